"""The README's data recipes resume a DistributedSampler and a StatefulDataLoader exactly, at any world size.

Field failures guarded against: a resume mid-epoch that replays or skips samples (a DistributedSampler cannot skip,
and a skip computed per rank is wrong at another world size); torchdata's StatefulDataLoader passed as an extra,
which at another world size loaded silently at the wrong samples; a global batch changed by a resume on fewer ranks
with the same accumulation, unnoticed.

The code under test is the README's own (Position, SkippingSampler, ignore_sigterm), cut out of its code blocks.
The jobs (tests/loader_job.py) run ranks forked from warm processes (tests/launch.py) and save with ckpt.

    python -m pytest -q -s tests/test_dataloaders.py
"""

import itertools
import json
import re
import shutil
import textwrap

import pytest
import torch

from tests import launch  # first: its warm rank processes import torch while this one does

from tests.harness import REPO, SMALL, TRAIN, read_log  # noqa: E402

JOB = f"{REPO}/tests/loader_job.py"
README = open(f"{REPO}/README.md").read()
EPOCH, GLOBAL_BATCH = 24, 8  # the job's data set, and its 3 steps an epoch


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """The README's Position, SkippingSampler and ignore_sigterm, as a module file (and loaded)."""
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", README, re.S)]
    code = [b for b in blocks if "class Position" in b or "def ignore_sigterm" in b]
    assert len(code) == 2 and "class SkippingSampler" in code[0] + code[1], "the README lost a data recipe"
    path = tmp_path_factory.mktemp("recipes") / "recipes.py"
    path.write_text("import math, os, signal, threading, torch\n" + "\n".join(code))
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return path, namespace


def test_skipping_sampler_is_distributed_samplers_order(recipes):
    """From the start of an epoch, SkippingSampler yields exactly what DistributedSampler yields, on every rank of
    every world size, padded or cut alike: the recipe changes where an epoch starts, nothing else."""
    SkippingSampler = recipes[1]["SkippingSampler"]
    cases = 0
    for n, world, shuffle, drop_last, epoch in itertools.product((23, 24), (1, 2, 3, 4), (True, False), (True, False),
                                                                 (0, 1)):
        for rank in range(world):
            kw = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            want, got = torch.utils.data.DistributedSampler(range(n), **kw), SkippingSampler(range(n), **kw)
            want.set_epoch(epoch), got.set_epoch(epoch)
            assert list(got) == list(want) and len(got) == len(want), f"{n} samples, {kw}, epoch {epoch}"
            cases += 1
    print(f"\nSkippingSampler == DistributedSampler on {cases} (data set, world size, rank, shuffle, drop_last, "
          f"epoch) cases")


def run_ranks(recipes, root, world, *flags, steps=7, global_batch=GLOBAL_BATCH):
    """A job of tests/loader_job.py on `world` ranks: its RESULT, with {step: [rank 0's batch, ...]}."""
    _, out = launch.run([JOB, recipes, root, steps, *flags, "--global-batch", global_batch], nproc=world, timeout=120)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"no RESULT line:\n{out[-4000:]}"
    result = json.loads(line[len("RESULT "):])
    result["batches"] = {int(s): ranks for s, ranks in result.get("batches", {}).items()}
    return result


def global_batches(result):
    """{step: the sorted samples of that step's global batch}: what a step trains on, whatever the split."""
    return {s: sorted(i for batch in ranks for i in batch) for s, ranks in result["batches"].items()}


@pytest.fixture(scope="module")
def runs(recipes, tmp_path_factory):
    """2 ranks: 7 steps uninterrupted (2 epochs of 3 steps, and one); and stopped after step 4, in the 2nd epoch."""
    d = tmp_path_factory.mktemp("loaders")
    reference = run_ranks(recipes[0], d / "reference", 2)
    stopped = run_ranks(recipes[0], d / "stopped", 2, "--stop-after", 4)
    batches = global_batches(reference)
    print(f"\nreference, 2 ranks: epoch 1 {[batches[s] for s in (1, 2, 3)]}, epoch 2 {[batches[s] for s in (4, 5, 6)]}")
    assert [sorted(sum((batches[s] for s in epoch), [])) for epoch in ((1, 2, 3), (4, 5, 6))] == [[*range(EPOCH)]] * 2
    assert [batches[s] for s in (1, 2, 3)] != [batches[s] for s in (4, 5, 6)], "each epoch must be shuffled anew"
    assert stopped["batches"] == {s: reference["batches"][s] for s in range(1, 5)}
    return d, recipes[0], reference


def resume(runs, name, world, *flags, source="stopped", **kw):
    """A resume, on a copy of a root (the run stopped after step 4's, unless told), on `world` ranks."""
    d, recipes, _ = runs
    shutil.copytree(d / source, d / name)
    return run_ranks(recipes, d / name, world, "--resume", *flags, **kw)


def test_stateful_dataloader_resumes_exactly_at_the_same_world_size(runs):
    """A StatefulDataLoader in the extras, resumed on as many ranks: every rank's batches after the resume are the
    uninterrupted run's, sample for sample, across the epoch's end."""
    _, _, reference = runs
    got = resume(runs, "same", 2)
    want = {s: reference["batches"][s] for s in range(5, 8)}
    print(f"\nresumed at step {got['resumed']} on 2 ranks: steps 5-7 {got['batches']}; uninterrupted {want}")
    assert got["resumed"] == 4 and got["batches"] == want


def test_stateful_dataloader_at_another_world_size_is_refused_by_name(runs):
    """A StatefulDataLoader's state passed to a load at another world size: refused, naming it (in the field it
    loaded silently, and read other samples than the run it continued: its state is equal on every rank, so a rule
    that guesses per-rank state from differing values stores it once). A DataLoader is per rank by its type."""
    got = resume(runs, "refused", 1, "--keep-loader")
    print(f"\nloader state saved on 2 ranks, loaded on 1: {got.get('error') or got['batches']}")
    assert "extra 'loader' is per rank" in got.get("error", ""), got
    assert "saved at world size 2, not 1" in got["error"]


@pytest.mark.parametrize("world", [1, 4])
def test_another_world_size_restarts_from_the_position(runs, world):
    """At another world size, the README's recipe leaves the loader out of the load and restarts it from the
    position: every later step trains on the uninterrupted run's global batch. Then, stopped again after step 5
    and resumed on as many ranks, the rebuilt loader's own state comes back, and the same holds."""
    _, _, reference = runs
    want = global_batches(reference)
    got = resume(runs, f"on{world}", world, "--stop-after", 5)
    again = resume(runs, f"on{world}-again", world, source=f"on{world}")
    print(f"\nresumed at step 4 on {world} rank(s): step 5 {global_batches(got)[5]}; stopped, resumed at step "
          f"{again['resumed']}: steps 6-7 {[global_batches(again)[s] for s in (6, 7)]}; uninterrupted "
          f"{[want[s] for s in (5, 6, 7)]}")
    assert got["resumed"] == 4 and global_batches(got) == {5: want[5]}
    assert again["resumed"] == 5 and global_batches(again) == {6: want[6], 7: want[7]}
    assert all(len(batch) == GLOBAL_BATCH // world for ranks in again["batches"].values() for batch in ranks)


def test_control_a_resume_that_forgets_the_position_is_caught(runs):
    """Control: the comparison above sees a resume at the wrong samples. A load without the position (the loader's
    state alone, on 2 ranks) starts the data over: its steps 5-7 must differ from the uninterrupted run's."""
    _, _, reference = runs
    got = resume(runs, "forgot", 2, "--forget-position")
    differ = [s for s in (5, 6, 7) if got["batches"][s] != reference["batches"][s]]
    print(f"\ncontrol, the position not loaded: steps 5-7 {got['batches']}; differing from the uninterrupted run: "
          f"{differ}")
    assert got["resumed"] == 4 and differ == [5, 6, 7]


def test_changed_global_batch_is_refused_by_name(runs):
    """A resume on fewer ranks with the same per-rank batch and accumulation halves the global batch: the
    README's Position refuses it, naming both sizes, instead of training on with half the batch."""
    got = resume(runs, "halved", 1, global_batch=GLOBAL_BATCH // 2)
    print(f"\nglobal batch 8 saved, resumed with 4: {got.get('error')}")
    assert "global batch 8 saved" in got.get("error", ""), got


def test_train_fsdp_refuses_another_batch_size(tmp_path):
    """train_fsdp.py's TrainState: a resume with another --batch-size is refused, naming the flag and both values."""
    args = [TRAIN, *SMALL, "--n-layers", "1", "--steps", "4", "--num-workers", "0", "--ckpt-dir", tmp_path / "ckpt"]
    launch.run([*args, "--stop-after", "2", "--log-file", tmp_path / "log.jsonl"], nproc=1, timeout=90)
    rc, out = launch.run([*args, "--resume", "--batch-size", "4"], nproc=1, timeout=90, check=False)
    refusal = next((ln for ln in out.splitlines() if "changes the data stream" in ln), None)
    print(f"\nsaved with --batch-size 8, resumed with 4: exit {rc}; {refusal}")
    assert rc != 0 and refusal and "--batch-size 8 -> 4" in refusal
    assert sorted(read_log(tmp_path / "log.jsonl")) == [1, 2], "the refused run must not train"
