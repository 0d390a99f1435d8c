"""Start multi-rank jobs without paying for `import torch` each time: each rank is forked from a warm process.

torchrun costs about 7 s per job on a 2-core machine before the first step: it imports torch itself, then each
rank imports torch again. Fault tests launch many short jobs, so here each rank index has a "zygote", a Python
process started once per test session (at the import of this module) that has imported torch, DCP and FSDP2. A
job's rank r is a fork of zygote r that runs the script as `python script args` would (sys.argv, __main__, its own
environment, cwd and exit code), with the environment torchrun gives a rank (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT). As under torchrun, the rendezvous store is hosted outside the ranks (here, by the test process)
and the ranks' output goes to one stream (a file).

What differs from torchrun, on purpose: a rank that fails does not take the others down at once; they get GRACE
seconds to fail by themselves (so each rank's own error is seen), then are SIGKILLed. The ranks of one job come
from different zygotes, so they have different hash seeds and random states, as separate processes have. A rank
ends as a script does (non-daemon threads joined, atexit callbacks run, output flushed), without the module
teardown (over a second with torch loaded). The objects the zygote's imports made are frozen (gc.freeze), so a
rank's gc.collect() does not walk them: they are all modules and never garbage.

    job = start(["train_fsdp.py", "--steps", "4"], env={...})    # job.pids: the ranks' process ids
    rc, out = job.wait(timeout=60)                               # rc: 0 if every rank exited 0; job.rcs: each

A job ends any job still running when it starts (one its test left behind), and its rank r comes from zygote r.
Jobs meant to run at once (a fixture's concurrent launches, from threads) are started with beside=True: such a job
leaves the running ones alone and takes zygotes that run no rank now, starting more if there are too few.
"""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE = 10.0  # seconds a rank may outlive a failed one before it is killed (a fallback: gloo fails them at once)

ZYGOTE = r'''
import ctypes, os, signal, sys
replies = os.fdopen(os.dup(1), "wb")  # the protocol's channel; a stray print goes to stderr
os.dup2(2, 1)


def die_with_parent():  # Linux: SIGKILL when the parent dies (a killed test run leaves no process behind)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


die_with_parent()
import atexit, gc, json, random, runpy, threading
# What every job imports: paid once here. Only the main thread exists after these imports, so forking is safe.
import torch, torch.distributed, torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.tensor
import torch.distributed.checkpoint.state_dict, torch.distributed.checkpoint.staging, torch.nn.functional
import torch._dynamo, torch.profiler, torch.utils.serialization  # imported lazily by FSDP2's first step (~1 s)
import safetensors.torch
assert len(os.listdir("/proc/self/task")) == 1, "a zygote must not fork with threads running"
gc.collect()
gc.freeze()  # what the imports made is permanent: a rank's gc.collect() skips it (and leaves its pages shared)


def child(req):
    """Become `python argv...` with req's environment; never returns."""
    die_with_parent()
    out = os.open(req["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1), os.dup2(out, 2), os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    replies.close()
    for sig in (signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    random.seed()  # a fresh process's Python RNG is seeded from the OS
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # A script's exit: wait for the threads that are not daemons, run atexit callbacks, flush; no module teardown.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def reply(**kwargs):
    replies.write(json.dumps(kwargs).encode() + b"\n")
    replies.flush()


for line in iter(sys.stdin.buffer.readline, b""):
    req = json.loads(line)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(req)
    reply(pid=pid)
    _, status, usage = os.wait4(pid, 0)
    reply(rc=os.waitstatus_to_exitcode(status), cpu=usage.ru_utime + usage.ru_stime)
'''


class _Zygote:
    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd=REPO, start_new_session=True)
        self.buf = b""

    def send(self, req):
        self.proc.stdin.write(json.dumps(req).encode() + b"\n")
        self.proc.stdin.flush()

    def reply(self, timeout):
        """The zygote's next reply, or None if none came within timeout seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"a zygote died (exit {self.proc.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


_zygotes = []
_running = []  # the jobs whose ranks are alive: one, or several started with beside=True
_lock = threading.Lock()  # jobs started with beside=True may be started from several threads


def _zygote(rank):
    while len(_zygotes) <= rank:
        _zygotes.append(_Zygote())
    return _zygotes[rank]


def _idle(n):
    """n zygotes that run no rank of a running job (each zygote runs one rank at a time), lowest first."""
    busy = {id(z) for job in _running for z, rc in zip(job.zygotes, job.rcs) if rc is None}
    idle, r = [], 0
    while len(idle) < n:
        z = _zygote(r)
        if id(z) not in busy:
            idle.append(z)
        r += 1
    return idle


@atexit.register
def _stop():
    for job in _running:
        job.kill()
    for z in _zygotes:
        z.proc.stdin.close()
        try:
            z.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            z.proc.kill()


def warm(nproc=2):
    """Start the zygotes now (they import torch in parallel, a few seconds), rather than at the first job."""
    for r in range(nproc):
        _zygote(r)


warm()  # at import: the zygotes import torch while the importing test module does (import this module first)


class Job:
    """The ranks of one job: pids, rcs (exit codes, None while running), cpu (CPU seconds of each rank)."""

    def __init__(self, argv, nproc, env, out, cwd, beside=False):
        if not beside:
            for job in list(_running):  # a job its test left running (it failed before wait()): end it first
                job.kill()
                job.wait(30)
        env = dict(os.environ if env is None else env)
        env.setdefault("OMP_NUM_THREADS", "1")
        from torch.distributed import TCPStore  # here: the zygotes start before this process imports torch

        # The rendezvous store lives here, as torchrun's agent hosts it: every rank is its client.
        self.store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
        self.argv, self.env, self.out, self.t0 = argv, env, out, time.monotonic()
        self.pids, self.rcs, self.cpu = [], [None] * nproc, [None] * nproc
        open(out, "w").close()
        with _lock:
            self.zygotes = _idle(nproc) if beside else [_zygote(rank) for rank in range(nproc)]
            _running.append(self)
        for rank, z in enumerate(self.zygotes):
            z.send({"argv": argv, "env": dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), "out": out, "cwd": cwd})
            started = z.reply(120)  # the first job waits for the zygotes' imports
            if started is None:
                self.kill()
                raise AssertionError(f"zygote {rank} did not start rank {rank} within 120 s")
            self.pids.append(started["pid"])

    def kill(self, sig=signal.SIGKILL):
        for pid, rc in zip(self.pids, self.rcs):
            if rc is None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def poll(self, timeout=0.0):
        """Collect the exit codes of ranks that ended; True once every rank has."""
        per = timeout / max(1, self.rcs.count(None))
        for r, rc in enumerate(self.rcs):
            if rc is None and r < len(self.pids):
                got = self.zygotes[r].reply(per)
                if got is not None:
                    self.rcs[r], self.cpu[r] = got["rc"], got["cpu"]
        if None not in self.rcs and self in _running:
            with _lock:
                _running.remove(self)
        return None not in self.rcs

    def wait(self, timeout=120, check=False):
        """(rc, output): rc is 0 if every rank exited 0, else the first nonzero exit code (-9: SIGKILL). A job
        still running `timeout` seconds after its start is killed, and AssertionError raised."""
        deadline, failed_at, timed_out = self.t0 + timeout, None, False
        while not self.poll(0.05):
            now = time.monotonic()
            if failed_at is None and any(rc not in (None, 0) for rc in self.rcs):
                failed_at = now
            if now > deadline or failed_at is not None and now - failed_at > GRACE:
                timed_out = timed_out or now > deadline
                self.kill()
                while not self.poll(1.0):
                    pass
        with open(self.out, errors="replace") as f:
            output = f.read()
        if os.environ.get("LAUNCH_LOG"):  # a record per job: what it cost
            with open(os.environ["LAUNCH_LOG"], "a") as f:
                f.write(json.dumps({"script": os.path.basename(self.argv[0]), "fault": self.env.get("FAULT"),
                                    "wall": time.monotonic() - self.t0, "cpu": self.cpu, "rcs": self.rcs}) + "\n")
        rc = next((rc for rc in self.rcs if rc), 0)
        if timed_out:
            raise AssertionError(f"timed out after {timeout}s: {' '.join(self.argv)}\n{output[-4000:]}")
        if check and rc:
            raise AssertionError(f"exit codes {self.rcs}: {' '.join(self.argv)}\n{output[-6000:]}")
        return rc, output


def module_job(request, tmp_path_factory, job):
    """A module fixture's body: the 2-rank job (a script taking WORK OUT) started once, if a selected test of the
    module asks for "job", so that its ranks run while the module's other tests do. Yields {"dir", "job"}."""
    if not any("job" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    d = tmp_path_factory.mktemp(os.path.splitext(os.path.basename(job))[0])
    started = start([job, d / "work", d / "out"], env=dict(os.environ, OMP_NUM_THREADS="1"), out=d / "job.txt")
    yield {"dir": d, "job": started}
    if None in started.rcs:  # a test failed before waiting for it
        started.kill()
        started.wait(30)


def start(argv, nproc=2, env=None, out=None, cwd=REPO, beside=False):
    """Start `python argv...` as nproc ranks; out: the file both ranks' output goes to. beside=True: beside the
    jobs running now (on other zygotes), instead of ending them."""
    if out is None:
        fd, out = tempfile.mkstemp(prefix="launch-", suffix=".log")
        os.close(fd)
    return Job([str(a) for a in argv], nproc, env, str(out), cwd, beside)


def run(argv, nproc=2, env=None, timeout=120, check=True, out=None, beside=False):
    """Start a job and wait for it: (rc, output)."""
    return start(argv, nproc, env, out, beside=beside).wait(timeout, check)
