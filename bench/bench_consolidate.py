"""Benchmark consolidate.py: peak memory and throughput on two model sizes, against torch's converter and a copy.

    python bench/bench_consolidate.py                       # ~0.3 GB and ~1.2 GB fp32 models, 500MB output shards
    python bench/bench_consolidate.py --work /data/bench    # somewhere with ~8 GB free; deleted afterwards

For each size, a 2-rank train_fsdp.py run (--steps 1) writes a real checkpoint (model + AdamW state, so the
.distcp files hold about 3x the model bytes). Then, each in a child process whose peak RSS comes from
os.wait4 (ru_maxrss):
  ours      python consolidate.py CKPT OUT --max-shard-size 500MB    (every byte it reads checked against
            the manifest's block checksums; its output fsynced before the commit rename)
  ours nc   the same with --no-checksum (file sizes checked only)
  torch     torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, FILE): loads everything
  cp        cp of the .distcp files (GNU cp copies in the kernel, with copy_file_range); not on disk when it ends
  cp+sync   the same, then `sync FILES` on the copies: on disk, as our output is before its commit
  dd        dd bs=8M of the same files: a copy through user space, read() then write(), as any converter does
Our throughput is model bytes written per second of the child's wall time (Python start-up and torch import
included; start-up alone is ~2 s of imports on an idle machine); "stream" is the rate once streaming has
started, as consolidate.py reports it. The copies' rates are checkpoint bytes per second. Times are the best
of --repeat runs (the torch converter runs once); "CPU" is the child's user + system seconds.

Page cache: the checkpoint was just written, so every reader reads it from memory, unless --drop-caches
(posix_fadvise DONTNEED on each checkpoint file before each run: reads then come from the disk, or in a VM
from whatever the hypervisor caches).
Targets: our peak RSS <= largest output file + 300 MB and flat as the model grows; throughput >= 0.5x copy.
A copy that is not on disk when it ends is the faster baseline; our output must be (it is committed by a rename
after fsync), so cp+sync is the like-for-like one.
"""

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/ is one level down
SIZES = {"0.3 GB": ["--dim", "1024", "--n-layers", "6"], "1.2 GB": ["--dim", "2048", "--n-layers", "6"]}


def measure(cmd, timeout=900):
    """(wall seconds, peak RSS in MB, stderr text, CPU seconds) of cmd run as a child process."""
    t0 = time.monotonic()
    with open(os.devnull, "w") as devnull, tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(cmd, stdout=devnull, stderr=errf, text=True, cwd=REPO, start_new_session=True)
        while True:  # wait4, not wait: it returns this child's own rusage
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                os.killpg(p.pid, 9)
                raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}")
            time.sleep(0.05)
        errf.seek(0)
        err = errf.read()
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"exit {os.waitstatus_to_exitcode(status)}: {' '.join(cmd)}\n{err[-3000:]}")
    return wall, usage.ru_maxrss / 1024, err, usage.ru_utime + usage.ru_stime  # ru_maxrss is in KB on Linux


def drop_caches(enabled, ckpt_dir):
    """True when the checkpoint's files were evicted from the page cache (so the next read comes from disk)."""
    if not enabled:
        return False
    for name in os.listdir(ckpt_dir):
        fd = os.open(os.path.join(ckpt_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # no root needed, other jobs keep their cache
        finally:
            os.close(fd)
    return True


def make_checkpoint(root, model_args):
    """A real 2-rank FSDP2 checkpoint of one step; returns its directory."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train_fsdp.py",
           *model_args, "--steps", "1", "--save-every", "0", "--seq-len", "16", "--batch-size", "2",
           "--ckpt-dir", root]
    measure(cmd, timeout=1800)
    return os.path.join(root, "step-00000001")


def dir_bytes(path, suffix=""):
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(suffix))


def best(runs):
    """The fastest of several (seconds, rss, ...) runs, with the highest peak RSS seen in any of them."""
    fastest = min(runs, key=lambda r: r[0])
    return (fastest[0], max(r[1] for r in runs), *fastest[2:])


def bench_checkpoint(ckpt_dir, work, max_shard_size="500MB", repeat=2, cold=False):
    """One row of measurements on an existing checkpoint; work is a scratch directory (emptied after)."""
    os.makedirs(work, exist_ok=True)
    row = {"checkpoint MB": dir_bytes(ckpt_dir) / 1e6, "cold": True}
    out = os.path.join(work, "hf")
    for label, extra in (("ours", []), ("nc", ["--no-checksum"])):
        runs = []
        for _ in range(repeat):
            row["cold"] &= drop_caches(cold, ckpt_dir)
            seconds, rss, err, cpu = measure([sys.executable, "consolidate.py", ckpt_dir, out,
                                              "--max-shard-size", max_shard_size, *extra])
            check, stream = map(float, re.search(r"(?:check and plan|verify) ([\d.]+) s, stream ([\d.]+) s", err).groups())
            runs.append((seconds, rss, float(re.findall(r"([\d.]+) MB/s", err)[-1]), check, stream, cpu))
            row["model MB"] = dir_bytes(out, ".safetensors") / 1e6
            row["largest file MB"] = max(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)) / 1e6
            row["files"] = sum(n.endswith(".safetensors") for n in os.listdir(out))
            shutil.rmtree(out)
        row[f"{label} s"], row[f"{label} RSS"], row[f"{label} stream MB/s"], row[f"{label} check s"], \
            row[f"{label} stream s"], row[f"{label} CPU"] = best(runs)

    row["cold"] &= drop_caches(cold, ckpt_dir)
    code = ("import sys, warnings; warnings.simplefilter('ignore'); "
            "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
    row["torch s"], row["torch RSS"], _, _ = measure([sys.executable, "-c", code, ckpt_dir, os.path.join(work, "full.pt")])
    os.remove(os.path.join(work, "full.pt"))

    distcp = [os.path.join(ckpt_dir, n) for n in sorted(os.listdir(ckpt_dir)) if n.endswith(".distcp")]
    nbytes = sum(map(os.path.getsize, distcp))
    dst = os.path.join(work, "copy")
    copies = {"cp": lambda: ["cp", *distcp, dst],
              "cp+sync": lambda: ["sh", "-c", f'cp "$@" {dst} && sync {dst}/*', "cp", *distcp],
              "dd": lambda: ["sh", "-c", " && ".join(f"dd if={f} of={dst}/{os.path.basename(f)} bs=8M status=none"
                                                      for f in distcp)]}
    for label, cmd in copies.items():
        runs = []
        for _ in range(repeat):
            row["cold"] &= drop_caches(cold, ckpt_dir)
            os.makedirs(dst)
            runs.append(measure(cmd()))
            shutil.rmtree(dst)
        row[f"{label} MB/s"] = nbytes / 1e6 / best(runs)[0]
    return row


def table(rows):
    lines = [
        "| model (fp32) | checkpoint | files | largest file | ours: peak RSS, s = start-up + check/plan + stream "
        "(MB/s; stream MB/s), CPU s | ours --no-checksum: peak RSS, s (MB/s; stream) | dcp_to_torch_save: peak RSS, s "
        "| cp: MB/s | cp+sync: MB/s | dd: MB/s | ours / cp, / cp+sync, / dd (--no-checksum: / cp) "
        "| RSS <= largest + 300 MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        ours, nc = r["model MB"] / r["ours s"], r["model MB"] / r["nc s"]
        target = max(r["ours RSS"], r["nc RSS"]) <= r["largest file MB"] + 300
        lines.append(
            f"| {r['model MB']:.0f} MB | {r['checkpoint MB']:.0f} MB | {r['files']} | {r['largest file MB']:.0f} MB "
            f"| {r['ours RSS']:.0f} MB, {r['ours s']:.1f} s = {r['ours s'] - r['ours check s'] - r['ours stream s']:.1f} "
            f"+ {r['ours check s']:.1f} + {r['ours stream s']:.1f} ({ours:.0f}; {r['ours stream MB/s']:.0f}), "
            f"{r['ours CPU']:.1f} | {r['nc RSS']:.0f} MB, {r['nc s']:.1f} s ({nc:.0f}; {r['nc stream MB/s']:.0f}) "
            f"| {r['torch RSS']:.0f} MB, {r['torch s']:.1f} s | {r['cp MB/s']:.0f} | {r['cp+sync MB/s']:.0f} "
            f"| {r['dd MB/s']:.0f} | {ours / r['cp MB/s']:.2f}, {ours / r['cp+sync MB/s']:.2f}, {ours / r['dd MB/s']:.2f} "
            f"({nc / r['cp MB/s']:.2f}) | {'yes' if target else 'NO'} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/bench_consolidate", help="scratch directory (deleted afterwards)")
    p.add_argument("--max-shard-size", default="500MB")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {list(SIZES)}")
    p.add_argument("--repeat", type=int, default=2, help="runs of each measurement; the best is reported")
    p.add_argument("--drop-caches", action="store_true",
                   help="evict the checkpoint's files from the page cache before each run (posix_fadvise)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and scratch files")
    p.add_argument("--reuse", action="store_true", help="use the checkpoints a --keep run left in --work")
    args = p.parse_args()
    if os.path.exists(args.work) and not args.reuse:
        raise SystemExit(f"{args.work} exists: give a new scratch directory (or --reuse its checkpoints)")
    rows, load = {}, []
    try:
        for name in args.sizes.split(","):
            t0 = time.monotonic()
            base = os.path.join(args.work, name.replace(" ", ""))
            ckpt_dir = os.path.join(base, "ckpt", "step-00000001")
            if not (args.reuse and os.path.isdir(ckpt_dir)):
                ckpt_dir = make_checkpoint(os.path.join(base, "ckpt"), SIZES[name])
            print(f"{name}: checkpoint written in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            load.append(os.getloadavg()[0])
            rows[name] = bench_checkpoint(ckpt_dir, os.path.join(base, "scratch"), args.max_shard_size,
                                          args.repeat, args.drop_caches)
            load.append(os.getloadavg()[0])
            print(f"{name}: {rows[name]}", file=sys.stderr)
            if not args.keep:
                shutil.rmtree(base)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    cold = all(r["cold"] for r in rows.values())
    print(f"\ncommand: python {' '.join(sys.argv)}\n\n{platform.machine()}, {os.cpu_count()} CPUs, 1-min load average {min(load):.1f}-{max(load):.1f} "
          f"during the runs; --max-shard-size {args.max_shard_size}; best of {args.repeat}; page cache "
          f"{'dropped before each run (cold reads)' if cold else 'warm: every run reads the checkpoint from memory'}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
