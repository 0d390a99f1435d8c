"""A checkpoint saved under one torch release loads under another, bit for bit, in both directions.

Guards against a user who upgrades (or downgrades) torch mid-run and resumes from a checkpoint the other release
wrote: DCP's .metadata is a pickle of DCP's own classes, which a release may rename or change, and ckpt.py reads it
through an allow-list of those classes.

Needs a second interpreter with another torch release (its own torchrun is launched as `PYTHON -m
torch.distributed.run`); skips at once, without starting a process, when there is none:

    bash tests/other_torch.sh                       # builds .venvs/torch-2.14.1, found here by itself
    python -m pytest -q -s tests/test_versions.py
    CKPT_OTHER_PYTHON=/path/to/venv/bin/python python -m pytest -q -s tests/test_versions.py

Run from inside such a venv, the base interpreter the venv was made from is the other one. For each release: one
uninterrupted 16-step run (train_fsdp.py, tests/harness.py SMALL, 2 ranks, a save at steps 8 and 16). For each
direction, the saver's step-8 checkpoint is
  1. loaded by the other release and saved again at once (tests/versions_job.py): every key (model, optimizer,
     extras, random generators) equal to the saver's, bit for bit. This alone does not depend on the releases
     computing alike.
  2. resumed by the other release to step 16: every logged step equal, bit for bit, to the other release's own
     uninterrupted run, and its final checkpoint equal key by key. This holds only if the two releases compute
     the same losses on the same state (2.13.0 and 2.14.1 do, on CPU); if 1 passes and 2 does not, the
     checkpoint crossed intact and the releases' arithmetic differs.
"""

import glob
import os
import pickletools
import subprocess
import sys

import pytest
import torch

import ckpt
from test_resume import differing_keys, final_state
from tests.harness import REPO, SMALL, TRAIN, read_log, run

JOB = os.path.join(REPO, "tests", "versions_job.py")
STEPS, SAVED = 16, 8
ARGS = SMALL + ["--steps", str(STEPS), "--save-every", str(SAVED), "--dropout", "0.1", "--seed", "3"]
VENVS = os.path.join(REPO, ".venvs")  # tests/other_torch.sh builds venvs here


def candidates():
    """Interpreters that may run another torch: CKPT_OTHER_PYTHON alone if set, else the venvs that
    tests/other_torch.sh made, and the base interpreter when this one runs in a venv."""
    if os.environ.get("CKPT_OTHER_PYTHON"):
        return [os.environ["CKPT_OTHER_PYTHON"]]
    found = sorted(glob.glob(os.path.join(VENVS, "torch-*", "bin", "python")))
    if sys.prefix != sys.base_prefix:
        found.append(os.path.join(sys.base_prefix, "bin", "python3"))
    return [p for p in found if os.path.abspath(p) != os.path.abspath(sys.executable)]  # a venv links to its base


def torch_version(python):
    """The torch release python imports, or None if it cannot."""
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


@pytest.fixture(scope="module")
def releases():
    """{"this": (python, torch release), "other": (python, torch release)}; skips if no other release is found."""
    tried = []
    for python in candidates():
        version = torch_version(python) if os.access(python, os.X_OK) else None
        if version and version != torch.__version__:
            return {"this": (sys.executable, torch.__version__), "other": (python, version)}
        tried.append(f"{python}: {version or 'no torch'}")
    pytest.skip(f"no second torch release next to {torch.__version__} ({'; '.join(tried) or 'none found'}): "
                "set CKPT_OTHER_PYTHON to another interpreter, or run `bash tests/other_torch.sh`")


def launch(python, script, args):
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, *args]
    return run(cmd, timeout=600)[1]


@pytest.fixture(scope="module")
def uninterrupted(releases, tmp_path_factory):
    """Each release's uninterrupted run: {name: (log, root)}."""
    out = {}
    for name, (python, version) in releases.items():
        d = tmp_path_factory.mktemp(f"uninterrupted-{name}")
        launch(python, TRAIN, ARGS + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
        out[name] = read_log(d / "log.jsonl"), d / "ckpt"
        assert sorted(out[name][0]) == list(range(1, STEPS + 1)), f"torch {version}: steps {sorted(out[name][0])}"
    return out


def pickled_classes(path):
    """module.name of every class or function a pickle names (GLOBAL and STACK_GLOBAL), read with pickletools:
    nothing in it is run."""
    found, pushed, memo = set(), [], {}
    with open(path, "rb") as f:
        data = f.read()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        else:
            if op.name in ("GLOBAL", "STACK_GLOBAL"):
                found.add(arg.replace(" ", ".") if op.name == "GLOBAL" else f"{pushed[-2]}.{pushed[-1]}")
            pushed.append(None)
    return sorted(found)


@pytest.mark.parametrize("saver,loader", [("this", "other"), ("other", "this")])
def test_checkpoint_crosses_releases(releases, uninterrupted, tmp_path, saver, loader):
    (_, saved_by), (python, loaded_by) = releases[saver], releases[loader]
    src = ckpt.step_dir(str(uninterrupted[saver][1]), SAVED)
    manifest = ckpt.read_manifest(src)
    print(f"\ntorch {saved_by} saved step {SAVED} (manifest: torch {manifest['torch_version']}, step "
          f"{manifest['step']}); its .metadata pickles {', '.join(pickled_classes(os.path.join(src, '.metadata')))}")
    assert (manifest["torch_version"], manifest["step"]) == (saved_by, SAVED)

    # 1. Loaded and saved again at once by the other release: the same state, bit for bit.
    launch(python, JOB, [src, str(tmp_path / "resaved"), *ARGS])
    (step, want), (got_step, got) = final_state(src), final_state(tmp_path / "resaved")
    diff = differing_keys(want, got)
    print(f"torch {loaded_by} loaded it and saved it again: step {got_step}, {len(want)} keys, {len(diff)} differ "
          f"{list(diff)[:5]}")
    assert got_step == step == SAVED and sorted(want) == sorted(got) and not diff, diff

    # 2. Resumed by the other release: its steps and final checkpoint equal its own uninterrupted run's.
    reference, reference_root = uninterrupted[loader]
    d = tmp_path / "resumed"
    launch(python, TRAIN, ARGS + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume",
                                  "--resume-from", src])
    log = read_log(d / "log.jsonl")
    differ = [s for s in log if log[s] != reference[s]]
    dloss = max(abs(log[s]["loss"] - reference[s]["loss"]) for s in log)
    (step, want), (got_step, got) = final_state(reference_root), final_state(d / "ckpt")
    diff = differing_keys(want, got)
    print(f"torch {loaded_by} resumed it: steps {min(log)}-{max(log)}, max |dloss| = {dloss:.3e} against its own "
          f"uninterrupted run, steps differing {differ}; final checkpoints of step {got_step}: {len(want)} keys, "
          f"{len(diff)} differ {list(diff)[:5]}")
    assert sorted(log) == list(range(SAVED + 1, STEPS + 1)) and not differ, \
        f"steps {differ} differ from torch {loaded_by}'s uninterrupted run (check 1 passed: see the docstring)"
    assert got_step == step == STEPS and not diff, diff
