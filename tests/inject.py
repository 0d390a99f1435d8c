"""Run train_fsdp.py with one fault injected from outside the shipped files.

    FAULT=kill_mid_write FAULT_RANK=1 FAULT_STEP=6 FAULT_DIR=/tmp/f \
        torchrun --standalone --nproc-per-node 2 tests/inject.py <train_fsdp.py flags>

The wrapper patches ckpt / DCP in this process only, then runs train_fsdp.py
unchanged through runpy, exactly as torchrun would. Only the rank FAULT_RANK
(or every rank: FAULT_RANK=all) misbehaves, and only during the save of step
FAULT_STEP. Faults:

    kill_before_write   SIGKILL on entering DCP's write_data: the temp dir exists, no shard yet
    kill_mid_write      SIGKILL after KILL_AFTER_BYTES of this rank's shard reached the disk
    kill_before_commit  (rank 0) SIGKILL after manifest.json is in the temp dir, before the rename
    kill_after_commit   (rank 0) SIGKILL after the rename, before retention
    kill_mid_retain     (rank 0) SIGKILL halfway through deleting an old checkpoint
    enospc              write_data raises OSError(ENOSPC)
    slow_write          write_data sleeps FAULT_DELAY seconds first
    preempt             every rank sleeps FAULT_DELAY after each optimizer step; after step
                        FAULT_STEP the target rank writes ready.<rank> so the test can SIGTERM it

Evidence for the test goes to FAULT_DIR: pid.<rank>, fired.<rank> (the fault
happened, so a passing test really exercised it), error.<rank> (the exception a
rank died with) and exit.<rank> (the exit code of a rank that returned).
"""

import contextlib
import errno
import os
import runpy
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_fsdp.py")
sys.path.insert(0, REPO)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import ckpt  # noqa: E402  (the very module train_fsdp.py will import)

FAULT = os.environ.get("FAULT", "")
RANK = int(os.environ["RANK"])
TARGET = os.environ.get("FAULT_RANK", "1")
STEP = int(os.environ.get("FAULT_STEP", "0"))
DELAY = float(os.environ.get("FAULT_DELAY", "0"))
OUT = os.environ.get("FAULT_DIR", ".")
KILL_AFTER_BYTES = 256 * 1024

current = {"step": None}  # the step being saved, set by the patched ckpt.save


def note(kind, text=""):
    with open(os.path.join(OUT, f"{kind}.{RANK}"), "w") as f:
        f.write(str(text))
        f.flush()
        os.fsync(f.fileno())


def targeted():
    return (TARGET == "all" or int(TARGET) == RANK) and current["step"] == STEP


def die(where):
    note("fired", where)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


real_save = ckpt.save


def save(root, step, *args, **kwargs):
    current["step"] = step
    return real_save(root, step, *args, **kwargs)


ckpt.save = save


class DyingStream:
    """A shard file that gets KILL_AFTER_BYTES onto the disk, then the process dies."""

    def __init__(self, f):
        self.f, self.written = f, 0

    def write(self, data):
        data = memoryview(data).cast("B")
        room = KILL_AFTER_BYTES - self.written
        if len(data) >= room:
            self.f.write(data[:room])
            self.f.flush()
            os.fsync(self.f.fileno())  # a torn file on disk, as a power cut or OOM kill leaves it
            die(f"mid-write of {self.f.name} after {KILL_AFTER_BYTES} bytes")
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@contextlib.contextmanager
def dying_create_stream(path, mode):
    with open(path, mode) as f:
        yield DyingStream(f)


real_write_data = dcp.FileSystemWriter.write_data


def write_data(self, plan, planner):
    if targeted():
        if FAULT == "kill_before_write":
            die("before write_data")
        if FAULT == "kill_mid_write":
            self.fs.create_stream = dying_create_stream  # this writer instance only
        if FAULT == "enospc":
            note("fired", "ENOSPC")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        if FAULT == "slow_write":
            note("fired", f"sleep {DELAY}")
            time.sleep(DELAY)
    return real_write_data(self, plan, planner)


dcp.FileSystemWriter.write_data = write_data

real_write_manifest = ckpt._write_manifest


def write_manifest(ckpt_dir, manifest):
    real_write_manifest(ckpt_dir, manifest)
    if FAULT == "kill_before_commit" and targeted():
        die(f"manifest written in {ckpt_dir}, not renamed")


ckpt._write_manifest = write_manifest

real_retain = ckpt._retain


def retain(*args):
    if FAULT == "kill_after_commit" and targeted():
        die("committed, before retention")
    return real_retain(*args)


ckpt._retain = retain


class DyingShutil:
    """ckpt's view of shutil: deleting an old checkpoint stops after its first file."""

    def __init__(self, real):
        self.real = real

    def rmtree(self, path, *args, **kwargs):
        if FAULT == "kill_mid_retain" and targeted() and "delete-step" in os.path.basename(path):
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            die(f"mid-delete of {path}")
        return self.real.rmtree(path, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


ckpt.shutil = DyingShutil(ckpt.shutil)

if FAULT == "preempt":
    steps_done = {"n": 0}

    def after_step(optimizer, args, kwargs):
        # Slows the run so that a signal from outside lands during training, not after it.
        steps_done["n"] += 1
        if steps_done["n"] == STEP and (TARGET == "all" or int(TARGET) == RANK):
            note("ready", os.getpid())
        time.sleep(DELAY)

    register_optimizer_step_post_hook(after_step)

note("pid", os.getpid())
sys.argv = [TRAIN] + sys.argv[1:]
try:
    runpy.run_path(TRAIN, run_name="__main__")
except SystemExit as e:
    note("exit", e.code)
    raise
except BaseException as e:  # DCP's CheckpointException is a BaseException
    note("error", f"{type(e).__name__}: {e}")
    raise
