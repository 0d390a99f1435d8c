"""Launch real torchrun jobs from tests, always within a time limit, and read their logs."""

import json
import logging
import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_fsdp.py")
# Small enough for a 2-core CPU: a 16-step run takes a few seconds after start-up.
SMALL = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch-size", "8", "--warmup", "4"]


def run(cmd, timeout=180, env=None, check=True, cwd=None):
    """Run cmd in its own process group; on timeout kill the whole group (torchrun and its ranks)."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd or REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return proc.returncode, out


def torchrun(args, nproc=2, script=TRAIN, **kw):
    """torchrun --standalone: each job finds its own free port, so jobs never collide."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return run(cmd, **kw)


def read_log(path):
    """{step: record} from a --log-file; a resumed step overwrites the earlier record of that step."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


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
