"""Benchmark ckpt.py against plain DCP, the raw disk and the full-state-dict baseline (CPU with gloo, or CUDA).

    python bench/bench.py                  # every phase, 5 rounds each
    python bench/bench.py --quick          # the big model's save and load, and the replicated row: 3 rounds
    python bench/bench.py --device cuda --dim 2048 --n-layers 8 --work /nvme  # a rank per GPU (NCCL); 4.85 GB state

A phase is one torchrun launch of this file (--phase NAME) on a model sharded with FSDP2 after one AdamW step: ours,
plain DCP and the raw disk in rounds, each first in turn (a ratio: the median per-round ratio of the slowest rank's
seconds); saves after os.sync(), loads from a cold page cache, peak memory one launch per operation. bench/README.md
"""

import argparse
import cProfile
import ctypes
import datetime
import io
import json
import os
import pathlib
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # ckpt.py and train_fsdp.py
import ckpt  # noqa: E402
import train_fsdp  # noqa: E402

GB, MB = 1e9, 1e6
TINY_RANKS, TINY = 8, ["--dim", "64", "--n-layers", "2"]  # the tiny model: train_fsdp's at this size
MANY_LINEARS = 750  # the many-parameter model: this many nn.Linear(4, 4), 2 parameters each
REPLICATED = 64 << 20  # the replicated phase: bytes of a value stored once, beside the tiny model
BLOCK = 64 << 20  # raw writes go in 64 MiB calls
SAVES, LOADS = ["ckpt save", "plain save", "raw write"], ["ckpt load", "plain load", "ckpt load verify=False"]
MEMORY_OPS = ["ckpt save", "plain save", "ckpt load", "plain load", "ckpt async save"]  # one launch each

# ---- the reference: plain DCP (no agreement, manifest, checksums or claim) ----

def plain_state(model, opt, extra):  # torch's default options: the optimizer state nested by parameter name
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, **({"extra": extra.state_dict()} if extra else {})}

def plain_save(path, model, opt, extra):
    dcp.save(plain_state(model, opt, extra), storage_writer=dcp.FileSystemWriter(path, sync_files=True))

def plain_load(path, model, opt, extra):
    state = plain_state(model, opt, extra)  # DCP reads into these tensors: the live shards
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

def held(device):  # a value stored once, equal on every rank (an EMA kept as a plain tensor): ckpt compares it
    module = nn.Module()
    module.register_buffer("value", torch.randn(REPLICATED // 4, generator=torch.Generator().manual_seed(0)).to(device))
    return module

def full_state_save(path, model, opt):
    """What users fall back to: the whole state gathered to rank 0's memory, one torch.save, fsync."""
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with open(path, "wb") as f:
            torch.save({"model": model_sd, "optim": optim_sd}, f)
            f.flush()
            os.fsync(f.fileno())

# ---- the disk and the memory ----

def raw_write(path, nbytes, block):
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - offset)])
        os.fsync(f.fileno())

def drop_cache(paths):  # the next read of these files comes from the disk (or, in a VM, the host's cache)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

def cached_fraction(paths):  # of these files' bytes, how much is in the page cache (util-linux fincore); or None
    try:
        cmd = ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *paths]
        numbers = [int(n) for n in subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return sum(numbers[0::2]) / max(1, sum(numbers[1::2])) if numbers else None

def files_under(*tops):
    return sorted(os.path.join(d, name) for top in tops for d, _, names in os.walk(top) for name in names)

def status_kb(field):  # a field of /proc/self/status, in kB
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def rss_around(fn):
    """RSS before fn() and its peak while it runs (threads too), in bytes; how, and what it relies on: README.md"""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return [before * 1024, status_kb("VmHWM") * 1024]

# ---- worker: one phase, in one torchrun launch ----

def clock():  # seconds, once the GPU work queued on the training stream is done (not a side stream's: a copy's)
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()

def build(args, world, device=torch.device("cpu"), seq_len=16):
    """The phase's model, FSDP2-sharded, after one AdamW step; and a function that takes another step."""
    if args.phase == "many":  # many small parameters: a save's and a load's cost per parameter
        torch.manual_seed(0)
        model = fully_shard(nn.Sequential(*(nn.Linear(4, 4) for _ in range(MANY_LINEARS))).to(device))

        def loss(step):
            return model(torch.randn(2, 4, device=device)).square().mean()
    else:
        targs = train_fsdp.get_args(["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--seq-len",
                                     str(seq_len), "--batch-size", str(world), "--dropout", "0"])
        model = train_fsdp.build_model(targs, device)
        samples = train_fsdp.Samples(targs)

        def loss(step):
            inputs, labels = (t[None].to(device) for t in samples[step * world + dist.get_rank()])  # one per rank
            return F.cross_entropy(model(inputs).float().view(-1, targs.vocab_size), labels.reshape(-1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(step):  # the seconds of opt.step() and its GPU work (after an async save it may wait for the copy)
        loss(step).backward()
        t0 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)  # no GPU work
        return clock() - t0

    train_step(0)
    return model, opt, train_step, held(device) if args.phase == "replicated" else None

def where(work, phase, name):  # a round's checkpoints: ckpt's root and plain DCP's directory
    return [os.path.join(work, f"{phase}-{side}-{name}") for side in ("ckpt", "plain")]

def worker(args):
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the benchmark's own barriers
    model, opt, train_step, extra = build(args, world, device, args.seq_len)
    out = {"profile": {}, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}

    def timed(fn):  # seconds of fn on this rank and of its GPU work, every rank starting together
        dist.barrier(group=group)
        t0 = clock()
        fn()
        return clock() - t0

    def profiled(name, fn):  # one more, untimed run of fn under cProfile (--profile), kept as text
        dist.barrier(group=group)
        profile = cProfile.Profile()
        profile.runcall(fn)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        out["profile"][name] = text.getvalue().replace(os.path.dirname(torch.__file__), "torch").replace(REPO, ".")

    def cold(paths):  # every rank drops every file; rank 0 then checks that none is cached
        drop_cache(paths)
        dist.barrier(group=group)
        if rank == 0:
            out.setdefault("cached", []).append(cached_fraction(paths))

    def one_round(ops, names, i, before=lambda: None):  # each named op once, each going first in turn
        for name in names[i % len(names):] + names[: i % len(names)]:
            before()
            out.setdefault(name, []).append(timed(ops[name]))

    raw = {"file": os.path.join(args.work, f"raw-rank{rank}.bin"), "block": memoryview(os.urandom(BLOCK))}
    extras = {"held": extra} if extra else None

    def ops(ckpt_root, plain_dir):  # the operations measured, on these checkpoints; the raw write: ckpt's bytes
        return {"ckpt save": lambda: ckpt.save(ckpt_root, 1, model, opt, extras),
                "raw write": lambda: raw_write(raw["file"], raw["bytes"], raw["block"]),
                "plain save": lambda: plain_save(plain_dir, model, opt, extra),
                "ckpt async save": lambda: ckpt.save(ckpt_root, 1, model, opt, extras, async_save=True).wait(),
                "ckpt load": lambda: ckpt.load(ckpt_root, model, opt, extras),
                "plain load": lambda: plain_load(plain_dir, model, opt, extra),
                "ckpt load verify=False": lambda: ckpt.load(ckpt_root, model, opt, extras, verify=False)}

    def claimed(name):  # new checkpoints' paths; ckpt refuses a fresh start on a root holding commits
        paths = where(args.work, args.phase, name)
        ckpt.check_root(paths[0], model)  # untimed, as a training script does at start-up: claims the root
        return paths

    if args.phase in ("big", "many", "tiny", "replicated"):  # rounds of saves, then of loads of the last saves
        warm_up = ops(*claimed("warm-up"))  # each operation once, untimed: first-call costs
        warm_up["ckpt save"]()
        raw["bytes"] = sum(map(os.path.getsize, files_under(where(args.work, args.phase, "warm-up")[0]))) // world
        for name in SAVES[1:] + LOADS:
            warm_up[name]()
        for i in range(args.repeat):
            if rank == 0:  # only the last round's checkpoints are kept (untimed)
                for path in where(args.work, args.phase, i - 1 if i else "warm-up"):
                    shutil.rmtree(path)
            one_round(ops(*claimed(i)), SAVES, i, before=os.sync)  # the last one's writeback done first
        last = where(args.work, args.phase, args.repeat - 1)
        out["ckpt_bytes"] = sum(map(os.path.getsize, files_under(last[0])))
        if args.phase == "big":  # the disk: each rank reads cold its share of ckpt's bytes, as ckpt's CRCs do
            cold([raw["file"]])
            out["CRC read"] = [timed(lambda: ckpt.chunk_crcs([raw["file"]]))]  # ckpt's reader: 8 threads
        files = files_under(*last)
        for i in range(args.repeat):
            one_round(ops(*last), LOADS, i, before=lambda: cold(files))
        if args.profile:
            profiled("ckpt.save", ops(*claimed("profile"))["ckpt save"])
            cold(files)
            profiled("ckpt.load", ops(*last)["ckpt load"])
    elif args.phase == "async":  # prepare_async beside steps, 3 normal steps, then saves: sync, async x3, sync
        t0, making, beside = time.perf_counter(), ckpt.prepare_async(model, opt), []  # as a run does, beside its loop
        while not making.done() or not beside:  # do the loop's CUDA calls wait while the host memory is page-locked?
            beside.append(train_step(1))
        out["prepare_async"], out["opt.step beside it, slowest"] = [time.perf_counter() - t0], [max(beside)]
        out["normal opt.step"] = [median(map(train_step, [1, 2, 3]))]
        for i, async_save in enumerate([False, True, True, True, False]):
            root, saved = claimed(i)[0], []
            inside = timed(lambda: saved.append(ckpt.save(root, 1, model, opt, async_save=async_save)))
            t0 = time.perf_counter()
            wait = max(0.0, train_step(i + 4) - out["normal opt.step"][0])  # what opt.step() took more, or 0
            runs = {"sync save": inside}
            if async_save:
                saved[0].wait()
                runs = {"async in save()": inside, "async opt.step() extra": wait, "async blocked": inside + wait,
                        "async committed": inside + time.perf_counter() - t0}  # committed: a training step included
            for key, seconds in runs.items():
                out.setdefault(key, []).append(seconds)
            if rank == 0:  # untimed: one of these saves on the disk at a time
                shutil.rmtree(root)
        out["full state dict save"] = [timed(lambda: full_state_save(os.path.join(args.work, "full.pt"), model, opt))]
    else:  # one operation (--op) in a process of its own: its peak memory; loads read the big phase's last saves
        fresh, big = claimed(0), where(args.work, "big", args.repeat - 1)  # claimed(): ckpt's group made, untimed
        out["rss"] = rss_around(ops(*(fresh if "save" in args.op else big))[args.op])
    with open(os.path.join(args.work, f"{args.phase}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ckpt.close()
    dist.destroy_process_group()

# ---- driver: launch the phases, print one table ----

def launch(args, phase, nproc, *flags):
    """One torchrun launch of a phase, this run's flags then the phase's (the last wins), killed after --timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), *sys.argv[1:], "--work", args.work, "--phase", phase, *flags]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, os.cpu_count() // nproc)))
    args.loadavg[phase] = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout kills the workers too
    try:
        log = proc.communicate(timeout=args.timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        raise SystemExit(f"phase {phase} timed out after {args.timeout} s:\n{log[-4000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed (exit {proc.returncode}):\n{log[-6000:]}")
    print(f"[bench] {phase}: {nproc} ranks, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return [json.loads(pathlib.Path(args.work, f"{phase}-rank{rank}.json").read_text()) for rank in range(nproc)]

def slowest(results, key):  # per run, the slowest rank's seconds: a collective lasts that long
    return [max(run) for run in zip(*(r[key] for r in results))]

def header(args):
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    df = subprocess.run(["df", "-hT", args.work], capture_output=True, text=True, timeout=60).stdout.split()
    disk = f"{df[-7]} ({df[-6]}, {df[-5]}, {df[-3]} free)" if len(df) >= 7 else "unknown"
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {os.cpu_count()} CPUs ({cpu}), {gib:.0f} GiB, torch "
            f"{torch.__version__}, CUDA {'yes' if torch.cuda.is_available() else 'no'}; load average (1/5/15 min) "
            f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}; work dir {args.work} on {disk}")

def report(args, r):
    rows = []  # (measure, ours, reference, ratio, the ratio's ceiling)

    def pair_row(name, phase, ours, ref, ceiling):  # the median of the per-round ratios of the times
        ours_s, ref_s = slowest(r[phase], ours), slowest(r[phase], ref)
        ratios = [o / p for o, p in zip(ours_s, ref_s)]
        rows.append((name, f"{median(ours_s):.3f} s", f"{median(ref_s):.3f} s", median(ratios), ceiling))

    size, cuda = r["big"][0]["ckpt_bytes"], args.device == "cuda"
    pair_row(f"save {size / GB:.2f} GB, time: ckpt.save vs plain dcp.save", "big", *SAVES[:2], 1.05)
    pair_row("save, time: ckpt.save vs the raw fsynced write of its bytes", "big", SAVES[0], SAVES[2], 1.1)
    pair_row("load, cold cache, time: ckpt.load (its CRCs checked) vs plain dcp.load", "big", *LOADS[:2], 1.0)
    pair_row("load(verify=False), cold cache, time: vs plain dcp.load", "big", LOADS[2], LOADS[1], 0.95)
    pair_row(f"{REPLICATED / MB:.0f} MB stored once beside the tiny model: save time, ckpt.save vs plain dcp.save",
             "replicated", *SAVES[:2], 1.2)
    if "async" in r:  # each async save on the rank it blocked longest (#1 included: its buffers exist)
        budget, floor = (50.0, 1.0) if cuda else (median(slowest(r["async"], "sync save")) * 1e3, 0.03)
        for i in range(len(r["async"][0]["async blocked"])):
            rank = max(r["async"], key=lambda result: result["async blocked"][i])
            ms, inside, wait = (rank[f"async {key}"][i] * 1e3 for key in ("blocked", "in save()", "opt.step() extra"))
            rows.append((f"async save #{i + 1}, training blocked: save() + the next opt.step()'s extra, vs "
                         + ("a budget" if cuda else "a sync ckpt.save"), f"{ms:.1f} ms ({inside:.1f} + {wait:.1f})",
                         f"{budget:.1f} ms", ms / budget, floor))
        for phase, model in (("many", f"{2 * MANY_LINEARS} parameters ({MANY_LINEARS} Linear(4, 4)), {args.nproc}"),
                             ("tiny", f"tiny model ({' '.join(TINY)}), {args.tiny_ranks}")):
            pair_row(f"{model} ranks, time: ckpt.save vs plain dcp.save", phase, *SAVES[:2], 1.3)
            pair_row(f"{model} ranks, time: ckpt.load vs plain dcp.load", phase, *LOADS[:2], 1.3)
        grew = {op: max(top - before for before, top in (rank["rss"] for rank in r[f"rss {op}"])) for op in MEMORY_OPS}
        copy = size / args.nproc  # an async save's copy of the rank's state, kept for the next: by design
        grew["ckpt async save"] -= copy
        for what, ours, ref in (("save", "ckpt save", "plain save"), ("load", "ckpt load", "plain load"),
                                (f"async save less its copy ({copy / MB:.0f} MB)", "ckpt async save", "plain save")):
            rows.append((f"{what}, peak RSS growth: {ours} vs {ref}", f"{grew[ours] / MB:.1f} MB",
                         f"{grew[ref] / MB:.1f} MB", grew[ours] / grew[ref], 1.1))
    lines = [f"| measure (unless said: {args.nproc} ranks, dim {args.dim}, {args.n_layers} layers; median of "
             f"{args.repeat}) | ours | reference | ratio | target | |", "|---|---|---|---|---|---|"]
    for name, ours, ref, ratio, ceiling in rows:
        lines.append(f"| {name} | {ours} | {ref} | {ratio:.3f} | <= {ceiling:.3g} | "
                     f"{'MISS' if ratio > ceiling else 'PASS'} ({ratio - ceiling:+.3f}) |")
    lines += ["", f"Every run, seconds (slowest rank), in the order measured; ranks on {r['big'][0]['device']}:"]
    for phase, results in r.items():
        for key in [k for k, v in results[0].items() if isinstance(v, list) and k not in ("cached", "rss")]:
            lines.append(f"- {phase} / {key}: " + " ".join(f"{s:.3f}" for s in slowest(results, key)))
        if "rss" in results[0]:
            lines.append(f"- {phase}, each rank: peak RSS growth (MB) over RSS before: " + ", ".join(
                f"{(rank['rss'][1] - rank['rss'][0]) / MB:.1f} over {rank['rss'][0] / MB:.0f}" for rank in results))
    cached = [c for results in r.values() for c in results[0].get("cached", [])]
    lines.append(f"- cold cache: after each drop, at most {max(cached):.1%} of the files' bytes were in the page cache "
                 "(fincore); in a VM the host may still cache the disk" if cached and None not in cached else
                 "- cold cache NOT verified: fincore missing or failed; the drop was requested (fadvise) only")
    lines.append("- 1-minute load average at the start of each phase: "
                 + ", ".join(f"{phase} {load:.2f}" for phase, load in args.loadavg.items()))
    for phase, results in r.items():
        for name, text in results[0]["profile"].items():
            lines += ["", f"Profile of one more {name}, {phase} phase (rank 0, cProfile, cumulative):", "```",
                      text.strip(), "```"]
    return "\n".join(lines)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the big and replicated phases only, 3 rounds unless --repeat")
    p.add_argument("--repeat", type=int, help="rounds, each operation once per round (default 5, quick 3)")
    p.add_argument("--work", default=tempfile.gettempdir(), help="a scratch directory is made (and removed) here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: a rank per GPU, NCCL")
    p.add_argument("--nproc", type=int, help="ranks, but for the tiny model's 8 (default: 2 on CPU, every GPU)")
    p.add_argument("--dim", type=int, default=1024, help="hidden size (1024 and 8 layers: 1.22 GB of state in all)")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16, help="tokens per rank in a training step (its compute)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds for each phase's launch")
    p.add_argument("--profile", action="store_true", help="also profile one ckpt.save and one ckpt.load (rank 0)")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # set by launch(): run as a worker
    p.add_argument("--op", help=argparse.SUPPRESS)  # set by launch(): the operation whose memory is measured
    args = p.parse_args()
    args.repeat = args.repeat or (3 if args.quick else 5)
    if args.phase:
        return worker(args)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0  # one rank per GPU
    if args.device == "cuda" and not 0 < (args.nproc or gpus) <= gpus:
        raise SystemExit(f"bench.py --device cuda: a rank per GPU, and torch {torch.__version__} sees {gpus} GPU(s)")
    args.nproc, args.tiny_ranks = args.nproc or gpus or 2, min(TINY_RANKS, gpus or TINY_RANKS)
    args.loadavg, start = {}, header(args)
    args.work = tempfile.mkdtemp(prefix="bench-", dir=args.work)  # only this is removed afterwards
    results = {}
    try:
        results["big"] = launch(args, "big", args.nproc)
        results["replicated"] = launch(args, "replicated", args.nproc, *TINY)
        if not args.quick:
            results["async"] = launch(args, "async", args.nproc)
            results["many"] = launch(args, "many", args.nproc)
            results["tiny"] = launch(args, "tiny", args.tiny_ranks, *TINY)
            for op in MEMORY_OPS:
                results[f"rss {op}"] = launch(args, "rss-" + op.replace(" ", "-"), args.nproc, "--op", op)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"command: python {' '.join(sys.argv)}\nmachine at the start: {start}\n"
          f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(report(args, results))


if __name__ == "__main__":
    sys.exit(main())
