"""Preemption with DataLoader workers, with ckpt's shipped pieces, for each way a scheduler's SIGTERM arrives.

torchrun forwards a SIGTERM it gets to each rank's process group, the rank's DataLoader workers included; SLURM
(scancel, --signal, a preemption) signals every process of the job step; a scheduler may also signal one rank. The
field failure: the workers die of the signal, the rank's next batch raises "DataLoader worker (pid N) is killed by
signal: Terminated." before the all-reduce that agrees on saving, the other ranks fail, and nothing is saved.

A loop of this file's own (tests/preemption_job.py: FSDP2 on 2 CPU ranks, a DataLoader with 2 workers and
worker_init_fn=ckpt.ignore_sigterm, ckpt.SkippingSampler read through ckpt.Position, ckpt.Preemption(cpu) asked after
each step, ckpt.save) gets a SIGTERM on rank 1 alone, then on rank 1 and its workers (torchrun's forward to one
rank's process group): every rank must see requested() at the same step, save it, and exit 0, and the resumes must
log the uninterrupted run's losses bit for bit. Its control leaves the workers without ignore_sigterm.

Then each delivery hits a train_fsdp.py run under real torchrun with --num-workers 2 mid-run (its workers run
ckpt.ignore_sigterm); the preempted step must be committed, every rank process must exit 0 by itself (torchrun
reports no rank's exit code after a forwarded signal, so each rank runs under tests/exit_status.py, which records
it), and the resumed run must log the uninterrupted run's losses bit for bit. The runs form one chain on one root:
each resumes from the step the one before was preempted at. A control takes the workers' worker_init_fn away
(tests/inject.py, FAULT_WORKERS=take_sigterm): the same delivery to torchrun must then fail, as in the field.

    python -m pytest -q -s tests/test_preemption.py
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
from tests.harness import REPO, SMALL, descendants, kill_tree, read_log, signal_all  # noqa: E402

INJECT = os.path.join(REPO, "tests", "inject.py")
STATUS = os.path.join(REPO, "tests", "exit_status.py")
TRAIN = os.path.join(REPO, "train_fsdp.py")
STEPS = 16
# Saves only where a run stops (preempted, or at --steps): each preempted step is the newest commit.
ARGS = SMALL + ["--n-layers", "1", "--steps", str(STEPS), "--save-every", "0", "--num-workers", "2", "--seed", "5",
                "--dropout", "0.1", "--timeout", "60", "--ckpt-timeout", "60"]
SHUTDOWN_TIMEOUT = 30  # torchrun's default: it SIGKILLs the ranks this long after forwarding a signal
DELIVERIES = ["torchrun", "job", "rank"]  # to torchrun's pid; to every process (SLURM); to rank 1's process alone


# ---- this file's own loop (tests/preemption_job.py), on warm ranks (tests/launch.py) ----

JOB = os.path.join(REPO, "tests", "preemption_job.py")
OWN_STEPS = 16  # 10 steps an epoch: the resumes cross an epoch's end
OWN_DELIVERIES = ["rank", "rank+workers"]  # to rank 1's process alone; to it and its DataLoader workers
SAID = {"rank": "rank 1 alone", "rank+workers": "rank 1 and its DataLoader workers"}


def own_run(d, name, resume, delivery=None, take_sigterm=False):
    """A 2-rank job of tests/preemption_job.py on root d/ckpt; with a delivery, each rank sleeps 0.3 s after each
    step, and after rank 1's 2nd step the SIGTERM comes. Returns what a test needs to know about how it ended."""
    ev = d / name
    ev.mkdir()
    argv = [JOB, d / "ckpt", OWN_STEPS, ev / "log.jsonl", "--evidence", ev] + ["--resume"] * resume
    argv += ["--ready-after", 2, "--pause", 0.3] if delivery else []
    argv += ["--take-sigterm"] * take_sigterm
    job = launch.start(argv, nproc=2, out=ev / "output.txt")
    workers = None
    try:
        deadline = time.monotonic() + 90
        while delivery and not (ev / "ready.1").exists():
            job.poll(0.05)
            assert job.rcs == [None, None], f"a rank ended before its 2nd step:\n{(ev / 'output.txt').read_text()}"
            assert time.monotonic() < deadline, "no rank reached its 2nd step in 90 s"
        if delivery:
            pids = descendants(job.pids[1])  # rank 1 and its DataLoader workers
            workers = len(pids) - 1
            signal_all(pids if delivery == "rank+workers" else pids[:1], signal.SIGTERM)
        rc, out = job.wait(timeout=120)
    finally:
        job.kill()
    ranks = {int(m[1]): {"step": int(m[2]), "signal_at": m[3] and int(m[3]), "requested_at": m[4] and int(m[4])}
             for m in re.finditer(r"RANK (\d) step (\d+) signal_at (?:None|(\d+)) requested_at (?:None|(\d+))", out)}
    resumed = re.search(r"RESUMED from step (\d+)", out)
    log = read_log(ev / "log.jsonl") if (ev / "log.jsonl").exists() else {}
    return dict(out=out, rcs=job.rcs, workers=workers, ranks=ranks, log=log, resumed=resumed and int(resumed[1]),
                committed=ckpt.committed_steps(str(d / "ckpt")))


@pytest.fixture(scope="module")
def own_reference(tmp_path_factory):
    """The uninterrupted run of the loop: {step: {"step", "loss"}}."""
    run = own_run(tmp_path_factory.mktemp("own-reference"), "run", resume=False)
    assert run["rcs"] == [0, 0] and sorted(run["log"]) == list(range(1, OWN_STEPS + 1)), run["out"][-4000:]
    losses = [run["log"][s]["loss"] for s in sorted(run["log"])]
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4]), f"the loss must fall for the comparison to mean anything: {losses}"
    return run["log"]


@pytest.fixture(scope="module")
def own_chain(tmp_path_factory):
    """Run 0 starts fresh and is preempted; run 1 resumes from its step and is preempted; the last run resumes and
    trains to the end."""
    d = tmp_path_factory.mktemp("own-preempt")
    runs = [own_run(d, delivery, resume=i > 0, delivery=delivery) for i, delivery in enumerate(OWN_DELIVERIES)]
    return runs + [own_run(d, "last", resume=True)]


@pytest.mark.parametrize("i", range(len(OWN_DELIVERIES)), ids=OWN_DELIVERIES)
def test_preemption_of_a_loop_with_ckpts_pieces(own_reference, own_chain, i):
    """SIGTERM to one rank (alone, or with its DataLoader workers) of a loop built from ckpt's Preemption,
    ignore_sigterm, SkippingSampler and Position: every rank sees requested() at the same step (the signalled one
    alone received it), saves that step with ckpt.save, and exits 0; the resume continues from that step and logs
    the uninterrupted run's losses bit for bit."""
    run, after = own_chain[i], own_chain[i + 1]
    ranks = run["ranks"]
    assert run["rcs"] == [0, 0] and sorted(ranks) == [0, 1], f"every rank must save and exit 0:\n{run['out'][-4000:]}"
    started = run["resumed"] or 0
    stopped = ranks[0]["step"]
    print(f"\nown loop, SIGTERM to {SAID[OWN_DELIVERIES[i]]} (workers: {run['workers']}) after step {started + 2}: "
          f"requested() at step {[ranks[r]['requested_at'] for r in (0, 1)]} on ranks 0, 1 (received by rank(s) "
          f"{[r for r in (0, 1) if ranks[r]['signal_at'] is not None]}), exits {run['rcs']}, committed "
          f"{run['committed']}; the next run resumed from step {after['resumed']}")
    assert run["workers"] == 2, "rank 1 must have its 2 DataLoader workers when the signal comes"
    assert [ranks[r]["requested_at"] for r in (0, 1)] == [stopped] * 2 and ranks[1]["step"] == stopped
    assert ranks[0]["signal_at"] is None and ranks[1]["signal_at"] is not None, "rank 1 alone got the signal"
    assert started + 2 <= stopped < OWN_STEPS, f"preempted at step {stopped}, signalled after {started + 2}"
    assert run["committed"][-1] == stopped, f"the preempted step {stopped} must be the newest commit"
    assert after["resumed"] == stopped and after["rcs"] == [0, 0]
    assert_continues(run, after, own_reference, started)


def test_control_own_loop_without_ignore_sigterm_fails(tmp_path):
    """Control: the same loop without worker_init_fn=ckpt.ignore_sigterm, SIGTERM to rank 1 and its workers: the
    workers die of it, rank 1's next batch fails, nothing is saved. The checks above would see it."""
    run = own_run(tmp_path, "control", resume=False, delivery="rank+workers", take_sigterm=True)
    died = [line.strip() for line in run["out"].splitlines() if "killed by signal" in line][:1]
    print(f"\ncontrol, own loop without ignore_sigterm: exits {run['rcs']}, committed {run['committed']}; {died}")
    assert run["workers"] == 2
    assert run["rcs"] != [0, 0] and run["committed"] == []
    assert died and "Terminated" in died[0], run["out"][-4000:]


# ---- train_fsdp.py under real torchrun ----

def preempted(d, name, delivery, resume, env=None):
    """A torchrun job of train_fsdp.py whose ranks (under exit_status.py and inject.py) sleep 0.3 s after each step;
    after their second step, SIGTERM by `delivery`. Returns what a test needs to know about how it ended."""
    ev = d / name
    ev.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", FAULT="preempt", FAULT_RANK="all", FAULT_STEP="2", FAULT_DELAY="0.3",
               FAULT_DIR=str(ev), STATUS_DIR=str(ev), **(env or {}))
    args = [*ARGS, "--ckpt-dir", str(d / "ckpt"), "--log-file", str(ev / "log.jsonl")] + ["--resume"] * resume
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", STATUS, INJECT, *args]
    with open(ev / "output.txt", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((ev / f"ready.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended (or hung) before its 2nd step"
            time.sleep(0.02)
        ranks = [int((ev / f"pid.{r}").read_text()) for r in (0, 1)]
        workers = [len(descendants(pid)) - 1 for pid in ranks]  # each rank's DataLoader worker processes
        t_signal = time.monotonic()
        if delivery == "torchrun":
            os.kill(proc.pid, signal.SIGTERM)
        elif delivery == "job":
            signal_all(descendants(proc.pid), signal.SIGTERM)
        else:
            os.kill(ranks[1], signal.SIGTERM)
        torchrun_rc = proc.wait(timeout=SHUTDOWN_TIMEOUT + 30)
    finally:
        kill_tree(proc.pid)
    secs = time.monotonic() - t_signal
    statuses = [int(p.read_text()) if p.exists() else None for p in (ev / "status.0", ev / "status.1")]
    log = read_log(ev / "log.jsonl") if (ev / "log.jsonl").exists() else {}
    return dict(out=(ev / "output.txt").read_text(), statuses=statuses, workers=workers, secs=secs, log=log,
                torchrun_rc=torchrun_rc, committed=ckpt.committed_steps(str(d / "ckpt")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, without torchrun (warm ranks: tests/launch.py), the same workers."""
    d = tmp_path_factory.mktemp("reference")
    launch.run([TRAIN, *ARGS, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl"], timeout=90)
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[STEPS]["loss"] < log[1]["loss"] - 0.3, "the loss must fall for the comparison to mean anything"
    return log


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Run 0 starts fresh; each next run resumes from the step the one before was preempted at; the last resume
    trains to the end."""
    d = tmp_path_factory.mktemp("preempt")
    runs = [preempted(d, delivery, delivery, resume=i > 0) for i, delivery in enumerate(DELIVERIES)]
    _, out = launch.run([TRAIN, *ARGS, "--ckpt-dir", d / "ckpt", "--log-file", d / "last.jsonl", "--resume"],
                        timeout=90)
    return runs, out, read_log(d / "last.jsonl")


@pytest.mark.parametrize("i", range(len(DELIVERIES)), ids=DELIVERIES)
def test_preemption_with_workers(reference, chain, i):
    """A SIGTERM to torchrun, to every process of the job, or to one rank, mid-run with DataLoader workers: the
    field's preemption that saved nothing (the workers died of it and failed their ranks). The step in progress is
    committed, every rank exits 0 by itself, and the resumed run logs the uninterrupted run's values bit for bit."""
    runs, last_out, last_log = chain
    run = runs[i]
    started = min(run["log"]) - 1 if run["log"] else None
    stopped = max(run["log"]) if run["log"] else None
    after = runs[i + 1] if i + 1 < len(runs) else {"out": last_out, "log": last_log}
    print(f"\nSIGTERM to {DELIVERIES[i]} after step {started + 2 if run['log'] else '?'} (workers per rank: "
          f"{run['workers']}): stopped after step {stopped}, rank exit statuses {run['statuses']}, torchrun's exit "
          f"code {run['torchrun_rc']}, {run['secs']:.1f} s from the signal to the end; committed {run['committed']}")
    assert run["workers"] == [2, 2], "each rank must have its 2 DataLoader workers when the signal comes"
    assert run["statuses"] == [0, 0], f"every rank must save and exit 0:\n{run['out'][-4000:]}"
    assert "preempted (SIGTERM on some rank)" in run["out"]
    assert started is not None and started < stopped < STEPS
    assert run["committed"][-1] == stopped, f"the preempted step {stopped} must be the newest commit"
    assert run["secs"] < SHUTDOWN_TIMEOUT, "the ranks must end well within torchrun's shutdown timeout"
    assert f"resumed from step {stopped}" in after["out"]
    assert_continues(run, after, reference, started)


def assert_continues(run, after, reference, started):
    """A preempted run and the resume after it log every step from started + 1 on, each record equal to the
    uninterrupted run's bit for bit."""
    logged = {**run["log"], **after["log"]}
    steps = sorted(logged)
    assert steps == list(range(started + 1, max(steps) + 1)), f"logged steps {steps}"
    for s in steps:
        assert logged[s] == reference[s], f"step {s}: {logged[s]} != uninterrupted {reference[s]}"
    dloss = max(abs(logged[s]["loss"] - reference[s]["loss"]) for s in steps)
    print(f"steps {steps[0]}-{steps[-1]} (this run and the resume after it): max |dloss| = {dloss:.3e}")


def test_control_workers_dying_of_the_signal_fail_the_preemption(tmp_path):
    """Control: without the worker_init_fn, torchrun's forwarded SIGTERM kills the workers, and the preemption
    fails as in the field (a rank fails, the step is not saved): the checks above would see it."""
    run = preempted(tmp_path, "control", "torchrun", resume=False, env={"FAULT_WORKERS": "take_sigterm"})
    died = [line.strip() for line in run["out"].splitlines() if "DataLoader worker" in line][:1]
    print(f"\ncontrol: rank exit statuses {run['statuses']}, committed {run['committed']}, torchrun's exit code "
          f"{run['torchrun_rc']}; {died}")
    assert run["workers"] == [2, 2]
    assert run["statuses"] != [0, 0] and run["committed"] == []
    assert died and "killed by signal: Terminated" in died[0], run["out"][-4000:]
