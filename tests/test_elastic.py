"""Elastic resume: a checkpoint saved at world size 2 resumes at world sizes 1, 3 and 4.

Guards against the field's resharding failures: uneven shards (a dimension that the
world size does not divide) restored into the wrong rows (pytorch/pytorch #102821,
torchtitan #1136), optimizer moments that cannot follow their parameters to another
world size, and per-rank data position that cannot be resharded (torchtitan #811),
so a job that comes back on fewer or more GPUs trains on other samples than it would
have. The model below has dim 64, vocab 256 and ffn 176, none divisible by 3: world
size 3 shards every parameter unevenly.

What is compared, for every resume:
  * the full model and optimizer state (and scheduler and data position) gathered
    right before the save and right after the load: equal element for element;
  * the per-step losses after the resume with those of an uninterrupted world-2 run:
    equal to a relative 1e-4 (the sums in the all-reduce and reduce-scatter run in
    another order at another world size, so bit equality is not expected);
  * the LR and the data position (global samples consumed) of every step: exact.

  * the random generators: each rank's stream is its own, stored per rank, so at another world size
    none of them is handed to another rank, even though train_fsdp.py seeds them alike: the wrapper
    scrambles both generators right before the load (another seed on each rank), and after it each
    rank must hold exactly its scrambled state, with a "not restored from" warning naming them.

All runs use --dropout 0: dropout masks would still differ from the uninterrupted run (each rank
draws for its own share of the batch, which the world size changes), and the loss comparison
would measure that instead of the resume.

Speed (2 cores): ranks are forked from processes that imported torch once (tests/launch.py), not
once per rank and launch; the model has one layer (dims as before: the uneven shards stay).

    python -m pytest -q -s tests/test_elastic.py
"""

import os
import random
import re
import shutil

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch

from tests.harness import REPO, SMALL, TRAIN, read_log

STEPS, SAVE_AT = 8, 4
# Flags after SMALL override it (argparse keeps the last). Batch 12 splits evenly over 1, 2, 3
# and 4 ranks; dim 64, vocab 256 and ffn 176 are not multiples of 3.
COMMON = SMALL + ["--batch-size", "12", "--ffn-dim", "176", "--vocab-size", "256", "--dropout", "0",
                  "--steps", str(STEPS), "--seed", "5", "--keep", "3", "--n-layers", "1"]
RTOL = 1e-4

# Runs train_fsdp.py unchanged; ckpt.save and ckpt.load are wrapped from outside so that
# the full state is gathered right before each save and right after each load, and
# rank 0 writes it to $ELASTIC_DUMP/{saved,loaded}-step{N}-world{W}.pt, with every rank's
# generator states. Before the load, the generators are scrambled (another seed on each rank):
# after it they hold what was saved only if ckpt restored them. Gathering the whole model to
# one rank is fine for a test model, never for a real one.
WRAPPER = '''
import os, random, runpy, sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
import ckpt

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
real_save, real_load = ckpt.save, ckpt.load


def dump(kind, step, model, optimizer, extra):
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FULL)  # collective; rank 0 receives
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, {{"torch": torch.get_rng_state(), "python": random.getstate()}})
    if dist.get_rank() == 0:
        state = {{"model": model_sd, "optim": optim_sd, "rng": generators[0], "rng_ranks": generators,
                  "extra": {{k: v.state_dict() for k, v in (extra or {{}}).items()}}}}
        name = f"{{kind}}-step{{step}}-world{{dist.get_world_size()}}.pt"
        torch.save(state, os.path.join(os.environ["ELASTIC_DUMP"], name))


def save(root, step, model, optimizer, extra=None, **kw):
    dump("saved", step, model, optimizer, extra)
    return real_save(root, step, model, optimizer, extra, **kw)


def load(path, model, optimizer, extra=None, **kw):
    torch.manual_seed(1000 + dist.get_rank())  # scrambled: only a restore brings back what was saved
    random.seed(1000 + dist.get_rank())
    step = real_load(path, model, optimizer, extra, **kw)
    if step is not None:
        dump("loaded", step, model, optimizer, extra)
    return step


ckpt.save, ckpt.load = save, load
sys.argv = [{train!r}] + sys.argv[1:]
runpy.run_path({train!r}, run_name="__main__")
'''


def run_wrapper(d, args, nproc, timeout=180, check=True):
    """Run the wrapper at world size nproc (tests/launch.py, as torchrun --standalone); dumps land in d."""
    wrapper = d / "elastic_wrapper.py"
    if not wrapper.exists():
        wrapper.write_text(WRAPPER.format(repo=REPO, train=TRAIN))
    env = dict(os.environ, ELASTIC_DUMP=str(d))
    return launch.run([wrapper, *COMMON, *args], nproc, env=env, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at world size 2; its step-4 checkpoint is where every resume starts."""
    d = tmp_path_factory.mktemp("elastic_reference")
    run_wrapper(d, ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--save-every",
                       str(SAVE_AT)], 2)
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    # The tolerance must be able to see a resume that is off by one step (LR or data position):
    # consecutive losses differ by far more than RTOL.
    gap = min(abs(log[s + 1]["loss"] - log[s]["loss"]) / log[s]["loss"] for s in range(1, STEPS))
    print(f"\nreference: loss {log[1]['loss']:.4f} -> {log[STEPS]['loss']:.4f}, "
          f"smallest relative change between consecutive steps {gap:.2e} (tolerance {RTOL:.0e})")
    assert gap > 10 * RTOL
    return d, log


def compare_state(saved_path, loaded_path):
    """(tensors compared, other values compared, max |diff|); asserts element-for-element equality."""
    saved = torch.load(saved_path, weights_only=True)
    loaded = torch.load(loaded_path, weights_only=True)
    n_tensors, n_values, max_diff = 0, 0, 0.0
    for part in ("model", "optim", "extra"):
        a, b = flat(saved[part]), flat(loaded[part])
        assert sorted(a) == sorted(b), f"{part}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
        for k in a:
            if isinstance(a[k], torch.Tensor):
                assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{part}.{k}: dtype or shape differs"
                max_diff = max(max_diff, (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0)
                assert torch.equal(a[k], b[k]), f"{part}.{k} differs after the load"
                n_tensors += 1
            else:
                assert a[k] == b[k], f"{part}.{k}: {a[k]!r} saved, {b[k]!r} loaded"
                n_values += 1
    return saved, n_tensors, n_values, max_diff


def flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, (list, tuple)):
            out.update(flat(dict(enumerate(v)), f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("worlds", [(1,), (3, 2), (4,)], ids=lambda w: "2-" + "-".join(map(str, w)))
def test_elastic_resume(reference, tmp_path, worlds):
    """Saved at world size 2, resumed on 1, on 4, and on 3 ranks then back on 2 (stopping at step 6 on 3).

    Guards against a job restarted on another number of GPUs that loads without error but
    puts uneven shards or optimizer moments in the wrong place, reads other samples, or hands
    one rank's random stream to others."""
    ref_dir, ref = reference
    d = tmp_path
    (d / "ckpt").mkdir()
    shutil.copytree(ref_dir / "ckpt" / f"step-{SAVE_AT:08d}", d / "ckpt" / f"step-{SAVE_AT:08d}")
    args = ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--save-every", "0", "--resume"]
    stops = [SAVE_AT + 2 * (i + 1) for i in range(len(worlds) - 1)] + [STEPS]
    prev_world, start, saved_dir = 2, SAVE_AT, ref_dir
    for world, stop in zip(worlds, stops):
        _, out = run_wrapper(d, args + ["--stop-after", str(stop)], world)
        assert f"resumed from step {start}" in out and f"(step {start}, saved at world size {prev_world})" in out
        named = [line for line in out.splitlines() if "not restored from" in line]
        assert named and all(f"extra.rng.{g} (per rank" in named[0] for g in ("torch", "python")), out[-3000:]

        saved, n_tensors, n_values, max_diff = compare_state(
            saved_dir / f"saved-step{start}-world{prev_world}.pt", d / f"loaded-step{start}-world{world}.pt")
        loaded = torch.load(d / f"loaded-step{start}-world{world}.pt", weights_only=True)
        def alike(a, b):
            return torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]

        assert len(loaded["rng_ranks"]) == world
        for r, gen in enumerate(loaded["rng_ranks"]):  # left as the wrapper seeded them: nobody else's stream
            seeded = {"torch": torch.Generator().manual_seed(1000 + r).get_state(),
                      "python": random.Random(1000 + r).getstate()}
            assert alike(gen, seeded), f"rank {r}: its generators were replaced at another world size"
        uneven = sorted({v.shape[0] for v in saved["model"].values() if v.shape[0] % world})
        log = read_log(d / "log.jsonl")
        rel = max(abs(log[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in range(start + 1, stop + 1))
        print(f"\n{prev_world} -> {world} at step {start}: state equal ({n_tensors} tensors + {n_values} values, "
              f"max |diff| = {max_diff:.1e}); uneven dim-0 sizes {uneven}; "
              f"steps {start + 1}-{stop}: max relative |dloss| = {rel:.2e}; generators left as each of the {world} "
              f"ranks seeded them: {named[0].split(': ', 1)[1][:90]}")
        assert n_tensors > 0 and max_diff == 0.0
        assert float(saved["optim"][next(k for k in saved["optim"] if k.endswith(".step"))]) == start
        if world == 3:
            assert uneven, "world size 3 must shard some parameter unevenly for this test to mean anything"
        for s in range(start + 1, stop + 1):
            assert log[s]["samples"] == ref[s]["samples"], f"step {s}: data position differs"
            assert log[s]["lr"] == ref[s]["lr"], f"step {s}: LR differs"
        assert rel < RTOL, f"losses after resuming at world size {world} differ by {rel:.2e} relative"
        prev_world, start, saved_dir = world, stop, d
    assert sorted(read_log(d / "log.jsonl")) == list(range(SAVE_AT + 1, STEPS + 1))


def test_indivisible_world_fails_at_startup(reference, tmp_path):
    """A resume on a world size that does not divide the global batch stops before step 1, saying what to change.

    Guards against a job that is restarted on the wrong number of ranks and fails (or
    silently trains on a different batch) only after it has run and written checkpoints."""
    ref_dir, _ = reference
    d = tmp_path
    shutil.copytree(ref_dir / "ckpt", d / "ckpt")
    before = sorted(os.listdir(d / "ckpt"))
    rc, out = run_wrapper(d, ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume"], 5,
                     check=False, timeout=120)
    message = "--batch-size 12 is not divisible by the world size 5"
    steps = re.findall(r"^step\s+\d+ \|", out, re.M)
    print(f"\nworld size 5: exit code {rc}, {out.count(message)} rank(s) reported it, {len(steps)} step lines")
    assert rc != 0
    assert message in out and "run on a number of ranks that divides it (1, 2, 3, 4, 6, 12)" in out, out[-3000:]
    assert not steps and "resumed from" not in out
    assert not (d / "log.jsonl").exists()
    assert sorted(os.listdir(d / "ckpt")) == before
