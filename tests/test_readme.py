"""The README is checked: what it names exists, and its quick start does what it shows.

Guards against a teaching document that drifts from the code: a `ckpt.` function that was renamed, a link to a
file that is not in the repository (or outside it), a test that no longer exists, quick-start commands that fail
or print other losses than the README shows.

    python -m pytest -v -s tests/test_readme.py
"""

import json
import os
import re
import shlex
import sys

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from tests.harness import REPO, run  # noqa: E402

README = open(os.path.join(REPO, "README.md")).read()


def test_names_links_and_tests_exist():
    """Every `ckpt.<name>`, every relative link and every quoted test file in the README exists."""
    names = sorted(set(re.findall(r"\bckpt\.(?!py\b)([A-Za-z_]\w*)", README)))  # ckpt.py is the file
    missing = [n for n in names if not hasattr(ckpt, n)]
    links = sorted({t for t in re.findall(r"\]\(([^)#\s]+)\)", README) if "://" not in t})
    broken = [t for t in links if not os.path.exists(os.path.join(REPO, t))]
    quoted = sorted(set(re.findall(r"\b((?:tests/)?test_\w+\.py)(?:::(\w+\*?))?", README)))  # file[::test]
    absent = [f"{q}::{test}" if test else q for q, test in quoted if not _defines(q, test)]
    outside = re.findall(r"\.\./\w+", README)
    print(f"\n{len(names)} ckpt names, {len(links)} links, {len(quoted)} test files quoted; missing: {missing}, "
          f"broken: {broken}, absent: {absent}, outside the repository: {outside}")
    assert not missing and not broken and not absent and not outside


def _defines(quoted, test):
    """quoted (test_resume.py at the top, the others under tests/) exists and defines test (a prefix if it ends
    in *)."""
    top = quoted.startswith("tests/") or quoted == "test_resume.py"
    path = os.path.join(REPO, quoted if top else "tests/" + quoted)
    if not os.path.exists(path):
        return False
    defined = re.findall(r"^def (test_\w+)", open(path).read(), re.M)
    return not test or any(d == test or test.endswith("*") and d.startswith(test[:-1]) for d in defined)


def test_quick_start_runs_as_shown(tmp_path):
    """The quick start's commands, as written, run in a fresh directory; every output line the README shows after
    them (steps, losses, learning rates, the resume) is printed by those commands."""
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)  # [(language, text)]: commands, then output
    commands = [line.split("#")[0].strip() for lang, text in blocks if lang == "bash" for line in text.splitlines()]
    commands = [c for c in commands if c.startswith(("torchrun", "python consolidate.py"))]
    shown = "\n".join(text for lang, text in blocks if lang == "")
    for name in ("train_fsdp.py", "ckpt.py", "consolidate.py"):
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    output = ""
    for command in commands:  # this interpreter's torchrun and python, not whichever PATH finds first
        argv = shlex.split(command)
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else [sys.executable]
        _, out = run(argv, timeout=300, cwd=str(tmp_path))
        output += out
    expected = [line.strip() for line in shown.splitlines() if line.strip().startswith(("step ", "resumed"))]
    printed = {re.sub(r"\|[^|]*tok/s", "", line).strip() for line in output.splitlines()}
    absent = [line for line in expected if re.sub(r"\|[^|]*tok/s", "", line).strip() not in printed]
    print(f"\nran {len(commands)} commands; {len(expected)} lines shown in the README, not printed: {absent}")
    assert len(commands) == 3 and expected and not absent
    assert os.path.isfile(tmp_path / "model_out" / "model.safetensors")


RECIPES = """
import json, os, sys, time, torch
sys.path.insert(0, {repo!r})
import ckpt
root = sys.argv[1]
{code}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
ema = EMA(model, decay=0.5)
for step in range(1, 4):  # no process group: a world of one
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    ema.update()
    ckpt.save(root, step, model, opt, {{"ema": ema}}, keep=2)
ckpt.close()
torch.manual_seed(1)
fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
fresh_ema = EMA(fresh)  # shadows of fresh's own parameters: load() reads into them
step = newest(root, fresh, fresh_ema)
weights = max((a - b).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters()))
shadows = max((ema.shadow[n] - fresh_ema.shadow[n]).abs().max().item() for n in ema.shadow)
print("RESULT", json.dumps({{"step": step, "dweights": weights, "dshadow": shadows,
                             "decay": fresh_ema.decay, "names": sorted(fresh_ema.shadow) == sorted(ema.shadow)}}))
"""


def test_recipes_run(tmp_path):
    """The README's EMA class and evaluation loop, as written, in a process without a process group (one rank
    forked from a warm interpreter, tests/launch.py: torch imported already; the script starts no group): an EMA
    saved with the model and the optimizer comes back into a fresh model's EMA; the loop loads the newest step's
    weights and EMA and returns the step it loaded. Guards against recipes that do not run, or do not restore what
    they promise."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    code = "\n".join(b for b in blocks if "class EMA" in b or "def newest(" in b)
    assert code.count("class EMA") == 1 and code.count("def newest(") == 1, "the README lost a recipe"
    script = tmp_path / "recipes.py"
    script.write_text(RECIPES.format(repo=REPO, code=code))
    _, out = launch.run([script, tmp_path / "root"], nproc=1, timeout=120)
    got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    print(f"\nrecipes: newest() loaded step {got['step']}; max |dweights| {got['dweights']}, max |dshadow| "
          f"{got['dshadow']}, decay {got['decay']}")
    assert got == {"step": 3, "dweights": 0.0, "dshadow": 0.0, "decay": 0.5, "names": True}


LOOP = """
import os, random, sys, torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from torch.distributed.fsdp import fully_shard
root, resume, total_steps = sys.argv[1], sys.argv[2] == "resume", int(sys.argv[3])
dist.init_process_group("gloo")
rank, world, device = dist.get_rank(), dist.get_world_size(), torch.device("cpu")
seed, batch_size, save_every = 0, 8, 2


class Samples(torch.utils.data.Dataset):  # sample i from (seed, i) alone
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(seed * 1000 + i))
        return x, x.sum(0, keepdim=True)


dataset = Samples()


def build_model():  # as train_fsdp.py's: the generators seeded at start-up
    torch.manual_seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    fully_shard(model)
    return model


def loss_of(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


try:
{code}
finally:
    dist.destroy_process_group()
"""


def test_loop_runs_and_resumes_exactly(tmp_path):
    """The README's loop, as written, at 2 ranks (FSDP2, gloo, DataLoader workers): run 6 steps uninterrupted; run 4
    steps, then resume to 6. The resumed run's final checkpoint equals the uninterrupted one's key by key, bit for
    bit. Guards against a loop in the README that does not run, or that does not resume exactly."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    code = next(b for b in blocks if "position.batches(loader)" in b)
    script = tmp_path / "loop.py"
    script.write_text(LOOP.format(repo=REPO, code="\n".join("    " + line for line in code.splitlines())))
    for root, mode, steps in (("straight", "new", 6), ("stopped", "new", 4), ("stopped", "resume", 6)):
        launch.run([script, tmp_path / root, mode, str(steps)], nproc=2, timeout=120)
    states = {}
    for root in ("straight", "stopped"):
        path = ckpt.find_checkpoint(str(tmp_path / root))
        metadata = ckpt.read_metadata(path)
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) if hasattr(m, "size") else None
                 for k, m in metadata.state_dict_metadata.items()}
        dcp.load(state, storage_reader=ckpt.SafeReader(path, metadata), planner=ckpt.SafeLoadPlanner(), no_dist=True)
        states[root] = (ckpt.read_manifest(path)["step"], state)
    (step_a, a), (step_b, b) = states["straight"], states["stopped"]
    differ = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    print(f"\nthe README's loop: steps {step_a} and {step_b}; {len(a)} keys, {len(differ)} differ: {differ[:5]}")
    assert step_a == step_b == 6 and sorted(a) == sorted(b) and not differ
    # The README's recipe for another world size, in place of the loop's load: the 2-rank root resumed at 1 rank.
    recipe = next(b for b in blocks if "resized" in b)
    line = next(line for line in code.splitlines() if line.startswith("step = (ckpt.load("))
    resized = "\n".join("    " + line for line in code.replace(line, recipe.strip()).splitlines())
    script.write_text(LOOP.format(repo=REPO, code=resized))
    _, out = launch.run([script, tmp_path / "stopped", "resume", "8"], nproc=1, timeout=120)
    manifest = ckpt.read_manifest(ckpt.find_checkpoint(str(tmp_path / "stopped")))
    said = [ln for ln in out.splitlines() if "not restored from" in ln]
    print(f"the README's world-size recipe at 1 rank: step {manifest['step']} at world size {manifest['world_size']}; "
          f"said: {said[:1]}")
    assert manifest["step"] == 8 and manifest["world_size"] == 1 and "saved at world size 2" in "".join(said)
