"""Correct sharded checkpointing for FSDP2 training, in plain public torch APIs.

    import ckpt
    ckpt.check_root("checkpoints")                    # at start-up: claims the root, fails early if it is wrong
    step = ckpt.load("checkpoints", model, optimizer, extra={"sched": scheduler, "data": position}) or 0
    ...
    ckpt.save("checkpoints", step, model, optimizer, extra={"sched": scheduler, "data": position}, keep=3)
    ...
    ckpt.close()                                       # before dist.destroy_process_group()

Every function is called on every rank. Model and optimizer go through
torch.distributed.checkpoint.state_dict, so optimizer state is keyed by parameter
name (never by position), and are written with Distributed Checkpoint (DCP): each
rank writes only its own shards, nothing is gathered. What save() commits, load()
restores exactly, or save() refuses it before writing, naming the key.

Save protocol (save()):
  1. Collect. Model and optimizer state by canonical parameter name; each extra
     object's state_dict(), flattened the one way load() rebuilds it; RNG. A
     value load() could not restore safely is refused here, naming the key.
  2. Agree, in one all-reduce: no rank failed in 1, every rank was given the same
     arguments, and values DCP stores once (model buffers, optimizer steps) are
     equal on every rank. An extra whose state differs between ranks is stored
     once per rank (DCP would keep one rank's copy).
  3. Prepare. Rank 0 claims the root for this run (root/.owner.json: a second
     live run is refused instead of deleting our files) and creates
     root/.tmp-step-N-<id>; every rank checks it can see it (a node-local root
     would scatter the shards over several disks).
  4. Write. dcp.save() writes each rank's shards (and rank 0 the values stored
     once, first in its file); any rank's failure is raised on every rank. A
     thread CRCs each 16 MB block as soon as it is written, so the checksums
     cost no second pass; then the rank fingerprints its shards.
  5. Commit. Rank 0 gathers checksums and fingerprint sums, writes manifest.json
     (checksums, fingerprint, structure of the extras, commit sequence number),
     fsyncs it and renames the directory to root/step-N: readers see all of it
     or nothing.
  6. Retain. Rank 0 deletes the oldest commits beyond `keep`; never the newest.
  With async_save=True, save() returns once step 4 has copied the state to host
  memory (buffers kept from one save to the next); the write, checksums and
  fingerprint run in a background thread, and steps 5-6 run in
  PendingSave.wait(), which every rank calls (the next save calls it too).

Load protocol (load()):
  1. Agree on the arguments, as in save step 2.
  2. Choose. Rank 0 picks the newest commit under the root (by commit order, so
     a rollback's branch wins over older, higher-numbered steps), or the
     checkpoint directory it was given, claims a root it will write to, and
     sends each rank its part of the manifest (the checksums of the files it
     reads: its own and rank 0's).
  3. Verify files: every file the manifest lists is there with its size.
  4. Verify keys. DCP's .metadata is checksummed and read through a restricted
     unpickler (no code from the checkpoint runs); model and optimizer keys and
     shapes must match it.
  5. Read. dcp.load() reads into the live sharded tensors (resharding if the
     layout changed), every block checked against its checksum before its bytes
     are used, and copied straight into the tensor when it was saved whole;
     set_state_dict() maps optimizer state by name; extras are rebuilt from the
     structure saved with them and handed to load_state_dict().
  6. Verify values: the parameter fingerprint and every parameter's optimizer
     state (which keys, which step) must equal what was saved.
  Any step that fails on one rank fails every rank at the next agreement, within
  seconds, with the same CheckpointError.

On-disk layout:
    root/
      .owner.json               the run that writes here (host, pid, job), refreshed while it lives
      step-00000100/            committed: renamed into place after every rank wrote
        manifest.json           ours: step, commit sequence, world size, fingerprint, size
                                and block checksums of every file, structure of the extras
        .metadata               DCP: which key lives in which file (pickle)
        __0_0.distcp            DCP: the values stored once (steps, lrs, buffers), then
                                rank 0's shards of every tensor
        __1_0.distcp            DCP: rank 1's shards ...
      step-00000200/
      .tmp-step-00000300-1a2b/  a save in progress or crashed: never loaded
      .abandoned-step-00000200-9f8e/   a commit on a branch given up by a rollback

Keys inside the DCP checkpoint (standard DCP, readable by torch's own tools):
    model.<fqn>                          parameters and buffers (fp32 master weights)
    optim.state.<fqn>.<name>             optimizer state, e.g. exp_avg, step
    optim.param_groups.<fqn>.<option>    lr, betas, ... per parameter
    extra.<name>.<path>                  an extra's state_dict(), equal on every rank
    rank.<r>.extra.<name>.<path>         an extra's state_dict() that differs per rank
    rank.<r>.rng.<generator>             per-rank RNG state
"""

import concurrent.futures
import contextlib
import copy
import datetime
import hashlib
import io
import json
import logging
import mmap
import os
import pickle
import queue
import random
import re
import shutil
import socket
import threading
import time
import uuid
import zipfile
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)
from torch.distributed.tensor import DTensor

log = logging.getLogger("ckpt")

DEFAULT_TIMEOUT = datetime.timedelta(hours=1)
STALE_AFTER = 120.0  # seconds without a refresh after which another run's claim on a root is abandoned
MANIFEST = "manifest.json"
OWNER = ".owner.json"
FORMAT = 2
STEP_RE = re.compile(r"^step-(\d{8,})$")
ABANDONED_RE = re.compile(r"^\.abandoned-step-(\d{8,})-[0-9a-f]+$")
TMP_PREFIX = ".tmp-"
# Optimizer state flattened to "state.<fqn>.<name>" keys: matched by name, and reshardable.
SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank."""


# DCP reports a failure on any rank as dcp.CheckpointException, a BaseException:
# `except Exception` would let it escape as a raw DCP error instead of a CheckpointError.
_DCP_FAILURES = (Exception, dcp.CheckpointException)


def step_dir(root, step):
    return os.path.join(root, f"step-{step:08d}")


# ---------------------------------------------------------------------------
# Coordination: one gloo group, agreements that cost one all-reduce when all is well
# ---------------------------------------------------------------------------

_groups = {}


def checkpoint_group(timeout=DEFAULT_TIMEOUT, purpose="coordination"):
    """A gloo group, with its own long timeout, for every checkpoint collective.

    Training groups keep a short timeout so that a hung rank is noticed quickly.
    Checkpoint I/O on slow or shared storage can legitimately take much longer;
    run under the training timeout, the first slow save kills the job (or the
    NCCL watchdog aborts it). A separate gloo group also keeps checkpoint
    coordination off the GPU and raises an ordinary error when it times out.
    Creating a group is itself collective: every rank calls this in the same order.
    """
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    if not dist.is_initialized():
        raise CheckpointError("ckpt needs torch.distributed to be initialized (init_process_group)")
    if (timeout, purpose) not in _groups:
        _groups[timeout, purpose] = _collective(lambda: dist.new_group(backend="gloo", timeout=timeout), None,
                                                "create ckpt's process group")
    return _groups[timeout, purpose]


def _collective(fn, group, what):
    """Run one collective; a timeout or a lost peer becomes a CheckpointError naming the phase."""
    try:
        return fn()
    except RuntimeError as e:
        # A gloo group that timed out is unusable: drop it, so the next save makes a fresh one.
        for key in [k for k, g in _groups.items() if g is group]:
            del _groups[key]
        raise CheckpointError(
            f"checkpoint coordination failed at '{what}' on rank {dist.get_rank()}: not every rank reached it "
            f"within the checkpoint timeout (is save/load called on every rank? did a rank crash or hang?). "
            f"Cause: {e}"
        ) from e


def _check_all(error, group, what, args=None):
    """Every rank reports its local error (or None) and, optionally, the arguments it was given
    ({name: value}; a dict value is compared key by key). If any rank failed, or ranks disagree on the
    arguments, all raise the same error, naming what differs.

    One all-reduce when all is well: the max of a failure flag, of a hash h of the arguments and of -h
    (equal hashes iff max(h) == -max(-h)). Messages are exchanged only when something is wrong.
    """
    items = []
    for k, v in (args or {}).items():
        items += [(f"{k}[{i}]", w) for i, w in v.items()] if isinstance(v, dict) else [(k, v)]
    text = " ".join(f"{k}={v}".replace(" ", "") for k, v in items)
    h = _hash(text)
    t = torch.tensor([0 if error is None else 1, h, -h], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), group, what)
    if t[0].item() or t[1].item() != -t[2].item():
        seen = [None] * dist.get_world_size(group)
        _collective(lambda: dist.all_gather_object(seen, (error, text), group=group), group, what)
        if not t[0].item():  # a rank that failed reports no arguments worth comparing: its error comes first
            values = [dict(kv.split("=", 1) for kv in a.split(" ")) for _, a in seen]
            differ = [k for k in {k: 0 for v in values for k in v} if len({v.get(k) for v in values}) > 1][:5]
            hint = (". Values that are not DTensors (model buffers such as BatchNorm statistics, optimizer steps "
                    "and options) must be equal on every rank, since DCP stores one copy: synchronize them before "
                    "save() (e.g. SyncBatchNorm, or an all_reduce), or, if a load failed part-way, load a checkpoint"
                    if any(k.startswith("replicated_values[") for k in differ) else "")
            raise CheckpointError(f"{what} was given different arguments on different ranks: " + ", ".join(
                f"rank {r}: " + " ".join(f"{k}={v.get(k)}" for k in differ) for r, v in enumerate(values)) + hint)
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(seen) if e]
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): " + "; ".join(failed))


def _hash(text):
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def _differ(values, group, what):
    """The keys of {key: str} whose value is not the same on every rank (same keys on every rank):
    one MAX all-reduce of (h, -h) per key, whatever the world size."""
    t = torch.tensor([x for v in values.values() for x in (_hash(v), -_hash(v))], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), group, what)
    return [k for i, k in enumerate(values) if t[2 * i].item() != -t[2 * i + 1].item()]


def _to_rank0(obj, group, what):
    """Gather JSON-able objects on rank 0 (a list there, None elsewhere): each other rank sends only its own."""
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    _collective(lambda: dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group), group, what)
    padded = torch.zeros(size.item() + 8, dtype=torch.uint8)
    padded[:8] = torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8)
    padded[8 : 8 + data.numel()] = data
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))] if dist.get_rank() == 0 else None
    _collective(lambda: dist.gather(padded, out, dst=0, group=group), group, what)
    if out is None:
        return None
    return [json.loads(bytes(t[8 : 8 + t[:8].view(torch.int64).item()].tolist())) for t in out]


def _capture(fn, *args):
    """Run fn on this rank; return (result, None) or (None, "ExcType: message")."""
    try:
        return fn(*args), None
    except Exception as e:  # reported to every rank by _check_all, then raised there
        log.debug("on rank %d", dist.get_rank(), exc_info=True)
        return None, f"{type(e).__name__}: {e}"


def _rank0_each(fn, group, what, *args):
    """Run fn on rank 0 only; it returns a list with one result per rank, and each rank receives its own
    (what a rank receives does not grow with the world size); its failure is raised on every rank."""
    mine = [None]
    if dist.get_rank() == 0:
        results, err = _capture(fn, *args)
        each = [(r, None) for r in results] if err is None else [(None, err)] * dist.get_world_size(group)
    _collective(lambda: dist.scatter_object_list(mine, each if dist.get_rank() == 0 else None, src=0, group=group),
                group, what)
    result, err = mine[0]
    if err:
        raise CheckpointError(f"{what} failed on rank 0: {err}")
    return result


def _rank0(fn, group, what, *args):
    """Run fn on rank 0 only and hand every rank its result; its failure is raised on every rank."""
    return _rank0_each(lambda: [fn(*args)] * dist.get_world_size(group), group, what)


# ---------------------------------------------------------------------------
# The root: one run writes it at a time
# ---------------------------------------------------------------------------

_claims = {}  # root -> (run id, stop event, refresher thread); on rank 0 only


def _check_root(root):
    """A checkpoint root holds only our entries; anything else means a wrong path."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint root {root} exists and is not a directory")
    if not os.path.isdir(root):
        return
    # Hidden names and lost+found are ours or the filesystem's (.nfsXXXX, .snapshot).
    foreign = [n for n in sorted(os.listdir(root)) if not (STEP_RE.match(n) or n.startswith(".") or n == "lost+found")]
    if foreign:
        raise CheckpointError(
            f"{root} does not look like a checkpoint root: it holds {foreign[:5]}; "
            "give a directory that holds only step-NNNNNNNN checkpoints (or a new one)"
        )


def _read_owner(path):
    """(record, seconds since its last refresh), or (None, None) if there is none."""
    try:
        age = time.time() - os.stat(path).st_mtime
        with open(path) as f:
            return json.load(f), age
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        return {}, age  # half-written by a run that died: judged by its age alone


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError):
        return True
    return True


def _claim(root, stale_after):
    """Rank 0: make this run the only writer of root, or raise naming the run that is."""
    path = os.path.join(root, OWNER)
    if root in _claims:
        owner, _ = _read_owner(path)
        if (owner or {}).get("run") != _claims[root][0]:
            raise CheckpointError(f"this run lost its claim on {root} to {owner}: another run writes there now")
        return
    _check_root(root)
    os.makedirs(root, exist_ok=True)
    me = {"run": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
          "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID"),
          "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    for _ in range(3):
        try:
            # Create-exclusive is atomic on local filesystems and NFS v3+; flock is not reliable on NFS.
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner, age = _read_owner(path)
            if owner is None:
                continue  # released meanwhile: try again
            dead = owner.get("host") == me["host"] and not _alive(owner.get("pid"))
            if not dead and age < stale_after:
                who = ", ".join(f"{k} {v}" for k, v in owner.items() if k != "run")
                raise CheckpointError(
                    f"{root} is in use by another run ({who}; "
                    f"claim refreshed {age:.0f} s ago). Two runs on one root delete each other's checkpoints: stop "
                    f"that run or use another root. If it is gone, its claim expires {stale_after:.0f} s after its "
                    f"last refresh (check_root(stale_after=...)), or delete {path}"
                )
            why = "its process is gone" if dead else f"no refresh for {age:.0f} s (stale after {stale_after:.0f} s)"
            log.warning("taking over %s from %s: %s", root, owner, why)
            try:
                os.replace(path, os.path.join(root, f"{TMP_PREFIX}owner-{me['run']}"))  # another taker may win this
                os.remove(os.path.join(root, f"{TMP_PREFIX}owner-{me['run']}"))
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        stop = threading.Event()
        refresher = threading.Thread(target=_refresh_claim, args=(path, me["run"], stop, stale_after / 4),
                                     name="ckpt-claim", daemon=True)  # daemon: a crashed run must still exit
        refresher.start()
        _claims[root] = (me["run"], stop, refresher)
        # Temporary entries left by an earlier run are garbage now that it is gone; ours are created after this.
        for name in os.listdir(root):
            if name.startswith(TMP_PREFIX):
                _remove(os.path.join(root, name), "left by an interrupted save")
        return
    raise CheckpointError(f"could not claim {root}: other runs keep taking it over")


def _refresh_claim(path, run, stop, every):
    # The file's mtime is the heartbeat: a run that stops refreshing it can be taken over.
    while not stop.wait(every):
        try:
            owner, _ = _read_owner(path)
            if (owner or {}).get("run") != run:
                log.error("lost the claim on %s to %s", os.path.dirname(path), owner)
                return
            os.utime(path)
        except OSError as e:
            log.warning("could not refresh %s: %s", path, e)


def _remove(path, why):
    """Delete a directory or file we own; a failure is logged, never fatal (the name is not reused)."""
    try:
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        log.warning("removed %s, %s", path, why)
    except OSError as e:
        log.warning("could not remove %s (%s): %s", path, why, e)


def check_root(root, timeout=DEFAULT_TIMEOUT, stale_after=STALE_AFTER):
    """Claim root for this run and fail now, on every rank, if it cannot hold checkpoints.

    Call once at start-up, on every rank: otherwise a wrong or unwritable root, or a
    root another live run is writing, surfaces only at the first save, and the
    training done until then is lost.
    """
    group = checkpoint_group(timeout)
    root = os.path.abspath(root)
    _check_all(None, group, "check_root()", {"root": root})
    _rank0(_probe_root, group, f"check of the checkpoint root {root}", root, stale_after)


def _probe_root(root, stale_after):
    try:
        _claim(root, stale_after)
        probe = os.path.join(root, f"{TMP_PREFIX}probe-{os.getpid()}")
        os.makedirs(probe, exist_ok=True)
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(b"ok")
        shutil.rmtree(probe)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints under {root}: {e}") from e


def close():
    """End ckpt's part of the run, on every rank, before dist.destroy_process_group().

    Commits a save in flight, releases the root (the next run needs no stale
    wait), stops the refresher thread, frees the async saves' host buffers and
    destroys ckpt's process groups: none of them may outlive the default group
    they were made from.
    """
    try:
        wait_pending()
    finally:
        _release()


def _release():
    for root, (run, stop, refresher) in list(_claims.items()):
        stop.set()
        refresher.join()
        path = os.path.join(root, OWNER)
        if (_read_owner(path)[0] or {}).get("run") == run:
            os.remove(path)
        del _claims[root]
    for group in _groups.values():
        dist.destroy_process_group(group)
    _groups.clear()
    for stager in _stagers:
        stager.close()  # frees the async saves' host copy of the state
    _stagers.clear()


# ---------------------------------------------------------------------------
# Files: checksums, manifests, committed checkpoints in commit order
# ---------------------------------------------------------------------------

# CRC-32 of every 16 MB block of a file. It guards against corruption, not forgery (the manifest
# itself is not signed), and runs 2-3x faster than sha256. Per block, so that load() can check
# exactly the bytes it reads, as it reads them, instead of reading every file twice.
CHECKSUM = "crc32"
BLOCK = 1 << 24  # part of the format: a checkpoint's checksums are per BLOCK bytes (change FORMAT with it)


def _crc(data):
    return f"{zlib.crc32(data):08x}"  # zlib releases the GIL on large buffers: other threads keep working


def _checksum(path):
    with open(path, "rb") as f:
        return [_crc(block) for block in iter(lambda: f.read(BLOCK), b"")]


class _ChecksumFileSystem(FileSystem):
    """DCP's local file system, checksumming every file it writes block by block while it is written
    (_ChecksumStream), not in a second pass. files: {name: {"bytes", "crc32"}} of what it wrote."""

    def __init__(self):
        super().__init__()
        self.files = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            stream = _ChecksumStream(f, path)
            try:
                yield stream
            finally:
                stream.close()  # ends its thread, on failure too
            self.files[os.path.basename(path)] = {"bytes": stream.pos, CHECKSUM: stream.blocks}

    def rename(self, path, new_path):  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        self.files[os.path.basename(new_path)] = self.files.pop(os.path.basename(path))


class _ChecksumStream(io.RawIOBase):
    """A file written front to back (as DCP writes). A thread maps each 16 MB block as soon as it is
    written and CRCs it in the page cache, beside the writes and the fsync that follow: with a core to
    spare the checksums add no time, and they cover the bytes as they go to disk."""

    def __init__(self, f, path):
        self.f, self.pos, self.blocks, self.error = f, 0, [], None
        self.written = queue.SimpleQueue()  # numbers of the blocks written so far, then None
        self.worker = threading.Thread(target=self._checksums, args=(path,), name="ckpt-checksum", daemon=True)
        self.worker.start()

    def _checksums(self, path):
        try:
            with open(path, "rb", buffering=0) as f:
                for b, size in iter(self.written.get, None):
                    self.blocks.append(_crc(_written_block(f, b, size)))
                    if hasattr(os, "posix_fadvise"):  # Linux starts writing the block to disk now, not at the fsync
                        os.posix_fadvise(f.fileno(), b * BLOCK, BLOCK, os.POSIX_FADV_DONTNEED)
        except BaseException as e:  # noqa: B036 - handed to the writer in close()
            self.error = e
            for _ in iter(self.written.get, None):
                pass

    def writable(self):
        return True

    def write(self, data):
        before = self.pos // BLOCK
        n = self.f.write(data)
        self.pos += n
        if self.pos // BLOCK > before:
            self.f.flush()  # the reader must see the whole block
            for b in range(before, self.pos // BLOCK):
                self.written.put((b, BLOCK))
        return n

    def tell(self):
        return self.pos

    def fileno(self):
        self.f.flush()  # DCP asks for it to fsync: what Python still buffers must be in the file first
        return self.f.fileno()

    def flush(self):
        self.f.flush()

    def close(self):
        if self.closed:
            return
        try:
            super().close()
            self.f.close()  # a full disk raises here, on the last buffered bytes
            if self.pos % BLOCK:
                self.written.put((self.pos // BLOCK, self.pos % BLOCK))
        finally:
            self.written.put(None)  # the thread ends, whatever happened
            self.worker.join()
        if self.error:
            raise self.error


def _written_block(f, b, n):
    """Block b (n bytes) of a file this process has just written, mapped read-only: its pages are still
    in the page cache, so the CRC reads them there, with no copy into a buffer first. (load() reads
    into buffers instead; see _VerifiedBlocks. Here the CRC is of what was written, not a check.)"""
    try:
        return memoryview(mmap.mmap(f.fileno(), n, offset=b * BLOCK, access=mmap.ACCESS_READ))
    except (OSError, ValueError):  # a file system that cannot map files (some FUSE mounts), or a short file
        buf = memoryview(bytearray(n))
        if (got := _read_block(f, b, buf)) != n:  # a file system that hides what another handle wrote
            raise CheckpointError(f"{f.name}: read back {got} bytes of block {b}, {n} were written") from None
        return buf


def _read_block(f, b, buf):
    """Read block b of f into buf; returns how many bytes it holds (less than len(buf) only at the end)."""
    f.seek(b * BLOCK)
    n = 0
    while n < len(buf) and (got := f.readinto(buf[n:])):
        n += got
    return n


def _crc_when_read(read, buf):
    """(bytes read, their CRC) of a block another thread is reading into buf (read: its future)."""
    n = read.result()
    return n, _crc(buf[:n])


def fsync_dir(path):
    # A rename is durable only once the directory holding it is flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_digest(manifest):
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_manifest(ckpt_dir, manifest):
    manifest = dict(manifest, manifest_sha256=_manifest_digest(manifest))
    tmp = os.path.join(ckpt_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())  # the manifest must be on disk before the commit rename points at it
    os.replace(tmp, os.path.join(ckpt_dir, MANIFEST))


def read_manifest(ckpt_dir):
    """The manifest of a committed checkpoint, checked against its own digest."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a committed checkpoint")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(f"{path} was edited or is damaged: its digest does not match its content")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')}, this ckpt.py reads {FORMAT}")
    return manifest


def committed_steps(root):
    """Steps of the committed step-NNNNNNNN checkpoints under root, in step order."""
    if not os.path.isdir(root):
        return []
    found = (STEP_RE.match(n) for n in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isfile(os.path.join(root, m.group(0), MANIFEST)))


_seqs = {}  # manifest path -> (its stat, its seq): every save orders the commits, each manifest is read once


def _commits(root):
    """[(seq, name)] of readable commits under root (abandoned ones included), oldest commit first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if STEP_RE.match(name) or ABANDONED_RE.match(name):
            path = os.path.join(root, name, MANIFEST)
            try:
                st = os.stat(path)
                seen = (st.st_ino, st.st_size, st.st_mtime_ns)
                if _seqs.get(path, (None,))[0] != seen:
                    _seqs[path] = (seen, read_manifest(os.path.dirname(path))["seq"])
                out.append((_seqs[path][1], name))
            except (OSError, CheckpointError):
                pass  # not a commit we can order; find_checkpoint() and load() deal with it
    return sorted(out)


def find_checkpoint(path):
    """The checkpoint load() would use: path itself if it is one, else the newest commit under path."""
    name = os.path.basename(os.path.normpath(path))
    if os.path.isfile(os.path.join(path, MANIFEST)) or STEP_RE.match(name) or ABANDONED_RE.match(name):
        return path
    _check_root(path)
    if not os.path.isdir(path):
        return None
    for n in sorted(os.listdir(path)):
        if n.startswith(TMP_PREFIX) and "step-" in n:
            log.warning("ignoring %s: an uncommitted (interrupted or in-progress) save", os.path.join(path, n))
    live = [n for _, n in _commits(path) if STEP_RE.match(n)]
    newest = live[-1] if live else None
    # A step directory whose manifest is unreadable may be the newest commit: return it, and load()
    # refuses it by name, where skipping it would silently go back to an older step.
    step = lambda n: int(STEP_RE.match(n).group(1))  # noqa: E731
    broken = [n for n in os.listdir(path) if STEP_RE.match(n) and n not in live]
    broken = [n for n in broken if newest is None or step(n) > step(newest)]
    if broken:
        return os.path.join(path, max(broken, key=step))
    return os.path.join(path, newest) if newest else None


def _older(ckpt_dir):
    """The newest readable commit beside ckpt_dir, for the hint when ckpt_dir is damaged."""
    root, name = os.path.split(os.path.abspath(ckpt_dir))
    others = [n for _, n in _commits(root) if n != name and STEP_RE.match(n)]
    return os.path.join(root, others[-1]) if others else None


def verify_files(ckpt_dir, manifest, names=None, checksums=True):
    """Compare sizes (and checksums) of the files (all the manifest lists, or names); returns errors."""
    errors = []
    for name in sorted(manifest["files"]) if names is None else names:
        path, want = os.path.join(ckpt_dir, name), manifest["files"][name]
        if not os.path.isfile(path):
            errors.append(f"{path} is missing")
        elif os.path.getsize(path) != want["bytes"]:
            errors.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']}")
        elif checksums and _checksum(path) != want[CHECKSUM]:
            errors.append(f"{path} does not match its checksum (corrupted)")
    return errors


# ---------------------------------------------------------------------------
# Untrusted input: DCP pickles its metadata and non-tensor values
# ---------------------------------------------------------------------------

# DCP stores .metadata with pickle.dump; a plain pickle.load of a checkpoint someone
# sent you runs any code it names. These are the only globals DCP's metadata uses.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # maps a name like "torch.strided" to the layout object
    ("pathlib", "PosixPath"),  # the checkpoint_id recorded at save time
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
} | {("torch", str(d).removeprefix("torch.")) for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
)} | {("torch", "strided")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a DCP metadata type")
        return super().find_class(module, name)


def read_metadata(ckpt_dir, manifest=None):
    """DCP's .metadata, read without running code from the file (and checked against the manifest, if given)."""
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if manifest is not None and [_crc(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)] != \
                manifest["files"][".metadata"][CHECKSUM]:
            raise CheckpointError(f"{path} does not match its checksum (corrupted)")
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read safely: {e}") from e


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose .metadata is read through the restricted unpickler, and whose
    data is checked against the manifest's block checksums as it is read.

    metadata: what read_metadata() already returned for this checkpoint, to skip a second read.
    manifest: checksums to check every byte against before it is used (None: unchecked reads).
    """

    def __init__(self, path, metadata=None, manifest=None):
        super().__init__(path)
        self.safe_metadata, self.manifest = metadata, manifest

    def read_metadata(self, *args, **kwargs):
        metadata = self.safe_metadata or read_metadata(str(self.checkpoint_id))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def checksums(self, name):
        if name not in self.manifest["files"]:  # load() handed this rank its own and rank 0's files' only
            full = read_manifest(str(self.path))
            if full["manifest_sha256"] != self.manifest["manifest_sha256"]:
                raise CheckpointError(f"{self.path}/{MANIFEST} changed while it was being loaded")
            self.manifest = full
        return self.manifest["files"][name][CHECKSUM]

    def read_data(self, plan, planner):
        if self.manifest is None:
            return super().read_data(plan, planner)
        per_file = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        layouts = {}
        for name, items in per_file.items():
            path = os.path.join(str(self.path), name)
            # In file order, block by block: one sequential pass, each block checked once.
            with contextlib.closing(_VerifiedBlocks(path, self.checksums(name))) as blocks:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    where = self.storage_data[item.storage_index]
                    if getattr(where, "transform_descriptors", None):
                        raise CheckpointError(f"{name}: transformed (e.g. compressed) items are not supported")
                    data = blocks.read(where.offset, where.length)
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, data)
                        continue
                    target = planner.resolve_tensor(item).detach()
                    if not _read_into(target, item, blocks, where.offset, where.length, data, layouts):
                        data.seek(0)
                        tensor = torch.load(data, map_location="cpu", weights_only=True)
                        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                            tensor = tensor.narrow(dim, start, length)  # the part of the chunk this rank needs
                        target.copy_(tensor)
                    planner.commit_tensor(item, target)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _read_into(target, item, blocks, offset, length, data, layouts):
    """Copy a whole saved tensor from checked blocks straight into target; False if it is not that simple.

    DCP stores each tensor as one torch.save zip: a pickle that describes the tensor, and a data
    record, the elements in order when the tensor was contiguous. Copying that record from the checked
    blocks skips torch.load's fresh tensor (an allocation, its page faults, a second copy); tensors
    with the same pickle are alike, so torch.load reads each kind of pickle once (layouts).
    """
    with zipfile.ZipFile(data) as z:
        records = {i.filename.rsplit("/", 1)[-1]: i for i in z.infolist()}
        if "data.pkl" not in records or "0" not in records or len(records) > 8:
            return False
        pickled = z.read(records["data.pkl"])
    if pickled not in layouts:
        data.seek(0)
        saved = torch.load(data, map_location="meta", weights_only=True)  # shape, strides, dtype: no data read
        whole = (saved.is_contiguous() and saved.storage_offset() == 0 and not saved.is_conj()
                 and not saved.is_neg() and saved.untyped_storage().nbytes() == saved.nbytes)
        layouts[pickled] = (saved.dtype, tuple(saved.shape), saved.nbytes) if whole else None
    record = records["0"]
    data.seek(record.header_offset)
    head = data.read(30)  # a zip local header: fixed fields, then the name and an extra field
    start = record.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    if layouts[pickled] is None or head[:4] != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED:
        return False
    dtype, shape, nbytes = layouts[pickled]
    if not (dtype == target.dtype and shape == tuple(item.lengths) == tuple(target.shape) and target.is_contiguous()
            and not any(item.storage_offsets) and record.file_size == nbytes and start + nbytes <= length):
        return False
    dest = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
    out, done = dest.reshape(-1).view(torch.uint8), 0
    for piece in blocks.pieces(offset + start, nbytes):
        out[done : done + len(piece)].copy_(torch.frombuffer(piece, dtype=torch.uint8))
        done += len(piece)
    if dest is not target:
        target.copy_(dest)
    return True


class _VerifiedBlocks:
    """A file read through its checksummed 16 MB blocks: read(offset, length) returns a file-like view of
    that range, whose reads copy out of blocks that were checked when they were read (a small range is
    copied into a BytesIO at once). A few blocks are kept, in reused buffers, so the zip reads of a
    tensor's range (its directory at the end, then its data in order) rarely read a block twice.

    Blocks are read into buffers of our own, not mapped: mapped bytes could change between the check
    and their use (the file rewritten, or a page evicted and read again), and a read error there
    kills the process (SIGBUS) where read() raises. (The README gives what mapping would gain.)
    """

    KEEP = 3  # checked blocks kept; with AHEAD, at most 6 buffers of 16 MB per file being read
    AHEAD = 2  # blocks being read ahead, at most

    def __init__(self, path, checksums):
        self.path, self.checksums, self.f = path, checksums, open(path, "rb", buffering=0)
        self.blocks, self.spare = {}, []  # block number -> memoryview of its checked bytes
        # While reading forward, the next blocks are read in one thread (in order, with a file handle of its
        # own) and CRC'd in another, while this one is copied (read() and zlib release the GIL): with cores
        # to spare, neither the disk nor the copy waits for the CRC.
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-read")
        self.checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")
        self.f_ahead = open(path, "rb", buffering=0)
        self.ahead = {}  # block number -> (its buffer, future of (bytes read, their CRC))

    def block(self, b):
        view = self.blocks.pop(b, None)
        if view is None:
            if b >= len(self.checksums):
                raise CheckpointError(f"{self.path} is longer than its checksums say (corrupted)")
            forward = b - 1 in self.blocks  # not a jump (to a range's end, or another rank's part)
            if len(self.blocks) >= self.KEEP:  # reading goes forward: the first block's buffer is reused
                self.spare.append(self.blocks.pop(min(self.blocks)).obj)
            if b in self.ahead:
                full, read = self.ahead.pop(b)
                n, crc = read.result()
            else:
                full = self._buffer()
                n = _read_block(self.f, b, full)
                crc = _crc(full[:n])
            for ahead in range(b + 1, b + 1 + self.AHEAD) if forward else ():
                self._read_ahead(ahead)
            if crc != self.checksums[b]:
                raise CheckpointError(f"{self.path} does not match its checksum at block {b} (corrupted)")
            view = full[:n]
        self.blocks[b] = view
        return view

    def _buffer(self):
        return memoryview(self.spare.pop() if self.spare else bytearray(BLOCK))

    def _read_ahead(self, b):
        if b >= len(self.checksums) or b in self.blocks or b in self.ahead:
            return
        if len(self.ahead) >= self.AHEAD:  # a guess that was not used: its buffer back
            self._drop(min(self.ahead))
        buf = self._buffer()
        read = self.reader.submit(_read_block, self.f_ahead, b, buf)
        self.ahead[b] = (buf, self.checker.submit(_crc_when_read, read, buf))

    def _drop(self, b):
        buf, read = self.ahead.pop(b)
        concurrent.futures.wait([read])  # never reuse a buffer, or close the file, under a running read
        self.spare.append(buf.obj)

    def pieces(self, at, n):
        """Bytes [at, at + n) as checked memoryviews, in order, one per block they span."""
        end = at + n
        while at < end:
            block = self.block(at // BLOCK)
            piece = block[at % BLOCK : min(len(block), at % BLOCK + end - at)]
            if not piece:
                raise CheckpointError(f"{self.path} is shorter than its checksums say (truncated)")
            yield piece
            at += len(piece)

    def read(self, offset, length):
        view = _BlockView(self, offset, length)
        if length > (1 << 20):
            return view
        # A small range (a value, a small tensor) is copied into a BytesIO: torch.load then reads it
        # at C speed instead of through _BlockView's Python readinto, call by call.
        data = bytearray(length)
        view.readinto(data)
        return io.BytesIO(data)

    def close(self):
        try:
            for b in list(self.ahead):
                self._drop(b)
            self.reader.shutdown()
            self.checker.shutdown()
        finally:
            self.f.close()
            self.f_ahead.close()
            self.blocks, self.spare = {}, []


class _BlockView(io.RawIOBase):
    """Bytes [offset, offset + length) of a _VerifiedBlocks file, as a read-only file for torch.load."""

    def __init__(self, blocks, offset, length):
        self.blocks, self.offset, self.length, self.pos = blocks, offset, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, out):
        out = memoryview(out).cast("B")
        n, done = max(0, min(len(out), self.length - self.pos)), 0
        for piece in self.blocks.pieces(self.offset + self.pos, n):
            out[done : done + len(piece)] = piece
            done += len(piece)
        self.pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = (offset, self.pos + offset, self.length + offset)[whence]
        return self.pos

    def tell(self):
        return self.pos


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Loads non-tensor items (lr, betas, scheduler fields) with weights_only=True.

    We hand DCP an already flat state dict, so flatten_state_dict=False and each
    loaded value goes straight into the caller's dict under its key."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.decoded = {}  # small item's bytes -> its value

    def load_bytes(self, read_item, value):
        # The flattened optimizer state repeats every param_group option once per parameter (lr, betas,
        # eps, ...: a dozen small items per parameter, the same bytes for the same value): each distinct
        # one is unpickled once (torch.load costs ~0.1 ms) and every key gets a copy of its own.
        data = value.read()
        if data in self.decoded:
            loaded = copy.deepcopy(self.decoded[data])
        else:
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            if len(data) <= (1 << 16):  # a large value is not kept twice
                self.decoded[data] = copy.deepcopy(loaded)
        self.original_state_dict[read_item.dest_index.fqn] = loaded


# ---------------------------------------------------------------------------
# The state: one flattening for save and load
# ---------------------------------------------------------------------------

# Plain values that torch.load(weights_only=True) restores: DCP stores them pickled.
_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)


def _flatten(value, key, flat):
    """Put value's leaves into flat under dotted keys; return its structure (JSON) to rebuild it.

    The structure is saved in the manifest, so load() rebuilds exactly what was
    saved (lists, tuples, empty dicts, numpy values) without asking a freshly
    constructed object what its state looks like.
    """
    if type(value) in (dict, list, tuple) or isinstance(value, dict):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        children = []
        for k, v in items:
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise CheckpointError(f"{key}: a key of type {type(k).__name__} ({k!r}); use str or int keys")
            children.append([k, _flatten(v, f"{key}.{k}", flat)])
        kind = "dict" if isinstance(value, dict) else type(value).__name__
        return {kind: children if kind == "dict" else [c for _, c in children]}
    if key in flat:
        raise CheckpointError(f"{key}: two entries flatten to this key (a dict key with a '.' in it?)")
    if type(value).__module__ == "numpy":  # arrays and scalars, without importing numpy: stored as tensors
        try:
            flat[key] = torch.from_numpy(value.reshape(-1).copy()).reshape(value.shape)
        except (TypeError, AttributeError) as e:
            raise CheckpointError(f"{key}: a numpy {type(value).__name__} that torch cannot hold ({e})") from e
        return {"numpy": "array" if type(value).__name__ == "ndarray" else "scalar"}
    if not isinstance(value, (torch.Tensor, *_PLAIN)):
        raise CheckpointError(
            f"{key} is a {type(value).__module__}.{type(value).__qualname__}, which load() cannot restore without "
            "running code from the checkpoint. A checkpoint holds tensors, numpy arrays, None/bool/int/float/str/"
            "bytes and dicts/lists/tuples of them: convert it in state_dict() and back in load_state_dict()"
        )
    flat[key] = value
    return None


def _unflatten(structure, key, flat):
    """Inverse of _flatten: the value saved under key, rebuilt from its structure and the loaded leaves."""
    if structure is None:
        return flat[key]
    kind, children = next(iter(structure.items()))
    if kind == "dict":
        return {k: _unflatten(c, f"{key}.{k}", flat) for k, c in children}
    if kind in ("list", "tuple"):
        items = [_unflatten(c, f"{key}.{i}", flat) for i, c in enumerate(children)]
        return items if kind == "list" else tuple(items)
    t = flat[key]  # numpy
    return t.numpy() if children == "array" else t.numpy()[()]


def _leaf_keys(structure, key):
    """The flat keys _flatten() produced for this structure."""
    if structure is None:
        return [key]
    kind, children = next(iter(structure.items()))
    if kind == "dict":
        return [k2 for k, c in children for k2 in _leaf_keys(c, f"{key}.{k}")]
    if kind in ("list", "tuple"):
        return [k2 for i, c in enumerate(children) for k2 in _leaf_keys(c, f"{key}.{i}")]
    return [key]


class _RNG:
    """This rank's RNG streams as tensors (no pickled Python objects in the checkpoint)."""

    GENERATORS = {"torch": (".torch",), "cuda": (".cuda",), "python": (".python_mt", ".python_meta")}  # their leaves

    def state_dict(self):
        version, mt, gauss = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "python_mt": torch.tensor(mt, dtype=torch.int64),
            "python_meta": torch.tensor([version, gauss if gauss is not None else float("nan")], dtype=torch.float64),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state):
        torch.set_rng_state(state["torch"])
        version, gauss = state["python_meta"].tolist()
        random.setstate((int(version), tuple(state["python_mt"].tolist()), None if gauss != gauss else gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])

    @staticmethod
    def reseed(generators, seed):
        """Seed these generators (names of GENERATORS) alone: the others keep what load_state_dict gave them."""
        if "torch" in generators:
            torch.default_generator.manual_seed(seed)
        if "cuda" in generators and torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        if "python" in generators:
            random.seed(seed)


def _digest(flat):
    """A digest of the leaves that are not DTensors: equal on every rank, or DCP keeps one rank's copy."""
    h = hashlib.sha256()
    for k, v in flat.items():
        h.update(k.encode())
        if isinstance(v, DTensor):
            continue  # a global tensor: DCP stores its shards, whatever each rank holds
        if isinstance(v, torch.Tensor):  # pickles of equal tensors differ between processes: hash the bytes
            h.update(f"{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(pickle.dumps(v))
    return h.hexdigest()


def _extras(extra, rng):
    objects = dict(extra or {})
    if "rng" in objects:
        raise CheckpointError("extra 'rng': ckpt saves the RNG state under this name itself (rng=True); rename yours")
    for name, obj in objects.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):  # restored in place, so not a value
            raise CheckpointError(f"extra {name!r} is a {type(obj).__name__}, which has no state_dict() and "
                                  "load_state_dict(): wrap it in an object that has both (the README's Position)")
    if rng:
        objects["rng"] = _RNG()  # the name is ours: user extras live under extra.<name>, RNG under rank.<r>.rng
    return objects


def _extra_prefix(name, rank=None):
    """Where an extra's leaves are keyed: once for all ranks, or per rank (rank given: the RNG, and an
    extra whose state differs between ranks)."""
    if rank is None:
        return f"extra.{name}"
    return f"rank.{rank}." + ("rng" if name == "rng" else f"extra.{name}")


def _collect(model, optimizer, extra, rng):
    """This rank's state: flat model/optimizer keys, and each extra's flat leaves and structure."""
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=SD_OPTIONS), {}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=SD_OPTIONS)
    flat = {}
    _flatten(model_sd, "model", flat)
    _flatten(optim_sd, "optim", flat)
    summary = None if optimizer is None else _optimizer_summary(optim_sd, model_sd)
    extras = {}
    for name, obj in _extras(extra, rng).items():
        leaves = {}
        try:
            extras[name] = (_flatten(obj.state_dict(), "", leaves), leaves)
        except CheckpointError as e:
            raise CheckpointError(f"extra {name!r}: {e}") from None
    return model_sd, flat, extras, summary


def _optimizer_summary(optim_sd, model_sd):
    """{fqn: [state names, step]} for every parameter that has optimizer state; load() compares it."""
    summary = {}
    for key, value in optim_sd.items():
        if not key.startswith("state."):
            continue
        parts = key[len("state."):].split(".")
        fqn = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in model_sd), None)
        if fqn is None:
            continue
        names, step = summary.setdefault(fqn, [[], None])
        names.append(".".join(parts[len(fqn.split(".")):]))
        if parts[-1] == "step" and len(parts) == len(fqn.split(".")) + 1:
            summary[fqn][1] = float(value)
    return {fqn: [sorted(names), step] for fqn, (names, step) in summary.items()}


# Fingerprint: every element's bits weighted by (1 + the sum of its global coordinates), summed
# modulo a prime. Integer arithmetic is exact and order-free, so any layout gives the same value,
# and the weights make a misplaced shard or two swapped rows change it, where a plain sum would not.
_P = 2**31 - 1  # products of two residues stay below 2**62: no int64 overflow
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _weighted_sum(local, offsets):
    """Σ bits(x) * (1 + Σ_d global_coordinate_d(x)) mod _P over one shard at its global offsets."""
    x = local.detach()
    if x.is_complex():
        x, offsets = torch.view_as_real(x), (*offsets, 0)
    if x.dim() == 0:
        x, offsets = x.reshape(1), (0,)
    if x.numel() == 0:
        return 0
    v = x.view(_INT[x.element_size()])
    # = (1 + Σ_d offset_d) * S + Σ_d M_d, with S the sum of the bits and M_d = Σ_k k * (sum of the slice k along d).
    if v.dim() == 1:  # rows of K: index i = r*K + c, so M = K * M_rows + M_columns (+ a short tail)
        K, n = 1024, v.numel()
        m = n // K * K
        S, (m_rows, m_cols) = _moments(v[:m].view(-1, K)) if m else (0, (0, 0))
        tail = v[m:].to(torch.int64) % _P
        index = torch.arange(m, n, dtype=torch.int64, device=v.device)
        S = (S + tail.sum().item()) % _P
        M = (K * m_rows + m_cols + (tail * index % _P).sum().item()) % _P
        return ((1 + offsets[0]) % _P * S + M) % _P
    S, M = _moments(v)
    return ((1 + sum(offsets)) % _P * S + sum(M)) % _P


def _moments(v):
    """(S, [M_d]) of an integer view (see _weighted_sum), modulo _P, coordinates from 0."""
    # Blocks of rows widened into one reused int64 buffer: integer sums of int32 are slow in torch,
    # and a fresh int64 copy of a whole shard costs its page faults and its memory.
    rows = max(1, (1 << 20) // v[0].numel())
    buf = torch.empty(min(v.numel(), rows * v[0].numel()), dtype=torch.int64, device=v.device)
    margins = [torch.zeros(n, dtype=torch.int64, device=v.device) for n in v.shape]
    for start in range(0, v.shape[0], rows):
        block = v[start : start + rows]
        w = buf[: block.numel()].view(block.shape)
        w.copy_(block)
        if v.element_size() == 8:
            w %= _P  # 64-bit patterns: reduced first, so that no sum below can overflow
        for d in range(w.dim()):
            part = w.sum(dim=[i for i in range(w.dim()) if i != d]) % _P  # each |sum| < 2**31 * 2**32
            if d == 0:
                margins[0][start : start + rows] = part
            else:
                margins[d] = (margins[d] + part) % _P
    S = margins[0].sum().item() % _P
    M = [(m * torch.arange(m.numel(), dtype=torch.int64, device=v.device) % _P).sum().item() % _P for m in margins]
    return S, M


def _local_prints(model_sd):
    """This rank's part of the fingerprint, {fqn: int}: summed over ranks (mod _P), an int per tensor of
    model_sd that is identical under any sharding, replication or world size.

    Each element is counted once: a DTensor's shard by the replica whose coordinate
    is 0 on every Replicate mesh dimension (HSDP keeps a copy per replica), at the
    global offset DCP stores it at, and once per copy of its mesh with weight
    1/copies. A plain tensor counts on rank 0 (save() checks that it is the same on
    every rank, since DCP keeps one copy of it).
    """
    tensors = {fqn: t for fqn, t in model_sd.items() if isinstance(t, torch.Tensor)}

    def local(fqn, t):
        if not isinstance(t, DTensor):
            return _weighted_sum(t, (0,) * t.dim())
        coord = t.device_mesh.get_coordinate() or []
        if not all(c == 0 for c, p in zip(coord, t.placements) if p.is_replicate()):
            return 0
        # A DTensor on a sub-mesh (FSDP over "dp" beside tensor parallel) has one whole copy per sub-mesh:
        # weigh each copy by 1/copies, exact modulo the prime, so the copies add up to one.
        copies = dist.get_world_size() // t.device_mesh.size()
        local = _weighted_sum(t.to_local(), t.__create_chunk_list__()[0].offsets)  # where DCP stores this shard
        return local * pow(copies, -1, _P) % _P

    return {fqn: local(fqn, t) if isinstance(t, DTensor) or dist.get_rank() == 0 else 0 for fqn, t in tensors.items()}


def _param_names(model, model_sd):
    """{parameter: [canonical names]}: named_parameters() with wrapper segments dropped.

    torch.compile (_orig_mod) and activation checkpointing (_checkpoint_wrapped_module)
    insert underscore-named wrappers into names; the state dict, and so the
    checkpoint, does not have them. A name must end up as a key of the state dict.
    """
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        keep = [i for i, s in enumerate(parts) if not s.startswith("_")]
        candidates = [name, ".".join(parts[i] for i in keep)]
        canonical = next((c for c in candidates if c in model_sd), None)
        if canonical is None:
            raise CheckpointError(f"parameter {name} has no entry in the model's state dict (canonical names: "
                                  f"{list(model_sd)[:5]}...)")
        out.setdefault(p, []).append(canonical)
    return out


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save(root, step, model, optimizer=None, extra=None, *, keep=None, meta=None, rng=True, async_save=False,
         timeout=DEFAULT_TIMEOUT):
    """Write a sharded checkpoint of step under root; returns its path once committed.

    Call on every rank, with the same arguments. optimizer=None saves the model alone.
    extra: {name: object with state_dict()/load_state_dict()}; state that differs
    between ranks is kept per rank. keep: retain the newest `keep` commits (None
    keeps all). meta: a JSON-able dict stored in the manifest (e.g. the model
    configuration). async_save: return a PendingSave as soon as the state is copied
    to host memory; the files are written in the background and its wait() (on
    every rank) commits.
    """
    wait_pending()  # at most one save in flight: a second would race the first for the root
    group = checkpoint_group(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.abspath(root)
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")

    # 1-2. Collect this rank's state (user code runs here: state_dict()), then agree, in one all-reduce,
    # that no rank failed and every rank was given the arguments that decide the files and collectives.
    collected, err = _capture(_collect, model, optimizer, extra, rng)
    args = {"root": root, "step": step, "keep": keep, "rng": rng, "async_save": async_save,
            "optimizer": optimizer is not None, "extra": sorted(extra or {})}
    # Values that are not DTensors (model buffers, optimizer steps and options) are stored once by DCP: they
    # must be equal on every rank (they differ after a load that failed part-way, say).
    args["replicated_values"] = _capture(lambda: {k: _digest({k: v})[:12] for k, v in collected[1].items()
                                                  if not isinstance(v, DTensor)})[0]
    _check_all(err, group, "save()", args)
    model_sd, flat, extras, summary = collected
    # An extra that differs between ranks would be de-duplicated by DCP to one rank's copy: keep it per rank.
    # The RNG is kept per rank; which of its generators are the same on every rank is recorded, so that a
    # load at another world size can restore those (ranks that drew alike, e.g. tensor-parallel partners,
    # still do) and reseed only the others (an unseeded Python `random` differs between processes).
    rng_leaves = extras["rng"][1] if rng else {}
    # The same keys, in the same order, on every rank (a digest that fails is a value that differs).
    compared = {n: _capture(_digest, extras[n][1])[0] or f"rank {rank}" for n in sorted(extras) if n != "rng"}
    compared.update({f"rng {g}": _digest({k: rng_leaves[k] for k in leaves if k in rng_leaves})  # same keys everywhere
                     for g, leaves in _RNG.GENERATORS.items() if rng})
    differ = _differ(compared, group, "save: compare extras") if compared else []
    per_rank = sorted((["rng"] if rng else []) + [n for n in differ if not n.startswith("rng ")])
    rng_shared = {g: f"rng {g}" not in differ for g, leaves in _RNG.GENERATORS.items()
                  if leaves[0] in rng_leaves}  # cuda: if available
    for name, (structure, leaves) in extras.items():
        prefix = _extra_prefix(name, rank if name in per_rank else None)
        flat.update({prefix + k: v for k, v in leaves.items()})
    # A value that is not a DTensor (a step, an lr, a buffer) is the same on every rank (checked in 2) and
    # DCP keeps one copy, which every rank reads on load. Rank 0 alone hands them to DCP, and first: they
    # share the first block or two of rank 0's file, where DCP would spread them over every rank's
    # files, and each rank would read and check most of the others' files (and need their checksums).
    if rank != 0:
        flat = {k: v for k, v in flat.items() if isinstance(v, DTensor) or k.startswith(f"rank.{rank}.")}
    flat = dict(sorted(flat.items(), key=lambda kv: isinstance(kv[1], DTensor)))

    # 3. Prepare: rank 0 alone touches the root, so ranks never race on mkdir/rmtree.
    tmp, final = _rank0(_prepare, group, f"save: prepare step {step} in {root}", root, step)
    # Each rank must see rank 0's directory: a node-local root loses other nodes' shards.
    err = None if os.path.isdir(tmp) else (
        f"cannot see {tmp}, which rank 0 created: the checkpoint root must be on storage shared by all ranks"
    )
    _check_all(err, group, "save: shared storage check")

    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "fingerprint": None,  # each rank's sums, taken after its write, are added up at the commit
        "optimizer": summary,
        "extra": {n: s for n, (s, _) in extras.items() if n not in per_rank},
        "per_rank": per_rank,  # their structures, one per rank, are gathered at the commit
        "rng_seed": torch.initial_seed(),
        "rng_shared": rng_shared,  # {generator: its state was the same on every rank}
        "meta": meta or {},
    }
    mine = {n: s for n, (s, _) in extras.items() if n in per_rank}
    fqns = [fqn for fqn, v in model_sd.items() if isinstance(v, torch.Tensor)]
    pending = PendingSave(tmp, final, manifest, mine, group, keep, fqns)

    # 4. Write. DCP raises any rank's failure on every rank.
    writer = dcp.FileSystemWriter(tmp, sync_files=True)  # fsync: "committed" must mean "on disk"
    writer.fs = _ChecksumFileSystem()  # checksums every file as it is written
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False)  # keys are flat already: load() asks for these
    if not async_save:
        pending.start(flat, writer, planner, group, background=False)
        return pending.wait()
    # The background thread runs DCP's collectives on a group of its own: the main thread
    # keeps using `group` meanwhile, and two threads on one group would interleave and deadlock.
    async_group = checkpoint_group(timeout, purpose="async")
    # Staged before anything collective starts, so a rank that cannot stage (out of host memory)
    # fails every rank here, with no write of the others left waiting for it.
    staged, err = _capture(_stager().stage, flat)
    shared = [] if err else _capture(_aliased, staged, flat)[0] or []
    if shared:  # e.g. "offload to CPU" of a tensor already on CPU: the next step would change the checkpoint
        err = f"the staged copy of {shared[:5]} shares memory with the live state: it would change while written"
    _check_all(err, group, "save: stage the state")
    # The state is copied to host memory: training may change parameters now.
    pending.start(staged, writer, planner, async_group, background=True)
    _in_flight.append(pending)
    return pending


_stagers = []


def _aliased(staged, live):
    """Keys of staged tensors that share memory with a live tensor."""
    def where(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.device, t.untyped_storage().data_ptr()

    tensors = lambda d: [(k, v) for k, v in d.items() if isinstance(v, torch.Tensor) and v.numel()]  # noqa: E731
    memory = {where(v) for _, v in tensors(live)}
    return [k for k, v in tensors(staged) if where(v) in memory]


def _stager():
    """The async saves' stager, kept until close(): it reuses its host buffers (pinned on CUDA), so after
    the first save, staging is a copy into memory already mapped, the part of a save that blocks training.
    DCP's generic stager copies each tensor once (a FileSystemWriter would deep-copy, then copy again)."""
    if not _stagers:
        _stagers.append(DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                     use_shared_memory=False, use_async_staging=False,
                                                     use_non_blocking_copy=False)))
    return _stagers[0]


_in_flight = []


def wait_pending():
    """Commit the save in flight, if any (on every rank). Call before exiting."""
    while _in_flight:
        _in_flight[0].wait()


class PendingSave:
    """A save being written. wait() blocks until it is committed, on every rank.

    The write, its checksums and this rank's fingerprint sums run in a background
    thread (in the caller's, for a synchronous save); the commit (a gather, rank
    0's rename, an all-reduce) runs in the caller's thread, in wait().
    """

    def __init__(self, tmp, final, manifest, structures, group, keep, fqns):
        self.tmp, self.final, self.manifest, self.group, self.keep = tmp, final, manifest, group, keep
        self.structures, self.fqns = structures, fqns
        self.path = None
        self.t0 = time.monotonic()

    def start(self, state, writer, planner, group, background):
        def job():
            dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
            # The fingerprint of what was written: of the staged copy on an async save, off the training thread.
            # Rank 0 alone holds the tensors that are not DTensors (see save), and alone counts them.
            mine = _local_prints({f: state["model." + f] for f in self.fqns if "model." + f in state})
            prints = [mine.get(f, 0) for f in self.fqns]
            rank = dist.get_rank()
            return {n: dict(d, rank=rank) for n, d in writer.fs.files.items()}, prints

        if background:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
            self.job = pool.submit(job)
            pool.shutdown(wait=False)  # the thread ends when the job does
        else:
            self.job = concurrent.futures.Future()
            try:
                self.job.set_result(job())
            except _DCP_FAILURES as e:
                self.job.set_exception(e)

    def done(self):
        """True when this rank's part is written (no collective; ranks may differ)."""
        return self.job.done()

    def wait(self):
        if self.path is None:
            try:
                (files, prints), err = self.job.result(), None
            except _DCP_FAILURES as e:  # told to every rank below, so none commits or hangs
                files, prints, err = None, None, f"{type(e).__name__}: {e}"
            # Only now is the write over: a wait() interrupted above (Ctrl-C) leaves the save in flight.
            if self in _in_flight:
                _in_flight.remove(self)
            # 5. Every rank checksummed its own files (or failed); rank 0 collects them and commits.
            mine = {"files": files, "prints": prints, "error": err, "structures": self.structures}
            parts = _to_rank0(mine, self.group,
                              f"save of {self.final}: gather checksums")
            # No rank returns before the rename (and retention) is done: returning means "committed".
            _, err = _capture(_commit_rank0, self, parts) if dist.get_rank() == 0 else (None, None)
            _check_all(err, self.group, f"save of {self.final}")
            self.path = self.final
            if dist.get_rank() == 0:
                log.info("checkpoint %s committed (%.2f s)", self.final, time.monotonic() - self.t0)
        return self.path


_parents = {}  # root -> name of the commit this run's state descends from (loaded or last saved)


def _ancestors(root):
    """Names of the commits this run's state descends from, by their manifests' parent links."""
    names, name = set(), _parents.get(root)
    while name and name not in names:
        names.add(name)
        name = (_capture(read_manifest, os.path.join(root, name))[0] or {}).get("parent")
    return names


def _prepare(root, step):
    """Rank 0: a fresh temporary directory for step; an older commit of the same step is moved aside."""
    _claim(root, STALE_AFTER)
    final = step_dir(root, step)
    if os.path.exists(final):
        if os.path.basename(final) in _ancestors(root):  # our state descends from it: keep history as it is
            raise CheckpointError(f"{final} already exists and this run's state descends from it: refusing to "
                                  f"overwrite a committed checkpoint")
        # Committed after the state we continue from: a branch given up by a rollback (or an earlier run
        # started over). Keep it out of load()'s way; retention removes it in commit order.
        aside = os.path.join(root, f".abandoned-step-{step:08d}-{uuid.uuid4().hex[:8]}")
        os.rename(final, aside)
        fsync_dir(root)  # or a power cut brings the abandoned step back under the name we commit to
        log.warning("moved %s aside to %s: this run continues from %s", final, aside, _parents.get(root, "scratch"))
    # DCP assumes an empty directory: old .metadata beside new shards would be trusted. A unique name
    # means a leftover we could not delete never blocks a later save.
    tmp = os.path.join(root, f"{TMP_PREFIX}step-{step:08d}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)  # not fsynced: lost in a crash, it held nothing committed; the commit's fsyncs cover it
    return tmp, final


def _commit_rank0(pending, parts):
    failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"]]
    if failed:
        raise CheckpointError(f"writing failed on {len(failed)} rank(s): {'; '.join(failed)}. Nothing was committed; "
                              "the previous checkpoint is intact")
    tmp, final, root = pending.tmp, pending.final, os.path.dirname(pending.final)
    files = {n: d for part in parts for n, d in part["files"].items()}
    on_disk = sorted(os.listdir(tmp))
    if ".metadata" not in on_disk or sorted(files) != on_disk:
        raise CheckpointError(f"{tmp} holds {on_disk} but ranks reported {sorted(files)}")
    commits = _commits(root)
    seq = commits[-1][0] + 1 if commits else 1  # commit order: "newest" even after a rollback
    prints = {fqn: sum(p["prints"][i] for p in parts) % _P for i, fqn in enumerate(pending.fqns)}
    manifest = dict(pending.manifest, files=files, fingerprint=prints, run=_claims[root][0],
                    parent=_parents.get(root), seq=seq,
                    per_rank={n: [p["structures"][n] for p in parts] for n in pending.manifest["per_rank"]})
    _write_manifest(tmp, manifest)
    fsync_dir(tmp)
    os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
    fsync_dir(root)  # without this a power cut can undo the rename
    _parents[root] = os.path.basename(final)
    # 6. Retain: after the commit, so a crash here never leaves fewer good checkpoints.
    if pending.keep:
        _retain(root, pending.keep, [n for _, n in commits] + [os.path.basename(final)])


def _retain(root, keep, commits):
    """Remove all but the newest `keep` of commits (names, oldest commit first)."""
    for name in commits[: max(len(commits) - max(keep, 1), 0)]:  # by commit order; never the newest
        trash = os.path.join(root, f"{TMP_PREFIX}delete-{name.lstrip('.')}")
        try:
            # Rename first: a crash mid-delete leaves a .tmp- directory, never a half checkpoint.
            os.rename(os.path.join(root, name), trash)
            shutil.rmtree(trash)
            log.info("retention: removed %s (keep=%d)", os.path.join(root, name), keep)
        except OSError as e:
            log.warning("retention: could not remove %s: %s", os.path.join(root, name), e)


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def _targets(model, optimizer, extra, rng, manifest, metadata, ckpt_dir):
    """The flat dict DCP reads into: live shards for the model and optimizer, new tensors for extras."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = metadata.state_dict_metadata
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=SD_OPTIONS), {}
    else:
        # A fresh optimizer gets state for every trainable parameter here (torch fills it by a
        # zero step); parameters that had none when saved keep none (see load step 5).
        model_sd, optim_sd = get_state_dict(model, optimizer, options=SD_OPTIONS)
    flat = {}
    structure = (_flatten(model_sd, "model", flat), _flatten(optim_sd, "optim", flat))

    want = manifest["optimizer"]
    if optimizer is not None and want is None:
        raise CheckpointError(f"{ckpt_dir} was saved without optimizer state: load it with optimizer=None")
    without = set()  # optimizer keys of parameters that had no state when saved: not read
    if optimizer is not None:
        for key in flat:
            if key.startswith("optim.state.") and not any(key.startswith(f"optim.state.{f}.") for f in want):
                without.add(key)
    missing = sorted(k for k in flat if k not in saved and k not in without)
    unexpected = sorted(k for k in saved if k.split(".")[0] in ("model", "optim") and k not in flat
                        and (optimizer is not None or not k.startswith("optim.")))
    reshaped = [f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(v.shape)}" for k, v in flat.items()
                if k in saved and isinstance(v, torch.Tensor) and hasattr(saved[k], "size")
                and tuple(saved[k].size) != tuple(v.shape)]
    found = (("missing from the checkpoint", missing), ("not in the model/optimizer", unexpected),
             ("of another shape", reshaped))
    problems = [f"{len(keys)} key(s) {label}: {keys[:10]}" + (f" (+{len(keys) - 10} more)" if len(keys) > 10 else "")
                for label, keys in found if keys]
    if problems:
        optim_only = all(k.startswith("optim.") for k in missing + unexpected + reshaped)
        hint = " (to load the weights alone, pass optimizer=None)" if optimizer is not None and optim_only else ""
        options = {k.rsplit(".", 1)[1] for k in missing + unexpected if k.startswith("optim.param_groups.")}
        if "initial_lr" in options:  # the most common way to get here
            hint = (" (an LR scheduler adds 'initial_lr' to the optimizer's param_groups when it is created: "
                    "create schedulers before load(), as when they were saved)")
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model/optimizer{hint}: " + "; ".join(problems))
    request = {k: v for k, v in flat.items() if k not in without}

    # Extras are rebuilt from the saved structure; tensors are read into the live object's tensor
    # under the same key when it has one of that shape (keeps a DTensor sharded), else a new one.
    objects, plan = _extras(extra, rng), {}
    for name, obj in objects.items():
        if name == "rng" and "rng" not in manifest["per_rank"]:
            continue  # saved with rng=False
        if name == "rng" and manifest["world_size"] != world:
            if not any(manifest.get("rng_shared", {}).values()):
                continue  # reseeded in load()
            # Rank 0's state: the generators that were the same on every rank are every rank's; load()
            # reseeds the others.
            shape, prefix = manifest["per_rank"]["rng"][0], _extra_prefix("rng", 0)
        elif name in manifest["per_rank"]:
            if manifest["world_size"] != world:
                raise CheckpointError(
                    f"extra {name!r} differed between ranks when {ckpt_dir} was saved at world size "
                    f"{manifest['world_size']}; there is no right way to give it to {world} ranks. Resume at "
                    f"{manifest['world_size']} ranks, or make its state_dict() the same on every rank (e.g. a global "
                    "position) so it reshards")
            shape, prefix = manifest["per_rank"][name][rank], _extra_prefix(name, rank)
        elif name in manifest["extra"]:
            shape, prefix = manifest["extra"][name], _extra_prefix(name)
        else:
            raise CheckpointError(f"extra {name!r} is not in {ckpt_dir}; it holds {sorted(manifest['extra'])}")
        live = {}
        _capture(lambda: _flatten(obj.state_dict(), "", live))  # a fresh object may not even have a state yet
        for key in _leaf_keys(shape, ""):
            meta = saved.get(prefix + key)
            if meta is None:
                raise CheckpointError(f"{ckpt_dir} lacks {prefix + key} of extra {name!r}")
            have = live.get(key)
            if hasattr(meta, "size"):  # a tensor
                fits = (isinstance(have, torch.Tensor) and tuple(have.shape) == tuple(meta.size)
                        and have.dtype == meta.properties.dtype)
                request[prefix + key] = have if fits else torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            else:
                request[prefix + key] = None  # filled by SafeLoadPlanner.load_bytes
        plan[name] = (shape, prefix)
    return structure, flat, request, plan, without


def load(path, model, optimizer=None, extra=None, *, rng=True, verify=True, timeout=DEFAULT_TIMEOUT):
    """Restore the newest commit under path (or the checkpoint at path); returns its step, or None.

    Call on every rank, with the same arguments. optimizer=None loads the weights
    (and extras, if given) alone. Loading an explicit older checkpoint is a
    rollback: this run's next save becomes the newest commit, and a step of the
    abandoned branch with the same number is moved aside, not overwritten.
    """
    group = checkpoint_group(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)

    # 1. Agree on the arguments first: a rank in save() and another in load() meet here, not in a hang.
    _check_all(None, group, "load()", {"path": path, "optimizer": optimizer is not None,
                                       "extra": sorted(extra or {}), "rng": rng, "verify": verify})

    # 2. Rank 0 chooses the checkpoint, so all ranks load the same one.
    def choose():
        found = find_checkpoint(path)
        if found == path and not os.path.isdir(path):
            raise CheckpointError(f"{path}: no such checkpoint directory")
        if found != path:  # path is a root we will write to: claim it before training starts
            _claim(path, STALE_AFTER)
        manifest, damaged = _capture(read_manifest, found) if found else (None, None)
        return [(found, manifest and _share(manifest, r, world), damaged) for r in range(world)]

    ckpt_dir, manifest, damaged = _rank0_each(choose, group, f"load: find a checkpoint in {path}")
    if ckpt_dir is None:
        return None

    def refuse(e):
        older = _older(ckpt_dir)
        hint = f" The newest older committed checkpoint is {older}; pass it explicitly to load it." if older else ""
        return CheckpointError(f"refusing to load a damaged checkpoint: {e}.{hint}")

    # 3-4. Verify files: every file is there with its size, each rank a share of them (checksums are
    # checked as the bytes are read, in 5, so no file is read twice). Verify keys against DCP's metadata,
    # read without executing anything from the file.
    if manifest is None:
        raise refuse(damaged)

    def check():
        errors = verify_files(ckpt_dir, manifest, manifest["stat"], checksums=False) if verify else []
        if errors:
            raise CheckpointError("; ".join(errors))
        return read_metadata(ckpt_dir, manifest if verify else None)

    metadata, err = _capture(check)
    prepared = None
    if not err:
        prepared, mismatch = _capture(_targets, model, optimizer, extra, rng, manifest, metadata, ckpt_dir)
    try:
        _check_all(err, group, f"load: verify {ckpt_dir}")
    except CheckpointError as e:
        raise refuse(e) from e
    _check_all(None if prepared else mismatch, group, f"load: match {ckpt_dir} to the model")
    structure, template, request, plan, without = prepared

    # 5. Read into the live shards, each block checked before its bytes are used; a damaged block
    # fails the load on every rank (the model may then hold part of the checkpoint: load another).
    reader = SafeReader(ckpt_dir, metadata, manifest if verify else None)
    try:
        dcp.load(request, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    except _DCP_FAILURES as e:  # DCP raises every rank's failure on every rank
        raise (refuse(e) if "checksum" in str(e) else CheckpointError(f"reading {ckpt_dir} failed: {e}")) from e
    _, err = _capture(_restore, model, optimizer, extra, manifest, structure, {**template, **request}, plan)
    if rng and "rng" in manifest["per_rank"] and manifest["world_size"] != world:
        # A generator whose state differed between ranks: N streams have no right mapping onto M ranks.
        same = manifest.get("rng_shared", dict.fromkeys(_RNG.GENERATORS, False))  # format 2 did not record it
        shared, reseeded = [g for g, v in same.items() if v], [g for g, v in same.items() if not v]
        seed = int(hashlib.sha256(f"{manifest['rng_seed']}-{manifest['step']}-{rank}".encode()).hexdigest()[:15], 16)
        _RNG.reseed(reseeded, seed)
        if rank == 0:
            alike = {"torch", "cuda"} & set(reseeded)  # what dropout draws from
            log.log(logging.WARNING if alike else logging.INFO,
                "world size changed %d -> %d: RNG restored on every rank: %s (the same on every rank when saved); "
                "reseeded from (seed, step, rank): %s (it differed between ranks)%s", manifest["world_size"], world,
                ", ".join(shared) or "none", ", ".join(reseeded) or "none",
                ". Ranks that must draw alike, such as tensor-parallel partners, need the same seed: reseed "
                "them after load()" if alike else "")

    # 6. Verify what was restored: the fingerprint's sums and any rank's failure in one all-reduce;
    # every rank then compares the same sums with the manifest, so all decide alike.
    fqns = list(manifest["fingerprint"])

    def restored():
        current = get_model_state_dict(model, options=SD_OPTIONS)
        problem = _check_optimizer(model, optimizer, manifest["optimizer"], current) if optimizer is not None else None
        if problem:
            raise CheckpointError(problem)
        mine = _local_prints({f: current[f] for f in fqns})
        return [mine[f] for f in fqns]  # by name, in the manifest's order, as save() sums them

    sums, err = (None, err) if err else _capture(restored)
    total = torch.tensor((sums or [0] * len(fqns)) + [1 if err else 0], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(total, group=group), group, f"load: verify what {ckpt_dir} restored")
    if total[-1].item():
        _check_all(err, group, f"load: restore and verify {ckpt_dir}")
    bad = [f for i, f in enumerate(fqns) if total[i].item() % _P != manifest["fingerprint"][f]]
    if bad:
        raise CheckpointError(f"load: verify what {ckpt_dir} restored failed: parameters differ from what was "
                              f"saved: {bad[:10]}")
    _parents[os.path.dirname(ckpt_dir)] = os.path.basename(ckpt_dir)  # the next save's parent (a rollback's too)
    if rank == 0:
        log.info("loaded %s (step %d, saved at world size %d)", ckpt_dir, manifest["step"], manifest["world_size"])
    return manifest["step"]


def _share(manifest, rank, world):
    """The part of the manifest rank needs: the files it stats (a share of all), the checksums of
    .metadata, of its own files and of rank 0's (which hold the values stored once), its own per-rank
    structures (and rank 0's RNG structure at another world size). A reader that needs another file's
    checksums (a load at another world size) reads them from manifest.json (SafeReader)."""
    names = sorted(manifest["files"])
    needed = set(names[rank::world]) | {n for n in names if n == ".metadata" or n.startswith((f"__{rank}_", "__0_"))}
    other = manifest["world_size"] != world  # then rank 0's RNG structure too: see _targets
    mine = {n: {r: s[r] for r in ({rank, 0} if n == "rng" and other else {rank}) if r < len(s)}
            for n, s in manifest["per_rank"].items()}
    return dict(manifest, stat=names[rank::world], files={n: manifest["files"][n] for n in sorted(needed)},
                per_rank=mine)


def _restore(model, optimizer, extra, manifest, structure, values, plan):
    """Hand the loaded values to the model, optimizer and extras (user code runs here)."""
    model_sd = _unflatten(structure[0], "model", values)
    if optimizer is None:
        set_model_state_dict(model, model_sd, options=SD_OPTIONS)
    else:
        # Parameters without saved state get the placeholders torch made, then their state is dropped.
        optim_sd = _unflatten(structure[1], "optim", values)
        names_of = _param_names(model, model_sd)  # before set_state_dict, which renames keys of a compiled model
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=SD_OPTIONS)
        for p, names in names_of.items():
            if not any(n in manifest["optimizer"] for n in names):
                optimizer.state.pop(p, None)  # no state when saved: none now, as in the uninterrupted run
    objects = _extras(extra, rng=True)
    for name, (shape, prefix) in plan.items():
        objects[name].load_state_dict(_unflatten(shape, prefix, values))


def _check_optimizer(model, optimizer, want, model_sd):
    """Every parameter's optimizer state has the saved keys at the saved step (or none, if it had none)."""
    for p, names in _param_names(model, model_sd).items():
        saved = next((want[n] for n in names if n in want), [[], None])
        st = optimizer.state.get(p, {})
        step = float(st["step"]) if "step" in st else None
        if sorted(st) != sorted(k for k in saved[0] if "." not in k) or step != saved[1]:
            return (f"optimizer state of {names[0]} is {sorted(st)} at step {step} after loading; saved: "
                    f"{saved[0]} at step {saved[1]}")
    return None
