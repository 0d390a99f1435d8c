"""Launch real torchrun jobs from tests, always within a time limit, and read their logs."""

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_fsdp.py")
# Small enough for a 2-core CPU: a 16-step run takes a few seconds after start-up.
SMALL = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch-size", "8", "--warmup", "4"]


def run(cmd, timeout=180, env=None, check=True, cwd=None):
    """Run cmd in its own process group; on timeout kill it and every process it started (torchrun and its ranks)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd or REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return proc.returncode, out


def processes():
    """{pid: (parent pid, state letter)} of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the command may hold spaces
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pid):
    """pid and every live process under it."""
    children = {}
    table = processes()
    for p, (parent, _) in table.items():
        children.setdefault(parent, []).append(p)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in table and table[p][1] != "Z":
            found.append(p)
            todo.extend(children.get(p, []))
    return found


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:  # gone meanwhile
            pass


def kill_tree(pid, timeout=10):
    """SIGKILL pid and every process under it, and wait until they are gone. Killing torchrun's process group is
    not enough: torchrun starts each rank in a session of its own, and a rank whose torchrun is killed goes on (and
    holds its checkpoint root). The tree is stopped first, so that nothing in it starts a process unseen."""
    stopped = set()
    while True:
        new = [p for p in descendants(pid) if p not in stopped]
        if not new:
            break
        signal_all(new, signal.SIGSTOP)
        stopped.update(new)
    signal_all(stopped, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # a killed process is gone once it is a zombie: its files are closed
        table = processes()
        if all(p not in table or table[p][1] == "Z" for p in stopped):
            return
        time.sleep(0.02)
    raise AssertionError(f"processes {sorted(stopped)} still run {timeout} s after SIGKILL")


def torchrun(args, nproc=2, script=TRAIN, **kw):
    """torchrun --standalone: each job finds its own free port, so jobs never collide."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return run(cmd, **kw)


def logged_steps(path):
    """The steps of a --log-file in the order they were logged: a run that did not stop or resume shows here."""
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def read_log(path):
    """{step: record} from a --log-file; a resumed step overwrites the earlier record of that step."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


def result_line(out, said=""):
    """The JSON of a job's "RESULT <json>" line (rank 0 prints it); a job that printed none fails here."""
    line = next((line for line in out.splitlines() if line.startswith("RESULT ")), None)
    assert line, f"no RESULT line{said}:\n{out[-4000:]}"
    return json.loads(line[len("RESULT "):])


def scenarios_result(out, job, said):
    """The RESULT line of a job of tests/state_job.py's run_scenarios() (said: how it ended, printed with each
    scenario's seconds): {scenario: [each rank's figures]}; a missing line, a scenario that hung or a job that did
    not finish fails here."""
    result = result_line(out, f" ({said})")
    secs = {name: [r.get("secs") for r in ranks] for name, ranks in result.items() if isinstance(ranks, list)}
    print(f"\n{job}: {said}; {result.get('timing')}; seconds per scenario {secs}")
    assert "hung" not in result, f"scenario {result['hung']} hung:\n{out[-4000:]}"
    assert result.get("done"), out[-4000:]
    return result


def max_abs_diff(ref, got, key="loss"):
    """max |ref - got| over the steps in got (every step of got must be in ref)."""
    return max(abs(ref[s][key] - got[s][key]) for s in got)


class Lines(logging.Handler):
    """ckpt's log lines in a job, so that a scenario can show what was announced (a takeover, a move aside)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def take(self, *phrases):
        """The lines since the last take() that contain any of phrases; clears the buffer."""
        lines = [ln for ln in self.lines if any(p in ln for p in phrases)]
        self.lines.clear()
        return lines


def lock_is_free(root):
    """Whether another process could claim root now: try its lock (from a new open file, not ckpt's)."""
    fd = os.open(os.path.join(root, ".owner.json"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it, if taken


class Patched:
    """Replace <module>.<dotted name> (a function of ckpt, or of a module or class it uses) in this process while the
    with-block runs, if mine (the scenario's rank); ckpt.zlib.crc32 and ckpt.os.makedirs patch those modules."""

    def __init__(self, module, name, mine, fake):
        *path, self.attr = name.split(".")
        self.owner = module
        for part in path:
            self.owner = getattr(self.owner, part)
        self.mine, self.fake = mine, fake

    def __enter__(self):
        self.own = self.attr in vars(self.owner)  # else inherited: restored by deleting ours
        self.real = vars(self.owner).get(self.attr)
        if self.mine:
            setattr(self.owner, self.attr, self.fake)

    def __exit__(self, *exc):
        if self.mine:
            if self.own:
                setattr(self.owner, self.attr, self.real)
            else:
                delattr(self.owner, self.attr)


def refused_everywhere(ranks, *phrases):
    """Every rank raised CheckpointError with each phrase in its message; returns rank 0's message."""
    for r, res in enumerate(ranks):
        assert res["raised"] == "CheckpointError", f"rank {r}: {res['raised']}: {res['msg']}"
        for phrase in phrases:
            assert phrase in res["msg"], f"rank {r}: {phrase!r} not in {res['msg']}"
    return ranks[0]["msg"]
