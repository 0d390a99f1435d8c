"""Benchmark ckpt.py at world size 2: against the disk's own limit and the full-state-dict baseline.

    python bench_ckpt.py                               # dim 1024, 8 layers: 101M params, checkpoint 1.2 GB
    python bench_ckpt.py --work /data                  # scratch dir made (and removed) there; ~5 GB free
    python bench_ckpt.py --devices cpu,cuda            # also on GPUs (needs one GPU per rank)

Every phase is its own 2-rank torchrun launch of this file (--phase NAME), so each starts from the same
state: the model built by train_fsdp.build_model, sharded with FSDP2, one AdamW step taken (so the
checkpoint holds parameters + exp_avg + exp_avg_sq). Per-phase peak memory is the rank's VmHWM, reset
(/proc/self/clear_refs, "5") right before the phase; "extra" is that peak minus the RSS at the reset.

  save       ckpt.save (synchronous), profiled (get_state_dict, fingerprint, DCP plan/write/fsync, sha256
             of the written files, commit); then, same launch, the raw limit: each rank writes as many
             bytes as its shard to a file of its own in 64 MB writes and fsyncs it
  load       the raw read of those files, then ckpt.load, then ckpt.load(verify=False), each from a cold
             page cache: posix_fadvise(DONTNEED) per file, checked with util-linux fincore when present
             (dropping all caches, /proc/sys/vm/drop_caches, needs root outside a container). In a VM the
             hypervisor may still cache the disk: "cold" then means "not in this machine's page cache"
  async      ckpt.save(async_save=True) twice: seconds the caller is blocked, seconds to the commit
  baseline   what users fall back to: get_state_dict(full_state_dict=True, cpu_offload=True) gathered on
             rank 0, torch.save to one file, fsync
  steps      training step time without checkpoints and with an asynchronous save every 10 steps
             (commit folded into the step's all-reduce, as in train_fsdp.py), in alternating windows
  consolidate  python consolidate.py CKPT OUT (when consolidate.py exists): wall time, peak RSS (wait4)

Prints a markdown table, the targets with PASS/MISS, and the profile of each phase. Times depend on the
machine and on whatever else runs on it: the header states the CPU count, load average and disk.
"""

import argparse
import collections
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.abspath(__file__))
GB = 1e9


# ---------------------------------------------------------------------------
# Worker side: one phase, in one torchrun launch
# ---------------------------------------------------------------------------

PROF = collections.defaultdict(float)
LOADAVG = {}  # (device, phase): 1-minute load average when the phase started (driver side)


def timed(owner, name, label):
    """Wrap owner.name so that its wall time adds up under PROF[label] (the caller sees no difference)."""
    real = getattr(owner, name)

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
    timed(ckpt, "fingerprint", "fingerprint")
    timed(dcp.FileSystemWriter, "stage", "staging copy")  # DCP's stager for a FileSystemWriter ...
    timed(DefaultStager, "stage", "staging copy")  # ... or the one ckpt.save passes
    timed(dcp, "save", "dcp.save")
    timed(dcp, "load", "dcp.load")
    timed(dcp.FileSystemWriter, "write_data", "write_data")
    timed(dcp.FileSystemWriter, "finish", "finish")
    timed(dcp.FileSystemReader, "read_data", "read_data")
    timed(os, "fsync", "os.fsync")
    timed(ckpt, "_describe_own", "sha256 own")
    timed(ckpt, "verify_files", "verify")
    timed(ckpt, "set_state_dict", "set_state_dict")
    timed(ckpt, "_commit", "commit")


# How the profile is printed: (key, label); "  " marks a part of the item above.
LABELS = [
    ("get_state_dict", "get_state_dict (sharded, ckpt._state)"),
    ("fingerprint", "fingerprint (sum of bits, all-reduce)"),
    ("staging copy", "staging copy to host memory (async)"),
    ("dcp.save", "dcp.save: plan + write + .metadata"),
    ("write_data", "  write_data: serialize + write + fsync"),
    ("finish", "  finish: .metadata (rank 0)"),
    ("sha256 own", "sha256 of own files (ckpt._describe_own)"),
    ("commit", "commit: gather checksums, manifest, rename"),
    ("verify", "verify sha256 against manifest"),
    ("dcp.load", "dcp.load: plan + read"),
    ("read_data", "  read_data: read + deserialize"),
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
    group = ckpt.checkpoint_group()  # gloo, for barriers that work on either device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=group)

    install_profile()
    result = {"rank": rank}
    model, opt, step = build(args, device, args.seq_len if args.phase == "steps" else 16,
                             args.batch_size if args.phase == "steps" else 2)
    sync()
    PROF.clear()
    result["rss_before"] = reset_peak()
    t0 = time.perf_counter()

    if args.phase == "save":
        # ckpt.save, then (same launch, same disk, minutes apart at most) the raw write of as many bytes.
        path = ckpt.save(args.target, 1, model, opt)
        result["seconds"] = time.perf_counter() - t0
        result["peak_rss"] = memory()[1]
        result["bytes"] = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        result["raw_bytes"] = sum(os.path.getsize(p) for p in shard_files(path, rank))
        sync()
        result["raw_write_seconds"], result["raw_fsync_seconds"] = raw_write(args.raw % rank, result["raw_bytes"])

    elif args.phase == "load":
        # The raw read of this rank's file written in the save phase, then ckpt.load, both from a cold cache.
        files = [os.path.join(args.target, n) for n in os.listdir(args.target)]
        drop_cache(files + [args.raw % rank])
        result["raw_cached_before"] = cached_fraction([args.raw % rank])
        sync()
        result["raw_read_seconds"] = raw_read(args.raw % rank)
        result["raw_bytes"] = os.path.getsize(args.raw % rank)
        result["cached_before"] = cached_fraction(files)
        sync()
        PROF.clear()
        result["rss_before"] = reset_peak()
        t0 = time.perf_counter()
        ckpt.load(args.target, model, opt)
        result["seconds"] = time.perf_counter() - t0
        result["peak_rss"] = memory()[1]
        result["profile"] = dict(PROF)
        # Again without the checksum pass, to show what verification costs.
        drop_cache(files)
        sync()
        t0 = time.perf_counter()
        ckpt.load(args.target, model, opt, verify=False)
        result["noverify_seconds"] = time.perf_counter() - t0

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

    result.setdefault("peak_rss", memory()[1])
    result.setdefault("profile", dict(PROF))
    with open(os.path.join(args.results, f"{args.phase}-{args.device}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


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


def launch(args, phase, device, target, work):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--phase", phase, "--device", device, "--target", target,
           "--raw", os.path.join(work, "raw-rank%d.bin"), "--results", args.results, "--dim", str(args.dim),
           "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--n-steps", str(args.n_steps), "--warmup-steps", str(args.warmup_steps)]
    LOADAVG[device, phase] = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(os.cpu_count() // args.nproc, 1))))
    t0 = time.monotonic()
    print(f"[bench] {phase} on {device} ...", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"phase {phase} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    print(f"[bench] {phase} on {device}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    out = []
    for r in range(args.nproc):
        with open(os.path.join(args.results, f"{phase}-{device}-rank{r}.json")) as f:
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


def bench_device(args, device):
    """All phases on one device; returns {name: value} for the report."""
    work = os.path.join(args.work, device)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    m = {}
    worst = lambda rs, key: max(r[key] for r in rs)  # a collective phase lasts as long as its slowest rank

    save = launch(args, "save", device, os.path.join(work, "sync"), work)
    ckpt_dir = os.path.join(work, "sync", "step-00000001")
    m["ckpt_bytes"], m["save"] = save[0]["bytes"], worst(save, "seconds")
    m["save_rss"], m["save_extra"] = save[0]["peak_rss"], save[0]["peak_rss"] - save[0]["rss_before"]
    m["save_profile"] = [r["profile"] for r in save]
    m["raw_bytes"] = sum(r["raw_bytes"] for r in save)
    m["raw_write"], m["raw_fsync"] = worst(save, "raw_write_seconds"), worst(save, "raw_fsync_seconds")

    load = launch(args, "load", device, ckpt_dir, work)
    m["raw_read"], m["raw_cached"] = worst(load, "raw_read_seconds"), [r["raw_cached_before"] for r in load]
    m["load"], m["load_noverify"] = worst(load, "seconds"), worst(load, "noverify_seconds")
    m["load_rss"], m["load_extra"] = load[0]["peak_rss"], load[0]["peak_rss"] - load[0]["rss_before"]
    m["load_cached"] = load[0]["cached_before"]
    m["load_profile"] = [r["profile"] for r in load]
    for r in range(args.nproc):
        os.remove(os.path.join(work, f"raw-rank{r}.bin"))

    if os.path.isfile(os.path.join(REPO, "consolidate.py")):
        out = os.path.join(work, "consolidated")
        LOADAVG[device, "consolidate"] = os.getloadavg()[0]
        rc, wall, peak, err = run_child([sys.executable, "consolidate.py", ckpt_dir, out], args.timeout)
        if rc != 0:
            raise SystemExit(f"consolidate.py failed (exit {rc}):\n{err[-3000:]}")
        m["consolidate"] = (wall, peak, sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)))
        shutil.rmtree(out)
    else:
        m["consolidate"] = None  # HOOK: consolidate.py does not exist yet; the report says so
    shutil.rmtree(os.path.join(work, "sync"))

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
    ck = m["ckpt_bytes"]
    lines = [f"### {device}: {args.nproc} ranks, model dim {args.dim} x {args.n_layers} layers, "
             f"checkpoint {ck / GB:.2f} GB (params + exp_avg + exp_avg_sq)", "",
             "| phase | seconds | GB/s | rank-0 peak RSS | rank-0 extra RSS in phase |", "|---|---|---|---|---|"]

    def row(name, sec, nbytes, rss=None, extra=None):
        rate = f"{nbytes / GB / sec:.3f}" if nbytes else ""
        rss = f"{rss / GB:.2f} GB" if rss is not None else ""
        extra = f"{extra / GB:.2f} GB" if extra is not None else ""
        lines.append(f"| {name} | {sec:.2f} | {rate} | {rss} | {extra} |")

    pct = lambda c: "n/a" if c is None else f"{c:.0%}"
    row(f"raw write + fsync, each rank its shard's bytes (fsync alone {m['raw_fsync']:.2f} s)", m["raw_write"],
        m["raw_bytes"])
    row(f"raw read (page cache before: {', '.join(pct(c) for c in m['raw_cached'])})", m["raw_read"], m["raw_bytes"])
    row("ckpt.save (sync)", m["save"], ck, m["save_rss"], m["save_extra"])
    row(f"ckpt.load (page cache before: {pct(m['load_cached'])})", m["load"], ck, m["load_rss"], m["load_extra"])
    row("ckpt.load(verify=False) (cache dropped again)", m["load_noverify"], ck)
    for k in (1, 2):
        row(f"ckpt.save(async_save=True) #{k}: caller blocked", m[f"async_blocked_{k}"], None)
        row(f"ckpt.save(async_save=True) #{k}: to commit", m[f"async_commit_{k}"], ck,
            *((m["async_rss"], m["async_extra"]) if k == 1 else ()))
    row("baseline: full state dict to rank 0, torch.save, fsync", m["base"], m["base_bytes"], m["base_rss"],
        m["base_extra"])
    if m["consolidate"]:
        wall, peak, size = m["consolidate"]
        lines.append(f"| python consolidate.py CKPT OUT (wall of the process; {size / GB:.2f} GB written) | {wall:.2f} "
                     f"| {size / GB / wall:.3f} | {peak / GB:.2f} GB (its own) | |")
    else:
        lines.append("| consolidate.py | HOOK: consolidate.py not present, not measured | | | |")
    plain, asyn = mean(m["steps_plain"]), mean(m["steps_async"])
    lines.append(f"| train step, no checkpoint (mean of {len(m['steps_plain'])}) | {plain:.3f} | | | |")
    lines.append(f"| train step, async save every 10 (mean of {len(m['steps_async'])}, max {max(m['steps_async']):.2f}) "
                 f"| {asyn:.3f} | | | |")

    raw_w, raw_r = m["raw_bytes"] / m["raw_write"], m["raw_bytes"] / m["raw_read"]
    overhead = asyn / plain - 1
    noise = 2 * (var(m["steps_plain"]) / len(m["steps_plain"]) + var(m["steps_async"]) / len(m["steps_async"])) ** 0.5 / plain
    targets = [
        ("sync save GB/s / raw write GB/s", ck / m["save"] / raw_w, ">= 0.8"),
        ("load GB/s / raw read GB/s", ck / m["load"] / raw_r, ">= 0.8"),
        ("async blocked / sync save, save #1", m["async_blocked_1"] / m["save"], "<= 0.10"),
        ("async blocked / sync save, save #2", m["async_blocked_2"] / m["save"], "<= 0.10"),
        ("sharded save speedup vs full state dict", m["base"] / m["save"], ">= 2"),
        ("rank-0 peak RSS: ours / baseline", m["save_rss"] / m["base_rss"], "<= 0.5"),
        ("step-time overhead, async save every 10 steps", overhead, "<= 0.05"),
    ]
    lines += ["", "| target | measured | goal | |", "|---|---|---|---|"]
    for name, value, goal in targets:
        ok = value >= float(goal[3:]) if goal.startswith(">=") else value <= float(goal[3:])
        shown = f"{value:+.1%} (noise: +-{noise:.1%}, 2 standard errors)" if "overhead" in name else f"{value:.3f}"
        lines.append(f"| {name} | {shown} | {goal} | {verdict(ok)} |")
    lines.append(f"| (info) rank-0 extra RSS in the phase: ours / baseline | "
                 f"{m['save_extra'] / GB:.2f} GB / {m['base_extra'] / GB:.2f} GB | | |")

    lines += ["", "Profile (seconds, rank 0 / rank 1; an indented item is part of the one above it):", ""]
    for name, profs in (("ckpt.save (sync)", m["save_profile"]), ("ckpt.load", m["load_profile"]),
                        ("async save #1, while the caller is blocked", m["async_blocked_profile_1"]),
                        ("async save #2, while the caller is blocked", m["async_blocked_profile_2"]),
                        ("async save #1, all of it (background thread included)", m["async_profile"]),
                        ("baseline", m["base_profile"])):
        lines.append(f"- {name}:")
        for key, label in LABELS:
            if any(p.get(key, 0) > 0.005 for p in profs):
                depth = 1 + (len(label) - len(label.lstrip())) // 2
                lines.append(f"{'  ' * depth}- {label.strip()}: {' / '.join(f'{p.get(key, 0):.2f}' for p in profs)}")
    lines.append(f"- step seconds, windows of 10 alternating; with async saves (save after the 5th of each window; "
                 f"{m['forced_waits']} window(s) ended waiting for a commit): "
                 + " ".join(f"{t:.2f}" for t in m["steps_async"]))
    lines.append("- step seconds without: " + " ".join(f"{t:.2f}" for t in m["steps_plain"]))
    lines.append("- 1-minute load average at the start of each phase: "
                 + ", ".join(f"{ph} {v:.1f}" for (dev, ph), v in LOADAVG.items() if dev == device))
    return "\n".join(lines)


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
    p.add_argument("--work", default="/tmp", help="where to make the scratch directory (needs ~5 GB free; deleted after)")
    p.add_argument("--devices", default="auto", help="cpu, cuda or both (auto: cpu, plus cuda with one GPU per rank)")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence in the step-time phase")
    p.add_argument("--batch-size", type=int, default=2, help="global batch in the step-time phase")
    p.add_argument("--n-steps", type=int, default=40, help="measured steps, with and without async saves")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per phase")
    # Worker-only (set by launch()).
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--raw", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, REPO)
    if args.phase:
        return worker(args)

    import torch

    if args.devices == "auto":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc else [])
    else:
        devices = args.devices.split(",")
    head = machine(args)
    args.work = tempfile.mkdtemp(prefix="bench_ckpt-", dir=args.work)  # only this is deleted afterwards
    args.results = os.path.join(args.work, "results")
    os.makedirs(args.results)
    reports = []
    try:
        for device in devices:
            reports.append(report(args, device, bench_device(args, device)))
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"## bench_ckpt.py\n\ncommand: python {' '.join(sys.argv)}\n\nmachine: {head}\n"
          f"load average at the end: {os.getloadavg()[0]:.1f}\n")
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
