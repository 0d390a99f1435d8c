"""Rules that ckpt.py is told or reads from the objects' structure, never infers from names, values or history.

Each test fails on the ckpt.py before these rules (e3e4b03) and passes now:
  * a per-rank tensor in an extra whose key happens to name a parameter is refused at save (naming the key and
    the ranks), not stored once; declared ckpt.PerRank(obj) it comes back to each rank exactly;
  * a 0-dim parameter's Adam/AdamW state comes back where the optimizer itself puts it, and training goes on bit
    for bit (e3e4b03 fails this with CUDA only: on the CPU every device is the CPU);
  * containers load() would not give back as they were (a namedtuple, a defaultdict) are refused at save by path
    and type; an OrderedDict comes back an OrderedDict;
  * an edited manifest, a step directory renamed, a corrupted .metadata: refused by checksum or step, before any
    unpickling;
  * a resume at another number of pipeline stages is refused before anything is read; a weights-only load works;
  * an async save's checkpoint is the state at save(), whatever the optimizer or the user writes right after it.

The 2-rank parts run in ONE job, tests/explicit_job.py (ranks forked by tests/launch.py), started as the module
starts; the single-process parts run here, without a process group (a world of one), meanwhile.

    python -m pytest -q -s tests/test_explicit.py
"""

import collections
import json
import os
import shutil
import threading
import time

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests import explicit_job
from tests.state_job import Box
from tests.harness import REPO, scenarios_result

JOB = os.path.join(REPO, "tests", "explicit_job.py")


@pytest.fixture(scope="module", autouse=True)
def job_launch(request, tmp_path_factory):
    """tests/explicit_job.py, started at once (if a selected test needs it): its ranks run while the
    single-process tests do."""
    yield from launch.module_job(request, tmp_path_factory, JOB)


@pytest.fixture(scope="module")
def job(job_launch):
    """{scenario: [rank 0's figures, rank 1's figures]} of tests/explicit_job.py."""
    t0 = time.monotonic()
    rc, out = job_launch["job"].wait(timeout=240)
    result = scenarios_result(out, "explicit_job.py", f"exit {rc} (exit codes {job_launch['job'].rcs}), waited "
                              f"{time.monotonic() - t0:.1f} s for it")
    return dict(result, out_dir=str(job_launch["dir"] / "out"))


def scenario(job, name):
    ranks = job[name]
    for r, res in enumerate(ranks):
        assert "unexpected" not in res, f"scenario {name} on rank {r}: {res['unexpected']}\n{res.get('trace', '')}"
    return ranks


@pytest.fixture
def plain():
    """A test in this process without a process group: ckpt's world of one; its claims and resumes forgotten after."""
    yield
    ckpt.close()


# ------------------------------------------------------------------------------------------ one process


class Scaled(torch.nn.Module):
    """CLIP's logit scale: a 0-dim parameter beside a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))

    def forward(self, x):
        return self.lin(x) * self.logit_scale.exp()


def scaled_steps(model, opt, steps, first):
    losses = []
    for i in range(first, first + steps):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i)).to(model.logit_scale.device)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("kind", [torch.optim.Adam, torch.optim.AdamW], ids=lambda k: k.__name__)
def test_zero_dim_parameter_state_placed_as_the_optimizer_places_it(tmp_path, plain, kind, device):
    """A 0-dim parameter (a logit scale) trained with Adam or AdamW: its `step` is a 0-dim tensor too, so laying
    state out by the parameter's shape cannot tell them apart. After save and load into a fresh model, each
    parameter's state is where the optimizer itself keeps it (`step` on the CPU, exp_avg on the parameter's
    device: compared with a fresh optimizer that took one step), of its dtype and shape, equal to what was saved;
    3 further steps equal the uninterrupted run bit for bit. On the CPU every device is the CPU, so e3e4b03 (which
    put `step` on the parameter's device) passes there; with CUDA it fails (`step` on cuda, Adam keeps it on the
    CPU)."""
    torch.manual_seed(0)
    model = Scaled().to(device)
    opt = kind(model.parameters(), lr=1e-2)
    scaled_steps(model, opt, 2, 0)
    saved = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    path = ckpt.save(str(tmp_path), 2, model, opt)
    ref = scaled_steps(model, opt, 3, 2)

    torch.manual_seed(1)
    fresh = Scaled().to(device)
    fresh_opt = kind(fresh.parameters(), lr=1e-2)
    assert ckpt.load(path, fresh, fresh_opt) == 2
    torch.manual_seed(2)
    probe = Scaled().to(device)
    probe_opt = kind(probe.parameters(), lr=1e-2)
    scaled_steps(probe, probe_opt, 1, 0)

    def where(m, o):
        return {n: {k: (str(v.device), str(v.dtype), tuple(v.shape)) for k, v in o.state[p].items()}
                for n, p in m.named_parameters()}

    loaded, own = where(fresh, fresh_opt), where(probe, probe_opt)
    differ = [f"{n}.{k}" for n, p in fresh.named_parameters() for k, v in fresh_opt.state[p].items()
              if not torch.equal(v, saved[n][k])]
    resumed = scaled_steps(fresh, fresh_opt, 3, 2)
    print(f"\n{kind.__name__} on {device}: state after load {loaded['logit_scale']} (logit_scale); "
          f"{kind.__name__}'s own after a step {own['logit_scale']}; differ from saved: {differ}; "
          f"losses {ref} uninterrupted, {resumed} resumed")
    assert loaded == own
    for n, p in fresh.named_parameters():
        assert fresh_opt.state[p]["step"].device == torch.device("cpu")
        assert fresh_opt.state[p]["exp_avg"].device == p.device
    assert loaded["logit_scale"]["step"][2] == () and loaded["logit_scale"]["exp_avg"][2] == ()
    assert differ == []
    assert resumed == ref
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert fresh.logit_scale.device.type == device


Point = collections.namedtuple("Point", "x y")


def test_tensor_options_and_a_root_claimed_without_a_lock(tmp_path, plain):
    """An optimizer option that is a tensor (lr=torch.tensor(...), as torch.compile'd steps use) comes back a
    tensor equal to the saved one, and the next step() runs (a placeholder string in its place broke it); a root
    claimed with lock=False is claimed again by a later check_root() (not refused as unseen storage)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt.check_root(tmp_path / "root", model, lock=False)
    ckpt.check_root(tmp_path / "root", model)  # the claim stands: no lock now either
    ckpt.save(tmp_path / "root", 1, model, opt)
    ckpt.close()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=torch.tensor(0.5), foreach=False)
    assert ckpt.load(tmp_path / "root", fresh, fresh_opt) == 1
    lr = fresh_opt.param_groups[0]["lr"]
    print(f"\nlr after load: {lr!r}; root holds {sorted(os.listdir(tmp_path / 'root'))}")
    assert isinstance(lr, torch.Tensor) and lr.item() == opt.param_groups[0]["lr"].item()
    fresh(torch.randn(4, 3)).sum().backward()
    fresh_opt.step()


def test_async_save_keeps_a_tensor_option_as_at_save(tmp_path, plain, monkeypatch):
    """A tensor inside a value (lr=torch.tensor(...), which an LR scheduler updates in place with fill_) is pickled
    at the write, in the background: an async save must write the option as it was at save(), not as it is when
    the writer gets to it. The write is held until three steps and scheduler steps (lr halved each) went by."""
    gate, real_write = threading.Event(), dcp.FileSystemWriter.write_data
    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", lambda *a: gate.wait(60) and real_write(*a))

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(model, opt, sched):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()

    model, opt, sched = build()
    step(model, opt, sched)
    at_save = opt.param_groups[0]["lr"].item()
    pending = ckpt.save(tmp_path / "root", 1, model, opt, {"sched": sched}, async_save=True)
    for _ in range(3):
        step(model, opt, sched)
    gate.set()
    pending.wait()
    fresh, fresh_opt, fresh_sched = build()
    ckpt.load(tmp_path / "root", fresh, fresh_opt, {"sched": fresh_sched})
    loaded = fresh_opt.param_groups[0]["lr"].item()
    print(f"\nlr at save {at_save}, after 3 more steps {opt.param_groups[0]['lr'].item()}, loaded {loaded}; "
          f"scheduler's last lr loaded {fresh_sched.get_last_lr()}")
    assert at_save == pytest.approx(0.005) and opt.param_groups[0]["lr"].item() == pytest.approx(0.000625)
    assert loaded == at_save and [float(lr) for lr in fresh_sched.get_last_lr()] == [at_save]


def test_only_exact_containers(tmp_path, plain):
    """A namedtuple would come back a tuple, a defaultdict a dict (its factory lost): save() refuses each, naming
    its path and type, and writes nothing. An OrderedDict (at the top of the state and nested, holding a tensor)
    comes back an OrderedDict, its keys in order, equal."""
    model = torch.nn.Linear(2, 2)
    refused = {}
    for name, state in {"namedtuple": {"pos": Point(1, 2)},
                        "defaultdict": {"pos": {"seen": collections.defaultdict(int, a=1)}}}.items():
        try:
            ckpt.save(str(tmp_path / name), 1, model, None, {"data": Box(state)})
            refused[name] = f"saved: {ckpt.committed_steps(str(tmp_path / name))}"
        except ckpt.CheckpointError as e:
            refused[name] = str(e)
            assert ckpt.committed_steps(str(tmp_path / name)) == []
    print("\n" + "\n".join(f"{name}: {msg[:200]}" for name, msg in refused.items()))
    assert "extra.data.pos is a tests.test_explicit.Point" in refused["namedtuple"]
    assert "extra.data.pos.seen is a collections.defaultdict" in refused["defaultdict"]
    state = collections.OrderedDict([("z", 1), ("a", collections.OrderedDict([("t", torch.arange(3)), ("b", 2)]))])
    path = ckpt.save(str(tmp_path / "ordered"), 1, model, None, {"data": Box(state)})
    back = Box({})
    ckpt.load(path, model, None, {"data": back})
    got = back.state
    print(f"OrderedDict back: {type(got).__name__} {list(got)}, inner {type(got['a']).__name__} {list(got['a'])}")
    assert type(got) is collections.OrderedDict and list(got) == ["z", "a"] and got["z"] == 1
    assert type(got["a"]) is collections.OrderedDict and list(got["a"]) == ["t", "b"] and got["a"]["b"] == 2
    assert torch.equal(got["a"]["t"], torch.arange(3))


def test_tampered_checkpoints_are_refused(tmp_path, plain):
    """A committed step 2, then three copies of it: (1) its manifest's step edited to 7, valid JSON: refused, the
    manifest does not match its own checksum; (2) the directory renamed step-00000007, its manifest kept: refused,
    the manifest is step 2's; (3) one byte of .metadata flipped: refused naming .metadata's checksum, before it
    is unpickled (no unpickler's error in the message). Each refusal leaves the model as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    good = ckpt.save(str(tmp_path / "good"), 2, model, opt)
    cases = {}
    for case in ("edited", "renamed", "metadata"):
        root = tmp_path / case
        name = "step-00000007" if case == "renamed" else "step-00000002"
        shutil.copytree(good, root / name)
        if case == "edited":
            path = root / name / ckpt.MANIFEST
            manifest = json.loads(path.read_text())
            manifest["step"] = 7
            path.write_text(json.dumps(manifest))
        elif case == "metadata":
            path = root / name / ".metadata"
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        torch.manual_seed(1)
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        before = [p.detach().clone() for p in fresh.parameters()]
        try:
            cases[case] = f"loaded, step {ckpt.load(str(root), fresh, torch.optim.AdamW(fresh.parameters()))}"
        except ckpt.CheckpointError as e:
            cases[case] = str(e)
            assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters())), f"{case}: the model changed"
    print("\n" + "\n".join(f"{case}: ...{msg.split('refusing to load a damaged checkpoint: ')[-1][-230:]}"
                            for case, msg in cases.items()))
    assert "manifest.json does not match its own checksum (edited or corrupted)" in cases["edited"]
    assert "is the manifest of step 2, not of" in cases["renamed"] and "step-00000007's step" in cases["renamed"]
    assert ".metadata does not match its checksum (corrupted)" in cases["metadata"]
    for noise in ("Memo value", "Unpickling", "pickle", "cannot be read safely"):
        assert noise not in cases["metadata"], f"{noise!r} in {cases['metadata']}"


# ------------------------------------------------------------------------------------------ 2 ranks


def test_per_rank_tensor_under_a_parameter_name(job):
    """A per-rank tensor (a residual, each rank's own) in an extra, under the key "0.weight", which names a
    parameter of the DDP-style plain model: the old rule took a tensor named like a parameter for the parameter's
    (equal on every rank, stored once), so rank 0 read back rank 1's 1.0. Now it is compared like any value stored
    once and refused at save, on every rank, naming the key and the ranks on each side, nothing committed; declared
    ckpt.PerRank(obj) it is stored per rank and each rank reads back its own value exactly."""
    res = scenario(job, "per_rank_tensor")
    for r, x in enumerate(res):
        u = x["undeclared"]
        print(f"\nrank {r}: undeclared: {u['raised']}: {u['msg'][:230]}; root {u['listing']}\n"
              f"rank {r}: declared PerRank: keys {x['keys']}; read back {x['type']} of values {x['values']}")
        assert u["raised"] == "CheckpointError", u
        assert "extra.resid.0.weight (ranks 0 | 1)" in u["msg"], u["msg"]
        assert "ckpt.PerRank(obj)" in u["msg"], u["msg"]
        assert u["committed"] == [] and not [n for n in u["listing"] if n.startswith(ckpt.TMP)], u["listing"]
        assert x["keys"] == ["rank.0.extra.resid", "rank.0.extra.resid.0.weight", "rank.1.extra.resid",
                             "rank.1.extra.resid.0.weight"]
        assert x["loaded"] == 1 and x["type"] == "Tensor" and x["values"] == [float(r)] and x["exact"]


def test_resume_at_another_number_of_stages_is_refused(job, plain):
    """2 ranks each held half the layers of one model (two pipeline stages) with AdamW; the checkpoint is resumed
    here by one process holding every layer with its optimizer: param groups and stage state would be split
    otherwise, so load() refuses before anything is read, naming the parameters the one process's param group
    holds and the saved group it matched does not (the other stage's), and pipeline stages; the model and
    optimizer are untouched. A weights-only load of the same checkpoint works, and its weights equal the saved
    ones exactly."""
    res = scenario(job, "stages")
    path = res[0]["path"]
    print(f"\nsaved by 2 ranks: rank 0 held {res[0]['params']}, rank 1 {res[1]['params']}")
    saved = torch.load(os.path.join(job["out_dir"], "stages_ref.pt"), weights_only=True)
    torch.manual_seed(5)
    model = explicit_job.Layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(path, model, opt)
    untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters()) and not opt.state
    print(f"resumed by 1 process: {str(e.value)[:300]}\nmodel and optimizer untouched: {untouched}")
    other = [n for n in res[1]["params"] if n not in res[0]["params"]]  # the second stage's, which rank 0 lacked
    assert "does not hold the parameters its saved group held" in str(e.value), e.value
    assert "pipeline stages" in str(e.value) and all(n in str(e.value) for n in other[:3]), e.value
    assert untouched, "the refused resume must read nothing into the model or optimizer"
    torch.manual_seed(6)
    weights = explicit_job.Layers()
    assert ckpt.load(path, weights) == 2
    diff = max((p.detach() - saved[n]).abs().max().item() for n, p in weights.named_parameters())
    print(f"weights-only load at 1 stage: {len(saved)} tensors, max |diff| vs saved {diff:.1e}")
    assert sorted(saved) == sorted(dict(weights.named_parameters())) and diff == 0.0
    assert all(torch.equal(saved[n], p) for n, p in weights.named_parameters())


def test_async_checkpoint_is_the_state_at_save(job):
    """save(async_save=True) on a 2-rank FSDP2 model copies the state to host memory beside the loop. (1) Three
    optimizer.step() calls right after save() returned: each step waits for the copy, so the committed checkpoint
    equals the snapshot taken before save() bit for bit (and not the state after the steps). (2) An in-place
    p.mul_(2) under no_grad right after save(), which no hook sees: either the save fails on every rank naming the
    written keys, nothing committed, or the copy had settled and the checkpoint equals the state at save(). (3)
    pending.wait_copy(), then the same write: always fine, the checkpoint equals the state at save()."""
    res = scenario(job, "async_steps")
    for r, x in enumerate(res):
        for part in ("steps", "in_place", "after_wait_copy"):
            assert "unexpected" not in x[part], f"rank {r}, {part}: {x[part]['unexpected']}"
        s, i, w = x["steps"], x["in_place"], x["after_wait_copy"]
        happened = (f"the save failed: {i['errors'][r][:200]}" if any(i["errors"]) else
                    f"the copy had settled: checkpoint vs state at save max |diff| {i['vs_at_save']}")
        print(f"\nrank {r}: 3 steps right after save(): {s['n']} tensors, checkpoint vs state at save max |diff| "
              f"{s['vs_at_save']}, vs state after the steps {s['vs_after']}\nrank {r}: p.mul_(2) right after "
              f"save(): {happened}; committed {i['committed']}\nrank {r}: wait_copy(), then p.mul_(2): checkpoint "
              f"vs state at save {w['vs_at_save']}, vs now {w['vs_now']}")
        assert s["n"] == 24 and s["vs_at_save"] == 0.0 and s["vs_after"] > 0
        if any(i["errors"]):
            assert all(i["errors"]), f"the save failed on some ranks only: {i['errors']}"
            for msg in i["errors"]:
                assert "were written in place while being copied to host memory" in msg and "model.a.weight" in msg
                assert "call pending.wait_copy() before writing them" in msg
            assert i["committed"] == [2] and not [n for n in i["listing"] if n.startswith(ckpt.TMP)], i["listing"]
        else:
            assert i["vs_at_save"] == 0.0 and i["committed"] == [2, 3]
        assert w["vs_at_save"] == 0.0 and w["vs_now"] > 0
    assert [bool(x["in_place"]["errors"][0]) for x in res] == [bool(res[0]["in_place"]["errors"][0])] * 2
