"""One rank of tests/test_preemption.py's own loop: the README's loop, with ckpt's glue imported as it imports it.

    python tests/preemption_job.py ROOT STEPS LOG [--resume] [--ready-after K] [--pause S] [--evidence DIR]
                                                  [--take-sigterm]

FSDP2 (gloo, CPU) over a small MLP with dropout, AdamW, a DataLoader with 2 workers (worker_init_fn=ignore_sigterm)
over a SkippingSampler read through Position.batches, ckpt.Preemption(torch.device("cpu")) asked after each step,
ckpt.save at the preempted step and at STEPS. Rank 0 appends {"step", "loss"} (the mean over ranks) to LOG. Each
rank prints "RANK r step S signal_at A requested_at B", A the first step after whose requested() its own SIGTERM
handler had run (None: it got none), B the step at which requested() first said yes (None: never); rank 0 prints
"RESUMED from step N" after a resume. Test scaffolding: after step K (of this process) each rank writes
DIR/ready.<rank> holding its pid; every step sleeps S s so that a signal lands mid-run; --take-sigterm (a control)
leaves the workers without ignore_sigterm.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckpt  # noqa: E402
from ckpt import Position, Preemption, SkippingSampler, ignore_sigterm  # noqa: E402  (the README's import)

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("steps", type=int)
p.add_argument("log")
p.add_argument("--resume", action="store_true")
p.add_argument("--ready-after", type=int)
p.add_argument("--pause", type=float, default=0.0)
p.add_argument("--evidence", default=".")
p.add_argument("--take-sigterm", action="store_true")
args = p.parse_args()

GLOBAL_BATCH, SAMPLES = 8, 80  # 10 steps an epoch


class Samples(torch.utils.data.Dataset):
    """Sample i: a fixed input and its target, from i alone (any worker, any rank, any run)."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        a, b = x[:4].sum(), x[4:].sum()
        return x, torch.stack([1.0 + torch.tanh(a - b), torch.tanh(a + b)])


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial weights on every rank; dropout draws from each rank's generator
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2))
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
dataset = Samples()
sampler = SkippingSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
loader = torch.utils.data.DataLoader(dataset, GLOBAL_BATCH // world, sampler=sampler, num_workers=2,
                                     worker_init_fn=None if args.take_sigterm else ignore_sigterm,
                                     generator=torch.Generator())
position = Position(global_batch=GLOBAL_BATCH)
extra = {"data": position}
step = (ckpt.load(args.root, model, optimizer, extra) or 0) if args.resume else 0
if args.resume and rank == 0:
    print(f"RESUMED from step {step}", flush=True)
preemption = Preemption(torch.device("cpu"))
signal_at = requested_at = None
done = 0  # steps of this process
try:
    ckpt.check_root(args.root, model)
    data = position.batches(loader)
    while step < args.steps:
        x, y = next(data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step, done = step + 1, done + 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the log's, not the preemption's
        if rank == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
        stop = preemption.requested()  # one all-reduce of one number: one rank's SIGTERM, known to all
        if preemption.received and signal_at is None:
            signal_at = step
        if stop and requested_at is None:
            requested_at = step
        if stop or step == args.steps:
            ckpt.save(args.root, step, model, optimizer, extra, keep=2)
        if stop:
            break
        if done == args.ready_after:
            with open(os.path.join(args.evidence, f"ready.{rank}.part"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(args.evidence, f"ready.{rank}.part"), os.path.join(args.evidence, f"ready.{rank}"))
        time.sleep(args.pause)
    print(f"RANK {rank} step {step} signal_at {signal_at} requested_at {requested_at}", flush=True)
finally:
    ckpt.close()
    gc.collect()
    dist.destroy_process_group()
