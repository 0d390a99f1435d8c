"""Resume continuity: an interrupted and resumed run equals an uninterrupted one, bit for bit.

Guards against the field's "loss spike on the first steps after resuming a sharded
checkpoint": optimizer state restored by position or not at all, the LR schedule
restarting, RNG or data position forgotten. Two negative controls prove that the
comparison sees exactly those failures.

    python -m pytest -v test_resume.py
"""

import os
import shutil

import pytest

from tests.harness import REPO, SMALL, max_abs_diff, read_log, torchrun

NAIVE = os.path.join(REPO, "tests", "naive_resume.py")

STEPS = 16
COMMON = SMALL + ["--steps", str(STEPS), "--save-every", "4", "--dropout", "0.1", "--seed", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 16 steps, 2 ranks."""
    d = tmp_path_factory.mktemp("reference")
    torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[STEPS]["loss"] < log[1]["loss"] - 0.5, "the loss must visibly fall for the test to mean anything"
    return log


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Stopped after step 6 (between saves at 4 and 8); its checkpoint is reused by the controls."""
    d = tmp_path_factory.mktemp("interrupted")
    torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--stop-after", "6"])
    return d


def test_resume_is_bit_exact(reference, interrupted, tmp_path):
    d = tmp_path
    shutil.copytree(interrupted, d, dirs_exist_ok=True)
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")]
    torchrun(args + ["--resume", "--stop-after", "11"])  # resumes at 6, stops mid-way between saves again
    torchrun(args + ["--resume"])                        # resumes at 11, runs to the end
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    dloss, dlr = max_abs_diff(reference, log), max_abs_diff(reference, log, "lr")
    print(f"\nresumed at 6 and 11: max |dloss| = {dloss:.3e}, max |dlr| = {dlr:.3e} over {len(log)} steps")
    for s in range(1, STEPS + 1):
        assert log[s]["loss"] == reference[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {reference[s]['loss']!r}"
        assert log[s]["lr"] == reference[s]["lr"], f"step {s}: lr differs"
        assert log[s]["samples"] == reference[s]["samples"], f"step {s}: data position differs"


@pytest.mark.parametrize("mode", ["dropped", "by_position"])
def test_naive_resume_is_caught(reference, interrupted, tmp_path, mode):
    """Negative control: the same comparison flags a resume that restores the optimizer wrongly
    (tests/naive_resume.py: state dropped, or matched by position)."""
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
