"""Benchmark ckpt.py against plain DCP, the raw disk and the full-state-dict baseline (CPU, gloo).

    python bench/bench.py                  # every phase, 5 rounds each (~8 min on 2 busy cores)
    python bench/bench.py --quick          # save and load only, 3 rounds (~3 min)
    python bench/bench.py --work /data --repeat 7 --nproc 2 --dim 1024 --n-layers 8 --profile

Each phase is one torchrun launch of this file (--phase NAME): every rank builds train_fsdp's model, shards it
with FSDP2 and takes one AdamW step, so the state is params + exp_avg + exp_avg_sq. An operation's time is its
slowest rank's, every rank starting it after a barrier. Ours and the reference run side by side in rounds, each
going first in turn, and a ratio is the median of the per-round ratios. Every load starts from a cold page cache
(posix_fadvise(DONTNEED) on each checkpoint file, checked with util-linux fincore). bench/README.md explains it.
"""

import argparse
import cProfile
import datetime
import io
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # ckpt.py and train_fsdp.py
import ckpt  # noqa: E402
import train_fsdp  # noqa: E402

GB = 1e9
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer state keyed by name, as ckpt.py keys it
TINY_RANKS, TINY_DIM, TINY_LAYERS = 8, 64, 2
BLOCK = 64 << 20  # raw reads and writes go in 64 MiB calls


# ---- the reference: plain DCP, as torchtitan uses it (no agreement, manifest, checksums or claim) ----

def plain_state(model, opt):
    model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
    return {"model": model_sd, "optim": optim_sd}

def plain_save(path, model, opt):
    dcp.save(plain_state(model, opt), storage_writer=dcp.FileSystemWriter(path, sync_files=True))

def plain_load(path, model, opt):
    state = plain_state(model, opt)  # DCP reads into these tensors: the live shards
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)

def full_state_save(path, model, opt):
    """What users fall back to: the whole state gathered to rank 0's memory, one torch.save, fsync."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    if dist.get_rank() == 0:
        with open(path, "wb") as f:
            torch.save({"model": model_sd, "optim": optim_sd}, f)
            f.flush()
            os.fsync(f.fileno())


# ---- the disk ----

def raw_write(path, nbytes, block):
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - offset)])
        os.fsync(f.fileno())

def raw_read(path):
    buffer = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass

def drop_cache(paths):
    """Evict these files from the page cache: the next read comes from the disk (or, in a VM, the host's cache)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages would stay
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

def cached_fraction(paths):
    """Fraction of these files' bytes in the page cache, by util-linux fincore; None if it cannot tell."""
    try:
        cmd = ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *paths]
        numbers = [int(n) for n in subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    size = sum(numbers[1::2])
    return sum(numbers[0::2]) / size if size else None

def files_in(directory):
    return sorted(os.path.join(directory, name) for name in os.listdir(directory))

def dir_bytes(directory):
    return sum(os.path.getsize(path) for path in files_in(directory))

def own_bytes(ckpt_dir, rank):
    """Bytes this rank wrote: DCP's __<rank>_*.distcp, and rank 0's .metadata and manifest.json."""
    own = [path for path in files_in(ckpt_dir) if os.path.basename(path).startswith(f"__{rank}_")]
    rank0 = [os.path.join(ckpt_dir, name) for name in (".metadata", ckpt.MANIFEST)] if rank == 0 else []
    return sum(map(os.path.getsize, own + rank0))


# ---- worker: one phase, in one torchrun launch ----

def build(args, world):
    """train_fsdp's model, FSDP2-sharded, after one AdamW step; and a function that takes another step."""
    targs = train_fsdp.get_args(["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--seq-len", "16",
                                 "--batch-size", str(world), "--dropout", "0"])
    cpu = torch.device("cpu")
    model = train_fsdp.build_model(targs, cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(step):
        inputs, labels = train_fsdp.get_batch(targs, None, step * world, dist.get_rank(), world, cpu)
        F.cross_entropy(model(inputs).view(-1, targs.vocab_size), labels.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step(0)
    return model, opt, train_step

def rotated(names, i):  # run i's order: each name goes first in turn
    return names[i % len(names):] + names[: i % len(names)]

def worker(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the benchmark's own barriers
    model, opt, train_step = build(args, world)
    out = {"profile": {}}

    def timed(fn):  # seconds of fn on this rank, every rank starting together
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

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

    def one_round(ops, i, before=lambda: None):  # each op once, in round i's order; seconds kept under its name
        for name in rotated(list(ops), i):
            before()
            out.setdefault(name, []).append(timed(ops[name]))

    prefix = "tiny-" if args.phase == "tiny" else "async-" if args.phase == "async" else ""
    ckpt_root, plain_root = os.path.join(args.work, prefix + "ckpt"), os.path.join(args.work, prefix + "plain")
    raw_file = os.path.join(args.work, f"raw-rank{rank}.bin")
    ckpt.check_root(ckpt_root)  # as a training script does at start-up: makes ckpt's process group, claims the root

    def save_ops(step):
        return {"ckpt save": lambda: ckpt.save(ckpt_root, step, model, opt),
                "plain save": lambda: plain_save(ckpt.step_dir(plain_root, step), model, opt)}

    def load_ops(step):
        ckpt_dir, plain_dir = ckpt.step_dir(ckpt_root, step), ckpt.step_dir(plain_root, step)
        return {"ckpt load": lambda: ckpt.load(ckpt_dir, model, opt),
                "plain load": lambda: plain_load(plain_dir, model, opt),
                "ckpt load verify=False": lambda: ckpt.load(ckpt_dir, model, opt, verify=False)}

    def checkpoint_files(step):
        return files_in(ckpt.step_dir(ckpt_root, step)) + files_in(ckpt.step_dir(plain_root, step))

    if args.phase == "save":
        for step in range(1, args.repeat + 1):
            if rank == 0 and step > 1:  # only the last pair is kept, for the load phase (untimed)
                shutil.rmtree(ckpt.step_dir(ckpt_root, step - 1))
                shutil.rmtree(ckpt.step_dir(plain_root, step - 1))
            one_round(save_ops(step), step - 1)
        ckpt_dir = ckpt.step_dir(ckpt_root, args.repeat)
        out.update(ckpt_bytes=dir_bytes(ckpt_dir), plain_bytes=dir_bytes(ckpt.step_dir(plain_root, args.repeat)))
        out["raw_bytes"] = own_bytes(ckpt_dir, rank)
        block = memoryview(os.urandom(BLOCK))  # incompressible, made before the clock starts
        out["raw write"] = [timed(lambda: raw_write(raw_file, out["raw_bytes"], block))]
        if args.profile:
            profiled("ckpt.save", save_ops(args.repeat + 1)["ckpt save"])
    elif args.phase == "load":
        cold([raw_file])
        out["raw read"] = [timed(lambda: raw_read(raw_file))]
        paths = checkpoint_files(args.repeat)
        for i in range(args.repeat):
            one_round(load_ops(args.repeat), i, before=lambda: cold(paths))
        if args.profile:
            cold(paths)
            profiled("ckpt.load", load_ops(args.repeat)["ckpt load"])
    elif args.phase == "async":
        out["sync save"] = [timed(save_ops(1)["ckpt save"])]
        for step in (2, 3):  # the first allocates the host buffers, the second reuses them
            train_step(step)  # the parameters change between saves, as in training
            dist.barrier(group=group)
            t0 = time.perf_counter()
            pending = ckpt.save(ckpt_root, step, model, opt, async_save=True)
            out.setdefault("async blocked", []).append(time.perf_counter() - t0)
            pending.wait()
            out.setdefault("async committed", []).append(time.perf_counter() - t0)
        out["sync save"].append(timed(save_ops(4)["ckpt save"]))
        full_file = os.path.join(args.work, "full.pt")
        out["full state dict save"] = [timed(lambda: full_state_save(full_file, model, opt))]
        dist.barrier(group=group)  # rank 0's file is complete
        out["full_bytes"] = os.path.getsize(full_file)
    elif args.phase == "tiny":
        for fn in [*save_ops(1).values(), *load_ops(1).values()]:  # warm-up, untimed: first-call costs
            fn()
        for step in range(2, args.repeat + 2):
            one_round(save_ops(step), step)
        last = args.repeat + 1
        paths = checkpoint_files(last)
        for i in range(args.repeat):
            one_round({k: v for k, v in load_ops(last).items() if "verify" not in k}, i, before=lambda: cold(paths))
    with open(os.path.join(args.work, f"{args.phase}-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ckpt.close()
    dist.destroy_process_group()


# ---- driver: launch the phases, print one table ----

def launch(args, phase, nproc, dim, n_layers):
    """One torchrun launch of a phase, killed with its workers after --timeout; returns each rank's results."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--phase", phase, "--work", args.work, "--repeat", str(args.repeat),
           "--dim", str(dim), "--n-layers", str(n_layers), "--timeout", str(args.timeout)]
    cmd += ["--profile"] if args.profile else []
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, os.cpu_count() // nproc)))
    args.loadavg[phase] = os.getloadavg()[0]
    print(f"[bench] {phase}: {nproc} ranks, dim {dim}, {n_layers} layers ...", file=sys.stderr, flush=True)
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
    print(f"[bench] {phase}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    results = []
    for rank in range(nproc):
        with open(os.path.join(args.work, f"{phase}-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results

def median(values):
    values = sorted(values)
    return (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2

def slowest(results, key):  # per run, the slowest rank's seconds: a collective lasts that long
    return [max(run) for run in zip(*(r[key] for r in results))]

def header(args):
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    df = subprocess.run(["df", "-hT", args.work], capture_output=True, text=True, timeout=60).stdout.split()
    disk = f"{df[-7]} ({df[-6]}, {df[-5]}, {df[-3]} free)" if len(df) >= 7 else "unknown"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {os.cpu_count()} CPUs ({cpu}), {memory:.0f} GiB, torch "
            f"{torch.__version__}, CUDA {'yes' if torch.cuda.is_available() else 'no'}; load average (1/5/15 min) "
            f"{load}; work dir {args.work} on {disk}")

def report(args, r):
    rows = []  # (measure, ours, reference, ratio, "<=" or ">=", floor)

    def seconds(values):
        return f"{median(values):.3f} s" if len(values) > 1 else f"{values[0]:.3f} s"

    def pair_row(name, results, ours, ref, floor, by_time=False):
        ours_s, ref_s = slowest(results, ours), slowest(results, ref)
        ratios = [(o / p) if by_time else (p / o) for o, p in zip(ours_s, ref_s)]
        rows.append((name, seconds(ours_s), seconds(ref_s), median(ratios), "<=" if by_time else ">=", floor))

    save, load = r["save"], r["load"]
    size = save[0]["ckpt_bytes"]
    pair_row(f"save {size / GB:.2f} GB, throughput: ckpt.save vs plain dcp.save", save, "ckpt save", "plain save", 0.85)
    pair_row("load, cold cache, throughput: ckpt.load vs plain dcp.load", load, "ckpt load", "plain load", 0.7)
    pair_row("load(verify=False), cold cache: vs plain dcp.load", load, "ckpt load verify=False", "plain load", 0.95)
    if "async" in r:
        sync = median(slowest(r["async"], "sync save"))
        blocked = slowest(r["async"], "async blocked")
        rows.append(("async save #2, caller blocked: vs a sync ckpt.save", f"{blocked[1]:.3f} s", f"{sync:.3f} s",
                     blocked[1] / sync, "<=", 0.10))
        rows.append(("(info) async save #1 (allocates the host buffers)", f"{blocked[0]:.3f} s", f"{sync:.3f} s",
                     blocked[0] / sync, "<=", 0.10))
        ranks = f"tiny model (dim {TINY_DIM}, {TINY_LAYERS} layers), {TINY_RANKS} ranks"
        pair_row(f"{ranks}, time: ckpt.save vs plain dcp.save", r["tiny"], "ckpt save", "plain save", 1.5, True)
        pair_row(f"{ranks}, time: ckpt.load vs plain dcp.load", r["tiny"], "ckpt load", "plain load", 1.5, True)
    lines = [f"| measure ({args.nproc} ranks, dim {args.dim}, {args.n_layers} layers; median of {args.repeat}) "
             "| ours | reference | ratio | floor | |", "|---|---|---|---|---|---|"]
    for name, ours, ref, ratio, sense, floor in rows:
        ok = ratio >= floor if sense == ">=" else ratio <= floor
        lines.append(f"| {name} | {ours} | {ref} | {ratio:.3f} | {sense} {floor} | "
                     f"{'PASS' if ok else 'MISS'} ({ratio - floor:+.3f}) |")

    def rate(values, nbytes):  # seconds (GB/s), the median run
        return f"{median(values):.2f} s ({nbytes / GB / median(values):.2f} GB/s)"

    raw_bytes = sum(rank["raw_bytes"] for rank in save)
    plain_bytes = save[0]["plain_bytes"]
    full = "n/a (--quick)"
    if "async" in r:
        full = rate(slowest(r["async"], "full state dict save"), r["async"][0]["full_bytes"])
    lines += ["", f"| {size / GB:.2f} GB, {args.nproc} ranks | ckpt.py | plain DCP | the disk (each rank its shard's "
              "bytes) | full state dict (rank 0, torch.save) |", "|---|---|---|---|---|",
              f"| save (+ fsync) | {rate(slowest(save, 'ckpt save'), size)} | "
              f"{rate(slowest(save, 'plain save'), plain_bytes)} | {rate(slowest(save, 'raw write'), raw_bytes)} "
              f"| {full} |",
              f"| load, cold cache | {rate(slowest(load, 'ckpt load'), size)} | "
              f"{rate(slowest(load, 'plain load'), plain_bytes)} | {rate(slowest(load, 'raw read'), raw_bytes)} | |",
              f"| load(verify=False), cold cache | {rate(slowest(load, 'ckpt load verify=False'), size)} | | | |"]
    if "async" in r:
        committed = slowest(r["async"], "async committed")
        lines.append(f"| async save #1 / #2: blocked; until committed | {blocked[0]:.2f} s / {blocked[1]:.2f} s; "
                     f"{committed[0]:.2f} s / {committed[1]:.2f} s | | | |")
    lines += ["", "Every run, seconds (slowest rank), in the order measured:"]
    for phase, results in r.items():
        for key in [k for k, v in results[0].items() if isinstance(v, list) and k != "cached"]:
            lines.append(f"- {phase} / {key}: " + " ".join(f"{s:.3f}" for s in slowest(results, key)))
    cached = [c for phase in ("load", "tiny") if phase in r for c in r[phase][0].get("cached", [])]
    known = [c for c in cached if c is not None]
    if not cached or len(known) < len(cached):
        lines.append("- cold cache NOT verified: fincore missing or failed; the drop was requested (fadvise) only")
    else:
        lines.append(f"- cold cache: after each drop, at most {max(known):.1%} of the files' bytes were in the page "
                     "cache (fincore); in a VM the host may still cache the disk")
    lines.append("- 1-minute load average at the start of each phase: "
                 + ", ".join(f"{phase} {load:.2f}" for phase, load in args.loadavg.items()))
    for phase, results in r.items():
        for name, text in results[0]["profile"].items():
            lines += ["", f"Profile of one more {name} (rank 0, cProfile, cumulative):", "```", text.strip(), "```"]
    return "\n".join(lines)

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="save and load only, 3 rounds unless --repeat")
    p.add_argument("--repeat", type=int, help="rounds, each operation once per round (default 5, quick 3)")
    p.add_argument("--work", default=tempfile.gettempdir(), help="a scratch directory is made (and removed) here")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the save, load and async phases")
    p.add_argument("--dim", type=int, default=1024, help="hidden size (1024 and 8 layers: ~0.6 GB of state per rank)")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=1200, help="seconds for each phase's launch")
    p.add_argument("--profile", action="store_true", help="also profile one ckpt.save and one ckpt.load (rank 0)")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # set by launch(): run as a worker
    args = p.parse_args()
    args.repeat = args.repeat or (3 if args.quick else 5)
    if args.phase:
        return worker(args)
    args.loadavg, start = {}, header(args)
    args.work = tempfile.mkdtemp(prefix="bench-", dir=args.work)  # only this is removed afterwards
    results = {}
    try:
        results["save"] = launch(args, "save", args.nproc, args.dim, args.n_layers)
        results["load"] = launch(args, "load", args.nproc, args.dim, args.n_layers)
        if not args.quick:
            results["async"] = launch(args, "async", args.nproc, args.dim, args.n_layers)
            results["tiny"] = launch(args, "tiny", TINY_RANKS, TINY_DIM, TINY_LAYERS)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"command: python {' '.join(sys.argv)}\nmachine at the start: {start}\n"
          f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(report(args, results))


if __name__ == "__main__":
    sys.exit(main())
