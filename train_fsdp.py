"""A compact FSDP2 training script for a small Llama-style LM, checkpointed with ckpt.py.

    torchrun --standalone --nproc_per_node 2 train_fsdp.py               # train 200 steps, save every 50
    torchrun --standalone --nproc_per_node 2 train_fsdp.py --resume      # continue from the newest checkpoint
    torchrun --standalone --nproc_per_node 2 train_fsdp.py --resume-from checkpoints/step-00000100 --rollback
    torchrun --standalone --nproc_per_node 4 train_fsdp.py --hsdp 2      # HSDP: 2 replicas x 2 shards
    python train_fsdp.py --steps 20                                      # one process, no torchrun
    ./run_multinode.sh --resume                                          # several nodes (see README)

CPU with gloo when there is no GPU; CUDA with NCCL and bf16 mixed precision when there is. FSDP2 keeps
fp32 master weights whatever --mixed-precision says: the optimizer and the checkpoints see fp32.
Parameter names follow Hugging Face Llama, so consolidate.py output loads in `transformers`.
"""

import argparse
import datetime
import gc
import glob
import json
import logging
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ckpt


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="length of the run in optimizer steps (sets the LR schedule)")
    p.add_argument("--stop-after", type=int, default=None, help="end this process cleanly after step K, having saved")
    p.add_argument("--seed", type=int, default=0, help="seeds the model init, the data order and dropout")
    p.add_argument("--log-file", default=None, help="append one JSON object per step (rank 0)")
    p.add_argument("--timeout", type=float, default=300, help="training collectives timeout, seconds")
    p.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint root, shared by all ranks")
    p.add_argument("--save-every", type=int, default=50, help="save every K steps (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="keep the newest K committed checkpoints (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    p.add_argument("--resume-from", metavar="PATH", help="resume from this checkpoint; saves still go to --ckpt-dir")
    p.add_argument("--rollback", action="store_true", help="with --resume-from: give up --ckpt-dir's later steps")
    p.add_argument("--ckpt-timeout", type=float, default=3600, help="checkpoint collectives timeout, seconds")
    p.add_argument("--async-save", action="store_true", help="write periodic checkpoints in the background")
    p.add_argument("--init-from", default=None, help="start from consolidated safetensors (file or directory)")
    p.add_argument("--vocab-size", type=int, default=256, help="tokens; 256 covers --data bytes")
    p.add_argument("--dim", type=int, default=128, help="hidden size")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=None, help="SwiGLU hidden size (default about 8/3 * dim)")
    p.add_argument("--dropout", type=float, default=0.1, help="residual dropout (makes resume depend on RNG state)")
    p.add_argument("--tie-embeddings", action="store_true", help="lm_head.weight is model.embed_tokens.weight")
    p.add_argument("--hsdp", type=int, metavar="R", help="HSDP: R replicas, each sharded over world/R ranks")
    p.add_argument("--mixed-precision", choices=("fp32", "bf16"), help="forward/backward dtype (default: bf16 on CUDA)")
    p.add_argument("--data", default=None, help="train on this file's bytes instead of the synthetic corpus")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences, split over ranks")
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank (0: none)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine decay to 10%%")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    args = p.parse_args(argv)
    args.ffn_dim = args.ffn_dim or 8 * ((8 * args.dim // 3 + 7) // 8)
    args.mixed_precision = args.mixed_precision or ("bf16" if torch.cuda.is_available() else "fp32")
    args.resume = args.resume or args.resume_from is not None
    if args.keep < 0 or (args.stop_after or 0) < 0 or (args.rollback and not args.resume_from):
        p.error("--keep and --stop-after take K >= 0, and --rollback needs --resume-from (the step to go back to)")
    return args


# --- Model: Hugging Face Llama's names and numerics (rotate-half RoPE, RMSNorm in fp32) ---
class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)


def rope(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = attn = nn.Module()  # self_attn and mlp are plain containers, for HF's names
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj = (nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) for _ in range(2))
        mlp.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        heads = (*x.shape[:2], self.n_heads, -1)  # (batch, seq, head, head_dim)
        h = self.input_layernorm(x)
        q = rope(self.self_attn.q_proj(h).view(heads).transpose(1, 2), cos, sin)
        k = rope(self.self_attn.k_proj(h).view(heads).transpose(1, 2), cos, sin)
        v = self.self_attn.v_proj(h).view(heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.self_attn.o_proj(y.transpose(1, 2).reshape(x.shape)))
        h = self.post_attention_layernorm(x)
        return x + self.dropout(self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)))


class LlamaLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.model = nn.Module()  # a plain container: HF's names are model.embed_tokens, model.layers.N, ...
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.model.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one Parameter under both names, as HF's tie_word_embeddings
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)  # from the config: not in the checkpoint
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.model.embed_tokens(idx)
        cos, sin = self.cos[: idx.shape[1]].to(x.dtype), self.sin[: idx.shape[1]].to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def hf_config(args):  # the model's config.json, in the form `transformers` reads
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "rope_theta": 10000.0,
            "num_key_value_heads": args.n_heads, "max_position_embeddings": args.seq_len, "mlp_bias": False,
            "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "torch_dtype": "float32"}


class Samples(torch.utils.data.Dataset):
    """Item i: global sample i as (inputs, targets), from (seed, i) alone: any world size or worker reads the same.
    An epoch is 2**20 samples (ckpt.SkippingSampler hands them out in order: each is random already)."""

    def __len__(self):
        return 1 << 20

    def __init__(self, args):
        self.seed, self.n, self.corpus = args.seed, args.seq_len + 1, None
        if args.data:
            with open(args.data, "rb") as f:
                self.corpus = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
            if len(self.corpus) <= self.n or args.vocab_size < 256:
                raise SystemExit(f"--data needs more than {self.n} bytes and --vocab-size >= 256")
        g = torch.Generator().manual_seed(args.seed)  # synthetic: sentences over 64 random "words", learnt as they come
        lengths = torch.randint(2, 7, (64,), generator=g).tolist()
        self.words = [torch.randint(args.vocab_size, (n,), generator=g) for n in lengths]

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 2**32 + i)
        if self.corpus is not None:  # a random window of the file's bytes
            start = torch.randint(len(self.corpus) - self.n, (1,), generator=g).item()
            seq = self.corpus[start : start + self.n].long()
        else:  # n words always cover n tokens
            seq = torch.cat([self.words[j] for j in torch.randint(len(self.words), (self.n,), generator=g).tolist()])
        return seq[: self.n - 1], seq[1 : self.n]


def lr_lambda(args):
    def f(step):  # LambdaLR calls this with the number of scheduler steps taken
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def build_model(args, device):
    torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shard
    random.seed(args.seed)  # unused here, but saved like every generator: runs compare equal to the last bit
    model = LlamaLM(args).to(device)
    mesh = None
    if args.hsdp:  # each parameter sharded within a "shard" group, its gradient all-reduced across the R replicas
        shape = (args.hsdp, dist.get_world_size() // args.hsdp)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    # bf16 is the compute dtype only: FSDP2 keeps the sharded parameters (what the optimizer steps and ckpt
    # saves) in fp32 and casts a copy at each all-gather; gradients are reduced in fp32.
    param_dtype, reduce_dtype = (torch.bfloat16, torch.float32) if args.mixed_precision == "bf16" else (None, None)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The root group holds embed_tokens, norm and lm_head: a tied embed_tokens/lm_head weight must live in a
    # single group (fully_shard refuses a Parameter shared by two).
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def init_from(model, path, rank):
    """Rank 0 reads the full safetensors weights; FSDP2 broadcasts and each rank keeps its shard."""
    full = {}
    if rank == 0:  # a file, or a directory of model.safetensors or numbered model-0000i-of-0000N.safetensors
        files = sorted(glob.glob(os.path.join(path, "model*.safetensors"))) if os.path.isdir(path) else [path]
        for file in files:
            full.update({name: tensor.float() for name, tensor in load_file(file).items()})
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def train(args, device, rank, world):
    # Before any checkpoint is read: a resume on other ranks continues the run only if --batch-size stays.
    if args.batch_size % world:
        fits = ", ".join(str(n) for n in range(1, args.batch_size + 1) if args.batch_size % n == 0)
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the world size {world} (the global "
                         f"batch is split evenly over ranks): run on a number of ranks that divides it ({fits}), "
                         f"or use a --batch-size that is a multiple of {world}")
    if args.hsdp and (args.hsdp < 1 or world % args.hsdp):
        fits = ", ".join(str(r) for r in range(1, world + 1) if world % r == 0)
        raise SystemExit(f"--hsdp {args.hsdp} does not divide the world size {world} (the mesh is R replicas x "
                         f"world/R shards): use one of {fits}")
    say = print if rank == 0 else (lambda *a, **k: None)
    dataset = Samples(args)
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    # The data's place in global samples; a resume with another global batch, seed or sequence length is refused
    # (it would silently read other samples than the run it continues).
    position = ckpt.Position(global_batch=args.batch_size, seed=args.seed, seq_len=args.seq_len)
    extra = {"scheduler": sched, "data": position}
    # Global sample i goes to rank i % world: the first k samples are the same at any world size. The loader's own
    # generator: else iter() draws from torch's, which load() restored (dropout would shift).
    sampler = ckpt.SkippingSampler(dataset, num_replicas=world, rank=rank, shuffle=False, seed=args.seed)
    # Workers forked once, now, before the first collective: later, a gloo thread taking the GIL as the fork runs
    # can hang the child in Python < 3.12 (CPython issue 112275).
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size // world, sampler=sampler,
                                         num_workers=args.num_workers, worker_init_fn=ckpt.ignore_sigterm,
                                         generator=torch.Generator(), persistent_workers=args.num_workers > 0)
    iter(loader)
    preemption = ckpt.Preemption(device)  # a SIGTERM to any rank, known to every rank at the same step
    step = None
    try:  # the message of a refusal, not a traceback per rank
        if args.resume:
            step = ckpt.load(args.resume_from or args.ckpt_dir, model, opt, extra, timeout=args.ckpt_timeout)
            say(f"resumed from step {step}" if step is not None else f"nothing to resume in {args.ckpt_dir}: step 0")
        if step is None and args.resume_from:  # a rollback must not quietly start over
            raise SystemExit(f"--resume-from {args.resume_from}: no checkpoint there")
        step = step or 0
        # After the load: a bad --ckpt-dir, another live run there, or a break of the branch rule (commits there
        # and no --resume, or later ones than the step resumed) fail now; --rollback gives up the later steps.
        ckpt.check_root(args.ckpt_dir, model, rollback_to=step if args.rollback else None, timeout=args.ckpt_timeout)
    except ckpt.CheckpointError as e:
        raise SystemExit(f"train_fsdp.py: CheckpointError: {e}") from None
    if step == 0 and args.init_from:
        init_from(model, args.init_from, rank)
        say(f"initialized weights from {args.init_from}")
    last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)  # this process's last step
    data, done, first = position.batches(loader), step >= last, step + 1
    while not done:
        t0 = time.time()
        x, y = (t.to(device) for t in next(data))
        loss = F.cross_entropy(model(x).float().view(-1, args.vocab_size), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if args.async_save and step == first:  # the optimizer holds state: async saves' host memory, beside the loop
            ckpt.prepare_async(model, opt, extra)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss, preempted = mean_loss.item() / world, preemption.requested()
        tok_s = args.batch_size * args.seq_len / (time.time() - t0)
        say(f"step {step:5d} | loss {mean_loss:.4f} | lr {lr:.3e} | {tok_s:,.0f} tok/s")
        if args.log_file and rank == 0:
            with open(args.log_file, "a") as log:
                log.write(json.dumps(dict(step=step, loss=mean_loss, lr=lr, samples=position.samples)) + "\n")
        done = step >= last or preempted
        if done or (args.save_every and step % args.save_every == 0):
            background = args.async_save and not done  # the last save is synchronous: the run ends with it
            t0 = time.time()
            out = ckpt.save(args.ckpt_dir, step, model, opt, extra, keep=args.keep or None, async_save=background,
                            meta={"model_config": hf_config(args)}, timeout=args.ckpt_timeout)
            if background:  # it commits by itself once every rank's write is durable (ckpt logs the commit)
                say(f"checkpoint of step {step} staged, writing in the background ({time.time() - t0:.2f} s blocked)")
            else:
                size = sum(os.path.getsize(os.path.join(out, name)) for name in os.listdir(out))
                say(f"checkpoint {out} | {size / 1e6:.1f} MB | {time.time() - t0:.2f} s")
        if preempted:
            say("preempted (SIGTERM on some rank): checkpoint saved, exiting")
    return 0


def main(argv=None):
    args = get_args(argv)
    if "RANK" not in os.environ:  # plain `python train_fsdp.py`: a world of one, its store on any free port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}] %(message)s")
    try:
        return train(args, device, rank, world)
    finally:
        try:
            ckpt.close()  # commits a save in flight, releases the root, ends ckpt's thread and process groups
        finally:
            # gc first: a gloo thread of FSDP2 still releasing a collective of backward needs the GIL (else: SIGABRT)
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
