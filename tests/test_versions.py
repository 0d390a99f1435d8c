"""A checkpoint saved under one torch release loads under another, bit for bit, in both directions.

Guards against a user who upgrades (or downgrades) torch mid-run and resumes from a checkpoint the other release
wrote: DCP's .metadata is a pickle of DCP's own classes, which a release may rename or change, and ckpt.py reads it
through an allow-list of those classes.

Needs other interpreters with other torch releases (each one's torchrun is launched as `PYTHON -m
torch.distributed.run`); skips at once, without starting a process, when there is none:

    bash tests/other_torch.sh 2.11.0 2.12.1 2.14.1 2.15.0    # builds .venvs/torch-*, all found here by themselves
    python -m pytest -q -s tests/test_versions.py
    CKPT_OTHER_PYTHONS=/a/bin/python:/b/bin/python python -m pytest -q -s tests/test_versions.py
    CKPT_VERSIONS_ALL_PAIRS=1 python -m pytest -q -s tests/test_versions.py   # every ordered pair, not via this one

The releases: this interpreter's and every other one's (CKPT_OTHER_PYTHONS, colon-separated, or CKPT_OTHER_PYTHON,
else every .venvs/torch-*/bin/python, and the base interpreter when this one runs in a venv). An interpreter that
cannot import torch, has this one's release, or one older than ckpt.OLDEST_TORCH, is skipped. The pairs: this
release with each other one, in both directions (2 tests a release: 5 two-rank jobs a release, 1 for this one; 4
other releases: 6 minutes on an idle 2-core machine, 23 on one kept busy by other jobs); with
CKPT_VERSIONS_ALL_PAIRS=1 every ordered pair of releases (n * (n - 1) tests). For each release: one uninterrupted
16-step run (train_fsdp.py, tests/harness.py SMALL, 2 ranks, a save at steps 8 and 16). For each pair, the saver's
step-8 checkpoint is
  1. loaded by the loader's release and saved again at once (tests/versions_job.py): every key (model, optimizer,
     extras, random generators) equal to the saver's, bit for bit. This alone does not depend on the releases
     computing alike. Where the loader is older than the saver, it may instead refuse the checkpoint by name: ckpt's
     "<...>/.metadata cannot be read safely: ..." naming the type it does not know (module.Class) or the release
     that wrote it; the test then stops there, passes, and says so. A refusal that names neither (a bare "too many
     values to unpack") fails, and so does any failure of a newer loader. Torch 2.15 pickles DCP's
     TensorProperties with a 6th field (strides), which 2.14 and older cannot unpickle: so they refuse its .metadata.
  2. resumed by the loader's release to step 16: every logged step, and the final checkpoint key by key, equal bit
     for bit to a reference run by the loader's release. Where the two releases' uninterrupted runs log the same
     steps 1-8 bit for bit (they compute alike), the reference is the loader's own uninterrupted run; else it is the
     loader resuming from its own re-save of 1. (the same state, written by its own release), and the test prints
     the largest loss difference between the releases' uninterrupted runs.
Checkpoints are compared (test_resume.py's final_state) in the interpreter of the newest release that wrote them, by
tests/versions_job.py --compare where that is not this one. The table of every pair is printed at the end (-s).
"""

import concurrent.futures
import glob
import json
import os
import pickletools
import re
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
REFUSED = re.compile(r"\S*\.metadata cannot be read safely: ([^;\n]*)")  # ckpt.read_metadata's, on one rank


def candidates():
    """Interpreters that may run another torch, found without starting a process: CKPT_OTHER_PYTHONS (or
    CKPT_OTHER_PYTHON) if set, else the venvs that tests/other_torch.sh made, and the base interpreter when this
    one runs in a venv."""
    given = os.environ.get("CKPT_OTHER_PYTHONS") or os.environ.get("CKPT_OTHER_PYTHON")
    if given:
        found = [p for p in given.split(":") if p]
    else:
        found = sorted(glob.glob(os.path.join(VENVS, "torch-*", "bin", "python")))
        if sys.prefix != sys.base_prefix:
            found.append(os.path.join(sys.base_prefix, "bin", "python3"))
    here = os.path.abspath(sys.executable)
    return list(dict.fromkeys(p for p in found if os.path.abspath(p) != here))  # a venv links to its base


def label(python):
    """A test id for python: its venv's directory name (.venvs/torch-2.14.1/bin/python: torch-2.14.1)."""
    parts = os.path.abspath(python).split(os.sep)
    return parts[-3] if len(parts) >= 3 and parts[-2] == "bin" else python


def pairs():
    """(saver, loader) interpreters, and a test id for each; one skipped test if there is no other interpreter."""
    others = candidates()
    if not others:
        return [pytest.param(None, None, id="none", marks=pytest.mark.skip(
            reason=f"no other interpreter next to torch {torch.__version__}: set CKPT_OTHER_PYTHONS, or run "
                   "`bash tests/other_torch.sh VERSION...`"))]
    if os.environ.get("CKPT_VERSIONS_ALL_PAIRS") == "1":
        every = [sys.executable] + others
        chosen = [(a, b) for a in every for b in every if a != b]
    else:
        chosen = [pair for other in others for pair in ((sys.executable, other), (other, sys.executable))]
    name = {p: "this" if p == sys.executable else label(p) for pair in chosen for p in pair}
    return [pytest.param(a, b, id=f"{name[a]}->{name[b]}") for a, b in chosen]


def release(version):
    """(2, 14, 1) from "2.14.1+cpu": comparable."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])


def torch_version(python):
    """The torch release python imports; None if it cannot (no such file, no torch). A python that takes over
    300 s to import torch (a loaded machine: a CUDA build loads over 1 GB of libraries) fails the test, not skips."""
    if not os.access(python, os.X_OK):
        return None
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{python} did not import torch within 300 s")
    except OSError:
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


@pytest.fixture(scope="module")
def versions():
    """{python: its torch release, or None}, for this interpreter and every candidate, two at a time."""
    others = candidates()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        found = dict(zip(others, pool.map(torch_version, others)))
    return {sys.executable: torch.__version__, **found}


@pytest.fixture(scope="module")
def table():
    """One row a pair, printed at the end of the module."""
    rows = []
    yield rows
    print(f"\n{'saver':>12} {'loader':>12}  result")
    for row in rows:
        print(f"{row[0]:>12} {row[1]:>12}  {row[2]}")


def launch(python, script, args, check=True):
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, *args]
    return run(cmd, timeout=600, check=check)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """uninterrupted(python, version): that release's uninterrupted run (log, root), run once, when first asked."""
    runs = {}

    def get(python, version):
        if python not in runs:
            d = tmp_path_factory.mktemp(f"uninterrupted-{version}")
            launch(python, TRAIN, ARGS + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl")])
            runs[python] = read_log(d / "log.jsonl"), d / "ckpt"
            assert sorted(runs[python][0]) == list(range(1, STEPS + 1)), \
                f"torch {version}: steps {sorted(runs[python][0])}"
        return runs[python]
    return get


def compare(a, b, writers):
    """(a's step, b's step, a's keys, b's keys, differing keys) of the newest checkpoints under a and b, read by the
    newest release of writers [(python, version)]: in this process if that is this release, else in that python."""
    python, version = max(writers, key=lambda w: release(w[1]))
    if release(version) <= release(torch.__version__):
        (step_a, want), (step_b, got) = final_state(a), final_state(b)
        return step_a, step_b, sorted(want), sorted(got), list(differing_keys(want, got))
    out = run([python, JOB, "--compare", str(a), str(b)], timeout=300)[1]
    found = json.loads(out.strip().splitlines()[-1])
    return (*found["steps"], *found["keys"], found["differ"])


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


@pytest.mark.parametrize("saver,loader", pairs())
def test_checkpoint_crosses_releases(versions, uninterrupted, table, tmp_path, saver, loader):
    saved_by, loaded_by = versions[saver], versions[loader]
    for python, version in ((saver, saved_by), (loader, loaded_by)):
        if version is None:
            pytest.skip(f"{python} cannot import torch")
        if python != sys.executable and version == torch.__version__:
            pytest.skip(f"{python} has this interpreter's torch {version}")
        if release(version) < getattr(ckpt, "OLDEST_TORCH", ()):
            pytest.skip(f"{python} has torch {version}: ckpt.py needs torch >= {ckpt.OLDEST_TORCH}")
    if saved_by == loaded_by:
        pytest.skip(f"both interpreters have torch {saved_by}")
    row = [saved_by, loaded_by, "FAILED (see the test's output)"]
    table.append(row)
    (saver_log, saver_root), (reference, reference_root) = (uninterrupted(saver, saved_by),
                                                            uninterrupted(loader, loaded_by))
    src = ckpt.step_dir(str(saver_root), SAVED)
    manifest = ckpt.read_manifest(src)
    print(f"\ntorch {saved_by} saved step {SAVED} (manifest: torch {manifest['torch_version']}, step "
          f"{manifest['step']}); its .metadata pickles {', '.join(pickled_classes(os.path.join(src, '.metadata')))}")
    assert (manifest["torch_version"], manifest["step"]) == (saved_by, SAVED)

    # 1. Loaded and saved again at once by the loader's release: the same state, bit for bit; or, by an older
    # release, refused by name.
    code, out = launch(loader, JOB, [src, str(tmp_path / "resaved"), *ARGS], check=False)
    refusal = REFUSED.search(out)
    if code != 0 and refusal and release(loaded_by) < release(saved_by):
        reason = refusal[1]
        print(f"torch {loaded_by} refused it (older than {saved_by}): {refusal[0]}")
        named = re.search(r"\b[A-Za-z_]\w*(\.[A-Za-z_]\w*)+\b", reason) or saved_by.split("+")[0] in reason
        row[2] = f"refused {'by name' if named else 'naming nothing: FAILED'}: {reason[:100]}"
        assert named, (f"torch {loaded_by} refused torch {saved_by}'s checkpoint without naming the type it does not "
                       f"know nor the release that wrote it: {reason!r}")
        return
    assert code == 0, f"torch {loaded_by} could not load torch {saved_by}'s checkpoint (exit {code}):\n{out[-6000:]}"
    writers = [(saver, saved_by), (loader, loaded_by)]
    step, got_step, want, got, diff = compare(src, tmp_path / "resaved", writers)
    print(f"torch {loaded_by} loaded it and saved it again: step {got_step}, {len(want)} keys, {len(diff)} differ "
          f"{diff[:5]}")
    loaded = f"loaded: {len(want)} keys, {len(diff)} differ"
    assert got_step == step == SAVED and want == got and not diff, diff

    # 2. Resumed by the loader's release: its steps and final checkpoint equal a reference run by the same release.
    alike = all(saver_log[s] == reference[s] for s in range(1, SAVED + 1))
    if not alike:  # the releases compute differently: the loader resuming from its own copy of the same state
        dloss = max(abs(saver_log[s]["loss"] - reference[s]["loss"]) for s in range(1, STEPS + 1))
        print(f"torch {saved_by} and {loaded_by} compute differently: uninterrupted runs' max |dloss| = "
              f"{dloss:.3e}; reference: torch {loaded_by} resuming from its own re-save")
        own = tmp_path / "own"
        launch(loader, TRAIN, ARGS + ["--ckpt-dir", str(own / "ckpt"), "--log-file", str(own / "log.jsonl"),
                                      "--resume", "--resume-from", str(tmp_path / "resaved")])
        reference, reference_root = read_log(own / "log.jsonl"), own / "ckpt"
    d = tmp_path / "resumed"
    launch(loader, TRAIN, ARGS + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume",
                                  "--resume-from", src])
    log = read_log(d / "log.jsonl")
    differ = [s for s in log if log[s] != reference[s]]
    dloss = max(abs(log[s]["loss"] - reference[s]["loss"]) for s in log)
    step, got_step, want, got, diff = compare(reference_root, d / "ckpt", [(loader, loaded_by)])
    what = "its own uninterrupted run" if alike else "its resume from its own re-save"
    print(f"torch {loaded_by} resumed it: steps {min(log)}-{max(log)}, max |dloss| = {dloss:.3e} against {what}, "
          f"steps differing {differ}; final checkpoints of step {got_step}: {len(want)} keys, {len(diff)} differ "
          f"{diff[:5]}")
    row[2] = (f"{loaded}; resumed ({'alike' if alike else 'computes differently'}): {len(differ)} steps, "
              f"{len(diff)} keys differ")
    assert sorted(log) == list(range(SAVED + 1, STEPS + 1)) and not differ, \
        f"steps {differ} differ from torch {loaded_by}'s {what}"
    assert got_step == step == STEPS and want == got and not diff, diff
