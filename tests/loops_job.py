"""The training loops users write, checkpointed with ckpt.py: the jobs behind tests/test_loops.py.

    python tests/loops_job.py plain-save DIR        # a plain process: no process group, a plain nn.Module
    python tests/loops_job.py plain-load DIR        # another plain process loads what plain-save wrote
    torchrun --standalone --nproc-per-node 2 tests/loops_job.py ranks WORK PLAIN_DIR

`ranks` runs several scenarios in ONE 2-rank FSDP2 job, each in its own root WORK/<name>: saves at step 0 and
before the first optimizer step (AdamW, SGD with momentum, [Muon, AdamW]), the same step saved twice, values
stored once that differ between ranks, and the plain process's checkpoint loaded at world size 2. Every rank's
figures are gathered to rank 0, which prints one line "RESULT <json>" ({scenario: [rank 0's, rank 1's]}). The
plain modes print one RESULT line each. A scenario still running after SCENARIO_LIMIT seconds makes rank 0 print
what it has (with "hung": name) and the job exit, so that the test names it instead of waiting out its timeout.
"""

import time

STARTED = time.time()

import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import ckpt  # noqa: E402
from tests import state_job  # noqa: E402

SCENARIO_LIMIT = 40
STEPS, EVERY = 4, 2  # the loop: `if step % EVERY == 0: save` at the top of each of STEPS iterations
BRANCH_FROM = 3  # aux gets its first gradient at this step: at the save of step 2 it has no optimizer state


class Net(torch.nn.Module):
    """2-D weights (for Muon), biases, a LayerNorm, and `aux`, a branch used only from step BRANCH_FROM on."""

    def __init__(self, stats=False):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        self.aux = torch.nn.Linear(4, 4)
        if stats:  # a running mean of the inputs, updated from this rank's batch alone (never all-reduced)
            self.stats = torch.nn.Module()
            self.stats.register_buffer("running_mean", torch.zeros(8))

    def forward(self, x, branch=False):
        if hasattr(self, "stats"):
            with torch.no_grad():
                self.stats.running_mean.lerp_(x.mean(0), 0.1)
        y = self.b(torch.relu(self.norm(self.a(x))))
        return self.aux(y) if branch else y


def build(seed=0, fsdp=True, stats=False):
    torch.manual_seed(seed)
    model = Net(stats)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a)
        fully_shard(model)
    return model


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def batch(i):
    """Step i's data on this rank: the same in every run, whatever the global generator."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * i + rank()))


def train_step(model, opts, i):
    loss = model(batch(i), branch=i >= BRANCH_FROM).pow(2).mean()
    loss.backward()
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad()
    return loss.item()


OPTIMIZERS = {
    "adamw": lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)],
    "sgd_momentum": lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True)],
    "muon_adamw": lambda m: [torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
                             torch.optim.AdamW([p for p in m.parameters() if p.ndim != 2], lr=1e-2)],
}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def weights(model):
    """{name: full tensor} (collective under FSDP2)."""
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def opt_values(model, opts, gather=full):
    """Every value of the optimizers: {opt.<i>.<param name>.<key>: value} for each parameter's state (in parameter
    order, so that every rank gathers the same DTensors in the same order), {opt.<i>.group<g>.<option>: value}."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for i, opt in enumerate(opts):
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                for k, v in sorted(opt.state.get(p, {}).items()):
                    out[f"opt.{i}.{names[p]}.{k}"] = gather(v).clone() if isinstance(v, torch.Tensor) else v
            out.update({f"opt.{i}.group{g}.{k}": v for k, v in group.items() if k != "params"})
    return out


def with_state(model, opts):
    names = {p: n for n, p in model.named_parameters()}
    return sorted(names[p] for opt in opts for p in opt.state)


def diff(a, b):
    """max |a - b| over the keys of a and b (inf where a key is missing on one side or a non-tensor differs)."""
    worst = 0.0
    for k in set(a) | set(b):
        x, y = a.get(k), b.get(k)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape:
            d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        else:
            d = 0.0 if type(x) is type(y) and x == y else float("inf")
        worst = max(worst, d)
    return worst


def dloss(a, b):
    return max([abs(x - y) for x, y in zip(a, b, strict=True)] or [0.0])


def listing(root):
    return sorted(n for n in os.listdir(root) if n != ckpt.OWNER) if os.path.isdir(root) else []


def outcome(fn):
    """fn() on every rank together: {"raised": type or None, "msg": message, "secs": seconds}."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn()
        raised, msg = None, ""
    except BaseException as e:  # noqa: B036  (DCP raises a BaseException)
        raised, msg = type(e).__name__, str(e)
    return {"raised": raised, "msg": msg, "secs": round(time.monotonic() - t0, 3)}


# ------------------------------------------------------------------------ 1. saves at step 0, in a loop


def loop(model, opts, start, root, record):
    """The user's loop: `if step % EVERY == 0: save` at the top of each iteration, before that step's optimizer
    step (so step 0 is saved before the first one). Each save is checked to leave the optimizer state exactly as
    it was: the same parameters with state, every value (this rank's shard) and every option bit for bit."""
    losses = []
    for step in range(start, STEPS):
        if root is not None and step % EVERY == 0:
            before, had = opt_values(model, opts, local), with_state(model, opts)
            path = ckpt.save(root, step, model, opts)
            after = opt_values(model, opts, local)
            record.append({"step": step, "path": os.path.basename(path), "with_state": had,
                           "same_params_with_state": with_state(model, opts) == had,
                           "same_keys": sorted(before) == sorted(after), "max_dstate": diff(before, after)})
        losses.append(train_step(model, opts, step))
    return losses


def scen_step0(work):
    res = {}
    for kind, make in OPTIMIZERS.items():
        root = os.path.join(work, kind)
        ref_model = build(0)
        ref_opts = make(ref_model)
        ref_losses = loop(ref_model, ref_opts, 0, None, [])
        ref = {"w": weights(ref_model), "opt": opt_values(ref_model, ref_opts)}

        model = build(0)
        opts = make(model)
        saves = []
        losses = loop(model, opts, 0, root, saves)
        r = {"saves": saves, "dloss": dloss(ref_losses, losses), "dweights": diff(ref["w"], weights(model)),
             "dopt": diff(ref["opt"], opt_values(model, opts)), "n_opt_values": len(ref["opt"]),
             "ref_with_state": with_state(ref_model, ref_opts)}

        # A resume as users write it: step = load(root) (the newest, step 2), then the same loop with its saves
        # (the first saves again the step just loaded). Then a rollback to step 0: load(step-0), said
        # (check_root(rollback_to=0): step 2 is moved aside), the same loop.
        for name, path, start in (("resume2", root, 2), ("resume0", ckpt.step_dir(root, 0), 0)):
            fresh = build(1)  # other weights: only the load makes them equal
            fresh_opts = make(fresh)
            loaded = ckpt.load(path, fresh, fresh_opts)
            if name == "resume0":
                ckpt.check_root(root, fresh, rollback_to=0)
            at_load = with_state(fresh, fresh_opts)
            resaves = []
            resumed = loop(fresh, fresh_opts, start, root, resaves)
            r[name] = {"loaded": loaded, "with_state_at_load": at_load, "saves": resaves,
                       "dloss": dloss(ref_losses[start:], resumed), "dweights": diff(ref["w"], weights(fresh)),
                       "dopt": diff(ref["opt"], opt_values(fresh, fresh_opts)), "losses": resumed}
        r.update(losses=losses, ref_losses=ref_losses, listing=listing(root))
        res[kind] = r
    # Control: torch's get_optimizer_state_dict on an optimizer without state runs a step with lr 0 to make it (what
    # ckpt.py used before): the checks above see that, as parameters given state by the save.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = build(0)
    opts = OPTIMIZERS["adamw"](model)
    before = with_state(model, opts)
    get_optimizer_state_dict(model, opts[0])
    res["control"] = {"before": before, "after": with_state(model, opts),
                      "steps": sorted({float(s["step"]) for s in opts[0].state.values() if "step" in s})}
    return res


# --------------------------------------------------------------------- 3. the same step saved twice


def snapshot(model, opts):
    return {**{f"w.{k}": v for k, v in weights(model).items()}, **opt_values(model, opts)}


def scen_same_step(work):
    root = os.path.join(work, "twice")
    model = build(0)
    opts = OPTIMIZERS["adamw"](model)
    for i in range(5):
        train_step(model, opts, i)
    first_path = ckpt.save(root, 5, model, opts)
    first = snapshot(model, opts)
    train_step(model, opts, 5)  # another optimizer step; the loop's counter stays at 5
    second = snapshot(model, opts)
    path = ckpt.save(root, 5, model, opts)
    fresh = build(1)
    fresh_opts = OPTIMIZERS["adamw"](fresh)
    loaded = ckpt.load(path, fresh, fresh_opts)
    got = snapshot(fresh, fresh_opts)
    res = {"first_path": first_path, "path": path, "loaded": loaded, "vs_second": diff(got, second),
           "vs_first": diff(got, first), "first_vs_second": diff(first, second), "n_values": len(got),
           "vs_first_weights": diff({k: v for k, v in got.items() if k.startswith("w.")},
                                    {k: v for k, v in first.items() if k.startswith("w.")}),
           "listing": listing(root)}

    # The common end of a loop: the periodic save fires at the last step, then the final save of the same state.
    for name, periodic_async in (("final_sync", False), ("final_async", True)):
        root = os.path.join(work, name)
        model = build(0)
        opts = OPTIMIZERS["adamw"](model)
        for i in range(4):
            train_step(model, opts, i)
        periodic = ckpt.save(root, 4, model, opts, async_save=periodic_async)
        final = ckpt.save(root, 4, model, opts)
        periodic = periodic.wait() if periodic_async else periodic
        state = snapshot(model, opts)
        fresh = build(1)
        fresh_opts = OPTIMIZERS["adamw"](fresh)
        loaded = ckpt.load(root, fresh, fresh_opts)
        res[name] = {"periodic": periodic, "final": final, "loaded": loaded, "listing": listing(root),
                     "committed": ckpt.committed_steps(root), "vs_state": diff(snapshot(fresh, fresh_opts), state)}
    return res


# ------------------------------------------------------- 4. values stored once that differ between ranks


def scen_refusals(work):
    res = {}
    model = build(0, stats=True)  # its running mean follows this rank's batches
    opts = OPTIMIZERS["adamw"](model)
    for i in range(2):
        train_step(model, opts, i)
    root = os.path.join(work, "buffer")
    res["buffer"] = dict(outcome(lambda: ckpt.save(root, 2, model, opts)), listing=listing(root),
                         exists=os.path.isdir(root), value=model.stats.running_mean.tolist())

    model = build(0)
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-2 * (1 + rank()))]  # an LR scaled by the rank, by mistake
    train_step(model, opts, 0)
    root = os.path.join(work, "lr")
    res["lr"] = dict(outcome(lambda: ckpt.save(root, 1, model, opts)), listing=listing(root),
                     exists=os.path.isdir(root))
    return res


# ------------------------------------------------------------ 6. a plain process's checkpoint at 2 ranks


def scen_plain_at_two(work, plain_dir):
    ref = torch.load(os.path.join(plain_dir, "ref.pt"), weights_only=True)
    root = os.path.join(plain_dir, "ckpt")
    model = build(1)
    loaded = ckpt.load(root, model)
    res = {"weights_only": {"loaded": loaded, "dweights": diff(ref["weights"], weights(model)),
                            "n": len(ref["weights"])}}
    # With the optimizer: its state comes back laid out like the parameters (DTensors), and training goes on.
    model = build(1)
    opts = OPTIMIZERS["adamw"](model)
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)  # made before load(), as at save()
    r = {}
    try:
        r["loaded"] = ckpt.load(root, model, opts, {"sched": sched, "position": Box({})})
        r["dweights"] = diff(ref["weights"], weights(model))
        r["dopt"] = diff(ref["opt"], opt_values(model, opts))
        moments = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in opts[0].state.get(p, {}).items()
                   if k != "step"}  # the step is a plain tensor in any case
        r["moment_types"] = sorted({type(v).__name__ for v in moments.values()})
        r["a.weight"] = {"param_local_shape": list(model.a.weight.to_local().shape),
                         "exp_avg": f"{type(moments['a.weight.exp_avg']).__name__} "
                                    f"{list(local(moments['a.weight.exp_avg']).shape)}"}
        r["with_state"] = with_state(model, opts)
        r["next_loss"] = train_step(model, opts, 3)
    except BaseException as e:  # noqa: B036
        r["error"] = f"{type(e).__name__}: {e}"
    res["with_optimizer"] = r
    return res


Box = state_job.Box  # an extra whose state is whatever the loop puts in it (a data position)


# ------------------------------------------------------------ 7. an evaluation copy beside the training run


def generators():
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def scen_eval_copy(work):
    """Training saves steps 1 and 2; an evaluation copy (another model) loads step 1, weights only; training goes on
    and saves step 3. Then the control: the training model itself loads step 1 with its optimizer; its save of step
    2 is refused (step 3 is later) until check_root(rollback_to=1) moves steps 2 and 3 aside."""
    root = os.path.join(work, "root")
    model = build(0)
    opts = OPTIMIZERS["adamw"](model)
    for i in (1, 2):
        train_step(model, opts, i)
        ckpt.save(root, i, model, opts)
    evaluation = build(7)
    before = generators()
    loaded = ckpt.load(ckpt.step_dir(root, 1), evaluation)
    after = generators()
    res = {"eval_loaded": loaded, "torch_rng_kept": torch.equal(before["torch"], after["torch"]),
           "python_rng_kept": before["python"] == after["python"]}
    train_step(model, opts, 3)
    res["save3"] = outcome(lambda: ckpt.save(root, 3, model, opts))
    res["after_save3"] = listing(root)
    res["rollback_loaded"] = ckpt.load(ckpt.step_dir(root, 1), model, opts)  # the control: this model goes back
    train_step(model, opts, 4)
    res["save2_unsaid"] = outcome(lambda: ckpt.save(root, 2, model, opts))
    res["after_unsaid"] = listing(root)
    res["rollback"] = outcome(lambda: ckpt.check_root(root, model, rollback_to=1))
    res["save2"] = outcome(lambda: ckpt.save(root, 2, model, opts))
    res["after_save2"] = listing(root)
    return res


class Counter(torch.utils.data.Sampler):
    """A sampler with a position: a Sampler is per rank by its type, whatever its state's value."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return iter(range(self.i, 100))

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = sd["i"]


def scen_per_rank(work):
    """Extras equal on every rank but declared per rank (a Sampler; ckpt.PerRank) are stored per rank, and an
    extra stored once that differs between ranks is refused naming the key and the ranks."""
    root = os.path.join(work, "root")
    model = build(0)
    sampler, position = Counter(), Box({"batches": 5})  # the same on both ranks
    sampler.i = 5
    path = ckpt.save(root, 1, model, None, {"sampler": sampler, "position": ckpt.PerRank(position)})
    keys = sorted(k for k in ckpt.read_metadata(path).state_dict_metadata if k.split(".")[0] in ("extra", "rank"))
    fresh, fresh_position = Counter(), Box({})
    ckpt.load(root, build(1), None, {"sampler": fresh, "position": ckpt.PerRank(fresh_position)})
    differing = outcome(lambda: ckpt.save(os.path.join(work, "differ"), 1, model, None, {"seen": Box({"n": rank()})}))
    meta = {"lr": 0.1, "arch": "x"} if rank() == 0 else {"arch": "x", "lr": 0.1}  # equal JSON, keys in other orders
    same_meta = outcome(lambda: ckpt.save(os.path.join(work, "meta"), 1, model, None, meta=meta))
    return {"keys": [k for k in keys if ".rng." not in k], "sampler_back": fresh.i,
            "position_back": fresh_position.state, "differing": differing, "same_meta": same_meta,
            "differ_listing": listing(os.path.join(work, "differ"))}


# ---------------------------------------------------------------------- plain processes (no process group)


def plain_save(d):
    """A plain nn.Module and AdamW (aux never gets a gradient, so it has no state), a scheduler and a data position;
    saved at step 3 without any process group. ref.pt holds what was saved, and the next 2 steps' losses."""
    model = build(0, fsdp=False)
    opts = OPTIMIZERS["adamw"](model)
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
    position = Box({"samples": 0})
    for i in range(3):
        train_step(model, opts, i % BRANCH_FROM)  # never the branch: aux stays without state
        sched.step()
        position.state = {"samples": position.state["samples"] + 4}
    t0 = time.monotonic()
    path = ckpt.save(os.path.join(d, "ckpt"), 3, model, opts, {"sched": sched, "position": position})
    secs = time.monotonic() - t0
    ref = {"weights": weights(model), "opt": opt_values(model, opts), "sched": sched.state_dict(),
           "position": dict(position.state), "with_state": with_state(model, opts)}
    ref["next_losses"] = [train_step(model, opts, i) for i in (0, 1)]
    torch.save(ref, os.path.join(d, "ref.pt"))
    ckpt.close()
    return {"path": path, "secs": round(secs, 3), "initialized": dist.is_initialized(),
            "manifest_world_size": ckpt.read_manifest(path)["world_size"], "with_state": ref["with_state"]}


def plain_load(d):
    """Another plain process: weights only; weights and extras; weights, optimizer and extras."""
    ref = torch.load(os.path.join(d, "ref.pt"), weights_only=True)
    root, res = os.path.join(d, "ckpt"), {}
    # First, before any load in this process: README's loop, as written there (check_root(), then load()).
    model = build(1, fsdp=False)
    opts = OPTIMIZERS["adamw"](model)
    sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
    try:  # the README's order: load (resume), then check_root (claim)
        step = ckpt.load(root, model, opts, {"sched": sched, "position": Box({})}) or 0
        ckpt.check_root(root, model)
        res["readme_order"] = {"step": step, "dweights": diff(ref["weights"], weights(model)), "error": None}
    except ckpt.CheckpointError as e:
        res["readme_order"] = {"step": None, "error": str(e)}
    ckpt.close()
    try:  # the other order, on the same root: refused, saying how to resume
        ckpt.check_root(root, model)
        res["claim_first"] = None
    except ckpt.CheckpointError as e:
        res["claim_first"] = str(e)
    ckpt.close()  # releases the claim, if it was taken
    for name in ("weights_only", "extras", "optimizer"):
        model = build(1, fsdp=False)
        opts = OPTIMIZERS["adamw"](model)
        sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
        extra = {"sched": sched, "position": Box({})} if name != "weights_only" else None
        t0 = time.monotonic()
        loaded = ckpt.load(root, model, opts if name == "optimizer" else None, extra)
        r = {"loaded": loaded, "secs": round(time.monotonic() - t0, 3)}
        r["dweights"] = diff(ref["weights"], weights(model))
        if extra:
            r["sched_equal"] = sched.state_dict() == ref["sched"]
            r["position"] = extra["position"].state
        if name == "optimizer":
            r["dopt"] = diff(ref["opt"], opt_values(model, opts))
            r["with_state"] = with_state(model, opts)
            r["dloss_next"] = dloss(ref["next_losses"], [train_step(model, opts, i) for i in (0, 1)])
        else:
            r["with_state"] = with_state(model, opts)  # nothing: the optimizer was not passed
        res[name] = r
    ckpt.close()
    return dict(res, initialized=dist.is_initialized())


# --------------------------------------------------------------------------------------------- main


def ranks(work, plain_dir):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank()}] %(message)s")
    results = {"timing": {"import_s": round(time.time() - STARTED, 2)}}
    scenarios = {"step0": lambda: scen_step0(os.path.join(work, "step0")),
                 "same_step": lambda: scen_same_step(os.path.join(work, "same_step")),
                 "refusals": lambda: scen_refusals(os.path.join(work, "refusals")),
                 "plain_at_two": lambda: scen_plain_at_two(work, plain_dir),
                 "eval_copy": lambda: scen_eval_copy(os.path.join(work, "eval_copy")),
                 "per_rank": lambda: scen_per_rank(os.path.join(work, "per_rank"))}

    try:
        state_job.run_scenarios(scenarios, results)
    finally:
        ckpt.close()
        gc.collect()  # the README's teardown (Supported setups)
        dist.destroy_process_group()


def main():
    mode = sys.argv[1]
    if mode == "ranks":
        return ranks(sys.argv[2], sys.argv[3])
    result = {"plain-save": plain_save, "plain-load": plain_load}[mode](sys.argv[2])
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
