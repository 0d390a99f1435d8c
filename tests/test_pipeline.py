"""Pipeline parallelism: each rank one stage of torch.distributed.pipelining, checkpointed with ckpt.py.

tests/pipeline_loop.py splits a small model the way torchtitan does (every rank builds the full model and
deletes what other stages own, so each stage keeps its parameters under their original names) and trains it
with a real schedule (1F1B, 2 microbatches), with an AdamW of two param groups per stage, a OneCycleLR and the
data position as extras, an EMA per stage and dropout. Each test guards against a field failure:

  * stages that write one key (optimizer state numbered by position, one param group entry per optimizer):
    a stage's state lost or mixed with another's, so the resumed pipeline diverges;
  * a pipeline with FSDP inside each stage that resumes at its own layout only, or not bit for bit;
  * a pipeline checkpoint that cannot move to another data-parallel degree inside the stages (FSDP2 stages
    resumed as plain ones and back: optimizer state that was a DTensor comes back a plain tensor, and back);
  * two stages' different state stored under one name, one copy silently kept: it must be refused.

How they launch: the 2-rank pipeline's (pp=2) stopped and resumed runs by torchrun itself, as users launch it;
its uninterrupted reference, the refused 2-rank save and the 4-rank layouts by tests/launch.py (torchrun's
environment, ranks forked from processes that imported torch once: seconds less per job on 2 cores). Each run is
a few steps of a tiny model; the reshard runs are chained (4 ranks -> 2 at step 4 -> 4 at step 8) against one
uninterrupted 4-rank run. About a minute in all on 2 cores.

    python -m pytest -q -s tests/test_pipeline.py
"""

import os
import re
import shutil

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch

import ckpt
from test_resume import differing_keys, final_state
from tests.harness import REPO, read_log, torchrun

launch.warm(4)  # the 4-rank layouts: two more warm processes, importing torch while the first runs go
SCRIPT = os.path.join(REPO, "tests", "pipeline_loop.py")
PP, N_LAYERS = 2, 4  # pipeline_loop.py's stages and layers
RTOL = 1e-4  # relative, on the losses across data-parallel degrees (the reductions sum in another order)
PARAM = re.compile(r"(tok_embeddings|layers\.(\d+)|norm|output)\.")  # leftmost: layers.0.norm is layer 0's


def run(d, nproc, steps=8, flags=(), resume=None, check=True, warm=True):
    """pipeline_loop.py on nproc ranks (pp=2 x dp=nproc/2) in d; resume=(root, step): that checkpoint, copied alone
    into a fresh root, is the newest there. warm=False: by torchrun itself, as users launch it (seconds more).
    Returns (log, output), or (exit code, log, output) with check=False."""
    d.mkdir(parents=True, exist_ok=True)
    args = ["--steps", steps, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl", "--pp", PP, *flags]
    if resume:
        root, step = resume
        shutil.copytree(root / f"step-{step:08d}", d / "ckpt" / f"step-{step:08d}")
        args.append("--resume")
    if warm:
        rc, out = launch.run([SCRIPT, *args], nproc, timeout=120, check=check)
    else:
        rc, out = torchrun([str(a) for a in args], nproc=nproc, script=SCRIPT, timeout=120, check=check)
    log = read_log(d / "log.jsonl") if (d / "log.jsonl").exists() else {}
    return (log, out) if check else (rc, log, out)


def stage_of(key):
    """The stage whose parameter (or EMA) a checkpoint key names; None: every rank's (stored once) or per rank."""
    found = PARAM.search(key + ".")
    if found:
        layer = found[2]
        return (int(layer) // (N_LAYERS // PP) if layer is not None
                else 0 if found[1] == "tok_embeddings" else PP - 1)
    ema = re.fullmatch(r"extra\.ema(\d+)", key)
    return int(ema[1]) if ema else None


def check_trains(log, steps):
    assert sorted(log) == list(range(1, steps + 1)), f"logged steps {sorted(log)}"
    assert log[steps]["loss"] < log[1]["loss"] - 0.5, f"the run did not train: {[log[s]['loss'] for s in log]}"
    apart = min(abs(log[s + 1]["loss"] - log[s]["loss"]) / log[s]["loss"] for s in range(1, steps))
    assert apart > 10 * RTOL, f"consecutive losses only {apart:.1e} apart: a resume at the wrong step could pass"


def check_exact(ref, resumed, ref_root, resumed_root):
    """Every logged value of every step bit for bit, and the final checkpoints key by key; the figures."""
    assert sorted(resumed) == sorted(ref), f"steps {sorted(resumed)} logged, not {sorted(ref)}"
    for s in ref:
        assert resumed[s] == ref[s], f"step {s}: {resumed[s]} != {ref[s]}"
    dloss = max(abs(resumed[s]["loss"] - ref[s]["loss"]) for s in ref)
    (step, want), (got_step, got) = final_state(ref_root), final_state(resumed_root)
    diff = differing_keys(want, got)
    assert got_step == step == max(ref), f"final checkpoints of steps {step} and {got_step}"
    assert not diff, f"the final checkpoints differ in {len(diff)} keys: {list(diff)[:5]}"
    keys = len({re.sub(r"^rank\.\d+\.", "", k) for k in want})
    return (f"max |dloss| {dloss:.3e} over {len(ref)} steps (loss, lr and data position equal); final checkpoints "
            f"of step {step}: {keys} keys, {len(diff)} differ"), want


# ------------------------------------------------------------------ pp=2, and pp=2 x dp=2 (FSDP in each stage)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    """2 ranks, pp=2: uninterrupted 8 steps (warm ranks); and stopped after 4, then resumed, launched by torchrun."""
    d = tmp_path_factory.mktemp("pp2")
    ref, _ = run(d / "ref", 2)
    run(d / "resumed", 2, flags=["--stop-after", "4"], warm=False)
    resumed, _ = run(d / "resumed", 2, flags=["--resume"], warm=False)
    return d, ref, resumed


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory):
    """4 ranks, pp=2 x dp=2, fully_shard in each stage: uninterrupted 8 steps; and stopped after 4, resumed."""
    d = tmp_path_factory.mktemp("pp2_dp2")
    ref, _ = run(d / "ref", 4)
    run(d / "resumed", 4, flags=["--stop-after", "4"])
    resumed, _ = run(d / "resumed", 4, flags=["--resume"])
    return d, ref, resumed


def test_stages_resume_bit_exact(pp2):
    """Two pipeline stages, no FSDP: guards against stages overwriting each other's state in the one checkpoint
    (optimizer state by position: both stages' parameter 0 is one key; one param-group entry per optimizer),
    which a resumed pipeline shows as a loss spike. Every logged loss and the final checkpoint bit for bit; each
    stage's keys are its own: one optimizer record per stage (optim.0.groups.<its first parameter>) holding two
    param groups, four in all, each holding its stage's names only."""
    d, ref, resumed = pp2
    check_trains(ref, 8)
    figures, state = check_exact(ref, resumed, d / "ref" / "ckpt", d / "resumed" / "ckpt")
    print(f"\npp=2, stopped at 4 and resumed: {figures}")
    by_stage = {}
    for key in state:
        by_stage.setdefault(stage_of(key), []).append(key)
    groups = {}
    for s in range(PP):
        keys = by_stage[s]
        records = [k for k in keys if k.startswith("optim.0.groups.")]
        assert len(records) == 1, f"stage {s} has {len(records)} optimizer records, not 1: {records}"
        groups[s] = state[records[0]]["state"]["param_groups"]
        model = [k for k in keys if k.startswith("model.")]
        optim = [k for k in keys if k.startswith("optim.0.state.")]
        ema = [k for k in keys if k.startswith(f"extra.ema{s}")]
        print(f"  stage {s}: {len(model)} model keys ({', '.join(k[6:] for k in model[:3])}, ...); {len(optim)} "
              f"optimizer tensors; {len(ema)} EMA keys; param groups:")
        for i, g in enumerate(groups[s]):
            names = g["params"]
            print(f"    {records[0]}, group {i}: {len(names)} parameters, weight_decay {g['weight_decay']}")
            assert {stage_of(n) for n in names} == {s}, f"group {i} holds another stage's parameters: {names}"
        assert len(groups[s]) == 2, f"stage {s} has {len(groups[s])} param groups, not 2 (decay, no decay)"
        assert sorted(n for g in groups[s] for n in g["params"]) == sorted(k[6:] for k in model)
    shared = sorted(k for k in by_stage[None] if not k.startswith("rank."))
    per_rank = sorted(k for k in by_stage[None] if k.startswith("rank."))
    print(f"  every rank (stored once): {', '.join(shared)}; per rank: {', '.join(per_rank)}")
    assert sum(map(len, groups.values())) == 4
    assert shared == ["extra.data", "extra.sched"]
    assert per_rank == [f"rank.{r}.extra.rng.{g}" for r in range(2) for g in ("python", "torch")]


def test_stages_with_fsdp_resume_bit_exact(pp2_dp2):
    """pp=2 x dp=2, fully_shard over each stage's dp group: guards against pipeline checkpoints that hold with
    plain stages only (each stage's DTensor shards, its param groups stored once by its two dp ranks, the EMA
    of sharded parameters). Every logged loss and the final checkpoint bit for bit."""
    d, ref, resumed = pp2_dp2
    check_trains(ref, 8)
    figures, state = check_exact(ref, resumed, d / "ref" / "ckpt", d / "resumed" / "ckpt")
    records = sorted(k for k in state if k.startswith("optim.0.groups."))
    groups = [g for k in records for g in state[k]["state"]["param_groups"]]
    print(f"\npp=2 x dp=2, stopped at 4 and resumed: {figures}; optimizer records: {', '.join(records)}")
    assert len(records) == 2 and len(groups) == 4, records


# ------------------------------------------------------------------ another data-parallel degree in the stages


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    """Without dropout (generators are not carried to another world size): an uninterrupted 12-step run on 4
    ranks; its step 4 resumed on 2 ranks (pp=2 x dp=1: plain stages, no fully_shard) to step 8; that step 8
    resumed on 4 ranks to 12: optimizer state moves between DTensors and plain tensors both ways."""
    d = tmp_path_factory.mktemp("reshard")
    flags = ["--dropout", "0"]
    ref, _ = run(d / "ref", 4, steps=12, flags=flags)
    hops = []
    for name, nproc, sub, first, source in (("4 -> 2 ranks at step 4", 2, "down", 5, ("ref", 4)),
                                             ("2 -> 4 ranks at step 8", 4, "up", 9, ("down", 8))):
        src = d / source[0] / "ckpt"
        stop = ["--stop-after", "8"] if sub == "down" else []
        rc, log, out = run(d / sub, nproc, steps=12, flags=[*flags, *stop], resume=(src, source[1]), check=False)
        assert rc == 0, f"{name}: exit {rc}\n{out[-4000:]}"
        hops.append((name, log, d / sub, first))
    return d, ref, hops


def leaves(value, path=""):
    """{path: leaf} of nested dicts, lists and tuples."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{path}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{path}.{i}").items()}
    return {path: value}


def compare_close(want, got):
    """(values compared, max |diff| / max |tensor| over the float tensors): every key but the per-rank ones (their
    number follows the world size), tensors within RTOL of their largest magnitude, anything else equal."""
    want, got = ({k: v for k, v in leaves(state).items() if not k.startswith(".rank.")} for state in (want, got))
    assert sorted(want) == sorted(got), f"keys differ: {sorted(set(want) ^ set(got))[:10]}"
    worst = 0.0
    for k, a in want.items():
        b = got[k]
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
            scale = a.double().abs().max().item() if a.numel() else 0.0
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            worst = max(worst, diff / scale if scale else diff)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k
        elif ".tensors." in k:  # the kind of a tensor where it was saved: a DTensor at dp=2, plain at dp=1
            assert {a, b} <= {"Tensor", "DTensor"}, (k, a, b)
        else:
            assert type(a) is type(b) and a == b, (k, a, b)
    assert worst <= RTOL, f"the final states differ by {worst:.1e} of a tensor's largest magnitude"
    return len(want), worst


@pytest.mark.parametrize("hop", range(2))
def test_stages_reshard_to_another_dp_degree(reshard, hop):
    """A pipeline checkpoint of pp=2 x dp=2 resumed at pp=2 x dp=1, and back: guards against checkpoints bound to
    the data-parallel degree they were saved at (stage shards that load only at their own layout, optimizer
    state or param groups lost on the way). The LR and the data position exact, the losses within RTOL
    relative of the uninterrupted 4-rank run (the gradients are summed in another order)."""
    d, ref, hops = reshard
    check_trains(ref, 12)
    name, resumed, d_resumed, first = hops[hop]
    steps = list(range(first, first + 4))
    assert sorted(resumed) == steps, f"{name}: logged steps {sorted(resumed)}, not {steps}"
    for s in steps:
        assert resumed[s]["lr"] == ref[s]["lr"] and resumed[s]["samples"] == ref[s]["samples"], (s, resumed[s], ref[s])
    drel = max(abs(resumed[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)
    dabs = max(abs(resumed[s]["loss"] - ref[s]["loss"]) for s in steps)
    step, want = final_state(d / "ref" / "ckpt" / f"step-{steps[-1]:08d}")
    got_step, got = final_state(d_resumed / "ckpt")
    assert step == got_step == steps[-1], (step, got_step)
    n, worst = compare_close(want, got)
    print(f"\n{name}: steps {steps[0]}-{steps[-1]}: max |dloss| {dabs:.3e} (relative {drel:.1e}), LR and data position "
          f"equal; checkpoints of step {step}: {n} values, tensors within {worst:.1e} of their largest magnitude")
    assert drel <= RTOL, f"{name}: max relative |dloss| {drel:.2e} > {RTOL}"


# ------------------------------------------------------------------ one key, different values: refused


@pytest.mark.parametrize("nproc, ranks", [(2, "0 | 1"), (4, "0 1 | 2 3")])
def test_stages_colliding_extra_refused(tmp_path, nproc, ranks):
    """Every stage passes its EMA under one name: guards against a checkpoint that keeps one stage's copy of a
    key and silently drops the other's (a resume would load stage 0's EMA skeleton into stage 1). save() must
    fail on every rank with a CheckpointError naming the key and the ranks on each side (the dp ranks of a stage
    agree), with advice for pipeline stages, and commit nothing. Both layouts on warm ranks."""
    rc, log, out = run(tmp_path, nproc, steps=2, flags=["--collide", "--save-every", "0"], check=False)
    errors = dict(re.findall(r"^(?:\[rank(\d+)\]: )?ckpt\.CheckpointError: (.*)$", out, re.MULTILINE))
    shown = f"rank 0: {errors['0']}" if "0" in errors else "no CheckpointError"
    print(f"\n--collide on {nproc} ranks: exit {rc}, CheckpointError on rank(s) {', '.join(sorted(errors))}; {shown}")
    assert rc != 0 and sorted(errors) == [str(r) for r in range(nproc)], out[-4000:]
    for error in errors.values():
        assert f"extra.ema (ranks {ranks})" in error, error
        assert "a pipeline stage's under a name of its own" in error, error
        assert "Nothing was written" in error, error
    left = sorted(os.listdir(tmp_path / "ckpt"))
    assert not ckpt.committed_steps(str(tmp_path / "ckpt")) and not [n for n in left if n.startswith(".tmp-")], left
    assert sorted(log) == [1, 2], f"the steps before the save ran: logged {sorted(log)}"
