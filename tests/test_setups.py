"""What saves, loads, on the setups users bring: a loop we did not write for train_fsdp.py.

tests/user_loop.py is a nanoGPT-style script that uses only ckpt.check_root/load/save/close. Its model
always has tied embeddings, dropout, a trainable parameter that never gets a gradient and a branch used
every third step only (so its AdamW step lags); its `extra` holds a OneCycleLR (SequentialLR in the bf16
chain), a disabled GradScaler (state {}), an EMA of the sharded parameters (DTensors, made from the
parameters before load(), which reads into them), and per-rank data streams (torch and numpy generators whose
state differs per rank, converted to tensors and ints by its state_dict(): ckpt refuses numpy). Each scenario runs
it uninterrupted, then resumes it from one of its checkpoints in another (or the same) layout, and checks:

  * state: the full model and optimizer state, the EMA and every rank's extras, gathered right before the
    save and right after the load (user_loop.py --dump-state), are equal element for element;
  * losses against the uninterrupted run: bit-exact in the same layout; within RTOL relative across
    layouts (the reductions sum in another order);
  * the final state (model, optimizer, EMA) of the resumed run against the uninterrupted run's: bit-exact in
    the same layout, within FINAL_RTOL of each tensor's scale across layouts;
  * the LR and each rank's data (token sums per rank) of every step, exactly;
  * the parameter that never had a gradient has no optimizer state after the load, the branch's
    parameters are still behind the others by the same number of steps, and the embeddings are tied.

Guards against what issue 11 found: a per-rank stream collapsed to one rank's copy (a silently wrong
resume), states a checkpoint saves but cannot load (OneCycleLR's list of dicts, an empty dict), and correct
loads refused after HSDP, tensor parallel, torch.compile or activation checkpointing; and against state a
loss comparison cannot see (an EMA the user forgot to pass to load()).

Speed (2 cores): every rank is forked from a process that imported torch once (tests/launch.py; torch
imports cost ~5 s of CPU per process), test_resume.py's pytest included; user_loop.py is one block with a
fused AdamW (first steps of a per-tensor optimizer on DTensors cost more than the run); runs are 8 steps
(the wrapper chain) or 6 (HSDP, TP), saving only the steps a resume or a comparison uses; the bf16 runs
are the wrapper chain itself (one reference for both tests); 4 ranks only where a 2-D mesh needs them.

    python -m pytest -v -s tests/test_setups.py
"""

import os
import shutil

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch

import ckpt
from tests.harness import REPO, read_log

USER_LOOP = os.path.join(REPO, "tests", "user_loop.py")
RTOL = 1e-4  # relative, on losses across layouts
FINAL_RTOL = 1e-4  # on the final state across layouts, relative to each tensor's largest magnitude
BF16 = ["--mixed-precision", "bf16", "--sched", "sequential"]


class Run:
    def __init__(self, d, steps, out=""):
        self.dir, self.root, self.steps, self.out = d, d / "ckpt", steps, out
        self.log = read_log(d / "log.jsonl") if (d / "log.jsonl").exists() else {}

    def dump(self, kind, step):
        return torch.load(self.dir / f"{kind}-step{step}.pt", weights_only=False)  # our own files

    def last(self):
        return self.dump("saved", max(self.log))


def run_loop(d, nproc, flags=(), steps=8, every=0, resume=None, check=True):
    """user_loop.py for `steps` steps, saving every `every` (0: never) and at the last step (each save dumps the
    state); resume=(run, step): continue from that checkpoint, copied alone into a fresh root (so it is the
    newest there)."""
    d.mkdir(parents=True, exist_ok=True)
    args = ["--steps", str(steps), "--save-every", str(every), "--ckpt-dir", str(d / "ckpt"),
            "--log-file", str(d / "log.jsonl"), "--dump-state", str(d), *flags]
    if resume:
        src, step = resume
        name = f"step-{step:08d}"
        shutil.copytree(src.root / name, d / "ckpt" / name)
        args.append("--resume")
    rc, out = launch.run([USER_LOOP, *args], nproc, timeout=240, check=check)
    return Run(d, steps, out) if check else (rc, out)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in flat(v, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def compare(a, b, what, rtol=0.0):
    """(values compared, max |diff| over tensors, max |diff| / max |tensor|); asserts a == b: tensors bit for
    bit, or with rtol within rtol of each tensor's largest magnitude (Adam's second moments are ~1e-9, the
    weights ~1e-2: one absolute tolerance would see nothing in the first)."""
    a, b = flat(a), flat(b)
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
    worst, worst_rel = 0.0, 0.0
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, \
                f"{what} {k}: {x.dtype}{tuple(x.shape)} vs {y!r:.80}"
            diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            scale = x.double().abs().max().item() if x.numel() else 0.0
            worst, worst_rel = max(worst, diff), max(worst_rel, diff / scale if scale else diff)
            if rtol == 0.0 or not x.is_floating_point():
                assert torch.equal(x, y), f"{what} {k}: values differ (max |diff| {diff:.3e})"
            else:
                assert diff <= rtol * scale, f"{what} {k}: max |diff| {diff:.3e} > {rtol} x max |value| {scale:.3e}"
        else:
            assert type(x) is type(y) and x == y, f"{what} {k}: {x!r} != {y!r}"
    return len(a), worst, worst_rel


def check_state(saver, resumed, step):
    """The state resumed holds after its load equals what saver held before saving step."""
    saved, loaded = saver.dump("saved", step), resumed.dump("loaded", step)
    n_model, d_model, _ = compare(saved["model"], loaded["model"], "model")
    n_optim, d_optim, _ = compare(saved["optim"], loaded["optim"], "optimizer")
    n_ema, d_ema, _ = compare(saved["ema"], loaded["ema"], "EMA")
    assert n_ema > 10, "the EMA must be saved and loaded for this check to mean anything"
    if saved["world"] == loaded["world"]:  # per-rank extras come back to their own rank
        n_extra, d_extra, _ = compare(saved["extra"], loaded["extra"], "extras")
    else:  # only rank-independent extras may move to another world size
        for other in saved["extra"][1:]:
            compare(saved["extra"][0], other, "extras of rank 0 and another rank")
        n_extra, d_extra, _ = compare([saved["extra"][0]] * loaded["world"], loaded["extra"], "extras")
    # What the uninterrupted run had: no state for the parameter that never got a gradient; the
    # branch used every third step behind the rest; the embeddings tied.
    for dump in (saved, loaded):
        opt = dump["optim"]
        assert not [k for k in opt if k.startswith("state.unused.")], "a parameter that never had a gradient got state"
        assert float(opt["state.wte.weight.step"]) == step
        assert float(opt.get("state.aux.weight.step", 0)) == step // 3, "the branch runs on every third step"
        assert dump["tied"] and "lm_head.weight" in dump["model"]
    assert loaded["extra"][0]["scaler"] == {}
    n, worst = n_model + n_optim + n_ema + n_extra, max(d_model, d_optim, d_ema, d_extra)
    return f"{n} values equal after the load (max |dstate| {worst:.1e})"


def check_final(ref, resumed, exact):
    """The resumed run's state at its last save against the uninterrupted run's at that step."""
    step = max(resumed.log)
    want, got = ref.dump("saved", step), resumed.dump("saved", step)
    n, worst, worst_rel = 0, 0.0, 0.0
    for part in ("model", "optim", "ema"):
        k, d, r = compare(want[part], got[part], f"final {part} (step {step})", 0.0 if exact else FINAL_RTOL)
        n, worst, worst_rel = n + k, max(worst, d), max(worst_rel, r)
    return f"final state of step {step}: {n} values, max |dstate| {worst:.2e} ({worst_rel:.1e} of the tensor's scale)"


def check_losses(ref, resumed, first, exact):
    """Losses, LRs and per-rank data of resumed's steps from `first` against ref; returns the figures."""
    steps = list(range(first, max(resumed.log) + 1))
    assert sorted(resumed.log) == steps, f"resumed at the wrong step: logged {sorted(resumed.log)}"
    drel = max(abs(resumed.log[s]["loss"] - ref.log[s]["loss"]) / ref.log[s]["loss"] for s in steps)
    dabs = max(abs(resumed.log[s]["loss"] - ref.log[s]["loss"]) for s in steps)
    for s in steps:
        assert resumed.log[s]["lr"] == ref.log[s]["lr"], f"step {s}: LR differs"
        if len(resumed.log[s]["tokens"]) == len(ref.log[s]["tokens"]):
            assert resumed.log[s]["tokens"] == ref.log[s]["tokens"], f"step {s}: a rank read other data"
        if exact:
            assert resumed.log[s]["loss"] == ref.log[s]["loss"], \
                f"step {s}: {resumed.log[s]['loss']!r} != {ref.log[s]['loss']!r}"
    assert drel <= RTOL, f"max relative |dloss| {drel:.2e} > {RTOL}"
    return f"steps {first}-{steps[-1]}: max |dloss| {dabs:.3e} (relative {drel:.1e})"


def check_reference(ref, per_rank=True):
    """The uninterrupted run trains, its steps are far apart (a resume off by one step shows), and with
    per-rank streams its ranks read different data (a stream collapsed to one rank's copy shows)."""
    steps = sorted(ref.log)
    assert steps == list(range(1, ref.steps + 1)) and ref.log[steps[-1]]["loss"] < ref.log[1]["loss"]
    apart = min(abs(ref.log[s + 1]["loss"] - ref.log[s]["loss"]) / ref.log[s]["loss"] for s in steps[:-1])
    assert apart > 10 * RTOL, f"consecutive losses only {apart:.1e} apart: the tolerance could not see a wrong step"
    assert not per_rank or len(set(ref.log[1]["tokens"])) == len(ref.log[1]["tokens"]) > 1, ref.log[1]["tokens"]


def not_restored(out):
    return [line.strip() for line in out.splitlines() if "not restored from" in line]


# ------------------------------------------------------------------ 1-D FSDP, 2 ranks, bf16: the wrapper chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Uninterrupted (bf16 compute, SequentialLR, per-rank data, dropout 0.1); then compile on (resumed at 2),
    compile off and AC on (at 4), AC off (at 6), each resumed from the previous run's checkpoint."""
    d = tmp_path_factory.mktemp("chain")
    ref = run_loop(d / "ref", 2, BF16, every=2)
    check_reference(ref)
    compiled = run_loop(d / "compile", 2, [*BF16, "--compile"], every=4, resume=(ref, 2))
    ac = run_loop(d / "ac", 2, [*BF16, "--ac"], every=6, resume=(compiled, 4))
    plain = run_loop(d / "plain", 2, BF16, resume=(ac, 6))
    return ref, [("plain -> compile", ref, compiled, 2), ("compile -> AC", compiled, ac, 4),
                 ("AC -> plain", ac, plain, 6)]


@pytest.mark.parametrize("hop", range(3))
def test_wrappers_toggled(chain, hop):
    """torch.compile (_orig_mod.*) and activation checkpointing (*._checkpoint_wrapped_module.*) switched
    on or off between save and resume: guards against state keyed by wrapper names, which DCP does not use,
    so a correct load was refused (or an EMA keyed by them). backend="eager" computes the same ops, so the
    losses and the final state are bit-exact. (Both wrappers at once compute differently from a plain run
    even uninterrupted, from step 2 on, so they could not be checked bit for bit: one toggle per hop.)"""
    ref, hops = chain
    name, saver, resumed, step = hops[hop]
    state = check_state(saver, resumed, step)
    losses = check_losses(ref, resumed, step + 1, exact=True)
    final = check_final(ref, resumed, exact=True)
    assert not not_restored(resumed.out), not_restored(resumed.out)
    print(f"\n{name} at step {step}: {state}; {losses}; {final}")


def test_bf16_stores_fp32_and_resumes_exactly(chain):
    """bf16 compute (MixedPrecisionPolicy), as the whole wrapper chain runs: guards against checkpoints of the
    bf16 compute copy instead of the fp32 master weights (the stored dtypes, read from DCP's metadata), and
    against a resume that drifts (the AC -> plain hop: a plain bf16 resume, bit-exact to the last step and
    the final state). SequentialLR rides along in extra."""
    ref, hops = chain
    _, saver, resumed, step = hops[2]
    meta = ckpt.read_metadata(str(ref.root / "step-00000004")).state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in meta.items() if k.startswith(("model.", "optim.state.", "extra.ema."))
              and hasattr(v, "properties") and v.properties.dtype.is_floating_point}
    assert [k for k in dtypes if k.startswith("model.")] and set(dtypes.values()) == {torch.float32}, dtypes
    assert [k for k in dtypes if k.startswith("extra.ema.")], "the EMA is stored as DTensors of its own"
    state = check_state(saver, resumed, step)
    losses = check_losses(ref, resumed, step + 1, exact=True)
    print(f"\nbf16: {len(dtypes)} stored model, optimizer and EMA tensors, all {torch.float32}; {state}; {losses}; "
          f"{check_final(ref, resumed, exact=True)}")


def test_per_rank_state_refuses_another_world_size(chain, tmp_path):
    """A per-rank data stream has no right mapping onto 1 rank: guards against a silent single copy
    (both ranks resumed rank 1's stream). The load must fail with CheckpointError naming the extra."""
    ref, _ = chain
    rc, out = run_loop(tmp_path, 1, BF16, resume=(ref, 4), check=False)
    lines = [line for line in out.splitlines() if "CheckpointError" in line]
    print(f"\nresumed at world size 1 from 2: exit {rc}, {lines[-1].strip() if lines else 'no CheckpointError'}")
    assert rc != 0 and lines, out[-3000:]
    assert any("extra 'data' is per rank" in line and "saved at world size 2, not 1" in line for line in lines), lines
    assert not read_log(tmp_path / "log.jsonl"), "no step may run after a refused load"


def test_ema_not_loaded_is_seen_by_the_final_state_only(chain, tmp_path):
    """Negative control for state a loss comparison cannot see: --ema-not-loaded saves the EMA but does not
    pass it to load() (ckpt only warns). Guards against a continuity check blind to it: the losses and the
    model stay bit-exact, the final EMA must not, and the warning must name the extra."""
    ref, _ = chain
    resumed = run_loop(tmp_path, 2, [*BF16, "--ema-not-loaded"], resume=(ref, 4))
    losses = check_losses(ref, resumed, 5, exact=True)
    want, got = ref.last(), resumed.last()
    _, d_model, _ = compare(want["model"], got["model"], "final model")
    d_ema = max((want["ema"][k] - got["ema"][k]).abs().max().item() for k in want["ema"])
    warning = not_restored(resumed.out)
    print(f"\nEMA not passed to load(): {losses}; final model max |dstate| {d_model:.1e}, final EMA max |dstate| "
          f"{d_ema:.2e}; {warning[:1]}")
    assert d_ema > 1e-4, "the EMA restarted at the resume must differ from the uninterrupted run's"
    assert warning and "ema" in warning[0].split("not restored from")[1], resumed.out[-3000:]


# ------------------------------------------------------------------ HSDP 2 x 2 and 1-D FSDP, 4 ranks


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """HSDP uninterrupted (6 steps); resumed as HSDP at 4; resumed as 1-D FSDP at 2 and stopped at 4, which
    is resumed as HSDP."""
    d = tmp_path_factory.mktemp("hsdp")
    ref = run_loop(d / "ref", 4, ["--layout", "hsdp"], steps=6, every=2)
    check_reference(ref)
    same = run_loop(d / "same", 4, ["--layout", "hsdp"], steps=6, resume=(ref, 4))
    to_fsdp = run_loop(d / "to_fsdp", 4, ["--layout", "fsdp", "--stop-after", "4"], steps=6, resume=(ref, 2))
    back = run_loop(d / "back", 4, ["--layout", "hsdp"], steps=6, resume=(to_fsdp, 4))
    return ref, same, to_fsdp, back


def test_hsdp_same_layout_bit_exact(hsdp):
    """HSDP (replicate x shard) saved and resumed: (Replicate, Shard) DTensors, each shard written once by
    DCP for all replicas, must come back to every replica bit-exactly. Guards against a replica that loads
    another shard or none (its copy deduplicated away at save), and per-rank streams crossed between replicas."""
    ref, same, _, _ = hsdp
    print(f"\nHSDP 2x2 -> HSDP 2x2 at step 4: {check_state(ref, same, 4)}; {check_losses(ref, same, 5, exact=True)}; "
          f"{check_final(ref, same, exact=True)}")
    assert not not_restored(same.out), not_restored(same.out)


def test_hsdp_to_fsdp_and_back(hsdp):
    """HSDP resumed as 1-D FSDP and that resumed as HSDP (same 4 ranks, so the per-rank streams stay):
    guards against a load refused, or misplaced, when the same parameters come in other placements."""
    ref, _, to_fsdp, back = hsdp
    a = f"{check_state(ref, to_fsdp, 2)}; {check_losses(ref, to_fsdp, 3, exact=False)}; " \
        f"{check_final(ref, to_fsdp, exact=False)}"
    b = f"{check_state(to_fsdp, back, 4)}; {check_losses(ref, back, 5, exact=False)}; " \
        f"{check_final(ref, back, exact=False)}"
    print(f"\nHSDP 2x2 -> FSDP 4 at step 2: {a}\nFSDP 4 -> HSDP 2x2 at step 4: {b}")


# ------------------------------------------------------------------ FSDP x tensor parallel 2 x 2


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """TP uninterrupted (6 steps); resumed as TP at 4; resumed as 1-D FSDP on the 2 data-parallel ranks at 4.
    Data by global sample index and no dropout: 4 TP ranks -> 2 FSDP ranks changes the world size, where
    per-rank state (data streams, RNG) has no right mapping."""
    d = tmp_path_factory.mktemp("tp")
    flags = ["--data", "global", "--dropout", "0"]
    ref = run_loop(d / "ref", 4, ["--layout", "tp", *flags], steps=6, every=4)
    check_reference(ref, per_rank=False)
    same = run_loop(d / "same", 4, ["--layout", "tp", *flags], steps=6, resume=(ref, 4))
    to_fsdp = run_loop(d / "to_fsdp", 2, ["--layout", "fsdp", *flags], steps=6, resume=(ref, 4))
    return ref, same, to_fsdp


def test_tp_same_layout_bit_exact(tp):
    """FSDP x TP (2-D DTensors on a dp x tp mesh, the EMA too): guards against shards of the tp dimension
    saved or loaded as if replicated (one tp rank's half for both)."""
    ref, same, _ = tp
    print(f"\nTP 2x2 -> TP 2x2 at step 4: {check_state(ref, same, 4)}; {check_losses(ref, same, 5, exact=True)}; "
          f"{check_final(ref, same, exact=True)}")
    assert not not_restored(same.out), not_restored(same.out)


def test_tp_to_fsdp(tp):
    """TP 2x2 resumed as 1-D FSDP on 2 ranks: the tensor-parallel shards (and the EMA's) must reassemble
    into full rows, and training continue within float tolerance. user_loop.py seeds its generators per
    data-parallel rank, so they differed between the saving ranks: at another world size load() leaves them
    as the process seeded them and warns, naming rng.torch (ranks that must draw alike, such as TP partners,
    are the user's to seed)."""
    ref, _, to_fsdp = tp
    warning = not_restored(to_fsdp.out)
    print(f"\nTP 2x2 -> FSDP 2 at step 4: {check_state(ref, to_fsdp, 4)}; "
          f"{check_losses(ref, to_fsdp, 5, exact=False)}; {check_final(ref, to_fsdp, exact=False)}; {warning[:1]}")
    named = warning[0].split("not restored from")[1] if warning else ""
    assert "rng.torch (per rank, saved at world size 4: left as this process seeded it)" in named, to_fsdp.out[-3000:]
    assert "ema" not in named and "data" not in named, "only the per-rank generators may be left behind"


# ------------------------------------------------------------------ test_resume.py pointed at this script

# test_resume.py, run as users run it (python test_resume.py --script ...), but as a rank of tests/launch.py
# (torch imported already) whose launches go through tests/launch.py in turn instead of torchrun: torchrun
# and 2 x 4 rank imports saved. torchrun itself is exercised by test_multinode.py and test_resume.py's own runs.
RESUME_BOOT = """
import runpy, sys
sys.path.insert(0, {repo!r})
from tests import launch
import tests.harness as harness


def torchrun(args, nproc=2, script=harness.TRAIN, timeout=180, env=None, check=True, cwd=None):
    return launch.run([script, *args], nproc, env=env, timeout=timeout, check=check)


harness.torchrun = torchrun
sys.argv = [{script!r}, "--script", {user_loop!r}, "-p", "no:cacheprovider"]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_resume_script_on_user_loop(tmp_path):
    """test_resume.py --script (issue 11.9) on a script that is not train_fsdp.py: guards against a
    continuity test that only works for the trainer it was written with (its losses, LRs and final
    checkpoints, EMA and per-rank data streams included, must match bit for bit)."""
    boot = tmp_path / "resume_boot.py"
    boot.write_text(RESUME_BOOT.format(repo=REPO, script=os.path.join(REPO, "test_resume.py"), user_loop=USER_LOOP))
    rc, out = launch.run([boot], 1, timeout=600, check=False)
    tail = [line for line in out.splitlines() if "max |d" in line or "passed" in line or "skipped" in line]
    print("\n" + "\n".join(tail))
    assert rc == 0, out[-3000:]
    assert any("max |dloss| = 0.000e+00" in line for line in tail), out[-3000:]
    assert any("max |dstate| = 0.000e+00" in line and " 0 differ" in line for line in tail), out[-3000:]
