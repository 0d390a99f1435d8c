"""CUDA: what CPU CI cannot run, checked where a GPU is (one is enough). Without one the module is skipped at once.

    python -m pytest -v -s tests/test_cuda.py

Guards against the field's GPU-only checkpoint failures:
  * a resume on CUDA that is not bit-exact (NCCL, bf16 autocast, the CUDA generator), with synchronous saves and with
    async ones (test_resume.py, one rank);
  * an async save whose copy to host memory is still running when the optimizer steps (the copy goes on a side
    stream): the checkpoint holds a torn mix of step N and N+1, and nothing says so;
  * a write into a parameter right after an async save that lands in the checkpoint silently;
  * Adam's `step` of a 0-dim parameter (a logit scale: laid out like its parameter) restored onto the GPU when Adam
    keeps it on the CPU, or the reverse: another code path in the next step, or its failure;
  * a checkpoint saved from CUDA that consolidate.py cannot read on a machine without a GPU.

Each scenario that uses the GPU runs in a fresh process (this file, run as a script) within a time limit: this test
process never creates a CUDA context, which would hold GPU memory while later tests start ranks on the GPU, and a
hang is killed. A scenario's logic can be tried on CPU too (not a CUDA check, only a check of the test itself):

    python tests/test_cuda.py async /tmp/scenario --device cpu      # async | zero_dim | fsdp_save
"""

import argparse
import glob
import json
import os
import re
import sys
from collections import OrderedDict

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVERS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD (ROCm), WSL


def gpu_present():
    """torch.cuda.is_available(); without importing torch (3-4 s on a small machine) where no GPU driver is."""
    if "torch" not in sys.modules and not any(os.path.exists(path) for path in DRIVERS):
        return False
    import torch
    return torch.cuda.is_available()


if __name__ != "__main__" and not gpu_present():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

sys.path.insert(0, REPO)  # run as a script: ckpt.py, consolidate.py, train_fsdp.py and tests/ are found
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import ckpt  # noqa: E402
import train_fsdp  # noqa: E402
from tests.harness import SMALL, run  # noqa: E402


# ---- shared by the scenarios (in their processes) and the tests (in this one) ----

def state_of(model, optimizer):
    """What a resume must restore, copied to the CPU: {"model.<name>": tensor, "optim.<name>.<key>": value}. The copy
    waits for the GPU work queued before it."""
    names = {param: name for name, param in model.named_parameters()}
    state = {f"model.{name}": value.detach().cpu().clone() for name, value in model.state_dict().items()}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            state[f"optim.{names[param]}.{key}"] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    return state


def compare(want, got):
    """(the keys whose values differ, bit for bit, or that only one side has; max |want - got| over float tensors)."""
    differ, worst = sorted(set(want) ^ set(got)), 0.0
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if not torch.is_tensor(a) or not torch.is_tensor(b):
            differ += [key] if a != b else []
            continue
        if a.dtype != b.dtype or a.shape != b.shape:
            differ.append(key)
            continue
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            differ.append(key)
        if a.is_floating_point() and a.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return differ, worst


# ---- scenarios: each in a process of its own, on the GPU ----

def resumed(path, build, make_optimizer):
    """A fresh model (other initial weights: load() must overwrite each) and optimizer, with path loaded into them."""
    torch.manual_seed(1)
    model = build()
    optimizer = make_optimizer(model)
    ckpt.load(path, model, optimizer)
    return model, optimizer


def scenario_async(d, device):
    """(b) Two async saves, each followed at once by optimizer steps; then an in-place write right after a third."""
    def build():  # 33.6M parameters, 403 MB of state with AdamW's moments: a copy that takes a while
        return nn.Sequential(OrderedDict((f"layer{i}", nn.Linear(2048, 2048)) for i in range(8))).to(device)

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    model, root = build(), os.path.join(d, "ckpt")
    optimizer, x = make_optimizer(model), torch.randn(64, 2048, device=device)

    def backward():
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    for _ in range(2):
        backward()
        optimizer.step()
    result = {"saves": []}
    for step in (2, 3):  # the first async save may allocate the host buffers, the second reuses them
        backward()  # gradients ready: the step right after save() changes every parameter and moment
        want = state_of(model, optimizer)
        pending = ckpt.save(root, step, model, optimizer, async_save=True)
        optimizer.step()  # at once, while the copy may still run: it must wait for the copy
        for _ in range(3):
            backward()
            optimizer.step()
        path = pending.wait()
        now = state_of(model, optimizer)
        moved = max((now[k] - want[k]).abs().max().item() for k in want if k.startswith("model."))  # the weights
        differ, worst = compare(want, state_of(*resumed(path, build, make_optimizer)))
        result["saves"].append({"step": step, "keys": len(want), "differ": differ, "max_abs": worst, "moved": moved})
    result["page_locked"] = ckpt._cache["memory"].is_pinned()  # cudaHostRegister'd: the copies run beside the loop
    backward()
    want = state_of(model, optimizer)
    pending = ckpt.save(root, 4, model, optimizer, async_save=True)
    with torch.no_grad():
        model.layer7.weight.mul_(2)  # in place, not through .data: the tensor's version counter moves
    try:
        path = pending.wait()
    except ckpt.CheckpointError as e:
        result["in_place"] = {"error": str(e)}
    else:
        differ, worst = compare(want, state_of(*resumed(path, build, make_optimizer)))
        result["in_place"] = {"error": None, "differ": differ, "max_abs": worst}
    ckpt.close()
    return result


class LogitScale(nn.Module):
    """CLIP's shape of model: a 0-dim parameter (the logit scale) beside a matrix."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    def forward(self, x):
        return self.proj(x) * self.logit_scale.exp()


def scenario_zero_dim(d, device):
    """(c) Adam (default; fused) on a model with a 0-dim parameter, saved (sync; async), loaded into a fresh copy."""
    x, cases = torch.randn(8, 32, device=device), []

    def build():
        return LogitScale().to(device)

    def loss(model):
        return model(x).square().mean()

    def adam(options):  # what makes this Adam for a model
        return lambda model: torch.optim.Adam(model.parameters(), lr=1e-2, **options)

    for i, (options, async_save) in enumerate([(o, a) for o in ({}, {"fused": True}) for a in (False, True)]):
        make_optimizer = adam(options)
        torch.manual_seed(0)
        model = build()
        optimizer = make_optimizer(model)
        for _ in range(3):
            optimizer.zero_grad()
            loss(model).backward()
            optimizer.step()
        want = state_of(model, optimizer)
        kept = {name: str(optimizer.state[p]["step"].device) for name, p in model.named_parameters()}  # Adam's own
        saved = ckpt.save(os.path.join(d, f"ckpt-{i}"), 3, model, optimizer, async_save=async_save)
        model2, optimizer2 = resumed(saved.wait() if async_save else saved, build, make_optimizer)
        differ, worst = compare(want, state_of(model2, optimizer2))
        devices = {name: {"param": str(p.device), "step": str(optimizer2.state[p]["step"].device),
                          "step_kept": kept[name], "exp_avg": str(optimizer2.state[p]["exp_avg"].device)}
                   for name, p in model2.named_parameters()}
        optimizer.zero_grad()
        loss(model).backward()
        for p, p2 in zip(model.parameters(), model2.parameters()):
            p2.grad = p.grad.clone()  # the same gradients: only the optimizers' state can make the steps differ
        try:
            optimizer.step()
            optimizer2.step()
            differ_after, worst_after = compare(state_of(model, optimizer), state_of(model2, optimizer2))
        except RuntimeError as e:  # Adam refusing a state on the wrong device: recorded, the other cases still run
            differ_after, worst_after = [f"the step after load() failed: {e}"], float("nan")
        cases.append({"options": options, "async": async_save, "devices": devices, "differ": differ,
                      "max_abs": worst, "differ_after_step": differ_after, "max_abs_after_step": worst_after})
    ckpt.close()
    return {"cases": cases}


def scenario_fsdp_save(d, device):
    """(d) train_fsdp.py's model under FSDP2 on the GPU (NCCL, world of one), three AdamW steps, ckpt.save(); its
    weights, gathered whole from model.state_dict() (not ckpt's code), go to d/weights.pt."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        args = train_fsdp.get_args(SMALL + ["--dropout", "0"])
        model, samples = train_fsdp.build_model(args, device), train_fsdp.Samples(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        for step in range(3):
            inputs, labels = (torch.stack(t).to(device) for t in zip(*(samples[step * 8 + i] for i in range(8))))
            F.cross_entropy(model(inputs).float().view(-1, args.vocab_size), labels.reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        weights = {name: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for name, v in
                   model.state_dict().items()}
        meta = {"model_config": train_fsdp.hf_config(args)}  # consolidate.py writes it as config.json
        path = ckpt.save(os.path.join(d, "ckpt"), 3, model, optimizer, meta=meta)
        torch.save(weights, os.path.join(d, "weights.pt"))
        return {"checkpoint": path, "tensors": len(weights)}
    finally:
        ckpt.close()
        dist.destroy_process_group()


SCENARIOS = {"async": scenario_async, "zero_dim": scenario_zero_dim, "fsdp_save": scenario_fsdp_save}


def scenario(name, d, timeout=300):
    """Run this file's scenario `name` in a fresh process, killed after timeout seconds; its result."""
    run([sys.executable, os.path.abspath(__file__), name, str(d)], timeout=timeout)
    with open(os.path.join(d, "result.json")) as f:
        return json.load(f)


# ---- the tests ----

@pytest.mark.parametrize("flags", [[], ["--args=--async-save"]], ids=["sync", "async"])
def test_resume_on_cuda(tmp_path, flags):
    """test_resume.py's bit-exact resume, one rank on the GPU (NCCL, bf16 autocast, SDPA, the CUDA generator): losses
    and every key of the final checkpoints equal. Guards against a resume that is exact on CPU and not on CUDA (a
    generator left out, state restored to another device). Its negative controls are left out: they launch 2 ranks
    whatever --nproc, which a one-GPU machine cannot, and CI runs them on CPU."""
    basetemp = tmp_path / "pytest"
    cmd = [sys.executable, "test_resume.py", "--nproc", "1", *flags, "-k", "test_resume_is_bit_exact",
           f"--basetemp={basetemp}"]
    _, out = run(cmd, timeout=900)
    figures = [line.strip() for line in out.splitlines() if line.startswith(("resumed at", "final checkpoints"))]
    print(f"\ntest_resume.py --nproc 1 {' '.join(flags)}:\n  " + "\n  ".join(figures))
    assert re.search(r"\b1 passed\b", out) and len(figures) == 2, out[-3000:]
    assert re.search(r"final checkpoints of step \d+: \d+ keys, 0 differ", figures[1]), figures[1]
    keys = ckpt.read_metadata(ckpt.find_checkpoint(str(basetemp / "reference0" / "ckpt"))).state_dict_metadata
    assert any(key.startswith("rank.0.extra.rng.cuda") for key in keys), "no CUDA generator saved: not on the GPU?"


@pytest.fixture(scope="module")
def async_result(tmp_path_factory):
    return scenario("async", tmp_path_factory.mktemp("async"))


def test_async_save_then_step(async_result):
    """An optimizer step right after save(async_save=True), then three more: the committed checkpoint equals the state
    at save(), bit for bit, on the first save (host buffers made) and the next (reused). Guards against a copy to
    host memory still running on its stream when the step writes the parameters and moments: a torn checkpoint."""
    for save in async_result["saves"]:
        print(f"\nasync save of step {save['step']}: {save['keys']} values, {len(save['differ'])} differ, "
              f"max |d| = {save['max_abs']:.3e}; the 4 steps after save() moved the weights by max |d| = "
              f"{save['moved']:.3e}")
        assert save["moved"] > 0, "the steps after save() changed nothing: the test would prove nothing"
        assert not save["differ"] and save["max_abs"] == 0, f"the checkpoint is not the state at save(): {save}"
    print(f"host memory of the copies page-locked: {async_result['page_locked']}")
    assert async_result["page_locked"], "a copy into pageable memory blocks the host: the loop waits for it"


def test_in_place_write_after_async_save(async_result):
    """`with torch.no_grad(): weight.mul_(2)` right after save(async_save=True): the save fails with a CheckpointError
    naming the key, or the checkpoint equals the state at save(). Guards against a write between save() and the end
    of its copy (an EMA swap, a weight edit: no optimizer step to wait) landing in the checkpoint silently."""
    in_place = async_result["in_place"]
    if in_place["error"] is not None:
        print(f"\nin-place write after save(): the save failed: {in_place['error']}")
        assert "layer7.weight" in in_place["error"], f"the error does not name the key written: {in_place}"
    else:
        print(f"\nin-place write after save(): committed, {len(in_place['differ'])} values differ from the state "
              f"at save(), max |d| = {in_place['max_abs']:.3e}")
        assert not in_place["differ"], f"the write landed in the checkpoint: {in_place['differ']}"


def test_zero_dim_parameter_state_devices(tmp_path):
    """Adam on a model with a 0-dim parameter (a logit scale), default and fused, saved sync and async, loaded into a
    fresh model: each parameter's `step` is where Adam keeps it (the CPU unless fused or capturable: the
    parameter's device) and exp_avg on the parameter's device; the state equals the saved one and one more step from
    the same gradients equals the original's, bit for bit. Guards against a 0-dim `step`, laid out like its
    parameter, read back onto the GPU (or the CPU) against Adam's rule: another kernel path, or a failed step."""
    for case in scenario("zero_dim", tmp_path)["cases"]:
        where = "; ".join(f"{name}: step on {d['step']} (Adam keeps it on {d['step_kept']}), exp_avg on {d['exp_avg']}"
                          for name, d in case["devices"].items())
        print(f"\nAdam({case['options']}), {'async' if case['async'] else 'sync'} save: {where}; max |d| after load "
              f"{case['max_abs']:.3e}, after one more step {case['max_abs_after_step']:.3e}")
        on_param_device = case["options"].get("fused") or case["options"].get("capturable")
        for name, d in case["devices"].items():
            assert d["step"] == d["step_kept"] == (d["param"] if on_param_device else "cpu"), f"{name}'s step: {d}"
            assert d["exp_avg"] == d["param"], f"{name}'s exp_avg: {d}"
        assert not case["differ"] and case["max_abs"] == 0, f"loaded state differs: {case}"
        assert not case["differ_after_step"] and case["max_abs_after_step"] == 0, f"the next step differs: {case}"


def test_consolidate_cuda_saved_checkpoint(tmp_path):
    """consolidate.py, with no GPU visible (CUDA_VISIBLE_DEVICES=""), on a checkpoint saved from an FSDP2 model on the
    GPU: every weight equals the model's own (model.state_dict(), gathered whole), bit for bit. Guards against a
    GPU-saved checkpoint that needs a GPU to export (tensors pickled with their CUDA device), or exports wrongly."""
    saved = scenario("fsdp_save", tmp_path)
    out = tmp_path / "hf"
    run([sys.executable, "consolidate.py", saved["checkpoint"], str(out), "--quiet"], timeout=300,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    want = torch.load(tmp_path / "weights.pt")  # CPU tensors, written by the scenario a moment ago
    got = {}
    for path in sorted(glob.glob(str(out / "model*.safetensors"))):
        got.update(load_file(path))
    differ, worst = compare(want, got)
    print(f"\nconsolidated {saved['checkpoint']}: {len(got)} tensors, {len(want)} in the model, {len(differ)} differ, "
          f"max |d| = {worst:.3e}")
    assert not differ and worst == 0, f"{len(differ)} tensors differ from the model's weights: {differ[:10]}"
    assert (out / "config.json").exists(), "no config.json: the manifest's meta lost model_config"


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Run one scenario; its result goes to DIR/result.json.")
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("dir")
    p.add_argument("--device", default="cuda:0", help="cuda:0; cpu tries the scenario's logic only")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    outcome = SCENARIOS[a.scenario](a.dir, torch.device(a.device))
    with open(os.path.join(a.dir, "result.json"), "w") as f:
        json.dump(outcome, f)
