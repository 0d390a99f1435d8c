"""torchrun --standalone for tests, without importing torch in every rank of every launch.

On a 2-core machine importing torch and its distributed modules costs ~5 s of CPU per process: a 4-rank
torchrun launch spends ~25 s of CPU before its first step. Here one server process (the "zygote") imports
them once; for each launch it forks a launcher, which forks the ranks. Each rank sets the environment torchrun
sets and runs the script as __main__ (sys.argv, sys.path[0] and __file__ as `python script.py` has them).
The ranks are separate processes with their own gloo connections, meeting at a TCPStore the launcher hosts
(as torchrun's agent does: TORCHELASTIC_USE_AGENT_STORE), so no port is guessed. Python's `random` is reseeded
in each child (CPython does so after fork), so it differs between ranks as in fresh processes; torch's
generators keep their import-time state, the same in every fresh process. When a rank fails, the others get
SIGTERM, then SIGKILL after GRACE seconds (torchrun does the same), and the launch exits with its code.
A launch has its own session: a timeout kills it whole (launcher and ranks), never the zygote; the zygote
ends when the test process closes its stdin (or dies), killing a launch still running.

Only for tests of scripts: the real launchers (torchrun, run_multinode.sh) are tested by their own tests.
The zygote must not run torch ops itself (fork after OpenMP is unsafe). run_here() forks ranks from the
calling process instead, for a script the zygote runs that launches scripts in turn (test_resume.py).

    python tests/forkrun.py NPROC script.py args...    # one launch, from the command line

    ZYGOTE = forkrun.shared()                          # in a test module, before it imports torch
    rc, out = ZYGOTE.run(2, "tests/user_loop.py", ["--steps", "8"], timeout=120)   # FORKRUN_VERBOSE=1: timings
"""

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

GRACE = 5.0  # seconds the other ranks get after one failed, before SIGKILL
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preimport():
    """What the ranks of our scripts import (torch._dynamo: FSDP2 and DTensor import it at their first call)."""
    import numpy.random  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401


def run_rank(rank, nproc, read_fd, script, args, out=None, env=None, cwd=None):
    """In a rank: wait for the store's port, then run the script; never returns."""
    code = 1
    try:
        if out is not None:
            os.dup2(out, 1)
            os.dup2(out, 2)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        with os.fdopen(read_fd) as f:
            port = f.read().strip()
        if not port:
            os._exit(1)  # the launcher failed before hosting the store
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
                          TORCHELASTIC_RUN_ID=f"forkrun-{port}", TORCHELASTIC_RESTART_COUNT="0")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: B036 (the rank's failure, printed as python prints it)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: FSDP's gloo threads may still be about


def launch(nproc, script, args, out=None, env=None, cwd=None, deadline=None):
    """Fork nproc ranks of script, host their store, wait for them; return the exit code (0: all succeeded),
    or None if they ran past deadline (time.monotonic()) and were killed. out: a file descriptor for their
    output (default: this process's); env, cwd: theirs (default: this process's)."""
    import torch.distributed as dist

    def say(message):
        os.write(2 if out is None else out, f"forkrun: {message}\n".encode())

    sys.stdout.flush()
    sys.stderr.flush()
    children, pipes = {}, []
    for rank in range(nproc):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            for other in pipes:
                os.close(other)
            run_rank(rank, nproc, r, script, args, out, env, cwd)
        os.close(r)
        pipes.append(w)
        children[pid] = rank
    try:  # after the forks, so that no rank inherits the store's server thread
        store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        port = str(store.port)
    except Exception as e:  # noqa: BLE001
        say(f"no TCPStore: {e!r}")
        port = ""
    for w in pipes:
        os.write(w, f"{port}\n".encode())
        os.close(w)

    def forward(signum, _=None):
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    code, failed_at = (0 if port else 1), None
    try:
        while children:
            if deadline is not None and time.monotonic() > deadline:
                say(f"timed out: killing ranks {sorted(children.values())}")
                forward(signal.SIGKILL)
                for pid in children:
                    os.waitpid(pid, 0)
                return None
            if failed_at is not None and time.monotonic() > failed_at + GRACE:
                forward(signal.SIGKILL)
            for pid in list(children):
                waited, status = os.waitpid(pid, os.WNOHANG)
                if not waited:
                    continue
                rank, rc = children.pop(pid), os.waitstatus_to_exitcode(status)
                if rc != 0 and failed_at is None:
                    code = rc if rc > 0 else 128 - rc
                    say(f"rank {rank} exited with {rc}: stopping the others")
                    failed_at = time.monotonic()
                    forward(signal.SIGTERM)
            time.sleep(0.02)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code


def run_here(nproc, script, args, env=None, timeout=180, check=True, cwd=None):
    """Zygote.run's twin that forks the ranks from this very process, which must have imported torch and run
    no torch op yet (OpenMP's threads do not survive a fork): a script the zygote itself runs, such as
    test_resume.py's pytest under tests/test_setups.py, whose launches then cost no import either."""
    import tempfile

    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryFile("w+") as out:
        code = launch(nproc, os.path.abspath(script), [str(a) for a in args], out.fileno(), env,
                      str(cwd or REPO), time.monotonic() + timeout)
        out.seek(0)
        text = out.read()
    cmd = f"forkrun {nproc} {script} {' '.join(map(str, args))}"
    if code is None:
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n{text[-4000:]}")
    if check and code != 0:
        raise AssertionError(f"exit {code}: {cmd}\n{text[-6000:]}")
    return code, text


def serve():
    """The zygote: one JSON request per line on stdin {nproc, script, args, env, cwd, out}; for each, a launcher
    in a session of its own, its output to the file `out`; replies {"pid": launcher} then {"rc": exit code,
    "cpu": seconds}. When stdin closes (the test process ended, or was killed), a launch still running is
    killed and the zygote exits: nothing outlives the test."""
    preimport()
    gc.freeze()  # what is imported stays out of the collector's sight: forked ranks copy fewer pages on write
    reply, buf = os.dup(1), b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 65536)
            if not chunk:
                os._exit(0)  # skips torch's slow interpreter teardown
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(launcher(req, reply))
        os.write(reply, (json.dumps({"pid": pid}) + "\n").encode())
        while True:
            waited, status, usage = os.wait4(pid, os.WNOHANG)  # usage: the launcher's and its ranks' CPU time
            if waited:
                break
            if select.select([0], [], [], 0.2)[0] and not os.read(0, 65536):  # the client is gone
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os._exit(1)
        done = {"rc": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
        os.write(reply, (json.dumps(done) + "\n").encode())


def launcher(req, reply):
    """In the launcher: a session of its own (a timeout kills it whole), output to req["out"]; returns the code."""
    code = 1
    try:
        os.setsid()
        os.close(reply)
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        code = launch(req["nproc"], req["script"], req["args"])
    except BaseException:  # noqa: B036
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


class Zygote:
    """The test side: start the zygote (it imports torch once, ~5 s of CPU), then run launches through it."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.fds = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        self.buf, self.count, self.cpu = b"", 0, 0.0  # cpu: seconds the launches took, ranks included

    def _reply(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fds[0]], [], [], left)[0]:
                return None
            chunk = os.read(self.fds[0], 4096)
            if not chunk:
                raise AssertionError("the forkrun zygote died")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, nproc, script, args, env=None, timeout=180, check=True, cwd=None, out=None):
        """Like harness.torchrun: (exit code, stdout and stderr of every rank); raises on timeout or, with
        check, on failure. out: where the output goes (default: a file in /tmp, removed after reading)."""
        self.count += 1
        path = out or f"/tmp/forkrun-{os.getpid()}-{self.count}.txt"
        env = dict(os.environ if env is None else env)
        env.setdefault("OMP_NUM_THREADS", "1")
        req = {"nproc": nproc, "script": os.path.abspath(script), "args": [str(a) for a in args], "env": env,
               "cwd": str(cwd or REPO), "out": str(path)}
        os.write(self.fds[1], (json.dumps(req) + "\n").encode())
        deadline = time.monotonic() + timeout
        started = self._reply(time.monotonic() + 60)
        assert started is not None, "the forkrun zygote does not answer"
        pid = started["pid"]
        done = self._reply(deadline)
        if done is not None:
            self.cpu += done["cpu"]
            if os.environ.get("FORKRUN_VERBOSE"):
                print(f"[forkrun: {nproc} x {os.path.basename(script)} {' '.join(map(str, args))[-80:]}: "
                      f"{time.monotonic() - deadline + timeout:.1f} s, {done['cpu']:.1f} s of CPU]", flush=True)
        if done is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reply(time.monotonic() + 60)
        with open(path) as f:
            text = f.read()
        if out is None:
            os.remove(path)
        cmd = f"forkrun {nproc} {script} {' '.join(map(str, args))}"
        if done is None:
            raise AssertionError(f"timed out after {timeout}s: {cmd}\n{text[-4000:]}")
        if check and done["rc"] != 0:
            raise AssertionError(f"exit {done['rc']}: {cmd}\n{text[-6000:]}")
        return done["rc"], text

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_shared = []


def shared():
    """This process's zygote, started at the first call and closed at exit: test modules call it at import,
    before importing torch themselves, so that both imports run at once; every module of a session shares it."""
    if not _shared:
        _shared.append(Zygote())
        atexit.register(_shared[0].close)
    return _shared[0]


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        preimport()
        sys.exit(launch(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
