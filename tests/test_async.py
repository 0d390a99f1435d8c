"""Asynchronous saves: training goes on while the checkpoint is written, and nothing unsafe is committed.

Guards against the field's async-checkpoint failures:
  * the "latest" checkpoint advanced (and the previous one deleted by retention)
    before every rank's background write was durable, so a crash left nothing
    loadable (KempnerInstitute/KempnerForge #102);
  * a staged "copy" that shares memory with the live parameters: on CPU, moving a
    tensor "to the CPU" returns the same tensor, and the optimizer step that follows
    the save lands in the checkpoint (a torn mix of step N and N+1);
  * a resume from an asynchronously written checkpoint that is not continuous;
  * a rank killed in the middle of a background write;
  * a background write that fails on one rank (disk full) and is reported on that
    rank only, or never, while the others carry on or hang.

Faults are injected from outside the shipped files: a wrapper patches
dcp.FileSystemWriter.write_data (which runs in the background thread) for one rank
and one step, then runs train_fsdp.py unchanged; the staging and write-failure tests
call ckpt directly from a small torchrun script (DIRECT below).

    python -m pytest -q -s tests/test_async.py
"""

import concurrent.futures
import json
import os
import time

import pytest

import ckpt
from tests.harness import REPO, SMALL, TRAIN, read_log, torchrun

STEPS = 16
COMMON = SMALL + ["--steps", str(STEPS), "--save-every", "4", "--keep", "3", "--dropout", "0.1", "--seed", "3",
                  "--async-save", "--timeout", "60", "--ckpt-timeout", "60"]
HOLD_STEP = 8  # the save whose background write the fault hits, on rank FAULT_RANK
FAULT_RANK = 1

# ASYNC_FAULT=delay: rank 1 holds its write of step 8 until the test creates $ASYNC_DIR/release
# (at most 120 s); kill: rank 1 writes its shard of step 8, then SIGKILLs itself before DCP finishes.
WRAPPER = '''
import os, runpy, signal, sys, time
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

real_write = dcp.FileSystemWriter.write_data
fault, where = os.environ["ASYNC_FAULT"], os.environ["ASYNC_DIR"]


def write_data(self, plan, planner):
    if dist.get_rank() != {rank} or ".tmp-step-{step:08d}-" not in str(self.path):
        return real_write(self, plan, planner)
    if fault == "delay":
        open(os.path.join(where, "held"), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(where, "release")) and time.monotonic() < deadline:
            time.sleep(0.05)
        return real_write(self, plan, planner)
    real_write(self, plan, planner)  # kill: this rank's shard is on disk ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... and the rank dies before the checkpoint is finished


dcp.FileSystemWriter.write_data = write_data
sys.argv = [{train!r}] + sys.argv[1:]
runpy.run_path({train!r}, run_name="__main__")
'''


def launch_faulty(d, fault, args, **kw):
    wrapper = d / "async_fault.py"
    wrapper.write_text(WRAPPER.format(repo=REPO, train=TRAIN, rank=FAULT_RANK, step=HOLD_STEP))
    env = dict(os.environ, ASYNC_FAULT=fault, ASYNC_DIR=str(d))
    return torchrun(COMMON + args, script=str(wrapper), env=env, **kw)


def listing(root):
    """The root's entries, temporary names without their unique suffix, the run's claim (.owner.json) left out."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n.rsplit("-", 1)[0] if n.startswith(".tmp-step-") else n for n in names if n != ".owner.json")


def tmp_dir(root, step):
    return next(os.path.join(root, n) for n in os.listdir(root) if n.startswith(f".tmp-step-{step:08d}-"))


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """An uninterrupted --async-save run in which rank 1's write of step 8 is held by the test.

    While it is held, the test looks at the checkpoint root from outside. Its losses are
    also the reference for the resume tests: holding a write must not change training.
    """
    d = tmp_path_factory.mktemp("async_held")
    root, log_file = d / "ckpt", d / "log.jsonl"

    def logged():
        return max(read_log(log_file)) if log_file.exists() and log_file.stat().st_size else 0

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(launch_faulty, d, "delay", ["--ckpt-dir", str(root), "--log-file", str(log_file)], timeout=240)
        # Training runs on to step 12, where save(12) must first commit step 8 and so blocks.
        seen = wait_for(lambda: (d / "held").exists() and logged() >= HOLD_STEP + 4, timeout=100)
        time.sleep(0.5)  # a commit that wrongly did not wait would have happened by now
        during = {"seen": seen, "logged": logged(), "committed": ckpt.committed_steps(str(root)),
                  "listing": listing(root)}
        (d / "release").touch()
        _, out = run.result()
    return d, read_log(log_file), during, out


def test_commit_waits_for_every_rank(held):
    """Step 8 is committed only after rank 1's held background write finished; until then step 4 is the newest."""
    d, log, during, out = held
    after = ckpt.committed_steps(str(d / "ckpt"))
    files = sorted(ckpt.read_manifest(str(d / "ckpt" / f"step-{HOLD_STEP:08d}"))["files"])
    print(f"\nwhile rank 1's write of step {HOLD_STEP} was held: training reached step {during['logged']}, "
          f"committed {during['committed']}, root holds {during['listing']}; after: committed {after}, "
          f"step {HOLD_STEP} holds {files}")
    assert during["seen"], f"the held write or training past step {HOLD_STEP + 3} was never observed:\n{out[-3000:]}"
    assert during["logged"] >= HOLD_STEP + 4, "training must go on while the checkpoint is written"
    assert during["committed"] == [4], "a checkpoint was committed (or the previous one removed) before rank 1 wrote"
    assert during["listing"] == [f".tmp-step-{HOLD_STEP:08d}", "step-00000004"]
    assert after == [8, 12, 16]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[STEPS]["loss"] < log[1]["loss"] - 0.5, "the loss must visibly fall for the comparisons to mean anything"


def assert_same_losses(ref, log, steps, what):
    dloss = max(abs(ref[s]["loss"] - log[s]["loss"]) for s in steps)
    print(f"\n{what}: max |dloss| = {dloss:.3e} over steps {steps[0]}-{steps[-1]}")
    for s in steps:
        assert log[s]["loss"] == ref[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {ref[s]['loss']!r}"
        assert log[s]["lr"] == ref[s]["lr"] and log[s]["samples"] == ref[s]["samples"], f"step {s}: LR or data differs"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Rank 1 is SIGKILLed in its background write of step 8; then a resume that stops at step 9.

    The stop comes one step after the asynchronous save of step 8, so the stop's
    synchronous save must first commit step 8, most likely still in flight."""
    d = tmp_path_factory.mktemp("async_killed")
    t0 = time.monotonic()
    rc, _ = launch_faulty(d, "kill", ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "crash.jsonl")],
                          check=False, timeout=150)
    crash = {"rc": rc, "elapsed": time.monotonic() - t0, "committed": ckpt.committed_steps(str(d / "ckpt")),
             "listing": listing(d / "ckpt"), "partial": sorted(os.listdir(tmp_dir(d / "ckpt", HOLD_STEP)))}
    _, out = torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume",
                                "--stop-after", "9"])
    return d, crash, out, ckpt.committed_steps(str(d / "ckpt"))


def test_rank_killed_during_background_write(held, killed):
    """Rank 1 dies (SIGKILL) while step 8 is being written: the resume uses step 4 and continues bit-exactly."""
    _, ref, _, _ = held
    d, crash, out, _ = killed
    print(f"\nkilled run: exit code {crash['rc']} after {crash['elapsed']:.1f} s; committed {crash['committed']}; "
          f"root holds {crash['listing']}; the interrupted save holds {crash['partial']}")
    assert crash["rc"] != 0
    assert crash["committed"] == [4] and crash["listing"] == [f".tmp-step-{HOLD_STEP:08d}", "step-00000004"]
    assert "__1_0.distcp" in crash["partial"], "rank 1 should have died after writing its shard"
    assert "resumed from step 4" in out
    assert "left by an interrupted save" in out and f".tmp-step-{HOLD_STEP:08d}" in out, "the stale temporary directory must be cleared"
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(5, 10))
    assert_same_losses(ref, log, list(range(5, 10)), "resumed at step 4 after the kill")


def test_async_resume_is_bit_exact(held, killed):
    """A run stopped right after an asynchronous save, then resumed, equals the uninterrupted run, bit for bit."""
    _, ref, _, _ = held
    d, _, _, committed = killed
    _, out = torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume"])
    print(f"\nafter the stop at step 9: committed {committed}")
    assert committed == [4, 8, 9], "the stop's save must commit the save of step 8 in flight, then its own"
    assert "resumed from step 9" in out
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(5, STEPS + 1))
    assert_same_losses(ref, log, list(range(5, STEPS + 1)), "killed at 8, resumed at 4, stopped at 9, resumed")
    assert ckpt.committed_steps(str(d / "ckpt")) == [9, 12, 16]


# Calls ckpt directly on a 2-rank FSDP2 model; rank 0 prints one RESULT line of JSON.
DIRECT = '''
import gc, json, os, sys, threading
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.staging import AsyncStager
import ckpt, train_fsdp

dist.init_process_group("gloo")
rank, world, cpu = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
args = train_fsdp.get_args({small!r} + ["--dropout", "0"])
root = sys.argv[1]

# The background write waits for `gate`, so it surely runs after the caller changed the parameters.
gate = {{"event": threading.Event(), "fail_rank": None}}
real_write = dcp.FileSystemWriter.write_data


def write_data(self, plan, planner):
    if not gate["event"].wait(60):
        raise TimeoutError("the test never opened the gate")
    if rank == gate["fail_rank"]:
        raise OSError(28, f"No space left on device (injected on rank {{rank}})")
    return real_write(self, plan, planner)


dcp.FileSystemWriter.write_data = write_data


def build(steps):
    model = train_fsdp.build_model(args, cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        x, y = train_fsdp.get_batch(args, None, i * args.batch_size, rank, world, cpu)
        F.cross_entropy(model(x).view(-1, args.vocab_size), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model, opt):
    """Full parameters and Adam moments (collective: every rank calls it)."""
    out = {{}}
    for name, p in model.named_parameters():
        out[name] = p.full_tensor().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{{name}}.{{k}}"] = opt.state[p][k].full_tensor().clone()
    return out


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def save_then_modify(step, model, opt, sub):
    gate["event"] = threading.Event()
    pending = ckpt.save(os.path.join(root, sub), step, model, opt, async_save=True)
    with torch.no_grad():  # what the next optimizer step does, right after save() returned
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["exp_avg"].add_(1.0)
            opt.state[p]["exp_avg_sq"].add_(1.0)
    gate["event"].set()
    return pending


result = {{}}
model, opt = build(3)
at_save = snapshot(model, opt)
save_then_modify(3, model, opt, "staged").wait()
modified = snapshot(model, opt)
fresh, fresh_opt = build(0)
ckpt.load(os.path.join(root, "staged"), fresh, fresh_opt)
loaded = snapshot(fresh, fresh_opt)
result["staged"] = {{"n": len(loaded), "vs_saved": max_diff(loaded, at_save), "vs_modified": max_diff(loaded, modified)}}

# Control: ckpt gets a stager that does not copy (what "offload to CPU" does with tensors already there).
class NoCopy(AsyncStager):
    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self):
        pass


real_stager = ckpt._stager
ckpt._stager = NoCopy
model, opt = build(3)
try:
    save_then_modify(3, model, opt, "unstaged").wait()
    refused = None
except ckpt.CheckpointError as e:
    refused = str(e)
gate["event"].set()
ckpt._stager = real_stager
result["unstaged"] = {{"refused": refused, "committed": ckpt.committed_steps(os.path.join(root, "unstaged"))}}

# A failed background write: rank 1's write raises, every rank must raise at wait().
gate["fail_rank"] = 1
pending = save_then_modify(4, model, opt, "staged")
err = None
try:
    pending.wait()
except ckpt.CheckpointError as e:
    err = str(e)
errors = [None] * world
dist.all_gather_object(errors, err)
result["failed"] = {{"errors": errors, "committed": ckpt.committed_steps(os.path.join(root, "staged")),
                    "listing": sorted(n.rsplit("-", 1)[0] if n.startswith(".tmp-step-") else n
                                      for n in os.listdir(os.path.join(root, "staged")) if n != ".owner.json")}}
if rank == 0:
    print("RESULT " + json.dumps(result), flush=True)
del model, opt, fresh, fresh_opt  # FSDP2 state holds the process group: free it before the teardown
ckpt.close()
gc.collect()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_direct")
    script = d / "direct.py"
    script.write_text(DIRECT.format(repo=REPO, small=SMALL))
    _, out = torchrun([str(d / "ckpt")], script=str(script), timeout=180)
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    assert line, out[-3000:]
    return json.loads(line[len("RESULT "):])


def test_staged_copy_is_isolated_from_training(direct):
    """Parameters and Adam moments changed right after save() returned do not reach the checkpoint.

    The background write is held until after the change, so a staged "copy" that shares
    memory with the live tensors would write the changed values: the control, a stager
    that does not copy (what "offload to CPU" does to tensors already there), is refused
    by save() before anything is written, naming the keys."""
    staged, unstaged = direct["staged"], direct["unstaged"]
    print(f"\nasync save, then +1 to every parameter and moment: loaded vs at save max |diff| = {staged['vs_saved']:.3e}, "
          f"loaded vs modified = {staged['vs_modified']:.3e} ({staged['n']} tensors)")
    print(f"control, a stager that does not copy: save() refused: {unstaged['refused']!r}; "
          f"committed {unstaged['committed']}")
    assert staged["n"] > 0 and staged["vs_saved"] == 0.0
    assert abs(staged["vs_modified"] - 1.0) < 1e-5  # +1 in fp32: 1 up to rounding
    assert unstaged["refused"] and "shares memory with the live state" in unstaged["refused"]
    assert "model." in unstaged["refused"] and unstaged["committed"] == []


def test_background_write_failure_raises_on_every_rank(direct):
    """An OSError in rank 1's background write is raised by wait() on both ranks; nothing is committed."""
    failed = direct["failed"]
    print(f"\nrank 1's write of step 4 raised OSError: wait() raised on ranks "
          f"{[r for r, e in enumerate(failed['errors']) if e]}; committed {failed['committed']}; "
          f"root holds {failed['listing']}; rank 0 said: {failed['errors'][0][:160]!r}...")
    for rank, err in enumerate(failed["errors"]):
        assert err, f"rank {rank}: wait() did not raise"
        assert "No space left on device (injected on rank 1)" in err and "Nothing was committed" in err, err
    assert failed["committed"] == [3]
    assert failed["listing"] == [".tmp-step-00000004", "step-00000003"]
