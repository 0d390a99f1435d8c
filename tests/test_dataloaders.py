"""ckpt's data glue (Position, SkippingSampler) resumes a DistributedSampler and a StatefulDataLoader exactly, at any
world size.

Field failures guarded against: a resume mid-epoch that replays or skips samples (a DistributedSampler cannot skip,
and a skip computed per rank is wrong at another world size); torchdata's StatefulDataLoader passed as an extra,
which at another world size loaded silently at the wrong samples; a global batch changed by a resume on fewer ranks
with the same accumulation, unnoticed; a StatefulDataLoader restored beside the position skipping again what the
position skipped.

The code under test is ckpt's Position, SkippingSampler and ignore_sigterm, imported as the README's loop imports
them (`from ckpt import Position, SkippingSampler, ignore_sigterm`). The jobs (tests/loader_job.py) run ranks forked
from warm processes (tests/launch.py) and save with ckpt.

    python -m pytest -q -s tests/test_dataloaders.py
"""

import copy
import itertools
import shutil

import pytest
import torch

from tests import launch  # first: its warm rank processes import torch while this one does

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from ckpt import Position, SkippingSampler, ignore_sigterm  # noqa: E402  (the README's import)
from tests.harness import REPO, SMALL, TRAIN, read_log, result_line  # noqa: E402

JOB = f"{REPO}/tests/loader_job.py"
EPOCH, GLOBAL_BATCH = 24, 8  # the job's data set, and its 3 steps an epoch


def test_skipping_sampler_is_distributed_samplers_order():
    """From the start of an epoch, SkippingSampler yields exactly what DistributedSampler yields, on every rank of
    every world size, padded or cut alike: it changes where an epoch starts, nothing else."""
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


class StatelessSkippingSampler(torch.utils.data.DistributedSampler):
    """Control: SkippingSampler's order from `start`, but no state_dict() of its own (as a sampler written without
    the rule would be): a StatefulDataLoader then fast-forwards the batches it had yielded, on top of `start`."""
    start = 0
    __iter__, __len__ = SkippingSampler.__iter__, SkippingSampler.__len__


def stream(world, rank, steps, stop=None, sampler=SkippingSampler, load=("loader", "data")):
    """Rank `rank` of `world`: its batches of steps 1..steps, from a StatefulDataLoader (2 workers) read through
    Position.batches, in one process (the sampler is told its rank: no process group). With stop=k: the loop stops
    after step k; the loader's and the position's state_dict() (those named in `load`) go into a fresh loader and
    position, which go on to `steps`."""
    def fresh():
        s = sampler(range(EPOCH), num_replicas=world, rank=rank, shuffle=True, seed=3)
        loader = StatefulDataLoader(range(EPOCH), GLOBAL_BATCH // world, sampler=s, num_workers=2,
                                    worker_init_fn=ignore_sigterm, generator=torch.Generator())
        return {"loader": loader, "data": Position(GLOBAL_BATCH)}
    objects = fresh()
    data = objects["data"].batches(objects["loader"])
    batches = [next(data).tolist() for _ in range(stop or steps)]
    if stop is not None:
        saved = {name: copy.deepcopy(obj.state_dict()) for name, obj in objects.items()}  # as a save would, here
        data.close()  # the stopped run's workers end
        objects = fresh()
        for name in load:
            objects[name].load_state_dict(saved[name])
        data = objects["data"].batches(objects["loader"])
        batches += [next(data).tolist() for _ in range(steps - stop)]
    data.close()
    return batches


def test_start_wins_over_a_restored_stateful_dataloader():
    """Which of `sampler.start` and a restored StatefulDataLoader decides where a resumed epoch goes on: `start`.
    SkippingSampler's state_dict() is empty, so the restored loader restores its workers and skips nothing by itself
    (Position.batches sets `start` each epoch). Both restored, stopped mid-epoch or at an epoch's end, every rank
    of 2 reads on exactly as the uninterrupted run: no sample twice, none skipped. Shown on both sides: the
    restored loader without the position starts the data over (it skipped nothing); with a sampler of the same
    order that has no state of its own, the loader's fast-forward comes on top
    of `start`: a batch is skipped (the check above would see it; at other stops it runs past the epoch's end)."""
    steps, world = 8, 2
    want = [stream(world, rank, steps) for rank in range(world)]
    epochs = [sorted(sum((want[r][s] for r in range(world) for s in range(e, e + 3)), [])) for e in (0, 3)]
    assert epochs == [[*range(EPOCH)]] * 2, "each epoch must read every sample once"
    stops = (2, 3, 5)  # mid-epoch, at the epoch's end, mid-epoch (the job test stops after step 4)
    for stop, rank in itertools.product(stops, range(world)):
        got = stream(world, rank, steps, stop)
        assert got == want[rank], f"rank {rank}, stopped after step {stop}: {got} != uninterrupted {want[rank]}"
    print(f"\nloader and position restored, stopped after step {list(stops)} (3 steps an epoch), 2 ranks: steps "
          f"1-{steps} == uninterrupted on every rank")
    alone = stream(world, 0, steps, 2, load=("loader",))
    print(f"the loader restored without the position, stopped after step 2: rank 0 {alone[2:]}; the uninterrupted "
          f"steps 1-{steps - 2}: {want[0][:steps - 2]}")
    assert alone[2:] == want[0][:steps - 2], "the restored loader must skip nothing by itself"
    twice = [stream(world, rank, steps, 1, sampler=StatelessSkippingSampler) for rank in range(world)]
    skipped = sorted(want[0][1] + want[1][1])
    print(f"control, a sampler without state_dict(), stopped after step 1: rank 0 reads {twice[0][1:3]} at steps 2-3, "
          f"the uninterrupted run {want[0][1:3]}: step 2's global samples {skipped} skipped")
    assert all(twice[r][1:steps - 1] == want[r][2:] for r in range(world)), "the control must skip step 2's batch"


def run_ranks(root, world, *flags, steps=7, global_batch=GLOBAL_BATCH):
    """A job of tests/loader_job.py on `world` ranks: its RESULT, with {step: [rank 0's batch, ...]}."""
    _, out = launch.run([JOB, root, steps, *flags, "--global-batch", global_batch], nproc=world, timeout=120)
    result = result_line(out)
    result["batches"] = {int(s): ranks for s, ranks in result.get("batches", {}).items()}
    return result


def global_batches(result):
    """{step: the sorted samples of that step's global batch}: what a step trains on, whatever the split."""
    return {s: sorted(i for batch in ranks for i in batch) for s, ranks in result["batches"].items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 ranks: 7 steps uninterrupted (2 epochs of 3 steps, and one); and stopped after step 4, in the 2nd epoch."""
    d = tmp_path_factory.mktemp("loaders")
    reference = run_ranks(d / "reference", 2)
    stopped = run_ranks(d / "stopped", 2, "--stop-after", 4)
    batches = global_batches(reference)
    print(f"\nreference, 2 ranks: epoch 1 {[batches[s] for s in (1, 2, 3)]}, epoch 2 {[batches[s] for s in (4, 5, 6)]}")
    assert [sorted(sum((batches[s] for s in epoch), [])) for epoch in ((1, 2, 3), (4, 5, 6))] == [[*range(EPOCH)]] * 2
    assert [batches[s] for s in (1, 2, 3)] != [batches[s] for s in (4, 5, 6)], "each epoch must be shuffled anew"
    assert stopped["batches"] == {s: reference["batches"][s] for s in range(1, 5)}
    return d, reference


def resume(runs, name, world, *flags, source="stopped", **kw):
    """A resume, on a copy of a root (the run stopped after step 4's, unless told), on `world` ranks."""
    d, _ = runs
    shutil.copytree(d / source, d / name)
    return run_ranks(d / name, world, "--resume", *flags, **kw)


def test_stateful_dataloader_resumes_exactly_at_the_same_world_size(runs):
    """A StatefulDataLoader in the extras, resumed on as many ranks mid-epoch (after step 4, the 2nd epoch's 1st of 3
    steps), through ckpt.save and ckpt.load: every rank's batches after the resume are the uninterrupted run's,
    sample for sample, across the epoch's end (`start` wins: test_start_wins_over_a_restored_stateful_dataloader)."""
    _, reference = runs
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
    _, reference = runs
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
    _, reference = runs
    got = resume(runs, "forgot", 2, "--forget-position")
    differ = [s for s in (5, 6, 7) if got["batches"][s] != reference["batches"][s]]
    print(f"\ncontrol, the position not loaded: steps 5-7 {got['batches']}; differing from the uninterrupted run: "
          f"{differ}")
    assert got["resumed"] == 4 and differ == [5, 6, 7]


def test_changed_global_batch_is_refused_by_name(runs):
    """A resume on fewer ranks with the same per-rank batch and accumulation halves the global batch: the
    Position refuses it, naming both sizes, instead of training on with half the batch."""
    got = resume(runs, "halved", 1, global_batch=GLOBAL_BATCH // 2)
    print(f"\nglobal batch 8 saved, resumed with 4: {got.get('error')}")
    assert "global_batch 8 saved, 4 now" in got.get("error", ""), got


def test_train_fsdp_refuses_another_batch_size(tmp_path):
    """train_fsdp.py's ckpt.Position: a resume with another --batch-size is refused, naming it and both values."""
    args = [TRAIN, *SMALL, "--n-layers", "1", "--steps", "4", "--num-workers", "0", "--ckpt-dir", tmp_path / "ckpt"]
    launch.run([*args, "--stop-after", "2", "--log-file", tmp_path / "log.jsonl"], nproc=1, timeout=90)
    rc, out = launch.run([*args, "--resume", "--batch-size", "4"], nproc=1, timeout=90, check=False)
    refusal = next((ln for ln in out.splitlines() if "changes the data stream" in ln), None)
    print(f"\nsaved with --batch-size 8, resumed with 4: exit {rc}; {refusal}")
    assert rc != 0 and refusal and "train_fsdp.py: CheckpointError" in refusal and "global_batch 8 saved, 4 now" in refusal
    assert sorted(read_log(tmp_path / "log.jsonl")) == [1, 2], "the refused run must not train"
