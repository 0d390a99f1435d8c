"""One live run per root, under every launcher (issue 28, item 1), launched as users launch: real torchrun.

Guards against two runs writing one checkpoint root, each taking the other's save in progress for a crashed one's,
where the two look alike to anything but a lock: torchrun --master_port (static rendezvous: the run id is "none"
for every run), one c10d rendezvous id used twice, two job steps of one SLURM allocation (one SLURM_JOB_ID), a
container restarted with a fresh PID namespace (the dead run's pid is ours). Also against a requeue that cannot
take a dead run's root back at once, two requeues of one dead run both training, and run_multinode.sh giving two
job steps of one allocation one rendezvous (the second failed to start).

Each launcher, with the environment it really sets (SLURM's as srun sets it, with a stand-in scontrol):
  A holds a root: it trains and saves every 2 steps; the test polls the root until A's claim is in .owner.json and
    A has committed a step.
  B, launched the same way on the same root (another port where one is set), must exit non-zero before it logs a
    step, naming A's claim (its pid). A's ranks are paused meanwhile (SIGSTOP: the lock stays held, as by a run
    waiting on a slow save), so the root can be compared before and after B, and A takes no CPU from B; resumed,
    A must commit another step.
  A is killed hard (SIGKILL on torchrun and every rank), and C, its requeue (with --resume), must take the root over
    at once, say so, and resume from A's newest committed step.
Launches are shared (a C is the next launcher's A), and three roots run at once (a thread each): each launch costs
two imports of torch (torchrun's and a rank's), about 6 CPU seconds.
  torchrun:        --standalone A, B; C is --master_port A (2 ranks), B; then two --master_port requeues start at
                   once on its dead claim: one trains (C), the other is refused naming the winner.
  run_multinode.sh c10d rendezvous on 2 "nodes" x 1 rank meeting at 127.0.0.1, with the script's default rendezvous
                   id ("train_fsdp") for A and B; C is the job submitted to SLURM, as srun starts the script: A is
                   job step 0, B step 1 of the same allocation, C the job requeued (step 0 again, on its port).
  container:       torchrun --standalone under `unshare --pid --fork --mount-proc`, each run in a PID namespace of
                   its own (A, B, then C in a fresh one: C's rank 0 has the dead A's pid).

    python -m pytest -q -s tests/test_launchers.py
"""

import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.harness import REPO, SMALL, TRAIN, descendants, kill_tree, read_log, signal_all

SCRIPT = os.path.join(REPO, "run_multinode.sh")
OWNER = ".owner.json"  # ckpt.OWNER; ckpt is not imported: this process need not import torch
STEP_DIR = re.compile(r"^step-(\d{8,})$")
# Many steps (the runs are killed), a save every 2; short collective timeouts: a lost peer fails in a minute.
ARGS = SMALL + ["--n-layers", "1", "--steps", "100000", "--save-every", "2", "--timeout", "60", "--ckpt-timeout", "60"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
LAUNCH_TIMEOUT = 150  # seconds for a launch to end (B, the race's loser), start-up included
WAIT = 150  # seconds for a run to reach a point (its claim, a commit, a step)
STEP_LINE = re.compile(r"^step +(\d+) \|", re.M)
REFUSAL = "is in use by another run"
TAKEOVER = "taking over"
_launches = []  # every launch, killed at the end whatever happened
ORPHANS_CPU = [0.0]  # CPU seconds of killed processes that no process of this test reaps (ranks, mostly)


class Launch:
    """One run as users start it: a process per node (torchrun, or run_multinode.sh or unshare in front of it), each
    in a session of its own. Their output is read as it comes, each line with its time since the launch."""

    def __init__(self, name, nodes, log_file):
        self.name, self.log_file, self.t0 = name, log_file, time.monotonic()
        self.procs, self.lines, self.readers, self.secs = [], [], [], None
        _launches.append(self)
        for cmd, env in nodes:
            env = dict(env, OMP_NUM_THREADS="1")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                                    start_new_session=True)
            self.procs.append(proc)
            self.readers.append(threading.Thread(target=self._read, args=(proc,), daemon=True))
            self.readers[-1].start()
        self.cmd = describe(nodes[0][0])

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip("\n")))

    @property
    def out(self):
        return "\n".join(line for _, line in self.lines)

    def tail(self, n=4000):
        return f"--- {self.name}: {self.cmd}\n{self.out[-n:]}"

    def when(self, pattern):
        """Seconds from the launch to the first line matching pattern (a regex), or None."""
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def alive(self):
        return any(p.poll() is None for p in self.procs)

    def rcs(self):
        return [p.poll() for p in self.procs]

    def steps(self):
        """The steps this run logged (rank 0's --log-file)."""
        return sorted(read_log(self.log_file)) if os.path.exists(self.log_file) else []

    def wait(self, timeout=LAUNCH_TIMEOUT, grace=20, trains=False):
        """Every node's exit code, once all have exited; killed, and failing, after timeout. Nodes still running
        grace seconds after another failed are killed (one that failed before the rendezvous leaves the others
        waiting for it: torchrun's default is 10 minutes). trains=True: killed at its first step (a run that
        should have been refused would train on)."""
        deadline = self.t0 + timeout
        while self.alive():
            if trains and STEP_LINE.search(self.out):
                self.kill()
                break
            if any(rc not in (None, 0) for rc in self.rcs()):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                self.kill()
                if time.monotonic() - self.t0 >= timeout:
                    raise AssertionError(f"{self.name} still ran after {timeout} s:\n{self.tail()}")
                break
            time.sleep(0.05)
        self.secs = time.monotonic() - self.t0
        for r in self.readers:
            r.join(timeout=10)
        return self.rcs()

    def ranks(self):
        """The pids of its ranks (not torchrun's, nor a shell's or unshare's in front of it)."""
        pids = [q for p in self.procs if p.poll() is None for q in descendants(p.pid)]  # a reaped pid may be reused
        return [q for q in pids if is_rank(q)]

    def pause(self):
        signal_all(self.ranks(), signal.SIGSTOP)

    def resume(self):
        signal_all(self.ranks(), signal.SIGCONT)

    def kill(self):
        """SIGKILL every process of the run (torchrun and each rank), as a node's crash or the OOM killer ends it."""
        for p in self.procs:
            if p.poll() is None:  # not reaped: the pid is still this process's (a zombie at worst)
                # Their parents die with them, so nobody waits for them: their CPU time is counted here.
                ORPHANS_CPU[0] += sum(cpu_seconds(q) for q in descendants(p.pid) if q != p.pid)
                kill_tree(p.pid)
            p.wait()
        for r in self.readers:
            r.join(timeout=10)


def describe(cmd):
    """cmd up to the script, then [args] and --resume if given: the launch, for the printed figures."""
    names = {TRAIN: "train_fsdp.py", SCRIPT: "run_multinode.sh", sys.executable: "python"}
    end = next(i for i, a in enumerate(cmd) if a in (TRAIN, SCRIPT))
    return " ".join([names.get(a, a) for a in cmd[:end + 1]] + ["[args]"] + ["--resume"] * ("--resume" in cmd))


def cpu_seconds(pid):
    """User and system CPU seconds of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def is_rank(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    # torchrun, and unshare in front of it, name the script too; run_multinode.sh names it by its real path
    return "torch.distributed.run" not in argv and any(os.path.basename(a) == "train_fsdp.py" for a in argv)


def rank_env(pid, *names):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    return {n: env.get(n) for n in names}


def free_port():
    """A port nothing listens on, below 20000 (run_multinode.sh's SLURM ports) and outside the kernel's ephemeral
    range: an ephemeral port free now may be the local end of a connection (of a run started meanwhile) when the
    launch comes to listen on it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    ports = [p for p in range(10000, 20000) if not low <= p <= high]
    for port in random.sample(ports, min(len(ports), 100)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:  # taken
                continue
    with socket.socket() as s:  # every port is ephemeral here
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def owner(root):
    """.owner.json's text: the claim of the run holding root ("" if none)."""
    try:
        with open(os.path.join(root, OWNER)) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def newest(root):
    """The highest committed step under root (0 if none)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return max((int(m.group(1)) for m in map(STEP_DIR.match, names) if m), default=0)


def listing(root):
    """Every entry under root, with its inode, size and mtime, and the claim's text: what B must leave alone."""
    out = {OWNER: owner(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def wait_until(what, cond, run, timeout=WAIT):
    """Poll cond() until it is true; fail naming what, if run exits first or after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if not run.alive():
            raise AssertionError(f"{run.name} exited {run.rcs()} before {what}:\n{run.tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{run.name}: no {what} after {timeout} s:\n{run.tail()}")
        time.sleep(0.05)


def claimed(root, before):
    """The claim in .owner.json, once it is not `before` (the previous run's) and names a pid; else None."""
    text = owner(root)
    if text and text != before:
        try:
            return text if "pid" in json.loads(text) else None
        except ValueError:  # being written
            return None
    return None


# ---------------------------------------------------------------------------------- the launchers


def clean_env(**extra):
    """This process's environment without a launcher's settings, with extra."""
    drop = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}
    env.update(extra)
    return env


def standalone(nproc=1, wrap=()):
    return [*wrap, *TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), TRAIN]


def static(port, nproc=2):
    """torchrun's static rendezvous: TORCHELASTIC_RUN_ID is "none", whatever the run."""
    return [*TORCHRUN, "--nnodes", "1", "--nproc_per_node", str(nproc), "--master_port", str(port), TRAIN]


def c10d_nodes(port, args, nnodes=2):
    """run_multinode.sh on nnodes "nodes" of this host, as on separate nodes over SSH: RDZV_ID is left to the
    script's default ("train_fsdp"), the same for every run."""
    return [([SCRIPT, *args], clean_env(PYTHON=sys.executable, NNODES=str(nnodes), NODE_RANK=str(i),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NPROC_PER_NODE="1"))
            for i in range(nnodes)]


def slurm_port(job, step):
    """The rendezvous port run_multinode.sh derives for a job step (tests/test_multinode.py checks the script's)."""
    return 20000 + job % 1000 * 12 + step % 12


def slurm_env(bin_dir, job, step, restart=0):
    """A task's environment as `srun --nodes=1 --ntasks=1 ./run_multinode.sh` sets it, in job step `step` of
    allocation `job` on this host. NPROC_PER_NODE is set (SLURM sets SLURM_GPUS_ON_NODE only with GPUs): else the
    script imports torch once more to count GPUs."""
    node = "localhost"
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable, NPROC_PER_NODE="1")
    env.update({
        "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": str(step), "SLURM_STEPID": str(step),
        "SLURM_JOB_NAME": "train", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1",
        "SLURM_TASKS_PER_NODE": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
        "SLURM_JOB_NODELIST": node, "SLURM_NODELIST": node, "SLURM_STEP_NODELIST": node, "SLURMD_NODENAME": node,
        "SLURM_SUBMIT_DIR": REPO, "SLURM_CPUS_ON_NODE": "2", "SLURM_RESTART_COUNT": str(restart),
    })
    return env


def fake_scontrol(bin_dir):
    """`scontrol show hostnames LIST`, for lists of plain names (scontrol is not installed here)."""
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, "scontrol")
    with open(path, "w") as f:
        f.write('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 2\necho "$3" | tr , "\\n"\n')
    os.chmod(path, 0o755)


def slurm_job():
    """An allocation id whose job steps 0 and 1 get free rendezvous ports here."""
    for _ in range(100):
        job = random.randrange(100000, 999999)
        try:
            for step in (0, 1):
                with socket.socket() as s:
                    s.bind(("", slurm_port(job, step)))
            return job
        except OSError:
            continue
    raise AssertionError("no job id with free ports")


def unshare_reason():
    """Why a run cannot have a PID namespace of its own here, or None."""
    try:
        r = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if r.returncode == 0 else f"{' '.join(UNSHARE)} is not permitted: {r.stderr.strip()}"


# ---------------------------------------------------------------------------------- one scenario, step by step


def holds(fig, root, a, before_claim, before_step):
    """A takes root: its claim replaces before_claim and it commits a step past before_step. Returns its claim."""
    claim = wait_until("claim in .owner.json", lambda: claimed(root, before_claim), a)
    wait_until(f"step of its own committed (past step {before_step})", lambda: newest(root) > before_step, a)
    fig["a_claim"], fig["a_pid"] = claim, json.loads(claim)["pid"]
    env = rank_env(a.ranks()[0], "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID")
    fig["a_env"] = {k: v for k, v in env.items() if v is not None}
    return claim


def refuses(fig, root, a, start_b, nranks):
    """With A holding root (paused), B starts the same way and must fail before a step, naming A; A resumed goes
    on committing."""
    a.pause()
    try:
        before = listing(root)
        b = start_b()
        fig["b_rcs"] = b.wait(trains=True)
        fig["b_secs"], fig["b_cmd"], fig["b_out"] = b.secs, b.cmd, b.tail()
        refusal = rf"CheckpointError: check_root\(\) \(rank 0\): \S+ {REFUSAL}"
        fig["b_refused"] = len(re.findall(refusal, b.out))  # once per rank
        fig["b_ranks"], fig["b_named_a"] = nranks, fig["a_claim"] in b.out
        fig["b_steps"] = len(STEP_LINE.findall(b.out)) + len(b.steps())
        fig["root_unchanged"] = listing(root) == before
    finally:
        a.resume()
    committed = newest(root)
    wait_until(f"commit after B's refusal (past step {committed})", lambda: newest(root) > committed, a)
    fig["a_commits"] = (committed, newest(root))


def requeue(fig, root, a, start_c):
    """A is killed hard; C, its requeue, takes root over at once and resumes from A's newest commit."""
    a.kill()
    fig["killed_at"] = newest(root)
    c = start_c()
    wait_until("step logged", lambda: STEP_LINE.search(c.out), c)
    first = c.when(STEP_LINE.pattern)
    resumed = c.when(r"^resumed from step")
    fig["c_first_step"], fig["c_first_step_secs"] = int(STEP_LINE.search(c.out).group(1)), first
    fig["c_claim_secs"] = first - resumed if resumed is not None else float("nan")  # check_root() and one step
    fig["c_resumed"] = re.findall(r"^resumed from step (\d+)", c.out, re.M)
    fig["c_took_over"] = [line for _, line in c.lines if TAKEOVER in line]
    fig["c_cmd"], fig["c_out"] = c.cmd, c.tail()
    return c


def check_refusal(fig, launcher):
    """A held the root, B was refused naming it and left it alone, A went on; prints the figures first."""
    print(f"\n{launcher}: A = {fig['a_cmd']}\n  A holds the root as pid {fig['a_pid']} (its ranks' env "
          f"{fig['a_env']}); B = {fig['b_cmd']}\n  B exited {fig['b_rcs']} after {fig['b_secs']:.1f} s, refused on "
          f"{fig['b_refused']} of {fig['b_ranks']} ranks, naming A: {fig['b_named_a']}, steps logged {fig['b_steps']}; "
          f"root unchanged by B: {fig['root_unchanged']}; A then committed step {fig['a_commits'][1]} (newest "
          f"before: {fig['a_commits'][0]}); A killed at step {fig['killed_at']}")
    assert all(rc != 0 for rc in fig["b_rcs"]), f"B succeeded on a held root:\n{fig['b_out']}"
    assert fig["b_refused"] >= 1, f"B was not refused for the held root:\n{fig['b_out']}"
    assert fig["b_named_a"], f"B's refusal does not name A's claim {fig['a_claim']}:\n{fig['b_out']}"
    assert fig["b_steps"] == 0, f"B trained {fig['b_steps']} steps before its refusal:\n{fig['b_out']}"
    assert fig["root_unchanged"], "B changed the root A holds"
    assert fig["a_commits"][1] > fig["a_commits"][0], "A committed nothing after B's refusal"


def check_takeover(fig):
    """C, the requeue of the killed A, took the root over at once and resumed from A's newest commit."""
    print(f"  C = {fig['c_cmd']}\n  C resumed from {fig['c_resumed']}, first step {fig['c_first_step']} "
          f"{fig['c_first_step_secs']:.1f} s after its launch ({fig['c_claim_secs']:.2f} s after its load), takeover "
          f"logged: {len(fig['c_took_over'])}")
    assert fig["c_resumed"] == [str(fig["killed_at"])], f"C resumed from {fig['c_resumed']}:\n{fig['c_out']}"
    assert fig["c_first_step"] == fig["killed_at"] + 1, f"C's first step is {fig['c_first_step']}"
    assert len(fig["c_took_over"]) == 1 and fig["a_claim"] in fig["c_took_over"][0], fig["c_out"]
    assert fig["c_claim_secs"] < 10, f"C took {fig['c_claim_secs']:.1f} s from its load to its first step"


# ---------------------------------------------------------------------------------- the three roots


def torchrun_chain(d, stage):
    """--standalone A, B; --master_port (2 ranks) C = A, B; two --master_port requeues at once."""
    root = str(d / "torchrun")
    fig = stage("standalone")

    def sa(name, args):
        return Launch(name, [(standalone() + args + ["--log-file", str(d / f"{name}.jsonl")], clean_env())],
                      str(d / f"{name}.jsonl"))

    def st(name, args, nproc=2):
        port = free_port()
        return Launch(name, [(static(port, nproc) + args + ["--log-file", str(d / f"{name}.jsonl")], clean_env())],
                      str(d / f"{name}.jsonl"))

    args = ARGS + ["--ckpt-dir", root]
    a = sa("standalone_a", args)
    fig["a_cmd"] = a.cmd
    holds(fig, root, a, "", 0)
    refuses(fig, root, a, lambda: sa("standalone_b", args), 1)
    a = requeue(fig, root, a, lambda: st("static_a", args + ["--resume"]))

    previous = fig
    fig = stage("static")
    fig["a_cmd"] = a.cmd
    holds(fig, root, a, previous["a_claim"], previous["killed_at"])
    refuses(fig, root, a, lambda: st("static_b", args + ["--resume"]), 2)
    a.kill()
    dead, base = fig["a_claim"], newest(root)
    fig["killed_at"] = base

    # Two requeues of the dead run at the same moment (1 rank each: the world size takes no part in the claim).
    race = stage("race")
    race.update(dead=dead, base=base)
    x, y = st("race_x", args + ["--resume"], 1), st("race_y", args + ["--resume"], 1)
    race["cmds"] = [x.cmd, y.cmd]
    # The loser exits; the winner, paused at its first step (it must hold the root while the loser checks, and
    # need not train meanwhile), is stopped once the loser is gone.
    deadline, trained = time.monotonic() + WAIT, []
    while True:
        for run in (x, y):
            if run not in trained and STEP_LINE.search(run.out):
                run.pause()
                trained.append(run)
        exited = [run for run in (x, y) if not run.alive()]
        if len(trained) == 2 or len(exited) == 2 or (exited and trained):
            break
        assert time.monotonic() < deadline, f"neither trained nor exited after {WAIT} s:\n{x.tail()}\n{y.tail()}"
        time.sleep(0.05)
    winner = trained[0] if trained else x
    loser = y if winner is x else x
    race["winner_claim"] = owner(root)
    for run in trained:  # as a preemption: it saves and exits
        signal_all(run.ranks(), signal.SIGTERM)
        run.resume()
    for run in (loser, winner):
        race[run.name] = {"rcs": run.wait(), "secs": run.secs, "steps": run.steps(), "out": run.tail(),
                          "took_over": [line for _, line in run.lines if TAKEOVER in line],
                          "refused": len(re.findall(rf"CheckpointError: check_root\(\) \(rank 0\): \S+ {REFUSAL}",
                                                    run.out)),
                          "resumed": re.findall(r"^resumed from step (\d+)", run.out, re.M)}
    race["winner"], race["loser"] = winner.name, loser.name


def run_multinode_chain(d, stage):
    """run_multinode.sh on 2 nodes x 1 rank over "SSH", rendezvous id "train_fsdp" (the script's default) for A and B;
    C is the job submitted to SLURM: A of the SLURM scenario (job step 0), whose B is step 1 of the same allocation,
    and whose C the job requeued (step 0 again, on step 0's port)."""
    root, bin_dir, job = str(d / "run_multinode"), str(d / "bin"), slurm_job()
    fake_scontrol(bin_dir)
    args = ARGS + ["--ckpt-dir", root, "--resume"]  # as the README's command lines: every launch resumes

    def c10d(name, port):
        log = str(d / f"{name}.jsonl")
        return Launch(name, c10d_nodes(port, args + ["--log-file", log]), log)

    def slurm(name, step, restart=0):
        log = str(d / f"{name}.jsonl")
        return Launch(name, [([SCRIPT, *args, "--log-file", log], slurm_env(bin_dir, job, step, restart))], log)

    fig = stage("c10d")
    port = free_port()
    a = c10d("c10d_a", port)
    fig["a_cmd"] = f"{a.cmd} (NNODES=2, NODE_RANK=0/1, MASTER_PORT={port})"
    holds(fig, root, a, "", 0)
    port_b = free_port()
    refuses(fig, root, a, lambda: c10d("c10d_b", port_b), 2)
    fig["b_cmd"] += f" (NNODES=2, NODE_RANK=0/1, MASTER_PORT={port_b})"
    a = requeue(fig, root, a, lambda: slurm("slurm_a", 0))
    fig["c_cmd"] += f" (under srun: SLURM_JOB_ID={job}, SLURM_STEP_ID=0)"

    previous, fig = fig, stage("slurm")
    fig.update(job=job, a_cmd=previous["c_cmd"])
    holds(fig, root, a, previous["a_claim"], previous["killed_at"])
    fig["a_endpoint"] = agent_endpoint(a)
    refuses(fig, root, a, lambda: slurm("slurm_b", 1), 1)
    fig["b_cmd"] += f" (SLURM_JOB_ID={job}, SLURM_STEP_ID=1)"
    c = requeue(fig, root, a, lambda: slurm("slurm_c", 0, restart=1))
    fig["c_cmd"] += f" (SLURM_JOB_ID={job}, SLURM_STEP_ID=0, SLURM_RESTART_COUNT=1)"
    c.kill()


def agent_endpoint(run):
    """torchrun's --rdzv-endpoint and --rdzv-id, from its command line."""
    with open(f"/proc/{run.procs[0].pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[argv.index("--rdzv-endpoint") + 1], argv[argv.index("--rdzv-id") + 1]


def container_chain(d, stage):
    """torchrun --standalone, each run in a PID namespace of its own: A, B; C in a fresh one, A killed."""
    root = str(d / "container")
    fig = stage("container")
    args = ARGS + ["--ckpt-dir", root, "--resume"]  # a container's entrypoint resumes whenever it starts

    def launch(name):
        log = str(d / f"{name}.jsonl")
        return Launch(name, [(standalone(wrap=UNSHARE) + args + ["--log-file", log], clean_env())], log)

    a = launch("container_a")
    fig["a_cmd"] = a.cmd
    holds(fig, root, a, "", 0)
    refuses(fig, root, a, lambda: launch("container_b"), 1)
    c = requeue(fig, root, a, lambda: launch("container_c"))
    fig["c_claim"] = wait_until("claim", lambda: claimed(root, fig["a_claim"]), c)
    c.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs the three roots' scenarios at once, one thread each. {"figs": {scenario: its figures, with "error" if it
    broke off there}, "errors": {chain: its error}, "no_unshare": why there is no container scenario, or None}."""
    d = tmp_path_factory.mktemp("launchers")
    figs, errors, t0 = {}, {}, time.monotonic()
    no_unshare = unshare_reason()
    chains = [torchrun_chain, run_multinode_chain] + ([container_chain] if not no_unshare else [])

    def run(chain):
        stages = []

        def stage(name):
            stages.append(name)
            return figs.setdefault(name, {})

        try:
            chain(d, stage)
        except BaseException as e:  # the scenario it was in fails with it; those after it are not reached
            errors[chain.__name__] = f"{type(e).__name__}: {e}"
            if stages:
                figs[stages[-1]]["error"] = errors[chain.__name__]

    threads = [threading.Thread(target=run, args=(chain,)) for chain in chains]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        for launch in _launches:
            launch.kill()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime + ORPHANS_CPU[0]
    print(f"\n{len(chains)} roots, {len(_launches)} launches: {time.monotonic() - t0:.1f} s, {cpu:.1f} CPU seconds "
          f"(user + system)")
    return {"figs": figs, "errors": errors, "no_unshare": no_unshare}


def scenario(runs, name, chain):
    """One scenario's figures; fails with its chain's error if it broke off in it or before it."""
    fig = runs["figs"].get(name)
    if fig is None:
        pytest.fail(f"{name} not reached: {chain}: {runs['errors'].get(chain)}")
    if "error" in fig:
        pytest.fail(f"{name}: {fig['error']}")
    return fig


# ---------------------------------------------------------------------------------- the tests


def test_standalone(runs):
    """Field failure: two jobs writing one directory, started with `torchrun --standalone` (each on its own port):
    the second must be refused before a step, naming the first; the first's requeue (after a crash) takes over at
    once. Here the requeue is the --master_port run of the next test."""
    fig = scenario(runs, "standalone", "torchrun_chain")
    check_refusal(fig, "torchrun --standalone")
    check_takeover(fig)


def test_static_rendezvous(runs):
    """Field failure (issue 28): `torchrun --nproc_per_node 2 --master_port P` twice on one root. torchrun sets
    TORCHELASTIC_RUN_ID to "none" for every static-rendezvous run, so the second looked like the first and took the
    root over, deleting its save in progress. Its requeues are the next test's."""
    fig = scenario(runs, "static", "torchrun_chain")
    check_refusal(fig, "torchrun --master_port, 2 ranks")
    assert fig["a_env"]["TORCHELASTIC_RUN_ID"] == "none", "not the static rendezvous"
    assert fig["b_refused"] == 2, "B must be refused on both its ranks"


def test_two_requeues_at_once(runs):
    """Field failure: a dead run requeued twice at once (the scheduler's requeue and a user's resubmission, or two
    job steps started by one script): both take the dead claim over and train into one root. Two --master_port
    runs with --resume start at the same moment on a root whose claim names a dead run: exactly one trains, the
    other is refused naming the winner."""
    race = scenario(runs, "race", "torchrun_chain")
    win, lose = race[race["winner"]], race[race["loser"]]
    print(f"\ntwo requeues at once on a dead claim (step {race['base']}): {race['winner']} won: exit {win['rcs']} "
          f"(SIGTERMed after training, saved), {len(win['steps'])} steps logged ({win['steps'][:1]}..), resumed from "
          f"{win['resumed']}, takeover logged {len(win['took_over'])}; {race['loser']}: exit {lose['rcs']} after "
          f"{lose['secs']:.1f} s, refused {lose['refused']}, naming the winner: {race['winner_claim'] in lose['out']}, "
          f"steps logged {len(lose['steps'])}, resumed from {lose['resumed']}")
    assert win["rcs"] == [0], f"the winner failed:\n{win['out']}"
    assert win["steps"] and win["steps"][0] == race["base"] + 1, f"the winner's steps {win['steps']}"
    assert win["resumed"] == [str(race["base"])] and len(win["took_over"]) == 1, win["out"]
    assert race["dead"] in win["took_over"][0], f"the winner's takeover does not name the dead run:\n{win['out']}"
    assert lose["rcs"] != [0] and lose["refused"] >= 1, f"the loser was not refused:\n{lose['out']}"
    assert not lose["steps"] and not STEP_LINE.search(lose["out"]), f"the loser trained:\n{lose['out']}"
    assert not lose["took_over"], f"the loser took over too:\n{lose['out']}"
    assert race["winner_claim"] and race["winner_claim"] in lose["out"], (
        f"the loser does not name the winner's claim {race['winner_claim']}:\n{lose['out']}")


def test_c10d_rendezvous(runs):
    """Field failure: one c10d rendezvous id for two runs (run_multinode.sh's default "train_fsdp", or a fixed job
    name), on two nodes each: the second must be refused on both nodes, naming the first. The requeue, after a
    crash, is the job submitted to SLURM (the next test's A): it takes over at once."""
    fig = scenario(runs, "c10d", "run_multinode_chain")
    check_refusal(fig, "c10d rendezvous, 2 nodes x 1 rank")
    check_takeover(fig)
    assert fig["a_env"]["TORCHELASTIC_RUN_ID"] == "train_fsdp"
    assert len(fig["b_rcs"]) == 2 and fig["b_refused"] == 2, f"B's nodes exited {fig['b_rcs']}:\n{fig['b_out']}"


def test_slurm_job_steps_and_requeue(runs):
    """Field failure: two job steps of one SLURM allocation on one root (one SLURM_JOB_ID; an id-based claim let the
    second in), and a requeued job (the same SLURM_JOB_ID, its processes gone) that must take its root back. Both
    through run_multinode.sh as srun starts it; the two steps must get rendezvous of their own (before, the second
    step failed at torchrun's start-up, its port taken by the first: EADDRINUSE), so that ckpt refuses it."""
    fig = scenario(runs, "slurm", "run_multinode_chain")
    print(f"\nSLURM job {fig['job']}: step 0's rendezvous (endpoint, id) = {fig['a_endpoint']}")
    check_refusal(fig, "SLURM")
    check_takeover(fig)
    assert fig["a_env"]["SLURM_JOB_ID"] == str(fig["job"]) and fig["a_env"]["SLURM_STEP_ID"] == "0", fig["a_env"]
    assert "EADDRINUSE" not in fig["b_out"], f"step 1 could not start beside step 0:\n{fig['b_out']}"


def test_container_restart(runs):
    """Field failure: a container restarted with a fresh PID namespace, where the dead run's pid is the new run's
    (a pid-based claim calls the dead owner alive, or itself). A second container on the root is refused; the
    restarted one takes over at once, though its rank 0 has the dead owner's pid."""
    if runs["no_unshare"]:
        pytest.skip(f"no PID namespace here: {runs['no_unshare']}")
    fig = scenario(runs, "container", "container_chain")
    c_pid = json.loads(fig["c_claim"])["pid"]
    print(f"\ncontainer: rank 0's pid in its namespace: A {fig['a_pid']}, C (after A's kill) {c_pid}")
    check_refusal(fig, "container (unshare --pid)")
    check_takeover(fig)
    assert c_pid == fig["a_pid"], "C's rank 0 does not have the dead A's pid: the case this guards is not made"
