"""A pipelined training loop (torch.distributed.pipelining), each rank one stage, checkpointed with ckpt.py.

    torchrun --standalone --nproc_per_node 2 tests/pipeline_loop.py --steps 8 --stop-after 4   # pp=2
    torchrun --standalone --nproc_per_node 2 tests/pipeline_loop.py --steps 8 --resume
    torchrun --standalone --nproc_per_node 4 tests/pipeline_loop.py --steps 8                  # pp=2 x dp=2
    torchrun --standalone --nproc_per_node 2 tests/pipeline_loop.py --steps 2 --collide        # refused save

Stages the way torchtitan splits a model: every rank builds the full model from one seed, then deletes the
layers other stages own and sets the embedding (all but the first stage) and the norm and head (all but the
last) to None, so that each stage keeps its parameters under their original names (layers.2.fc1.weight on
stage 1 as in the full model). The mesh is (pp, dp): the ranks of one dp index across stages form the pp
group, and with dp > 1 each stage is fully_shard-ed over its dp group. A real schedule (GPipe or 1F1B, with
--microbatches >= 2) runs forward and backward; the loss is known on the last stage, whose first dp rank logs.

test_resume.py's script contract: --steps N (saves its last step), --stop-after K (saves step K, exits 0),
--resume (the newest checkpoint in --ckpt-dir, or step 0 if none), --ckpt-dir D, --log-file F (one JSON
object per step: step, loss, lr and the data position). State: AdamW with two param groups (decay, no decay)
on each stage, so four groups in all; a OneCycleLR and the data position as extras, equal on every rank
(stored once); an EMA of the stage's parameters, one per stage under the stage's own name (ema0, ema1),
as ckpt asks of a stage's own state; dropout, so that each rank's generators matter.

--collide: every stage passes its EMA under one name ("ema"): the stages' EMAs hold different parameter
names, so the one key extra.ema has different values on different ranks, and save() refuses it.

Data: global sample i depends only on (seed, i), and dp rank r of a step reads samples [r * n, (r + 1) * n)
of the step's global batch: another dp degree reads the same global batch.
"""

import argparse
import datetime
import json
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckpt  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=8, help="length of the whole run (the LR schedule spans it)")
p.add_argument("--stop-after", type=int, default=None, help="save after step K and exit")
p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
p.add_argument("--ckpt-dir", default="pipeline_ckpt")
p.add_argument("--log-file", default=None, help="the last stage's first dp rank appends one JSON object per step")
p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints (0: the last step only)")
p.add_argument("--pp", type=int, default=2, help="pipeline stages; data-parallel degree = world / pp")
p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
p.add_argument("--microbatches", type=int, default=2)
p.add_argument("--dropout", type=float, default=0.1)
p.add_argument("--seed", type=int, default=3)
p.add_argument("--collide", action="store_true", help="every stage's EMA under one name: save() must refuse")
args = p.parse_args()
vocab, dim, hidden, n_layers, seq_len, batch = 64, 32, 64, 4, 16, 8  # batch: global, in sequences


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Model(nn.Module):
    """The full model; a stage is this with the other stages' parts deleted (None), names unchanged."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})  # a dict: deleting keeps names
        self.norm, self.output = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, h):
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def keep_stage(model, stage):
    """Delete what other stages own: stage s keeps layers [s * L / pp, (s + 1) * L / pp)."""
    per = n_layers // args.pp
    for i in range(n_layers):
        if i // per != stage:
            del model.layers[str(i)]
    if stage != 0:
        model.tok_embeddings = None
    if stage != args.pp - 1:
        model.norm, model.output = None, None
    return model


class Data:
    """Global sample i depends only on (seed, i): mostly a walk along a fixed permutation, so it can be learned."""

    def __init__(self, dp_rank, dp_size):
        self.perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(args.seed))
        self.dp_rank, self.dp_size, self.samples = dp_rank, dp_size, 0

    def sample(self, i):
        g = torch.Generator().manual_seed(args.seed * 2**32 + i)
        tokens, jumps = [int(torch.randint(vocab, (1,), generator=g))], torch.rand(seq_len, generator=g) < 0.1
        noise = torch.randint(vocab, (seq_len,), generator=g)
        for t in range(seq_len):
            tokens.append(int(noise[t]) if jumps[t] else int(self.perm[tokens[-1]]))
        return torch.tensor(tokens)

    def next(self):
        n = batch // self.dp_size
        first = self.samples + self.dp_rank * n
        seqs = torch.stack([self.sample(i) for i in range(first, first + n)])
        self.samples += batch
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()  # torch 2.11's pipelining checks strides

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, sd):
        self.samples = sd["samples"]


class EMA:
    """An average of this stage's parameters, keyed by their names: each stage's has other keys."""

    def __init__(self, model, decay=0.9):
        self.model, self.decay = model, decay
        self.shadow = {n: w.detach().clone() for n, w in model.named_parameters()}

    @torch.no_grad()
    def update(self):
        for n, w in self.model.named_parameters():
            self.shadow[n].lerp_(w.detach(), 1 - self.decay)

    def state_dict(self):
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, sd):
        self.decay, self.shadow = sd["decay"], sd["shadow"]


dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
assert world % args.pp == 0 and n_layers % args.pp == 0 and batch % (world // args.pp * args.microbatches) == 0
mesh = init_device_mesh("cpu", (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
stage, dp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["dp"].size()
last = stage == args.pp - 1

torch.manual_seed(args.seed)  # one full model on every rank; each keeps its stage
model = keep_stage(Model(), stage)
if dp > 1:
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
decay = [w for w in model.parameters() if w.dim() >= 2]
no_decay = [w for w in model.parameters() if w.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95))
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[1e-2, 1e-2], total_steps=args.steps,
                                                pct_start=0.25)
data = Data(dp_rank, dp)
ema = EMA(model)
extra = {"sched": scheduler, "data": data, "ema" if args.collide else f"ema{stage}": ema}
torch.manual_seed(args.seed + 1 + rank)  # dropout: each rank's own
random.seed(args.seed + 1 + rank)


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, vocab), target.reshape(-1))


pipe = PipelineStage(model, stage, args.pp, torch.device("cpu"), group=mesh.get_group("pp"))
Schedule = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
schedule = Schedule(pipe, n_microbatches=args.microbatches, loss_fn=loss_fn)

log = open(args.log_file, "a") if args.log_file and last and dp_rank == 0 else None
try:
    step = ckpt.load(args.ckpt_dir, model, optimizer, extra) if args.resume else None
    step = step or 0
    ckpt.check_root(args.ckpt_dir, model)
    while step < args.steps:
        step += 1
        lr, position = scheduler.get_last_lr()[0], data.samples
        x, y = data.next()
        losses = []
        if stage == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update()
        if last:  # the mean over the microbatches, then over the dp ranks of the last stage
            loss = torch.stack(losses).mean().double().reshape(1)
            if dp > 1:
                dist.all_reduce(loss, group=mesh.get_group("dp"))
                loss /= dp
        if log:
            log.write(json.dumps({"step": step, "loss": loss.item(), "lr": lr, "samples": position}) + "\n")
            log.flush()
        final = step in (args.steps, args.stop_after)  # the last step is always saved
        if final or (args.save_every and step % args.save_every == 0):
            ckpt.save(args.ckpt_dir, step, model, optimizer, extra)
        if final:
            break
finally:
    if log:
        log.close()
    ckpt.close()
    dist.destroy_process_group()
