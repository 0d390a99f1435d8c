"""The jobs of tests/test_exact.py (issue items 6 and 7), launched as ranks with torchrun's environment
(tests/launch.py).

    exact_job.py train OUT --root R [--resume] [--stop-after N] [--kill POINT --kill-step N]   (item 6)
    exact_job.py hold OUT --root R [--no-fork-hook]                                           (item 7)
    exact_job.py claim OUT --root R                                                           (item 7)

train: a user's loop (a small FSDP2 model with dropout, AdamW, a step counter as an extra) that saves every
--save-every steps (meta {"save": "periodic"}) and, at its last step, saves that step again (meta {"save":
"final"}): the common end of a loop, a re-save of step N. --kill makes rank 0 SIGKILL every rank at one point of
that re-save's commit: first_rename (the old copy moved to .replaced-, the new one still .tmp-), second_rename
(the new copy is step-N, before the root's fsync), after_fsync (fsynced, before the old copy is deleted).
Rank 0 logs each step to OUT/log.jsonl (loss, full weights' hash) and writes OUT/run.json.

hold: claims R (check_root), rank 0 forks a helper child that lives until OUT/release (at most 90 s), writes
OUT/ready.json, then every rank sleeps until the test SIGKILLs it. --no-fork-hook: os.register_at_fork is a
no-op before the claim (the control). claim: a new run's check_root of R, timed, into OUT/claim.json.
"""

import argparse
import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckpt  # noqa: E402

TIMEOUT = 60  # of every process group and checkpoint collective here: no test may hang


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.2)  # draws from torch's generator: a resume must restore it

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x)))))


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def build(seed=0):
    """The model (FSDP2 under a process group, plain without); torch's generator then seeded per rank."""
    torch.manual_seed(seed)
    model = Net()
    if dist.is_initialized():
        fully_shard(model.a)
        fully_shard(model)
    torch.manual_seed(1000 + 10 * seed + rank())  # dropout and data differ per rank, as they do in training
    return model


def full(t):
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def weights(model):
    """sha256 of the full parameters, in order: the same on every rank (and in a plain process's model)."""
    flat = torch.cat([full(p).detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def loss_of(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    mean = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    return mean.item()


def listing(root):
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def write_json(path, obj):
    with open(path + ".part", "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".part", path)


class Progress:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


# ----------------------------------------------------------------------------------------- 6. train


def install_kill(point, step, out, pids):
    """Rank 0: SIGKILL every rank (a node lost) at `point` of the commit of the re-save of `step`."""
    tag = f"step-{step:08d}"

    def die(where, root):
        with open(os.path.join(out, "fired.part"), "w") as f:
            json.dump({"where": where, "listing": listing(root)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(out, "fired.part"), os.path.join(out, "fired.json"))
        sys.stdout.flush(), sys.stderr.flush()
        for pid in pids[1:]:
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def replaced_in(root):
        return any(n.startswith(f"{ckpt.REPLACED}{tag}-") for n in os.listdir(root))

    real_rename, real_fsync_dir = os.rename, ckpt.fsync_dir

    def rename(src, dst):
        real_rename(src, dst)
        src, root = os.fspath(src), os.path.dirname(os.fspath(dst))
        if point == "first_rename" and os.path.basename(dst).startswith(f"{ckpt.REPLACED}{tag}-"):
            die(f"renamed {os.path.basename(src)} to {os.path.basename(dst)}", root)
        if (point == "second_rename" and os.path.basename(src).startswith(f"{ckpt.TMP}{tag}-")
                and os.path.basename(dst) == tag and replaced_in(root)):
            die(f"renamed {os.path.basename(src)} to {tag}, the root not fsynced", root)

    def fsync_dir(path):
        real_fsync_dir(path)
        if point == "after_fsync" and os.path.isdir(os.path.join(path, tag)) and replaced_in(path):
            die(f"fsynced {path} after the renames, the old copy not deleted", path)

    os.rename, ckpt.fsync_dir = rename, fsync_dir  # ckpt calls os.rename: the os module's, patched here


def train(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if a.kill and rank() == 0:
        install_kill(a.kill, a.kill_step, a.out, pids)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    progress = Progress()
    extra = {"progress": progress}
    run = {"pids": pids, "saved": {}}
    if a.resume:
        chosen = ckpt.find_checkpoint(a.root)  # what load() chooses (rank 0 alone chooses: nothing else runs)
        run["chosen"] = os.path.basename(chosen)
        run["copy"] = ckpt.read_manifest(chosen)["meta"].get("save")  # which copy of the step: periodic or final
        run["resumed"] = ckpt.load(a.root, model, opt, extra, timeout=TIMEOUT)
    ckpt.check_root(a.root, model, timeout=TIMEOUT)
    run["after_claim"] = listing(a.root)
    log = open(os.path.join(a.out, "log.jsonl"), "a") if rank() == 0 else None
    while progress.step < a.steps:
        progress.step += 1
        g = torch.Generator().manual_seed(100 * progress.step + rank())  # the data: from (step, rank) alone
        loss = loss_of(model, torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        opt.step()
        opt.zero_grad()
        w = weights(model)
        if log:
            log.write(json.dumps({"step": progress.step, "loss": loss, "weights": w}) + "\n")
            log.flush()
        last = progress.step in (a.steps, a.stop_after)
        if progress.step % a.save_every == 0:
            ckpt.save(a.root, progress.step, model, opt, extra, keep=a.keep, meta={"save": "periodic"},
                      timeout=TIMEOUT)
            run["saved"][progress.step] = w
        if rank() == 0:
            write_json(os.path.join(a.out, "run.json"), run)
        if last:  # the loop's final save: the same step again when the periodic save just fired
            ckpt.save(a.root, progress.step, model, opt, extra, keep=a.keep, meta={"save": "final"}, timeout=TIMEOUT)
            break
    run["end"] = listing(a.root)
    if rank() == 0:
        write_json(os.path.join(a.out, "run.json"), run)
    ckpt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- 7. fork


def hold(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    model = build()
    if a.no_fork_hook:  # the control: ckpt's hook is never registered, so a forked child keeps the lock
        os.register_at_fork = lambda **kwargs: None
    ckpt.check_root(a.root, model, timeout=TIMEOUT)
    child = None
    if rank() == 0:
        child = os.fork()  # a helper forked without exec (as a DataLoader worker under fork is)
        if child == 0:
            deadline = time.monotonic() + 90
            while not os.path.exists(os.path.join(a.out, "release")) and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)
    dist.barrier()
    if rank() == 0:
        write_json(os.path.join(a.out, "ready.json"), {"pid": os.getpid(), "child": child})
    time.sleep(60)  # the test SIGKILLs this run long before
    os._exit(1)


def claim(a):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    model = build()
    t0, wall = time.monotonic(), time.time()
    try:
        ckpt.check_root(a.root, model, timeout=TIMEOUT)
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    res = {"error": error, "secs": round(time.monotonic() - t0, 3), "started": wall, "claimed_at": time.time(),
           "pid": os.getpid(), "listing": listing(a.root)}
    if rank() == 0:
        with open(os.path.join(a.root, ckpt.OWNER)) as f:
            res["owner"] = f.read()
        write_json(os.path.join(a.out, "claim.json"), res)
    ckpt.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "hold", "claim"])
    p.add_argument("out")
    p.add_argument("--root")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", choices=["first_rename", "second_rename", "after_fsync"])
    p.add_argument("--kill-step", type=int)
    p.add_argument("--no-fork-hook", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format=f"[rank{os.environ.get('RANK', '-')}] %(message)s")
    {"train": train, "hold": hold, "claim": claim}[a.mode](a)


if __name__ == "__main__":
    main()
