"""Fault injection: crashes, failing or slow storage, preemption, misuse, damaged and hostile checkpoints.

Each test injects one fault into real torchrun jobs (CPU, gloo, 2 ranks) and checks
what the field needs to be true afterwards: the newest *committed* checkpoint is
what a resume uses, the loss curve from there equals the uninterrupted run bit for
bit, every rank reports a failure in bounded time with the rank and the cause, and
nothing from a checkpoint file runs as code. Faults in train_fsdp.py runs are
injected by tests/inject.py, which patches ckpt/DCP from outside the shipped files.

    python -m pytest -q -s tests/test_faults.py
"""

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest

import ckpt
from tests.harness import REPO, SMALL, read_log, torchrun

INJECT = os.path.join(REPO, "tests", "inject.py")
STEPS = 8
# keep=1: a single good checkpoint at a time, so a retention that ran too early would leave none.
COMMON = SMALL + ["--steps", str(STEPS), "--save-every", "2", "--keep", "1", "--dropout", "0.1", "--seed", "7",
                  "--timeout", "60", "--ckpt-timeout", "60"]
KILL_STEP = 6  # the save the kill hits; step 4 is then the newest committed checkpoint


def fault_run(d, fault, rank, step, args, delay=0.0, timeout=120):
    """One torchrun job of train_fsdp.py under tests/inject.py; returns (rc, output, evidence, seconds)."""
    ev = d / "evidence"
    ev.mkdir(exist_ok=True)
    env = dict(os.environ, FAULT=fault, FAULT_RANK=str(rank), FAULT_STEP=str(step), FAULT_DELAY=str(delay),
               FAULT_DIR=str(ev))
    t0 = time.monotonic()
    rc, out = torchrun(args, script=INJECT, env=env, check=False, timeout=timeout)
    return rc, out, evidence(ev), time.monotonic() - t0


def evidence(ev):
    """{"error.1": text, "fired.0": text, ...}: what each rank of a fault run left behind."""
    return {p.name: p.read_text() for p in sorted(ev.iterdir())}


def on_disk(root):
    """(committed steps, leftover temp entries); every committed checkpoint must pass its checksums."""
    steps = ckpt.committed_steps(str(root))
    for s in steps:
        path = ckpt.step_dir(str(root), s)
        assert ckpt.verify_files(path, ckpt.read_manifest(path)) == [], f"committed {path} does not verify"
    return steps, sorted(n for n in os.listdir(root) if n.startswith(ckpt.TMP_PREFIX))


def resumed_step(out):
    m = re.search(r"resumed from step (\d+)", out)
    assert m, f"no 'resumed from step' line in:\n{out[-3000:]}"
    return int(m.group(1))


def assert_same_losses(reference, log, steps):
    """Bit-exact: the same float for every step (== on the float, not a tolerance)."""
    assert sorted(log) == list(steps), f"logged steps {sorted(log)}, expected {list(steps)}"
    for s in steps:
        assert log[s]["loss"] == reference[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {reference[s]['loss']!r}"
        assert log[s]["lr"] == reference[s]["lr"], f"step {s}: lr differs"
    return max(abs(log[s]["loss"] - reference[s]["loss"]) for s in steps)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (keep=2, so its steps 6 and 8 also serve the corruption tests)."""
    d = tmp_path_factory.mktemp("reference")
    torchrun(COMMON + ["--keep", "2", "--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    assert ckpt.committed_steps(str(d / "ckpt")) == [6, 8]
    return {"log": log, "ckpt": d / "ckpt"}


# ---------------------------------------------------------------------------
# 1. SIGKILL of one rank at each point of a save
# ---------------------------------------------------------------------------

# fault, killed rank, committed steps right after the kill, leftover temp entry
KILLS = [
    ("kill_before_write", 1, [4], ".tmp-step-00000006"),    # temp dir made, no byte of rank 1's shard
    ("kill_mid_write", 1, [4], ".tmp-step-00000006"),       # rank 1's shard torn at 256 KiB
    ("kill_before_commit", 0, [4], ".tmp-step-00000006"),   # every file and the manifest written, not renamed
    ("kill_after_commit", 0, [4, 6], None),                 # renamed, retention (keep=1) never ran
    ("kill_mid_retain", 0, [6], ".tmp-delete-step-00000004"),  # step 4 half deleted
]


@pytest.mark.parametrize("fault,rank,committed,leftover", KILLS, ids=[k[0] for k in KILLS])
def test_kill_during_save(reference, tmp_path, fault, rank, committed, leftover):
    """A rank killed (OOM killer, node failure) at any point of a save: the field's torn checkpoint
    that resume trusts (Lightning #688), or retention deleting the last good one (KempnerForge #102)."""
    d = tmp_path
    args = COMMON + ["--ckpt-dir", str(d / "ckpt")]
    rc, out, ev, secs = fault_run(d, fault, rank, KILL_STEP, args + ["--log-file", str(d / "log1.jsonl")])
    assert f"fired.{rank}" in ev, f"the fault never fired:\n{out[-3000:]}"
    assert rc != 0, "a job with a killed rank must fail"
    steps, temps = on_disk(d / "ckpt")
    print(f"\n{fault} (rank {rank}, save of step {KILL_STEP}): {ev[f'fired.{rank}']}; job exit {rc} after "
          f"{secs:.1f} s; committed {steps}, leftovers {temps}")
    assert steps == committed, "the newest committed checkpoint must be the last one that completed"
    # Temporary names carry a unique suffix (.tmp-step-00000006-1a2b3c4d): a leftover never blocks a later save.
    assert [t.rsplit("-", 1)[0] if t.startswith(".tmp-step") else t for t in temps] == ([leftover] if leftover else [])
    leftover = temps[0] if temps else None
    if fault == "kill_mid_write":
        torn = d / "ckpt" / leftover / "__1_0.distcp"
        print(f"torn shard {torn.name}: {torn.stat().st_size} bytes")
        assert torn.stat().st_size == 256 * 1024
    if fault == "kill_before_commit":
        # The dangerous leftover: complete files and a valid manifest, only the rename missing.
        assert (d / "ckpt" / leftover / "manifest.json").is_file()
    killed_log = read_log(d / "log1.jsonl")
    assert_same_losses(reference["log"], killed_log, range(1, KILL_STEP + 1))

    _, out = torchrun(args + ["--resume", "--log-file", str(d / "log2.jsonl")])
    start = resumed_step(out)
    dloss = assert_same_losses(reference["log"], read_log(d / "log2.jsonl"), range(start + 1, STEPS + 1))
    steps_after, temps_after = on_disk(d / "ckpt")
    print(f"resumed from step {start}: steps {start + 1}..{STEPS} max |dloss| = {dloss:.3e}; "
          f"afterwards committed {steps_after}, leftovers {temps_after}")
    assert start == committed[-1]
    if leftover:
        # The resumed run claims the root at start-up; the dead run's leftovers go then, with a log line.
        assert f"removed {d / 'ckpt' / leftover}, left by an interrupted save" in out, "the leftover must be cleaned up"
    assert steps_after == [STEPS] and temps_after == []


# ---------------------------------------------------------------------------
# 2. One rank's write fails: disk full
# ---------------------------------------------------------------------------


def test_enospc_on_one_rank(reference, tmp_path):
    """Disk full on one rank: the field's save that failed on one rank only, while the others
    carried on and a later resume loaded something else on that rank (composer #2146)."""
    d = tmp_path
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")]
    rc, out, ev, secs = fault_run(d, "enospc", 1, KILL_STEP, args)
    assert "fired.1" in ev and rc != 0
    steps, temps = on_disk(d / "ckpt")
    print(f"\nENOSPC on rank 1 at step {KILL_STEP}: exit {rc} after {secs:.1f} s; committed {steps}, leftovers {temps}")
    for r in (0, 1):
        err = ev.get(f"error.{r}", "")
        why = [line.strip() for line in err.splitlines() if "No space left" in line]
        print(f"rank {r} raised: {err[:160]}... {why[:1]}")
        assert re.search(r"rank 1\b|RANK 1\b", err), f"rank {r}'s error must say that rank 1 failed"
        assert "No space left on device" in err, f"rank {r}'s error must say why"
    assert steps == [4], "nothing new may be committed, and the previous checkpoint must stay"
    assert not os.path.exists(ckpt.step_dir(str(d / "ckpt"), KILL_STEP))


# ---------------------------------------------------------------------------
# 3. Slow storage: the checkpoint group's own timeout, not the training one
# ---------------------------------------------------------------------------

SHORT = 4  # seconds: a tight training (and, in the second case, checkpoint) timeout
DELAY = 3 * SHORT  # rank 1's write of step 4 stalls this long


@pytest.mark.parametrize("ckpt_timeout", [60, SHORT], ids=["ckpt_timeout_long", "ckpt_timeout_short"])
def test_slow_storage(reference, tmp_path, ckpt_timeout):
    """A write that takes longer than the training timeout: the field's checkpoint collectives run
    under the training timeout and a slow filesystem kills the job (Fast-LLM #543, llm-foundry #733).
    With a short checkpoint timeout as well, every rank must fail with a timeout, not hang."""
    d = tmp_path
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"),
                     "--timeout", str(SHORT), "--ckpt-timeout", str(ckpt_timeout)]
    rc, out, ev, secs = fault_run(d, "slow_write", 1, 4, args, delay=DELAY)
    assert "fired.1" in ev
    steps, temps = on_disk(d / "ckpt")
    if ckpt_timeout > DELAY:
        m = re.search(r"step-00000004 \| [\d.]+ MB \| ([\d.]+) s", out)
        assert rc == 0 and m, out[-3000:]
        dloss = assert_same_losses(reference["log"], read_log(d / "log.jsonl"), range(1, STEPS + 1))
        print(f"\nrank 1 write stalled {DELAY} s under --timeout {SHORT}: save of step 4 took {float(m.group(1)):.1f} s "
              f"and committed; run finished in {secs:.1f} s, max |dloss| vs reference = {dloss:.3e}")
        assert float(m.group(1)) >= DELAY > SHORT
        assert steps == [STEPS]
    else:
        print(f"\nrank 1 write stalled {DELAY} s under --ckpt-timeout {SHORT}: exit {rc} after {secs:.1f} s; "
              f"committed {steps}")
        for r in (0, 1):
            err = ev.get(f"error.{r}", "")
            print(f"rank {r} raised: {err[:400]}")
            assert err.startswith("CheckpointError") and "step-00000004" in err, f"rank {r} must fail the save"
        assert re.search(r"[Tt]imed out|timeout", ev["error.0"]), "the waiting rank must say it timed out"
        ev_dir = d / "evidence"
        when = {n: (ev_dir / n).stat().st_mtime - (ev_dir / "fired.1").stat().st_mtime for n in ("error.0", "error.1")}
        print(f"after rank 1's stall began: rank 0 raised at {when['error.0']:.1f} s, rank 1 at {when['error.1']:.1f} s")
        assert when["error.0"] < DELAY, "rank 0 must give up by its own timeout, while rank 1 is still stalled"
        assert when["error.1"] < DELAY + 15, "rank 1 must fail as soon as its write returns"
        assert rc != 0 and steps == [2]


# ---------------------------------------------------------------------------
# 4. Preemption: SIGTERM to one rank, or to every rank through torchrun
# ---------------------------------------------------------------------------

GRACE = 30  # seconds: torchrun's (and a typical scheduler's) wait between SIGTERM and SIGKILL


@pytest.mark.parametrize("target", ["one_rank", "all_ranks"])
def test_preemption(reference, tmp_path, target):
    """SIGTERM during training: the field's preemptions that saved nothing (spd #741: flag checked
    too rarely) or deadlocked (one rank exiting alone while the others wait in a collective)."""
    d = tmp_path
    ev = d / "evidence"
    ev.mkdir()
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log1.jsonl")]
    # Every rank sleeps 0.5 s after each step, so that the signal lands during training;
    # rank 1 writes ready.1 after step 3.
    env = dict(os.environ, FAULT="preempt", FAULT_RANK="1", FAULT_STEP="3", FAULT_DELAY="0.5", FAULT_DIR=str(ev),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", INJECT, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (ev / "ready.1").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was signalled"
            time.sleep(0.05)
        victim = int((ev / "ready.1").read_text()) if target == "one_rank" else proc.pid  # torchrun forwards
        t_signal = time.monotonic()
        os.kill(victim, signal.SIGTERM)
        out, _ = proc.communicate(timeout=GRACE + 30)
        grace = time.monotonic() - t_signal
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    got = evidence(ev)
    steps, temps = on_disk(d / "ckpt")
    stopped = max(read_log(d / "log1.jsonl"))
    print(f"\nSIGTERM to {'rank 1' if target == 'one_rank' else 'torchrun (forwarded to both ranks)'} after step 3: "
          f"stopped after step {stopped}, exit codes rank0={got.get('exit.0')} rank1={got.get('exit.1')} "
          f"torchrun={proc.returncode}, {grace:.1f} s from signal to exit; committed {steps}")
    assert got.get("exit.0") == "0" and got.get("exit.1") == "0", f"both ranks must return 0:\n{out[-3000:]}"
    assert "preempted (SIGTERM on some rank)" in out, "rank 0 must have learnt of the signal"
    assert 3 <= stopped < STEPS and steps == [stopped] and temps == []
    assert grace < GRACE
    if target == "one_rank":
        assert proc.returncode == 0

    _, out = torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--resume", "--log-file", str(d / "log2.jsonl")])
    start = resumed_step(out)
    assert start == stopped
    dloss = assert_same_losses(reference["log"], read_log(d / "log1.jsonl"), range(1, stopped + 1))
    dloss = max(dloss, assert_same_losses(reference["log"], read_log(d / "log2.jsonl"), range(start + 1, STEPS + 1)))
    print(f"resumed from step {start}: max |dloss| over all {STEPS} steps = {dloss:.3e}")


# ---------------------------------------------------------------------------
# 5. Misuse: save on one rank only, or with different arguments per rank (and, for 8, bad roots)
# ---------------------------------------------------------------------------

API_JOB = r'''
"""Tiny FSDP2 model; for each case every rank records what ckpt raised and how long it took."""
import datetime, json, os, sys, time
sys.path.insert(0, os.environ["REPO"])
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
import ckpt

out, root, ckpt_timeout, bad_roots = sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
for m in (model[0], model[2], model):
    fully_shard(m)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 16)).sum().backward()
opt.step()
ckpt.checkpoint_group(ckpt_timeout)

def case(name, fn):
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except BaseException as e:
        err = f"{type(e).__name__}: {e}"
    with open(f"{out}/{name}.{rank}.json", "w") as f:
        json.dump({"error": err, "seconds": time.monotonic() - t0}, f)
    return err

def save(r, step):
    ckpt.save(r, step, model, opt, timeout=ckpt_timeout)

for name, bad in bad_roots.items():
    case(f"root_{name}", lambda: ckpt.check_root(bad, timeout=ckpt_timeout))
case("different_root", lambda: save(root + ("-elsewhere" if rank == 1 else ""), 1))
case("different_step", lambda: save(root, 1 if rank == 0 else 2))

def rank0_only():
    if rank == 0:
        save(root, 3)
    dist.all_reduce(torch.ones(1))  # the next training step's collective

if case("rank0_only", rank0_only):  # last: it leaves the groups unusable
    os._exit(1)  # a failed rank ends its process; the other then fails in its pending collective
dist.destroy_process_group()
'''


def bad_root(d, case):
    """A checkpoint root that cannot hold checkpoints (tests run as root: chmod would not stop a write)."""
    if case == "fresh":  # the control: a new directory is fine
        return d / "fresh"
    if case == "under_a_file":
        (d / "a-file").write_text("x")
        return d / "a-file" / "ckpt"
    if case == "is_a_file":
        (d / "b-file").write_text("x")
        return d / "b-file"
    if case == "in_proc":
        return "/proc/ckpt-faults-test"
    (d / "data").mkdir()  # foreign_directory: somebody's data, not checkpoints
    (d / "data" / "corpus.txt").write_text("x")
    return d / "data"


ROOTS = ["fresh", "under_a_file", "is_a_file", "in_proc", "foreign_directory"]


@pytest.fixture(scope="module")
def api_job(tmp_path_factory):
    """One 2-rank job runs every misuse and bad-root case through ckpt's API."""
    d = tmp_path_factory.mktemp("api")
    (d / "job.py").write_text(API_JOB)
    (d / "out").mkdir()
    (d / "roots").mkdir()
    roots = {name: str(bad_root(d / "roots", name)) for name in ROOTS}
    t0 = time.monotonic()
    rc, out = torchrun([str(d / "out"), str(d / "ckpt"), str(SHORT), json.dumps(roots)], script=str(d / "job.py"),
                       check=False, env=dict(os.environ, REPO=REPO), timeout=90)
    print(f"\nckpt API job: exit {rc} after {time.monotonic() - t0:.1f} s")
    return d, out, roots


def job_results(d, out, case):
    res = []
    for r in (0, 1):
        path = d / "out" / f"{case}.{r}.json"
        assert path.is_file(), f"rank {r} never finished case {case}:\n{out[-3000:]}"
        res.append(json.loads(path.read_text()))
        print(f"\n{case}: rank {r} after {res[r]['seconds']:.1f} s: {str(res[r]['error'])[:300]}")
    return res


@pytest.mark.parametrize("case", ["different_root", "different_step", "rank0_only"])
def test_misuse(api_job, case):
    """save() called on rank 0 only (accelerate #1171, #2000: the others never join and the job
    hangs until a watchdog), or with per-rank paths or steps (OpenTau #396: shards scattered)."""
    d, out, _ = api_job
    res = job_results(d, out, case)
    assert all(r["error"] for r in res), "every rank must fail"
    if case == "different_root":
        for r in res:
            assert "different arguments" in r["error"] and f"{d / 'ckpt'}-elsewhere" in r["error"]
    elif case == "different_step":
        for r in res:
            assert "different arguments" in r["error"] and "step=1" in r["error"] and "step=2" in r["error"]
    else:
        # Rank 1 never entered save(), so only rank 0 can say why; rank 1 fails in its next collective.
        assert "is save/load called on every rank?" in res[0]["error"]
        assert SHORT <= res[0]["seconds"] < SHORT + 10, "rank 0 must fail when the checkpoint timeout expires"
    for r in res:
        assert r["seconds"] < SHORT + 20, "bounded: no rank may wait for a watchdog"
    roots = [p.name for p in d.iterdir() if p.name.startswith("ckpt")]
    committed = [s for p in roots for s in ckpt.committed_steps(str(d / p))]
    print(f"checkpoint roots afterwards: {roots}, committed steps {committed}")
    assert committed == []


# ---------------------------------------------------------------------------
# 6-7. Damaged and hostile checkpoints
# ---------------------------------------------------------------------------

LOADER = r'''
"""Loads each prepared checkpoint root into train_fsdp.py's model and records the outcome per rank."""
import datetime, gc, json, os, sys
sys.path.insert(0, os.environ["REPO"])
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import ckpt, train_fsdp

out, cases, canaries = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
args = train_fsdp.get_args(json.loads(os.environ["TRAIN_ARGS"]))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
model = train_fsdp.build_model(args, torch.device("cpu"))
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
sched = torch.optim.lr_scheduler.LambdaLR(opt, train_fsdp.lr_lambda(args))
extra = {"scheduler": sched, "train": train_fsdp.TrainState()}

class Evil:
    """Pickles as a call of os.system: whoever unpickles it with plain pickle runs the command."""
    def __init__(self, path):
        self.path = path
    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))

class Holder:
    def __init__(self, sd):
        self.sd = sd
    def state_dict(self):
        return self.sd
    def load_state_dict(self, sd):
        self.sd = sd

def record(name, fn):
    try:
        res = {"step": fn(), "error": None}
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        res = {"step": None, "error": f"{type(e).__name__}: {e}"}
    with open(f"{out}/{name}.{rank}.json", "w") as f:
        json.dump(res, f)

for name, root in cases.items():
    record(name, lambda: ckpt.load(root, model, opt, extra))

# A non-tensor item whose pickle runs a command. save() refuses such a value ...
evil_root = f"{out}/evil_bytes_ckpt"
record("evil_save", lambda: ckpt.save(evil_root, 1, model, opt, {"evil": Holder({"payload": Evil(f"{canaries}/bytes-canary")})}))
# ... so plant it as an attacker would, with valid checksums: here by letting this save accept it.
ckpt._PLAIN = (*ckpt._PLAIN, Evil)
ckpt.save(evil_root, 1, model, opt, {"evil": Holder({"payload": Evil(f"{canaries}/bytes-canary")})})
record("evil_bytes", lambda: ckpt.load(evil_root, model, opt, {"evil": Holder({"payload": 0})}))
# Control: stock DCP reads the same item with torch.load(weights_only=False), and the payload runs.
ckpt.save(evil_root, 2, model, opt, {"evil": Holder({"payload": Evil(f"{canaries}/stock-dcp-canary")})})
dcp.load({"extra.evil.payload": 0}, checkpoint_id=ckpt.step_dir(evil_root, 2))
del model, opt, sched
ckpt.close()
gc.collect()  # FSDP2 state holds the process group: free it before the teardown
dist.destroy_process_group()
'''


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def edit_manifest(path):
    m = json.loads(path.read_text())
    m["world_size"] = 4  # an edit that does not recompute manifest_sha256
    path.write_text(json.dumps(m))


class Evil:
    """Pickles as a call of os.system: plain pickle.load runs `touch path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def plant_metadata(ckpt_dir, canary):
    """An attacker's .metadata, with the manifest updated to match so every checksum passes."""
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(Evil(canary)))
    manifest_path = ckpt_dir / "manifest.json"
    m = json.loads(manifest_path.read_text())
    data = (ckpt_dir / ".metadata").read_bytes()
    m["files"][".metadata"].update(bytes=len(data), crc32=[f"{zlib.crc32(data):08x}"])  # one 16 MB block
    body = {k: v for k, v in m.items() if k != "manifest_sha256"}
    m["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    manifest_path.write_text(json.dumps(m))


# case: (damage done to step-00000008, the file the error must name)
DAMAGE = {
    "intact": (None, None),
    "truncated_shard": (lambda c: truncate(c / "__1_0.distcp"), "__1_0.distcp"),
    "flipped_byte": (lambda c: flip_byte(c / "__0_0.distcp"), "__0_0.distcp"),
    "missing_shard": (lambda c: (c / "__1_0.distcp").unlink(), "__1_0.distcp"),
    "missing_metadata": (lambda c: (c / ".metadata").unlink(), ".metadata"),
    "missing_manifest": (lambda c: (c / "manifest.json").unlink(), "manifest.json"),
    "edited_manifest": (lambda c: edit_manifest(c / "manifest.json"), "manifest.json"),
}


@pytest.fixture(scope="module")
def loads(reference, tmp_path_factory):
    """One job loads every damaged copy of the reference checkpoints (steps 6 and 8; 8 is damaged)."""
    d = tmp_path_factory.mktemp("loads")
    (d / "out").mkdir()
    cases = {}
    for name, (damage, _) in DAMAGE.items():
        shutil.copytree(reference["ckpt"], d / name)
        if damage:
            damage(d / name / "step-00000008")
        cases[name] = str(d / name)
    # A hostile .metadata: first show that the payload is live (plain pickle runs it) ...
    control = d / "control-canary"
    pickle.loads(pickle.dumps(Evil(control)))
    assert control.exists(), "the payload must work, or its absence below proves nothing"
    shutil.copytree(reference["ckpt"], d / "evil_metadata")
    plant_metadata(d / "evil_metadata" / "step-00000008", d / "metadata-canary")
    cases["evil_metadata"] = str(d / "evil_metadata")
    (d / "loader.py").write_text(LOADER)
    t0 = time.monotonic()
    torchrun([str(d / "out"), json.dumps(cases), str(d)], script=str(d / "loader.py"),
             env=dict(os.environ, REPO=REPO, TRAIN_ARGS=json.dumps(COMMON)), timeout=120)
    print(f"\nload job: {len(cases) + 1} loads in {time.monotonic() - t0:.1f} s")
    return d


def outcome(d, name):
    res = [json.loads((d / "out" / f"{name}.{r}.json").read_text()) for r in (0, 1)]
    assert res[0] == res[1], f"ranks disagree: {res}"
    return res[0]


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused(loads, case):
    """A truncated, bit-flipped or incomplete checkpoint: the field's resume that trusts whatever
    is on disk (Lightning #688, #19970) or silently goes back to an older step (composer #2146)."""
    res = outcome(loads, case)
    bad = DAMAGE[case][1]
    print(f"\n{case}: step {res['step']}, error: {str(res['error'])[:400]}")
    if bad is None:  # the control: the same job loads an undamaged copy
        assert res["error"] is None and res["step"] == STEPS
        return
    assert res["step"] is None and res["error"], "a damaged checkpoint must be refused, not loaded"
    assert f"step-00000008/{bad}" in res["error"], "the error must name the damaged file"
    assert f"newest older committed checkpoint is {loads / case / 'step-00000006'}" in res["error"]


def test_hostile_pickles_do_not_run(loads):
    """DCP reads .metadata with pickle.load and non-tensor items with weights_only=False: a
    checkpoint downloaded from someone else can run code. Both must be refused, the code never run."""
    meta, items, at_save = outcome(loads, "evil_metadata"), outcome(loads, "evil_bytes"), outcome(loads, "evil_save")
    print(f"\nsave() of the hostile value: {str(at_save['error'])[:200]}")
    assert "Evil" in at_save["error"] and "cannot restore" in at_save["error"]
    print(f"\nhostile .metadata (checksums made to match): {str(meta['error'])[:300]}")
    refusal = [line for line in str(items["error"]).splitlines() if "posix.system" in line]
    print(f"hostile non-tensor item: {str(items['error']).splitlines()[0][:200]} ... {refusal[:1]}")
    assert meta["step"] is None and "step-00000008/.metadata" in meta["error"]
    assert "refusing to load posix.system" in meta["error"]
    assert items["step"] is None and "Weights only load failed" in items["error"] and refusal
    # The controls: plain pickle runs the .metadata payload; stock DCP runs the item's payload.
    for canary, expected in (("control-canary", True), ("stock-dcp-canary", True),
                             ("metadata-canary", False), ("bytes-canary", False)):
        print(f"{canary} exists: {(loads / canary).exists()} (expected {expected})")
        assert (loads / canary).exists() == expected, canary


# ---------------------------------------------------------------------------
# 8. A checkpoint root that cannot be written or holds something else
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ROOTS)
def test_bad_root_is_refused(api_job, case):
    """A checkpoint root that cannot hold checkpoints (a path through a file, a mount that refuses
    writes, a data directory): ckpt.check_root refuses it on every rank, naming the path."""
    d, out, roots = api_job
    res = job_results(d, out, f"root_{case}")
    if case == "fresh":
        assert res[0]["error"] is None and res[1]["error"] is None
        assert os.listdir(roots[case]) == [".owner.json"], "the probe leaves nothing behind but this run's claim"
        return
    for r in res:
        assert r["error"] and r["error"].startswith("CheckpointError") and roots[case] in r["error"]
        assert r["seconds"] < SHORT, "a local check, not a timeout"


def test_train_refuses_bad_root_before_training(tmp_path):
    """train_fsdp.py pointed at a data directory: without the start-up check it trains until its
    first save and only then fails, losing that work."""
    root = bad_root(tmp_path, "foreign_directory")
    t0 = time.monotonic()
    rc, out = torchrun(COMMON + ["--ckpt-dir", str(root), "--log-file", str(tmp_path / "log.jsonl")],
                       check=False, timeout=90)
    lines = [line for line in out.splitlines() if "CheckpointError" in line]
    print(f"\nforeign --ckpt-dir: exit {rc} after {time.monotonic() - t0:.1f} s: {lines[-1][:300] if lines else None}")
    assert rc != 0
    assert "step     1" not in out and not (tmp_path / "log.jsonl").exists(), "no step may run"
    assert lines and str(root) in lines[-1], "the error must name the root"
    assert os.listdir(root) == ["corpus.txt"], "nothing may be written into a foreign directory"
