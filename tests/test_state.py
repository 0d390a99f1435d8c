"""What saves, loads: the state users hand ckpt.py, round-tripped in one process (world size 1, gloo).

Guards against checkpoints that save but never load (a OneCycleLR or a list of dicts
in `extra`, an empty dict, numpy values), values refused only at resume time, a
weights-only load that is impossible, and a fingerprint that misses misplaced data.
Multi-rank layouts are in tests/test_setups.py.

    python -m pytest -v tests/test_state.py
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckpt

np = pytest.importorskip("numpy")  # numpy is in requirements.txt (torch's object collectives need it)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    ckpt.close()
    dist.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.unused = torch.nn.Linear(4, 4)  # trainable, never gets a gradient (unless a test uses it)

    def forward(self, x, branch=False):
        return self.unused(self.body(x)) if branch else self.body(x)


def make(seed=0):
    torch.manual_seed(seed)
    model = Net()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, steps, sched=None):
    for i in range(steps):
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()


class Box:
    """An extra whose state is whatever the test puts in it."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = sd


def same(a, b):
    """Exact equality through nested containers, tensors and numpy values, types included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a).__module__ == "numpy":
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b or (a != a and b != b)


def schedulers(opt):
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    return one_cycle


def test_state_kinds_round_trip_exactly(tmp_path):
    """OneCycleLR, SequentialLR, a disabled GradScaler, empty containers, tuples, numpy values and
    non-string keys: each extra's state_dict() after load equals the one saved, types included."""
    model, opt = make()
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    train(model, opt, 3, one_cycle)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    seq = torch.optim.lr_scheduler.SequentialLR(opt2, [torch.optim.lr_scheduler.ConstantLR(opt2, total_iters=2),
                                                       torch.optim.lr_scheduler.ExponentialLR(opt2, 0.9)], [2])
    for _ in range(3):
        opt2.step()
        seq.step()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rng = np.random.default_rng(5)
    odd = Box({"empty": {}, "nested": [[], (1, 2.5, None), {"a": [True, b"x", "s"]}], 3: "int key",
               "np": np.arange(6, dtype=np.float32).reshape(2, 3), "np_scalar": np.int64(7),
               "np_rng": np.random.RandomState(3).get_state(), "gen": rng.bit_generator.state,
               "big": 2**100, "nan": float("nan"), "t": torch.arange(5), "dtype": torch.bfloat16})
    extra = {"one_cycle": one_cycle, "seq": seq, "scaler": scaler, "odd": odd}
    saved = {k: v.state_dict() for k, v in extra.items()}
    path = ckpt.save(str(tmp_path), 3, model, opt, extra)

    model2, opt_b = make(seed=1)
    one_cycle_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=0.1, total_steps=50)
    opt2_b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    seq_b = torch.optim.lr_scheduler.SequentialLR(opt2_b, [torch.optim.lr_scheduler.ConstantLR(opt2_b, total_iters=2),
                                                           torch.optim.lr_scheduler.ExponentialLR(opt2_b, 0.9)], [2])
    extra_b = {"one_cycle": one_cycle_b, "seq": seq_b, "scaler": torch.amp.GradScaler("cpu", enabled=False),
               "odd": Box({})}  # a fresh object whose state looks nothing like the saved one
    assert ckpt.load(path, model2, opt_b, extra_b) == 3
    mismatched = [k for k in saved if not same(saved[k], extra_b[k].state_dict())]
    print(f"\n{len(saved)} extras round-tripped; mismatched: {mismatched}")
    assert mismatched == []
    assert one_cycle_b.get_last_lr() == one_cycle.get_last_lr()


def test_repeated_values_are_unpickled_once(tmp_path, monkeypatch):
    """The flattened optimizer state repeats each param_group option per parameter: load() unpickles each
    distinct value once, and every key still gets its value (a copy of its own)."""
    model, opt = make()
    train(model, opt, 2)
    box = Box({"a": "same", "b": "same", "n": [2.5, 2.5, 2.5]})
    path = ckpt.save(str(tmp_path), 2, model, opt, {"box": box})
    metadata = ckpt.read_metadata(path)
    values = [k for k, m in metadata.state_dict_metadata.items() if not hasattr(m, "size")]
    real_load, calls = torch.load, []

    def counting_load(*args, **kwargs):
        calls.append(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    model2, opt2, box2 = *make(seed=1), Box({})
    assert ckpt.load(path, model2, opt2, {"box": box2}) == 2
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    groups2 = [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups]
    print(f"\n{len(values)} pickled values in the checkpoint, {len(calls)} torch.load calls in load()")
    assert groups2 == groups and box2.state_dict() == box.state_dict()
    assert len(values) >= 40 and len(calls) <= len(values) // 3


def test_unsupported_value_is_refused_at_save(tmp_path):
    """A value load() could not restore safely is refused by save(), naming the key and type; nothing is written."""
    model, opt = make()
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(str(tmp_path), 1, model, opt, {"data": Box({"it": {"pos": 3, "f": open}})})
    print(f"\n{e.value}")
    assert "extra 'data'" in str(e.value) and ".it.f" in str(e.value) and "builtin_function_or_method" in str(e.value)
    assert ckpt.committed_steps(str(tmp_path)) == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-step")]


def test_params_without_optimizer_state_stay_without(tmp_path):
    """A parameter that never had a gradient has no optimizer state after a resume, as in the
    uninterrupted run; the others are at the saved step."""
    model, opt = make()
    train(model, opt, 2)
    unused = set(model.unused.parameters())
    assert all(p not in opt.state for p in unused)
    path = ckpt.save(str(tmp_path), 2, model, opt)
    model2, opt2 = make(seed=1)
    ckpt.load(path, model2, opt2)
    stateless = [n for n, p in model2.named_parameters() if p not in opt2.state]
    steps = {float(s["step"]) for s in opt2.state.values()}
    print(f"\nwithout optimizer state after load: {stateless}; steps of the others: {steps}")
    assert stateless == ["unused.weight", "unused.bias"]
    assert steps == {2.0}


def test_parameters_at_different_steps(tmp_path):
    """A branch used only on some steps leaves its parameters at an older optimizer step; save and load accept it."""
    model, opt = make()
    train(model, opt, 2)
    model(torch.randn(2, 8), branch=True).sum().backward()  # only the once-used branch steps now
    for p in model.parameters():
        if p not in set(model.unused.parameters()):
            p.grad = None
    opt.step()
    opt.zero_grad()
    before = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters() if p in opt.state}
    path = ckpt.save(str(tmp_path), 3, model, opt)
    model2, opt2 = make(seed=1)
    ckpt.load(path, model2, opt2)
    after = {n: float(opt2.state[p]["step"]) for n, p in model2.named_parameters() if p in opt2.state}
    print(f"\nsteps before: {before}\nsteps after:  {after}")
    assert after == before and len(set(before.values())) == 2


def test_weights_only_load_and_optimizer_mismatch(tmp_path):
    """optimizer=None restores the weights; an optimizer of another kind is refused with a hint."""
    model, opt = make()
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path), 2, model, opt)
    model2, _ = make(seed=1)
    assert ckpt.load(path, model2, None) == 2
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(model.parameters(), model2.parameters()))
    print(f"\nweights-only load: max |diff| = {diff:.3e}")
    assert diff == 0
    model3, _ = make(seed=1)
    sgd = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointError, match="optimizer=None"):
        ckpt.load(path, model3, sgd)


def test_fingerprint_sees_position_and_ignores_layout():
    """The fingerprint is the same however a tensor is cut into shards, and changes when two rows
    swap or a shard lands at the wrong offset (a plain sum would not see either)."""
    t = torch.randn(6, 5)
    whole = ckpt._weighted_sum(t, (0, 0))
    rows = (ckpt._weighted_sum(t[:4], (0, 0)) + ckpt._weighted_sum(t[4:], (4, 0))) % ckpt._P
    cols = (ckpt._weighted_sum(t[:, :2], (0, 0)) + ckpt._weighted_sum(t[:, 2:], (0, 2))) % ckpt._P
    swapped = ckpt._weighted_sum(t[[1, 0, 2, 3, 4, 5]], (0, 0))
    shifted = (ckpt._weighted_sum(t[:4], (2, 0)) + ckpt._weighted_sum(t[4:], (0, 0))) % ckpt._P
    flipped = t.clone()
    flipped.view(torch.int32)[3, 3] ^= 1
    print(f"\nwhole {whole}, by rows {rows}, by columns {cols}; swapped rows {swapped}, misplaced shard {shifted}, "
          f"one bit {ckpt._weighted_sum(flipped, (0, 0))}")
    assert whole == rows == cols
    assert len({whole, swapped, shifted, ckpt._weighted_sum(flipped, (0, 0))}) == 4
    # The definition, element by element: bits * (1 + sum of global coordinates), modulo the prime.
    bits = t.view(torch.int32).to(torch.int64)
    rows, cols = torch.arange(6)[:, None] + 10, torch.arange(5)[None, :] + 20
    assert ckpt._weighted_sum(t, (10, 20)) == int((bits * (1 + rows + cols)).sum() % ckpt._P)
    big = torch.randn(3_000_000)  # several blocks of the chunked sum, 1-D
    assert ckpt._weighted_sum(big, (0,)) == (ckpt._weighted_sum(big[:1_234_567], (0,)) +
                                             ckpt._weighted_sum(big[1_234_567:], (1_234_567,))) % ckpt._P


def test_misuse_is_named_with_its_fix(tmp_path):
    """Two mistakes a new user makes, each refused with a message that says what to do: an LR scheduler
    built after load() (the optimizer lacks the 'initial_lr' the checkpoint has), and a plain value
    as an extra (nothing to restore it in place)."""
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)  # adds initial_lr to the param_groups
    train(model, opt, 2, sched)
    ckpt.save(str(tmp_path / "a"), 2, model, opt, {"sched": sched})
    fresh, fresh_opt = make(1)  # its scheduler is built only after the load
    with pytest.raises(ckpt.CheckpointError) as late:
        ckpt.load(str(tmp_path / "a"), fresh, fresh_opt)
    with pytest.raises(ckpt.CheckpointError) as plain:
        ckpt.save(str(tmp_path / "b"), 2, model, opt, {"position": {"epoch": 3}})
    print(f"\nscheduler after load: {str(late.value)[-160:]}\nplain extra: {plain.value}")
    assert "initial_lr" in str(late.value) and "create schedulers before load()" in str(late.value)
    assert "extra 'position' is a dict" in str(plain.value) and "state_dict()" in str(plain.value)
    assert ckpt.committed_steps(str(tmp_path / "b")) == []


def test_file_systems_that_cannot_map_files(tmp_path, monkeypatch):
    """save() checksums the blocks it has just written through a mapping; where mmap fails (some FUSE
    mounts), it reads them instead: the same checksums, a checkpoint that loads, a damaged one refused."""
    model, opt = make()
    train(model, opt, 2)
    mapped = ckpt.save(str(tmp_path / "mapped"), 2, model, opt)

    refused = []

    def no_mmap(*args, **kwargs):
        refused.append(args[1:])
        raise OSError(19, "No such device")  # what mmap says on a file system without it

    monkeypatch.setattr(ckpt.mmap, "mmap", no_mmap)
    path = ckpt.save(str(tmp_path / "read"), 2, model, opt)
    files = ckpt.read_manifest(path)["files"]
    by_read = {n: ckpt._checksum(os.path.join(path, n)) for n in files}
    assert {n: f[ckpt.CHECKSUM] for n, f in files.items()} == by_read
    data_files = [n for n in files if n.endswith(".distcp")]  # .metadata holds the save's id: it differs
    assert [ckpt.read_manifest(mapped)["files"][n][ckpt.CHECKSUM] for n in data_files] == \
        [by_read[n] for n in data_files]
    fresh, fresh_opt = make(seed=1)
    assert ckpt.load(path, fresh, fresh_opt) == 2
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(model.parameters(), fresh.parameters()))
    data = data_files[0]
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, data)) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ckpt.CheckpointError, match="checksum") as damaged:
        ckpt.load(path, fresh, fresh_opt)
    print(f"\nwithout mmap ({len(refused)} blocks read instead): {len(files)} files, checksums as by read(); "
          f"max |diff| after load = {diff:.3e}; damaged: {str(damaged.value)[:120]}")
    assert diff == 0 and len(refused) == 2  # the data block and .metadata; load() reads, it does not map


def test_blocks_read_ahead_and_checked_in_order(tmp_path, monkeypatch):
    """load() reads the blocks after the current one in a thread and CRCs them in another: with blocks
    of one page (so that a small model spans ~100) and reads delayed at random, every value arrives
    exactly, a flipped byte far into the file is refused at its block, and no thread outlives the load."""
    import mmap
    import random
    import threading
    import time

    monkeypatch.setattr(ckpt, "BLOCK", mmap.ALLOCATIONGRANULARITY)  # part of the format: same for save and load
    read_block, checked = ckpt._read_block, []

    def slow_read(f, b, buf):
        time.sleep(random.random() * 0.002)  # the CRC thread must wait for its block, whatever the order
        return read_block(f, b, buf)

    def crc_when_read(read, buf):
        checked.append(1)
        return crc(read, buf)

    crc = ckpt._crc_when_read
    monkeypatch.setattr(ckpt, "_read_block", slow_read)
    monkeypatch.setattr(ckpt, "_crc_when_read", crc_when_read)

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 8))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)
    for _ in range(2):
        model(torch.randn(4, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    path = ckpt.save(str(tmp_path / "ckpt"), 2, model, opt)
    fresh, fresh_opt = build(1)
    assert ckpt.load(path, fresh, fresh_opt) == 2
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(model.parameters(), fresh.parameters()))
    moments = max((opt.state[a][k].full_tensor() - fresh_opt.state[b][k].full_tensor()).abs().max().item()
                  for a, b in zip(model.parameters(), fresh.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    data = next(n for n in ckpt.read_manifest(path)["files"] if n.endswith(".distcp"))
    blocks = len(ckpt.read_manifest(path)["files"][data][ckpt.CHECKSUM])
    ahead = len(checked)

    at = os.path.getsize(os.path.join(path, data)) * 3 // 4
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ckpt.CheckpointError, match=f"checksum at block {at // ckpt.BLOCK} ") as damaged:
        ckpt.load(path, fresh, fresh_opt)
    left = [t.name for t in threading.enumerate() if t.name.startswith(("ckpt-read", "ckpt-crc"))]
    print(f"\n{blocks} blocks of {ckpt.BLOCK} B, {ahead} read ahead; max |diff| params {diff:.3e}, "
          f"Adam moments {moments:.3e}; byte {at} flipped: {str(damaged.value)[:140]}; threads left: {left}")
    assert diff == 0 and moments == 0 and blocks > 50 and ahead > blocks // 2 and not left
