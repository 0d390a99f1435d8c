"""Benchmark ckpt.py: against the disk's own limit, plain DCP (what torchtitan does) and the full-state-dict baseline.

    python bench/bench_ckpt.py                         # dim 1024, 8 layers: 101M params, checkpoint 1.2 GB; ~8 min
    python bench/bench_ckpt.py --quick                 # only save and load (ckpt vs plain DCP vs the disk); ~2 min
    python bench/bench_ckpt.py --work /data            # scratch dir made (and removed) there; ~8 GB free
    python bench/bench_ckpt.py --devices cpu,cuda      # also on GPUs (needs one GPU per rank)
    python bench/bench_ckpt.py --coordination          # tiny model at 2, 4, 8 ranks: time and bytes per rank; ~3 min

Every phase is its own torchrun launch of this file (--phase NAME), so each starts from the same state: the
model built by train_fsdp.build_model, sharded with FSDP2, one AdamW step taken (so the checkpoint holds
parameters + exp_avg + exp_avg_sq). Per-phase peak memory is the rank's VmHWM, reset (/proc/self/clear_refs,
"5") right before the phase; "extra" is that peak minus the RSS at the reset.

  save       --repeat times, alternating which goes first: ckpt.save (synchronous), then plain DCP of the same
             state: get_state_dict (optimizer flattened, as ckpt does) and dcp.save with a FileSystemWriter
             (fsync on, as ckpt); each profiled. Then, same launch, the raw limit: each rank writes as many
             bytes as its shard to a file of its own in 64 MB writes and fsyncs it
  load       the raw read of those files, then --repeat times, alternating: ckpt.load and plain DCP (dcp.load
             into get_state_dict's tensors, then set_state_dict), then ckpt.load(verify=False) once; each from
             a cold page cache: posix_fadvise(DONTNEED) per file, checked with util-linux fincore when present
             (dropping all caches, /proc/sys/vm/drop_caches, needs root outside a container). In a VM the
             hypervisor may still cache the disk: "cold" then means "not in this machine's page cache"
  async      ckpt.save(async_save=True) twice: seconds the caller is blocked, seconds to the commit
  baseline   what users fall back to: get_state_dict(full_state_dict=True, cpu_offload=True) gathered on
             rank 0, torch.save to one file, fsync
  steps      training step time without checkpoints and with an asynchronous save every 10 steps
             (commit folded into the step's all-reduce, as in train_fsdp.py), in alternating windows
  consolidate  python consolidate.py CKPT OUT: wall time, peak RSS (wait4)
  coord      (--coordination) a tiny model at each of --world-sizes: ckpt.save/ckpt.load against plain
             dcp.save/dcp.load, seconds and the bytes each rank sends and receives through torch.distributed
             (bench/comm_count.py wraps the collectives in this process; ckpt.py is not touched)

Prints a markdown table, the targets with PASS/MISS, and the profile of each phase. Times depend on the
machine and on whatever else runs on it: the header states the CPU count, load average and disk. A ratio is
the median over the --repeat pairs of the two runs measured side by side, so drifting load weighs on both.
"""

import argparse
import collections
import contextlib
import datetime
import gc
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/ is one level down
GB = 1e9


# ---------------------------------------------------------------------------
# Worker side: one phase, in one torchrun launch
# ---------------------------------------------------------------------------

PROF = collections.defaultdict(float)
LOADAVG = {}  # (device, phase): 1-minute load average when the phase started (driver side)


def timed(owner, name, label):
    """Wrap owner.name so that its wall time adds up under PROF[label] (the caller sees no difference).

    A name owner lacks is skipped: ckpt.py's internals change, the benchmark should not break with them."""
    real = getattr(owner, name, None)
    if real is None:
        return

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            PROF[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def install_profile():
    """Time the parts of ckpt.save/load by wrapping the functions they call (attributes looked up at call time)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager

    import ckpt

    timed(ckpt, "_state", "get_state_dict")
    timed(ckpt, "get_state_dict", "get_state_dict")
    timed(ckpt, "fingerprint", "fingerprint")
    timed(ckpt, "_local_prints", "fingerprint")
    timed(dcp.FileSystemWriter, "stage", "staging copy")  # DCP's stager for a FileSystemWriter ...
    timed(DefaultStager, "stage", "staging copy")  # ... or the one ckpt.save passes
    timed(dcp, "save", "dcp.save")
    timed(dcp, "load", "dcp.load")
    timed(dcp.FileSystemWriter, "write_data", "write_data")
    timed(dcp.FileSystemWriter, "finish", "finish")
    timed(dcp.FileSystemReader, "read_data", "read_data")
    if "read_data" in vars(ckpt.SafeReader):  # its own reads, checked against the manifest
        timed(ckpt.SafeReader, "read_data", "safe read_data")
    timed(os, "fsync", "os.fsync")
    timed(ckpt, "_describe_own", "checksum own")  # older versions: a second pass over the files
    timed(ckpt, "_read_into", "read into")
    timed(ckpt, "verify_files", "verify")
    timed(ckpt, "set_state_dict", "set_state_dict")
    timed(ckpt, "_commit", "commit")


# How the profile is printed: (key, label); "  " marks a part of the item above.
LABELS = [
    ("get_state_dict", "get_state_dict (sharded)"),
    ("fingerprint", "fingerprint (this rank's sums of bits)"),
    ("staging copy", "staging copy to host memory (async)"),
    ("dcp.save", "dcp.save: plan + write + .metadata"),
    ("write_data", "  write_data: serialize + write + fsync"),
    ("finish", "  finish: .metadata (rank 0)"),
    ("checksum own", "checksums of own files (ckpt._describe_own)"),
    ("commit", "commit: gather checksums, manifest, rename"),
    ("verify", "ckpt.verify_files: sizes (and checksums, if a separate pass)"),
    ("dcp.load", "dcp.load: plan + read"),
    ("safe read_data", "  ckpt.SafeReader.read_data: read + check checksums + deserialize"),
    ("read into", "    of which tensors copied straight from checked blocks (reads included)"),
    ("read_data", "  FileSystemReader.read_data: read + deserialize (unchecked)"),
    ("set_state_dict", "set_state_dict"),
    ("full get_state_dict", "get_state_dict(full_state_dict, cpu_offload)"),
    ("torch.save", "torch.save (rank 0)"),
    ("os.fsync", "(os.fsync, all calls: data files, .metadata, manifest, directories)"),
]


def memory():
    """(VmRSS, VmHWM) of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak():
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5); returns that RSS."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the whole process's (still reported, as such)
    return memory()[0]


def drop_cache(paths):
    """Evict these files from the page cache; the next read comes from the disk (or the hypervisor's cache)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths):
    """Fraction of these files' bytes in the page cache (util-linux fincore), None if it cannot be told."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *paths],
                             capture_output=True, text=True, timeout=30).stdout.split()
        res, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
        return res / size if size else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def files_in(d):
    return [os.path.join(d, n) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n))]


def dir_bytes(d):
    return sum(map(os.path.getsize, files_in(d)))


def shard_files(ckpt_dir, rank):
    """The files rank wrote in a DCP checkpoint (__rank_*.distcp, and .metadata for rank 0)."""
    return sorted(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir)
                  if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata"))


def raw_write(path, nbytes):
    """(seconds, of which fsync) to write nbytes to a new file in 64 MB writes, then fsync it."""
    block = memoryview(os.urandom(64 << 20))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(block[: min(left, len(block))])
        t1 = time.perf_counter()
        os.fsync(f.fileno())
    return time.perf_counter() - t0, time.perf_counter() - t1


def raw_read(path):
    """Seconds to read a file in 64 MB reads."""
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


# The baseline a user weighs ckpt.py against: plain DCP, as torchtitan uses it (no manifest, no checksums,
# no fingerprint, no agreement). Optimizer state flattened by name, as ckpt.py does, so both write the same keys.
def plain_state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    PROF["get_state_dict"] += time.perf_counter() - t0
    return {"model": msd, "optim": osd}


def plain_save(path, model, opt):
    import torch.distributed.checkpoint as dcp

    dcp.save(plain_state(model, opt), storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def plain_load(path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = plain_state(model, opt)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    t0 = time.perf_counter()
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
    PROF["set_state_dict"] += time.perf_counter() - t0


def build(args, device, seq_len=16, batch=2):
    """The model of train_fsdp.py, FSDP2-sharded, after one AdamW step (so optimizer state exists)."""
    import torch
    import torch.nn.functional as F

    import train_fsdp

    targs = train_fsdp.get_args(["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--n-heads",
                                 str(args.n_heads), "--seq-len", str(seq_len), "--batch-size", str(batch),
                                 "--dropout", "0"])
    model = train_fsdp.build_model(targs, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(i):
        import torch.distributed as dist

        x, y = train_fsdp.get_batch(targs, None, i * batch, dist.get_rank(), dist.get_world_size(), device)
        loss = F.cross_entropy(model(x).float().view(-1, targs.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step(0)
    return model, opt, step


def worker(args):
    import torch
    import torch.distributed as dist

    import ckpt

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=1800))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=1800))
    group = dist.new_group(backend="gloo")  # the benchmark's own barriers, on either device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)

    def measure(fn, around=contextlib.nullcontext):
        """(seconds, peak RSS, extra RSS, profile) of fn() on this rank, started together with the other ranks.

        around: a context manager entered after the barrier, around fn alone (the byte counter)."""
        sync()
        PROF.clear()
        before = reset_peak()
        with around():
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        peak = memory()[1]
        return seconds, peak, peak - before, dict(PROF)

    install_profile()
    result = {"rank": rank}
    model, opt, step = build(args, device, args.seq_len if args.phase == "steps" else 16,
                             args.batch_size if args.phase == "steps" else max(2, world))
    sync()
    PROF.clear()
    result["rss_before"] = reset_peak()
    t0 = time.perf_counter()

    if args.phase == "save":
        # ckpt.save and plain DCP side by side, alternating which goes first; then the raw write of as many bytes.
        plain_root = args.target + "-plain"
        for i in range(args.repeat):
            ops = [("ckpt", lambda: ckpt.save(args.target, i + 1, model, opt)),
                   ("plain", lambda: plain_save(os.path.join(plain_root, f"step-{i + 1:08d}"), model, opt))]
            for kind, fn in ops[:: 1 if i % 2 == 0 else -1]:
                for key, value in zip(("seconds", "peak_rss", "extra_rss", "profile"), measure(fn)):
                    result.setdefault(f"{kind}_{key}", []).append(value)
            sync()
            if rank == 0 and i + 1 < args.repeat:  # only the last of each is kept, for the load phase
                shutil.rmtree(os.path.join(args.target, f"step-{i + 1:08d}"))
                shutil.rmtree(os.path.join(plain_root, f"step-{i + 1:08d}"))
        path = os.path.join(args.target, f"step-{args.repeat:08d}")
        result["bytes"] = dir_bytes(path)
        result["plain_bytes"] = dir_bytes(os.path.join(plain_root, f"step-{args.repeat:08d}"))
        result["raw_bytes"] = sum(os.path.getsize(p) for p in shard_files(path, rank))
        sync()
        result["raw_write_seconds"], result["raw_fsync_seconds"] = raw_write(args.raw % rank, result["raw_bytes"])

    elif args.phase == "load":
        # The raw read of this rank's file written in the save phase, then ckpt.load and plain DCP, all cold.
        files, plain_files = files_in(args.target), files_in(args.plain)
        drop_cache(files + plain_files + [args.raw % rank])
        result["raw_cached_before"] = cached_fraction([args.raw % rank])
        sync()
        result["raw_read_seconds"] = raw_read(args.raw % rank)
        result["raw_bytes"] = os.path.getsize(args.raw % rank)
        ops = [("ckpt", files, lambda: ckpt.load(args.target, model, opt)),
               ("plain", plain_files, lambda: plain_load(args.plain, model, opt))]
        for i in range(args.repeat):
            for kind, paths, fn in ops[:: 1 if i % 2 == 0 else -1]:
                drop_cache(paths)
                result.setdefault(f"{kind}_cached_before", []).append(cached_fraction(paths))
                for key, value in zip(("seconds", "peak_rss", "extra_rss", "profile"), measure(fn)):
                    result.setdefault(f"{kind}_{key}", []).append(value)
        drop_cache(files)  # without the checksum pass, to show what verification costs
        result["noverify_seconds"] = measure(lambda: ckpt.load(args.target, model, opt, verify=False))[0]

    elif args.phase == "async":
        # Twice: the first save allocates the staging memory, as every save does (DCP frees it after
        # the write), but the allocator may reuse freed pages in the second.
        for k in (1, 2):
            PROF.clear()
            t0 = time.perf_counter()
            pending = ckpt.save(args.target, k, model, opt, async_save=True, keep=1)
            result[f"blocked_seconds_{k}"] = time.perf_counter() - t0
            result[f"blocked_profile_{k}"] = dict(PROF)
            pending.wait()
            result[f"seconds_{k}"] = time.perf_counter() - t0
            if k == 1:
                result["peak_rss"] = memory()[1]
                result["profile"] = dict(PROF)
            step(k)  # the parameters change between the two saves, as in training

    elif args.phase == "baseline":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        PROF["full get_state_dict"] = time.perf_counter() - t0
        if rank == 0:
            t1 = time.perf_counter()
            with open(os.path.join(args.target, "full.pt"), "wb") as f:
                torch.save({"model": model_sd, "optim": optim_sd}, f)
                f.flush()
                PROF["torch.save"] = time.perf_counter() - t1
                os.fsync(f.fileno())  # timed as "os.fsync"
            result["bytes"] = os.path.getsize(os.path.join(args.target, "full.pt"))
        del model_sd, optim_sd
        sync()
        result["seconds"] = time.perf_counter() - t0

    elif args.phase == "steps":
        result.update(run_steps(args, model, opt, step, device, args.target))

    elif args.phase == "coord":
        result.update(run_coordination(args, model, opt, measure))

    result.setdefault("peak_rss", memory()[1])
    result.setdefault("profile", dict(PROF))
    with open(os.path.join(args.results, f"{args.phase}-{args.device}-{world}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sync()
    if hasattr(ckpt, "close"):
        ckpt.close()  # the new API: commits a save in flight, releases the root, destroys ckpt's groups
    dist.destroy_process_group()


def run_coordination(args, model, opt, measure):
    """Seconds and bytes sent/received by this rank per ckpt.save, ckpt.load, plain dcp.save, plain dcp.load.

    A tiny model, so that coordination is nearly the whole cost. One round of each first, uncounted: it
    creates ckpt's process groups and warms up imports and allocators. Then --repeat rounds, alternating
    which of ckpt and plain DCP goes first. The page cache is not dropped: the files are a few hundred KB.
    """
    import comm_count
    import torch.distributed.checkpoint as dcp

    import ckpt

    ckpt_root, plain_root = args.target, args.target + "-plain"
    out = {}

    def ops(step):
        plain_dir = os.path.join(plain_root, f"step-{step:08d}")
        return {"ckpt save": lambda: ckpt.save(ckpt_root, step, model, opt),
                "plain save": lambda: plain_save(plain_dir, model, opt),
                "ckpt load": lambda: ckpt.load(os.path.join(ckpt_root, f"step-{step:08d}"), model, opt),
                "plain load": lambda: plain_load(plain_dir, model, opt)}

    def labelled(fn, *a, **k):
        with comm_count.label("dcp"):
            return fn(*a, **k)

    @contextlib.contextmanager
    def counter(into):
        with comm_count.counting() as c:
            into.append(c)
            yield

    for fn in ops(1).values():
        fn()
    comm_count.install()
    # DCP's own traffic, inside ckpt.save/load as in plain DCP, is labelled: the rest is ckpt's coordination.
    for name in ("save", "load"):
        real = getattr(dcp, name)
        setattr(dcp, name, lambda *a, _real=real, **k: labelled(_real, *a, **k))
    for i in range(args.repeat):
        step = i + 2
        named = list(ops(step).items())
        # Saves before loads (a load needs its save); within each pair, alternate which goes first.
        order = [named[0], named[1], named[2], named[3]] if i % 2 == 0 else [named[1], named[0], named[3], named[2]]
        for name, fn in order:
            counted = []
            seconds, _, _, profile = measure(fn, lambda: counter(counted))
            c = counted[0]
            out.setdefault(f"{name} seconds", []).append(seconds)
            out.setdefault(f"{name} profile", []).append(profile)
            for key in ("sent", "recv", "dcp sent", "dcp recv"):
                out.setdefault(f"{name} {key}", []).append(c[key])
            out[f"{name} calls"] = dict(c["calls"])
    return out


def run_steps(args, model, opt, step, device, root):
    """Seconds of each training step, without checkpoints and with an asynchronous save every 10 steps.

    Measured in alternating windows of 10 steps (plain, async, plain, ...), so that load from other
    jobs, which drifts over minutes, weighs on both alike. In an async window the save starts after
    its 5th step. As in train_fsdp.py, each step's all-reduce carries "my background write is done"
    and the save is committed once every rank is done. A save still in flight at the end of its
    window is waited for inside the window's last step: its whole cost is counted, never pushed
    into the next plain window (this overstates the overhead when a write needs 6-10 steps).
    """
    import torch
    import torch.distributed as dist

    import ckpt

    times, forced, in_flight, i = {"plain": [], "async": []}, 0, None, 1
    windows = [("warmup", args.warmup_steps)] + [(("plain", "async")[w % 2], 10) for w in range(2 * (args.n_steps // 10))]
    for kind, length in windows:
        for k in range(1, length + 1):
            t0 = time.perf_counter()
            loss = step(i)
            written = 1.0 if in_flight is None or in_flight.done() else 0.0
            stats = torch.tensor([loss.item(), written], device=device)
            dist.all_reduce(stats)
            if in_flight is not None and stats[1].item() == dist.get_world_size():
                in_flight.wait()
                in_flight = None
            if kind == "async" and k == 5:
                in_flight = ckpt.save(root, i, model, opt, keep=1, async_save=True)
            if kind == "async" and k == length and in_flight is not None:
                in_flight.wait()
                in_flight, forced = None, forced + 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            if kind != "warmup":
                times[kind].append(time.perf_counter() - t0)
            i += 1
    return {"plain": times["plain"], "async": times["async"], "forced_waits": forced}


# ---------------------------------------------------------------------------
# Driver side: launch the phases, collect, print
# ---------------------------------------------------------------------------


def launch(args, phase, device, target, work, nproc=None, model=None):
    """One torchrun launch of a phase; returns each rank's result dict."""
    nproc = nproc or args.nproc
    dim, n_layers, n_heads = model or (args.dim, args.n_layers, args.n_heads)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--phase", phase, "--device", device, "--target", target,
           "--plain", target + "-plain" if phase != "load" else args.plain_dir, "--raw",
           os.path.join(work, "raw-rank%d.bin"), "--results", args.results, "--dim", str(dim), "--n-layers",
           str(n_layers), "--n-heads", str(n_heads), "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--n-steps", str(args.n_steps), "--warmup-steps", str(args.warmup_steps),
           "--repeat", str(args.repeat)] + (["--ckpt", os.path.abspath(args.ckpt)] if args.ckpt else [])
    LOADAVG[device, phase, nproc] = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(os.cpu_count() // nproc, 1))))
    t0 = time.monotonic()
    print(f"[bench] {phase} on {device}, {nproc} ranks ...", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"phase {phase} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    print(f"[bench] {phase} on {device}, {nproc} ranks: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    out = []
    for r in range(nproc):
        with open(os.path.join(args.results, f"{phase}-{device}-{nproc}-rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def run_child(cmd, timeout):
    """(exit code, wall seconds, peak RSS bytes, stderr) of a child process, its rusage from os.wait4."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=errf, text=True)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                p.kill()
                raise SystemExit(f"timed out after {timeout} s: {' '.join(cmd)}")
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        errf.seek(0)
        err = errf.read()
    return p.returncode, time.monotonic() - t0, usage.ru_maxrss * 1024, err


def median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def per_repeat(rs, key):
    """A collective operation lasts as long as its slowest rank: [max over ranks] for each repeat."""
    return [max(vals) for vals in zip(*(r[key] for r in rs))]


def mean_profile(r, key):
    """One rank's profile, averaged over the repeats."""
    profs = r[key]
    return {k: sum(p.get(k, 0) for p in profs) / len(profs) for k in set().union(*profs)}


def bench_device(args, device):
    """All phases on one device; returns {name: value} for the report."""
    work = os.path.join(args.work, device)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    m = {}
    worst = lambda rs, key: max(r[key] for r in rs)

    save = launch(args, "save", device, os.path.join(work, "sync"), work)
    ckpt_dir = os.path.join(work, "sync", f"step-{args.repeat:08d}")
    args.plain_dir = os.path.join(work, "sync-plain", f"step-{args.repeat:08d}")
    m["ckpt_bytes"], m["plain_bytes"] = save[0]["bytes"], save[0]["plain_bytes"]
    for kind in ("ckpt", "plain"):
        m[f"{kind} save"] = per_repeat(save, f"{kind}_seconds")
        m[f"{kind} save rss"], m[f"{kind} save extra"] = max(save[0][f"{kind}_peak_rss"]), max(save[0][f"{kind}_extra_rss"])
        m[f"{kind} save profile"] = [mean_profile(r, f"{kind}_profile") for r in save]
    m["raw_bytes"] = sum(r["raw_bytes"] for r in save)
    m["raw_write"], m["raw_fsync"] = worst(save, "raw_write_seconds"), worst(save, "raw_fsync_seconds")

    load = launch(args, "load", device, ckpt_dir, work)
    m["raw_read"], m["raw_cached"] = worst(load, "raw_read_seconds"), [r["raw_cached_before"] for r in load]
    for kind in ("ckpt", "plain"):
        m[f"{kind} load"] = per_repeat(load, f"{kind}_seconds")
        m[f"{kind} load rss"], m[f"{kind} load extra"] = max(load[0][f"{kind}_peak_rss"]), max(load[0][f"{kind}_extra_rss"])
        m[f"{kind} load profile"] = [mean_profile(r, f"{kind}_profile") for r in load]
        m[f"{kind} load cached"] = max((c for c in load[0][f"{kind}_cached_before"] if c is not None), default=None)
    m["load_noverify"] = worst(load, "noverify_seconds")
    for r in range(args.nproc):
        os.remove(os.path.join(work, f"raw-rank{r}.bin"))

    m["consolidate"] = None
    if not args.quick:
        out = os.path.join(work, "consolidated")
        LOADAVG[device, "consolidate", 1] = os.getloadavg()[0]
        rc, wall, peak, err = run_child([sys.executable, "consolidate.py", ckpt_dir, out], args.timeout)
        if rc != 0:
            raise SystemExit(f"consolidate.py failed (exit {rc}):\n{err[-3000:]}")
        m["consolidate"] = (wall, peak, sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)))
        shutil.rmtree(out)
    shutil.rmtree(os.path.join(work, "sync"))
    shutil.rmtree(os.path.join(work, "sync-plain"))
    if args.quick:
        shutil.rmtree(work)
        return m

    asyn = launch(args, "async", device, os.path.join(work, "async"), work)
    for k in (1, 2):
        m[f"async_blocked_{k}"], m[f"async_commit_{k}"] = worst(asyn, f"blocked_seconds_{k}"), worst(asyn, f"seconds_{k}")
        m[f"async_blocked_profile_{k}"] = [r[f"blocked_profile_{k}"] for r in asyn]
    m["async_rss"], m["async_extra"] = asyn[0]["peak_rss"], asyn[0]["peak_rss"] - asyn[0]["rss_before"]
    m["async_profile"] = [r["profile"] for r in asyn]
    shutil.rmtree(os.path.join(work, "async"))

    base = launch(args, "baseline", device, work, work)
    m["base"], m["base_bytes"] = worst(base, "seconds"), base[0]["bytes"]
    m["base_rss"], m["base_extra"] = base[0]["peak_rss"], base[0]["peak_rss"] - base[0]["rss_before"]
    m["base_profile"] = [r["profile"] for r in base]
    os.remove(os.path.join(work, "full.pt"))

    steps = launch(args, "steps", device, os.path.join(work, "steps"), work)
    # A step ends at the same all-reduce on every rank: rank 0's times are the job's.
    m["steps_plain"], m["steps_async"], m["forced_waits"] = steps[0]["plain"], steps[0]["async"], steps[0]["forced_waits"]
    shutil.rmtree(work)
    return m


def verdict(ok):
    return "PASS" if ok else "MISS"


def report(args, device, m):
    mean = lambda xs: sum(xs) / len(xs)
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / max(len(xs) - 1, 1)
    ck, n = m["ckpt_bytes"], args.repeat
    lines = [f"### {device}: {args.nproc} ranks, model dim {args.dim} x {args.n_layers} layers, "
             f"checkpoint {ck / GB:.2f} GB (params + exp_avg + exp_avg_sq); plain DCP {m['plain_bytes'] / GB:.2f} GB", "",
             f"| phase | seconds (median of {n}: all runs) | GB/s | rank-0 peak RSS | rank-0 extra RSS in phase |",
             "|---|---|---|---|---|"]

    def row(name, sec, nbytes, rss=None, extra=None):
        shown = f"{sec:.2f}" if not isinstance(sec, list) else f"{median(sec):.2f}: " + " ".join(f"{x:.2f}" for x in sec)
        sec = median(sec) if isinstance(sec, list) else sec
        rate = f"{nbytes / GB / sec:.3f}" if nbytes else ""
        rss = f"{rss / GB:.2f} GB" if rss is not None else ""
        extra = f"{extra / GB:.2f} GB" if extra is not None else ""
        lines.append(f"| {name} | {shown} | {rate} | {rss} | {extra} |")

    pct = lambda c: "n/a" if c is None else f"{c:.0%}"
    row(f"raw write + fsync, each rank its shard's bytes (fsync alone {m['raw_fsync']:.2f} s)", m["raw_write"],
        m["raw_bytes"])
    row(f"raw read (page cache before: {', '.join(pct(c) for c in m['raw_cached'])})", m["raw_read"], m["raw_bytes"])
    row("ckpt.save (sync)", m["ckpt save"], ck, m["ckpt save rss"], m["ckpt save extra"])
    row("plain DCP save: get_state_dict + dcp.save", m["plain save"], m["plain_bytes"], m["plain save rss"],
        m["plain save extra"])
    row(f"ckpt.load (page cache before: {pct(m['ckpt load cached'])})", m["ckpt load"], ck, m["ckpt load rss"],
        m["ckpt load extra"])
    row(f"plain DCP load: dcp.load + set_state_dict (page cache before: {pct(m['plain load cached'])})", m["plain load"],
        m["plain_bytes"], m["plain load rss"], m["plain load extra"])
    row("ckpt.load(verify=False) (cache dropped again)", m["load_noverify"], ck)
    if not args.quick:
        for k in (1, 2):
            row(f"ckpt.save(async_save=True) #{k}: caller blocked", m[f"async_blocked_{k}"], None)
            row(f"ckpt.save(async_save=True) #{k}: to commit", m[f"async_commit_{k}"], ck,
                *((m["async_rss"], m["async_extra"]) if k == 1 else ()))
        row("baseline: full state dict to rank 0, torch.save, fsync", m["base"], m["base_bytes"], m["base_rss"],
            m["base_extra"])
        wall, peak, size = m["consolidate"]
        lines.append(f"| python consolidate.py CKPT OUT (wall of the process; {size / GB:.2f} GB written) | {wall:.2f} "
                     f"| {size / GB / wall:.3f} | {peak / GB:.2f} GB (its own) | |")
        plain, asyn = mean(m["steps_plain"]), mean(m["steps_async"])
        lines.append(f"| train step, no checkpoint (mean of {len(m['steps_plain'])}) | {plain:.3f} | | | |")
        lines.append(f"| train step, async save every 10 (mean of {len(m['steps_async'])}, max {max(m['steps_async']):.2f}) "
                     f"| {asyn:.3f} | | | |")

    raw_w, raw_r = m["raw_bytes"] / m["raw_write"], m["raw_bytes"] / m["raw_read"]
    # Same state, so a throughput ratio is a ratio of times; each pair was measured side by side.
    pair = lambda a, b: median([x / y for x, y in zip(m[a], m[b])])
    targets = [
        ("ckpt.save / plain dcp.save, throughput of the same state", pair("plain save", "ckpt save"), ">= 0.95"),
        ("ckpt.load / plain dcp.load, throughput of the same state", pair("plain load", "ckpt load"), ">= 1.0"),
        ("ckpt.load GB/s / raw read GB/s (stretch)", ck / median(m["ckpt load"]) / raw_r, ">= 0.6"),
        ("ckpt.save GB/s / raw write GB/s", ck / median(m["ckpt save"]) / raw_w, ">= 0.8"),
        ("(info) plain dcp.save GB/s / raw write GB/s", m["plain_bytes"] / median(m["plain save"]) / raw_w, ""),
        ("(info) plain dcp.load GB/s / raw read GB/s", m["plain_bytes"] / median(m["plain load"]) / raw_r, ""),
        ("(info) ckpt.load(verify=False) / plain dcp.load", median(m["plain load"]) / m["load_noverify"], ""),
    ]
    if not args.quick:
        overhead = asyn / plain - 1
        noise = 2 * (var(m["steps_plain"]) / len(m["steps_plain"]) + var(m["steps_async"]) / len(m["steps_async"])) ** 0.5 / plain
        targets += [
            ("async blocked / sync save, save #1", m["async_blocked_1"] / median(m["ckpt save"]), "<= 0.10"),
            ("async blocked / sync save, save #2", m["async_blocked_2"] / median(m["ckpt save"]), "<= 0.10"),
            ("sharded save speedup vs full state dict", m["base"] / median(m["ckpt save"]), ">= 2"),
            ("rank-0 peak RSS: ours / baseline", m["ckpt save rss"] / m["base_rss"], "<= 0.5"),
            ("step-time overhead, async save every 10 steps", overhead, "<= 0.05"),
        ]
    lines += ["", "| target | measured | goal | |", "|---|---|---|---|"]
    for name, value, goal in targets:
        ok = goal and (value >= float(goal[3:]) if goal.startswith(">=") else value <= float(goal[3:]))
        shown = f"{value:+.1%} (noise: +-{noise:.1%}, 2 standard errors)" if "overhead" in name else f"{value:.3f}"
        lines.append(f"| {name} | {shown} | {goal} | {verdict(ok) if goal else ''} |")
    if not args.quick:
        lines.append(f"| (info) rank-0 extra RSS in the phase: ours / baseline | "
                     f"{m['ckpt save extra'] / GB:.2f} GB / {m['base_extra'] / GB:.2f} GB | | |")

    lines += ["", f"Profile (seconds, rank 0 / rank 1, ...; save and load: mean of {n}; an indented item is part "
              "of the one above it):", ""]
    profiles = [("ckpt.save (sync)", m["ckpt save profile"]), ("plain DCP save", m["plain save profile"]),
                ("ckpt.load", m["ckpt load profile"]), ("plain DCP load", m["plain load profile"])]
    if not args.quick:
        profiles += [("async save #1, while the caller is blocked", m["async_blocked_profile_1"]),
                     ("async save #2, while the caller is blocked", m["async_blocked_profile_2"]),
                     ("async save #1, all of it (background thread included)", m["async_profile"]),
                     ("baseline", m["base_profile"])]
    for name, profs in profiles:
        lines.append(f"- {name}:")
        for key, label in LABELS:
            if any(p.get(key, 0) > 0.005 for p in profs):
                depth = 1 + (len(label) - len(label.lstrip())) // 2
                lines.append(f"{'  ' * depth}- {label.strip()}: {' / '.join(f'{p.get(key, 0):.2f}' for p in profs)}")
    if not args.quick:
        lines.append(f"- step seconds, windows of 10 alternating; with async saves (save after the 5th of each window; "
                     f"{m['forced_waits']} window(s) ended waiting for a commit): "
                     + " ".join(f"{t:.2f}" for t in m["steps_async"]))
        lines.append("- step seconds without: " + " ".join(f"{t:.2f}" for t in m["steps_plain"]))
    lines.append("- 1-minute load average at the start of each phase: "
                 + ", ".join(f"{ph} {v:.1f}" for (dev, ph, _), v in LOADAVG.items() if dev == device))
    return "\n".join(lines)


# A tiny model (harness.SMALL's): coordination, not I/O, is then nearly the whole cost.
TINY = (64, 2, 4)


def coordination(args):
    """--coordination: ckpt vs plain DCP at each world size, seconds and bytes per rank; returns the report."""
    per_world = {}
    for world in args.world_sizes:
        rs = launch(args, "coord", "cpu", os.path.join(args.work, f"coord-{world}"), args.work, nproc=world, model=TINY)
        per_world[world] = rs
        shutil.rmtree(os.path.join(args.work, f"coord-{world}"), ignore_errors=True)
        shutil.rmtree(os.path.join(args.work, f"coord-{world}-plain"), ignore_errors=True)

    lines = [f"### coordination: tiny model (dim {TINY[0]}, {TINY[1]} layers), CPU, gloo; median of {args.repeat} "
             "(each run: the slowest rank's seconds)", "",
             "| ranks | ckpt.save s | plain dcp.save s | save: ckpt / plain | ckpt.load s | plain dcp.load s "
             "| load: ckpt / plain |", "|---|---|---|---|---|---|---|"]
    ratios = {}
    for world, rs in per_world.items():
        t = {op: per_repeat(rs, f"{op} seconds") for op in ("ckpt save", "plain save", "ckpt load", "plain load")}
        ratios[world] = [median([c / p for c, p in zip(t[f"ckpt {x}"], t[f"plain {x}"])]) for x in ("save", "load")]
        lines.append(f"| {world} | {median(t['ckpt save']):.3f} | {median(t['plain save']):.3f} | {ratios[world][0]:.2f} "
                     f"| {median(t['ckpt load']):.3f} | {median(t['plain load']):.3f} | {ratios[world][1]:.2f} |")
    lines += ["", "| target | measured (per world size) | goal | |", "|---|---|---|---|"]
    for i, x in enumerate(("save", "load")):
        worst_ratio = max(r[i] for r in ratios.values())
        lines.append(f"| ckpt.{x} / plain dcp.{x}, tiny model | "
                     + ", ".join(f"{w}: {r[i]:.2f}" for w, r in ratios.items()) + f" | <= 1.1 | {verdict(worst_ratio <= 1.1)} |")

    lines += ["", "Bytes each rank sends / receives per operation through torch.distributed (bench/comm_count.py: "
              "payload under a direct exchange; object collectives counted as the tensor collectives they run). "
              "\"other ranks\": the largest over ranks 1..W-1. The fit is bytes = a + b * W over the world sizes "
              "measured, extrapolated to 4096 ranks.", "",
              "| operation | who | " + " | ".join(f"{w} ranks: sent / received" for w in per_world)
              + " | per added rank (sent + received) | at 4096 ranks, extrapolated (sent + received) |",
              "|---|---|" + "---|" * len(per_world) + "---|---|"]
    for op in ("ckpt save", "plain save", "ckpt load", "plain load"):
        for who, ranks in (("rank 0", lambda w: [0]), ("other ranks", lambda w: range(1, w))):
            cells, xs, ys = [], [], []
            for world, rs in per_world.items():
                sent = max(rs[r][f"{op} sent"][-1] for r in ranks(world))
                recv = max(rs[r][f"{op} recv"][-1] for r in ranks(world))
                cells.append(f"{fmt_bytes(sent)} / {fmt_bytes(recv)}")
                xs.append(world)
                ys.append(max(rs[r][f"{op} sent"][-1] + rs[r][f"{op} recv"][-1] for r in ranks(world)))
            a, b = linear_fit(xs, ys)
            lines.append(f"| {op} | {who} | " + " | ".join(cells) + f" | {fmt_bytes(b)} | {fmt_bytes(a + b * 4096)} |")
    # ckpt's own coordination: what ckpt.save/load send outside the dcp.save/dcp.load they run.
    lines += ["", "ckpt's own coordination: bytes ckpt.save / ckpt.load send + receive outside the dcp.save / dcp.load "
              "they run (DCP's own traffic is the plain DCP rows):", "",
              "| operation | who | " + " | ".join(f"{w} ranks" for w in per_world)
              + " | per added rank | at 4096 ranks, extrapolated |", "|---|---|" + "---|" * len(per_world) + "---|---|"]
    for x in ("save", "load"):
        for who, ranks in (("rank 0", lambda w: [0]), ("other ranks", lambda w: range(1, w))):
            ys = [max(sum(rs[r][f"ckpt {x} {k}"][-1] - rs[r][f"ckpt {x} dcp {k}"][-1] for k in ("sent", "recv"))
                      for r in ranks(world)) for world, rs in per_world.items()]
            a, b = linear_fit(list(per_world), ys)
            lines.append(f"| ckpt.{x} | {who} | " + " | ".join(map(fmt_bytes, ys)) + f" | {fmt_bytes(b)} "
                         f"| {fmt_bytes(a + b * 4096)} |")
    w = max(per_world)
    lines += ["", f"Profile at {w} ranks (seconds, mean of {args.repeat}; rank 0 / the slowest other rank):", ""]
    for op in ("ckpt save", "plain save", "ckpt load", "plain load"):
        profs = [mean_profile(r, f"{op} profile") for r in per_world[w]]
        total = [sum(r[f"{op} seconds"]) / args.repeat for r in per_world[w]]
        lines.append(f"- {op}: {total[0]:.3f} / {max(total[1:]):.3f} in all")
        for key, label in LABELS:
            if any(p.get(key, 0) > 0.0005 for p in profs):
                depth = 1 + (len(label) - len(label.lstrip())) // 2
                lines.append(f"{'  ' * depth}- {label.strip()}: {profs[0].get(key, 0):.3f} / "
                             f"{max(p.get(key, 0) for p in profs[1:]):.3f}")
    lines += ["", "Calls per operation (rank 1, outermost torch.distributed function):", ""]
    w = max(per_world)
    for op in ("ckpt save", "plain save", "ckpt load", "plain load"):
        calls = per_world[w][1][f"{op} calls"]
        lines.append(f"- {op} ({w} ranks): " + ", ".join(f"{k} x{v}" for k, v in sorted(calls.items())))
    lines.append("- 1-minute load average at the start of each launch: "
                 + ", ".join(f"{n} ranks {v:.1f}" for (_, ph, n), v in LOADAVG.items() if ph == "coord"))
    return "\n".join(lines)


def fmt_bytes(n):
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def linear_fit(xs, ys):
    """Least squares y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return my - b * mx, b


def machine(args):
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    disk = subprocess.run(["df", "-h", args.work], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem:.0f} GiB RAM, {gpus} GPU(s), torch {torch.__version__}, "
            f"load average {os.getloadavg()[0]:.1f}; disk: {disk}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp", help="where to make the scratch directory (needs ~8 GB free; deleted after)")
    p.add_argument("--devices", default="auto", help="cpu, cuda or both (auto: cpu, plus cuda with one GPU per rank)")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="runs of each save and load, ckpt and plain DCP alternating")
    p.add_argument("--quick", action="store_true", help="only the save and load phases (ckpt, plain DCP, raw disk)")
    p.add_argument("--coordination", action="store_true",
                   help="only the coordination benchmark: tiny model at --world-sizes, seconds and bytes per rank")
    p.add_argument("--world-sizes", default="2,4,8", help="ranks for --coordination (CPU, gloo)")
    p.add_argument("--ckpt", help="another ckpt.py to measure, e.g. an older version (default: the repository's)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence in the step-time phase")
    p.add_argument("--batch-size", type=int, default=2, help="global batch in the step-time phase")
    p.add_argument("--n-steps", type=int, default=40, help="measured steps, with and without async saves")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per phase")
    # Worker-only (set by launch()).
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--plain", help=argparse.SUPPRESS)
    p.add_argument("--raw", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, REPO)
    if args.ckpt:  # first on the path, so that train_fsdp.py's `import ckpt` finds it too
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.ckpt)))
    if args.phase:
        return worker(args)

    import torch

    if args.devices == "auto":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else [])
    else:
        devices = args.devices.split(",")
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    head = machine(args)
    ckpt_file = os.path.abspath(args.ckpt or os.path.join(REPO, "ckpt.py"))
    with open(ckpt_file, "rb") as f:
        ckpt_file += f" (sha256 {hashlib.sha256(f.read()).hexdigest()[:12]})"
    args.work = tempfile.mkdtemp(prefix="bench_ckpt-", dir=args.work)  # only this is deleted afterwards
    args.results = os.path.join(args.work, "results")
    os.makedirs(args.results)
    reports = []
    try:
        if args.coordination:
            reports.append(coordination(args))
        else:
            for device in devices:
                reports.append(report(args, device, bench_device(args, device)))
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"## bench_ckpt.py\n\ncommand: python {' '.join(sys.argv)}\n\nmachine: {head}\nckpt.py: {ckpt_file}\n"
          f"load average at the end: {os.getloadavg()[0]:.1f}\n")
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
