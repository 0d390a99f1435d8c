"""The rules ckpt.py says instead of inferring, at 2 ranks: scenario after scenario in ONE job (tests/launch.py).

    torchrun --standalone --nproc-per-node 2 tests/explicit_job.py WORK OUT   (tests/test_explicit.py forks its
                                                                              ranks with tests/launch.py)

  per_rank_tensor  a per-rank tensor in an extra, under a key that names a parameter of a DDP-style plain model:
                   refused at save unless declared ckpt.PerRank(obj); declared, each rank reads back its own.
  stages           2 ranks, each holding half the layers of one model (two pipeline stages, no FSDP), with AdamW,
                   save step 2; OUT/stages_ref.pt gets the full saved weights, for tests/test_explicit.py, which
                   resumes that checkpoint in one process holding every layer.
  async_steps      save(async_save=True) on a 2-rank FSDP2 model, then optimizer.step() 3 times at once; an
                   in-place write right after save(); the same after pending.wait_copy(). Each checkpoint is
                   loaded into a fresh model and compared with the state snapshot taken before save().

Rank 0 prints one line "RESULT <json>" ({scenario: [rank 0's figures, rank 1's figures]}) at the end, as
tests/state_job.py does (its run_scenarios(): a scenario still running after its limit ends the job, naming it).
tests/test_explicit.py imports Layers from here (the 1-process resume of the stages' checkpoint).
"""

import time

STARTED = time.time()  # before torch is imported: the job's figures include the import

import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ckpt  # noqa: E402
from tests import state_job  # noqa: E402
from tests.state_job import Box, full, listing, outcome, rank  # noqa: E402

N_LAYERS = 4


class Layers(torch.nn.Module):
    """A stack of layers under their original names: a pipeline stage deletes the others (keep_stage)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): torch.nn.Linear(8, 8) for i in range(N_LAYERS)})

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def keep_stage(model, stage, stages):
    per = N_LAYERS // stages
    for i in range(N_LAYERS):
        if i // per != stage:
            del model.layers[str(i)]
    return model


def step_batch(i, stage=0):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + stage))


def scen_per_rank_tensor(root, out):
    """A DDP-style model (every rank a full plain copy); an extra whose tensor under the key "0.weight" (the name of
    the model's parameter) differs per rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def mine():
        return {"0.weight": torch.full((4, 4), float(rank()))}

    undeclared = outcome(lambda: ckpt.save(os.path.join(root, "undeclared"), 1, model, None, {"resid": Box(mine())}))
    undeclared.update(listing=listing(os.path.join(root, "undeclared")),
                      committed=ckpt.committed_steps(os.path.join(root, "undeclared")))
    path = ckpt.save(os.path.join(root, "declared"), 1, model, None, {"resid": ckpt.PerRank(Box(mine()))})
    keys = sorted(k for k in ckpt.read_metadata(path).state_dict_metadata if "resid" in k)
    back = Box({})
    loaded = ckpt.load(path, model, None, {"resid": ckpt.PerRank(back)})
    t = back.state.get("0.weight") if isinstance(back.state, dict) else None
    return {"undeclared": undeclared, "keys": keys, "loaded": loaded, "type": type(t).__name__,
            "values": sorted(set(t.flatten().tolist())) if isinstance(t, torch.Tensor) else None,
            "exact": isinstance(t, torch.Tensor) and torch.equal(t, mine()["0.weight"])}


def scen_stages(root, out):
    """Two pipeline stages without FSDP: rank r holds layers 2r and 2r+1 of one model (same seed), trains 2 steps
    with AdamW, saves step 2."""
    torch.manual_seed(0)
    model = keep_stage(Layers(), rank(), dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        model(step_batch(i, rank())).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    path = ckpt.save(root, 2, model, opt)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: p.detach().clone() for n, p in model.named_parameters()})
    if rank() == 0:
        torch.save({k: v for mine in every for k, v in mine.items()}, os.path.join(out, "stages_ref.pt"))
    return {"path": path,
            "params": sorted(dict(model.named_parameters()))}


def snapshot(model, opt):
    """The full parameters and every optimizer state tensor, by name (collective)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    out.update({f"{names[p]}.{k}": full(v).clone() for p, s in opt.state.items() for k, v in s.items()})
    return out


def compared(a, b):
    """max |a - b| over the keys of a (None if the keys differ); 0.0 only if every tensor is equal bit for bit."""
    if sorted(a) != sorted(b):
        return None
    return max((x.double() - b[k].double()).abs().max().item() for k, x in a.items())


def fresh_load(path):
    """The state a fresh FSDP2 model and AdamW hold after loading path (a resume)."""
    model = state_job.build(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(path, model, opt)
    return snapshot(model, opt)


def scen_async_steps(root, out):
    """save(async_save=True) on FSDP2, then at once: 3 optimizer steps; an in-place write; wait_copy() and a write."""
    model = state_job.build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        state_job.train_step(model, [opt], i)
    model(state_job.batch(2)).pow(2).mean().backward()  # gradients for the steps right after save()
    res = {}

    def part(name, fn):  # each part's figures, or what it raised (on every rank alike)
        try:
            res[name] = fn()
        except Exception as e:
            res[name] = {"unexpected": f"{type(e).__name__}: {e}"}

    part("steps", lambda: steps_after_save(model, opt, root))
    part("in_place", lambda: in_place_after_save(model, opt, root))
    part("after_wait_copy", lambda: write_after_wait_copy(model, opt, root))
    return res


def steps_after_save(model, opt, root):
    at_save = snapshot(model, opt)
    pending = ckpt.save(root, 2, model, opt, async_save=True)
    for _ in range(3):
        opt.step()  # its step pre-hook waits for the copy to host memory
    path = pending.wait()
    loaded = fresh_load(path)
    return {"n": len(loaded), "vs_at_save": compared(at_save, loaded),
            "vs_after": compared(snapshot(model, opt), loaded)}


def in_place_after_save(model, opt, root):
    at_save = snapshot(model, opt)
    pending = ckpt.save(root, 3, model, opt, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    error = None
    try:
        path = pending.wait()
    except ckpt.CheckpointError as e:
        error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return {"errors": errors, "committed": ckpt.committed_steps(root), "listing": listing(root),
            "vs_at_save": None if any(errors) else compared(at_save, fresh_load(path))}


def write_after_wait_copy(model, opt, root):
    at_save = snapshot(model, opt)
    pending = ckpt.save(root, 4, model, opt, async_save=True)
    pending.wait_copy()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    now = snapshot(model, opt)
    loaded = fresh_load(pending.wait())
    return {"vs_at_save": compared(at_save, loaded), "vs_now": compared(now, loaded)}


ORDER = ["per_rank_tensor", "stages", "async_steps"]


def main():
    state_job.STARTED, state_job.SCENARIO_LIMIT = STARTED, 60  # the job is timed from our start
    state_job.main(ORDER, globals())


if __name__ == "__main__":
    main()
