"""Resume continuity: an interrupted and resumed run equals an uninterrupted one, bit for bit.

Guards against the field's "loss spike on the first steps after resuming a sharded checkpoint": optimizer state
restored by position or not at all, the LR schedule restarting, RNG or data position forgotten. Two negative
controls prove that the comparison sees exactly those failures.

    python -m pytest -v test_resume.py

Point it at your own training script to check your integration of ckpt.py:

    python test_resume.py --script path/to/train.py [--nproc 2] [--args="--model tiny"]   # from this repository
    CKPT_TEST_SCRIPT=path/to/train.py CKPT_TEST_NPROC=2 CKPT_TEST_ARGS="--model tiny" python -m pytest -s test_resume.py

The script must accept --steps N (the length of the whole run, whose last step it saves), --stop-after K (save step
K, exit 0), --resume (continue from the newest checkpoint in --ckpt-dir; start at step 0 if there is none),
--ckpt-dir D and --log-file F, and append to F one JSON object per step from rank 0 with "step" and "loss". It runs
16 steps uninterrupted, then steps 1-6, 7-11 and 12-16 in three launches. The uninterrupted loss must fall (step 16
below step 1), or a resume at the wrong step could pass: give a script that cannot learn in 16 steps a fast setting
in --args. Every key of every line is compared, bit for bit, and a key one run logs at a step and the other does not
is a difference too: log only what a resumed run must reproduce (no wall-clock times), and a fingerprint of state
that does not move the loss (an EMA). Every key of the two runs' final checkpoints must be equal too (when only
generators differ, the failure names them). The negative controls run on train_fsdp.py only.
"""

import argparse
import os
import re
import shlex
import shutil
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests.harness import REPO, SMALL, TRAIN, logged_steps, max_abs_diff, read_log, torchrun

NAIVE = os.path.join(REPO, "tests", "naive_resume.py")
SCRIPT = os.path.abspath(os.environ.get("CKPT_TEST_SCRIPT") or TRAIN)
OURS = SCRIPT == TRAIN
NPROC = int(os.environ.get("CKPT_TEST_NPROC", "2"))

STEPS = 16
# Another script gets only the contract's flags (and CKPT_TEST_ARGS), so its own defaults apply.
OWN = SMALL + ["--save-every", "4", "--dropout", "0.1", "--seed", "3"] if OURS else []
COMMON = OWN + ["--steps", str(STEPS)] + shlex.split(os.environ.get("CKPT_TEST_ARGS", ""))
# An extra whose state differs between ranks is stored once per rank, under this prefix: its copies are one key.
PER_RANK = re.compile(r"^rank\.\d+\.")
GENERATOR = re.compile(r"extra\.rng\.(\w+)")  # the random generators ckpt saves
SEEDING = {"torch": "torch.manual_seed", "cuda": "torch.cuda.manual_seed_all", "python": "random.seed"}


def launch(args, **kw):
    return torchrun(args, nproc=NPROC, script=SCRIPT, timeout=600, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 16 steps."""
    d = tmp_path_factory.mktemp("reference")
    print(f"\nscript: {SCRIPT} on {NPROC} ranks, {' '.join(COMMON)}")
    launch(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1)), (f"the script logged steps {sorted(log)}: rank 0 must append one "
                                                      f"JSON line per step 1..{STEPS} to --log-file")
    # The loss must visibly fall for the test to mean anything (a resume at the wrong step shows).
    losses = [log[s]["loss"] for s in sorted(log)]
    assert losses[-1] < losses[0] - (0.5 if OURS else 0.0), (
        f"the uninterrupted run did not train (loss at step {STEPS} not below step 1's): {losses}. A resume at the "
        "wrong step would pass unseen: pass a setting that learns in 16 steps with --args (a tiny model, a higher lr)")
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


def differences(a, b):
    """[max |a - b|, or None if not a float tensor] for each value where a and b differ, bit for bit (tensor bytes)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [None] * len(set(a) ^ set(b)) + [d for k in set(a) & set(b) for d in differences(a[k], b[k])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for x, y in zip(a, b) for d in differences(x, y)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [None]
        if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return []
        return [(a.double() - b.double()).abs().max().item() if a.is_floating_point() else None]
    return [] if type(a) is type(b) and a == b else [None]


def differing_keys(want, got):
    """{checkpoint key: its differing values}, counted per key of DCP's state dict (a per-rank extra's copies as one):
    a generator's state, a tuple of hundreds of ints, is one key however many of them differ."""
    found = {}
    for key in sorted(set(want) | set(got)):
        deltas = differences(want[key], got[key]) if key in want and key in got else [None]
        found.setdefault(PER_RANK.sub("", key), []).extend(deltas)
    return {key: found[key] for key in sorted(found) if found[key]}


def advice(diff):
    """The assertion message: the generators by name when nothing else differs, else the first keys."""
    generators = [GENERATOR.fullmatch(key) for key in diff]
    if all(generators):
        names = sorted({match[1] for match in generators})
        seeding = ", ".join(SEEDING.get(name, f"{name}'s seed") for name in names)
        return (f"only random generators differ: {', '.join(names)} ({', '.join(diff)}). A generator the script does "
                f"not seed starts from a fresh state in every run: seed it at start-up ({seeding})")
    first = ", ".join(list(diff)[:3]) + (", ..." if len(diff) > 3 else "")
    return (f"the resumed run's final state differs from the uninterrupted run's in {len(diff)} of its keys ({first}): "
            "is that state passed to ckpt.load (extra), and its random generator seeded at start-up (random.seed, "
            "torch.manual_seed)?")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Stopped after step 6 (between saves at 4 and 8); its checkpoint is reused by the controls."""
    d = tmp_path_factory.mktemp("interrupted")
    launch(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--stop-after", "6"])
    assert logged_steps(d / "log.jsonl") == list(range(1, 7)), "--stop-after 6 must save step 6 and exit 0"
    return d


def test_resume_is_bit_exact(reference, interrupted, tmp_path):
    reference, reference_root = reference
    d = tmp_path
    shutil.copytree(interrupted, d, dirs_exist_ok=True)
    args = COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")]
    for stop in (11, STEPS):  # resumes at 6 and stops mid-way between saves again; resumes at 11, runs to the end
        launch(args + ["--resume"] + (["--stop-after", str(stop)] if stop < STEPS else []))
        steps = logged_steps(d / "log.jsonl")
        assert steps == list(range(1, stop + 1)), (f"the runs logged steps {steps}, not 1..{stop}: --resume must "
                                                   "continue after the newest checkpoint, --stop-after K stop at K")
    log = read_log(d / "log.jsonl")
    keys = sorted(set().union(*reference.values(), *log.values()) - {"step"})
    # Figures for the keys that are numbers at every step of both runs; the others (a bool, a list) are compared only.
    measured = [k for k in keys if all(type(r.get(k)) in (int, float) for r in [*reference.values(), *log.values()])]
    figures = ", ".join(f"max |d{k}| = {max_abs_diff(reference, log, k):.3e}" for k in measured)
    print(f"\nresumed at 6 and 11: {figures} over {len(log)} steps (compared: {', '.join(keys)})")
    for s in range(1, STEPS + 1):
        hint = ("; the first step after a resume: is every object it depends on in extra (an EMA, the data position)? "
                "Does anything draw from torch's RNG between load() and that step (a DataLoader without its own "
                "generator; a model built after load())? Do DataLoader workers draw from theirs (seed by sample)?"
                if s in (7, 12) else "")
        for k in keys:
            only = "the resumed run" if k in log[s] else "the uninterrupted run"
            assert (k in log[s]) == (k in reference[s]), f"step {s}: {k} is logged by {only} only{hint}"
            assert log[s].get(k) == reference[s].get(k), f"step {s}: {k} {log[s][k]!r} != {reference[s][k]!r}{hint}"
    (step, want), (got_step, got) = final_state(reference_root), final_state(d / "ckpt")
    diff = differing_keys(want, got)
    worst = max((delta for deltas in diff.values() for delta in deltas if delta is not None), default=0.0)
    shown = [key if len(deltas) == 1 else f"{key}: {len(deltas)} values" for key, deltas in diff.items()]
    named = f" ({', '.join(shown[:3])}{', ...' if len(shown) > 3 else ''})" if diff else ""
    verb = "differs" if len(diff) == 1 else "differ"
    saved = len({PER_RANK.sub("", key) for key in want})
    print(f"final checkpoints of step {step}: {saved} keys, {len(diff)} {verb}{named}, max |dstate| = {worst:.3e}")
    assert got_step == step == STEPS, (f"the final checkpoints are of steps {step} and {got_step}, not {STEPS}: "
                                       "the script must save its last step")
    assert not diff, advice(diff)


@pytest.mark.skipif(not OURS, reason="the controls patch train_fsdp.py (tests/naive_resume.py)")
@pytest.mark.parametrize("mode", ["dropped", "by_position"])
def test_naive_resume_is_caught(reference, interrupted, tmp_path, mode):
    """Negative control: the same comparison flags a resume that restores the optimizer wrongly
    (tests/naive_resume.py: state dropped, or matched by position)."""
    reference, _ = reference
    d = tmp_path
    shutil.copytree(interrupted, d, dirs_exist_ok=True)
    torchrun(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume"],
             nproc=NPROC, script=NAIVE, env=dict(os.environ, NAIVE_MODE=mode))
    log = read_log(d / "log.jsonl")
    after = {s: log[s] for s in log if s > 6}
    dloss = max_abs_diff(reference, after)
    first_bad = min((s for s in after if after[s]["loss"] != reference[s]["loss"]), default=None)
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
