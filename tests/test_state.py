"""What saves, loads: the state users hand ckpt.py, in one process (world size 1, gloo) and in one 2-rank job.

Guards against checkpoints that save but never load (a OneCycleLR, a disabled GradScaler, an empty dict in
`extra`), state that comes back changed (tuples as lists, int keys as str, DTensors as plain tensors, a second
optimizer's moments lost), values refused only at resume time instead of at save, refusals that do not say what
to fix, and a save that silently rewrites or rewinds the step it continues from.

The single-process tests build a small FSDP2 model at world size 1. The 2-rank scenarios (several optimizers,
an EMA lazy or eager at load, an optimizer passed as an extra, DTensors in extras, refusals on every rank) run in
ONE 2-rank job, tests/state_job.py (ranks forked from warm processes, tests/launch.py), launched once for the
module; each test below asserts on its part of the job's RESULT line.

    python -m pytest -q -s tests/test_state.py
"""

import dataclasses
import io
import os
import time

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckpt
from tests import state_job
from tests.harness import REPO, refused_everywhere, scenarios_result

np = pytest.importorskip("numpy")  # numpy is in requirements.txt (torch's object collectives need it)

JOB = os.path.join(REPO, "tests", "state_job.py")


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to race for
    yield
    ckpt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- single process, world size 1


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
    for _ in range(steps):
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()


Box = state_job.Box


def same(a, b):
    """Exact equality through nested containers and tensors, types (of keys too) included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return [(type(k), k) for k in a] == [(type(k), k) for k in b] and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b or (a != a and b != b)


def nothing_written(root):
    """No commit and no save in progress under root (the root itself may not exist)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return ckpt.committed_steps(str(root)) == [] and not [n for n in names if n.startswith(ckpt.TMP)]


def round_trip(tmp_path, extra, fresh):
    """Save model, optimizer and extra; load into a fresh model and the `fresh` extras; {name: same?}."""
    model, opt = make()
    train(model, opt, 1)
    saved = {k: v.state_dict() for k, v in extra.items()}
    path = ckpt.save(str(tmp_path), 1, model, opt, extra)
    model2, opt2 = make(seed=1)
    assert ckpt.load(path, model2, opt2, fresh) == 1
    return {k: same(saved[k], fresh[k].state_dict()) for k in saved}, saved


def test_state_kinds_round_trip_exactly(tmp_path):
    """OneCycleLR, SequentialLR, tuples (nested, empty), lists, torch.Size/dtype/device, bytes, big ints, NaN:
    each extra's state_dict() after load equals the one saved, types included; the LR goes on where it was.
    Guards against a scheduler or data position that saves but does not load, or loads changed (a tuple as a
    list, a dtype as a string)."""
    model, opt = make()
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
    train(model, opt, 3, one_cycle)
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    seq = torch.optim.lr_scheduler.SequentialLR(opt2, [torch.optim.lr_scheduler.ConstantLR(opt2, total_iters=2),
                                                       torch.optim.lr_scheduler.ExponentialLR(opt2, 0.9)], [2])
    for _ in range(3):
        opt2.step()
        seq.step()
    odd = Box({"nested": [[1], (1, 2.5, None, ()), {"a": [True, b"x", "s"]}], "tuple": ((1, 2), ("a",)),
               "big": 2**100, "nan": float("nan"), "t": torch.arange(5), "bf16": torch.ones(2, dtype=torch.bfloat16),
               "dtype": torch.bfloat16, "size": torch.Size([3, 4]), "device": torch.device("cpu")})
    extra = {"one_cycle": one_cycle, "seq": seq, "odd": odd}
    saved = {k: v.state_dict() for k, v in extra.items()}
    path = ckpt.save(str(tmp_path), 3, model, opt, extra)

    model2, opt_b = make(seed=1)
    one_cycle_b = torch.optim.lr_scheduler.OneCycleLR(opt_b, max_lr=0.1, total_steps=50)
    opt2_b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    seq_b = torch.optim.lr_scheduler.SequentialLR(opt2_b, [torch.optim.lr_scheduler.ConstantLR(opt2_b, total_iters=2),
                                                           torch.optim.lr_scheduler.ExponentialLR(opt2_b, 0.9)], [2])
    extra_b = {"one_cycle": one_cycle_b, "seq": seq_b, "odd": Box({})}  # a fresh object, nothing like the saved one
    assert ckpt.load(path, model2, opt_b, extra_b) == 3
    mismatched = [k for k in saved if not same(saved[k], extra_b[k].state_dict())]
    one_cycle.step(), one_cycle_b.step()
    print(f"\n{len(saved)} extras round-tripped; mismatched: {mismatched}; next LR {one_cycle.get_last_lr()} vs "
          f"{one_cycle_b.get_last_lr()} (resumed)")
    assert mismatched == []
    assert one_cycle_b.get_last_lr() == one_cycle.get_last_lr()


def test_empty_state_and_non_string_keys_round_trip(tmp_path):
    """A disabled GradScaler (state_dict() is {}), empty dicts and lists, and dict keys that are int, None, bool,
    bytes: each comes back exactly. Guards against a checkpoint that saves but never loads (the empty extra's
    key missing from it) and against state that loads changed (the int keys of an optimizer's state as str)."""
    extra = {"scaler": torch.amp.GradScaler("cpu", enabled=False),
             "odd": Box({"empty": {}, "nested": {"x": {}}, "lists": [[], {}], 3: "int key",
                         "keys": {0: 1.5, None: 2, True: 3, b"k": 4}, "in_list": [{1: 2}]})}
    fresh = {"scaler": torch.amp.GradScaler("cpu", enabled=False), "odd": Box({})}
    try:
        matched, saved = round_trip(tmp_path, extra, fresh)
    except ckpt.CheckpointError as e:
        print(f"\nrefused at load: {e}")
        raise
    print(f"\nsaved {saved}\nloaded {({k: v.state_dict() for k, v in fresh.items()})}\nexact: {matched}")
    assert all(matched.values()), matched


def test_numpy_values_are_refused_at_save(tmp_path):
    """numpy arrays and scalars (also as dict keys) are refused by save(), naming the key and the type, with
    nothing written. Guards against a checkpoint that load() can only restore by unpickling numpy objects
    (running code from the file), or that fails only at resume time."""
    model, opt = make()
    cases = {".pos.array": {"pos": {"array": np.arange(6, dtype=np.float32)}},
             ".scalar": {"scalar": np.int64(7)},
             "the key": {np.int64(3): 1},
             ".float": {"float": np.float64(1.5)}}  # a float subclass: it would pickle, then load() would refuse it
    refused = {}
    for i, (where, state) in enumerate(cases.items()):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.save(str(tmp_path / str(i)), 1, model, opt, {"data": Box(state)})
        refused[where] = str(e.value)
        print(f"\n{where}: {e.value}")
        assert nothing_written(tmp_path / str(i))
    for where, msg in refused.items():
        assert where in msg and "numpy." in msg and "cannot restore without running code from the checkpoint" in msg
    assert "numpy.ndarray" in refused[".pos.array"] and "numpy.int64" in refused[".scalar"]
    assert "extra.data.pos.array" in refused[".pos.array"] and "extra.data.scalar" in refused[".scalar"]


def test_generators_are_stored_per_rank(tmp_path):
    """The random generators are stored per rank at every world size, one plain process included: each rank's
    stream is its own. Resumed at another world size they are left as each process seeded them (with a warning)
    instead of handing every rank one saved stream. Guards against identical dropout masks on every rank after
    growing a one-process run, and against a rule that guesses from the values whether streams are per rank."""
    model, opt = make()
    ckpt.save(str(tmp_path), 1, model, opt)
    keys = sorted(ckpt.read_metadata(ckpt.step_dir(str(tmp_path), 1)).state_dict_metadata)
    generators = [k for k in keys if ".rng." in k]
    print(f"\ngenerator keys at world size 1: {generators}")
    assert generators == ["rank.0.extra.rng.python", "rank.0.extra.rng.torch"]


@dataclasses.dataclass
class Config:
    scale: float = 2.0


class Stamped(torch.nn.Module):
    """A module with extra state (get_extra_state()), as some quantization and normalization layers keep."""

    def __init__(self, extra):
        super().__init__()
        self.lin, self.extra = torch.nn.Linear(4, 4), extra

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_model_extra_state_save_refuses_what_load_would(tmp_path):
    """A module's get_extra_state() returning an object (a BytesIO, a dataclass) used to save, and every checkpoint
    of the run then failed at load with torch's weights-only error; save() now refuses it naming the key, as it
    does an extra's. Plain values round-trip."""
    refused = {}
    for name, extra in {"bytesio": io.BytesIO(b"x"), "dataclass": Config()}.items():
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.save(str(tmp_path / name), 1, Stamped(extra))
        refused[name] = str(e.value)
        assert not os.path.isdir(tmp_path / name / "step-00000001")
    print("\n" + "\n".join(f"{name}: {msg[:200]}" for name, msg in refused.items()))
    assert "model._extra_state is a _io.BytesIO" in refused["bytesio"]
    assert "model._extra_state is a tests.test_state.Config" in refused["dataclass"]
    model = Stamped({"scale": 2.0, "version": 3})
    ckpt.save(str(tmp_path / "plain"), 1, model)
    back = Stamped(None)
    ckpt.load(str(tmp_path / "plain"), back)
    print(f"plain extra state back: {back.extra}")
    assert back.extra == {"scale": 2.0, "version": 3}


def test_one_model_saved_to_two_roots_in_turn(tmp_path):
    """A run that saves to fast local storage and to durable storage in turn (one model, two roots) continues from
    its last commit in each: its own commits are never taken for another run's (a forgotten resume)."""
    model, opt = make()
    saved = []
    for step in (1, 2):
        train(model, opt, 1)
        saved += [ckpt.save(str(tmp_path / root), step, model, opt) for root in ("fast", "durable")]
    print(f"\n{[os.path.relpath(p, tmp_path) for p in saved]}")
    assert [ckpt.committed_steps(str(tmp_path / root)) for root in ("fast", "durable")] == [[1, 2], [1, 2]]


def test_parameters_named_like_the_keys_parts(tmp_path):
    """A model whose parameters are named 0 and 1 (a ParameterList at the top): the key optim.0.state.1.exp_avg
    names parameter 1, not the optimizer's index 0; every tensor of a parameter's state has its own key, the step
    too. Guards against a valid optimizer refused, or its moments laid out like another parameter."""
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(3))])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sum(p.sum() for p in model).backward()
    opt.step()
    path = ckpt.save(str(tmp_path), 1, model, opt)
    keys = sorted(k for k in ckpt.read_metadata(path).state_dict_metadata if ".state." in k)
    fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(3))])
    fully_shard(fresh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load(path, fresh, fresh_opt)
    shapes = {k: tuple(v.shape) for p in fresh for k, v in fresh_opt.state[p].items() if k != "step"}
    print(f"\nkeys {keys}; moments after load {shapes}")
    assert keys == [f"optim.0.state.{i}.{k}" for i in (0, 1) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert all((a.full_tensor() == b.full_tensor()).all() for a, b in zip(model, fresh))


def test_a_bool_is_not_a_step_or_keep(tmp_path):
    """keep=True is an int to Python, and kept one step: refused, as step=True is."""
    model, opt = make()
    for kw in ({"keep": True}, {"step": True}):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.save(str(tmp_path), kw.get("step", 1), model, opt, keep=kw.get("keep"))
        print(f"\n{kw}: {e.value}")
        assert "step must be an int >= 0 and keep None or an int > 0" in str(e.value)


def test_refused_dict_key_names_its_extra(tmp_path):
    """A dict key load() could not restore (a numpy integer) is refused naming the extra, the path and the key,
    as a refused value is. Guards against a refusal that leaves the user to search every extra for the key."""
    model, opt = make()
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(str(tmp_path), 1, model, opt, {"data": Box({"pos": {np.int64(3): 1}})})
    print(f"\n{e.value}")
    assert nothing_written(tmp_path)
    assert "the key" in str(e.value) and "numpy.int64" in str(e.value)
    assert "extra.data.pos: the key" in str(e.value)


def test_unsupported_value_is_refused_at_save(tmp_path):
    """A value load() could not restore safely (a function, an object, a set) is refused by save(), naming the
    extra, the key and the type; nothing is written. Guards against finding out at resume time."""
    model, opt = make()
    cases = {".it.f": ({"it": {"pos": 3, "f": open}}, "builtin_function_or_method"),
             ".obj": ({"obj": Box()}, "Box"),
             ".seen": ({"seen": {1, 2}}, "builtins.set")}
    for i, (where, (state, kind)) in enumerate(cases.items()):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.save(str(tmp_path / str(i)), 1, model, opt, {"data": Box(state)})
        print(f"\n{where}: {e.value}")
        assert f"extra.data{where}" in str(e.value) and kind in str(e.value)
        assert nothing_written(tmp_path / str(i))


def test_params_without_optimizer_state_stay_without(tmp_path):
    """A parameter that never had a gradient has no optimizer state after a resume, as in the uninterrupted run;
    the others are at the saved step. Guards against a resume that invents zero moments (a different run)."""
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
    """A branch used only on some steps leaves its parameters at an older optimizer step; save and load accept it
    and keep each parameter's step. Guards against a resume refused, or every step reset to one value."""
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
    """optimizer=None restores the weights exactly; an optimizer of another kind is refused with the hint to pass
    optimizer=None; a checkpoint saved without optimizer state, loaded with one, says so. Guards against an
    evaluation job that cannot load a training checkpoint, and a resume that silently drops the moments."""
    model, opt = make()
    train(model, opt, 2)
    path = ckpt.save(str(tmp_path / "a"), 2, model, opt)
    model2, _ = make(seed=1)
    assert ckpt.load(path, model2, None) == 2
    diff = max((a.full_tensor() - b.full_tensor()).abs().max().item()
               for a, b in zip(model.parameters(), model2.parameters()))
    model3, _ = make(seed=1)
    sgd = torch.optim.SGD(model3.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointError) as kind:
        ckpt.load(path, model3, sgd)
    bare = ckpt.save(str(tmp_path / "b"), 2, model, None)
    with pytest.raises(ckpt.CheckpointError) as without:
        ckpt.load(bare, model3, torch.optim.AdamW(model3.parameters()))
    print(f"\nweights-only load: max |diff| = {diff:.3e}\nSGD into AdamW's: {str(kind.value)[-300:]}\n"
          f"saved without optimizer: {without.value}")
    assert diff == 0
    assert "was saved with optimizers ['AdamW'], not ['SGD']" in str(kind.value)
    assert "(to load the weights alone, pass optimizer=None)" in str(kind.value)
    assert "was saved with optimizers [], not ['AdamW']" in str(without.value)
    assert "(to load the weights alone, pass optimizer=None)" in str(without.value)


def test_load_says_what_it_found(tmp_path, caplog):
    """A root holding only an interrupted save loads nothing and says so (the .tmp- directory named, never loaded); a
    weights-only load warns about nothing it was not asked to restore; a full load names the extras left behind.
    Guards against a lost save that looks like a fresh root, and a warning that every evaluation poll repeats."""
    model, opt = make()
    train(model, opt, 1)
    os.makedirs(tmp_path / "interrupted" / ".tmp-step-00000005-0123abcd")
    with caplog.at_level("WARNING", logger="ckpt"):
        found = ckpt.load(str(tmp_path / "interrupted"), model, opt)
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        path = ckpt.save(str(tmp_path / "root"), 1, model, opt, {"sched": Box({"lr": 1})})
        ckpt.load(path, make(1)[0])
        weights_only = [r.getMessage() for r in caplog.records]
        fresh, fresh_opt = make(1)
        ckpt.load(path, fresh, fresh_opt)
        full = [r.getMessage() for r in caplog.records]
    print(f"\nroot with an interrupted save only: load -> {found}; said {said}\nweights-only load warned: "
          f"{weights_only}\nfull load without the extra: {full}")
    assert found is None and len(said) == 1 and ".tmp-step-00000005-0123abcd is an interrupted save" in said[0]
    assert weights_only == []
    assert len(full) == 1 and "extra.sched (not passed to load())" in full[0]


def test_misuse_is_named_with_its_fix(tmp_path):
    """Two mistakes a new user makes, each refused with a message that says what to do: an LR scheduler built
    after load() (the optimizer lacks the 'initial_lr' the checkpoint has), and a plain dict as an extra (nothing
    to restore it in place; refused at save, nothing written)."""
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)  # adds initial_lr to the param_groups
    train(model, opt, 2, sched)
    ckpt.save(str(tmp_path / "a"), 2, model, opt, {"sched": sched})
    fresh, fresh_opt = make(1)  # its scheduler is built only after the load
    with pytest.raises(ckpt.CheckpointError) as late:
        ckpt.load(str(tmp_path / "a"), fresh, fresh_opt)
    with pytest.raises(ckpt.CheckpointError) as plain:
        ckpt.save(str(tmp_path / "b"), 2, model, opt, {"position": {"epoch": 3}})
    print(f"\nscheduler after load: {str(late.value)[-200:]}\nplain extra: {plain.value}")
    assert "initial_lr" in str(late.value) and "create schedulers before load()" in str(late.value)
    assert "extra 'position' is a dict" in str(plain.value)
    assert "which has no state_dict() and load_state_dict()" in str(plain.value)
    assert nothing_written(tmp_path / "b")


# ------------------------------------------------------------------------------ one 2-rank job, many scenarios


@pytest.fixture(scope="module", autouse=True)
def job_launch(request, tmp_path_factory):
    """Starts tests/state_job.py as the module starts (if a selected test needs it): it runs while the
    single-process tests do."""
    wanted = any("job" in item.fixturenames for item in request.session.items if item.module is request.module)
    if not wanted:
        yield None
        return
    d = tmp_path_factory.mktemp("state_job")
    job = launch.start([JOB, d / "work", d / "out"], out=d / "output.txt")
    state = {"dir": d, "job": job, "launched": {}}
    yield state
    collect(state)  # no test waited for it (one failed first): it ends here, within its time limit


def collect(state):
    """The job's exit code, output and seconds, once it has ended (killed 240 s after its start)."""
    launched, job = state["launched"], state["job"]
    if "out" not in launched:
        try:
            launched["rc"], launched["out"] = job.wait(timeout=240)
        except AssertionError as e:  # killed at its time limit
            launched["rc"], launched["out"] = None, str(e)
        launched["secs"] = time.monotonic() - job.t0
    return launched


@pytest.fixture(scope="module")
def job(job_launch):
    """tests/state_job.py once, at world size 2; {scenario: [rank 0's figures, rank 1's figures]}."""
    d, launched = job_launch["dir"], collect(job_launch)
    rc, out = launched["rc"], launched["out"]
    result = scenarios_result(out, "state_job.py",
                              f"exit {rc} after {launched['secs']:.1f} s (launched as the module started)")
    # Every scenario's figures are in the RESULT line, printed before the teardown: an exit status other than 0
    # after it is torch's gloo teardown abort (README "A clean exit"), reported here, not a scenario failing.
    if rc != 0:
        print(f"state_job.py exited {rc} after printing its RESULT:\n{out[-2000:]}")
    return dict(result, out_dir=str(d / "out"))


def scenario(job, name):
    """Both ranks' figures of one scenario; a scenario that raised unexpectedly fails here, by name."""
    ranks = job[name]
    for r, res in enumerate(ranks):
        assert "unexpected" not in res, f"scenario {name} on rank {r}: {res['unexpected']}\n{res.get('trace', '')}"
    return ranks


def test_several_optimizers_resume_bit_exact(job):
    """optimizer=[Muon on the weight matrices, AdamW on the rest]: a fresh model and optimizers loaded from the
    checkpoint hold the saved state (each optimizer its own keys) and continue N steps with the same losses, to
    the bit. Guards against the second optimizer's state dropped, or given to the first's parameters."""
    for r, res in enumerate(scenario(job, "multi_opt")):
        print(f"\nrank {r}: loaded step {res['loaded']}; state kinds {res['kinds']}; max |d state| after load "
              f"{res['moments_diff_after_load']}; max |dloss| over {len(res['losses'])} steps {res['dloss']}; "
              f"max |d weights| at the end {res['weights_diff_end']}")
        assert res["loaded"] == state_job.N
        assert res["kinds"] == {"Muon": ["momentum_buffer"], "AdamW": ["exp_avg", "exp_avg_sq", "step"]}
        assert res["state_keys"] == res["saved_keys"] and len(res["saved_keys"]) == 14
        assert res["moments_diff_after_load"] == 0
        assert len(res["resumed"]) == state_job.N and res["dloss"] == 0 and res["weights_diff_end"] == 0


def test_several_optimizers_load_at_world_size_1(job):
    """The [Muon, AdamW] checkpoint written by 2 ranks loads here at world size 1: every parameter, momentum
    buffer and Adam moment equals the full tensor saved, exactly. Guards against a multi-optimizer checkpoint
    that cannot be resharded (a smaller resume, an evaluation job)."""
    ref = torch.load(os.path.join(job["out_dir"], "multi_opt_ref.pt"), weights_only=True)
    model = state_job.build(seed=1)
    opts = state_job.muon_adamw(model)
    assert ckpt.load(job["multi_opt"][0]["path"], model, opts) == state_job.N
    names = {p: n for n, p in model.named_parameters()}
    state = {f"{names[p]}.{k}": v for opt in opts for p, s in opt.state.items() for k, v in s.items()}
    params = {n: p for n, p in model.named_parameters()}
    d_state = {k: (state_job.full(state[k]) - ref["state"][k]).abs().max().item() for k in sorted(ref["state"])}
    d_params = {n: (state_job.full(params[n]) - ref["params"][n]).abs().max().item() for n in ref["params"]}
    print(f"\nworld size 1: {len(state)} state tensors, {len(params)} parameters; max |diff| state "
          f"{max(d_state.values())}, parameters {max(d_params.values())}; mesh {model.a.weight.device_mesh}")
    assert sorted(state) == sorted(ref["state"])
    assert max(d_state.values()) == 0 and max(d_params.values()) == 0


def test_ema_comes_back_into_its_own_dtensors(job):
    """An EMA of the sharded parameters (DTensors), saved by a run that built it lazily. Resumed into a lazy EMA
    (its shadow dict empty when load() runs): nothing says how to lay its tensors out, so load() refuses on every
    rank, naming the first shadow key and the fix (the shadows before load()), and the EMA stays empty. Resumed
    into an eager EMA (shadows made from the parameters before load()): each shadow is read into the EMA's own
    DTensor, in place, so it keeps its parameter's mesh, placements and shape, equal to what was saved; training
    and the EMA continue bit-exact. Guards against an EMA restored as plain tensors (wrong shard or a 'mixed
    torch.Tensor and DTensor' error at its next update), or silently not restored."""
    ranks = scenario(job, "ema")
    msg = refused_everywhere([res["refused"] for res in ranks],
                             "extra.ema.shadow.a.weight was saved as a DTensor, and the object held no tensor there",
                             "before load() (an EMA's shadows from the parameters)")
    print(f"\nlazy EMA at load: {msg[:300]}")
    for r, res in enumerate(ranks):
        kinds = {(v["type"], v["placements"]) for v in res["layouts"].values()}
        print(f"rank {r}: eager EMA: read in place {len(res['read_in_place'])} of {len(res['layouts'])}; shadow "
              f"after load {kinds}; params {set(res['param_placements'].values())}; max |diff| vs saved "
              f"{res['vs_saved']}; max |dloss| {res['dloss']}; max |d EMA| at the end {res['ema_diff_end']}; "
              f"decay/updates {res['meta']}")
        assert res["refused"]["empty_after"], "the refused load must leave the lazy EMA as it was"
        assert res["loaded"] == state_job.N
        assert res["read_in_place"] == sorted(res["param_placements"])
        assert sorted(res["layouts"]) == sorted(res["param_placements"]) and all(res["same_layout"].values())
        assert all(v["type"] == "DTensor" for v in res["layouts"].values())
        assert res["vs_saved"] == 0 and res["meta"] == {"decay": 0.9, "updates": state_job.N}
        assert res["dloss"] == 0 and res["ema_diff_end"] == 0
        # Each shadow tensor has its own key, its path in the EMA's state (here the name of its parameter).
        followed = [key.removeprefix("extra.ema.shadow.") for key in res["tensor_keys"]]
        print(f"rank {r}: the shadows' keys: {followed}")
        assert followed == sorted(res["param_placements"])


def test_optimizer_in_extra_before_its_first_step(job):
    """A second optimizer passed as an entry of extra, not yet stepped (empty state) when load() runs: its
    exp_avg/exp_avg_sq come back as DTensors placed like their parameters, keyed by the parameters, and the next
    steps run and match the uninterrupted run bit-exact. Guards against moments restored as plain tensors ('mixed
    torch.Tensor and DTensor' at the next step) or not mapped to the parameters (silently restarted from zero)."""
    for r, res in enumerate(scenario(job, "optimizer_extra")):
        kinds = {k.rsplit(".", 1)[1]: v["type"] for k, v in res["types"].items()}
        print(f"\nrank {r}: empty at load {res['empty_at_load']}; unmapped state keys {res['unmapped_keys']}; "
              f"params with state {res['params_with_state']}; types {kinds}; next step: {res['step_error']}; "
              f"max |dloss| {res['dloss']}")
        assert res["loaded"] == state_job.N and res["empty_at_load"]
        assert res["unmapped_keys"] == [] and res["params_with_state"] == ["b.bias", "b.weight", "norm.bias",
                                                                           "norm.weight"]
        assert kinds == {"exp_avg": "DTensor", "exp_avg_sq": "DTensor", "step": "Tensor"}
        assert all(res["placed_like_param"].values()) and len(res["placed_like_param"]) == 8
        assert res["step_error"] is None and res["dloss"] == 0


def test_extra_mixing_dtensors_and_plain_values(job):
    """An extra holding DTensors under keys that name parameters (in a dict, a list, a tuple) and plain tensors,
    beside a ckpt.PerRank extra whose values differ per rank. Every tensor has its own key, its path. Loaded into
    objects that hold none of their tensors: refused on every rank, naming the first DTensor's key (a key naming a
    parameter lends no layout). Loaded into an object that holds its DTensors, one of them Replicate() though its
    namesake parameter is sharded: each comes back exactly, read into the object's own tensor and laid out like
    it; the plain ones (absent at load) as the Tensor, dtype and device they were; each rank its own value of the
    PerRank one. Guards against DTensors flattened to plain tensors or laid out like a parameter they only share
    a name with, plain ones sharded, or one rank's value given to every rank."""
    ranks = scenario(job, "mixed_extra")
    msg = refused_everywhere([res["missing"] for res in ranks],
                             "extra.mixed.a.weight was saved as a DTensor, and the object held no tensor there")
    print(f"\nobjects without their tensors at load: {msg[:240]}")
    for r, res in enumerate(ranks):
        leaves = {k: (v["loaded"]["type"], v["loaded"]["placements"], v["diff"]) for k, v in res["leaves"].items()}
        print(f"rank {r}: keys {res['keys']}; leaves {leaves}; rank value {res['rank_value']}; "
              f"problems {res['problems']}")
        assert res["loaded"] == 1 and res["problems"] == [] and res["rank_value"] == r
        assert res["keys"] == ["extra.mixed", "extra.mixed.a.weight", "extra.mixed.nested.0.b.weight",
                               "extra.mixed.nested.1.plain", "extra.mixed.tup.0.norm.weight", "extra.mixed.tup.1",
                               "rank.0.extra.own", "rank.0.extra.own.per_rank_t", "rank.1.extra.own",
                               "rank.1.extra.own.per_rank_t"]
        dtensors = [k for k, v in leaves.items() if v[0] == "DTensor"]
        assert dtensors == [".shared.a.weight", ".shared.nested.0.b.weight", ".shared.tup.0.norm.weight"]
        assert all(res["leaves"][k]["read_in_place"] for k in dtensors)
        assert leaves[".shared.a.weight"][1] == "(Replicate(),)" and leaves[".shared.tup.0.norm.weight"][1] == \
            "(Shard(dim=0),)"
        assert len(leaves) == 6 and all(v[2] == 0 for v in leaves.values())


def test_dtensor_laid_out_like_no_parameter(job):
    """A DTensor in an extra laid out like no model parameter (Replicate() on the mesh; Shard(0) of another shape)
    is saved under its own key; its layout at load is the object's to give: loaded into an object that lacks it,
    refused on every rank naming the key; into one holding a DTensor of its shape, read into that tensor, equal
    to what was saved. Guards against a checkpoint whose extra load() cannot place, or places by guesswork."""
    res = scenario(job, "unplaceable")
    for case in ("replicated", "reshaped"):
        per_case = [r[case] for r in res]
        msg = refused_everywhere([r["missing"] for r in per_case],
                                 f"extra.{case}.w was saved as a DTensor, and the object held no tensor there")
        print(f"\n{case}: saved {[r['saved']['raised'] for r in per_case]}, committed "
              f"{[r['committed'] for r in per_case]}; into an object without it: {msg[:200]}; into one with it: "
              f"{[r['loaded']['raised'] for r in per_case]}, {per_case[0]['layout']['placements']} "
              f"{per_case[0]['layout']['shape']}, read in place {[r['read_in_place'] for r in per_case]}, max |diff| "
              f"{[r['diff'] for r in per_case]}")
        for r in per_case:
            assert r["saved"]["raised"] is None and r["committed"] == [1] and r["loaded"]["raised"] is None
            assert r["read_in_place"] and r["layout"] == r["saved_layout"] and r["diff"] == 0 and r["keep"] == 1


def test_optimizer_state_beyond_tensors(job):
    """SGD(momentum=0.9) holding {'momentum_buffer': None} for a parameter (second in optimizer=[adamw, sgd]) saves
    and comes back None, every other buffer equal; LBFGS, whose state beside its lists of flat past directions
    holds each rank's own loss (prev_loss, a number in its param group's value, stored once), is refused by save()
    on every rank, naming that key and the ranks on each side, nothing committed. Guards against a checkpoint that
    drops or invents optimizer state (one rank's value for both), or a save that fails inside DCP with a message
    that names nothing."""
    res = scenario(job, "optimizer_refusals")
    for r, x in enumerate(res):
        print(f"\nrank {r}: SGD save {x['sgd']['raised']}, load {x['sgd']['loaded']['raised']}; momentum buffers "
              f"after load (max |diff|, None kept None): {x['sgd']['buffers']}")
        assert x["sgd"]["raised"] is None and x["sgd"]["loaded"]["raised"] is None and x["sgd"]["none_kept"]
        assert x["sgd"]["buffers"] == {"b.bias": 0.0, "b.weight": None, "norm.bias": 0.0, "norm.weight": 0.0}
    lbfgs = refused_everywhere([r["lbfgs"] for r in res], "optim.0.state.a.weight.prev_loss (ranks 0 | 1)",
                               "LBFGS's prev_loss", "Nothing was written")
    print(f"LBFGS: {lbfgs[:300]}\nLBFGS state: {res[0]['lbfgs']['state_types']}")
    assert all(r["lbfgs"]["step_error"] is None for r in res)
    assert all(r["lbfgs"]["listing"] == [] for r in res), "refused before the root is touched"


def test_model_of_another_dtype_is_refused(job):
    """A float32 checkpoint loaded (weights only) into the same model cast to bf16 is refused on every rank,
    naming a key and both dtypes, and leaves the weights as they were. Guards against a silent conversion, and
    against the refusal reading like damage ('differ from what was saved')."""
    res = scenario(job, "dtype")
    msg = refused_everywhere(res, "of another dtype or shape",
                             "model.a.weight: torch.float32 (16, 8) saved, torch.bfloat16 (16, 8) here")
    print(f"\n{msg[:330]}\nweights changed by the refused load: {[r['weights_changed'] for r in res]}")
    assert all("differ from what was saved" not in r["msg"] for r in res)
    assert all(r["dtypes"] == ["torch.bfloat16"] and r["weights_changed"] == 0 for r in res)


def test_optimizer_state_is_checked_after_load(job):
    """An optimizer whose load_state_dict() leaves a parameter's state at another step than the one saved under
    its name, or gives two parameters each other's moments (same keys, same step: a check of keys and steps alone
    passes it), is refused after the read, on every rank, naming the parameter and the key. Guards against
    optimizer state restored to the wrong parameter, or from the wrong step, passing silently (the loss spike)."""
    res = scenario(job, "summary_mismatch")
    step = refused_everywhere([r["step"] for r in res], "optimizer state of a.weight after loading is not what was "
                              "saved under its name: ['step'] differ")
    swapped = refused_everywhere([r["swapped"] for r in res], "optimizer state of a.weight after loading",
                                 "['exp_avg_sq'] differ")
    print(f"\nanother step: {step[:240]}\nmoments swapped between two parameters (same keys, same step): "
          f"{swapped[:240]}")


def test_save_of_the_loaded_step_and_of_an_older_one(job):
    """After load() of step 3 and another optimizer step (the counter not advanced), save(3) replaces step 3 with
    the state given (sync, then async after one more step): the checkpoint at the returned path holds the live
    weights; save(2) is refused on every rank (the root holds a later step; a rollback is said, with
    check_root(rollback_to=)). Guards against a save that returns the path of a checkpoint not holding the state
    it was given, or rewinds the root's history without a rollback."""
    res = scenario(job, "same_and_older_step")
    for r, x in enumerate(res):
        print(f"\nrank {r}: save(3) after another step: {x['same']['raised']} -> {x['same'].get('value')}, its "
              f"weights vs the live ones max |diff| {x['sync_vs_live']}; async: {x['same_async']}, max |diff| "
              f"{x['async_vs_live']}; save(2): {x['older']['msg'][:140]}; root {x['dirs']}")
        assert x["loaded"] == 3
        assert x["same"]["raised"] is None and x["same"]["value"] == x["path3"] and x["sync_vs_live"] == 0
        assert x["same_async"] == {"path": x["path3"], "done": True} and x["async_vs_live"] == 0
        assert x["dirs"] == [ckpt.OWNER, "step-00000002", "step-00000003"]
    refused_everywhere([x["older"] for x in res], "holds step-00000003, a later step than 2",
                       "ckpt.check_root(root, model, rollback_to=<the step loaded>)")
