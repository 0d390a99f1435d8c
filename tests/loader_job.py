"""One rank of a data-loading job for tests/test_dataloaders.py: ckpt's resume glue, as the README's loop imports it.

    python tests/loader_job.py ROOT STEPS [--stop-after K] [--resume] [--global-batch B] [--keep-loader]
                                          [--forget-position]

Position, SkippingSampler and ignore_sigterm are ckpt's, imported as the README's loop imports them. The data set is
the numbers 0-23; a global batch of 8 makes 3 steps an epoch. The loader is torchdata's StatefulDataLoader (2
workers) in the extras as "loader", left out of the load at another world size as the README's recipe does
(--keep-loader: passed anyway; --forget-position, a control: the position is not loaded, as by a loop that forgets
it). Each step's batch of every rank is gathered; rank 0 prints RESULT {"batches": {step: [rank 0's, ...]},
"resumed": step or None}, or RESULT {"error": message} if the load failed.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckpt  # noqa: E402
from ckpt import Position, SkippingSampler, ignore_sigterm  # noqa: E402  (the README's import)

p = argparse.ArgumentParser()
p.add_argument("root")
p.add_argument("steps", type=int)
p.add_argument("--stop-after", type=int)
p.add_argument("--resume", action="store_true")
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--keep-loader", action="store_true")
p.add_argument("--forget-position", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = list(range(24))
sampler = SkippingSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=3)
loader = StatefulDataLoader(dataset, args.global_batch // world, sampler=sampler, num_workers=2,
                            worker_init_fn=ignore_sigterm, generator=torch.Generator())
position = Position(global_batch=args.global_batch)
extra = {"data": position, "loader": loader}
step, result = 0, {"resumed": None}
try:
    if args.resume:  # the README's recipe: the loader is left out of a load at another world size
        found = ckpt.find_checkpoint(args.root)
        resized = found is not None and ckpt.read_manifest(found)["world_size"] != world
        keep = args.keep_loader or not resized
        dropped = {"loader"} if not keep else set()
        dropped |= {"data"} if args.forget_position else set()
        loaded = {k: v for k, v in extra.items() if k not in dropped}
        step = result["resumed"] = ckpt.load(args.root, model, optimizer, loaded) or 0
    data = position.batches(loader)
    batches = {}
    while step < (args.stop_after or args.steps):
        step += 1
        mine = next(data).tolist()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        batches[step] = everyone
        model(torch.tensor([[float(sum(map(sum, everyone))), 1.0]])).sum().backward()  # alike on every rank
        optimizer.step()
        optimizer.zero_grad()
    ckpt.save(args.root, step, model, optimizer, extra)
    result["batches"] = batches
except ckpt.CheckpointError as e:
    result = {"error": str(e)}
finally:
    ckpt.close()
if rank == 0:
    print("RESULT " + json.dumps(result), flush=True)
dist.destroy_process_group()
