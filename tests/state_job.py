"""State that lives in DTensors, and refusals that name the thing: scenario after scenario in ONE 2-rank job.

    torchrun --standalone --nproc-per-node 2 tests/state_job.py WORK OUT

Each scenario runs in its own root WORK/<name>; every rank's figures are gathered to rank 0, which prints one line
"RESULT <json>" ({scenario: [rank 0's figures, rank 1's figures]}) at the end; tests/test_state.py asserts on it.
A scenario still running after SCENARIO_LIMIT seconds makes rank 0 print what it has (with "hung": name) and the
job exit at once, so the test names the scenario instead of waiting out its own timeout.
OUT receives multi_opt_ref.pt: the full parameters and optimizer state of the multi_opt checkpoint, for the test
that loads that checkpoint at world size 1.

tests/test_state.py imports build(), muon_adamw(), full(), Box and N from here (for the world-size-1 load);
tests/explicit_job.py its model, training step and run_scenarios().
"""

import time

STARTED = time.time()  # before torch is imported: the job's figures include the import

import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

import ckpt  # noqa: E402

SCENARIO_LIMIT = 40
N = 3  # steps trained before the save, and continued after it


class Net(torch.nn.Module):
    """2-D weights (for Muon), biases and a LayerNorm (for AdamW)."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.norm(self.a(x))))


def build(seed=0, dtype=None):
    torch.manual_seed(seed)
    model = Net()
    if dtype is not None:
        model.to(dtype)
    fully_shard(model.a)
    fully_shard(model)
    return model


def rank():
    return dist.get_rank()


def batch(i):
    """Step i's data on this rank: the same in an uninterrupted and a resumed run, whatever the global RNG."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * i + rank()))


def train_step(model, opts, i, after=None):
    loss = model(batch(i)).pow(2).mean()
    loss.backward()
    for opt in opts:
        opt.step()
    for opt in opts:
        opt.zero_grad()
    if after:
        after()
    return loss.item()


def muon_adamw(model):
    """Muon on the 2-D weight matrices, AdamW on the rest (biases, the LayerNorm)."""
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a, b):
    return max([(full(x).double() - full(y).double()).abs().max().item() for x, y in zip(a, b)] or [0.0])


def dloss(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def weights(model):
    return [p.detach() for p in model.parameters()]


class Box:
    """An extra whose state is whatever the scenario puts in it."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


class EMA:
    """An exponential moving average of the parameters. Lazy (the default): its shadow is empty until the first
    update, so it is empty when load() runs in a resumed job, and load() refuses it (a DTensor would come back as
    a plain tensor). eager=True: the shadow is built from the parameters at once (DTensors laid out like them),
    and load() reads into it."""

    def __init__(self, model, decay=0.9, eager=False):
        self.model, self.decay, self.updates = model, decay, 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()} if eager else {}

    def update(self):
        with torch.no_grad():
            if not self.shadow:
                self.shadow = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            else:
                for n, p in self.model.named_parameters():
                    self.shadow[n].lerp_(p.detach(), 1 - self.decay)
        self.updates += 1

    def state_dict(self):
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, sd):
        self.decay, self.updates, self.shadow = sd["decay"], sd["updates"], dict(sd["shadow"])


def outcome(fn):
    """Call fn (every rank together); {"raised": type or None, "msg": message, "value": its result}."""
    dist.barrier()
    try:
        value = fn()
    except BaseException as e:  # noqa: B036  (DCP raises a BaseException)
        return {"raised": type(e).__name__, "msg": str(e)}
    return {"raised": None, "msg": "", "value": value if isinstance(value, (int, str, type(None))) else repr(value)}


def listing(root):
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def layout(t):
    return {"type": type(t).__name__, "placements": str(t.placements) if isinstance(t, DTensor) else None,
            "mesh": str(t.device_mesh) if isinstance(t, DTensor) else None, "device": str(t.device),
            "shape": list(t.shape), "dtype": str(t.dtype)}


# ------------------------------------------------------------------------------------------ scenarios


def scen_multi_opt(root, out):
    """a. optimizer=[Muon, AdamW]: save at N, continue N steps; a fresh model and optimizers loaded from the
    checkpoint continue the same N steps. Rank 0 writes the saved full state for the world-size-1 load."""
    model = build(0)
    opts = muon_adamw(model)
    for i in range(N):
        train_step(model, opts, i)
    path = ckpt.save(root, N, model, opts)
    names = {p: n for n, p in model.named_parameters()}
    saved_state = {f"{names[p]}.{k}": full(v).clone() for opt in opts for p, s in opt.state.items()
                   for k, v in s.items()}
    ref = {"params": {n: full(p).detach().clone() for n, p in model.named_parameters()}, "state": saved_state}
    if rank() == 0:
        torch.save(ref, os.path.join(out, "multi_opt_ref.pt"))
    losses = [train_step(model, opts, i) for i in range(N, 2 * N)]

    fresh = build(1)
    fresh_opts = muon_adamw(fresh)
    loaded = ckpt.load(root, fresh, fresh_opts)
    fnames = {p: n for n, p in fresh.named_parameters()}
    state = {f"{fnames[p]}.{k}": v for opt in fresh_opts for p, s in opt.state.items() for k, v in s.items()}
    keys = sorted(state)
    moments = max_diff([state[k] for k in keys], [saved_state[k] for k in keys]) if keys == sorted(saved_state) \
        else None
    kinds = {f"{type(opt).__name__}": sorted({k for s in opt.state.values() for k in s}) for opt in fresh_opts}
    resumed = [train_step(fresh, fresh_opts, i) for i in range(N, 2 * N)]
    return {"path": path, "loaded": loaded, "losses": losses, "resumed": resumed, "dloss": dloss(losses, resumed),
            "moments_diff_after_load": moments, "state_keys": keys, "saved_keys": sorted(saved_state),
            "kinds": kinds, "weights_diff_end": max_diff(weights(model), weights(fresh))}


def scen_ema(root, out):
    """b. An EMA of the sharded parameters, built lazily in the saving run. Resumed into a lazy EMA (empty when
    load() runs): refused by name. Resumed into an eager one (its shadows made from the parameters before load()):
    read into its own tensors."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = EMA(model)
    for i in range(N):
        train_step(model, [opt], i, ema.update)
    ckpt.save(root, N, model, opt, {"ema": ema})
    saved = {n: t.clone() for n, t in ema.shadow.items()}
    losses = [train_step(model, [opt], i, ema.update) for i in range(N, 2 * N)]

    lazy_model = build(1)
    lazy = EMA(lazy_model, decay=0.5)
    lazy_opt = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2)
    refused = outcome(lambda: ckpt.load(root, lazy_model, lazy_opt, {"ema": lazy}))
    refused["empty_after"] = lazy.shadow == {}

    fresh = build(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_ema = EMA(fresh, decay=0.5, eager=True)  # decay is restored too
    own = dict(fresh_ema.shadow)  # the tensors load() must read into
    loaded = ckpt.load(root, fresh, fresh_opt, {"ema": fresh_ema})
    params = dict(fresh.named_parameters())
    layouts = {n: layout(t) for n, t in fresh_ema.shadow.items()}
    same_layout = {n: isinstance(t, DTensor) and t.placements == params[n].placements
                   and t.device_mesh == params[n].device_mesh and t.shape == params[n].shape
                   and t.to_local().shape == params[n].to_local().shape for n, t in fresh_ema.shadow.items()}
    names = sorted(saved)
    vs_saved = max_diff([fresh_ema.shadow[n] for n in names], [saved[n] for n in names]) \
        if sorted(fresh_ema.shadow) == names else None
    meta = {"decay": fresh_ema.decay, "updates": fresh_ema.updates}
    resumed = [train_step(fresh, [fresh_opt], i, fresh_ema.update) for i in range(N, 2 * N)]
    return {"loaded": loaded, "refused": refused, "layouts": layouts, "same_layout": same_layout,
            "read_in_place": sorted(n for n, t in fresh_ema.shadow.items() if t is own.get(n)),
            "param_placements": {n: str(p.placements) for n, p in params.items()},
            "vs_saved": vs_saved, "meta": meta, "losses": losses, "resumed": resumed, "dloss": dloss(losses, resumed),
            "ema_diff_end": max_diff([fresh_ema.shadow[n] for n in names], [ema.shadow[n] for n in names]),
            "tensor_keys": sorted(k for k, md in ckpt.read_metadata(ckpt.find_checkpoint(root)).state_dict_metadata
                                  .items() if k.startswith("extra.ema.") and hasattr(md, "size"))}


def two_optimizers(model):
    return (torch.optim.AdamW(model.a.parameters(), lr=1e-2),
            torch.optim.AdamW([*model.norm.parameters(), *model.b.parameters()], lr=1e-2))


def scen_optimizer_extra(root, out):
    """c. A second optimizer passed as an entry of extra; in the resumed job it has not stepped yet (empty
    state) when load() runs."""
    model = build(0)
    opt, other = two_optimizers(model)
    for i in range(N):
        train_step(model, [opt, other], i)
    ckpt.save(root, N, model, opt, {"other": other})
    losses = [train_step(model, [opt, other], i) for i in range(N, 2 * N)]

    fresh = build(1)
    fresh_opt, fresh_other = two_optimizers(fresh)
    empty_at_load = len(fresh_other.state) == 0
    loaded = ckpt.load(root, fresh, fresh_opt, {"other": fresh_other})
    names = {p: n for n, p in fresh.named_parameters()}
    # Optimizer.load_state_dict() maps the saved state to the parameters by its int keys: a key that came back
    # as anything else stays in .state unmapped, and the next step starts that parameter's moments from zero.
    unmapped = [repr(p) for p in fresh_other.state if p not in names]
    types = {f"{names[p]}.{k}": layout(v) for p, s in fresh_other.state.items() if p in names for k, v in s.items()}
    placed = {f"{names[p]}.{k}": v.placements == p.placements for p, s in fresh_other.state.items() if p in names
              for k, v in s.items() if isinstance(v, DTensor)}
    resumed, error = [], None
    try:
        resumed = [train_step(fresh, [fresh_opt, fresh_other], i) for i in range(N, 2 * N)]
    except Exception as e:  # "mixed torch.Tensor and DTensor" if the moments came back as plain tensors
        error = f"{type(e).__name__}: {e}"
    return {"loaded": loaded, "empty_at_load": empty_at_load, "unmapped_keys": unmapped, "types": types,
            "placed_like_param": placed, "params_with_state": sorted(names[p] for p in fresh_other.state if p in names),
            "step_error": error, "losses": losses, "resumed": resumed,
            "dloss": dloss(losses, resumed) if not error else None}


def scen_mixed_extra(root, out):
    """d. One extra holding DTensors keyed by their parameters' names (in a dict, a list, a tuple) and plain
    tensors, beside a PerRank extra whose values differ between ranks. Loaded first into an object that holds none
    of its tensors (refused: a DTensor would come back plain), then into one that holds its DTensors, one of them
    laid out otherwise than its parameter (Replicate): each comes back laid out like the object's own tensor."""
    model = build(0)
    with torch.no_grad():
        shared = {"a.weight": model.a.weight.detach() * 2,
                  "nested": [{"b.weight": model.b.weight.detach().clone()}, {"plain": torch.arange(6.0).reshape(2, 3)}],
                  "tup": ({"norm.weight": model.norm.weight.detach() + 1}, torch.tensor([1, 2], dtype=torch.int32)),
                  "cfg": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu")}}
        own = {"rank": rank(), "per_rank_t": torch.full((3,), float(rank()))}
    path = ckpt.save(root, 1, model, None, {"mixed": Box(shared), "own": ckpt.PerRank(Box(own))})
    keys = sorted(k for k in ckpt.read_metadata(path).state_dict_metadata if k.split(".")[0] in ("extra", "rank")
                  and ".rng." not in k)
    fresh = build(1)
    missing = outcome(lambda: ckpt.load(root, fresh, None, {"mixed": Box({}), "own": ckpt.PerRank(Box({}))}))
    mesh = fresh.a.weight.device_mesh
    with torch.no_grad():  # the object's own tensors at load; the plain ones it lacks come back as saved
        mine = {".shared.a.weight": distribute_tensor(torch.zeros(16, 8), mesh, [Replicate()]),
                ".shared.nested.0.b.weight": torch.zeros_like(fresh.b.weight),
                ".shared.tup.0.norm.weight": torch.zeros_like(fresh.norm.weight)}
    box = Box({"a.weight": mine[".shared.a.weight"], "nested": [{"b.weight": mine[".shared.nested.0.b.weight"]}],
               "tup": ({"norm.weight": mine[".shared.tup.0.norm.weight"]},)})
    own_box = Box({})
    loaded = ckpt.load(root, fresh, None, {"mixed": box, "own": ckpt.PerRank(own_box)})
    state, got, problems, leaves = {"shared": shared, "own": own}, {"shared": box.state, "own": own_box.state}, [], {}

    def compare(path, a, b):
        if type(a) is not type(b):
            problems.append(f"{path}: {type(a).__name__} saved, {type(b).__name__} loaded")
        elif isinstance(a, dict):
            if list(a) != list(b):
                problems.append(f"{path}: keys {list(a)} saved, {list(b)} loaded")
            for k in a:
                if k in b:
                    compare(f"{path}.{k}", a[k], b[k])
        elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
            if len(a) != len(b):
                problems.append(f"{path}: {len(a)} items saved, {len(b)} loaded")
            for i, (x, y) in enumerate(zip(a, b)):
                compare(f"{path}.{i}", x, y)
        elif isinstance(a, torch.Tensor):
            expected = layout(mine[path]) if path in mine else layout(a)  # the object's own, else as saved
            leaves[path] = {"saved": layout(a), "loaded": layout(b), "diff": max_diff([a], [b]),
                            "read_in_place": b is mine.get(path)}
            if layout(b) != expected or leaves[path]["diff"] != 0:
                problems.append(f"{path}: {leaves[path]}, expected {expected}")
        elif a != b:
            problems.append(f"{path}: {a!r} saved, {b!r} loaded")

    compare("", state, got)
    return {"missing": missing, "loaded": loaded, "keys": keys, "problems": problems, "leaves": leaves,
            "rank_value": own_box.state.get("rank") if isinstance(own_box.state, dict) else None}


def scen_unplaceable(root, out):
    """e. A DTensor laid out like no model parameter: Replicate() on the mesh; Shard(0) of another shape. Saved
    under its own key; loaded into an object without it (refused by name), then into one holding a tensor of its
    shape laid out the same way (read into it)."""
    model, fresh = build(0), build(1)
    mesh = model.a.weight.device_mesh
    cases = {"replicated": ((16, 8), [Replicate()]), "reshaped": ((6, 8), [Shard(0)])}
    res = {}
    for name, (shape, placements) in cases.items():
        sub = os.path.join(root, name)
        value = distribute_tensor(torch.arange(float(shape[0] * shape[1])).reshape(shape), mesh, placements)
        r = {"saved": outcome(lambda: ckpt.save(sub, 1, model, None, {name: Box({"keep": 1, "w": value})}))}
        r["committed"] = ckpt.committed_steps(sub)
        r["missing"] = outcome(lambda: ckpt.load(sub, fresh, None, {name: Box({"keep": 0})}))
        holder = Box({"keep": 0, "w": distribute_tensor(torch.zeros(shape), mesh, placements)})
        own = holder.state["w"]
        r["loaded"] = outcome(lambda: ckpt.load(sub, fresh, None, {name: holder}))
        w = holder.state["w"]
        r.update(keep=holder.state["keep"], layout=layout(w), saved_layout=layout(value), read_in_place=w is own,
                 diff=max_diff([value], [w]))
        res[name] = r
    return res


def scen_optimizer_refusals(root, out):
    """f. Optimizer state beyond tensors and numbers: a None momentum buffer (SGD, second in the list) round-trips;
    LBFGS's state, beside its lists of past directions, holds each rank's own loss (prev_loss: each rank's batch),
    stored once in its group's value: refused by key."""
    model = build(0)
    adam = torch.optim.AdamW(model.a.parameters(), lr=1e-2)
    sgd = torch.optim.SGD([*model.norm.parameters(), *model.b.parameters()], lr=0.1, momentum=0.9)
    for i in range(2):
        train_step(model, [adam, sgd], i)
    sgd.state[model.b.weight]["momentum_buffer"] = None  # what SGD itself holds for a parameter it skipped
    sub = os.path.join(root, "sgd")
    saved = outcome(lambda: ckpt.save(sub, 2, model, [adam, sgd]))
    fresh = build(1)
    fresh_adam = torch.optim.AdamW(fresh.a.parameters(), lr=1e-2)
    fresh_sgd = torch.optim.SGD([*fresh.norm.parameters(), *fresh.b.parameters()], lr=0.1, momentum=0.9)
    loaded = outcome(lambda: ckpt.load(sub, fresh, [fresh_adam, fresh_sgd]))
    names, fresh_names = {p: n for n, p in model.named_parameters()}, {p: n for n, p in fresh.named_parameters()}
    before = {names[p]: s["momentum_buffer"] for p, s in sgd.state.items()}
    after = {fresh_names[p]: s["momentum_buffer"] for p, s in fresh_sgd.state.items()}
    buffers = {n: None if after.get(n) is None else max_diff([before[n]], [after[n]]) for n in sorted(before)}
    res = {"sgd": dict(saved, listing=listing(sub), loaded=loaded, buffers=buffers,
                       none_kept=before["b.weight"] is None and after.get("b.weight", 0) is None)}

    model = build(0)
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2, history_size=3)
    x = batch(0)

    def closure():
        lbfgs.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    lbfgs_error = None
    try:
        for _ in range(2):
            lbfgs.step(closure)
    except Exception as e:
        lbfgs_error = f"{type(e).__name__}: {e}"
    names = {p: n for n, p in model.named_parameters()}
    held = {names[p]: {k: type(v).__name__ for k, v in s.items()} for p, s in lbfgs.state.items()}
    sub = os.path.join(root, "lbfgs")
    r = outcome(lambda: ckpt.save(sub, 2, model, lbfgs))
    res["lbfgs"] = dict(r, listing=listing(sub), state_types=held, step_error=lbfgs_error)
    return res


def scen_dtype(root, out):
    """g. A float32 checkpoint loaded (weights only) into the same model cast to bf16."""
    model = build(0)
    ckpt.save(root, 1, model, None)
    bf16 = build(0, dtype=torch.bfloat16)
    before = [full(p).clone() for p in bf16.parameters()]
    r = outcome(lambda: ckpt.load(root, bf16, None))
    r["dtypes"] = sorted({str(p.dtype) for p in bf16.parameters()})
    r["weights_changed"] = max_diff(before, list(bf16.parameters()))
    return r


def scen_summary_mismatch(root, out):
    """i. After load(), a parameter's optimizer state is at another step than the one saved under its name."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        train_step(model, [opt], i)
    ckpt.save(root, 2, model, opt)
    out = {}
    for case in ("step", "swapped"):
        fresh = build(1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        torch_load = fresh_opt.load_state_dict

        def misplacing(state_dict):  # a bug in a custom optimizer, or in the id mapping of a future torch: what
            torch_load(state_dict)  # the check after load() exists for
            a, b = (fresh_opt.state[p] for p in fresh_opt.param_groups[0]["params"][:2])  # a.weight, a.bias
            if case == "step":  # a.weight's state at another step
                a["step"] = torch.tensor(7.0)
            else:  # the first two parameters' moments swapped, their keys and steps alike
                a["exp_avg_sq"], b["exp_avg_sq"] = b["exp_avg_sq"], a["exp_avg_sq"]
        fresh_opt.load_state_dict = misplacing
        out[case] = outcome(lambda: ckpt.load(root, fresh, fresh_opt))
    return out


def scen_same_and_older_step(root, out):
    """h. save() of the step just loaded, with other state, replaces it (sync, then async); an older one is
    refused."""
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        train_step(model, [opt], i)
    ckpt.save(root, 2, model, opt)
    for i in range(2, 3):
        train_step(model, [opt], i)
    path3 = ckpt.save(root, 3, model, opt)
    fresh = build(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    res = {"loaded": ckpt.load(root, fresh, fresh_opt)}

    def saved_weights():
        probe = build(2)
        ckpt.load(path3, probe, None)
        return [full(p).clone() for p in probe.parameters()]

    train_step(fresh, [fresh_opt], 3)  # another step, without advancing the step counter
    same = outcome(lambda: ckpt.save(root, 3, fresh, fresh_opt))
    res["sync_vs_live"] = max_diff(saved_weights(), [full(p) for p in fresh.parameters()])
    train_step(fresh, [fresh_opt], 4)
    pending = ckpt.save(root, 3, fresh, fresh_opt, async_save=True)
    same_async = {"path": pending.wait(), "done": pending.done()}
    res["async_vs_live"] = max_diff(saved_weights(), [full(p) for p in fresh.parameters()])
    older = outcome(lambda: ckpt.save(root, 2, fresh, fresh_opt))
    res.update(path3=path3, same=same, same_async=same_async, older=older, dirs=listing(root))
    return res


ORDER = ["multi_opt", "ema", "optimizer_extra", "mixed_extra", "unplaceable", "optimizer_refusals", "dtype",
         "summary_mismatch", "same_and_older_step"]


def run_scenarios(scenarios, results):
    """Run each scenario (name: a function) on every rank, gather every rank's figures into results[name], and print
    results as one RESULT line from rank 0. A scenario still running after SCENARIO_LIMIT s ends the job (exit 3)."""
    def report():
        print("RESULT " + json.dumps(results, default=str), flush=True)

    def hung(name):
        if rank() == 0:
            results["hung"] = name
            report()
        print(f"rank {rank()}: scenario {name} still running after {SCENARIO_LIMIT} s: giving up", flush=True)
        os._exit(3)

    for name, fn in scenarios.items():
        timer = threading.Timer(SCENARIO_LIMIT, hung, (name,))
        timer.start()
        t0 = time.monotonic()
        try:
            mine = fn()
        except BaseException as e:  # noqa: B036  (recorded; the test names the scenario)
            mine = {"unexpected": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        mine["secs"] = round(time.monotonic() - t0, 2)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        timer.cancel()
        results[name] = every
    results["timing"]["scenarios_s"] = round(time.time() - STARTED - results["timing"]["import_s"], 2)
    results["done"] = True
    if rank() == 0:
        report()


def main(order=ORDER, scope=None):
    """Runs the scenarios named in order, scen_<name>() of scope (this module's globals, or another job's)."""
    work, out, scope = sys.argv[1], sys.argv[2], scope or globals()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    os.makedirs(out, exist_ok=True)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    results = {"timing": {"import_s": round(time.time() - STARTED, 2)}}
    scenarios = {name: lambda name=name: scope[f"scen_{name}"](os.path.join(work, name), out) for name in order}
    try:
        run_scenarios(scenarios, results)
    finally:
        ckpt.close()
        gc.collect()  # the README's teardown (Supported setups)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
