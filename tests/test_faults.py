"""Fault injection: crashes, failing or slow storage, preemption, misuse, damaged and hostile checkpoints.

Each test injects a fault into real 2-rank jobs (CPU, gloo) and checks what the field needs to be true afterwards:
the newest *committed* checkpoint is what a resume uses, the loss curve from there equals the uninterrupted run bit
for bit, every rank reports a failure in bounded time with the rank and the cause, and nothing from a checkpoint
file runs as code. Faults in train_fsdp.py runs are injected by tests/inject.py, which patches DCP / ckpt from
outside the shipped files and proves each fault fired (FAULT_DIR/fired.<rank>).

Speed: ranks are forked from warm processes (tests/launch.py) instead of torchrun, and runs are chained where a
scenario allows: the resume after one kill is the run the next kill hits, and the run after the last fault goes to
the end, so each kill point's resume is checked (newest commit, bit-exact losses) by the link that follows it.

    python -m pytest -q -s tests/test_faults.py
"""

import collections
import json
import os
import pickle
import re
import shutil
import signal
import time
import zlib

import pytest

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
from tests.harness import REPO, SMALL, read_log  # noqa: E402

INJECT = os.path.join(REPO, "tests", "inject.py")
TRAIN = os.path.join(REPO, "train_fsdp.py")
STEPS = 8
# SMALL with one layer (argparse keeps the last --n-layers): DCP's cost grows with the number of tensors.
# keep=1: a single good checkpoint at a time, so a retention that ran too early would leave none.
COMMON = SMALL + ["--n-layers", "1", "--steps", str(STEPS), "--save-every", "2", "--keep", "1", "--dropout", "0.1",
                  "--seed", "7", "--timeout", "60", "--ckpt-timeout", "60"]

Run = collections.namedtuple("Run", "rc rcs out ev secs")


def fault_run(d, name, fault, rank, step, args, delay=0.0, timeout=90):
    """One 2-rank job of train_fsdp.py under tests/inject.py; evidence in d/<name>/."""
    ev = d / name
    ev.mkdir()
    # FAULT_WORKER_POLL: a killed rank's DataLoader workers, which hold its gloo sockets, exit 0.5 s after it
    # (torch's 5 s would be most of a kill's run); its peer must still fail by itself, well before launch.GRACE.
    env = dict(os.environ, FAULT=fault, FAULT_RANK=str(rank), FAULT_STEP=str(step), FAULT_DELAY=str(delay),
               FAULT_DIR=str(ev), FAULT_WORKER_POLL="0.5")
    t0 = time.monotonic()
    job = launch.start([INJECT, *args], env=env, out=ev / "output.txt")
    rc, out = job.wait(timeout)
    return Run(rc, job.rcs, out, evidence(ev), time.monotonic() - t0)


def evidence(ev):
    """{"error.1": text, "fired.0": text, ...}: what each rank of a fault run left behind."""
    return {p.name: p.read_text() for p in sorted(ev.iterdir()) if p.name != "output.txt" and p.suffix != ".part"}


def on_disk(root):
    """(committed steps, leftover temporary entries); every committed checkpoint must pass its checksums."""
    steps = ckpt.committed_steps(str(root))
    for s in steps:
        path = ckpt.step_dir(str(root), s)
        assert ckpt.verify_files(path, ckpt.read_manifest(path)) == [], f"committed {path} does not verify"
    return steps, sorted(n for n in os.listdir(root) if n.startswith(ckpt.TMP))


def unsuffixed(names):
    """Temporary names without their unique suffix (.tmp-step-00000006-1a2b3c4d -> .tmp-step-00000006)."""
    return [n.rsplit("-", 1)[0] for n in names]


def resumed_step(out):
    m = re.search(r"resumed from step (\d+)", out)
    assert m, f"no 'resumed from step' line in:\n{out[-3000:]}"
    return int(m.group(1))


def assert_same_losses(reference, log, steps):
    """Bit-exact: the same float for every step (== on the float, not a tolerance); returns max |dloss|."""
    assert sorted(log) == list(steps), f"logged steps {sorted(log)}, expected {list(steps)}"
    for s in steps:
        assert log[s]["loss"] == reference[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {reference[s]['loss']!r}"
        assert log[s]["lr"] == reference[s]["lr"] and log[s]["samples"] == reference[s]["samples"], f"step {s}"
    return max(abs(log[s]["loss"] - reference[s]["loss"]) for s in steps)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run (keep=2, so its steps 6 and 8 also serve the damaged-checkpoint tests)."""
    d = tmp_path_factory.mktemp("reference")
    t0 = time.monotonic()
    launch.run([TRAIN, *COMMON, "--keep", "2", "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl"])
    log = read_log(d / "log.jsonl")
    print(f"\nreference run: {STEPS} steps in {time.monotonic() - t0:.1f} s (the first job also warms the launcher)")
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[STEPS]["loss"] < log[1]["loss"] - 0.3, "the loss must fall for the comparisons to mean anything"
    assert ckpt.committed_steps(str(d / "ckpt")) == [6, 8]
    return {"log": log, "ckpt": d / "ckpt"}


# ---------------------------------------------------------------------------
# 1-2. SIGKILL of a rank at each point of a save, and ENOSPC on one rank: one chain of runs on one root
# ---------------------------------------------------------------------------

# fault, rank, the save it hits, committed steps right after, leftover temp entries. Each run resumes from the
# newest commit the one before left; the run after the last fault trains to the end.
CHAIN = [
    ("kill_before_write", 1, 4, [2], []),      # temp dir made, no byte of rank 1's shard: rank 0 removes it
    ("kill_mid_write", 1, 4, [2], []),         # rank 1's shard torn at 256 KiB: rank 0 removes the temp dir
    ("kill_before_commit", 0, 4, [2], [".tmp-step-00000004"]),   # every file and the manifest written, not renamed
    ("kill_after_commit", 0, 4, [2, 4], []),                 # renamed, retention (keep=1) never ran
    ("kill_mid_retain", 0, 6, [6], [".tmp-delete-step-00000002", ".tmp-delete-step-00000004"]),  # both out of sight
    ("enospc", 1, 8, [6], [".tmp-step-00000008"]),           # rank 1's write fails: disk full
]
Link = collections.namedtuple("Link", "run log start committed temps leftover_verifies")


@pytest.fixture(scope="module")
def chain(reference, tmp_path_factory):
    d = tmp_path_factory.mktemp("chain")
    root = d / "ckpt"
    links = []
    for i, (fault, rank, step, _, _) in enumerate(CHAIN + [("none", 1, 0, None, None)]):
        log = d / f"log{i}.jsonl"
        args = [*COMMON, "--ckpt-dir", root, "--log-file", log] + (["--resume"] if i else [])
        run = fault_run(d, f"{i}-{fault}", fault, rank, step, args)
        start = resumed_step(run.out) if i else 0
        steps, temps = on_disk(root)
        verifies = None
        if fault == "kill_before_commit" and temps and (root / temps[0] / ckpt.MANIFEST).is_file():
            verifies = ckpt.verify_files(str(root / temps[0]), ckpt.read_manifest(str(root / temps[0]))) == []
        links.append(Link(run, read_log(log) if log.exists() else {}, start, steps, temps, verifies))
        print(f"\nchain run {i} ({fault}, rank {rank}, save of step {step}): started at step {start}, exit codes "
              f"{run.rcs} after {run.secs:.1f} s; committed {steps}, leftovers {temps}")
    return root, links


@pytest.mark.parametrize("i", range(5), ids=[c[0] for c in CHAIN[:5]])
def test_kill_during_save(reference, chain, i):
    """A rank killed (OOM killer, node failure) at any point of a save: the field's torn checkpoint that resume
    trusts (Lightning #688), or retention deleting the last good one (KempnerForge #102). The next run must
    resume from the newest commit (never a temp dir, even a complete one) and continue bit-exactly."""
    root, links = chain
    fault, rank, step, committed, leftover = CHAIN[i]
    link, after = links[i], links[i + 1]
    print(f"\n{fault} (rank {rank}, save of step {step}): fired: {link.run.ev.get(f'fired.{rank}')!r}; exit codes "
          f"{link.run.rcs} after {link.run.secs:.1f} s; committed {link.committed}, leftovers {link.temps}")
    assert f"fired.{rank}" in link.run.ev, f"the fault never fired:\n{link.run.out[-3000:]}"
    assert link.run.rcs[rank] == -signal.SIGKILL, "the targeted rank must have died by SIGKILL"
    other = 1 - rank
    # The survivor fails by itself (gloo sees its peer gone), not by the launcher's kill after launch.GRACE s.
    assert link.run.rcs[other] not in (0, -signal.SIGKILL), f"rank {other} must fail, not hang:\n{link.run.out[-3000:]}"
    assert link.committed == committed, "the newest committed checkpoint must be the last one that completed"
    # Temporary names carry a unique suffix: a leftover never blocks a later save.
    assert unsuffixed(link.temps) == leftover  # retention: every old step renamed out of sight (fsynced), then deleted
    if fault == "kill_mid_write":
        assert f"after {256 * 1024} bytes" in link.run.ev["fired.1"], "rank 1 must die with its shard torn"
    if fault == "kill_before_commit":
        # The dangerous leftover: complete files and a valid manifest, only the rename missing.
        print(f"the uncommitted {link.temps[0]} is complete and verifies: {link.leftover_verifies}")
        assert link.leftover_verifies
    dloss = assert_same_losses(reference["log"], link.log, range(link.start + 1, step + 1))
    # The next run: it claims the root at start-up and removes the dead run's leftover, with a log line, then
    # resumes from the newest commit and trains bit-exactly up to its own fault.
    print(f"before the kill: max |dloss| = {dloss:.3e}; the next run resumed from step {after.start}")
    assert after.start == committed[-1]
    for name in link.temps:
        assert f"removed {root / name}, left by an interrupted save" in after.run.out
    assert after.log, f"the next run trained no step:\n{after.run.out[-3000:]}"
    last = max(after.log)
    dloss = assert_same_losses(reference["log"], after.log, range(after.start + 1, last + 1))
    print(f"after the resume: steps {after.start + 1}..{last} max |dloss| = {dloss:.3e}")


def test_enospc_on_one_rank(reference, chain):
    """Disk full on one rank: the field's save that failed on one rank only, while the others carried on and a
    later resume loaded something else on that rank (composer #2146). Every rank must fail naming rank 1 and
    the cause, nothing may be committed, and a resume continues bit-exactly from the previous checkpoint."""
    root, links = chain
    link, after = links[5], links[6]
    print(f"\nENOSPC on rank 1 in the save of step 8: exit codes {link.run.rcs} after {link.run.secs:.1f} s; "
          f"committed {link.committed}, leftovers {link.temps}")
    assert "fired.1" in link.run.ev and link.run.rc != 0
    for r in (0, 1):
        err = link.run.ev.get(f"error.{r}", "")
        why = [line.strip() for line in err.splitlines() if "No space left" in line]
        print(f"rank {r} raised: {err.splitlines()[0][:200] if err else None} ... {why[-1:]}")
        assert err.startswith("CheckpointError") and "writing failed on" in err
        assert "rank 1: " in err and "No space left on device" in err, f"rank {r}'s error must name rank 1 and why"
        assert "Nothing was committed; the previous checkpoint is intact" in err
    assert link.committed == [6], "nothing new may be committed, and the previous checkpoint must stay"
    assert after.start == 6
    dloss = assert_same_losses(reference["log"], after.log, range(7, STEPS + 1))
    print(f"resumed from step 6: max |dloss| = {dloss:.3e}")


def test_resume_after_every_fault_finishes(reference, chain):
    """After the six faults above, one root holds a clean history: the last run trains to the end, the dead runs'
    leftovers are gone, and every step of every run matched the uninterrupted run."""
    root, links = chain
    final = links[-1]
    steps, temps = on_disk(root)
    print(f"\nlast run: exit {final.run.rcs} after {final.run.secs:.1f} s; committed {steps}, leftovers {temps}; "
          f"steps trained over the chain: {sum(len(link.log) for link in links)} for {STEPS}")
    assert final.run.rc == 0 and steps == [STEPS] and temps == []
    for link in links:
        assert link.log, "every run of the chain trains at least one step"
        assert_same_losses(reference["log"], link.log, sorted(link.log))


# ---------------------------------------------------------------------------
# 3. Slow storage: the checkpoint group's own timeout, not the training one
# ---------------------------------------------------------------------------

SHORT = 3  # seconds: a tight training (and, in the second case, checkpoint) timeout
DELAY = 2 * SHORT  # rank 1's write of step 4 stalls this long


@pytest.mark.parametrize("ckpt_timeout", [60, SHORT], ids=["ckpt_timeout_long", "ckpt_timeout_short"])
def test_slow_storage(reference, tmp_path, ckpt_timeout):
    """A write that takes longer than the training timeout: the field's checkpoint collectives run under the
    training timeout and a slow filesystem kills the job (Fast-LLM #543, llm-foundry #733). With a short
    checkpoint timeout as well, every rank must fail with a timeout, not hang."""
    d = tmp_path
    args = [*COMMON, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl", "--timeout", str(SHORT),
            "--ckpt-timeout", str(ckpt_timeout), "--stop-after", "6"]
    run = fault_run(d, "slow", "slow_write", 1, 4, args, delay=DELAY)
    assert "fired.1" in run.ev
    steps, temps = on_disk(d / "ckpt")
    if ckpt_timeout > DELAY:
        m = re.search(r"step-00000004 \| [\d.]+ MB \| ([\d.]+) s", run.out)
        assert run.rc == 0 and m, run.out[-3000:]
        dloss = assert_same_losses(reference["log"], read_log(d / "log.jsonl"), range(1, 7))
        print(f"\nrank 1's write stalled {DELAY} s under --timeout {SHORT}: the save of step 4 took "
              f"{float(m.group(1)):.1f} s and committed; steps 5-6 trained after it; run took {run.secs:.1f} s, "
              f"max |dloss| vs reference = {dloss:.3e}")
        assert float(m.group(1)) >= DELAY > SHORT
        assert steps == [6] and temps == []
    else:
        print(f"\nrank 1's write stalled {DELAY} s under --ckpt-timeout {SHORT}: exit codes {run.rcs} after "
              f"{run.secs:.1f} s; committed {steps}")
        for r in (0, 1):
            err = run.ev.get(f"error.{r}", "")
            print(f"rank {r} raised: {err[:400]}")
            assert err.startswith("CheckpointError") and "step 4" in err, f"rank {r} must fail the save of step 4"
        assert re.search(r"[Tt]imed out|timeout", run.ev["error.0"]), "the waiting rank must say it timed out"
        ev = d / "slow"
        when = {n: (ev / n).stat().st_mtime - (ev / "fired.1").stat().st_mtime for n in ("error.0", "error.1")}
        print(f"after rank 1's stall began: rank 0 raised at {when['error.0']:.1f} s, "
              f"rank 1 at {when['error.1']:.1f} s")
        assert when["error.0"] < DELAY, "rank 0 must give up by its own timeout, while rank 1 is still stalled"
        assert when["error.1"] < DELAY + 15, "rank 1 must fail as soon as its write returns"
        assert -signal.SIGKILL not in run.rcs, "both ranks must fail by themselves"
        assert run.rc != 0 and steps == [2]


# ---------------------------------------------------------------------------
# 4. Preemption: SIGTERM to one rank, then (on the resumed run) to every rank
# ---------------------------------------------------------------------------

GRACE = 30  # seconds: a typical scheduler's wait between SIGTERM and SIGKILL
PREEMPT = [("1", 3), ("all", 1)]  # (FAULT_RANK, training steps of the run before the signal)


def preempted_run(d, name, args, target, after):
    """A run whose every step sleeps 0.3 s; after `after` steps, SIGTERM to rank 1 or to every rank."""
    ev = d / name
    ev.mkdir()
    env = dict(os.environ, FAULT="preempt", FAULT_RANK=target, FAULT_STEP=str(after), FAULT_DELAY="0.3",
               FAULT_DIR=str(ev))
    job = launch.start([INJECT, *args], env=env, out=ev / "output.txt")
    ranks = [1] if target == "1" else [0, 1]
    deadline = time.monotonic() + 60
    while not all((ev / f"ready.{r}").exists() for r in ranks):
        if job.poll() or time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"the run ended (or never got there) before it was signalled:\n{job.wait()[1]}")
        time.sleep(0.02)
    t_signal = time.monotonic()
    for r in ranks:  # what a scheduler does: SIGTERM to the job's processes
        os.kill(int((ev / f"ready.{r}").read_text()), signal.SIGTERM)
    rc, out = job.wait(60)
    return Run(rc, job.rcs, out, evidence(ev), time.monotonic() - t_signal)


@pytest.fixture(scope="module")
def preemptions(reference, tmp_path_factory):
    """Run 1: SIGTERM to rank 1 after step 3. Run 2 resumes; SIGTERM to both ranks after its first step. Run 3
    resumes and trains to the end."""
    d = tmp_path_factory.mktemp("preempt")
    runs, logs = [], []
    for i, (target, after) in enumerate(PREEMPT):
        args = [*COMMON, "--ckpt-dir", d / "ckpt", "--log-file", d / f"log{i}.jsonl"] + (["--resume"] if i else [])
        runs.append(preempted_run(d, f"run{i}", args, target, after))
        logs.append(read_log(d / f"log{i}.jsonl"))
    _, out = launch.run([TRAIN, *COMMON, "--ckpt-dir", d / "ckpt", "--resume", "--log-file", d / "log2.jsonl"],
                        timeout=60)
    return d, runs, logs + [read_log(d / "log2.jsonl")], out


@pytest.mark.parametrize("i", [0, 1], ids=["one_rank", "all_ranks"])
def test_preemption(reference, preemptions, i):
    """SIGTERM during training: the field's preemptions that saved nothing (spd #741: flag checked too rarely) or
    deadlocked (one rank exiting alone while the others wait in a collective). Every rank must save, exit 0
    within the grace period, and the resume continue bit-exactly."""
    d, runs, logs, last_out = preemptions
    run, log, next_log = runs[i], logs[i], logs[i + 1]
    start = min(log) - 1
    stopped = max(log)
    resumed = resumed_step(last_out if i == 1 else runs[1].out)
    steps = ckpt.committed_steps(str(d / "ckpt"))
    print(f"\nSIGTERM to {'rank 1' if i == 0 else 'both ranks'} after step {start + PREEMPT[i][1]}: stopped "
          f"after step {stopped}, exit codes rank0={run.ev.get('exit.0')} rank1={run.ev.get('exit.1')}, "
          f"{run.secs:.1f} s from signal to exit; the next run resumed from step {resumed}")
    assert run.ev.get("exit.0") == "0" and run.ev.get("exit.1") == "0", f"both ranks must return 0:\n{run.out[-3000:]}"
    assert run.rcs == [0, 0]
    assert "preempted (SIGTERM on some rank)" in run.out, "rank 0 must have learnt of the signal"
    assert f"checkpoint {ckpt.step_dir(str(d / 'ckpt'), stopped)} committed" in run.out
    assert start < stopped < STEPS and resumed == stopped
    assert run.secs < GRACE
    dloss = assert_same_losses(reference["log"], log, range(start + 1, stopped + 1))
    dloss = max(dloss, assert_same_losses(reference["log"], next_log, range(stopped + 1, max(next_log) + 1)))
    print(f"max |dloss| before and after the resume = {dloss:.3e}; committed at the end {steps}")
    if i == 1:
        assert steps == [STEPS] and max(next_log) == STEPS


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
    case(f"root_{name}", lambda: ckpt.check_root(bad, model, timeout=ckpt_timeout))
case("different_root", lambda: save(root + ("-elsewhere" if rank == 1 else ""), 1))
case("different_step", lambda: save(root, 1 if rank == 0 else 2))
case("different_calls", lambda: ckpt.check_root(root, model, timeout=ckpt_timeout) if rank == 0 else save(root, 4))

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
    if case == "in_proc":  # a mount that refuses to create anything
        return "/proc/ckpt-faults-test"
    (d / "data").mkdir()  # data_directory: somebody's data; accepted as a root since ckpt touches only its names
    (d / "data" / "corpus.txt").write_text("the data")
    return d / "data"


ROOTS = ["fresh", "under_a_file", "is_a_file", "in_proc", "data_directory"]


@pytest.fixture(scope="module")
def api_job(tmp_path_factory):
    """One 2-rank job runs every misuse and bad-root case through ckpt's API."""
    d = tmp_path_factory.mktemp("api")
    (d / "job.py").write_text(API_JOB)
    (d / "out").mkdir()
    (d / "roots").mkdir()
    roots = {name: str(bad_root(d / "roots", name)) for name in ROOTS}
    data = os.stat(d / "roots" / "data" / "corpus.txt")
    t0 = time.monotonic()
    rc, out = launch.run([d / "job.py", d / "out", d / "ckpt", SHORT, json.dumps(roots)], check=False,
                         env=dict(os.environ, REPO=REPO), timeout=60)
    print(f"\nckpt API job: exit {rc} after {time.monotonic() - t0:.1f} s")
    return d, out, roots, data


def job_results(d, out, case):
    res = []
    for r in (0, 1):
        path = d / "out" / f"{case}.{r}.json"
        assert path.is_file(), f"rank {r} never finished case {case}:\n{out[-3000:]}"
        res.append(json.loads(path.read_text()))
        print(f"\n{case}: rank {r} after {res[r]['seconds']:.1f} s: {str(res[r]['error'])[:300]}")
    return res


@pytest.mark.parametrize("case", ["different_root", "different_step", "different_calls", "rank0_only"])
def test_misuse(api_job, case):
    """save() called on rank 0 only (accelerate #1171, #2000: the others never join and the job hangs until a
    watchdog), with per-rank paths or steps (OpenTau #396: shards scattered), or while another rank is in
    check_root(): every rank fails, in bounded time, and nothing is committed."""
    d, out, _, _ = api_job
    res = job_results(d, out, case)
    assert all(r["error"] for r in res), "every rank must fail"
    if case == "different_root":
        for r in res:
            assert "different arguments on different ranks" in r["error"] and f"{d / 'ckpt'}-elsewhere" in r["error"]
    elif case == "different_step":
        for r in res:
            assert "different arguments on different ranks" in r["error"]
            assert "step=1" in r["error"] and "step=2" in r["error"]
    elif case == "different_calls":  # check_root()'s one argument is among save()'s: rank 0 must not go on alone
        for r in res:
            assert "different arguments on different ranks" in r["error"] and "step=4" in r["error"]
            assert "rank 0: (in check_root())" in r["error"] and "rank 1: (in save())" in r["error"]
            assert r["seconds"] < SHORT, "both ranks must fail at the agreement, not at the timeout"
    else:
        # Rank 1 never entered save(), so only rank 0 can say why; rank 1 fails in its next collective. Rank 0
        # fails at the agreement, or at making the group (an earlier case's disagreement dropped the groups).
        assert re.search(r"coordination failed at '(save\(\)|make ckpt's process group)' on rank 0", res[0]["error"])
        assert "called on every rank?" in res[0]["error"]
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
extra = {"scheduler": sched, "data": ckpt.Position(args.batch_size, seed=args.seed, seq_len=args.seq_len)}

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
ckpt.load(cases["intact"], model, opt, extra)  # a load that failed mid-read leaves the model unfit to save

# A non-tensor value whose pickle runs a command. save() refuses such a value ...
evil_root = f"{out}/evil_bytes_ckpt"
hostile = {"evil": Holder({"payload": Evil(f"{canaries}/bytes-canary")})}
record("evil_save", lambda: ckpt.save(evil_root, 1, model, opt, hostile))
# ... so plant it as an attacker would, with valid checksums: DCP's planner pickles it in place of a plain value.
real_transform = dcp.DefaultSavePlanner.transform_object
def planting(canary):
    def transform_object(self, write_item, obj):
        if write_item.index.fqn == "extra.evil":
            obj = {"payload": Evil(canary)}
        return real_transform(self, write_item, obj)
    return transform_object
dcp.DefaultSavePlanner.transform_object = planting(f"{canaries}/bytes-canary")
ckpt.save(evil_root, 1, model, opt, {"evil": Holder({"payload": 0})})
dcp.DefaultSavePlanner.transform_object = real_transform
record("evil_bytes", lambda: ckpt.load(evil_root, model, opt, {"evil": Holder({"payload": 0})}))
# Control: stock DCP reads the same kind of value with torch.load(weights_only=False), and the payload runs.
ckpt.load(cases["intact"], model, opt, extra)  # the evil load above failed mid-read
dcp.DefaultSavePlanner.transform_object = planting(f"{canaries}/stock-dcp-canary")
ckpt.save(f"{out}/stock_dcp_ckpt", 1, model, opt, {"evil": Holder({"payload": 0})})  # a root of its own: this
dcp.DefaultSavePlanner.transform_object = real_transform  # model now continues from the intact checkpoint
dcp.load({"extra.evil": None}, checkpoint_id=ckpt.step_dir(f"{out}/stock_dcp_ckpt", 1),
         planner=dcp.DefaultLoadPlanner(flatten_state_dict=False))
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


def other_format(path):
    m = json.loads(path.read_text())
    m["format"] = 2
    path.write_text(json.dumps(m))


class Evil:
    """Pickles as a call of os.system: plain pickle.load runs `touch path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def plant_metadata(ckpt_dir, canary):
    """An attacker's .metadata, with the manifest updated to match so that every checksum passes: the file's size
    and CRC (one per 64 MiB chunk), and the manifest's own CRC (format 6)."""
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(Evil(canary)))
    manifest_path = ckpt_dir / "manifest.json"
    m = json.loads(manifest_path.read_text())
    data = (ckpt_dir / ".metadata").read_bytes()
    assert len(data) < ckpt.CHUNK
    m["files"][".metadata"] = {"bytes": len(data), "crc32": [f"{zlib.crc32(data):08x}"]}
    m["crc32"] = ckpt._manifest_crc(m)
    manifest_path.write_text(json.dumps(m))
    assert ckpt.verify_files(str(ckpt_dir), ckpt.read_manifest(str(ckpt_dir))) == [], "every checksum must pass"


# case: (damage done to step-00000008, the file the error must name, what the error must say)
DAMAGE = {
    "intact": (None, None, None),
    "truncated_shard": (lambda c: truncate(c / "__1_0.distcp"), "__1_0.distcp", "(truncated?)"),
    "flipped_byte": (lambda c: flip_byte(c / "__0_0.distcp"), "__0_0.distcp",
                     "does not match its checksum (corrupted)"),
    "missing_shard": (lambda c: (c / "__1_0.distcp").unlink(), "__1_0.distcp", "is missing"),
    "missing_metadata": (lambda c: (c / ".metadata").unlink(), ".metadata", "is missing"),
    "missing_manifest": (lambda c: (c / "manifest.json").unlink(), "manifest.json", "cannot be read"),
    "truncated_manifest": (lambda c: truncate(c / "manifest.json"), "manifest.json", "cannot be read"),
    "manifest_of_other_format": (lambda c: other_format(c / "manifest.json"), "manifest.json",
                                 f"is not a manifest of format {ckpt.FORMAT}, the one this ckpt.py reads (format: 2)"),
}


@pytest.fixture(scope="module")
def loads(reference, tmp_path_factory):
    """One job loads every damaged copy of the reference checkpoints (steps 6 and 8; 8 is damaged)."""
    d = tmp_path_factory.mktemp("loads")
    (d / "out").mkdir()
    cases = {}
    for name, (damage, _, _) in DAMAGE.items():
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
    launch.run([d / "loader.py", d / "out", json.dumps(cases), d],
               env=dict(os.environ, REPO=REPO, TRAIN_ARGS=json.dumps(COMMON)), timeout=90)
    print(f"\nload job: {len(cases) + 1} loads and 3 saves in {time.monotonic() - t0:.1f} s")
    return d


def outcome(d, name):
    res = [json.loads((d / "out" / f"{name}.{r}.json").read_text()) for r in (0, 1)]
    assert res[0] == res[1], f"ranks disagree: {res}"
    return res[0]


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused(loads, case):
    """A truncated, bit-flipped or incomplete checkpoint, or a damaged manifest: the field's resume that trusts
    whatever is on disk (Lightning #688, #19970) or silently goes back to an older step (composer #2146). It must
    be refused on every rank, naming the file, and naming the newest other commit to load instead."""
    res = outcome(loads, case)
    _, bad, why = DAMAGE[case]
    print(f"\n{case}: step {res['step']}, error: {str(res['error'])[:500]}")
    if bad is None:  # the control: the same job loads an undamaged copy
        assert res["error"] is None and res["step"] == STEPS
        return
    assert res["step"] is None and res["error"], "a damaged checkpoint must be refused, not loaded"
    assert "refusing to load a damaged checkpoint" in res["error"] and why in res["error"]
    assert f"step-00000008/{bad}" in res["error"], "the error must name the damaged file"
    assert f"The newest other commit is {loads / case / 'step-00000006'}: pass it to load it" in res["error"]


def test_hostile_pickles_do_not_run(loads):
    """DCP reads .metadata with pickle.load and non-tensor values with weights_only=False: a checkpoint downloaded
    from someone else can run code. Both must be refused, the code never run; save() refuses such a value."""
    meta, items, at_save = outcome(loads, "evil_metadata"), outcome(loads, "evil_bytes"), outcome(loads, "evil_save")
    print(f"\nsave() of the hostile value: {str(at_save['error'])[:300]}")
    assert "Evil" in at_save["error"] and "which load() cannot restore without running code" in at_save["error"]
    print(f"hostile .metadata (checksums made to match): {str(meta['error'])[:400]}")
    refusal = [line for line in str(items["error"]).splitlines() if "posix.system" in line]
    print(f"hostile pickled value (checksums valid): {str(items['error']).splitlines()[0][:300]} ... {refusal[:1]}")
    assert meta["step"] is None and "step-00000008/.metadata" in meta["error"]
    assert "it names posix.system, which is not among the types of DCP's metadata" in meta["error"]
    assert items["step"] is None and "Weights only load failed" in items["error"] and refusal
    # The controls: plain pickle runs the .metadata payload; stock DCP runs the value's payload.
    for canary, expected in (("control-canary", True), ("stock-dcp-canary", True),
                             ("metadata-canary", False), ("bytes-canary", False)):
        print(f"{canary} exists: {(loads / canary).exists()} (expected {expected})")
        assert (loads / canary).exists() == expected, canary


# ---------------------------------------------------------------------------
# 8. A checkpoint root that cannot be written
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ROOTS)
def test_bad_root_is_refused(api_job, case):
    """A checkpoint root that cannot hold checkpoints (a path through a file, a mount that refuses writes):
    ckpt.check_root refuses it on every rank at once, naming the path. A directory that holds other data is
    accepted (ckpt touches only step-N, .tmp-*, .replaced-*, .abandoned-*, .rollback-to-* and .owner.json)
    and its data is left alone."""
    d, out, roots, data = api_job
    res = job_results(d, out, f"root_{case}")
    if case in ("fresh", "data_directory"):
        listing = sorted(os.listdir(roots[case]))
        print(f"accepted; the root holds {listing}")
        assert res[0]["error"] is None and res[1]["error"] is None
        assert listing == sorted([".owner.json"] + (["corpus.txt"] if case == "data_directory" else []))
        if case == "data_directory":
            now = os.stat(os.path.join(roots[case], "corpus.txt"))
            assert (now.st_mtime_ns, now.st_size) == (data.st_mtime_ns, data.st_size)
            assert open(os.path.join(roots[case], "corpus.txt")).read() == "the data"
        return
    for r in res:
        assert r["error"] and r["error"].startswith("CheckpointError") and roots[case] in r["error"]
        assert "check_root() (rank 0): " in r["error"]
        assert r["seconds"] < SHORT, "a local check, not a timeout"


def test_train_refuses_bad_root_before_training(tmp_path):
    """train_fsdp.py pointed at a root it cannot write (a path through a file): without the start-up check it
    trains until its first save and only then fails, losing that work."""
    root = bad_root(tmp_path, "under_a_file")
    t0 = time.monotonic()
    rc, out = launch.run([TRAIN, *COMMON, "--ckpt-dir", root, "--log-file", tmp_path / "log.jsonl"], check=False,
                         timeout=60)
    lines = [line for line in out.splitlines() if "CheckpointError" in line]
    print(f"\n--ckpt-dir through a file: exit {rc} after {time.monotonic() - t0:.1f} s: "
          f"{lines[-1][:300] if lines else None}")
    assert rc != 0
    assert "step     1" not in out and not (tmp_path / "log.jsonl").exists(), "no step may run"
    assert lines and str(root) in lines[-1], "the error must name the root"
