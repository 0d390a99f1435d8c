"""The jobs of tests/test_exact.py (issue items 6-10), launched as ranks with torchrun's environment
(tests/launch.py) or as one plain process (no process group: ckpt works as a world of one).

    exact_job.py train OUT --root R [--resume] [--stop-after N] [--kill POINT --kill-step N]   (item 6)
    exact_job.py hold OUT --root R [--no-fork-hook]                                           (item 7)
    exact_job.py claim OUT --root R                                                           (item 7)
    exact_job.py scenarios OUT WORK [--only NAME ...]                                         (items 8, 9, 10)
    exact_job.py rollback-crash OUT --root R; exact_job.py rollback-next OUT --root R         (a rollback killed)

train: a user's loop (a small FSDP2 model with dropout, AdamW, a step counter as an extra) that saves every
--save-every steps (meta {"save": "periodic"}) and, at its last step, saves that step again (meta {"save":
"final"}): the common end of a loop, a re-save of step N. --kill makes rank 0 SIGKILL every rank at one point of
that re-save's commit: first_rename (the old copy moved to .replaced-, the new one still .tmp-), second_rename
(the new copy is step-N, before the root's fsync), after_fsync (fsynced, before the old copy is deleted).
Rank 0 logs each step to OUT/log.jsonl (loss, full weights' hash) and writes OUT/run.json.

hold: claims R (check_root), rank 0 forks a helper child that lives until OUT/release (at most 90 s), writes
OUT/ready.json, then every rank sleeps until the test SIGKILLs it. --no-fork-hook: os.register_at_fork is a
no-op before the claim (the control). claim: a new run's check_root of R, timed, into OUT/claim.json.

rollback-crash: saves steps 1-3, closes; resumes step 1 into a new model (its save of step 2 refused), then
check_root(rollback_to=1) with rank 0 SIGKILLing every rank right after the first rename to .abandoned- (OUT/
fired.json: the root then). rollback-next: the next run, load(root) with the optimizer, its claim, a save of
step 2, a reload; OUT/run.json.

scenarios: one scenario after another on the same ranks (as tests/failpath_job.py, whose patched(),
expect_failure() and recover() these are), each in its own root; OUT/results.<rank>.json holds every
scenario's figures. Also runs without a process group (WORLD_SIZE unset, or --plain): a plain process.
"""

import argparse
import datetime
import errno
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckpt  # noqa: E402
from tests import harness  # noqa: E402

SCENARIO_LIMIT = 60  # seconds; a scenario running longer is recorded as hung and the job exits
TIMEOUT = 60  # of every process group and checkpoint collective here: no test may hang
DECAY = ["a.weight", "b.weight"]
NO_DECAY = ["a.bias", "norm.weight", "norm.bias", "b.bias"]
OPTIONS = {"decay": {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)},
           "no_decay": {"lr": 3e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.2)  # draws from torch's generator: a resume must restore it

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def build(seed=0):
    """The model (FSDP2 under a process group, plain without); torch's generator then seeded per rank."""
    torch.manual_seed(seed)
    model = Net()
    if dist.is_initialized():
        fully_shard(model.a)
        fully_shard(model)
    torch.manual_seed(1000 + 10 * seed + rank())  # dropout and data differ per rank, as they do in training
    return model


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def weights(model):
    """sha256 of the full parameters, in order: the same on every rank (and in a plain process's model)."""
    flat = torch.cat([full(p).detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def opt_state(model, opt):
    """{parameter name: sha256 of its full optimizer state}: compared by name, whatever the groups' order."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        h = hashlib.sha256()
        for k in sorted(st):
            h.update(k.encode() + full(st[k]).detach().float().flatten().numpy().tobytes())
        out[names[p]] = h.hexdigest()[:16]
    return out


def loss_of(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return mean.item()


def listing(root):
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def write_json(path, obj):
    with open(path + ".part", "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".part", path)


class Progress:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


# ----------------------------------------------------------------------------------------- 6. train


def install_kill(point, step, out, pids):
    """Rank 0: SIGKILL every rank (a node lost) at `point` of the commit of the re-save of `step`."""
    tag = f"step-{step:08d}"

    def die(where, root):
        with open(os.path.join(out, "fired.part"), "w") as f:
            json.dump({"where": where, "listing": listing(root)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(out, "fired.part"), os.path.join(out, "fired.json"))
        sys.stdout.flush(), sys.stderr.flush()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def replaced_in(root):
        return any(n.startswith(f"{ckpt.REPLACED}{tag}-") for n in os.listdir(root))

    real_rename, real_fsync_dir = os.rename, ckpt.fsync_dir

    def rename(src, dst):
        real_rename(src, dst)
        src, root = os.fspath(src), os.path.dirname(os.fspath(dst))
        if point == "first_rename" and os.path.basename(dst).startswith(f"{ckpt.REPLACED}{tag}-"):
            die(f"renamed {os.path.basename(src)} to {os.path.basename(dst)}", root)
        if (point == "second_rename" and os.path.basename(src).startswith(f"{ckpt.TMP}{tag}-")
                and os.path.basename(dst) == tag and replaced_in(root)):
            die(f"renamed {os.path.basename(src)} to {tag}, the root not fsynced", root)

    def fsync_dir(path):
        real_fsync_dir(path)
        if point == "after_fsync" and os.path.isdir(os.path.join(path, tag)) and replaced_in(path):
            die(f"fsynced {path} after the renames, the old copy not deleted", path)

    os.rename, ckpt.fsync_dir = rename, fsync_dir  # ckpt calls os.rename: the os module's, patched here


def train(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if a.kill and rank() == 0:
        install_kill(a.kill, a.kill_step, a.out, pids)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    progress = Progress()
    extra = {"progress": progress}
    run = {"pids": pids, "saved": {}}
    if a.resume:
        chosen = ckpt.find_checkpoint(a.root)  # what load() chooses (rank 0 alone chooses: nothing else runs)
        run["chosen"] = os.path.basename(chosen)
        run["copy"] = ckpt.read_manifest(chosen)["meta"].get("save")  # which copy of the step: periodic or final
        run["resumed"] = ckpt.load(a.root, model, opt, extra, timeout=TIMEOUT)
    ckpt.check_root(a.root, model, timeout=TIMEOUT)
    run["after_claim"] = listing(a.root)
    log = open(os.path.join(a.out, "log.jsonl"), "a") if rank() == 0 else None
    while progress.step < a.steps:
        progress.step += 1
        g = torch.Generator().manual_seed(100 * progress.step + rank())  # the data: from (step, rank) alone
        loss = loss_of(model, torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        opt.step()
        opt.zero_grad()
        w = weights(model)
        if log:
            log.write(json.dumps({"step": progress.step, "loss": loss, "weights": w}) + "\n")
            log.flush()
        last = progress.step in (a.steps, a.stop_after)
        if progress.step % a.save_every == 0:
            ckpt.save(a.root, progress.step, model, opt, extra, keep=a.keep, meta={"save": "periodic"},
                      timeout=TIMEOUT)
            run["saved"][progress.step] = w
        if rank() == 0:
            write_json(os.path.join(a.out, "run.json"), run)
        if last:  # the loop's final save: the same step again when the periodic save just fired
            ckpt.save(a.root, progress.step, model, opt, extra, keep=a.keep, meta={"save": "final"}, timeout=TIMEOUT)
            break
    run["end"] = listing(a.root)
    if rank() == 0:
        write_json(os.path.join(a.out, "run.json"), run)
    ckpt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- 7. fork


def hold(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    model = build()
    if a.no_fork_hook:  # the control: ckpt's hook is never registered, so a forked child keeps the lock
        os.register_at_fork = lambda **kwargs: None
    ckpt.check_root(a.root, model, timeout=TIMEOUT)
    child = None
    if rank() == 0:
        child = os.fork()  # a helper forked without exec (as a DataLoader worker under fork is)
        if child == 0:
            deadline = time.monotonic() + 90
            while not os.path.exists(os.path.join(a.out, "release")) and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)
    dist.barrier()
    if rank() == 0:
        write_json(os.path.join(a.out, "ready.json"), {"pid": os.getpid(), "child": child})
    time.sleep(60)  # the test SIGKILLs this run long before
    os._exit(1)


def claim(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    model = build()
    t0, wall = time.monotonic(), time.time()
    try:
        ckpt.check_root(a.root, model, timeout=TIMEOUT)
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    res = {"error": error, "secs": round(time.monotonic() - t0, 3), "started": wall, "claimed_at": time.time(),
           "pid": os.getpid(), "listing": listing(a.root)}
    if rank() == 0:
        with open(os.path.join(a.root, ckpt.OWNER)) as f:
            res["owner"] = f.read()
        write_json(os.path.join(a.out, "claim.json"), res)
    ckpt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- a rollback killed mid-way


def rollback_crash(a):
    """Run 1 saves steps 1, 2, 3 and ends (close()). Run 2 (the same ranks) resumes step 1 (load() of
    step-00000001 with the optimizer): its save of step 2 is refused (step 3 would stay the newest), then
    check_root(rollback_to=1), and rank 0 SIGKILLs every rank right after the first rename to .abandoned- (the
    marker written, one later step moved, the other not)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = {"pids": pids, "saved": {}}
    for s in (1, 2, 3):
        step(model, opt)
        ckpt.save(a.root, s, model, opt, timeout=TIMEOUT)
        run["saved"][s] = weights(model)
    ckpt.close()  # run 1 ends
    model = build(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run["loaded"] = ckpt.load(ckpt.step_dir(a.root, 1), model, opt, timeout=TIMEOUT)
    run["loaded_weights"] = weights(model)
    step(model, opt)
    run["unsaid"] = expect_failure(lambda: ckpt.save(a.root, 2, model, opt, timeout=TIMEOUT))
    run["after_unsaid"] = listing(a.root)
    if rank() == 0:
        write_json(os.path.join(a.out, "run.json"), run)
        real_rename = os.rename

        def rename(src, dst):  # ckpt calls os.rename: the os module's, patched here
            real_rename(src, dst)
            if os.path.basename(os.fspath(dst)).startswith(ckpt.ABANDONED):
                root = os.path.dirname(os.fspath(dst))
                write_json(os.path.join(a.out, "fired.json"), {"moved": [os.path.basename(os.fspath(src)),
                                                                          os.path.basename(os.fspath(dst))],
                                                               "listing": listing(root)})
                sys.stdout.flush(), sys.stderr.flush()
                for pid in pids[1:]:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

        os.rename = rename
    barrier()
    ckpt.check_root(a.root, model, rollback_to=1, timeout=TIMEOUT)
    run["check_root_returned"] = True  # never, if the kill fired
    if rank() == 0:
        write_json(os.path.join(a.out, "run.json"), run)
    ckpt.close()
    dist.destroy_process_group()


def rollback_next(a):
    """The next run after the killed rollback: load(root) with the optimizer (before any claim), then its claim
    (check_root(), no rollback_to) finishes the moves; then it trains, saves step 2, and a fresh model loads it."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    LOG.lines.clear()
    logging.getLogger("ckpt").addHandler(LOG)
    model = build(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = {"chosen": os.path.basename(ckpt.find_checkpoint(a.root) or "")}
    run["loaded"] = ckpt.load(a.root, model, opt, timeout=TIMEOUT)
    run["loaded_weights"] = weights(model)
    run["before_claim"] = listing(a.root)
    run["claim"] = expect_failure(lambda: ckpt.check_root(a.root, model, timeout=TIMEOUT))
    run["moved"] = [ln for ln in LOG.lines if "moved aside" in ln]
    run["after_claim"] = listing(a.root)
    step(model, opt)
    run["save2"] = expect_failure(lambda: run.update(path2=os.path.basename(ckpt.save(a.root, 2, model, opt,
                                                                                      timeout=TIMEOUT))))
    run["saved2"] = weights(model)
    fresh = build(seed=3)
    run["reload"] = ckpt.load(a.root, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), timeout=TIMEOUT)
    run["reload_weights"] = weights(fresh)
    run["committed"], run["end"] = ckpt.committed_steps(a.root), listing(a.root)
    if rank() == 0:
        write_json(os.path.join(a.out, "run.json"), run)
    ckpt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ 8-10. scenarios


LOG = harness.Lines()


def patched(name, on_rank, fake):
    """Replace ckpt.<dotted name> on one rank (None: every rank) while the call runs (harness.Patched)."""
    return harness.Patched(ckpt, name, on_rank is None or rank() == on_rank, fake)


def expect_failure(fn):
    """tests/failpath_job.py's: every rank starts together; how the call ended and this rank's seconds."""
    barrier()
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: B036
        return {"raised": type(e).__name__, "msg": str(e), "secs": round(time.monotonic() - t0, 3)}
    return {"raised": None, "msg": "", "secs": round(time.monotonic() - t0, 3)}


def eio(what):
    return OSError(errno.EIO, f"Input/output error ({what}, injected)")


def raiser(exc):
    def fake(*args, **kwargs):
        raise exc
    return fake


def step(model, opt):
    loss = loss_of(model, torch.randn(4, 8), torch.randn(4, 4))  # data and dropout from torch's generator
    opt.step()
    opt.zero_grad()
    return loss


def adamw(model, groups):
    """AdamW over groups: [(option set, [parameter names])], in that order."""
    named = dict(model.named_parameters())
    return torch.optim.AdamW([{"params": [named[n] for n in names], **OPTIONS[kind]} for kind, names in groups])


def committed_fsync_fails(root, async_save=False):
    """8. The root's fsync after the commit's rename fails on rank 0."""
    model = build()
    opt = adamw(model, [("decay", DECAY), ("no_decay", NO_DECAY)])
    step(model, opt)
    ckpt.save(root, 1, model, opt, timeout=TIMEOUT)
    step(model, opt)
    saved = weights(model)
    raised = []

    def failing(path):
        if os.path.realpath(path) == os.path.realpath(root) and os.path.isdir(ckpt.step_dir(root, 2)):
            raised.append(listing(root))
            raise eio(f"fsync of {path}")
        return ckpt_fsync_dir(path)

    ckpt_fsync_dir = ckpt.fsync_dir
    out = {}
    LOG.lines.clear()

    def save2():
        got = ckpt.save(root, 2, model, opt, timeout=TIMEOUT, async_save=async_save)
        out["path"] = got.wait() if async_save else got

    with patched("fsync_dir", 0, failing):
        out["save"] = expect_failure(save2)
    out["raised_on_rank"] = {"count": len(raised), "listing": raised}
    out["warnings"] = [ln for ln in LOG.lines if "fsync" in ln]
    out["after"] = listing(root)
    out["found"] = os.path.basename(ckpt.find_checkpoint(root) or "")
    fresh = build(seed=3)
    out["load"] = ckpt.load(root, fresh, timeout=TIMEOUT)
    out["load_weights_equal"] = weights(fresh) == saved
    step(model, opt)
    LOG.lines.clear()
    out["save3"] = expect_failure(lambda: out.update(path3=ckpt.save(root, 3, model, opt, timeout=TIMEOUT)))
    out["moved_aside_log"] = [ln for ln in LOG.lines if "moved aside" in ln]
    out["end"] = listing(root)
    out["committed"] = ckpt.committed_steps(root)
    return out


def scen_root_fsync_fails(root):
    return committed_fsync_fails(root)


def scen_root_fsync_fails_async(root):
    return committed_fsync_fails(root, async_save=True)


def groups_summary(model, opt):
    """Each group of opt, in its order: its parameters by name, its options, its parameters' AdamW steps."""
    names = {p: n for n, p in model.named_parameters()}
    def steps(group):  # none before the first step, or after a refused load
        return sorted({float(opt.state[p]["step"]) for p in group["params"] if "step" in opt.state.get(p, {})})
    return [{"params": [names[p] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"],
             "betas": list(g["betas"]), "steps": steps(g)} for g in opt.param_groups]


def scen_groups(root):
    """9. Saved with [decay, no_decay]: loaded into the same groups, each listing its parameters in another order;
    into [no_decay, decay]; and with a parameter moved between groups."""
    model = build()
    opt = adamw(model, [("decay", DECAY), ("no_decay", NO_DECAY)])
    for _ in range(2):
        step(model, opt)
    ckpt.save(root, 2, model, opt, timeout=TIMEOUT)
    saved_groups = groups_summary(model, opt)
    ref = {"losses": [step(model, opt) for _ in range(3)]}
    ref.update(weights=weights(model), opt=opt_state(model, opt), groups=groups_summary(model, opt))

    out = {"saved_groups": saved_groups, "ref": ref}
    other = build(seed=6)
    out["reordered"] = expect_failure(lambda: ckpt.load(root, other, adamw(other, [("no_decay", NO_DECAY),
                                                                                  ("decay", DECAY)]), timeout=TIMEOUT))
    fresh = build(seed=5)
    shuffled = adamw(fresh, [("decay", DECAY[::-1]), ("no_decay", NO_DECAY[::-1])])  # torch numbers them otherwise
    out["load"] = expect_failure(lambda: out.update(loaded=ckpt.load(root, fresh, shuffled, timeout=TIMEOUT)))
    out["loaded_groups"] = groups_summary(fresh, shuffled)
    got = {"losses": [step(fresh, shuffled) for _ in range(3)]}
    got.update(weights=weights(fresh), opt=opt_state(fresh, shuffled), groups=groups_summary(fresh, shuffled))
    out["resumed"] = got
    # A group holding other parameters: b.weight moved from decay to no_decay, at its end or at its front.
    moved = [n for n in DECAY if n != "b.weight"]
    for where, no_decay in (("end", NO_DECAY + ["b.weight"]), ("front", ["b.weight"] + NO_DECAY)):
        other = build(seed=6)
        wrong = adamw(other, [("no_decay", no_decay), ("decay", moved)])
        out[f"moved_{where}"] = expect_failure(lambda: ckpt.load(root, other, wrong, timeout=TIMEOUT))
        out[f"moved_{where}"]["groups"] = [g["params"] for g in groups_summary(other, wrong)]
    return out


def scen_groups_scheduler(root):
    """9, with what a run has beside its optimizer: a LambdaLR over it, saved as an extra. Each step's lr per
    option set (by the group's parameters), then the loss; the uninterrupted run, then the reordered resume."""
    def run(model, opt, steps):
        sched = scheds[id(opt)]
        out = []
        for _ in range(steps):
            loss = step(model, opt)
            sched.step()
            names = {p: n for n, p in model.named_parameters()}
            out.append({"loss": loss, "lr": {names[g["params"][0]]: g["lr"] for g in opt.param_groups}})
        return out

    scheds = {}

    def with_sched(opt):
        scheds[id(opt)] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return scheds[id(opt)]

    model = build()
    opt = adamw(model, [("decay", DECAY), ("no_decay", NO_DECAY)])
    sched = with_sched(opt)
    run(model, opt, 2)
    ckpt.save(root, 2, model, opt, {"sched": sched}, timeout=TIMEOUT)
    out = {"ref": run(model, opt, 3)}
    fresh = build(seed=5)
    reordered = adamw(fresh, [("no_decay", NO_DECAY), ("decay", DECAY)])
    fresh_sched = with_sched(reordered)
    out["load"] = expect_failure(lambda: out.update(loaded=ckpt.load(root, fresh, reordered, {"sched": fresh_sched},
                                                                     timeout=TIMEOUT)))
    if out["load"]["raised"] is None:
        out["base_lrs"] = list(fresh_sched.base_lrs)
        out["resumed"] = run(fresh, reordered, 3)
    return out


def write_error(root, patch, async_save=False):
    """10. A write error on rank 1 inside DCP's write; then the next save (and a load) on the same ranks."""
    model = build()
    opt = adamw(model, [("decay", DECAY), ("no_decay", NO_DECAY)])
    step(model, opt)
    ckpt.save(root, 1, model, opt, timeout=TIMEOUT)
    step(model, opt)

    def save2():
        got = ckpt.save(root, 2, model, opt, timeout=TIMEOUT, async_save=async_save)
        return got.wait() if async_save else got

    with patched(*patch):
        out = expect_failure(save2)
    out.update(committed_after=ckpt.committed_steps(root), listing_after=listing(root))
    barrier()
    w = weights(model)
    out["save_after"] = expect_failure(lambda: out.update(path=os.path.basename(ckpt.save(root, 2, model, opt,
                                                                                          timeout=TIMEOUT))))
    fresh = build(seed=4)
    out["load_after"] = ckpt.load(root, fresh, adamw(fresh, [("decay", DECAY), ("no_decay", NO_DECAY)]),
                                  timeout=TIMEOUT)
    out["load_weights_equal"] = weights(fresh) == w
    out["committed"], out["end"] = ckpt.committed_steps(root), listing(root)
    return out


def scen_write_error_fsync(root):  # DCP's writer fsyncs each file it wrote (sync_files=True): os.fsync
    return write_error(root, ("os.fsync", 1, raiser(eio("fsync of a shard"))))


def scen_write_error_write_data(root):
    return write_error(root, ("dcp.FileSystemWriter.write_data", 1, raiser(eio("write shard"))))


def scen_write_error_async(root):  # in the background thread that writes and commits
    return write_error(root, ("os.fsync", 1, raiser(eio("fsync of a shard"))), async_save=True)


def scen_resave_rename_fails(root):
    """6. A re-save of step 2 whose second rename (.tmp- to step-N) fails on rank 0 (EIO), in a run that goes on:
    the old copy is renamed back to step-2 (were that rename to fail too, find_checkpoint() would take its
    .replaced-step-2-* for step 2). Then, in one root, a resume of step 1 and a save of step 2: refused unless the
    rollback to step 1 is said, then replaced; in another, a save of step 3 with keep=1."""
    real = os.rename

    def failing(src, dst):
        if os.path.basename(src).startswith(f"{ckpt.TMP}step-00000002-") and os.path.basename(dst) == "step-00000002":
            raise eio("rename to step-00000002")
        return real(src, dst)

    out = {}
    for case in ("rollback", "keep"):
        sub = os.path.join(root, case)
        model = build()
        opt = adamw(model, [("decay", DECAY), ("no_decay", NO_DECAY)])
        for s in (1, 2):
            step(model, opt)
            ckpt.save(sub, s, model, opt, timeout=TIMEOUT)
        with patched("os.rename", 0, failing):
            res = expect_failure(lambda: ckpt.save(sub, 2, model, opt, timeout=TIMEOUT))
        res.update(after=listing(sub), found=os.path.basename(ckpt.find_checkpoint(sub)))
        if case == "rollback":
            res["loaded"] = ckpt.load(ckpt.step_dir(sub, 1), model, opt, timeout=TIMEOUT)
            step(model, opt)
            res["unsaid"] = expect_failure(lambda: ckpt.save(sub, 2, model, opt, timeout=TIMEOUT))
            ckpt.check_root(sub, model, rollback_to=1, timeout=TIMEOUT)
            res["save"] = expect_failure(lambda: ckpt.save(sub, 2, model, opt, timeout=TIMEOUT))
        else:
            step(model, opt)
            LOG.lines.clear()
            res["save"] = expect_failure(lambda: ckpt.save(sub, 3, model, opt, keep=1, timeout=TIMEOUT))
            res["retention_log"] = [ln for ln in LOG.lines if "retention" in ln]
        res.update(end=listing(sub), committed=ckpt.committed_steps(sub))
        out[case] = res
    return out


ORDER = ["root_fsync_fails", "root_fsync_fails_async", "groups", "groups_scheduler", "write_error_fsync",
         "write_error_write_data", "write_error_async", "resave_rename_fails"]


def scenarios(a):
    if not a.plain:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    logging.getLogger("ckpt").addHandler(LOG)
    logging.getLogger("ckpt").setLevel(logging.INFO)
    results = {"world_size": dist.get_world_size() if dist.is_initialized() else None}
    path = os.path.join(a.out, f"results.{rank()}.json")

    def hung(name):
        results[name] = {"hung_after_s": SCENARIO_LIMIT}
        write_json(path, results)
        os._exit(3)

    for name in ORDER:
        if a.only and name not in a.only:
            continue
        timer = threading.Timer(SCENARIO_LIMIT, hung, (name,))
        timer.start()
        t0 = time.monotonic()
        try:
            results[name] = globals()[f"scen_{name}"](os.path.join(a.work, name))
        except BaseException as e:  # noqa: B036  (recorded; the test names the scenario)
            results[name] = {"unexpected": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        timer.cancel()
        results[name]["scenario_secs"] = round(time.monotonic() - t0, 2)
        write_json(path, results)
        barrier()
    ckpt.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "hold", "claim", "scenarios", "rollback-crash", "rollback-next"])
    p.add_argument("out")
    p.add_argument("work", nargs="?")
    p.add_argument("--root")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", choices=["first_rename", "second_rename", "after_fsync"])
    p.add_argument("--kill-step", type=int)
    p.add_argument("--no-fork-hook", action="store_true")
    p.add_argument("--plain", action="store_true", help="scenarios in a plain process: no process group")
    p.add_argument("--only", nargs="*")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '-')}] %(message)s")
    {"train": train, "hold": hold, "claim": claim, "scenarios": scenarios, "rollback-crash": rollback_crash,
     "rollback-next": rollback_next}[a.mode](a)


if __name__ == "__main__":
    main()
