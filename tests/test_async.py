"""Asynchronous saves: training goes on while the checkpoint is written, and nothing unsafe is committed.

Guards against the field's async-checkpoint failures:
  * the "latest" checkpoint advanced (and the previous one deleted by retention) before every rank's background
    write was durable, so a crash left nothing loadable (KempnerInstitute/KempnerForge #102);
  * a host "copy" that shares memory with the live parameters (on CPU, moving a tensor "to the CPU" returns
    the same tensor): the optimizer step that follows the save lands in the checkpoint, a torn mix of N and N+1;
  * a resume from an asynchronously written checkpoint that is not continuous;
  * a rank killed in the middle of a background write;
  * a background write that fails on one rank (disk full) and is reported on that rank only, or never, while
    the others carry on or hang.

Faults are injected from outside the shipped files: tests/inject.py patches dcp.FileSystemWriter.write_data
(which runs in the background thread) for one rank and one step, then runs train_fsdp.py unchanged; the host-copy
and write-failure tests call ckpt directly from a small 2-rank script (DIRECT below). Ranks are forked from warm
processes (tests/launch.py), not started by torchrun: the same ranks and environment, without the start-up cost.

    python -m pytest -q -s tests/test_async.py
"""

import concurrent.futures
import os
import signal
import time

import pytest

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
from tests.harness import REPO, SMALL, TRAIN, read_log, result_line  # noqa: E402

INJECT = os.path.join(REPO, "tests", "inject.py")
STEPS = 8
MODEL = SMALL + ["--n-layers", "1"]  # argparse keeps the last --n-layers: DCP's cost grows with the tensors
COMMON = MODEL + ["--steps", str(STEPS), "--save-every", "2", "--keep", "3", "--dropout", "0.1", "--seed", "3",
                  "--async-save", "--timeout", "60", "--ckpt-timeout", "60"]
HOLD_STEP = 4  # the save whose background write the fault hits, on rank FAULT_RANK
FAULT_RANK = 1


def launch_faulty(d, fault, args, timeout=60):
    """train_fsdp.py under tests/inject.py: rank 1's write of step 4 is held (hold_write: until d/release
    exists) or completed and then SIGKILLed (kill_after_write). Returns (exit codes, output, seconds)."""
    env = dict(os.environ, FAULT=fault, FAULT_RANK=str(FAULT_RANK), FAULT_STEP=str(HOLD_STEP), FAULT_DIR=str(d))
    t0 = time.monotonic()
    job = launch.start([INJECT, *COMMON, *args], env=env, out=d / f"{fault}.txt")
    _, out = job.wait(timeout)
    assert (d / f"fired.{FAULT_RANK}").exists(), f"the fault never fired:\n{out[-3000:]}"
    return job.rcs, out, time.monotonic() - t0


def listing(root):
    """The root's entries, temporary names without their unique suffix, the run's claim (.owner.json) left out."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(n.rsplit("-", 1)[0] if n.startswith(".tmp-step-") else n for n in names if n != ckpt.OWNER)


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """An uninterrupted --async-save run in which rank 1's write of step 4 is held by the test.

    While it is held, the test looks at the checkpoint root from outside. Its losses are also the reference for
    the resume tests: holding a write must not change training.
    """
    d = tmp_path_factory.mktemp("async_held")
    root, log_file = d / "ckpt", d / "log.jsonl"

    def logged():
        return max(read_log(log_file)) if log_file.exists() and log_file.stat().st_size else 0

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(launch_faulty, d, "hold_write", ["--ckpt-dir", root, "--log-file", log_file])
        # Training runs on to step 6, where save(6) must first commit step 4 and so blocks.
        seen = wait_for(lambda: (d / "fired.1").exists() and logged() >= HOLD_STEP + 2, timeout=60)
        time.sleep(0.5)  # a commit that wrongly did not wait would have happened by now
        during = {"seen": seen, "logged": logged(), "committed": ckpt.committed_steps(str(root)),
                  "listing": listing(root)}
        (d / "release").touch()
        rcs, out, secs = run.result()
    print(f"\nheld run: exit codes {rcs} after {secs:.1f} s")
    assert rcs == [0, 0], out[-3000:]
    return d, read_log(log_file), during, out


def test_commit_waits_for_every_rank(held):
    """The field's "latest" that advanced (and retention that deleted the previous checkpoint) before every rank's
    background write was durable (KempnerForge #102): step 4 must be committed only after rank 1's held write
    finished; until then step 2 stays the newest, and training goes on meanwhile."""
    d, log, during, out = held
    after = ckpt.committed_steps(str(d / "ckpt"))
    files = sorted(ckpt.read_manifest(str(d / "ckpt" / f"step-{HOLD_STEP:08d}"))["files"])
    print(f"\nwhile rank 1's write of step {HOLD_STEP} was held: training reached step {during['logged']}, "
          f"committed {during['committed']}, root holds {during['listing']}; after: committed {after}, "
          f"step {HOLD_STEP} holds {files}")
    assert during["seen"], f"the held write or training past step {HOLD_STEP + 1} was never observed:\n{out[-3000:]}"
    assert during["logged"] >= HOLD_STEP + 2, "training must go on while the checkpoint is written"
    assert during["committed"] == [2], "a checkpoint was committed (or the previous one removed) before rank 1 wrote"
    assert during["listing"] == [f".tmp-step-{HOLD_STEP:08d}", "step-00000002"]
    assert after == [4, 6, 8]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[STEPS]["loss"] < log[1]["loss"] - 0.3, "the loss must visibly fall for the comparisons to mean anything"


def assert_same_losses(ref, log, steps, what):
    dloss = max(abs(ref[s]["loss"] - log[s]["loss"]) for s in steps)
    print(f"\n{what}: max |dloss| = {dloss:.3e} over steps {steps[0]}-{steps[-1]}")
    for s in steps:
        assert log[s]["loss"] == ref[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {ref[s]['loss']!r}"
        assert log[s]["lr"] == ref[s]["lr"] and log[s]["samples"] == ref[s]["samples"], f"step {s}: LR or data differs"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Rank 1 is SIGKILLed right after writing its shard of step 4 in the background; then a resume that stops at
    step 5. The stop comes one step after the asynchronous save of step 4, so the stop's synchronous save must
    first commit step 4, most likely still in flight."""
    d = tmp_path_factory.mktemp("async_killed")
    rcs, out, secs = launch_faulty(d, "kill_after_write", ["--ckpt-dir", d / "ckpt", "--log-file", d / "crash.jsonl"])
    crash = {"rcs": rcs, "elapsed": secs, "committed": ckpt.committed_steps(str(d / "ckpt")),
             "listing": listing(d / "ckpt"), "fired": (d / f"fired.{FAULT_RANK}").read_text()}
    _, out = launch.run([TRAIN, *COMMON, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl", "--resume",
                         "--stop-after", str(HOLD_STEP + 1)], timeout=60)
    return d, crash, out, ckpt.committed_steps(str(d / "ckpt"))


def test_rank_killed_during_background_write(held, killed):
    """A rank killed (OOM, node loss) in the middle of a background write, which the field's async savers
    commit anyway or leave as "latest": rank 1 dies (SIGKILL) right after writing its shard of step 4; nothing
    of step 4 may be committed (rank 0 removes the temporary directory as the commit fails), and the resume uses
    step 2 and continues bit-exactly."""
    _, ref, _, _ = held
    d, crash, out, _ = killed
    print(f"\nkilled run: exit codes {crash['rcs']} after {crash['elapsed']:.1f} s; committed {crash['committed']}; "
          f"root holds {crash['listing']}; rank 1 died {crash['fired']}")
    assert crash["rcs"][FAULT_RANK] == -signal.SIGKILL
    assert crash["rcs"][0] not in (0, -signal.SIGKILL), "rank 0 must fail by itself, not hang"
    assert crash["committed"] == [2] and crash["listing"] == ["step-00000002"]
    assert "__1_0.distcp" in crash["fired"], "rank 1 should have died after writing its shard"
    assert "resumed from step 2" in out
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(3, HOLD_STEP + 2))
    assert_same_losses(ref, log, list(range(3, HOLD_STEP + 2)), "resumed at step 2 after the kill")


def test_async_resume_is_bit_exact(held, killed):
    """A resume from an asynchronously written checkpoint that is not continuous (state captured at another
    moment than the step it is labelled with): a run stopped right after an asynchronous save, then resumed,
    equals the uninterrupted run, bit for bit."""
    _, ref, _, _ = held
    d, _, _, committed = killed
    _, out = launch.run([TRAIN, *COMMON, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl", "--resume"],
                        timeout=60)
    print(f"\nafter the stop at step {HOLD_STEP + 1}: committed {committed}")
    assert committed == [2, HOLD_STEP, HOLD_STEP + 1], "the stop's save must commit step 4 in flight, then its own"
    assert f"resumed from step {HOLD_STEP + 1}" in out
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(3, STEPS + 1))
    assert_same_losses(ref, log, list(range(3, STEPS + 1)), "killed at 4, resumed at 2, stopped at 5, resumed")
    assert ckpt.committed_steps(str(d / "ckpt")) == [HOLD_STEP + 1, 6, 8]


# Calls ckpt directly on a 2-rank FSDP2 model; rank 0 prints one RESULT line of JSON.
DIRECT = '''
import gc, json, os, sys, threading
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.utils.data import default_collate
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
        first = i * args.batch_size + rank * args.batch_size // world  # this rank's share of global batch i
        x, y = default_collate([train_fsdp.Samples(args)[j] for j in range(first, first + args.batch_size // world)])
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
    pending.wait_copy()  # what the next optimizer step's pre-hook does before it writes in place
    with torch.no_grad():  # what the next optimizer step does, right after save() returned
        for p in model.parameters():
            p.add_(1.0)
            opt.state[p]["exp_avg"].add_(1.0)
            opt.state[p]["exp_avg_sq"].add_(1.0)
    gate["event"].set()
    return pending


def staged_roundtrip(sub):
    """Save at step 3, +1 to everything once the copy is done (wait_copy()), wait; load into a fresh model: the
    diffs."""
    model, opt = build(3)
    at_save = snapshot(model, opt)
    save_then_modify(3, model, opt, sub).wait()
    modified = snapshot(model, opt)
    fresh, fresh_opt = build(0)
    ckpt.load(os.path.join(root, sub), fresh, fresh_opt)
    loaded = snapshot(fresh, fresh_opt)
    return model, opt, {{"n": len(loaded), "vs_saved": max_diff(loaded, at_save),
                        "vs_modified": max_diff(loaded, modified)}}


result = {{}}
model, opt, result["staged"] = staged_roundtrip("staged")

# Control: ckpt's own host copy made to alias instead of copy (what "offloading to the CPU" does with tensors
# already there): its host dict holds the live tensors, which the writer then reads. The test must see the change
# made after save() in the checkpoint.
def aliasing_copy(self):
    self.host.update(self.sources)  # a DTensor's local shard, the live tensor itself
    self.queued.set()
    self.settle()


real_copy = ckpt.HostCopy.copy
ckpt.HostCopy.copy = aliasing_copy
_, _, result["aliased"] = staged_roundtrip("aliased")
ckpt.HostCopy.copy = real_copy

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
                                      for n in os.listdir(os.path.join(root, "staged")) if n != ckpt.OWNER)}}

# prepare_async(): the host buffers made beside the loop before the first async save, which copies into them.
gate["fail_rank"] = None
ckpt.close()  # drops the buffers the saves above made
model, opt = build(3)
ckpt.prepare_async(model, opt).wait()
made = dict(ckpt._cache["views"])
at_save = snapshot(model, opt)
pending = save_then_modify(3, model, opt, "prepared")
pending.wait()
fresh, fresh_opt = build(0)
ckpt.load(os.path.join(root, "prepared"), fresh, fresh_opt)
result["prepared"] = {{"made": len(made), "copied": len(pending.copy.host),
                      "reused": sum(pending.copy.host[k] is buf for k, buf in made.items()),
                      "vs_saved": max_diff(snapshot(fresh, fresh_opt), at_save)}}
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
    script.write_text(DIRECT.format(repo=REPO, small=MODEL))
    t0 = time.monotonic()
    _, out = launch.run([script, d / "ckpt"], timeout=90)
    print(f"\ndirect ckpt job: {time.monotonic() - t0:.1f} s")
    return result_line(out)


def test_staged_copy_is_isolated_from_training(direct):
    """A host "copy" that shares memory with the live tensors, so that the optimizer step after save() lands
    in the checkpoint (a torn mix of step N and N+1): parameters and Adam moments changed right after save()
    returned, once the copy is done (pending.wait_copy(), the wait an optimizer step's pre-hook does), must not
    reach the checkpoint.

    The background write is held until after the change (+1 to every parameter and moment), so a host "copy"
    that shared memory with the live tensors would write the changed values. The control shows the test would
    see that: with ckpt.HostCopy made to alias instead of copy (its host dict holding the live tensors), the
    loaded values are the changed ones."""
    staged, aliased = direct["staged"], direct["aliased"]
    print(f"\nasync save, then +1 to every parameter and moment: loaded vs at save max |diff| = "
          f"{staged['vs_saved']:.3e}, "
          f"loaded vs modified = {staged['vs_modified']:.3e} ({staged['n']} tensors)")
    print(f"control, a HostCopy that aliases: loaded vs at save = {aliased['vs_saved']:.3e}, "
          f"loaded vs modified = {aliased['vs_modified']:.3e}")
    assert staged["n"] > 0 and staged["vs_saved"] == 0.0
    assert abs(staged["vs_modified"] - 1.0) < 1e-5  # +1 in fp32: 1 up to rounding
    assert aliased["n"] == staged["n"] and aliased["vs_modified"] == 0.0
    assert abs(aliased["vs_saved"] - 1.0) < 1e-5, "an aliasing host copy must be caught: the checkpoint differs by 1"


def test_background_write_failure_raises_on_every_rank(direct):
    """A background write that fails on one rank (disk full) and is reported on that rank only, or never, while
    the others carry on or hang: the OSError in rank 1's write is raised by wait() on both ranks, naming rank 1
    and the cause; nothing is committed and the previous checkpoint stays."""
    failed = direct["failed"]
    print(f"\nrank 1's write of step 4 raised OSError: wait() raised on ranks "
          f"{[r for r, e in enumerate(failed['errors']) if e]}; committed {failed['committed']}; "
          f"root holds {failed['listing']}; rank 0 said: {failed['errors'][0][:300]!r}...")
    for rank, err in enumerate(failed["errors"]):
        assert err, f"rank {rank}: wait() did not raise"
        assert "writing failed on" in err and "rank 1: " in err, err
        assert "No space left on device (injected on rank 1)" in err, err
        assert "Nothing was committed; the previous checkpoint is intact" in err, err
    assert failed["committed"] == [3]
    assert failed["listing"] == ["step-00000003"], "the failed save's directory is removed (space on a full disk)"


def test_prepare_async_makes_the_first_saves_buffers(direct):
    """prepare_async() makes the host buffers beside the loop, so that the first async save allocates nothing on
    the loop's path (pinned memory: seconds per 5 GB): that save copies into exactly the buffers it made, and the
    checkpoint is still the state at save(), with +1 written to every parameter and moment right after."""
    prepared = direct["prepared"]
    print(f"\nprepare_async(): {prepared['made']} buffers made; the first save copied {prepared['copied']} tensors, "
          f"{prepared['reused']} into them; loaded vs at save max |diff| = {prepared['vs_saved']:.3e}")
    assert prepared["made"] > 0 and prepared["copied"] == prepared["made"] == prepared["reused"]
    assert prepared["vs_saved"] == 0.0
