"""What saves, loads, on the setups users bring: a loop we did not write for train_fsdp.py.

tests/user_loop.py is a nanoGPT-style script that uses only ckpt.check_root/load/save/close. Its model
always has tied embeddings, dropout, a trainable parameter that never gets a gradient and a branch used
every third step only (so its AdamW step lags); its `extra` holds a OneCycleLR (SequentialLR in the bf16
runs), a disabled GradScaler (state {}), and per-rank data streams (torch and numpy generators whose
state differs per rank). Each scenario runs it uninterrupted, then resumes it from one of its
checkpoints in another (or the same) layout, and checks:

  * state: the full model and optimizer state and every rank's extras, gathered right before the save
    and right after the load (user_loop.py --dump-state), are equal element for element;
  * losses against the uninterrupted run: bit-exact in the same layout; within RTOL relative across
    layouts (the reductions sum in another order);
  * the LR and each rank's data (token sums per rank) of every step, exactly;
  * the parameter that never had a gradient has no optimizer state after the load, the branch's
    parameters are still behind the others by the same number of steps, and the embeddings are tied.

Guards against what issue 11 found: a per-rank stream collapsed to one rank's copy (a silently wrong
resume), states a checkpoint saves but cannot load (OneCycleLR's list of dicts, an empty dict, numpy),
and correct loads refused after HSDP, tensor parallel, torch.compile or activation checkpointing.
Launches are shared through module-scoped fixtures; 4-rank launches only where a 2-D mesh needs them.

    python -m pytest -v -s tests/test_setups.py
"""

import os
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.harness import REPO, read_log, run, torchrun

USER_LOOP = os.path.join(REPO, "tests", "user_loop.py")
STEPS, EVERY = 8, 2
RTOL = 1e-4


class Run:
    def __init__(self, d, out=""):
        self.dir, self.root, self.log, self.out = d, d / "ckpt", read_log(d / "log.jsonl"), out

    def dump(self, kind, step):
        return torch.load(self.dir / f"{kind}-step{step}.pt", weights_only=False)  # our own files


def launch(d, nproc, flags=(), resume=None):
    """user_loop.py for STEPS steps, saving every EVERY; resume=(run, step): continue from that checkpoint."""
    d.mkdir(parents=True, exist_ok=True)
    args = ["--steps", str(STEPS), "--save-every", str(EVERY), "--ckpt-dir", str(d / "ckpt"),
            "--log-file", str(d / "log.jsonl"), "--dump-state", str(d), *flags]
    if resume:
        src, step = resume
        name = f"step-{step:08d}"  # only that checkpoint, so it is the newest in the new root
        shutil.copytree(src.root / name, d / "ckpt" / name)
        args.append("--resume")
    _, out = torchrun(args, nproc=nproc, script=USER_LOOP, timeout=300)
    return Run(d, out)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in flat(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def compare(a, b, what):
    """(values compared, max |diff| over tensors and arrays); asserts a == b element for element."""
    a, b = flat(a), flat(b)
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, (torch.Tensor, np.ndarray)):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            assert x.dtype == y.dtype and x.shape == y.shape, f"{what} {k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            if x.numel():
                worst = max(worst, (x.double() - y.double()).abs().max().item())
            assert torch.equal(x, y), f"{what} {k}: values differ"
        else:
            assert type(x) is type(y) and x == y, f"{what} {k}: {x!r} != {y!r}"
    return len(a), worst


def check_state(saver, resumed, step):
    """The state resumed holds after its load equals what saver held before saving step."""
    saved, loaded = saver.dump("saved", step), resumed.dump("loaded", step)
    n_model, d_model = compare(saved["model"], loaded["model"], "model")
    n_optim, d_optim = compare(saved["optim"], loaded["optim"], "optimizer")
    if saved["world"] == loaded["world"]:  # per-rank extras come back to their own rank
        n_extra, d_extra = compare(saved["extra"], loaded["extra"], "extras")
    else:  # only rank-independent extras may move to another world size
        for other in saved["extra"][1:]:
            compare(saved["extra"][0], other, "extras of rank 0 and another rank")
        n_extra, d_extra = compare([saved["extra"][0]] * loaded["world"], loaded["extra"], "extras")
    # What the uninterrupted run had: no state for the parameter that never got a gradient; the
    # branch used every third step behind the rest; the embeddings tied.
    for dump in (saved, loaded):
        opt = dump["optim"]
        assert not [k for k in opt if k.startswith("state.unused.")], "a parameter that never had a gradient got state"
        assert float(opt["state.wte.weight.step"]) == step
        assert float(opt.get("state.aux.weight.step", 0)) == step // 3, "the branch runs on every third step"
        assert dump["tied"] and "lm_head.weight" in dump["model"]
    assert loaded["extra"][0]["scaler"] == {}
    return f"{n_model + n_optim + n_extra} values equal (max |diff| {max(d_model, d_optim, d_extra):.1e})"


def check_losses(ref, resumed, first, exact):
    """Losses, LRs and per-rank data of resumed's steps from `first` against ref; returns the figures."""
    steps = list(range(first, STEPS + 1))
    assert sorted(resumed.log) == steps, f"resumed at the wrong step: logged {sorted(resumed.log)}"
    drel = max(abs(resumed.log[s]["loss"] - ref.log[s]["loss"]) / ref.log[s]["loss"] for s in steps)
    dabs = max(abs(resumed.log[s]["loss"] - ref.log[s]["loss"]) for s in steps)
    for s in steps:
        assert resumed.log[s]["lr"] == ref.log[s]["lr"], f"step {s}: LR differs"
        if len(resumed.log[s]["tokens"]) == len(ref.log[s]["tokens"]):
            assert resumed.log[s]["tokens"] == ref.log[s]["tokens"], f"step {s}: a rank read other data"
        if exact:
            assert resumed.log[s]["loss"] == ref.log[s]["loss"], f"step {s}: {resumed.log[s]['loss']!r} != {ref.log[s]['loss']!r}"
    assert drel <= RTOL, f"max relative |dloss| {drel:.2e} > {RTOL}"
    return f"steps {first}-{STEPS}: max |dloss| {dabs:.3e} (relative {drel:.1e})"


def steps_apart(log):
    """Smallest relative change between consecutive losses: the tolerance must be far below it."""
    return min(abs(log[s + 1]["loss"] - log[s]["loss"]) / log[s]["loss"] for s in range(1, STEPS))


# ------------------------------------------------------------------ 1-D FSDP, 2 ranks: the default model


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Uninterrupted, 2 ranks, per-rank data, dropout 0.1: the reference of the wrapper chain."""
    ref = launch(tmp_path_factory.mktemp("fsdp"), 2)
    assert ref.log[STEPS]["loss"] < ref.log[1]["loss"] and steps_apart(ref.log) > 10 * RTOL
    assert len(set(ref.log[1]["tokens"])) == 2, "the two ranks must read different data for the test to mean anything"
    return ref


@pytest.fixture(scope="module")
def wrappers(fsdp, tmp_path_factory):
    """compile on (from plain), compile off with AC on, AC off: each resumed from the previous run."""
    d = tmp_path_factory.mktemp("wrappers")
    compiled = launch(d / "compile", 2, ["--compile"], resume=(fsdp, 2))
    ac = launch(d / "ac", 2, ["--ac"], resume=(compiled, 4))
    plain = launch(d / "plain", 2, [], resume=(ac, 6))
    return [("plain -> compile", fsdp, compiled, 2), ("compile -> AC", compiled, ac, 4), ("AC -> plain", ac, plain, 6)]


@pytest.mark.parametrize("hop", range(3))
def test_wrappers_toggled(fsdp, wrappers, hop):
    """torch.compile (_orig_mod.*) and activation checkpointing (*._checkpoint_wrapped_module.*) switched
    on or off between save and resume: guards against state keyed by wrapper names, which DCP does not use,
    so a correct load was refused. backend="eager" computes the same ops, so the losses are bit-exact."""
    name, saver, resumed, step = wrappers[hop]
    state = check_state(saver, resumed, step)
    losses = check_losses(fsdp, resumed, step + 1, exact=True)
    print(f"\n{name} at step {step}: {state}; {losses}")


def test_per_rank_state_refuses_another_world_size(fsdp, tmp_path):
    """A per-rank data stream has no right mapping onto 1 rank: guards against a silent single copy
    (both ranks resumed rank 1's stream). The load must fail with CheckpointError naming the extra."""
    name = "step-00000004"
    shutil.copytree(fsdp.root / name, tmp_path / "ckpt" / name)
    rc, out = torchrun(["--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt"), "--resume"],
                       nproc=1, script=USER_LOOP, timeout=300, check=False)
    lines = [line for line in out.splitlines() if "CheckpointError" in line]
    print(f"\nresumed at world size 1 from 2: exit {rc}, {lines[-1].strip() if lines else 'no CheckpointError'}")
    assert rc != 0 and lines, out[-3000:]
    assert any("'data'" in line for line in lines), f"the error must name the per-rank extra 'data': {lines}"


# ------------------------------------------------------------------ bf16 mixed precision


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    flags = ["--mixed-precision", "bf16", "--sched", "sequential"]
    ref = launch(d / "ref", 2, flags)
    return ref, launch(d / "resumed", 2, flags, resume=(ref, 4))


def test_bf16_stores_fp32_and_resumes_exactly(bf16):
    """bf16 compute (MixedPrecisionPolicy): guards against checkpoints of the bf16 compute copy instead of
    the fp32 master weights, and against a resume that drifts. SequentialLR rides along in extra."""
    ref, resumed = bf16
    meta = dcp.FileSystemReader(str(ref.root / "step-00000004")).read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in meta.items() if k.startswith("model.")}
    assert dtypes and set(dtypes.values()) == {torch.float32}, dtypes
    state = check_state(ref, resumed, 4)
    losses = check_losses(ref, resumed, 5, exact=True)
    print(f"\nbf16: {len(dtypes)} stored model tensors, all {torch.float32}; {state}; {losses}")


# ------------------------------------------------------------------ HSDP 2 x 2 and 1-D FSDP, 4 ranks


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """HSDP uninterrupted; resumed as HSDP; resumed as 1-D FSDP (saving step 6); that resumed as HSDP."""
    d = tmp_path_factory.mktemp("hsdp")
    ref = launch(d / "ref", 4, ["--layout", "hsdp"])
    assert steps_apart(ref.log) > 10 * RTOL
    same = launch(d / "same", 4, ["--layout", "hsdp"], resume=(ref, 4))
    to_fsdp = launch(d / "to_fsdp", 4, ["--layout", "fsdp"], resume=(ref, 4))
    back = launch(d / "back", 4, ["--layout", "hsdp"], resume=(to_fsdp, 6))
    return ref, same, to_fsdp, back


def test_hsdp_same_layout_bit_exact(hsdp):
    """HSDP (replicate x shard) saved and resumed: guards against a fingerprint that adds every replica's copy."""
    ref, same, _, _ = hsdp
    print(f"\nHSDP 2x2 -> HSDP 2x2 at step 4: {check_state(ref, same, 4)}; {check_losses(ref, same, 5, exact=True)}")


def test_hsdp_to_fsdp_and_back(hsdp):
    """HSDP resumed as 1-D FSDP and that resumed as HSDP: the same parameters in other placements must load."""
    ref, _, to_fsdp, back = hsdp
    a = f"{check_state(ref, to_fsdp, 4)}; {check_losses(ref, to_fsdp, 5, exact=False)}"
    b = f"{check_state(to_fsdp, back, 6)}; {check_losses(ref, back, 7, exact=False)}"
    print(f"\nHSDP 2x2 -> FSDP 4 at step 4: {a}\nFSDP 4 -> HSDP 2x2 at step 6: {b}")


# ------------------------------------------------------------------ FSDP x tensor parallel 2 x 2


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """TP uninterrupted; resumed as TP; resumed as 1-D FSDP on the 2 data-parallel ranks. Data by global
    sample index and no dropout: 4 TP ranks -> 2 FSDP ranks changes the world size, where per-rank state
    (data streams, RNG) has no right mapping."""
    d = tmp_path_factory.mktemp("tp")
    flags = ["--data", "global", "--dropout", "0"]
    ref = launch(d / "ref", 4, ["--layout", "tp", *flags])
    assert steps_apart(ref.log) > 10 * RTOL
    same = launch(d / "same", 4, ["--layout", "tp", *flags], resume=(ref, 4))
    to_fsdp = launch(d / "to_fsdp", 2, ["--layout", "fsdp", *flags], resume=(ref, 4))
    return ref, same, to_fsdp


def test_tp_same_layout_bit_exact(tp):
    """FSDP x TP (2-D DTensors on a dp x tp mesh): guards against verification that counts tp replicas."""
    ref, same, _ = tp
    print(f"\nTP 2x2 -> TP 2x2 at step 4: {check_state(ref, same, 4)}; {check_losses(ref, same, 5, exact=True)}")


def test_tp_to_fsdp(tp):
    """TP 2x2 resumed as 1-D FSDP on 2 ranks: the tensor-parallel shards must reassemble into full rows.
    user_loop.py seeds dropout per data-parallel rank, so the ranks' RNG states differ: at another world
    size load() reseeds them and warns that ranks which must draw alike need reseeding by the user."""
    ref, _, to_fsdp = tp
    warning = [line.strip() for line in to_fsdp.out.splitlines() if "reseeded from (seed, step, rank): " in line]
    print(f"\nTP 2x2 -> FSDP 2 at step 4: {check_state(ref, to_fsdp, 4)}; {check_losses(ref, to_fsdp, 5, exact=False)}"
          f"; {warning[:1]}")
    reseeded = warning[0].split("reseeded")[1] if warning else ""
    assert "torch" in reseeded and "tensor-parallel" in reseeded, to_fsdp.out[-3000:]


# ------------------------------------------------------------------ test_resume.py pointed at this script


def test_resume_script_on_user_loop():
    """test_resume.py --script (issue 11.9) on a script that is not train_fsdp.py, compiled: guards against a
    continuity test that only works for the trainer it was written with."""
    rc, out = run([sys.executable, os.path.join(REPO, "test_resume.py"), "--script", USER_LOOP, "--args=--compile"],
                  timeout=900)
    tail = [line for line in out.splitlines() if "max |dloss|" in line or "passed" in line or "skipped" in line]
    print("\n" + "\n".join(tail))
    assert any("max |dloss| = 0.000e+00" in line for line in tail), out[-3000:]
