"""Resume continuity: an interrupted and resumed run equals an uninterrupted one, bit for bit.

Guards against the field's "loss spike on the first steps after resuming a sharded
checkpoint": optimizer state restored by position or not at all, the LR schedule
restarting, RNG or data position forgotten. Two negative controls prove that the
comparison sees exactly those failures.

    python -m pytest -v test_resume.py

Point it at your own training script to check your integration of ckpt.py:

    python test_resume.py --script path/to/train.py [--nproc 2] [--args="--model tiny"]
    CKPT_TEST_SCRIPT=path/to/train.py CKPT_TEST_NPROC=2 CKPT_TEST_ARGS="--model tiny" python -m pytest -v -s test_resume.py

The script must accept --steps N (the length of the whole run, whose last step it saves), --stop-after K
(save step K, exit 0), --resume (continue from the newest checkpoint in --ckpt-dir; start at step 0 if there
is none), --ckpt-dir D and --log-file F, and append to F one JSON object per step from rank 0 with "step" and
"loss" (and "lr", "samples" if it has them, which are compared too). It runs 16 steps uninterrupted, then
stopped after 6 and 11 and resumed twice; every logged value must be equal, bit for bit, and so must every
value of the two runs' final checkpoints (model, optimizer, extras, random generators): state that does not
move the loss (an EMA, say) is compared too. The negative controls patch train_fsdp.py and run only on it.
"""

import argparse
import os
import shlex
import shutil
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests.harness import REPO, SMALL, TRAIN, max_abs_diff, read_log, torchrun

NAIVE = os.path.join(REPO, "tests", "naive_resume.py")
SCRIPT = os.path.abspath(os.environ.get("CKPT_TEST_SCRIPT") or TRAIN)
OURS = SCRIPT == TRAIN
NPROC = int(os.environ.get("CKPT_TEST_NPROC", "2"))

STEPS = 16
# Another script gets only the contract's flags (and CKPT_TEST_ARGS), so its own defaults apply.
OWN = SMALL + ["--save-every", "4", "--dropout", "0.1", "--seed", "3"] if OURS else []
COMMON = OWN + ["--steps", str(STEPS)] + shlex.split(os.environ.get("CKPT_TEST_ARGS", ""))
COMPARED = ("loss", "lr", "samples")


def launch(args, **kw):
    return torchrun(args, nproc=NPROC, script=SCRIPT, timeout=600, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 16 steps."""
    d = tmp_path_factory.mktemp("reference")
    print(f"\nscript: {SCRIPT} on {NPROC} ranks, {' '.join(COMMON)}")
    launch(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    # The loss must visibly fall for the test to mean anything (a resume at the wrong step shows).
    assert log[STEPS]["loss"] < log[1]["loss"] - (0.5 if OURS else 0.0), \
        f"the uninterrupted run did not train (loss at step {STEPS} not below step 1's): {[log[s]['loss'] for s in sorted(log)]}"
    return log, d / "ckpt"


def final_state(root):
    """Every value of the newest checkpoint under root, tensors in full, read in this one process."""
    path = ckpt.find_checkpoint(str(root))
    metadata = ckpt.read_metadata(path)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
             for k, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process is the point
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ckpt.SafeReader(path, metadata), planner=ckpt.SafeLoadPlanner(), no_dist=True)
    return ckpt.read_manifest(path)["step"], state


def differences(a, b, key=""):
    """[(key, max |a - b| or None)] wherever a and b differ, bit for bit (tensors by their bytes)."""
    where = lambda k: f"{key}.{k}" if key else str(k)  # noqa: E731
    found = []
    if isinstance(a, dict) and isinstance(b, dict):
        found += [(where(k), None) for k in set(a) ^ set(b)]
        for k in set(a) & set(b):
            found += differences(a[k], b[k], where(k))
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found += differences(x, y, where(i))
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            found.append((key, None))
        elif not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            found.append((key, (a.double() - b.double()).abs().max().item() if a.is_floating_point() else None))
    elif type(a) is not type(b) or a != b:
        found.append((key, None))
    return found


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Stopped after step 6 (between saves at 4 and 8); its checkpoint is reused by the controls."""
    d = tmp_path_factory.mktemp("interrupted")
    launch(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--stop-after", "6"])
    return d


def test_resume_is_bit_exact(reference, interrupted, tmp_path):
    reference, reference_root = reference
    d = tmp_path
    shutil.copytree(interrupted, d, dirs_exist_ok=True)
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")]
    launch(args + ["--resume", "--stop-after", "11"])  # resumes at 6, stops mid-way between saves again
    launch(args + ["--resume"])                        # resumes at 11, runs to the end
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    keys = [k for k in COMPARED if k in reference[1]]
    figures = ", ".join(f"max |d{k}| = {max_abs_diff(reference, log, k):.3e}" for k in keys)
    print(f"\nresumed at 6 and 11: {figures} over {len(log)} steps (compared: {', '.join(keys)})")
    for s in range(1, STEPS + 1):
        for k in keys:
            hint = ("; the first step after a resume: is the data position restored, and does anything draw from "
                    "the global RNG between load() and that step (iter(DataLoader) does: give it a generator)?"
                    if s in (7, 12) else "")
            assert log[s][k] == reference[s][k], f"step {s}: {k} {log[s][k]!r} != {reference[s][k]!r}{hint}"
    (step, want), (got_step, got) = final_state(reference_root), final_state(d / "ckpt")
    diff = differences(want, got)
    worst = max((delta for _, delta in diff if delta is not None), default=0.0)
    print(f"final checkpoints of step {step}: {len(want)} keys, {len(diff)} differ, max |dstate| = {worst:.3e}")
    assert got_step == step == STEPS, f"the final checkpoints are of steps {step} and {got_step}, not {STEPS}"
    assert not diff, (f"the resumed run's final state differs from the uninterrupted run's at {sorted(diff)[0][0]} "
                      f"({len(diff)} values): is that state passed to ckpt.load (extra), and its random generator "
                      "seeded at start-up (random.seed, torch.manual_seed)?")


@pytest.mark.skipif(not OURS, reason="the controls patch train_fsdp.py (tests/naive_resume.py)")
@pytest.mark.parametrize("mode", ["dropped", "by_position"])
def test_naive_resume_is_caught(reference, interrupted, tmp_path, mode):
    """Negative control: the same comparison flags a resume that restores the optimizer wrongly
    (tests/naive_resume.py: state dropped, or matched by position)."""
    reference, _ = reference
    d = tmp_path
    shutil.copytree(interrupted, d, dirs_exist_ok=True)
    torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume"],
             script=NAIVE, env=dict(os.environ, NAIVE_MODE=mode))
    log = read_log(d / "log.jsonl")
    after = {s: log[s] for s in log if s > 6}
    dloss = max_abs_diff(reference, after)
    first_bad = min(s for s in after if after[s]["loss"] != reference[s]["loss"])
    print(f"\nnaive resume ({mode}): max |dloss| = {dloss:.3e}, first deviating step {first_bad}")
    assert dloss > 1e-3, f"a {mode} optimizer state should visibly change the losses (max |dloss| {dloss:.3e})"
    assert os.path.isdir(d / "ckpt")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default=TRAIN, help="training script that follows the contract described above")
    p.add_argument("--nproc", type=int, default=NPROC, help="ranks per run")
    p.add_argument("--args", default=os.environ.get("CKPT_TEST_ARGS", ""), help="more flags for the script, one string")
    a, rest = p.parse_known_args()
    os.environ.update(CKPT_TEST_SCRIPT=os.path.abspath(a.script), CKPT_TEST_NPROC=str(a.nproc), CKPT_TEST_ARGS=a.args)
    sys.exit(pytest.main([os.path.abspath(__file__), "-v", "-s", *rest]))
