"""The defects a first reading of ckpt.py and a new user reproduced, at 2 ranks: scenario after scenario in ONE job.

    torchrun --standalone --nproc-per-node 2 tests/defects_job.py WORK OUT   (tests/test_defects.py forks its ranks
                                                                              with tests/launch.py)

  ddp              a DistributedDataParallel model: saved, resumed bit for bit; its checkpoint loads into the same
                   model under FSDP2 (weights only)
  fsdp1            a FullyShardedDataParallel (FSDP1) model: refused at save(), naming fully_shard
  foreign          a directory written by a plain dcp.save(): refused as not written by ckpt.save()
  strict           a fine-tune: a model with a new head loads what the checkpoint has (strict=False), both lists logged
  groups_changed   a resume whose param groups hold other parameters (a backbone unfrozen): refused, saying what to do
  unhashable       a meta tensor in an extra stored once: refused on every rank at once, naming the key
  branches         the branch rule at every save: a rollback to another step than the one loaded; a resume from an
                   older step saving the newest step's number; a second model, loaded weights-only, saving over a
                   resumed run's step; then a stray .rollback-to- file that names no step
  mistyped_root    a resume from a root that does not exist: said at WARNING, and check_root() says it makes one
  corrupt          a byte flipped in one of rank 1's tensors in its shard: the load refused on every rank naming the
                   file, save() refused until a load succeeds; the control loads it with verify=False
  ema              an EMA of FSDP2 parameters (DTensor shadows), saved; OUT/ema.pt gets the full shadows, for the test
                   that loads it into an empty EMA in a plain process

Rank 0 prints one line "RESULT <json>" ({scenario: [rank 0's figures, rank 1's figures]}) at the end (as
tests/state_job.py does: a scenario still running after its limit ends the job, naming it).
"""

import time

STARTED = time.time()  # before torch is imported: the job's figures include the import

import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import ckpt  # noqa: E402
from tests import state_job  # noqa: E402
from tests.harness import Lines  # noqa: E402
from tests.state_job import Box, full, listing, outcome, rank  # noqa: E402

LOG = Lines()


class Net(torch.nn.Module):
    def __init__(self, head=False):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.head = torch.nn.Linear(4, 3) if head else None

    def forward(self, x):
        y = self.b(torch.tanh(self.a(x)))
        return self.head(y) if self.head is not None else y


def batch(i):  # this rank's data of step i, whatever the generators
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * i + rank()))


def step(model, opt, i):
    loss = model(batch(i)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def weights(model, opt=None):  # every rank's full model, and its optimizer's state tensors by parameter name
    state = {k: full(v).clone() for k, v in get_model_state_dict(model).items()}
    for name, p in (model.named_parameters() if opt else ()):
        state.update({f"{name}.{k}": full(v).clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
    return state


def make(seed=0, shard=False):  # a seeded Net (shard: its layer a, then the whole, with FSDP2) and its AdamW
    torch.manual_seed(seed)
    model = Net()
    if shard:
        fully_shard(model.a)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def scen_ddp(root, out):
    def in_ddp(seed):
        torch.manual_seed(seed)
        model = DistributedDataParallel(Net())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = in_ddp(0)
    for i in range(2):
        step(model, opt, i)
    saved = ckpt.save(root, 2, model, opt)
    at_save = weights(model)
    reference = [step(model, opt, i) for i in (2, 3)]
    model, opt = in_ddp(1)
    loaded = ckpt.load(root, model, opt)
    resumed = [step(model, opt, i) for i in (2, 3)]
    sharded, _ = make(2, shard=True)
    into_fsdp2 = ckpt.load(root, sharded)
    keys = sorted(ckpt.read_metadata(saved).state_dict_metadata)
    return {"loaded": loaded, "reference": reference, "resumed": resumed, "into_fsdp2": into_fsdp2,
            "fsdp2_vs_saved": max_diff(at_save, weights(sharded)), "keys": [k for k in keys if k.startswith("model.")],
            "sharded": type(sharded.a.weight).__name__}


def scen_fsdp1(root, out):
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Net(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, 0)
    refused = outcome(lambda: ckpt.save(root, 1, model, opt))
    return dict(refused, listing=listing(root))


def scen_foreign(root, out):
    torch.manual_seed(0)
    model = Net()
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=root)
    return {"refused": outcome(lambda: ckpt.load(root, Net())), "listing": listing(root)}


def scen_strict(root, out):
    torch.manual_seed(0)
    base = Net()
    ckpt.save(root, 3, base, None)
    saved = weights(base)
    torch.manual_seed(1)
    tuned = Net(head=True)
    head = {k: v.clone() for k, v in tuned.head.state_dict().items()}
    refused = outcome(lambda: ckpt.load(root, tuned))  # strict: the head is missing from the checkpoint
    with_opt = outcome(lambda: ckpt.load(root, tuned, torch.optim.AdamW(tuned.parameters()), strict=False))
    LOG.lines.clear()
    loaded = ckpt.load(root, tuned, strict=False)
    said_new = LOG.take("left as they are (strict=False)")
    body = {k: v for k, v in weights(tuned).items() if not k.startswith("head.")}
    smaller = torch.nn.Module()
    smaller.a = torch.nn.Linear(8, 16)  # b is in the checkpoint, not in this model
    LOG.lines.clear()
    smaller_loaded = ckpt.load(root, smaller, strict=False)
    said_left = LOG.take("not in the model")
    return {"refused": refused, "with_opt": with_opt, "loaded": loaded, "said_new": said_new,
            "body_vs_saved": max_diff(body, {k: saved[k] for k in body}),
            "head_unchanged": all(torch.equal(v, tuned.head.state_dict()[k]) for k, v in head.items()),
            "smaller_loaded": smaller_loaded, "said_left": said_left,
            "smaller_vs_saved": (smaller.a.weight - saved["a.weight"]).abs().max().item()}


def scen_groups_changed(root, out):
    torch.manual_seed(0)
    model = Net()
    model.a.requires_grad_(False)  # stage 1 of a fine-tune: the backbone frozen, its optimizer the head's alone
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step(model, opt, 0)
    ckpt.save(root, 1, model, opt)
    model.a.requires_grad_(True)  # stage 2: the backbone unfrozen, one optimizer over everything
    return outcome(lambda: ckpt.load(root, model, torch.optim.AdamW(model.parameters(), lr=1e-3)))


def scen_unhashable(root, out):
    torch.manual_seed(0)
    model = Net()
    t0 = time.monotonic()
    refused = outcome(lambda: ckpt.save(root, 1, model, None, {"cache": Box({"t": torch.empty(3, device="meta")})}))
    return dict(refused, secs=round(time.monotonic() - t0, 3), listing=listing(root))


def scen_branches(root, out):
    model, opt = make()
    for s in (2, 4):
        step(model, opt, s)
        ckpt.save(root, s, model, opt)
    res = {}
    model, opt = make(1)
    ckpt.load(root, model, opt)  # step 4, the newest
    res["rollback_other"] = outcome(lambda: ckpt.check_root(root, model, rollback_to=2))  # 2 is not the step loaded
    res["after_rollback_other"] = listing(root)
    older, older_opt = make(2)
    ckpt.load(ckpt.step_dir(root, 2), older, older_opt)  # an older step, then its run saves step 4's number
    manifest = ckpt.read_manifest(ckpt.step_dir(root, 4))
    step(older, older_opt, 3)
    step(older, older_opt, 4)
    res["older_saves_newest"] = outcome(lambda: ckpt.save(root, 4, older, older_opt))
    res["step4_unchanged"] = ckpt.read_manifest(ckpt.step_dir(root, 4)) == manifest
    copy, _ = make(3)  # in the process of the resumed run: a copy of the model, its weights alone, a fresh optimizer
    ckpt.load(root, copy)
    res["weights_only_resave"] = outcome(lambda: ckpt.save(root, 4, copy, torch.optim.AdamW(copy.parameters())))
    res["step4_still_unchanged"] = ckpt.read_manifest(ckpt.step_dir(root, 4)) == manifest
    if rank() == 0:
        with open(os.path.join(root, f"{ckpt.ROLLBACK}00000002.swp"), "w") as f:  # an editor's swap file
            f.write("not a step")
    dist.barrier()
    res["stray"] = {"load": outcome(lambda: res.update(stray_loaded=ckpt.load(root, model, opt))),
                    "check_root": outcome(lambda: ckpt.check_root(root, model)),
                    "save": outcome(lambda: res.update(stray_saved=os.path.basename(ckpt.save(root, 5, model, opt)))),
                    "committed": ckpt.committed_steps(root), "listing": listing(root)}
    return res


def scen_mistyped_root(root, out):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    LOG.lines.clear()
    found = ckpt.load(root + "-typo", model, opt)
    said_load = LOG.take("no checkpoint in")
    ckpt.check_root(root + "-typo", model)
    return {"found": found, "said_load": said_load, "said_claim": LOG.take("a new checkpoint root")}


def scen_corrupt(root, out):
    model, opt = make(shard=True)
    for s in (2, 4):
        step(model, opt, s)
        ckpt.save(root, s, model, opt)
    saved = weights(model, opt)
    shard = os.path.join(ckpt.step_dir(root, 4), "__1_0.distcp")
    if rank() == 1:  # a byte flipped in the middle of one of its tensors' bytes in its shard: a read goes through
        mine = max((p.to_local().detach().contiguous() for p in model.parameters()), key=torch.Tensor.numel)
        raw = mine.view(torch.uint8).numpy().tobytes()  # the file holds them as they are (torch.save's records)
        with open(shard, "r+b") as f:
            at = f.read().find(raw) + len(raw) // 2
            assert at >= len(raw) // 2, "the tensor's bytes are not in its shard"
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    model, opt = make(1, shard=True)
    t0 = time.monotonic()
    res = {"load": outcome(lambda: ckpt.load(root, model, opt)), "secs": round(time.monotonic() - t0, 3),
           "shard": os.path.basename(shard)}
    res["save"] = outcome(lambda: ckpt.save(root, 5, model, opt))  # the model may hold part of the damaged step
    res["reload"] = outcome(lambda: res.update(reloaded=ckpt.load(ckpt.step_dir(root, 2), model, opt)))
    res["rollback"] = outcome(lambda: ckpt.check_root(root, model, rollback_to=2))  # the damaged step given up
    res["save_after"] = outcome(lambda: res.update(saved_after=os.path.basename(ckpt.save(root, 3, model, opt))))
    fresh, fresh_opt = make(2, shard=True)
    copy = os.path.join(root + "-control", "step-00000004")
    if rank() == 0:
        import shutil
        shutil.copytree(next(os.path.join(root, n) for n in os.listdir(root) if n.startswith(ckpt.ABANDONED)), copy)
    dist.barrier()
    res["control"] = outcome(lambda: res.update(control_loaded=ckpt.load(copy, fresh, fresh_opt, verify=False)))
    res["control_vs_saved"] = max_diff(saved, weights(fresh, fresh_opt))  # what the damage changed, read unchecked
    return res


def scen_ema(root, out):
    model, opt = make(shard=True)
    ema = state_job.EMA(model)
    step(model, opt, 0)
    ema.update()
    path = ckpt.save(root, 1, model, opt, {"ema": ema})
    shadows = {k: full(v).clone() for k, v in ema.shadow.items()}
    kinds = sorted({type(v).__name__ for v in ema.shadow.values()})
    if rank() == 0:
        torch.save({"path": path, "shadows": shadows}, os.path.join(out, "ema.pt"))
    return {"path": path, "kinds": kinds}


ORDER = ["ddp", "fsdp1", "foreign", "strict", "groups_changed", "unhashable", "branches", "mistyped_root",
         "corrupt", "ema"]

if __name__ == "__main__":
    logging.getLogger("ckpt").addHandler(LOG)
    state_job.main(ORDER, globals())
