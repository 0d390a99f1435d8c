"""consolidate.py: a sharded checkpoint streamed into Hugging Face safetensors, checked by independent paths.

Guards against the field's export failures (FAILURE_MODES.md, "dtype and export" and "Partial checkpoints"):
weights reassembled wrongly from shards, optimizer state leaking into the export, a bf16 export that is not
the plain cast, tied weights refused by safetensors, an output that our own --init-from or transformers
cannot load, and a half-written output directory after bad input or a crash.

Reference values never come from consolidate.py's own code: they come from torch's
dcp_to_torch_save (which loads the whole checkpoint, with its own planner and reader) and, for losses, from
train_fsdp.LlamaLM evaluated in this process.

    python -m pytest -q -s tests/test_consolidate.py
"""

import argparse
import contextlib
import glob
import io
import json
import os
import runpy
import shutil
import sys

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.data import default_collate

import ckpt
import consolidate
import train_fsdp
from tests.harness import REPO, SMALL, TRAIN, read_log

# --dropout 0: the first loss of a run is then a plain function of (weights, batch at data position 0).
ARGS = SMALL + ["--seed", "11", "--dropout", "0"]
STEPS = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank FSDP2 run that saves at steps 3 and 6: the root's newest checkpoint is step 6. Its ranks are forked
    from warm processes (tests/launch.py, torchrun's environment): the launcher is not what this file tests."""
    d = tmp_path_factory.mktemp("trained")
    launch.run([TRAIN, *ARGS, "--steps", STEPS, "--save-every", 3, "--ckpt-dir", d / "ckpt",
                "--log-file", d / "log.jsonl"], timeout=180)
    assert ckpt.committed_steps(d / "ckpt") == [3, STEPS]
    return d


@pytest.fixture(scope="module")
def reference(trained, tmp_path_factory):
    """{HF name: full fp32 tensor} by torch's own converter, which shares no code with consolidate.py."""
    path = tmp_path_factory.mktemp("reference") / "full.pt"
    dcp_to_torch_save(ckpt.step_dir(trained / "ckpt", STEPS), path)
    full = torch.load(path, weights_only=False)  # our own file, written a line above; holds non-tensor items too
    return {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}


@pytest.fixture(scope="module")
def fp32_out(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32") / "hf"
    result = consolidate.consolidate(trained / "ckpt", out, quiet=True)
    assert result["checkpoint"].endswith(f"step-{STEPS:08d}"), result["checkpoint"]
    return out


@pytest.fixture(scope="module")
def sharded_out(trained, tmp_path_factory):
    """The command line (main(), in this process), with a shard size that splits SMALL's 0.5 MB into files."""
    out = tmp_path_factory.mktemp("sharded") / "hf"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = consolidate.main([str(ckpt.step_dir(trained / "ckpt", STEPS)), str(out), "--max-shard-size", "100KB"])
    assert code == 0, err.getvalue()
    return out, err.getvalue()


def read_all(out):
    """{name: tensor} of every .safetensors file in out, opened with the safetensors library alone."""
    tensors = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                for k in f.keys():
                    assert k not in tensors, f"{k} is in two files"
                    tensors[k] = f.get_tensor(k)
    return tensors


def count_differing(got, want):
    """(tensors that differ, elements that differ), comparing bit patterns (so -0.0 != 0.0, NaN == NaN)."""
    bits = {2: torch.int16, 4: torch.int32}
    bad_t = bad_e = 0
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{k}: {g.dtype} {tuple(g.shape)}, {w.dtype} {tuple(w.shape)}"
        n = (g.view(bits[g.element_size()]) != w.view(bits[w.element_size()])).sum().item()
        bad_t, bad_e = bad_t + (n > 0), bad_e + n
    return bad_t, bad_e


def test_fp32_bit_exact_and_casts(trained, reference, fp32_out, tmp_path):
    """Every exported tensor is the full parameter, bit for bit; bf16/fp16 are exactly its cast; no optimizer keys."""
    got = read_all(fp32_out)
    n_dcp = len(ckpt.read_metadata(ckpt.step_dir(trained / "ckpt", STEPS)).state_dict_metadata)
    assert sorted(got) == sorted(reference), f"names differ: {sorted(set(got) ^ set(reference))}"
    assert "lm_head.weight" in got and "model.embed_tokens.weight" in got
    assert not [k for k in got if k.startswith(("optim", "extra", "rng", "model.model."))]
    bad_t, bad_e = count_differing(got, reference)
    elements = sum(t.numel() for t in got.values())
    config = json.load(open(fp32_out / "config.json"))

    casts = {}
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = tmp_path / flag
        assert consolidate.main([str(trained / "ckpt"), str(out), "--dtype", flag, "--quiet"]) == 0
        casts[flag] = (count_differing(read_all(out), {k: v.to(dtype) for k, v in reference.items()}),
                       json.load(open(out / "config.json"))["torch_dtype"], os.path.getsize(out / "model.safetensors"))
    print(f"\nfp32: {len(got)} tensors of {n_dcp} DCP keys, {elements} elements, {bad_e} differ ({bad_t} tensors), "
          f"{os.path.getsize(fp32_out / 'model.safetensors')} bytes; "
          + "; ".join(f"{k}: {v[0][1]} elements differ from the cast, {v[2]} bytes" for k, v in casts.items()))
    assert (bad_t, bad_e) == (0, 0)
    assert casts["bf16"][:2] == ((0, 0), "bfloat16") and casts["fp16"][:2] == ((0, 0), "float16")
    assert config["torch_dtype"] == "float32"
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert not os.path.exists(fp32_out / consolidate.INDEX)  # one file: no index, as Hugging Face does


def test_sharded_output(reference, sharded_out):
    """--max-shard-size splits into model-0000i-of-0000N files whose index names every tensor's file."""
    out, log = sharded_out
    index = json.load(open(out / consolidate.INDEX))
    files = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    sizes = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = list(f.keys())
            sizes[name] = (len(keys), sum(f.get_tensor(k).nbytes for k in keys))
        assert sorted(keys) == sorted(k for k, v in index["weight_map"].items() if v == name)
    got = read_all(out)
    bad_t, bad_e = count_differing(got, reference)
    total = sum(t.nbytes for t in reference.values())
    print(f"\n{len(files)} files, data bytes per file {[s for _, s in sizes.values()]}, "
          f"index total_size {index['metadata']['total_size']} (tensors hold {total}); {bad_e} elements differ")
    print("stderr tail:", log.strip().splitlines()[-1])
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(reference) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == total
    assert all(nbytes <= 100_000 or n == 1 for n, nbytes in sizes.values())  # only a lone tensor may exceed it
    assert (bad_t, bad_e) == (0, 0)
    assert "tensors" in log and "MB/s" in log  # progress on stderr


def reference_model(reference):
    args = train_fsdp.get_args(ARGS)
    model = train_fsdp.LlamaLM(args)
    model.load_state_dict(reference)  # strict: every name of the model, and no other
    return args, model.eval()


def test_init_from_round_trip(trained, reference, sharded_out, tmp_path):
    """consolidate -> train_fsdp.py --init-from -> the first loss is the saved model's loss on the same batch.

    An --init-from run starts at data position 0, so its first logged loss is the forward pass of the loaded
    weights on the batch at position 0 (logged before the optimizer step; --dropout 0 makes it deterministic).
    The saved model's loss on that batch is computed here, with train_fsdp.LlamaLM and the reference weights.
    The --init-from run is one rank (FSDP2 over a world of one, the same global batch; the export was made
    from 2 ranks' shards), forked from a warm process (tests/launch.py): a 2-rank torchrun took 2.4x the CPU time of
    a plain process (17.9 s against 7.3 s), too much for the budget.
    Control: the training run's own step-1 loss is that same batch under the seed's random init, the value
    an --init-from that silently loaded nothing would log; it must be far from the reference.
    """
    args, model = reference_model(reference)
    x, y = default_collate([train_fsdp.Samples(args)[i] for i in range(args.batch_size)])  # the global batch 0
    with torch.no_grad():
        want = F.cross_entropy(model(x).float().view(-1, args.vocab_size), y.reshape(-1)).item()
    out, _ = sharded_out
    launch.run([TRAIN, *ARGS, "--steps", 1, "--save-every", 0, "--init-from", out, "--ckpt-dir", tmp_path / "ckpt",
                "--log-file", tmp_path / "log.jsonl"], nproc=1, timeout=180)
    got = read_log(tmp_path / "log.jsonl")[1]["loss"]
    untrained = read_log(trained / "log.jsonl")[1]["loss"]
    print(f"\nfirst loss after --init-from {got:.7f}, saved model on batch 0 {want:.7f}: |d| = {abs(got - want):.2e}; "
          f"random init (control) {untrained:.7f}: |d| = {abs(untrained - want):.2e}")
    assert abs(got - want) <= 1e-5
    assert abs(untrained - want) > 0.05, "the training run must move the loss for this test to mean anything"


def test_transformers_loads_and_matches(reference, fp32_out):
    """LlamaForCausalLM.from_pretrained(OUT): no missing or unexpected keys, logits equal ours to 1e-4."""
    transformers = pytest.importorskip("transformers", reason="transformers is optional (not in requirements.txt)")
    hf, info = transformers.LlamaForCausalLM.from_pretrained(str(fp32_out), output_loading_info=True)
    args, model = reference_model(reference)
    x, _ = default_collate([train_fsdp.Samples(args)[i] for i in range(args.batch_size)])
    with torch.no_grad():
        diff = (hf.eval()(x).logits.float() - model(x).float()).abs().max().item()
    print(f"\ntransformers {transformers.__version__}: loading info {info}; max |dlogits| = {diff:.2e}")
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert diff <= 1e-4


@contextlib.contextmanager
def world_of_one():
    """A gloo process group of one rank in this process, enough for ckpt.save (a torchrun launch costs seconds)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        ckpt.close()
        dist.destroy_process_group()


class TiedLM(torch.nn.Module):
    """The names of train_fsdp.LlamaLM, with lm_head.weight and model.embed_tokens.weight one Parameter."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(256, 64)
        self.model.norm = torch.nn.LayerNorm(64, bias=False)
        self.lm_head = torch.nn.Linear(64, 256, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx):
        return self.lm_head(self.model.norm(self.model.embed_tokens(idx)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tied_weights(tmp_path):
    """Two names for one tensor (tied embed_tokens / lm_head) are both written, safetensors reads them, and
    config.json keeps tie_word_embeddings, so transformers ties them again on load.

    safetensors.torch.save_file refuses tensors that share memory ("Some tensors share memory"): the control
    shows the hazard with the very tensor saved here. The checkpoint is written by ckpt.save in this process
    (a world of one), with an optimizer step taken and the model_config train_fsdp.py stores.
    """
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(8)).square().mean().backward()
    opt.step()
    config = {"hidden_size": 64, "vocab_size": 256, "tie_word_embeddings": True, "torch_dtype": "float32"}
    with world_of_one():
        ckpt.save(tmp_path / "root", 1, model, opt, meta={"model_config": config})
    w = model.lm_head.weight.detach()
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"model.embed_tokens.weight": w, "lm_head.weight": w}, str(tmp_path / "naive.safetensors"))

    assert consolidate.main([str(tmp_path / "root"), str(tmp_path / "out"), "--quiet", "--dtype", "bf16"]) == 0
    got = read_all(tmp_path / "out")
    same = all(torch.equal(got[name], w.bfloat16()) for name in ("lm_head.weight", "model.embed_tokens.weight"))
    written = json.load(open(tmp_path / "out" / "config.json"))
    print(f"\ntied pair written as {sorted(got)}; both equal the tied tensor cast to bf16: {same}; "
          f"config.json: tie_word_embeddings={written.get('tie_word_embeddings')}, "
          f"torch_dtype={written['torch_dtype']}")
    assert sorted(got) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert same
    assert written == dict(config, torch_dtype="bfloat16")


class Shadow:
    """An EMA extra as the README keeps one: {"decay", "shadow": {parameter name: tensor}}."""

    def __init__(self, shadow):
        self.shadow = shadow

    def state_dict(self):
        return {"decay": 0.9, "shadow": self.shadow}

    def load_state_dict(self, sd):
        self.shadow = sd["shadow"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_ema_exported_by_prefix(tmp_path):
    """An EMA kept as an extra exports with --prefix extra.ema.shadow.: its shadow weights under the model's names,
    bit-exact, none of the model's own. The checkpoint is saved by a plain process (no process group), as an export
    or evaluation script runs. Guards against an EMA that can only be exported by copying it into the model and
    saving that again."""
    torch.manual_seed(0)
    model = TiedLM()
    shadow = {name: p.detach() * 0.5 for name, p in model.named_parameters()}
    try:
        ckpt.save(str(tmp_path / "root"), 1, model, None, {"ema": Shadow(shadow)})
    finally:
        ckpt.close()
    assert consolidate.main([str(tmp_path / "root"), str(tmp_path / "ema"), "--quiet", "--prefix",
                             "extra.ema.shadow."]) == 0
    got = read_all(tmp_path / "ema")
    diff = max((got[name] - shadow[name]).abs().max().item() for name in shadow)
    print(f"\nEMA exported by prefix: {sorted(got)}; max |diff| vs the shadow weights = {diff:.1e}")
    assert sorted(got) == sorted(shadow) and diff == 0
    bad = consolidate.main([str(tmp_path / "root"), str(tmp_path / "none"), "--quiet", "--prefix", "extra.nope."])
    assert bad == 1 and not os.path.exists(tmp_path / "none")


def leftovers(parent):
    return sorted(n for n in os.listdir(parent) if ".tmp-" in n or ".old-" in n)


def test_bad_input_is_refused_by_name(trained, tmp_path, capsys, monkeypatch):
    """Every bad input is one clear error naming the path, exit code 1, and no OUT (nor temp dirs) created."""
    src = ckpt.step_dir(trained / "ckpt", STEPS)

    def copy(dest):
        shutil.copytree(src, dest)
        return dest

    cases = {}
    cases["no such path"] = (tmp_path / "nowhere", "does not exist")
    (tmp_path / "foreign").mkdir()  # ckpt accepts any directory as a root: this one holds no checkpoint
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    cases["not a checkpoint"] = (tmp_path / "foreign", "no committed checkpoint")
    (tmp_path / "empty").mkdir()
    cases["empty root"] = (tmp_path / "empty", "no committed checkpoint")
    # A crash after the manifest, before the rename: complete-looking, but never committed.
    tmp_ckpt = copy(tmp_path / "crashed" / f"{ckpt.TMP}step-00000009-1a2b3c4d")
    cases["uncommitted .tmp- dir"] = (tmp_ckpt, "uncommitted save")
    cases["root with only a .tmp- dir"] = (tmp_path / "crashed", "no committed checkpoint")
    os.remove(copy(tmp_path / "nomanifest" / "step-00000006") / "manifest.json")
    cases["step dir without manifest"] = (tmp_path / "nomanifest" / "step-00000006", "is not a committed checkpoint")
    missing = copy(tmp_path / "missing" / "step-00000006")
    os.remove(missing / "__1_0.distcp")
    cases["missing shard"] = (missing / "__1_0.distcp", "is missing")
    corrupt = copy(tmp_path / "corrupt" / "step-00000006")
    with open(corrupt / "__0_0.distcp", "r+b") as f:
        f.seek(os.path.getsize(corrupt / "__0_0.distcp") // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    cases["flipped bit"] = (corrupt / "__0_0.distcp", "does not match its checksum")

    outs = tmp_path / "outs"
    outs.mkdir()
    for label, (path, why) in cases.items():
        out = outs / label.replace(" ", "_")
        arg = str(path.parent if label in ("missing shard", "flipped bit") else path)
        code = consolidate.main([arg, str(out)])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        with capsys.disabled():
            print(f"\n{label}: exit {code}: {err}")
        assert code == 1 and str(path) in err and why in err, err
        assert not os.path.exists(out) and leftovers(outs) == []

    existing = outs / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    code = consolidate.main([str(src), str(existing)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"\nexisting OUT: exit {code}: {err}")
    assert code == 1 and str(existing) in err and "--overwrite" in err
    assert sorted(os.listdir(existing)) == ["keep.txt"]

    inside = trained / "ckpt" / "hf"  # a root holds checkpoints: the export would be copied and cleaned up with them
    code = consolidate.main([str(trained / "ckpt"), str(inside)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"OUT inside the checkpoint root: exit {code}: {err}")
    assert code == 1 and str(inside) in err and not os.path.exists(inside) and leftovers(trained / "ckpt") == []

    # OUT holding the checkpoint root: --overwrite would delete the checkpoints with the old OUT.
    code = consolidate.main([str(trained / "ckpt"), str(trained), "--overwrite"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    print(f"OUT holding the checkpoint root, --overwrite: exit {code}: {err}")
    assert code == 1 and str(trained) in err and ckpt.committed_steps(trained / "ckpt") == [3, STEPS]
    assert leftovers(trained.parent) == []

    # As a script: exit status 1 and one line, not a traceback (run as __main__ in this process, since a fresh
    # interpreter costs seconds of importing torch; an exception other than SystemExit would fail the test).
    monkeypatch.setattr(sys, "argv", ["consolidate.py", str(missing), str(outs / "cli")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(os.path.join(REPO, "consolidate.py"), run_name="__main__")
    log = capsys.readouterr().err.strip().splitlines()
    print(f"as a script: exit {exit_.value.code}: {log[-1]}")
    assert exit_.value.code == 1 and len(log) == 1 and str(missing / "__1_0.distcp") in log[0]
    assert not os.path.exists(outs / "cli")


def test_overwrite_and_crash_leave_no_half_output(trained, tmp_path, monkeypatch):
    """--overwrite replaces OUT only once the new output is complete; a crash mid-stream leaves nothing.

    The crash is injected into the middle of streaming: the third dcp.load raises, with a read group of
    one tensor, so the first file is partly written when it happens (its size then is recorded).
    """
    src = ckpt.step_dir(trained / "ckpt", STEPS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("old export")  # a name this script writes

    real_load = dcp.load

    def crash(dest, **kw):
        calls, partial = [], []

        def flaky_load(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                partial.extend(map(os.path.getsize, glob.glob(f"{dest.parent}/.{dest.name}.tmp-*/*.safetensors")))
                raise OSError("disk went away (injected)")
            return real_load(*a, **k)

        monkeypatch.setattr(consolidate.dcp, "load", flaky_load)
        try:
            with pytest.raises(OSError, match="injected"):
                consolidate.consolidate(src, dest, quiet=True, **kw)
        finally:
            monkeypatch.setattr(consolidate.dcp, "load", real_load)
        return partial

    monkeypatch.setattr(consolidate, "READ_GROUP", 1)  # one tensor per dcp.load
    partial = crash(out, overwrite=True)
    crashed = (sorted(os.listdir(out)), leftovers(tmp_path))
    crash(tmp_path / "fresh")  # the same crash with no old OUT: none appears
    fresh = os.path.exists(tmp_path / "fresh")

    result = consolidate.consolidate(src, out, overwrite=True, quiet=True)
    after = (sorted(os.listdir(out)), leftovers(tmp_path))
    full = os.path.getsize(out / "model.safetensors")
    print(f"\ncrash at dcp.load #3, the output file then {partial} of {full} bytes: OUT holds {crashed[0]}, "
          f"leftovers {crashed[1]}, fresh OUT created: {fresh}; "
          f"after --overwrite: {after[0]} ({result['tensors']} tensors, {len(result['files'])} file), "
          f"leftovers {after[1]}")
    assert len(partial) == 1 and 0 < partial[0] < full
    assert crashed == (["model-00001-of-00002.safetensors"], [])
    assert not fresh
    assert after == (["config.json", "model.safetensors"], [])


def test_sizes_other_files_and_unreadable_shards_are_refused(trained, tmp_path, capsys, monkeypatch):
    """--max-shard-size refuses "5IB", "0" and "0.5" (they parsed as 5 and 0 bytes: a file per tensor); --overwrite
    refuses an OUT holding files this script does not write (it deleted them, "." and all); a shard DCP cannot read
    (past --no-checksum) is one line of error and exit 1 (a 60-line traceback)."""
    sizes = {}
    for text in ("5IB", "0", "0.5", "2GiB", "500MB"):
        try:
            sizes[text] = consolidate.parse_size(text)
        except argparse.ArgumentTypeError as e:
            sizes[text] = str(e)
    src = ckpt.step_dir(trained / "ckpt", STEPS)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    other = consolidate.main([str(src), str(mine), "--overwrite", "--quiet"])
    other_err = capsys.readouterr().err.strip()
    def unreadable(*a, **k):
        raise dcp.CheckpointException("injected", {0: (ValueError("bad item"), None)})
    monkeypatch.setattr(consolidate.dcp, "load", unreadable)
    damaged = consolidate.main([str(src), str(tmp_path / "out"), "--no-checksum", "--quiet"])
    damaged_err = capsys.readouterr().err.strip()
    print(f"\n{sizes}\nother files: {other} {other_err}\nunreadable: {damaged} {damaged_err}")
    assert all("not a size" in str(sizes[t]) for t in ("5IB", "0", "0.5"))
    assert sizes["2GiB"] == 2 * 2**30 and sizes["500MB"] == 500 * 10**6
    assert other == 1 and "is not an export of this script" in other_err and (mine / "notes.txt").exists()
    assert damaged == 1 and "cannot be read" in damaged_err and len(damaged_err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "out")
