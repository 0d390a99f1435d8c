"""A compact FSDP2 training script for a small Llama-style LM, checkpointed with ckpt.py.

    torchrun --standalone --nproc_per_node 2 train_fsdp.py               # train 200 steps, save every 50
    torchrun --standalone --nproc_per_node 2 train_fsdp.py --resume      # continue from the newest checkpoint
    torchrun --standalone --nproc_per_node 2 train_fsdp.py --resume-from checkpoints/step-00000100  # roll back
    torchrun --standalone --nproc_per_node 4 train_fsdp.py --hsdp 2      # HSDP: 2 replicas x 2 shards
    python train_fsdp.py --steps 20                                      # one process, no torchrun
    ./run_multinode.sh --resume                                          # several nodes (see README)

CPU with gloo when there is no GPU; CUDA with NCCL and bf16 mixed precision when there is. FSDP2 keeps
fp32 master weights whatever --mixed-precision says: the optimizer and the checkpoints see fp32.
Parameter names follow Hugging Face Llama, so consolidate.py output loads in `transformers`.
"""

import argparse
import contextlib
import datetime
import gc
import json
import logging
import math
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ckpt


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=200, help="length of the whole run in optimizer steps (sets the LR schedule)")
    g.add_argument("--stop-after", type=int, default=None, help="end this process cleanly after step K, having saved")
    g.add_argument("--seed", type=int, default=0, help="seeds the model init, the data order and dropout")
    g.add_argument("--log-file", default=None, help="append one JSON object per step (rank 0)")
    g.add_argument("--timeout", type=float, default=300, help="training collectives timeout, seconds")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint root, shared by all ranks")
    g.add_argument("--save-every", type=int, default=50, help="save every K steps (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="keep the newest K committed checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    g.add_argument("--resume-from", metavar="PATH", default=None, help="continue from this checkpoint (e.g. "
                   "an older step-NNNNNNNN, to roll back after a loss spike); implies --resume, saves still go "
                   "to --ckpt-dir")
    g.add_argument("--ckpt-timeout", type=float, default=3600, help="checkpoint collectives timeout, seconds")
    g.add_argument("--async-save", action="store_true", help="write periodic checkpoints in the background")
    g.add_argument("--init-from", default=None, help="start from consolidated safetensors (file or directory)")
    g = p.add_argument_group("model")
    g.add_argument("--vocab-size", type=int, default=256, help="tokens; 256 covers --data bytes")
    g.add_argument("--dim", type=int, default=128, help="hidden size")
    g.add_argument("--n-layers", type=int, default=4)
    g.add_argument("--n-heads", type=int, default=4)
    g.add_argument("--ffn-dim", type=int, default=None, help="SwiGLU hidden size (default about 8/3 * dim)")
    g.add_argument("--dropout", type=float, default=0.1, help="residual dropout (makes resume depend on RNG state)")
    g.add_argument("--tie-embeddings", action="store_true", help="lm_head.weight is model.embed_tokens.weight")
    g = p.add_argument_group("parallelism and precision")
    g.add_argument("--hsdp", type=int, default=None, metavar="R", help="HSDP: R replicas, each sharded over "
                   "world/R ranks (2-D mesh R x world/R); default: shard over all ranks")
    g.add_argument("--mixed-precision", choices=("fp32", "bf16"), default=None, help="compute dtype of forward "
                   "and backward; master weights, gradient reduction and checkpoints stay fp32 (default: bf16 on "
                   "CUDA, fp32 on CPU)")
    g = p.add_argument_group("data and optimization")
    g.add_argument("--data", default=None, help="train on this file's bytes instead of the synthetic corpus")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences, split over ranks")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine decay to 10%%")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    args = p.parse_args(argv)
    if args.ffn_dim is None:
        args.ffn_dim = 8 * ((8 * args.dim // 3 + 7) // 8)
    if args.mixed_precision is None:
        args.mixed_precision = "bf16" if torch.cuda.is_available() else "fp32"
    args.resume = args.resume or args.resume_from is not None
    return args


# ---------------------------------------------------------------------------
# Model: Hugging Face Llama layout and numerics (rotate-half RoPE, fp32 RMSNorm)
# ---------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim, ffn_dim):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = Attention(cfg.dim, cfg.n_heads)
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)


class LlamaLM(nn.Module):
    """model.embed_tokens, model.layers.N.{self_attn,mlp,...}, model.norm, lm_head: HF's names."""

    def __init__(self, cfg):
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # one Parameter under both names, as HF's tie_word_embeddings
            self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(cfg.seq_len).float(), inv_freq)
        # Buffers derived from the config: not persistent, so not part of the checkpoint.
        self.register_buffer("cos", torch.cat((freqs, freqs), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((freqs, freqs), -1).sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.model.embed_tokens(idx)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def hf_config(args):
    """The model configuration in the form `transformers` reads as config.json."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": args.vocab_size, "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads, "max_position_embeddings": args.seq_len,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------
# Data: sample i depends only on (seed, i), so any world size reads the same stream
# ---------------------------------------------------------------------------


def sample(args, i, corpus):
    g = torch.Generator().manual_seed(args.seed * 2**32 + i)
    n = args.seq_len + 1
    if corpus is not None:  # --data: a random window of the file's bytes
        start = torch.randint(len(corpus) - n, (1,), generator=g).item()
        return corpus[start : start + n].long()
    # Synthetic: random sentences over a fixed dictionary of random "words" (from the seed),
    # so the loss falls as the model learns the words.
    words = synthetic_words(args)
    ids = torch.randint(len(words), (n,), generator=g)  # n words always cover n tokens
    return torch.cat([words[j] for j in ids.tolist()])[:n]


_words = {}


def synthetic_words(args):
    key = (args.seed, args.vocab_size)
    if key not in _words:
        g = torch.Generator().manual_seed(args.seed)
        lengths = torch.randint(2, 7, (64,), generator=g).tolist()
        _words[key] = [torch.randint(args.vocab_size, (n,), generator=g) for n in lengths]
    return _words[key]


def get_batch(args, corpus, samples_done, rank, world, device):
    """This rank's share of the global batch that starts at global sample `samples_done`."""
    per_rank = args.batch_size // world
    first = samples_done + rank * per_rank
    seqs = torch.stack([sample(args, first + j, corpus) for j in range(per_rank)]).to(device)
    return seqs[:, :-1], seqs[:, 1:]


class TrainState:
    """Step and data position (global samples consumed): what the loop needs to continue.

    Also records what defines the data stream: resuming with another seed, global batch or
    sequence length would silently train on different samples than the interrupted run.
    """

    def __init__(self, args=None):
        self.step, self.samples = 0, 0
        self.stream = {k: getattr(args, k) for k in ("seed", "batch_size", "seq_len")} if args else {}

    def state_dict(self):
        return {"step": self.step, "samples": self.samples, **self.stream}

    def load_state_dict(self, sd):
        changed = [f"--{k.replace('_', '-')} {sd[k]} -> {v}" for k, v in self.stream.items() if sd.get(k, v) != v]
        if changed:
            raise ValueError(f"this resume changes the data stream ({', '.join(changed)}): "
                             "pass the values the checkpoint was trained with")
        self.step, self.samples = int(sd["step"]), int(sd["samples"])


def lr_lambda(args):
    def f(step):  # LambdaLR calls this with the number of scheduler steps taken
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min((step - args.warmup) / max(args.steps - args.warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# ---------------------------------------------------------------------------
# Distributed setup, paired with teardown in main()
# ---------------------------------------------------------------------------


def init_distributed(timeout_s):
    if "RANK" not in os.environ:  # plain `python train_fsdp.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None)
    return device


def build_model(args, device):
    torch.manual_seed(args.seed)  # every rank builds the same full model, then keeps its shard
    model = LlamaLM(args).to(device)
    # HSDP: each parameter is sharded over a "shard" group and its gradient all-reduced across the R replicas.
    mesh = init_device_mesh(device.type, (args.hsdp, dist.get_world_size() // args.hsdp),
                            mesh_dim_names=("replicate", "shard")) if args.hsdp else None
    # bf16 is the compute dtype only: FSDP2 keeps the sharded parameters (what the optimizer steps and
    # ckpt saves) in fp32 and casts a copy at each all-gather; gradients are reduced in fp32.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = bf16 if args.mixed_precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The root group holds embed_tokens, norm and lm_head: a tied embed_tokens/lm_head weight must live in a
    # single group (fully_shard refuses a Parameter shared by two).
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def init_from(model, path, rank):
    """Rank 0 reads the full safetensors weights; FSDP2 broadcasts and each rank keeps its shard."""
    full = {}
    if rank == 0:
        from safetensors.torch import load_file

        files = [path]
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
            else:
                files = [os.path.join(path, "model.safetensors")]
        for f in files:
            full.update(load_file(f))
        full = {k: v.float() for k, v in full.items()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def main(argv=None):
    args = get_args(argv)
    device = init_distributed(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank{rank}] %(message)s")
    try:
        return train(args, device, rank, world)
    finally:
        teardown()


def teardown():
    try:
        ckpt.close()  # commits a save in flight, releases the root, ends ckpt's thread and process groups
    finally:
        # FSDP2 keeps its gloo group's worker threads alive past destroy_process_group(); one still releasing a
        # collective issued in backward needs the GIL, and at interpreter shutdown that kills it mid-destructor
        # (SIGABRT). gc.collect() first holds us long enough that the next bytecode hands them the GIL.
        gc.collect()
        dist.destroy_process_group()


def train(args, device, rank, world):
    if args.batch_size % world:
        # Before any checkpoint is read or step taken. On a resume, keeping --batch-size and changing the
        # number of ranks continues the same run; changing --batch-size changes the rest of it.
        fits = [str(n) for n in range(1, args.batch_size + 1) if args.batch_size % n == 0]
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the world size {world} (the global "
                         f"batch is split evenly over ranks): run on a number of ranks that divides it ({', '.join(fits)}), "
                         f"or use a --batch-size that is a multiple of {world}")
    if args.hsdp and (args.hsdp < 1 or world % args.hsdp):
        fits = [str(r) for r in range(1, world + 1) if world % r == 0]
        raise SystemExit(f"--hsdp {args.hsdp} does not divide the world size {world} (the mesh is R replicas x "
                         f"world/R shards): use one of {', '.join(fits)}")
    say = print if rank == 0 else (lambda *a, **k: None)
    corpus = None
    if args.data:
        with open(args.data, "rb") as f:
            corpus = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        if len(corpus) <= args.seq_len + 1 or args.vocab_size < 256:
            raise SystemExit(f"--data needs more than {args.seq_len + 1} bytes and --vocab-size >= 256")

    ckpt.check_root(args.ckpt_dir, timeout=args.ckpt_timeout)  # a bad --ckpt-dir fails now, not at the first save
    model = build_model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    state = TrainState(args)
    extra = {"scheduler": sched, "train": state}

    if args.resume:
        found = ckpt.load(args.resume_from or args.ckpt_dir, model, opt, extra, timeout=args.ckpt_timeout)
        if found is None and args.resume_from:  # a rollback must not quietly start over
            raise SystemExit(f"--resume-from {args.resume_from}: no checkpoint there")
        say(f"resumed from step {found}" if found is not None else f"nothing to resume in {args.ckpt_dir}: starting from step 0")
    if state.step == 0 and args.init_from:
        init_from(model, args.init_from, rank)
        say(f"initialized weights from {args.init_from}")

    # SIGTERM (preemption) sets a flag; ranks agree on it at the step boundary, so none exits alone.
    stop = {"flag": 0.0}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=1.0))

    def report(path, t0):
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        say(f"checkpoint {path} | {size / 1e6:.1f} MB | {time.time() - t0:.2f} s")

    def checkpoint(background):
        t0 = time.time()
        out = ckpt.save(args.ckpt_dir, state.step, model, opt, extra, keep=args.keep, async_save=background,
                        meta={"model_config": hf_config(args)}, timeout=args.ckpt_timeout)
        if not background:
            report(out, t0)
            return None
        say(f"checkpoint of step {state.step} staged, writing in the background ({time.time() - t0:.2f} s blocked)")
        return out, t0

    in_flight = None  # (PendingSave, start time) of an --async-save checkpoint
    log = open(args.log_file, "a") if (args.log_file and rank == 0) else contextlib.nullcontext()
    with log:
        while state.step < args.steps:
            t0 = time.time()
            x, y = get_batch(args, corpus, state.samples, rank, world, device)
            loss = F.cross_entropy(model(x).float().view(-1, args.vocab_size), y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            state.step += 1
            state.samples += args.batch_size
            # One all-reduce carries the loss for logging, the preemption flag and how many
            # ranks finished writing an in-flight checkpoint (commit only when all have).
            written = 1.0 if in_flight is None or in_flight[0].done() else 0.0
            stats = torch.tensor([loss.item(), stop["flag"], written], device=device)
            dist.all_reduce(stats)
            mean_loss, preempted = stats[0].item() / world, stats[1].item() > 0
            tok_s = args.batch_size * args.seq_len / (time.time() - t0)
            say(f"step {state.step:5d} | loss {mean_loss:.4f} | lr {lr:.3e} | {tok_s:,.0f} tok/s")
            if args.log_file and rank == 0:
                log.write(json.dumps({"step": state.step, "loss": mean_loss, "lr": lr, "samples": state.samples}) + "\n")
                log.flush()
            if in_flight and stats[2].item() == world:
                report(in_flight[0].wait(), in_flight[1])
                in_flight = None
            done = state.step in (args.steps, args.stop_after) or preempted
            if done:  # the last save is synchronous: it first commits any save in flight
                checkpoint(background=False)
            elif args.save_every and state.step % args.save_every == 0:
                in_flight = checkpoint(background=args.async_save)
            if preempted:
                say("preempted (SIGTERM on some rank): checkpoint saved, exiting")
            if done:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
