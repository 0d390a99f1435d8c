"""Which checksum for ckpt.py's manifest: throughput of the candidates, whether threads scale, and the disk.

    python bench/bench_checksums.py                  # 512 MB in 4 MB chunks, file in /tmp
    python bench/bench_checksums.py --mb 2048 --dir /data

For each function: one thread over the whole buffer, as GB per CPU-second of that thread (what one idle
core does, whatever else runs on the machine) and as GB/s of wall time; then the same bytes split over 2 and
over os.cpu_count() threads (a function that holds the GIL does not speed up; on a busy machine nothing
does); and a GIL probe: the CPU time a pure Python loop in another thread gets while the function hashes,
over the hashing thread's (near 1: the GIL is released while hashing; near 0: it is held). Then the disk: a file of the same size written and
fsynced, read cold (posix_fadvise DONTNEED first) and warm, and read cold while hashing in the same loop.

The manifest guards against corruption (torn writes, bit rot, truncation), not forgery, so a CRC is enough
if it is fast; a cryptographic hash buys nothing here except a name people trust.
"""

import argparse
import concurrent.futures
import hashlib
import os
import platform
import sys
import threading
import time
import zlib

CHUNK = 4 << 20


def sha256():
    h = hashlib.sha256()
    return h.update, h.hexdigest


def blake2b():
    h = hashlib.blake2b()
    return h.update, h.hexdigest


def md5():
    h = hashlib.md5()
    return h.update, h.hexdigest


def _running(fn, start):
    state = [start]

    def update(b):
        state[0] = fn(b, state[0])

    return update, lambda: f"{state[0]:08x}"


FUNCTIONS = {
    "hashlib.sha256": sha256,
    "hashlib.blake2b": blake2b,
    "hashlib.md5": md5,
    "zlib.crc32": lambda: _running(zlib.crc32, 0),
    "zlib.adler32": lambda: _running(zlib.adler32, 1),
}


def digest(make, view):
    update, result = make()
    for i in range(0, len(view), CHUNK):
        update(view[i : i + CHUNK])
    return result()


def single(make, view, repeat):
    """(GB/s of wall time, GB per CPU-second of the thread): the second ignores other jobs on the machine."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.thread_time()
        digest(make, view)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.thread_time() - c0)
    return len(view) / wall / 1e9, len(view) / cpu / 1e9


def threaded(make, view, threads, repeat):
    """GB/s hashing the buffer split into `threads` parts, one independent digest per thread."""
    part = -(-len(view) // threads // CHUNK) * CHUNK
    parts = [view[i : i + part] for i in range(0, len(view), part)]
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(lambda v: digest(make, v), parts))
            best = min(best, time.perf_counter() - t0)
    return len(view) / best / 1e9


def gil_probe(make, view):
    """CPU seconds a pure Python loop in a second thread gets while the first hashes, over the hasher's.

    Near 1: the two threads ran at once, the hash released the GIL. Near 0: the loop ran only between
    chunks, the hash held the GIL. CPU time, not wall time: other jobs on the machine slow both alike."""
    stop, got = threading.Event(), []

    def spin():
        c0, n = time.thread_time(), 0
        while not stop.is_set():
            n += 1
        got.append(time.thread_time() - c0)

    t = threading.Thread(target=spin)
    t.start()
    c0 = time.thread_time()
    for _ in range(2):
        digest(make, view)
    hashing = time.thread_time() - c0
    stop.set()
    t.join()
    return got[0] / hashing


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read(path, make=None):
    """GB/s reading path in CHUNK reads into one reused buffer, hashing each chunk if make is given."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    update = make()[0] if make else None
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if update:
                update(view[:n])
    return os.path.getsize(path) / (time.perf_counter() - t0) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512, help="bytes hashed, in MB")
    p.add_argument("--dir", default="/tmp", help="where the test file is written (deleted afterwards)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is reported")
    args = p.parse_args()
    data = os.urandom(args.mb << 20)
    view = memoryview(data)
    cpus = os.cpu_count() or 1
    threads = sorted({2, cpus})
    print(f"## bench_checksums.py\n\ncommand: python {' '.join(sys.argv)}\n\nmachine: {cpus} CPUs "
          f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, zlib "
          f"{zlib.ZLIB_RUNTIME_VERSION}, {hashlib.sha256().name} from OpenSSL "
          f"{__import__('ssl').OPENSSL_VERSION}; load average {os.getloadavg()[0]:.1f}; {args.mb} MB in "
          f"{CHUNK >> 20} MB chunks, best of {args.repeat}\n")
    print("| function | 1 thread: GB per CPU-second | 1 thread: GB/s wall | "
          + " | ".join(f"{t} threads: GB/s wall (x 1 thread)" for t in threads)
          + " | GIL probe: CPU of a Python loop alongside / CPU hashing (~1: released, ~0: held) |")
    print("|---|---|---|" + "---|" * len(threads) + "---|")
    for name, make in FUNCTIONS.items():
        one, per_cpu = single(make, view, args.repeat)
        cells = [f"{per_cpu:.2f}", f"{one:.2f}"]
        for t in threads:
            rate = threaded(make, view, t, args.repeat)
            cells.append(f"{rate:.2f} ({rate / one:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + f" | {gil_probe(make, view):.2f} |", flush=True)

    path = os.path.join(args.dir, f"bench_checksums-{os.getpid()}.bin")
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for i in range(0, len(view), 64 << 20):
                f.write(view[i : i + (64 << 20)])
            os.fsync(f.fileno())
        write = len(view) / (time.perf_counter() - t0) / 1e9
        rows = [("write + fsync", write)]
        for label, make in (("read, cold", None), ("read, warm", "warm"), ("read + zlib.crc32, cold", "zlib.crc32"),
                            ("read + hashlib.sha256, cold", "hashlib.sha256")):
            best = 0
            for _ in range(args.repeat):
                if make != "warm":
                    drop(path)
                best = max(best, read(path, FUNCTIONS.get(make)))
            rows.append((label, best))
    finally:
        if os.path.exists(path):
            os.remove(path)
    print(f"\n| disk ({args.dir}, {args.mb} MB file, {CHUNK >> 20} MB reads) | GB/s |\n|---|---|")
    for label, rate in rows:
        print(f"| {label} | {rate:.2f} |")


if __name__ == "__main__":
    main()
