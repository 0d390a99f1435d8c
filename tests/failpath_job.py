"""The failure paths of issue 12, run as one 2-rank job: scenario after scenario, each in its own root.

    torchrun --standalone --nproc-per-node 2 tests/failpath_job.py OUT WORK [--live-root R] [--only NAME ...]
    torchrun --standalone --nproc-per-node 2 tests/failpath_job.py OUT WORK --holder R

Each rank writes OUT/results.<rank>.json after every scenario: {name: figures}, where a call expected to fail
records the exception type, its message and the seconds it took on this rank. tests/test_failpaths.py asserts
them. --holder claims root R, saves step 1, writes OUT/ready and keeps the claim until OUT/release exists (a
live run); the main job, given --live-root R, tries to use R as a second run (the test writes OUT/release).

A scenario that runs past SCENARIO_LIMIT seconds (a rank waiting out the hour-long checkpoint timeout) is
recorded as hung and the job exits at once: the test then fails naming it, instead of the harness timing out.
"""

import argparse
import datetime
import faulthandler
import gc
import hashlib
import json
import logging
import os
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

HOUR = 3600  # the checkpoint timeout of every injected failure: no rank may come near it
SCENARIO_LIMIT = 45

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("work")
p.add_argument("--holder", default=None)
p.add_argument("--live-root", default=None)
p.add_argument("--only", nargs="*", default=None)
args = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
RANK = dist.get_rank()
os.makedirs(args.out, exist_ok=True)


class Lines(logging.Handler):
    """ckpt's log lines, so a scenario can show that a takeover or a move was announced."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOG = Lines()
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


def expect_failure(fn):
    """Call fn with every rank starting together; record how it ended and how long this rank took."""
    dist.barrier()
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: B036  (KeyboardInterrupt and DCP's BaseException are outcomes too)
        return {"raised": type(e).__name__, "msg": str(e), "secs": round(time.monotonic() - t0, 3)}
    return {"raised": None, "msg": "", "secs": round(time.monotonic() - t0, 3)}


class patched:
    """Replace ckpt.<name> (or ckpt.<Class>.<name>) on one rank only; the others run the real thing."""

    def __init__(self, name, on_rank, fake):
        *owner, self.attr = name.split(".")
        self.owner = getattr(ckpt, owner[0]) if owner else ckpt
        self.on, self.fake = on_rank, fake

    def __enter__(self):
        self.real = self.owner.__dict__[self.attr]
        if RANK == self.on:
            setattr(self.owner, self.attr, self.fake)

    def __exit__(self, *exc):
        setattr(self.owner, self.attr, self.real)


def raiser(exc):
    def fake(*a, **k):
        raise exc
    return fake


def recover(root, model, opt, extra, step, load_too=False, reload_first=False):
    """A normal save (and load) on the same ranks right after a failure: healthy ranks must not stay broken.

    reload_first: after a failed load the model may hold part of the checkpoint on some ranks (ckpt's
    docstring says so); the recovery a user does is to load again, before training or saving."""
    dist.barrier()
    t0 = time.monotonic()
    out = {}
    try:
        if reload_first:
            out["reload"] = ckpt.load(root, model, opt, extra, timeout=HOUR)
        path = ckpt.save(root, step, model, opt, extra, timeout=HOUR)
        out["save_after"] = os.path.basename(path)
        if load_too:
            out["load_after"] = ckpt.load(root, model, opt, extra, timeout=HOUR)
    except BaseException as e:  # noqa: B036
        out["recover_error"] = f"{type(e).__name__}: {e}"
    out["recover_secs"] = round(time.monotonic() - t0, 3)
    return out


# ------------------------------------------------------------------------------------------ 1. rollback


def rollback(root, keep, new_run):
    """Save 1..4 (keep=3), load the step-2 dir explicitly, train differently, save 3 and 4 with `keep`;
    load(root) into a fresh model in between."""
    model, opt = make()
    saved_weights = {}
    for s in range(1, 5):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, keep=3, timeout=HOUR)
        saved_weights[s] = weights(model)
    old3 = ckpt.read_manifest(os.path.join(root, "step-00000003"))
    if new_run:
        ckpt.close()  # the first run ends here; what follows is the relaunched one (a new run id)
        model, opt = make(seed=5)
    got = ckpt.load(os.path.join(root, "step-00000002"), model, opt, timeout=HOUR)
    train(model, opt, 100)  # the new branch: different data after step 2
    branch = weights(model)
    out = {"loaded": got, "branch_weights": branch, "old3_weights": saved_weights[3]}
    r = expect_failure(lambda: out.update(saved=os.path.basename(ckpt.save(root, 3, model, opt, keep=keep,
                                                                          timeout=HOUR))))
    out["save3"] = r
    out["after_save3"] = listing(root)
    out["found"] = os.path.basename(ckpt.find_checkpoint(root) or "")
    out["committed_steps"] = ckpt.committed_steps(root)
    aside = [n for n in listing(root) if n.startswith(".abandoned-step-00000003-")]
    out["aside"] = [{"name": n, **{k: ckpt.read_manifest(os.path.join(root, n))[k] for k in ("step", "seq")}}
                    for n in aside]
    out["old3_seq"] = old3["seq"]
    if r["raised"] is None:
        new3 = ckpt.read_manifest(os.path.join(root, "step-00000003"))
        out["new3"] = {"seq": new3["seq"], "parent": new3.get("parent")}
        fresh, fresh_opt = make(seed=9)
        out["reloaded"] = ckpt.load(root, fresh, fresh_opt, timeout=HOUR)
        out["reloaded_weights"] = weights(fresh)
        # The new branch goes on: step 4 exists on the abandoned branch too.
        train(model, opt, 101)
        r4 = expect_failure(lambda: ckpt.save(root, 4, model, opt, keep=keep, timeout=HOUR))
        out["save4"] = r4
        out["after_save4"] = listing(root)
        out["found_after_save4"] = os.path.basename(ckpt.find_checkpoint(root) or "")
    return out


def scen_rollback_same_run(root):
    return rollback(root, keep=3, new_run=False)


def scen_rollback_keep1(root):
    return rollback(root, keep=1, new_run=True)


def scen_rollback_new_run(root):
    return rollback(root, keep=3, new_run=True)


def scen_same_step_twice(root):
    """Without a rollback, a step this run's state descends from is never overwritten or moved aside."""
    model, opt = make()
    for s in (1, 2):
        train(model, opt, s)
        ckpt.save(root, s, model, opt, timeout=HOUR)
    train(model, opt, 3)
    return {"again": expect_failure(lambda: ckpt.save(root, 2, model, opt, timeout=HOUR)),
            "older": expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR)),
            "listing": listing(root)}


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


# ------------------------------------------------------------------------------------------ 2. one run per root


def owner_file(root):
    path = os.path.join(root, ckpt.OWNER)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def fake_owner(root, host, pid, age):
    """Rank 0 writes another run's claim, last refreshed `age` seconds ago (atomically: ranks read it)."""
    dist.barrier()
    if RANK == 0:
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, ckpt.OWNER)
        with open(path + ".new", "w") as f:
            json.dump({"run": "feedfacefeedface", "host": host, "pid": pid, "job": "4242",
                       "started": "2020-01-01T00:00:00+00:00"}, f)
        t = time.time() - age
        os.utime(path + ".new", (t, t))
        os.replace(path + ".new", path)
    dist.barrier()


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=30)
    return proc.pid


def scen_second_live_run(root):
    """args.live_root is held by the --holder job: check_root, save and load must be refused, its files kept."""
    root = args.live_root
    before = listing(root)
    model, opt = make()
    out = {"holder_owner": owner_file(root), "before": before,
           "check_root": expect_failure(lambda: ckpt.check_root(root, timeout=HOUR)),
           "save": expect_failure(lambda: ckpt.save(root, 5, model, opt, timeout=HOUR)),
           "load": expect_failure(lambda: ckpt.load(root, model, opt, timeout=HOUR)),
           "after": listing(root)}
    return out


def scen_dead_owner(root):
    """Same host, pid gone: taken over at once (logged); only the dead run's temporaries are removed."""
    fake_owner(root, socket.gethostname(), dead_pid(), age=0)
    if RANK == 0:
        os.makedirs(os.path.join(root, ".tmp-step-00000009-deadbeef"))
        open(os.path.join(root, ".tmp-step-00000009-deadbeef", "__0_0.distcp"), "w").close()
        open(os.path.join(root, ".nfs1234"), "w").close()
        os.makedirs(os.path.join(root, "lost+found"))
    dist.barrier()
    LOG.lines.clear()
    r = expect_failure(lambda: ckpt.check_root(root, timeout=HOUR))
    took_over = [ln for ln in LOG.lines if "taking over" in ln]
    after_check = listing(root)
    model, opt = make()
    saved = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR))
    return {"check_root": r, "log": took_over, "owner": owner_file(root), "my_pid": os.getpid(),
            "after_check": after_check, "save": saved, "after_save": listing(root)}


def scen_stale_owner(root):
    """Another host's claim: refused while fresh, taken over once older than stale_after (logged)."""
    fake_owner(root, "elsewhere", 12345, age=0)
    fresh = expect_failure(lambda: ckpt.check_root(root, timeout=HOUR, stale_after=2))
    owner_kept = owner_file(root)
    fake_owner(root, "elsewhere", 12345, age=10)
    LOG.lines.clear()
    stale = expect_failure(lambda: ckpt.check_root(root, timeout=HOUR, stale_after=2))
    return {"fresh": fresh, "owner_after_refusal": owner_kept, "stale": stale,
            "log": [ln for ln in LOG.lines if "taking over" in ln], "owner": owner_file(root),
            "my_pid": os.getpid()}


def scen_foreign_entries(root):
    """.nfsXXXX and lost+found (a mount point) in a fresh root: not touched, root not refused."""
    if RANK == 0:
        os.makedirs(os.path.join(root, "lost+found"))
        open(os.path.join(root, ".nfs0000000001234"), "w").close()
    dist.barrier()
    model, opt = make()
    out = {"check_root": expect_failure(lambda: ckpt.check_root(root, timeout=HOUR)),
           "save": expect_failure(lambda: ckpt.save(root, 1, model, opt, keep=1, timeout=HOUR)),
           "save2": expect_failure(lambda: ckpt.save(root, 2, model, opt, keep=1, timeout=HOUR))}
    out["load"] = expect_failure(lambda: out.update(step=ckpt.load(root, model, opt, timeout=HOUR)))
    out["after"] = listing(root)
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


def scen_load_user_load_state_dict(root):
    return injected(root, 0, "the user's load_state_dict()", kind="load", box_fail="load_state_dict")


def scen_save_checksum(root):
    return injected(root, 1, "checksumming the files this rank writes", patch=("_crc", raiser(eio("checksum"))))


def scen_load_read_metadata(root):
    return injected(root, 1, "reading .metadata", kind="load",
                    patch=("read_metadata", raiser(eio("read .metadata"))))


def scen_load_set_state_dict(root):
    return injected(root, 1, "set_state_dict", kind="load",
                    patch=("set_state_dict", raiser(RuntimeError("set_state_dict broke (injected)"))))


def scen_save_prepare_rank0(root):
    return injected(root, 0, "_prepare on rank 0", patch=("_prepare", raiser(eio("mkdir"))))


def scen_save_retain(root):
    return injected(root, 0, "retention (any exception)", patch=("_retain", raiser(eio("retention"))))


def scen_save_stage_async(root):
    """async_save=True and staging (the copy to host memory) fails on rank 1, e.g. out of host memory: rank 0
    has staged and started its upload. Then an async save, a save and a load on the same ranks."""
    model, opt = make()
    train(model, opt, 1)
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    train(model, opt, 2)
    with patched("DefaultStager.stage", 1, raiser(RuntimeError("out of host memory while staging (injected)"))):
        r = expect_failure(lambda: ckpt.save(root, 2, model, opt, async_save=True, timeout=HOUR).wait())
    out = {"fail_rank": 1, "where": "staging", **r, "committed_after_failure": ckpt.committed_steps(root)}
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
    LOG.lines.clear()
    with patched("shutil.rmtree", 0, raiser(PermissionError(13, "Permission denied (injected)"))):
        r = expect_failure(lambda: ckpt.save(root, 3, model, opt, keep=2, timeout=HOUR))
    return {**r, "log": [ln for ln in LOG.lines if "retention" in ln], "committed": ckpt.committed_steps(root),
            "listing": listing(root), **recover(root, model, opt, None, 4, load_too=True)}


def scen_load_hash(root):
    hasher = "_crc" if hasattr(ckpt, "_crc") else "_checksum"  # whichever hashes bytes at load
    return injected(root, 1, f"hashing at load ({hasher})", kind="load", patch=(hasher, raiser(eio("checksum"))))


def scen_load_read_data(root):
    return injected(root, 1, "reading this rank's shards", kind="load",
                    patch=("SafeReader.read_data", raiser(eio("read shard"))))


def mismatch(root, **per_rank):
    """save() with one argument different on the two ranks; then a normal save."""
    model, opt = make()
    kw = {k: v[RANK] for k, v in per_rank.items()}
    r = expect_failure(lambda: ckpt.save(root, 1, model, opt, timeout=HOUR, **kw))
    ckpt.wait_pending()
    return {**r, "mine": kw, "committed_after_failure": ckpt.committed_steps(root),
            **recover(root, model, opt, None, 2)}


def scen_args_async_save(root):
    return mismatch(root, async_save=(True, False))


def scen_args_keep(root):
    return mismatch(root, keep=(5, 7))


def scen_args_rng(root):
    return mismatch(root, rng=(True, False))


def scen_args_load_rng(root):
    model, opt = make()
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    r = expect_failure(lambda: ckpt.load(root, model, opt, rng=(True, False)[RANK], timeout=HOUR))
    return {**r, "mine": {"rng": (True, False)[RANK]}, **recover(root, model, opt, None, 2, load_too=True)}


# ------------------------------------------------------------------------------------------ 4. smaller ones


def scen_big_step(root):
    """Steps of any size: 10**8 is step-100000000, and it orders and loads like any other."""
    model, opt = make()
    train(model, opt, 1)
    out = {"save": os.path.basename(ckpt.save(root, 10**8, model, opt, timeout=HOUR))}
    w = weights(model)
    train(model, opt, 2)
    out["save2"] = os.path.basename(ckpt.save(root, 10**8 + 1, model, opt, keep=1, timeout=HOUR))
    w2 = weights(model)
    out["check_root"] = expect_failure(lambda: ckpt.check_root(root, timeout=HOUR))
    out["committed_steps"] = ckpt.committed_steps(root)
    fresh, fresh_opt = make(seed=4)
    out["load_root"] = ckpt.load(root, fresh, fresh_opt, timeout=HOUR)
    out["weights_match"] = weights(fresh) == w2
    ckpt.save(root, 10**9, fresh, fresh_opt, keep=None, timeout=HOUR)
    out["load_explicit"] = ckpt.load(os.path.join(root, "step-100000001"), fresh, fresh_opt, timeout=HOUR)
    out["first_differs"] = w != w2
    out["listing"] = listing(root)
    return out


def scen_interrupted_wait(root):
    """Ctrl-C inside PendingSave.wait(): the save stays in flight, its directory is kept, a later wait commits."""
    model, opt = make()
    train(model, opt, 1)
    pending = ckpt.save(root, 1, model, opt, async_save=True, timeout=HOUR)
    real = pending.job.result

    def interrupted(*a, **k):
        pending.job.result = real  # only the first call is interrupted
        raise KeyboardInterrupt

    pending.job.result = interrupted
    r = expect_failure(pending.wait)
    out = {"wait": r, "in_flight_after": pending in ckpt._in_flight,
           "tmp_after": [n for n in listing(root) if n.startswith(".tmp-step-00000001")]}
    train(model, opt, 2)
    out["save2"] = expect_failure(lambda: out.update(path2=os.path.basename(ckpt.save(root, 2, model, opt,
                                                                                      timeout=HOUR))))
    out["pending_path"] = os.path.basename(pending.path or "")
    out["committed"] = ckpt.committed_steps(root)
    out["in_flight_end"] = len(ckpt._in_flight)
    out["listing"] = listing(root)
    return out


def scen_timeout_recovery(root):
    """timeout=2 s, rank 1 arrives 5 s late: both fail; then the next save (same timeout) works on both."""
    model, opt = make()
    ckpt.save(root, 1, model, opt, timeout=2)  # the 2-s group exists, as after any earlier save

    def late():
        if RANK == 1:
            time.sleep(5)
        ckpt.save(root, 2, model, opt, timeout=2)

    r = expect_failure(late)
    out = {**r, "committed_after_failure": ckpt.committed_steps(root)}
    dist.barrier()
    t0 = time.monotonic()
    try:
        out["save_after"] = os.path.basename(ckpt.save(root, 3, model, opt, timeout=2))
    except BaseException as e:  # noqa: B036
        out["recover_error"] = f"{type(e).__name__}: {e}"
    out["recover_secs"] = round(time.monotonic() - t0, 3)
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
    """A load that failed on one rank mid-read leaves the ranks' state apart; what save() then commits must load."""
    model, opt = make()
    train(model, opt, 1)
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    train(model, opt, 2)
    with patched("SafeReader.read_data", 1, raiser(eio("read shard"))):
        failed = expect_failure(lambda: ckpt.load(root, model, opt, timeout=HOUR))
    steps = sorted({float(st["step"]) for st in opt.state.values()})
    saved = expect_failure(lambda: ckpt.save(root, 2, model, opt, timeout=HOUR))
    loaded = expect_failure(lambda: ckpt.load(root, model, opt, timeout=HOUR)) if saved["raised"] is None else None
    return {"failed_load": failed, "optimizer_steps": steps, "save": saved, "load": loaded,
            "committed": ckpt.committed_steps(root)}


ORDER = [
    "second_live_run", "rollback_same_run", "rollback_keep1", "rollback_new_run", "same_step_twice",
    "find_ignores_abandoned",
    "dead_owner", "stale_owner", "foreign_entries",
    "save_user_state_dict", "load_user_load_state_dict", "save_checksum", "load_read_metadata",
    "load_set_state_dict", "save_prepare_rank0", "save_retain", "retention_cannot_delete",
    "args_async_save", "args_keep", "args_rng", "args_load_rng",
    "big_step", "interrupted_wait", "load_hash", "load_read_data", "save_after_failed_load",
    "timeout_recovery", "timeout_first_save",
    "save_stage_async",  # last: a hang here (watchdog) loses no other scenario
]
results = {}


def dump():
    path = os.path.join(args.out, f"results.{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def hung(name):
    results[name] = {"hung_after_s": SCENARIO_LIMIT}
    dump()
    with open(os.path.join(args.out, f"hung.{RANK}.txt"), "w") as f:  # where each thread waits
        faulthandler.dump_traceback(f, all_threads=True)
    print(f"rank {RANK}: scenario {name} still running after {SCENARIO_LIMIT} s: giving up", flush=True)
    os._exit(3)


def holder(root):
    """A live run on root: it keeps its claim until the main job has tried to use the root."""
    model, opt = make()
    ckpt.check_root(root, timeout=HOUR)
    ckpt.save(root, 1, model, opt, timeout=HOUR)
    base = os.path.dirname(args.out.rstrip("/"))
    if RANK == 0:
        open(os.path.join(base, "ready"), "w").close()
    deadline = time.monotonic() + 400
    while not os.path.exists(os.path.join(base, "release")) and time.monotonic() < deadline:
        time.sleep(0.2)
    dist.barrier()
    train(model, opt, 2)
    results["holder"] = {"released": os.path.exists(os.path.join(base, "release")),
                         "save2": os.path.basename(ckpt.save(root, 2, model, opt, timeout=HOUR)),
                         "owner_before_close": owner_file(root)}
    ckpt.close()
    results["holder"]["owner_after_close"] = owner_file(root)
    results["holder"]["committed"] = ckpt.committed_steps(root)
    dump()


try:
    if args.holder:
        holder(args.holder)
    else:
        for name in ORDER:
            if (args.only and name not in args.only) or (name == "second_live_run" and not args.live_root):
                continue
            timer = threading.Timer(SCENARIO_LIMIT, hung, (name,))
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
        # Every claim in the work dir is this job's by now (the fake ones were taken over).
        claimed = lambda: sorted(n for n in os.listdir(args.work) if owner_file(os.path.join(args.work, n)))  # noqa
        dist.barrier()
        results["close"] = {"claimed_before": claimed()}
        ckpt.close()
        dist.barrier()
        results["close"]["claimed_after"] = claimed()
        dump()
finally:
    dist.barrier()
    gc.collect()  # the scenarios' FSDP2 models hold the process group: free them before the teardown (README)
    dist.destroy_process_group()
