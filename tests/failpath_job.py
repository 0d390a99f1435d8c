"""The failure paths of issue 12, run as one 2-rank job: scenario after scenario, each in its own root.

    torchrun --standalone --nproc-per-node 2 tests/failpath_job.py OUT WORK [--live-root R] [--only NAME ...]
                                                                   [--skip NAME ...]

Each rank writes OUT/results.<rank>.json after every scenario: {name: figures}, where a call expected to fail
records the exception type, its message and the seconds it took on this rank. tests/test_failpaths.py asserts
them. With --live-root R the job is also a live run holding R: early on it claims R, saves step 1 and writes
R.ready; the test then launches train_fsdp.py on R (a second live run, to be refused) and writes R.release when
it is done; at the end this job saves step 2 on R and closes (releasing R).

A scenario that runs past SCENARIO_LIMIT seconds (a rank waiting out the hour-long checkpoint timeout) is
recorded as hung and the job exits at once: the test then fails naming it, instead of the harness timing out.
"""

import argparse
import datetime
import errno
import faulthandler
import gc
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckpt  # noqa: E402
from tests import harness  # noqa: E402

HOUR = 3600  # the checkpoint timeout of every injected failure: no rank may come near it
SCENARIO_LIMIT = 60

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("work")
p.add_argument("--live-root", default=None)
p.add_argument("--only", nargs="*", default=None)
p.add_argument("--skip", nargs="*", default=[])
args = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
RANK = dist.get_rank()
os.makedirs(args.out, exist_ok=True)
_pid0 = [os.getpid()]
dist.broadcast_object_list(_pid0, src=0)
PID0 = _pid0[0]  # rank 0's pid: the pid a claim of this run names
HOST = socket.gethostname()


LOG = harness.Lines()
logging.getLogger("ckpt").addHandler(LOG)
logging.getLogger("ckpt").setLevel(logging.INFO)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.a)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, seed):
    torch.manual_seed(seed * 7 + RANK)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def weights(model):
    """sha256 of the full (gathered) parameters: equal on every rank, changes with any element."""
    flat = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


class Box:
    """An extra (e.g. a data loader); `fail` makes this rank's state_dict()/load_state_dict() raise."""

    def __init__(self, n=0):
        self.n, self.fail = n, None

    def state_dict(self):
        if self.fail == "state_dict":
            raise ValueError(f"state_dict() of the data loader broke on rank {RANK} (injected)")
        return {"n": self.n}

    def load_state_dict(self, sd):
        if self.fail == "load_state_dict":
            raise ValueError(f"load_state_dict() of the data loader broke on rank {RANK} (injected)")
        self.n = sd["n"]


def listing(root):
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def live_steps(root):
    return [n for n in listing(root) if n.startswith("step-")]


def abandoned(root):
    """{step: name} of the steps moved aside under root."""
    return {int(n.split("-")[2]): n for n in listing(root) if n.startswith(ckpt.ABANDONED)}


def expect_failure(fn):
    """Call fn with every rank starting together; record how it ended and how long this rank took."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: B036  (KeyboardInterrupt and DCP's BaseException are outcomes too)
        return {"raised": type(e).__name__, "msg": str(e), "secs": round(time.monotonic() - t0, 3)}
    return {"raised": None, "msg": "", "secs": round(time.monotonic() - t0, 3)}


def patched(name, on_rank, fake):
    """Replace ckpt.<dotted name> on one rank (on_rank=None: on every rank) while the call runs; the other ranks run
    the real thing (harness.Patched)."""
    return harness.Patched(ckpt, name, on_rank is None or RANK == on_rank, fake)


def raiser(exc):
    def fake(*a, **k):
        raise exc
    return fake


def recover(root, model, opt, extra, step, load_too=False, reload_first=False, timeout=HOUR):
    """A normal save (and load) on the same ranks right after a failure: healthy ranks must not stay broken.

    reload_first: after a failed load the model may hold part of the checkpoint on some ranks; the recovery a
    user does is to load again, before training or saving. timeout: that of the failed call, to prove its group
    was replaced."""
    dist.barrier()
    t0 = time.monotonic()
    out = {}
    try:
        if reload_first:
            out["reload"] = ckpt.load(root, model, opt, extra, timeout=HOUR)
        path = ckpt.save(root, step, model, opt, extra, timeout=timeout)
        out["save_after"] = os.path.basename(path)
        if load_too:
            out["load_after"] = ckpt.load(root, model, opt, extra, timeout=HOUR)
    except BaseException as e:  # noqa: B036
        out["recover_error"] = f"{type(e).__name__}: {e}"
    out["recover_secs"] = round(time.monotonic() - t0, 3)
    return out


def copy_steps(src, dst, steps):
    """Rank 0 copies committed steps of src into dst: checkpoints written by another run (no claim in dst)."""
    dist.barrier()
    if RANK == 0:
        os.makedirs(dst, exist_ok=True)
        for s in steps:
            shutil.copytree(ckpt.step_dir(src, s), ckpt.step_dir(dst, s))
    dist.barrier()


# ------------------------------------------------------------------------------------------ 1. rollback


def rollback(root, keep, new_run):
    """Save 1..4, load the step-2 dir explicitly, train differently; a save of step 3 is refused (step 4 would stay
    the newest commit) until check_root(rollback_to=2) gives up steps 3 and 4; then save 3 and 4 with `keep`;
    load(root) into a fresh model in between; at the end, load each moved-aside step by its path."""
    model, opt = make()
    saved_weights = {}
    for s in range(1, 5):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, timeout=HOUR)
        saved_weights[s] = weights(model)
    if new_run:
        ckpt.close()  # the first run ends here; what follows is the relaunched one
        model, opt = make(seed=5)
    got = ckpt.load(os.path.join(root, "step-00000002"), model, opt, timeout=HOUR)
    train(model, opt, 100)  # the new branch: different data after step 2
    branch = weights(model)
    out = {"loaded": got, "branch_weights": branch, "old_weights": saved_weights}
    LOG.take()
    # Not said: refused, and nothing is touched.
    out["unsaid"] = expect_failure(lambda: ckpt.save(root, 3, model, opt, keep=keep, timeout=HOUR))
    out["after_unsaid"] = listing(root)
    out["moved_at_unsaid"] = LOG.take("moved aside")
    # Said: the later steps are moved aside by check_root(), before any save.
    out["check_root"] = expect_failure(lambda: ckpt.check_root(root, model, rollback_to=2, timeout=HOUR))
    out["moved_at_check_root"] = LOG.take("moved aside")
    out["after_check_root"] = listing(root)
    out["found_after_check_root"] = os.path.basename(ckpt.find_checkpoint(root) or "")
    out["save3"] = expect_failure(lambda: out.update(saved=os.path.basename(ckpt.save(root, 3, model, opt, keep=keep,
                                                                                      timeout=HOUR))))
    out["moved_at_save3"] = LOG.take("moved aside")
    out["after_save3"] = listing(root)
    out["found"] = os.path.basename(ckpt.find_checkpoint(root) or "")
    out["committed_steps"] = ckpt.committed_steps(root)
    if out["save3"]["raised"] is None:
        fresh, fresh_opt = make(seed=9)
        out["reloaded"] = ckpt.load(root, fresh, fresh_opt, timeout=HOUR)
        out["reloaded_weights"] = weights(fresh)
        train(model, opt, 101)  # the new branch goes on: step 4 was on the old branch too
        LOG.take()
        out["save4"] = expect_failure(lambda: ckpt.save(root, 4, model, opt, keep=keep, timeout=HOUR))
        out["moved_at_save4"] = LOG.take("moved aside")
        out["after_save4"] = listing(root)
        out["found_after_save4"] = os.path.basename(ckpt.find_checkpoint(root) or "")
        out["new4_weights"] = weights(model)
        # The old branch is intact where it was moved: each step loads by its path, with its old weights.
        out["aside_loads"] = {}
        for step, name in sorted(abandoned(root).items()):
            fresh, fresh_opt = make(seed=10 + step)
            loaded = ckpt.load(os.path.join(root, name), fresh, fresh_opt, timeout=HOUR)
            out["aside_loads"][step] = [loaded, weights(fresh)]
    return out


def scen_rollback_same_run(root):
    return rollback(root, keep=3, new_run=False)


def scen_rollback_new_run(root):
    return rollback(root, keep=1, new_run=True)


def scen_same_or_older_step(root):
    """save() of the step this run last committed replaces it with the state given now; an older one is refused,
    after a load of that older step too, until check_root(rollback_to=) says so."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, timeout=HOUR)
    train(model, opt, 3)  # another step, the step counter not advanced
    step2 = ckpt.step_dir(root, 2)

    def held_weights_of(path):  # what a step holds, read into a fresh model
        fresh, _ = make(seed=7)
        ckpt.load(path, fresh, None, timeout=HOUR)
        return weights(fresh)

    def held_weights():
        return held_weights_of(step2)

    out = {}
    out["again"] = expect_failure(lambda: out.update(again_path=ckpt.save(root, 2, model, opt, timeout=HOUR)))
    out["again_holds_live"] = held_weights() == weights(model)
    train(model, opt, 4)

    def async_again():
        pending = ckpt.save(root, 2, model, opt, async_save=True, timeout=HOUR)
        out.update(async_path=pending.wait(), async_done=pending.done())

    out["async_again"] = expect_failure(async_again)
    out["async_holds_live"] = held_weights() == weights(model)
    out["older"] = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR))
    out["listing"] = listing(root)
    # A load of step 1 is no rollback by itself: save(1) is refused as before. Said (check_root(rollback_to=1)),
    # step 2 is moved aside and save(1) replaces step 1.
    fresh, fresh_opt = make(seed=3)
    out["loaded"] = ckpt.load(ckpt.step_dir(root, 1), fresh, fresh_opt, timeout=HOUR)
    train(fresh, fresh_opt, 5)
    out["after_load_unsaid"] = expect_failure(lambda: ckpt.save(root, 1, fresh, fresh_opt, timeout=HOUR))
    out["listing_unsaid"] = listing(root)
    out["rollback"] = expect_failure(lambda: ckpt.check_root(root, fresh, rollback_to=1, timeout=HOUR))
    out["after_load"] = expect_failure(lambda: out.update(after_load_path=ckpt.save(root, 1, fresh, fresh_opt,
                                                                                    timeout=HOUR)))
    out["after_load_holds_live"] = held_weights_of(ckpt.step_dir(root, 1)) == weights(fresh)
    out["listing_end"] = listing(root)
    out["root"] = root
    return out


def scen_find_ignores_abandoned(root):
    """A step moved aside is never "newest", even when it was the last commit; loading it by path still works."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, timeout=HOUR)
    dist.barrier()
    if RANK == 0:
        os.rename(os.path.join(root, "step-00000002"), os.path.join(root, ".abandoned-step-00000002-0123abcd"))
    dist.barrier()
    fresh, fresh_opt = make(seed=3)
    return {"listing": listing(root), "found": os.path.basename(ckpt.find_checkpoint(root) or ""),
            "committed_steps": ckpt.committed_steps(root),
            "load_root": ckpt.load(root, fresh, fresh_opt, timeout=HOUR),
            "load_explicit": ckpt.load(os.path.join(root, ".abandoned-step-00000002-0123abcd"), fresh, fresh_opt,
                                       timeout=HOUR)}


# ------------------------------------------------------------- 1b. the explicit rules: resumes, roots, locks


def optim_entries(ckpt_dir):
    """The optimizer state entries a checkpoint holds: its keys optim.0.state.<fqn>.<name>, from .metadata."""
    return sorted(k for k in ckpt.read_metadata(ckpt_dir).state_dict_metadata if k.startswith("optim.0.state."))


def scen_weights_only_save(root):
    """A run saves step 100 with its AdamW state and ends (close()). The next run loads the weights alone into its
    model (an initialisation), makes a fresh optimizer and saves step 100: refused (check_root() too), and step
    100 keeps its optimizer state. The control: the same model then resumed (load() with the optimizer) saves
    step 100 again, which replaces it, the state kept."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
    ckpt.save(root, 100, model, opt, timeout=HOUR)
    saved = weights(model)
    ckpt.close()  # the run ends; what follows is the next one
    step100 = ckpt.step_dir(root, 100)

    def held():
        with open(os.path.join(step100, ckpt.MANIFEST), "rb") as f:
            manifest = hashlib.sha256(f.read()).hexdigest()[:16]
        return {"entries": optim_entries(step100), "inode": os.stat(step100).st_ino, "manifest": manifest}

    out = {"before": held()}
    model, fresh_opt = make(seed=3)
    out["loaded"] = ckpt.load(root, model, timeout=HOUR)  # no optimizer: the weights alone
    out["weights_equal"] = weights(model) == saved
    out["fresh_opt_state"] = len(fresh_opt.state)
    out["save"] = expect_failure(lambda: ckpt.save(root, 100, model, fresh_opt, timeout=HOUR))
    out["check_root"] = expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR))
    out["after"] = held()
    out["listing"] = listing(root)
    out["resumed"] = ckpt.load(root, model, fresh_opt, timeout=HOUR)
    out["resave"] = expect_failure(lambda: ckpt.save(root, 100, model, fresh_opt, timeout=HOUR))
    out["after_resave"] = held()
    return out


def scen_two_roots(root):
    """One model saves alternately to roots A and B (steps 1 and 3 to A, 2 and 4 to B); the run ends (close()).
    The next run loads the newer of the two (B, step 4) with its optimizer; check_root() of both roots, and saves
    to both at later steps (5 to A, 6 to B), succeed; each root then loads back what was saved there."""
    roots = {"A": root + "-A", "B": root + "-B"}
    model, opt = make()
    saved = {}
    for s in (1, 2, 3, 4):
        train(model, opt, s)
        ckpt.save(roots["A" if s % 2 else "B"], s, model, opt, timeout=HOUR)
        saved[s] = weights(model)
    ckpt.close()  # the run is stopped; the next one resumes
    newest = {name: ckpt.committed_steps(r)[-1] for name, r in roots.items()}
    newer = max(newest, key=newest.get)
    model, opt = make(seed=4)
    out = {"newest": newest, "newer": newer}
    out["loaded"] = ckpt.load(roots[newer], model, opt, timeout=HOUR)
    out["weights_equal"] = weights(model) == saved[4]
    for name, r in roots.items():
        out[f"check_root_{name}"] = expect_failure(lambda: ckpt.check_root(r, model, timeout=HOUR))
    for name, s in (("A", 5), ("B", 6)):
        train(model, opt, s)
        out[f"save_{name}"] = expect_failure(lambda: out.update({f"path_{name}": os.path.basename(
            ckpt.save(roots[name], s, model, opt, timeout=HOUR))}))
        saved[s] = weights(model)
    for name, s in (("A", 5), ("B", 6)):
        fresh, fresh_opt = make(seed=10 + s)
        out[f"load_{name}"] = ckpt.load(roots[name], fresh, fresh_opt, timeout=HOUR)
        out[f"load_{name}_weights_equal"] = weights(fresh) == saved[s]
        out[f"committed_{name}"] = ckpt.committed_steps(roots[name])
        out[f"listing_{name}"] = listing(roots[name])
    return out


def scen_no_flock(root):
    """A file system whose flock() fails with ENOSYS (Lustre mounted without -o flock), on rank 0, which claims: the
    first save is refused (check_root() too), naming the mount options and the opt-out; check_root(lock=False)
    claims the root without a lock (flock() is tried once more, refused: a lock held by another run would still
    refuse it), and saves and loads work. A second root, made beforehand,
    claimed with lock=False first; the same run's check_root() of it again (lock left at its default). A third root
    that does not exist yet, claimed with lock=False."""
    calls = []

    def no_flock(fd, operation):
        calls.append(operation)
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    made, new = root + "-made", root + "-new"
    if RANK == 0:
        os.makedirs(made)
    dist.barrier()
    owner = os.path.join(root, ckpt.OWNER)
    model, opt = make()
    train(model, opt, 1)
    out = {}
    with patched("fcntl.flock", 0, no_flock):
        out["save"] = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR))
        out["check_root"] = expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR))
        out["after_refusal"] = listing(root)
        out["flock_calls_refused"] = len(calls)
        out["opt_out"] = expect_failure(lambda: ckpt.check_root(root, model, lock=False, timeout=HOUR))
        out["claim"] = repr(ckpt._locks.get(os.path.realpath(root), "absent"))  # rank 0's: the record, unlocked
        out["save1"] = expect_failure(lambda: out.update(path1=os.path.basename(ckpt.save(root, 1, model, opt,
                                                                                          timeout=HOUR))))
        train(model, opt, 2)
        out["save2"] = expect_failure(lambda: out.update(path2=os.path.basename(ckpt.save(root, 2, model, opt, keep=1,
                                                                                          timeout=HOUR))))
        saved = weights(model)
        fresh, fresh_opt = make(seed=3)
        out["load"] = expect_failure(lambda: out.update(loaded=ckpt.load(root, fresh, fresh_opt, timeout=HOUR)))
        out["weights_equal"] = weights(fresh) == saved
        out["made_check_root"] = expect_failure(lambda: ckpt.check_root(made, model, lock=False, timeout=HOUR))
        out["made_save"] = expect_failure(lambda: ckpt.save(made, 2, model, opt, timeout=HOUR))
        out["made_claim"] = repr(ckpt._locks.get(os.path.realpath(made), "absent"))
        out["flock_calls"] = len(calls)
        out["made_listing"] = listing(made)
        out["made_check_root_again"] = expect_failure(lambda: ckpt.check_root(made, model, timeout=HOUR))
        out["new_check_root"] = expect_failure(lambda: ckpt.check_root(new, model, lock=False, timeout=HOUR))
        out["new_save"] = expect_failure(lambda: ckpt.save(new, 2, model, opt, timeout=HOUR))
        out["new_listing"] = listing(new)
    out["listing"] = listing(root)
    out["owner_bytes"] = os.path.getsize(owner) if os.path.exists(owner) else None
    dist.barrier()
    out["lock_free"] = harness.lock_is_free(root) if RANK == 0 else None  # one prober
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------ 2. one run per root


def owner_file(root):
    """The claim's record: None if there is none, or it is empty (its run closed)."""
    try:
        with open(os.path.join(root, ckpt.OWNER)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return json.loads(text) if text else None


def stale_owner(root, text):
    """Rank 0 writes a claim's record that no live process locks (its run died), atomically: ranks read it."""
    dist.barrier()
    if RANK == 0:
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, ckpt.OWNER)
        with open(path + ".new", "w") as f:
            f.write(text)
        os.replace(path + ".new", path)
    dist.barrier()


def record(host, pid):
    return json.dumps({"host": host, "pid": pid, "job": "4242", "started": "2020-01-01T00:00:00"})


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    return proc.pid


# Another run, in a plain process (no process group): it claims root as train_fsdp.py's check_root() does.
HOLDER = """import sys, torch; sys.path.insert(0, sys.argv[2]); import ckpt
ckpt.check_root(sys.argv[1], torch.nn.Linear(1, 1)); print("held", flush=True); sys.stdin.read()"""


LIVE = {}  # the live run's model and optimizer, for live_goes_on()


def scen_hold_live(root):
    """This job becomes the live run on args.live_root: it claims it and saves step 1, then tells the test."""
    root = args.live_root
    model, opt = make()
    ckpt.check_root(root, model, timeout=HOUR)
    train(model, opt, 1)
    out = {"save1": os.path.basename(ckpt.save(root, 1, model, opt, timeout=HOUR)), "owner": owner_file(root),
           "my_pid": PID0, "listing": listing(root)}
    dist.barrier()
    if RANK == 0:
        open(root + ".ready", "w").close()
    LIVE["model"] = model, opt
    return out


def live_goes_on():
    """After the second run was refused: this run still saves to its root, and close() releases it."""
    root = args.live_root
    waited = time.monotonic()
    deadline = time.monotonic() + 240  # every rank polls: none waits in a collective past its timeout
    while not os.path.exists(root + ".release") and time.monotonic() < deadline:
        time.sleep(0.1)
    released = [os.path.exists(root + ".release")]
    dist.broadcast_object_list(released, src=0)  # rank 0's verdict
    model, opt = LIVE["model"]
    train(model, opt, 2)
    out = {"released": released[0], "waited_secs": round(time.monotonic() - waited, 1), "before": listing(root),
           "owner_before": owner_file(root)}
    out["save2"] = expect_failure(lambda: out.update(path2=os.path.basename(ckpt.save(root, 2, model, opt,
                                                                                      timeout=HOUR))))
    out["committed"] = ckpt.committed_steps(root)
    out["owner_after_save"] = owner_file(root)
    return out


def scen_foreign_live_claim(root):
    """Another live run (a process of its own on this host) holds root, with a save in progress: check_root() and
    save() are refused naming it, check_root(lock=False) too (it tries the lock: a missing lock lets it go on, one
    held refuses); nothing of the other run's is removed. load() of the root and of a step directory claims
    nothing and works."""
    src = root + "-src"
    model, opt = make()
    train(model, opt, 1)
    ckpt.save(src, 1, model, opt, timeout=HOUR)
    saved = weights(model)
    holder = [None]
    if RANK == 0:  # the other run claims the empty root, then the step appears (it trains, say)
        os.makedirs(root)
        holder[0] = subprocess.Popen([sys.executable, "-c", HOLDER, root, harness.REPO], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert holder[0].stdout.readline().strip() == "held"
    copy_steps(src, root, [1])
    if RANK == 0:
        os.makedirs(os.path.join(root, f"{ckpt.TMP}step-00000002-0badc0de"))  # the other run's save in progress
    other = [holder[0].pid if holder[0] else None]
    dist.broadcast_object_list(other, src=0)
    before, owner_before = listing(root), owner_file(root)
    fresh, fresh_opt = make(seed=4)
    out = {"other_pid": other[0], "owner": owner_before, "listing_before": before,
           "check_root": expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR)),
           "save": expect_failure(lambda: ckpt.save(root, 5, model, opt, timeout=HOUR)),
           "lock_false": expect_failure(lambda: ckpt.check_root(root, model, lock=False, timeout=HOUR))}
    out["load_root"] = expect_failure(lambda: out.update(step_root=ckpt.load(root, fresh, None, timeout=HOUR)))
    out["weights_root"] = weights(fresh)
    fresh, fresh_opt = make(seed=5)
    out["load_dir"] = expect_failure(lambda: out.update(step_dir=ckpt.load(ckpt.step_dir(root, 1), fresh, None,
                                                                           timeout=HOUR)))
    out["load_with_opt"] = expect_failure(lambda: out.update(step_opt=ckpt.load(root, fresh, fresh_opt,
                                                                                timeout=HOUR)))
    out["weights_dir"], out["saved_weights"] = weights(fresh), saved
    dist.barrier()
    out["owner_unchanged"] = owner_file(root) == owner_before
    out["listing_after"] = listing(root)
    out["held_while_refused"] = not harness.lock_is_free(root)
    dist.barrier()
    if holder[0]:
        holder[0].communicate("", timeout=30)  # the other run ends (without close(): as if it died)
    return out


def scen_training_claims(root):
    """Training claims: load() of another run's checkpoints takes no claim, the save after it does, and
    check_root() keeps it; a model that loaded nothing from a root holding checkpoints, or its weights alone, is
    refused, and nothing there is touched."""
    src = root + "-src"
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(src, s, model, opt, timeout=HOUR)
    copy_steps(src, root, [1, 2])
    fresh_root = root + "-fresh"
    copy_steps(src, fresh_root, [1, 2])
    out = {"owner_initially": owner_file(root)}
    model, opt = make(seed=2)
    out["loaded"] = ckpt.load(root, model, opt, timeout=HOUR)
    out["owner_after_load"] = owner_file(root)
    train(model, opt, 3)
    out["save3"] = expect_failure(lambda: ckpt.save(root, 3, model, opt, timeout=HOUR))
    out["owner_after_save"] = owner_file(root)
    out["check_root"] = expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR))
    out["owner_after_check_root"] = owner_file(root)
    out["listing"] = listing(root)
    out["my_pid"], out["host"] = PID0, HOST
    # A model that loaded nothing (a forgotten resume), or the weights alone (an initialisation), on a root holding
    # another run's steps: refused. (The model above was resumed: it may claim other roots too.)
    never, never_opt = make(seed=8)
    out["fresh_check_root"] = expect_failure(lambda: ckpt.check_root(fresh_root, never, timeout=HOUR))
    out["fresh_save"] = expect_failure(lambda: ckpt.save(fresh_root, 3, never, never_opt, timeout=HOUR))
    initialised, initialised_opt = make(seed=9)
    out["weights_only_loaded"] = ckpt.load(fresh_root, initialised, None, timeout=HOUR)
    out["weights_only_check_root"] = expect_failure(lambda: ckpt.check_root(fresh_root, initialised, timeout=HOUR))
    out["weights_only_save"] = expect_failure(lambda: ckpt.save(fresh_root, 3, initialised, initialised_opt,
                                                                timeout=HOUR))
    out["fresh_listing"] = listing(fresh_root)
    out["fresh_lock_free"] = harness.lock_is_free(fresh_root) if RANK == 0 else None  # one prober: ranks would race
    return out


def scen_dead_owner(root):
    """A claim whose run died (its record says this host and a pid that is gone; nothing locks it): taken over at
    once (logged); only the dead run's temporaries are removed."""
    stale_owner(root, record(HOST, dead_pid()))
    if RANK == 0:
        os.makedirs(os.path.join(root, ".tmp-step-00000009-deadbeef"))
        open(os.path.join(root, ".tmp-step-00000009-deadbeef", "__0_0.distcp"), "w").close()
        open(os.path.join(root, ".nfs1234"), "w").close()
        os.makedirs(os.path.join(root, "lost+found"))
    dist.barrier()
    LOG.take()
    model, opt = make()
    r = expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR))
    log_lines = LOG.take("taking over", "removed")
    after_check = listing(root)
    saved = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR))
    return {"check_root": r, "log": log_lines, "owner": owner_file(root), "my_pid": PID0,
            "after_check": after_check, "save": saved, "after_save": listing(root)}


def scen_stale_owner(root):
    """Records no live process locks, whatever they say: another host's a day old, this very pid (a restarted
    container whose pids repeat), a half-written one. Each is taken over at once, with a log line naming it."""
    out = {"my_pid": PID0}
    for name, text in {"elsewhere": record("elsewhere", 12345), "own_pid": record(HOST, PID0),
                       "half_written": '{"host": "half-wri'}.items():
        sub = root + "-" + name  # a root each: this job's claim stays until close()
        stale_owner(sub, text)
        LOG.take()
        out[name] = expect_failure(lambda: ckpt.check_root(sub, make()[0], timeout=HOUR))
        out[name]["log"] = LOG.take("taking over")
        out[name]["owner"] = owner_file(sub)
    return out


def scen_foreign_entries(root):
    """.nfsXXXX, lost+found (a mount point) and a data file in a fresh root: not touched, root not refused."""
    if RANK == 0:
        os.makedirs(os.path.join(root, "lost+found"))
        open(os.path.join(root, ".nfs0000000001234"), "w").close()
        with open(os.path.join(root, "train.bin"), "wb") as f:
            f.write(b"data")
    dist.barrier()
    model, opt = make()
    out = {"check_root": expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR)),
           "save": expect_failure(lambda: ckpt.save(root, 1, model, opt, keep=1, timeout=HOUR))}
    train(model, opt, 2)
    out["save2"] = expect_failure(lambda: ckpt.save(root, 2, model, opt, keep=1, timeout=HOUR))
    out["load"] = expect_failure(lambda: out.update(step=ckpt.load(root, model, opt, timeout=HOUR)))
    out["after"] = listing(root)
    with open(os.path.join(root, "train.bin"), "rb") as f:
        out["data_kept"] = f.read() == b"data"
    return out


def advance(root):
    """Rank 0, as a run writing root would: commit the step after the newest, then retention removes the newest
    before it (renamed out of sight, then deleted). Returns (removed, committed)."""
    n = ckpt.committed_steps(root)[-1]
    tmp = os.path.join(root, f"{ckpt.TMP}step-{n + 1:08d}-c0ffee00")
    shutil.copytree(ckpt.step_dir(root, n), tmp)
    with open(os.path.join(tmp, ckpt.MANIFEST)) as f:
        manifest = json.load(f)
    manifest = dict(manifest, step=n + 1)  # a manifest names its step and carries its own CRC (format 6)
    with open(os.path.join(tmp, ckpt.MANIFEST), "w") as f:
        json.dump(dict(manifest, crc32=ckpt._manifest_crc(manifest)), f)
    os.rename(tmp, ckpt.step_dir(root, n + 1))
    trash = os.path.join(root, f"{ckpt.TMP}delete-step-{n:08d}-c0ffee00")
    os.rename(ckpt.step_dir(root, n), trash)
    shutil.rmtree(trash)
    return ckpt.step_dir(root, n), ckpt.step_dir(root, n + 1)


def scen_vanished_while_loading(root):
    """A reader chose the newest step; a run writing the root commits the next one and its retention removes the
    chosen one before the reader checks its files (or reads .metadata). load() fails on every rank naming the
    step that vanished and the newest commit; loading again works."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, timeout=HOUR)
    saved = weights(model)
    out = {}
    for where, name in (("before verify", "verify_files"), ("before .metadata", "read_metadata")):
        real, marker, fired = getattr(ckpt, name), os.path.join(root + "-signals", name), []

        def removed_first(*a, _real=real, _where=where, _marker=marker, _fired=fired, **k):
            if _fired:  # a load calls it more than once (the sizes, then the CRCs): the removal happens at the first
                return _real(*a, **k)
            _fired.append(True)
            # Every rank is here (none still in an earlier step of load(), where the removal would be seen
            # otherwise); then rank 0 is the writer, whose commit and retention happen now; the other ranks look
            # once the step is gone (else they may race the deletion, file by file).
            os.makedirs(os.path.dirname(_marker), exist_ok=True)
            open(f"{_marker}.arrived.{RANK}", "w").close()
            deadline = time.monotonic() + 20
            if RANK == 0:
                while (not all(os.path.exists(f"{_marker}.arrived.{r}") for r in range(dist.get_world_size()))
                       and time.monotonic() < deadline):
                    time.sleep(0.01)
                out[f"advanced {_where}"] = advance(root)
                open(_marker, "w").close()
            else:
                while not os.path.exists(_marker) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return _real(*a, **k)

        fresh, fresh_opt = make(seed=6)
        with patched(name, None, removed_first):
            out[where] = expect_failure(lambda: ckpt.load(root, fresh, fresh_opt, timeout=HOUR))
    gone = ckpt.step_dir(root, 2)
    out["explicit"] = expect_failure(lambda: ckpt.load(gone, fresh, fresh_opt, timeout=HOUR))
    out["explicit_dir"] = gone
    out["listing"] = listing(root)
    fresh, fresh_opt = make(seed=7)
    out["again"] = expect_failure(lambda: out.update(again_step=ckpt.load(root, fresh, fresh_opt, timeout=HOUR)))
    out["weights_match"] = weights(fresh) == saved
    return out


# ------------------------------------------------------------------------------------------ 3. one rank fails


def injected(root, fail_rank, where, kind="save", patch=None, box_fail=None):
    """Step 1 saved normally; then the `kind` call with the fault on fail_rank; then a normal save (and load)."""
    model, opt = make()
    box = Box(7)
    extra = {"data": box}
    train(model, opt, 1)
    ckpt.save(root, 1, model, opt, extra, keep=2, timeout=HOUR)
    train(model, opt, 2)
    if box_fail and RANK == fail_rank:
        box.fail = box_fail
    if kind == "save":
        call = lambda: ckpt.save(root, 2, model, opt, extra, keep=2, timeout=HOUR)  # noqa: E731
    else:
        call = lambda: ckpt.load(root, model, opt, extra, timeout=HOUR)  # noqa: E731
    if patch:
        with patched(patch[0], fail_rank, patch[1]):
            r = expect_failure(call)
    else:
        r = expect_failure(call)
    box.fail = None
    out = {"fail_rank": fail_rank, "where": where, **r, "committed_after_failure": ckpt.committed_steps(root)}
    out.update(recover(root, model, opt, extra, 3, load_too=True, reload_first=kind == "load"))
    out["committed"] = ckpt.committed_steps(root)
    return out


def eio(what):
    return OSError(5, f"Input/output error ({what}, injected)")


def scen_save_user_state_dict(root):
    return injected(root, 1, "the user's state_dict()", box_fail="state_dict")


def scen_save_prepare_rank0(root):
    return injected(root, 0, "making the step's directory (rank 0)", patch=("os.makedirs", raiser(eio("mkdir"))))


def scen_save_shared_storage(root):
    real = os.path.exists
    blind = lambda path: False if f"{os.sep}{ckpt.TMP}step-" in str(path) else real(path)  # noqa: E731
    return injected(root, 1, "seeing the step's directory (a node-local root)", patch=("os.path.exists", blind))


def scen_save_write_data(root):
    return injected(root, 1, "DCP writing this rank's file",
                    patch=("dcp.FileSystemWriter.write_data", raiser(eio("write shard"))))


def scen_save_checksum(root):
    return injected(root, 1, "checksumming this rank's files", patch=("zlib.crc32", raiser(eio("checksum"))))


def scen_load_choose_rank0(root):
    return injected(root, 0, "reading the manifest (rank 0)", kind="load",
                    patch=("read_manifest", raiser(eio("read manifest"))))


def scen_load_hash(root):
    return injected(root, 1, "checksumming at load", kind="load", patch=("zlib.crc32", raiser(eio("checksum"))))


def scen_load_read_metadata(root):
    return injected(root, 1, "reading .metadata", kind="load",
                    patch=("read_metadata", raiser(eio("read .metadata"))))


def scen_load_read_data(root):
    return injected(root, 1, "reading this rank's shards", kind="load",
                    patch=("SafeReader.read_data", raiser(eio("read shard"))))


def scen_load_set_state_dict(root):
    return injected(root, 1, "set_model_state_dict", kind="load",
                    patch=("set_model_state_dict", raiser(RuntimeError("set_model_state_dict broke (injected)"))))


def scen_load_user_load_state_dict(root):
    return injected(root, 0, "the user's load_state_dict()", kind="load", box_fail="load_state_dict")


def scen_save_stage_async(root):
    """async_save=True and the copy to host memory (HostCopy, in its thread) fails on rank 1, e.g. out of host
    memory: rank 0 has copied. Then an async save, a save and a load on the same ranks."""
    model, opt = make()
    train(model, opt, 1)
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    train(model, opt, 2)
    # ckpt._host_views on rank 1: its host memory cannot be made (pinned or host memory exhausted)
    with patched("_host_views", 1, raiser(RuntimeError("out of host memory while copying to host (injected)"))):
        r = expect_failure(lambda: ckpt.save(root, 2, model, opt, async_save=True, timeout=HOUR).wait())
    out = {"fail_rank": 1, "where": "the copy to host memory", **r,
           "committed_after_failure": ckpt.committed_steps(root)}
    train(model, opt, 3)
    out["async_after"] = expect_failure(lambda: ckpt.save(root, 3, model, opt, async_save=True, timeout=HOUR).wait())
    return {**out, **recover(root, model, opt, None, 4, load_too=True), "committed": ckpt.committed_steps(root),
            "listing": listing(root)}


def scen_retention_cannot_delete(root):
    """Retention on rank 0 cannot delete an old checkpoint (EACCES): the new one is committed all the same,
    on every rank, and the failure is logged."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, keep=2, timeout=HOUR)
    LOG.take()
    train(model, opt, 3)
    with patched("shutil.rmtree", 0, raiser(PermissionError(13, "Permission denied (injected)"))):
        r = expect_failure(lambda: ckpt.save(root, 3, model, opt, keep=2, timeout=HOUR))
    return {**r, "log": LOG.take("retention"), "committed": ckpt.committed_steps(root), "listing": listing(root),
            **recover(root, model, opt, None, 4, load_too=True)}


def mismatch(root, **per_rank):
    """save() with one argument different on the two ranks; then a normal save."""
    model, opt = make()
    kw = {k: v[RANK] for k, v in per_rank.items()}
    r = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR, **kw))
    ckpt.wait_pending()
    return {**r, "mine": kw, "committed_after_failure": ckpt.committed_steps(root),
            "listing_after_failure": listing(root), **recover(root, model, opt, None, 2)}


def scen_args_async_save(root):
    return mismatch(root, async_save=(True, False))


def scen_args_keep(root):
    return mismatch(root, keep=(5, 7))


def scen_args_rng(root):
    return mismatch(root, rng=(True, False))


def scen_args_load_verify(root):
    model, opt = make()
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    r = expect_failure(lambda: ckpt.load(root, model, opt, verify=(True, False)[RANK], timeout=HOUR))
    return {**r, "mine": {"verify": (True, False)[RANK]}, **recover(root, model, opt, None, 2, load_too=True)}


# ------------------------------------------------------------------------------------------ 4. smaller ones


def scen_big_step(root):
    """Steps of any size: 10**8 is step-100000000 and 10**9 step-1000000000, ordered by number (by name,
    "step-1000000000" < "step-100000001"): the newest, what a save below it is refused for, what a rollback moves."""
    model, opt = make()
    train(model, opt, 1)
    out = {"save": os.path.basename(ckpt.save(root, 10**8, model, opt, timeout=HOUR))}
    w = weights(model)
    train(model, opt, 2)
    out["save2"] = os.path.basename(ckpt.save(root, 10**8 + 1, model, opt, keep=1, timeout=HOUR))
    w2 = weights(model)
    out["check_root"] = expect_failure(lambda: ckpt.check_root(root, model, timeout=HOUR))
    out["committed_steps"] = ckpt.committed_steps(root)
    fresh, fresh_opt = make(seed=4)
    out["load_root"] = ckpt.load(root, fresh, fresh_opt, timeout=HOUR)
    out["weights_match"] = weights(fresh) == w2
    train(fresh, fresh_opt, 3)
    out["save3"] = os.path.basename(ckpt.save(root, 10**9, fresh, fresh_opt, timeout=HOUR))
    out["found"] = os.path.basename(ckpt.find_checkpoint(root))
    fresh, fresh_opt = make(seed=5)
    out["load_newest"] = ckpt.load(root, fresh, fresh_opt, timeout=HOUR)
    # A rollback from 10**9 to 10**8 + 1: a save of 10**8 + 2 is refused (10**9 is later, by number) until
    # check_root(rollback_to=10**8 + 1) moves step-1000000000 aside.
    out["load_explicit"] = ckpt.load(os.path.join(root, "step-100000001"), fresh, fresh_opt, timeout=HOUR)
    train(fresh, fresh_opt, 4)
    out["unsaid"] = expect_failure(lambda: ckpt.save(root, 10**8 + 2, fresh, fresh_opt, timeout=HOUR))
    out["rollback"] = expect_failure(lambda: ckpt.check_root(root, fresh, rollback_to=10**8 + 1, timeout=HOUR))
    out["save4"] = os.path.basename(ckpt.save(root, 10**8 + 2, fresh, fresh_opt, timeout=HOUR))
    out["first_differs"] = w != w2
    out["listing"] = listing(root)
    return out


def scen_interrupted_wait(root):
    """Ctrl-C inside PendingSave.wait() while every rank's background write is held: the save stays in flight
    with its directory, and once the write goes on it commits by itself; the next save follows it."""
    model, opt = make()
    train(model, opt, 1)
    gate = threading.Event()
    real_write = ckpt.dcp.FileSystemWriter.write_data

    def held_write(self, *a, **k):
        gate.wait(30)
        return real_write(self, *a, **k)

    with patched("dcp.FileSystemWriter.write_data", None, held_write):
        pending = ckpt.save(root, 1, model, opt, async_save=True, timeout=HOUR)
        real = pending.job.result

        def interrupted(*a, **k):
            pending.job.result = real  # only the first call is interrupted
            raise KeyboardInterrupt

        pending.job.result = interrupted
        r = expect_failure(pending.wait)
        out = {"wait": r, "done_after_interrupt": pending.done(),
               "committed_after_interrupt": ckpt.committed_steps(root),
               "tmp_after": [n for n in listing(root) if n.startswith(".tmp-step-00000001")]}
        gate.set()
        t0 = time.monotonic()
        while not ckpt.committed_steps(root) and time.monotonic() - t0 < 30:  # no ckpt call: it commits by itself
            time.sleep(0.01)
        out["committed_by_itself"] = ckpt.committed_steps(root)
    train(model, opt, 2)
    out["save2"] = expect_failure(lambda: out.update(path2=os.path.basename(ckpt.save(root, 2, model, opt,
                                                                                      timeout=HOUR))))
    out["wait_again"] = os.path.basename(pending.wait())
    out["committed"] = ckpt.committed_steps(root)
    out["listing"] = listing(root)
    return out


def scen_timeout_recovery(root):
    """timeout=2 s, rank 1 arrives 3 s late: both fail; then the next save (same timeout) works on both."""
    model, opt = make()
    ckpt.save(root, 1, model, opt, timeout=2)  # the 2-s group exists, as after any earlier save

    def late():
        if RANK == 1:
            time.sleep(3)
        ckpt.save(root, 2, model, opt, timeout=2)

    r = expect_failure(late)
    out = {**r, "committed_after_failure": ckpt.committed_steps(root)}
    out.update(recover(root, model, opt, None, 3, timeout=2))
    out["committed"] = ckpt.committed_steps(root)
    return out


def scen_timeout_async(root):
    """timeout=2 s, rank 1's background write stuck for 4 s: the commit, in the background, fails on both ranks
    (rank 0 after about 2 s, naming the phase), wait() raises it, and the next save works."""
    model, opt = make()
    ckpt.save(root, 1, model, opt, timeout=2)
    real_write = ckpt.dcp.FileSystemWriter.write_data

    def stuck(self, *a, **k):
        time.sleep(4)
        return real_write(self, *a, **k)

    with patched("dcp.FileSystemWriter.write_data", 1, stuck):
        t0 = time.monotonic()
        pending = ckpt.save(root, 2, model, opt, async_save=True, timeout=2)
        blocked = time.monotonic() - t0
        out = expect_failure(pending.wait)
    out.update(blocked_secs=round(blocked, 3), committed_after_failure=ckpt.committed_steps(root))
    out.update(recover(root, model, opt, None, 3, timeout=2))
    out["committed"] = ckpt.committed_steps(root)
    return out


def scen_timeout_first_save(root):
    """The same, when this timeout's group does not exist yet: it is created inside save(), under 1 s."""
    model, opt = make()

    def late():
        if RANK == 1:
            time.sleep(2.5)
        ckpt.save(root, 1, model, opt, timeout=datetime.timedelta(seconds=1))

    out = expect_failure(late)
    dist.barrier()
    out.update(recover(root, model, opt, None, 2))
    return out


def scen_save_after_failed_load(root):
    """A load that failed on one rank mid-read leaves the ranks' state apart (rank 0 read its shards and the
    values stored once, rank 1 did not): save() must refuse, naming what differs; a load then repairs it."""
    model, opt = make()
    train(model, opt, 1)
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    train(model, opt, 2)
    real, reads = ckpt.SafeReader.read_data, []

    def tensors_fail(self, plan, planner):  # a load reads twice: its small values, then its tensors into the state
        reads.append(plan)
        if len(reads) == 2:
            raise eio("read shard")
        return real(self, plan, planner)
    with patched("SafeReader.read_data", 1, tensors_fail):
        failed = expect_failure(lambda: ckpt.load(root, model, opt, timeout=HOUR))
    steps = sorted({float(st["step"]) for st in opt.state.values()})
    out = {"failed_load": failed, "optimizer_steps": steps,
           "save": expect_failure(lambda: ckpt.save(root, 2, model, opt, timeout=HOUR)),
           "committed_after_refusal": ckpt.committed_steps(root)}
    out.update(recover(root, model, opt, None, 2, load_too=True, reload_first=True))
    out["committed"] = ckpt.committed_steps(root)
    return out


ORDER = [
    # First: close() (the relaunched run) releases every claim this job holds, the live root's too.
    "weights_only_save", "two_roots",  # each ends its first run with close() too
    "rollback_new_run", "hold_live", "rollback_same_run", "no_flock", "same_or_older_step", "find_ignores_abandoned",
    "foreign_live_claim", "training_claims", "dead_owner", "stale_owner", "foreign_entries",
    "vanished_while_loading",
    "save_user_state_dict", "save_prepare_rank0", "save_shared_storage", "save_write_data", "save_checksum",
    "load_choose_rank0", "load_hash", "load_read_metadata", "load_read_data", "load_set_state_dict",
    "load_user_load_state_dict", "retention_cannot_delete",
    "args_async_save", "args_keep", "args_rng", "args_load_verify",
    "big_step", "interrupted_wait", "save_after_failed_load",
    "timeout_recovery", "timeout_first_save", "timeout_async",
    "save_stage_async",  # last: a hang here (watchdog) loses no other scenario
]
results = {}


def dump():
    path = os.path.join(args.out, f"results.{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def hung(name, limit=SCENARIO_LIMIT):
    results[name] = {"hung_after_s": limit}
    dump()
    with open(os.path.join(args.out, f"hung.{RANK}.txt"), "w") as f:  # where each thread waits
        faulthandler.dump_traceback(f, all_threads=True)
    print(f"rank {RANK}: scenario {name} still running after {limit} s: giving up", flush=True)
    os._exit(3)


def claims():
    """{root: its claim} for every claimed root this job used."""
    roots = [os.path.join(args.work, n) for n in listing(args.work)] + ([args.live_root] if args.live_root else [])
    return {os.path.basename(r): owner_file(r) for r in roots if owner_file(r)}


def wanted(name):
    return (not args.only or name in args.only) and name not in args.skip


def run(name, limit=SCENARIO_LIMIT):
    timer = threading.Timer(limit, hung, (name, limit))
    timer.start()
    t0 = time.monotonic()
    try:
        results[name] = globals()[f"scen_{name}"](os.path.join(args.work, name))
    except BaseException as e:  # noqa: B036  (recorded; the test names the scenario)
        results[name] = {"unexpected": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    timer.cancel()
    results[name]["scenario_secs"] = round(time.monotonic() - t0, 2)
    dump()
    dist.barrier()


try:
    t_job = time.monotonic()
    for name in ORDER:
        if wanted(name) and (name != "hold_live" or args.live_root):
            run(name)
    if "model" in LIVE:
        timer = threading.Timer(SCENARIO_LIMIT + 240, hung, ("live_goes_on",))
        timer.start()
        results["live_goes_on"] = live_goes_on()
        timer.cancel()
    dist.barrier()
    results["close"] = {"claims_before": claims(), "my_pid": PID0}
    ckpt.close()
    dist.barrier()
    results["close"]["claims_after"] = claims()
    claimed = [os.path.join(args.work, n) for n in results["close"]["claims_before"] if n != "live"]
    if RANK == 0:  # one prober: two ranks probing at once would find each other's probe
        results["close"]["locks_free"] = all(harness.lock_is_free(r) for r in claimed + [args.live_root] if r)
    results["job_secs"] = round(time.monotonic() - t_job, 1)
    dump()
    ckpt.close()
finally:
    dist.barrier()
    gc.collect()  # the scenarios' FSDP2 models hold the process group: free them before the teardown (README)
    dist.destroy_process_group()
