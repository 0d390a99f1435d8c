"""One rank, no collectives: ckpt.SafeReader (every block CRC-checked) against DCP's FileSystemReader.

    python bench/bench_reader.py                      # 36 tensors of 16 MB (600 MB) in /tmp; ~1 min
    python bench/bench_reader.py --warm               # from the page cache: the CPU path alone, no disk noise
    python bench/bench_reader.py --mb 16 --count 72 --repeat 7 --dir /data

Writes one checkpoint with dcp.save through ckpt's checksumming file system (the manifest's checksums come from
it), then loads it --repeat times with each reader, alternating which goes first, each from a cold page cache
(posix_fadvise DONTNEED per file) unless --warm, into the same target tensors each time (zeroed first, untimed),
as a load into live parameters. Prints the median seconds and checks both readers returned the same tensors.
On a multi-rank run the two readers do the same per rank; here no other rank competes for the cores.
"""

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import ckpt  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=16, help="size of each tensor")
    p.add_argument("--count", type=int, default=36)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--warm", action="store_true", help="read from the page cache (no drop before each load)")
    args = p.parse_args()
    d = os.path.join(args.dir, f"bench_reader-{os.getpid()}")
    try:
        torch.manual_seed(0)
        state = {f"model.w{i}": torch.randn(args.mb << 18) for i in range(args.count)}
        writer = dcp.FileSystemWriter(d, sync_files=True)
        writer.fs = ckpt._ChecksumFileSystem()
        dcp.save(state, storage_writer=writer, planner=dcp.DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
        manifest = {"files": writer.fs.files}
        metadata = ckpt.read_metadata(d)
        readers = {"ckpt.SafeReader (checked)": lambda: ckpt.SafeReader(d, metadata, manifest),
                   "dcp.FileSystemReader (unchecked)": lambda: dcp.FileSystemReader(d)}
        seconds = {k: [] for k in readers}
        loaded = {k: {n: torch.zeros_like(v) for n, v in state.items()} for k in readers}  # reused, as live params
        for r in range(args.repeat):
            for name in list(readers)[:: 1 if r % 2 == 0 else -1]:
                target = loaded[name]
                for t in target.values():
                    t.zero_()
                for n in os.listdir(d) if not args.warm else []:
                    fd = os.open(os.path.join(d, n), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                t0 = time.perf_counter()
                dcp.load(target, storage_reader=readers[name](),
                         planner=dcp.DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
                seconds[name].append(time.perf_counter() - t0)
        same = all(torch.equal(a, b) for a, b in zip(*(v.values() for v in loaded.values())))
        gb = sum(v.nbytes for v in state.values()) / 1e9
        print(f"## bench_reader.py\n\ncommand: python {' '.join(sys.argv)}\n\n{args.count} tensors of {args.mb} MB "
              f"({gb:.2f} GB), {'page cache warm' if args.warm else 'cold page cache'}, torch {torch.__version__}, "
              f"load average {os.getloadavg()[0]:.1f}\n")
        print(f"| reader | seconds (median of {args.repeat}: all runs) | GB/s |\n|---|---|---|")
        for name, s in seconds.items():
            m = statistics.median(s)
            print(f"| {name} | {m:.2f}: {' '.join(f'{x:.2f}' for x in s)} | {gb / m:.2f} |")
        print(f"\nboth readers returned the same tensors: {same}")
        assert same
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
