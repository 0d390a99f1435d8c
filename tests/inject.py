"""Run train_fsdp.py with one fault injected from outside the shipped files.

    FAULT=kill_mid_write FAULT_RANK=1 FAULT_STEP=6 FAULT_DIR=/tmp/f \
        torchrun --standalone --nproc-per-node 2 tests/inject.py <train_fsdp.py flags>

The wrapper patches DCP's FileSystemWriter, ckpt.fsync_dir and shutil.rmtree in this process only, then runs
train_fsdp.py unchanged through runpy, exactly as torchrun would. Only the rank FAULT_RANK (or every rank:
FAULT_RANK=all) misbehaves, and only in the save of step FAULT_STEP, recognised by its directory
(.tmp-step-<FAULT_STEP>-*), so a fault lands in the right save whether it is written in the background or not.
Faults, in the order of a save (ckpt.py's docstring: 4. write, 5. commit, 6. retain):

    kill_before_write   SIGKILL on entering DCP's write_data: the temp dir exists, no byte of this rank's shard
    kill_mid_write      SIGKILL once KILL_AFTER_BYTES of this rank's shard are on disk (fsynced): a torn file
    kill_after_write    SIGKILL right after DCP's write_data wrote this rank's shard, before DCP finished the save
    kill_before_commit  (rank 0) SIGKILL when the commit fsyncs the temp dir: manifest.json is in it, not renamed
    kill_after_commit   (rank 0) SIGKILL once the rename to step-N is fsynced, before retention
    kill_mid_retain     (rank 0) SIGKILL after the commit of FAULT_STEP, halfway through deleting an old step
    enospc              write_data raises OSError(ENOSPC)
    slow_write          write_data sleeps FAULT_DELAY seconds first
    hold_write          write_data waits until the test creates FAULT_DIR/release (at most 60 s)
    preempt             every rank sleeps FAULT_DELAY after each training step; after FAULT_STEP training steps of
                        this process the target rank writes ready.<rank> so the test can SIGTERM it. With
                        FAULT_WORKERS=take_sigterm (a control), DataLoader workers get no worker_init_fn: they keep
                        SIGTERM's default action, death

Any fault: FAULT_WORKER_POLL=S makes DataLoader workers check every S seconds (torch: 5) that their rank lives.

Evidence for the test goes to FAULT_DIR: pid.<rank>, fired.<rank> (the fault happened, so a passing test really
exercised it), error.<rank> (the exception a rank died with) and exit.<rank> (the exit code of a rank that returned).
"""

import errno
import os
import re
import runpy
import shutil
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
ME = TARGET == "all" or int(TARGET) == RANK


def note(kind, text=""):
    """FAULT_DIR/<kind>.<rank>, whole or not at all: a test may read it the moment it appears."""
    path = os.path.join(OUT, f"{kind}.{RANK}")
    with open(path + ".part", "w") as f:
        f.write(str(text))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def die(where):
    note("fired", where)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def targeted(fault, path):
    """This rank, this fault, and path is (in) the temp directory of the save of step STEP."""
    m = re.match(r"\.tmp-step-(\d+)-", os.path.basename(os.path.normpath(str(path))))
    return FAULT == fault and ME and m is not None and int(m.group(1)) == STEP


# ---- 4. write: DCP's FileSystemWriter, which ckpt uses as it is ----

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


class DyingFile:
    def __init__(self, path, mode):
        self.f = open(path, mode)

    def __enter__(self):
        return DyingStream(self.f)

    def __exit__(self, *exc):
        self.f.close()


real_write_data = dcp.FileSystemWriter.write_data


def write_data(self, plan, planner):
    if targeted("kill_before_write", self.path):
        die(f"entering write_data in {self.path}")
    if targeted("kill_mid_write", self.path):
        self.fs.create_stream = DyingFile  # this writer's file system object only
    if targeted("enospc", self.path):
        note("fired", "ENOSPC")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
    if targeted("slow_write", self.path):
        note("fired", f"sleep {DELAY}")
        time.sleep(DELAY)
    if targeted("hold_write", self.path):
        note("fired", "held until FAULT_DIR/release")
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(OUT, "release")) and time.monotonic() < deadline:
            time.sleep(0.02)
    result = real_write_data(self, plan, planner)
    if targeted("kill_after_write", self.path):
        die(f"after write_data in {self.path}: {sorted(os.listdir(self.path))}")
    return result


dcp.FileSystemWriter.write_data = write_data


# ---- 5. commit: ckpt fsyncs the temp dir (manifest.json in it), renames it, fsyncs the root ----

real_fsync_dir = ckpt.fsync_dir
committed = {"step": False}  # this process committed step STEP (kill_mid_retain waits for that)


def fsync_dir(path):
    real_fsync_dir(path)
    if targeted("kill_before_commit", path) and os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
        die(f"manifest.json written in {path}, not renamed")
    if ME and os.path.isdir(ckpt.step_dir(path, STEP)):  # the root, fsynced after the rename to step-N
        committed["step"] = True
        if FAULT == "kill_after_commit":
            die(f"{ckpt.step_dir(path, STEP)} committed, before retention")


ckpt.fsync_dir = fsync_dir


# ---- 6. retain: ckpt renames an old step to .tmp-delete-step-*, then shutil.rmtree ----

real_rmtree = shutil.rmtree


def rmtree(path, *args, **kwargs):
    if FAULT == "kill_mid_retain" and committed["step"] and "delete-step" in os.path.basename(str(path)):
        os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
        die(f"mid-delete of {path}")
    return real_rmtree(path, *args, **kwargs)


shutil.rmtree = rmtree


# ---- training: preemption ----

if FAULT == "preempt":
    steps_done = {"n": 0}

    def after_step(optimizer, args, kwargs):
        # Counts training steps only: load() steps a fresh optimizer once to make its state, before train_fsdp.py
        # installs its SIGTERM handler (a signal then would kill the rank, as it would any process).
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            return
        steps_done["n"] += 1
        if steps_done["n"] == STEP and ME:
            note("ready", os.getpid())
        time.sleep(DELAY)  # slows the run so that a signal from outside lands during training, not after it

    register_optimizer_step_post_hook(after_step)

    if os.environ.get("FAULT_WORKERS") == "take_sigterm":
        import torch.utils.data

        real_init = torch.utils.data.DataLoader.__init__

        def without_worker_init(self, *args, **kwargs):
            kwargs.pop("worker_init_fn", None)
            real_init(self, *args, **kwargs)

        torch.utils.data.DataLoader.__init__ = without_worker_init

if os.environ.get("FAULT_WORKER_POLL"):
    # DataLoader workers forked after ckpt's gloo group exists (a resumed run) hold its sockets: a SIGKILLed rank's
    # peers see it gone only once its orphaned workers exit, which they check every MP_STATUS_CHECK_INTERVAL
    # seconds (torch: 5). FAULT_WORKER_POLL: that interval, shorter (the workers stay; they notice sooner).
    import torch.utils.data._utils.worker

    torch.utils.data._utils.worker.MP_STATUS_CHECK_INTERVAL = float(os.environ["FAULT_WORKER_POLL"])

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
