"""A training loop written the way a new user writes one, checkpointed only as the README says.

Not train_fsdp.py: a flat nanoGPT-style script (a GPT-2-like block, tied embeddings, a fused AdamW with
decay groups, OneCycleLR, a GradScaler, an EMA) that knows nothing of ckpt.py beyond check_root / load /
save / close. Small (one block of width 32) so that a run on a 2-core CPU is mostly its start-up.
tests/test_setups.py runs it under several layouts and wrappers; test_resume.py runs it with --script.

    torchrun --standalone --nproc_per_node 2 tests/user_loop.py --steps 16 --stop-after 8
    torchrun --standalone --nproc_per_node 2 tests/user_loop.py --steps 16 --resume
    torchrun --standalone --nproc_per_node 4 tests/user_loop.py --layout hsdp     # 2 replicas x 2 shards
    torchrun --standalone --nproc_per_node 4 tests/user_loop.py --layout tp --data global --dropout 0

Setups (all run on CPU with gloo):
  --layout fsdp   fully_shard over all ranks
  --layout hsdp   fully_shard on a 2-D mesh (replicate x shard)
  --layout tp     tensor parallel (q/k/v and fc column-wise, proj row-wise) on the "tp" mesh dimension,
                  then fully_shard over "dp"; the tp ranks of one dp rank see the same data and dropout seed
  --compile       torch.compile(model, backend="eager"): parameters are named "_orig_mod.*" as with any
                  backend, but nothing is code-generated, so it compiles in seconds on CPU
  --ac            activation checkpointing with checkpoint_wrapper: parameters named
                  "*._checkpoint_wrapped_module.*". torch 2.13 has no public import path for it
                  (torch.distributed.algorithms._checkpoint); a test script may use it, shipped files may not
  --mixed-precision bf16   FSDP2 MixedPrecisionPolicy (bf16 compute, fp32 master weights and reduction)

The model always has what real models bring: tied input/output embeddings (both in the root FSDP group:
torch 2.13 refuses a parameter shared across groups), dropout, a trainable parameter that never gets a
gradient ("unused"), and a branch used only on every third step ("aux"), so its AdamW step lags. `extra`
holds a OneCycleLR (or SequentialLR) scheduler, a GradScaler (disabled: enabled only for fp16, which this
script does not offer; its state_dict() is {}), an EMA of the sharded parameters (DTensors, made from the
parameters when the EMA is built, before load(), which reads each saved shadow into them: an EMA built at its
first update would hold no tensor at load(), and ckpt refuses it by name), and the data stream: with
--data per-rank (default) each rank draws from its own torch and numpy generators, so that state differs per
rank and cannot move to another world size (so it is passed as ckpt.PerRank(data)); with --data global sample
i depends only on (seed, i), as in
train_fsdp.py. ckpt refuses numpy values in extras (load() could not restore them without running code from
the checkpoint): RankStream.state_dict() converts its numpy state to ints and tensors, load_state_dict() back.

--ema-not-loaded: the EMA is updated and saved but not passed to load(), a realistic user mistake (ckpt only
warns "not restored from ...: ema"): the resumed run's EMA restarts from the initial weights, so its final
checkpoint differs from an uninterrupted run's, while its losses do not. A checkpoint is saved at
the last step (--steps), so the final checkpoints of two runs can be compared.

--dump-state DIR gathers the full model and optimizer state, every rank's extras and the full EMA right before
each save and right after the load, into DIR/{saved,loaded}-step{N}.pt: a test check, too big for real models.
"""

import argparse
import datetime
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ckpt.py, copied next to us
import ckpt  # noqa: E402

p = argparse.ArgumentParser()
# The first six flags are test_resume.py's contract for any training script.
p.add_argument("--steps", type=int, default=16, help="length of the whole run (the LR schedule spans it)")
p.add_argument("--stop-after", type=int, default=None, help="save after step K and exit")
p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
p.add_argument("--ckpt-dir", default="user_ckpt")
p.add_argument("--log-file", default=None, help="rank 0 appends one JSON object per step")
p.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
p.add_argument("--layout", choices=["fsdp", "hsdp", "tp"], default="fsdp")
p.add_argument("--replicate", type=int, default=2, help="hsdp: replicas (mesh replicate x world/replicate)")
p.add_argument("--tp", type=int, default=2, help="tp: tensor-parallel degree (mesh world/tp x tp)")
p.add_argument("--compile", action="store_true")
p.add_argument("--ac", action="store_true")
p.add_argument("--mixed-precision", choices=["fp32", "bf16"], default="fp32")
p.add_argument("--sched", choices=["onecycle", "sequential"], default="onecycle")
p.add_argument("--data", choices=["per-rank", "global"], default="per-rank")
p.add_argument("--dropout", type=float, default=0.1)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--ema-decay", type=float, default=0.9)
p.add_argument("--ema-not-loaded", action="store_true", help="a user mistake: the EMA is saved, not loaded")
p.add_argument("--dump-state", default=None)
args = p.parse_args()
vocab, dim, n_layer, n_head, seq_len, batch = 96, 32, 1, 4, 16, 8  # batch: global, in sequences

# -------------------------------------------------------------------------------- model


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        # Separate q/k/v, not nanoGPT's fused c_attn: column-wise TP of a fused weight would hand
        # one rank all of q and half of k, a different model from the unsharded one.
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under TP each rank holds n_head / tp of them.
        q, k, v = (f(x).view(B, T, -1, dim // n_head).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), SelfAttention(), nn.LayerNorm(dim)
        self.fc, self.proj = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq_len, dim)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.aux = nn.Linear(dim, dim)  # used on every third step only
        self.unused = nn.Linear(dim, dim)  # trainable, never in the forward pass: never gets a gradient
        self.drop = nn.Dropout(args.dropout)
        for w in self.parameters():
            if w.dim() == 2:
                nn.init.normal_(w, std=0.02)

    def forward(self, idx, use_aux):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.h:
            x = block(x)
        if use_aux:
            x = x + self.aux(x)
        return self.lm_head(self.ln_f(x))


# -------------------------------------------------------------------------------- data


def words():
    """A fixed dictionary of random 'words' (same on every rank): the loss falls as they are learned."""
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(vocab, (int(n),), generator=g) for n in torch.randint(2, 6, (48,), generator=g)]


class RankStream:
    """This rank's own stream: a torch generator picks words, a numpy one the crop offset."""

    def __init__(self, dp_rank):
        self.words = words()
        self.gen = torch.Generator().manual_seed(1000 * args.seed + dp_rank)
        self.np_rng = np.random.default_rng(1000 * args.seed + dp_rank)
        self.batches, self.seen = 0, np.zeros(len(self.words), dtype=np.int64)

    def next(self, n):
        seqs = []
        for _ in range(n):
            ids = torch.randint(len(self.words), (seq_len + 1,), generator=self.gen)
            np.add.at(self.seen, ids.numpy(), 1)
            off = int(self.np_rng.integers(0, 4))
            seqs.append(torch.cat([self.words[i] for i in ids.tolist()])[off:off + seq_len + 1])
        self.batches += 1
        return torch.stack(seqs)

    def state_dict(self):
        # ckpt refuses numpy (load() could not restore it without running code from the checkpoint): the
        # torch generator's state is a uint8 tensor, numpy's PCG64 state goes as ints, the counts as a tensor.
        st = self.np_rng.bit_generator.state
        np_rng = {"state": int(st["state"]["state"]), "inc": int(st["state"]["inc"]),
                  "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])}
        return {"gen": self.gen.get_state(), "np_rng": np_rng, "batches": self.batches,
                "seen": torch.from_numpy(self.seen.copy())}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["gen"])
        st = sd["np_rng"]
        self.np_rng.bit_generator.state = {"bit_generator": "PCG64", "state": {"state": st["state"], "inc": st["inc"]},
                                           "has_uint32": st["has_uint32"], "uinteger": st["uinteger"]}
        self.batches, self.seen = int(sd["batches"]), sd["seen"].numpy().astype(np.int64)


class GlobalStream:
    """Sample i depends only on (seed, i): the same for every rank and world size, so it reshards."""

    def __init__(self, dp_rank, dp_size):
        self.words, self.dp_rank, self.dp_size, self.samples = words(), dp_rank, dp_size, 0

    def next(self, n):
        first = self.samples + self.dp_rank * n
        seqs = []
        for i in range(first, first + n):
            g = torch.Generator().manual_seed(args.seed * 2**32 + i)
            ids = torch.randint(len(self.words), (seq_len + 1,), generator=g)
            seqs.append(torch.cat([self.words[j] for j in ids.tolist()])[:seq_len + 1])
        self.samples += n * self.dp_size
        return torch.stack(seqs)

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, sd):
        self.samples = sd["samples"]


class EMA:
    """Exponential moving average of the sharded parameters (DTensors, each laid out like its parameter),
    keyed by the parameter's name without wrapper parts (torch.compile's _orig_mod, activation
    checkpointing's _checkpoint_wrapped_module), so that toggling a wrapper keeps its keys. Its shadows are
    made from the parameters when it is built, before load(): ckpt reads each saved shadow into the EMA's own
    DTensor (laid out as it will be trained); an EMA built at its first update would be empty at load(), and
    ckpt refuses it (a DTensor saved would come back as a plain tensor)."""

    def __init__(self, model, decay):
        self.model, self.decay = model, decay
        with torch.no_grad():
            self.shadow = {n: p.detach().clone() for n, p in self.params().items()}

    def params(self):
        return {".".join(k for k in n.split(".") if not k.startswith("_")): p for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def update(self):
        params = self.params()  # one foreach op for all of them, as timm's ModelEmaV3 does
        torch._foreach_lerp_([self.shadow[n] for n in params], [p.detach() for p in params.values()], 1 - self.decay)

    def state_dict(self):
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, sd):
        self.decay, self.shadow = sd["decay"], sd["shadow"]


class Progress:
    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


# -------------------------------------------------------------------------------- setup

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
mp = bf16 if args.mixed_precision == "bf16" else MixedPrecisionPolicy()

torch.manual_seed(args.seed)  # the same full model on every rank, whatever the layout
model = GPT()
if args.layout == "tp":
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    for block in model.h:
        parallelize_module(block, mesh["tp"], {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                               "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                               "fc": ColwiseParallel(), "proj": RowwiseParallel()})
    fsdp_mesh, dp_rank, dp_size = mesh["dp"], mesh["dp"].get_local_rank(), mesh["dp"].size()
elif args.layout == "hsdp":  # replicas and shards are both data parallel: every rank reads its own data
    fsdp_mesh = init_device_mesh("cpu", (args.replicate, world // args.replicate),
                                 mesh_dim_names=("replicate", "shard"))
    dp_rank, dp_size = rank, world
else:
    fsdp_mesh, dp_rank, dp_size = init_device_mesh("cpu", (world,)), rank, world
if args.ac:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.h):
        model.h[i] = checkpoint_wrapper(block)
for block in model.h:
    fully_shard(block, mesh=fsdp_mesh, mp_policy=mp)
fully_shard(model, mesh=fsdp_mesh, mp_policy=mp)  # root group: wte and the tied lm_head together

decay = [w for w in model.parameters() if w.dim() >= 2]
no_decay = [w for w in model.parameters() if w.dim() < 2]
# fused: one kernel per step, as many set it on GPU (on CPU torch's default loops over the parameters, each
# op a DTensor dispatch, and slow the first time each is seen)
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), fused=True)
if args.sched == "onecycle":
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[1e-2, 1e-2], total_steps=args.steps,
                                                    pct_start=0.25)
else:
    warm = max(args.steps // 4, 1)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps - warm)], [warm])
scaler = torch.amp.GradScaler("cpu", enabled=False)
data = RankStream(dp_rank) if args.data == "per-rank" else GlobalStream(dp_rank, dp_size)
if args.compile:
    model = torch.compile(model, backend="eager")
torch.manual_seed(args.seed + 1 + dp_rank)  # dropout: per data-parallel rank, shared by the tp ranks of one
random.seed(args.seed + 1 + dp_rank)  # unused, but saved like every generator: seeded, runs compare to the bit
progress = Progress()
ema = EMA(model, args.ema_decay)
position = ckpt.PerRank(data) if args.data == "per-rank" else data  # this rank's own: say so (stored per rank)
extra = {"sched": scheduler, "scaler": scaler, "data": position, "progress": progress, "ema": ema}


def dump(kind):
    """Full state, gathered to rank 0 (test check only), and whether the embeddings are still tied."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True))
    extras = [None] * world
    dist.all_gather_object(extras, {k: v.state_dict() for k, v in extra.items() if k != "ema"})
    shadow = {n: t.full_tensor() for n, t in ema.shadow.items()}  # collective
    raw = getattr(model, "_orig_mod", model)  # under --compile; only to look at the tie
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "extra": extras, "ema": shadow, "world": world,
                    "tied": raw.lm_head.weight is raw.wte.weight},
                   os.path.join(args.dump_state, f"{kind}-step{progress.step}.pt"))


# -------------------------------------------------------------------------------- train

log = open(args.log_file, "a") if args.log_file and rank == 0 else None
try:
    if args.resume:
        loaded = {k: v for k, v in extra.items() if not (args.ema_not_loaded and k == "ema")}
        found = ckpt.load(args.ckpt_dir, model, optimizer, loaded)  # None: nothing saved yet, start at 0
        if found is not None and args.dump_state:
            dump("loaded")
    ckpt.check_root(args.ckpt_dir, model)  # after load(): a root holding checkpoints this run did not load is refused
    while progress.step < args.steps:
        progress.step += 1
        seqs = data.next(batch // dp_size)
        x, y = seqs[:, :-1], seqs[:, 1:]
        use_aux = progress.step % 3 == 0  # the same on every rank: FSDP reduces every group's gradients together
        loss = F.cross_entropy(model(x, use_aux).float().reshape(-1, vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        lr = scheduler.get_last_lr()[0]
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update()
        stats = torch.zeros(1 + world, dtype=torch.float64)  # mean loss, and each rank's token sum
        stats[0], stats[1 + rank] = loss.item() / world, float(seqs.sum())
        dist.all_reduce(stats)
        if log:
            log.write(json.dumps({"step": progress.step, "loss": stats[0].item(), "lr": lr, "aux": use_aux,
                                  "tokens": stats[1:].tolist()}) + "\n")
            log.flush()
        last = progress.step in (args.steps, args.stop_after)  # the last step is always saved
        if last or (args.save_every and progress.step % args.save_every == 0):
            if args.dump_state:
                dump("saved")
            ckpt.save(args.ckpt_dir, progress.step, model, optimizer, extra)
        if last:
            break
finally:
    if log:
        log.close()
    ckpt.close()  # every rank, before the process group goes
    dist.destroy_process_group()
