"""A peer beside ckpt.py, plain DCP and the raw disk: torch_checkpointing (meta-pytorch; PyPI torch-checkpointing).

    python -m pip install --no-deps --target .peer torch-checkpointing==0.1.1   # bench only, outside site-packages
    python bench/peer.py                        # 3 rounds; --repeat 5 --work /data --dim 1024 --n-layers 8
    python bench/peer.py --peer-path DIR        # the peer installed elsewhere (default: .peer, then site-packages)

The peer is a bench-only install, never a dependency of ckpt.py: installed with --no-deps into .peer/ (ignored by
git), it cannot change the torch the project runs; without it, its rows are skipped and the bench says so. It
requires torch>=2.11, numpy, safetensors and typing_extensions, all already here.

One torchrun launch (2 ranks, gloo, CPU) builds bench.py's big model (train_fsdp's at --dim 1024 --n-layers 8,
one AdamW step) and saves the same state each way: get_state_dict(model, optimizer) for plain DCP and the peer,
ckpt.save(root, step, model, optimizer) for ckpt.py. Per round, each save once into a new directory, in an order
rotated by one each round; then rounds of loads of the last round's saves, each from a cold page cache. Before each
operation, untimed, os.sync(): a save that does not fsync leaves its bytes dirty in the page cache, and their
writeback would otherwise slow the next operation instead of its own. A time is the slowest rank's; the table shows
the median over rounds. An async save's "blocked" ends when the caller may change the parameters again (ckpt.py,
DCP: save() returned; the peer: save() returned and `with manager.lock()` passed, its staging done), "written" when
its future is done. Before the rounds, untimed but shown as "first call": every save once (the peer's async manager
is made by its first save, which starts its writer process); then each load once into zeroed state, checked bit for
bit against the state saved, and the peer's defaults tried (O_DIRECT writes, a resharder), their errors printed.
"""

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import re
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
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import DTensor

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import bench  # noqa: E402  (bench.py's model, plain DCP, the disk and the cache helpers)
import ckpt  # noqa: E402  (bench.py put the repository on sys.path)

# (name, fsynced, checksummed): every save, in the order of the table
SAVES = [("raw write", "yes", "no"), ("plain save", "yes (files)", "no"), ("plain async save", "yes (files)", "no"),
         ("ckpt save", "yes (files, dirs)", "CRC32"), ("ckpt async save", "yes (files, dirs)", "CRC32"),
         ("peer save", "no", "no"), ("peer save + fsync", "yes (by the bench, after)", "no"),
         ("peer async save", "no", "no")]
LOADS = [("raw read", "no"), ("plain load", "no"), ("ckpt load", "CRC32"), ("ckpt load verify=False", "no"),
         ("peer load", "no")]
PEER_OPS = ("peer save", "peer save + fsync", "peer async save", "peer load")
RANK_FILE = re.compile(r"_(\d+)\.\w+$")  # the peer's files: <item>_<rank>.pt


def first_line(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


# ---- worker: every operation, in one torchrun launch ----

def local_tensors(state):
    """Every tensor of a (nested) state dict, DTensors as this rank's shard."""
    if isinstance(state, dict):
        return [t for v in state.values() for t in local_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in local_tensors(v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, torch.Tensor) else []


def digest(model, opt):  # this rank's state, every byte
    h = hashlib.sha256()
    for t in local_tensors(bench.plain_state(model, opt)):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_tensors(path, tensors):  # the raw disk: the same bytes, plain writes, fsync
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
        os.fsync(f.fileno())


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_rank_files(path, rank):  # what the peer leaves out: its files, then (rank 0) the directories
    dist.barrier()  # the peer's save returns on the other ranks before rank 0 has renamed its directory into place
    for name in os.listdir(path):
        match = RANK_FILE.search(name)
        if match and int(match[1]) == rank:
            fsync(os.path.join(path, name))
    dist.barrier()
    if rank == 0:
        fsync(path)
        fsync(os.path.dirname(path))


def worker(args):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.phase = "big"
    model, opt, _ = bench.build(args, world)
    out = {"errors": {}, "bytes": sum(t.numel() * t.element_size() for t in local_tensors(bench.plain_state(model,
                                                                                                                 opt)))}
    peer = None
    if args.peer:
        if args.peer_path:
            sys.path.insert(0, args.peer_path)
        import torch_checkpointing as tc
        from torch_checkpointing.config import SyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        out["peer_version"] = tc.__version__
        buffered = LocalFileSystemStorageConfig(use_direct_io=False)  # its default, O_DIRECT, fails on ext4
        peer = {"sync": tc.CheckpointManager(tc.CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                                                                           storage_config=buffered)),
                "async config": tc.CheckpointManager.Config(storage_config=buffered)}  # async: its default

        def probe(name, config, path):  # a configuration the peer offers, tried once: its error, if any
            manager = tc.CheckpointManager(config)
            try:
                manager.save(os.path.join(args.work, path), bench.plain_state(model, opt))
                out["errors"][name] = None
            except Exception as e:  # noqa: BLE001  (reported, whatever it is)
                out["errors"][name] = first_line(e)
            finally:
                manager.close()
        probe("the peer's default storage (O_DIRECT writes), sync save",
              tc.CheckpointManager.Config(save=SyncCheckpointSaverConfig()), "probe-odirect")
        probe("the peer with a resharder (DefaultResharder on the model), sync save",
              tc.CheckpointManager.Config(save=SyncCheckpointSaverConfig(), storage_config=buffered,
                                          items={"model": tc.ItemSpec(resharder=DefaultResharder())}), "probe-reshard")

    def peer_async(path):
        if "async" not in peer:  # made by the first call, timed: it starts the writer process
            peer["async"] = peer["async config"].build()
        future = peer["async"].save(path, bench.plain_state(model, opt))
        with peer["async"].lock():  # returns once its staging copy is done: the caller may step again
            pass
        return future.result

    def plain_async(path):
        return dcp.async_save(bench.plain_state(model, opt),
                              storage_writer=dcp.FileSystemWriter(path, sync_files=True)).result

    def peer_load(path):
        state = bench.plain_state(model, opt)
        peer["sync"].load(path, into=state)  # into the live tensors, in place
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def ops(d):  # {name: a function of this round's paths; an async one returns its wait}
        def path(name):
            return os.path.join(args.work, f"round-{d}", name)
        os.makedirs(path(""), exist_ok=True)
        return {"raw write": lambda: write_tensors(path("raw") + f"-rank{rank}",
                                                   local_tensors(bench.plain_state(model, opt))),
                "plain save": lambda: bench.plain_save(path("plain"), model, opt),
                "plain async save": lambda: plain_async(path("plain-async")),
                "ckpt save": lambda: ckpt.save(path("ckpt"), 1, model, opt),
                "ckpt async save": lambda: ckpt.save(path("ckpt-async"), 1, model, opt, async_save=True).wait,
                "peer save": lambda: peer["sync"].save(path("peer"), bench.plain_state(model, opt)),
                "peer save + fsync": lambda: (peer["sync"].save(path("peer-fsync"), bench.plain_state(model, opt)),
                                              fsync_rank_files(path("peer-fsync"), rank)),
                "peer async save": lambda: peer_async(path("peer-async")),
                "raw read": lambda: bench.raw_read(path("raw") + f"-rank{rank}"),
                "plain load": lambda: bench.plain_load(path("plain"), model, opt),
                "ckpt load": lambda: ckpt.load(path("ckpt"), model, opt),
                "ckpt load verify=False": lambda: ckpt.load(path("ckpt"), model, opt, verify=False),
                "peer load": lambda: peer_load(path("peer"))}

    def run(name, fn):  # seconds until fn returned (blocked) and until what it returned, if callable, is done
        if rank == 0:  # untimed: the bytes an earlier save left dirty (the peer's) are written back now, not during fn
            os.sync()
        dist.barrier()
        t0 = time.perf_counter()
        wait = fn()
        blocked = time.perf_counter() - t0
        if callable(wait):
            wait()
        out.setdefault(name, []).append(time.perf_counter() - t0)
        if callable(wait):
            out.setdefault(name + " blocked", []).append(blocked)

    def cold(files):
        bench.drop_cache(files)
        dist.barrier()
        if rank == 0:
            out.setdefault("cached", []).append(bench.cached_fraction(files))

    saves = [name for name, _, _ in SAVES if peer or name not in PEER_OPS]
    loads = [name for name, _ in LOADS if peer or name not in PEER_OPS]
    first = ops("warm-up")
    for name in saves:  # first calls, untimed but kept: the peer's first async save starts its writer process
        run(name + " (first)", first[name])
    saved = digest(model, opt)
    for name in loads:  # each load into zeroed state must bring back every byte saved
        if name != "raw read":
            for t in local_tensors(bench.plain_state(model, opt)):
                t.detach().zero_()
            zeroed = digest(model, opt) != saved  # the zeroing reached the live state: the check means something
            first[name]()
            out.setdefault("restored", {})[name] = zeroed and digest(model, opt) == saved
    for i in range(args.repeat):
        dist.barrier()
        if rank == 0:  # only the last round's saves are kept (untimed)
            for name in os.listdir(args.work):
                if name.startswith(("round-", "probe-")):
                    shutil.rmtree(os.path.join(args.work, name))
        dist.barrier()
        round_ops = ops(i)
        for name in saves[i % len(saves):] + saves[: i % len(saves)]:
            run(name, round_ops[name])
    last, kept = ops(args.repeat - 1), os.path.join(args.work, f"round-{args.repeat - 1}")
    files = bench.files_under(kept)
    for i in range(args.repeat):
        for name in loads[i % len(loads):] + loads[: i % len(loads)]:
            cold(files)
            run(name, last[name])
    out["sizes"] = {name: bench.bytes_under(os.path.join(kept, name)) for name in ("plain", "ckpt", "peer")
                    if os.path.isdir(os.path.join(kept, name))}
    for name in ("sync", "async") if peer else ():
        peer[name].close()  # the async one waits for its writer process to end
    with open(os.path.join(args.work, f"peer-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ckpt.close()
    dist.destroy_process_group()


# ---- driver: one launch, one table ----

def launch(args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--worker", "--work", args.work, "--repeat", str(args.repeat),
           "--dim", str(args.dim), "--n-layers", str(args.n_layers), "--timeout", str(args.timeout),
           "--peer-path", args.peer_path or "", *([] if args.peer else ["--no-peer"])]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, os.cpu_count() // args.nproc)))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: a timeout kills the ranks too
    try:
        log = proc.communicate(timeout=args.timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"timed out after {args.timeout} s:\n{proc.communicate()[0][-4000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}):\n{log[-6000:]}")
    results = []
    for rank in range(args.nproc):
        with open(os.path.join(args.work, f"peer-rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def report(args, r):
    size = sum(rank["bytes"] for rank in r)

    def cell(name):  # the median over rounds of the slowest rank's seconds
        return median(bench.slowest(r, name))

    def ratio(name, ref):  # the median of the per-round ratios: load drifts alike on both sides of a ratio
        return median(a / b for a, b in zip(bench.slowest(r, name), bench.slowest(r, ref)))

    lines = [f"| {size / bench.GB:.2f} GB of state, {args.nproc} ranks, median of {args.repeat} | fsynced | "
             "checksummed | seconds (GB/s) | time / plain DCP's (sync or async alike) | first call |",
             "|---|---|---|---|---|---|"]
    for name, synced, summed in SAVES:
        if name not in r[0]:
            continue
        seconds = cell(name)
        first = max(rank[name + " (first)"][0] for rank in r)
        text = f"{seconds:.2f} s ({size / bench.GB / seconds:.2f} GB/s)"
        if name + " blocked" in r[0]:
            text = f"blocked {cell(name + ' blocked'):.2f} s; written {text}"
            first = f"blocked {max(rank[name + ' (first) blocked'][0] for rank in r):.2f} s; written {first:.2f} s"
        else:
            first = f"{first:.2f} s"
        ref = "plain async save" if "async" in name else "plain save"
        lines.append(f"| {name} | {synced} | {summed} | {text} | {ratio(name, ref):.2f}x | {first} |")
    for name, summed in LOADS:
        if name in r[0]:
            seconds = cell(name)
            lines.append(f"| {name}, cold cache | | {summed} | {seconds:.2f} s ({size / bench.GB / seconds:.2f} GB/s)"
                         f" | {ratio(name, 'plain load'):.2f}x | |")
    lines += ["", "Loads into zeroed state, every byte back (sha256 of each rank's state): " + ", ".join(
        f"{name} {all(rank['restored'][name] for rank in r)}" for name in r[0]["restored"])]
    if "peer_version" in r[0]:
        lines.append(f"torch_checkpointing {r[0]['peer_version']}; its defaults, tried once:")
        lines += [f"- {what}: {error or 'ok'}" for what, error in r[0]["errors"].items()]
    else:
        lines.append("torch_checkpointing: not installed, its rows skipped (python -m pip install --no-deps --target "
                     ".peer torch-checkpointing==0.1.1)")
    lines.append("Bytes on disk: " + ", ".join(f"{name} {n / bench.GB:.3f} GB" for name, n in r[0]["sizes"].items()))
    cached = r[0].get("cached", [])
    lines.append(f"Cold cache: after each drop at most {max(cached):.1%} of the files' bytes were cached (fincore)"
                 if cached and None not in cached else "Cold cache NOT verified (fincore missing or failed)")
    lines += ["", "Every run, seconds (slowest rank), in the order measured:"]
    lines += [f"- {key}: " + " ".join(f"{s:.3f}" for s in bench.slowest(r, key))
              for key, value in r[0].items() if isinstance(value, list) and key != "cached"]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="rounds: each save once per round, then each load")
    p.add_argument("--work", default=tempfile.gettempdir(), help="a scratch directory is made (and removed) here")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024, help="hidden size (1024 and 8 layers: ~0.6 GB of state per rank)")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=1800, help="seconds for the launch, ranks killed after")
    p.add_argument("--peer-path", help="where torch_checkpointing is installed (default: .peer if there)")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the peer's rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    default = os.path.join(REPO, ".peer")
    args.peer_path = args.peer_path or (default if os.path.isdir(default) else "")
    if args.peer_path:
        sys.path.insert(0, args.peer_path)
    if args.peer and importlib.util.find_spec("torch_checkpointing") is None:
        print("torch_checkpointing is not installed: its rows are skipped. It is a bench-only install:\n"
              "    python -m pip install --no-deps --target .peer torch-checkpointing==0.1.1", file=sys.stderr)
        args.peer = False
    start = bench.header(args)
    args.work = tempfile.mkdtemp(prefix="peer-", dir=args.work)  # only this is removed afterwards
    try:
        results = launch(args)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"command: python {' '.join(sys.argv)}\nmachine at the start: {start}\n"
          f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(report(args, results))


if __name__ == "__main__":
    sys.exit(main())
