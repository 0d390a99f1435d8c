"""Correct sharded checkpointing for FSDP2 training, in plain public torch APIs.

    import ckpt
    step = ckpt.load("checkpoints", model, optimizer, extra={"sched": scheduler, "data": loader_state})
    ...
    ckpt.save("checkpoints", step, model, optimizer, extra={"sched": scheduler, "data": loader_state}, keep=3)

Both functions are called on every rank. Model and optimizer go through
torch.distributed.checkpoint.state_dict, so optimizer state is keyed by parameter
name (never by position), and are written with Distributed Checkpoint (DCP): each
rank writes only its own shards, nothing is gathered.

Save protocol (save()):
  1. Agree. Every rank sends (root, step) to every other over the checkpoint
     process group; a rank with a different root or step fails all ranks, before
     anything is written. A rank that never calls save() makes the others fail
     when the checkpoint timeout expires.
  2. Prepare. Rank 0 removes stale temporary directories left by crashed saves
     and creates root/.tmp-step-NNNNNNNN; every rank checks that it can see it
     (a node-local root would scatter the shards over several disks).
  3. Write. dcp.save() writes each rank's shards into the temporary directory;
     DCP writes .metadata last, on rank 0, after every rank reported success.
     Any rank's failure is raised on every rank.
  4. Checksum. Each rank hashes the files it wrote; rank 0 gathers sizes and
     checksums into manifest.json, with the step, world size, torch version and
     a fingerprint of the parameters, and fsyncs it.
  5. Commit. Rank 0 renames the temporary directory to root/step-NNNNNNNN. A
     rename within one directory is atomic: readers see all of it or nothing.
  6. Retain. Rank 0 deletes committed checkpoints beyond the newest `keep`.
  With async_save=True, save() returns after step 3 has copied the state to host
  memory; the writing and hashing finish in a background thread, and steps 4-6
  run in PendingSave.wait(), which every rank calls (the next save calls it too).

Load protocol (load()):
  1. Agree on the path, as in save step 1.
  2. Choose. Rank 0 picks the newest committed checkpoint (a step-NNNNNNNN
     directory; one whose manifest.json is missing is refused in 3, not
     skipped), ignoring and reporting temporary ones.
  3. Verify files. Every file's size and checksum is compared with the
     manifest, the work spread over ranks; a mismatch names the file and the
     newest older checkpoint.
  4. Verify keys. DCP's .metadata is read through a restricted unpickler (no code
     from the checkpoint runs) and its keys and shapes are compared with the
     model's and optimizer's; a mismatch names the keys.
  5. Read. dcp.load() reads into the live sharded tensors (resharding if the
     world size changed); set_state_dict() maps optimizer state onto parameters
     by name. Non-tensor items are unpickled with weights_only=True.
  6. Verify values. The parameter fingerprint must equal the manifest's and
     every trainable parameter must have optimizer state at the saved step.

On-disk layout:
    root/
      step-00000100/            committed: renamed into place after every rank wrote
        manifest.json           ours: step, world size, torch version, fingerprint,
                                size and sha256 of every file below
        .metadata               DCP: which key lives in which file (pickle)
        __0_0.distcp            DCP: rank 0's shards of every tensor
        __1_0.distcp            DCP: rank 1's shards ...
      step-00000200/
      .tmp-step-00000300/       a save in progress or crashed: never loaded

Keys inside the DCP checkpoint (standard DCP, readable by torch's own tools):
    model.<fqn>                          parameters and buffers (fp32 master weights)
    optim.state.<fqn>.<name>             optimizer state, e.g. exp_avg, step
    optim.param_groups.<fqn>.<option>    lr, betas, ... per parameter
    extra.<name>.<key>                   each extra object's state_dict()
    rng.<rank>.<generator>               per-rank RNG state
"""

import concurrent.futures
import datetime
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

log = logging.getLogger("ckpt")

DEFAULT_TIMEOUT = datetime.timedelta(hours=1)
MANIFEST = "manifest.json"
FORMAT = 1
STEP_RE = re.compile(r"^step-(\d{8})$")
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
# The checkpoint process group
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
        _groups[timeout, purpose] = dist.new_group(backend="gloo", timeout=timeout)
    return _groups[timeout, purpose]


def _all_gather(obj, group, what):
    """all_gather_object on the checkpoint group; a timeout says which phase hung."""
    out = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint coordination failed at '{what}' on rank {dist.get_rank()}: not every rank "
            f"reached it in time (is save/load called on every rank?). Cause: {e}"
        ) from e
    return out


def _check_all(error, group, what):
    """Every rank reports its local error (or None); if any rank failed, all raise."""
    errors = _all_gather(error, group, what)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): " + "; ".join(failed))


def _from_rank0(obj, group, what):
    return _all_gather(obj, group, what)[0]


def _capture(fn, *args):
    """Run fn on this rank; return (result, None) or (None, "ExcType: message")."""
    try:
        return fn(*args), None
    except Exception as e:  # reported to every rank by _check_all, then raised there
        return None, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------
# Files: listing, hashing, atomic writes
# ---------------------------------------------------------------------------


def committed_steps(root):
    """Steps of committed checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _check_root(root):
    """A checkpoint root holds only our directories; anything else is a wrong path."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint root {root} exists and is not a directory")
    if not os.path.isdir(root):
        return
    foreign = [n for n in sorted(os.listdir(root)) if not (STEP_RE.match(n) or n.startswith(TMP_PREFIX))]
    if foreign:
        raise CheckpointError(
            f"{root} does not look like a checkpoint root: it holds {foreign[:5]}; "
            "give a directory that holds only step-NNNNNNNN checkpoints (or a new one)"
        )


def check_root(root, timeout=DEFAULT_TIMEOUT):
    """Fail now, on every rank, if root cannot hold checkpoints. Call once at start-up, on every rank.

    Otherwise a wrong or unwritable root surfaces only at the first save, and the
    training done until then is lost.
    """
    group = checkpoint_group(timeout)
    root = os.path.abspath(root)
    _, err = _capture(_probe_root, root) if dist.get_rank() == 0 else (None, None)
    _check_all(err, group, f"check of the checkpoint root {root}")


def _probe_root(root):
    _check_root(root)
    try:
        os.makedirs(root, exist_ok=True)
        # A directory with our temporary prefix: if we crash here, the next save removes it.
        probe = os.path.join(root, f"{TMP_PREFIX}probe-{os.getpid()}")
        os.makedirs(probe, exist_ok=True)
        with open(os.path.join(probe, "probe"), "wb") as f:
            f.write(b"ok")
        shutil.rmtree(probe)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints under {root}: {e}") from e


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _describe(path):
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


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
    torch.float8_e4m3fn, torch.float8_e5m2,
)} | {("torch", "strided")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a DCP metadata type")
        return super().find_class(module, name)


def read_metadata(ckpt_dir):
    """DCP's .metadata, read without running code from the file."""
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read safely: {e}") from e


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose .metadata is read through the restricted unpickler.

    metadata: what read_metadata() already returned for this checkpoint, to skip a second read."""

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self.safe_metadata = metadata

    def read_metadata(self, *args, **kwargs):
        metadata = self.safe_metadata or read_metadata(str(self.checkpoint_id))
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Loads non-tensor items (lr, betas, scheduler fields) with weights_only=True.

    We hand DCP an already flat state dict, so flatten_state_dict=False and each
    loaded value goes straight into the caller's dict under its key."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ---------------------------------------------------------------------------
# The state: model, optimizer, extras, RNG -> one flat dict of DCP keys
# ---------------------------------------------------------------------------


def _flatten(tree, prefix=""):
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _unflatten_into(tree, flat, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            _unflatten_into(v, flat, f"{prefix}{k}.")
        else:
            tree[k] = flat[f"{prefix}{k}"]


def _rng_state():
    """This rank's RNG state, as tensors (no pickled Python objects in the checkpoint)."""
    version, mt, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "python_meta": torch.tensor([version, gauss if gauss is not None else float("nan")], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state):
    torch.set_rng_state(state["torch"])
    version, gauss = state["python_meta"].tolist()
    random.setstate((int(version), tuple(state["python_mt"].tolist()), None if gauss != gauss else gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _state(model, optimizer, extra, rng):
    """The nested state of this rank; _flatten() turns it into DCP's flat keys."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=SD_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    if extra:
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    if rng:
        # Per-rank keys: DCP would otherwise keep only one rank's copy of a "replicated" value.
        state["rng"] = {str(dist.get_rank()): _rng_state()}
    return state


def fingerprint(model, group):
    """{fqn: int} summing the bit patterns of every parameter, exact under any sharding.

    Each rank sums its local shard as integers and the sums are all-reduced.
    Integer addition is associative, so the value is identical whatever the world
    size and shard boundaries: the value to compare after a load, reshard included.
    """
    names, sums = [], []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else (p if dist.get_rank() == 0 else p[:0])
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
        names.append(name)
        flat = local.detach().reshape(-1).view(bits)
        # Widened to int64 a chunk at a time: widening whole shards at once left ~200 MB of freed
        # temporaries in the heap at 100M parameters (bench_ckpt.py), on top of the peak memory.
        zero = torch.zeros((), dtype=torch.int64, device=flat.device)
        sums.append(sum((c.to(torch.int64).sum() for c in flat.split(1 << 20)), zero).cpu())
    total = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return dict(zip(names, total.tolist()))


def _optimizer_summary(model, optimizer):
    """What load() checks: which state every trainable parameter has, and its step."""
    keys, steps = set(), set()
    for p in model.parameters():
        st = optimizer.state.get(p, {})
        keys |= set(st)
        if "step" in st:
            steps.add(float(st["step"]))
    if len(steps) > 1:
        raise CheckpointError(f"optimizer parameters are at different steps {sorted(steps)}")
    return {"state_keys": sorted(keys), "step": steps.pop() if steps else None}


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save(root, step, model, optimizer, extra=None, *, keep=None, meta=None, rng=True, async_save=False,
         timeout=DEFAULT_TIMEOUT):
    """Write a sharded checkpoint of step under root; returns its path once committed.

    Call on every rank. extra: {name: object with state_dict()/load_state_dict()}.
    keep: retain the newest `keep` committed checkpoints (None keeps all).
    meta: a JSON-able dict stored in the manifest (e.g. the model configuration).
    async_save: return a PendingSave as soon as the state is copied to host memory;
    the files are written in the background and its wait() (on every rank) commits.
    """
    wait_pending()  # at most one save in flight: a second would race the first for the root
    group = checkpoint_group(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.abspath(root)

    # 1. Agree: ranks that build paths from their own clock or config diverge silently otherwise.
    seen = _all_gather((root, step), group, "save: agree on path")
    if len(set(seen)) > 1:
        raise CheckpointError(
            "save() was given different arguments on different ranks: "
            + ", ".join(f"rank {r}: root={p} step={s}" for r, (p, s) in enumerate(seen))
        )
    final = step_dir(root, step)
    tmp = os.path.join(root, f"{TMP_PREFIX}step-{step:08d}")

    # 2. Prepare: rank 0 alone touches the root, so ranks never race on mkdir/rmtree.
    _, err = _capture(_prepare, root, tmp, final) if rank == 0 else (None, None)
    _check_all(err, group, f"save: prepare {tmp}")
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
        "fingerprint": fingerprint(model, group),
        "optimizer": _optimizer_summary(model, optimizer),
        "extra": sorted(extra or {}),
        "rng": bool(rng),
        "rng_seed": torch.initial_seed(),
        "meta": meta or {},
    }
    pending = PendingSave(tmp, final, manifest, group, keep)

    # 3. Write. DCP raises any rank's failure on every rank.
    state = _flatten(_state(model, optimizer, extra, rng))
    writer = dcp.FileSystemWriter(tmp, sync_files=True)  # fsync: "committed" must mean "on disk"
    if not async_save:
        pending.start(lambda: dcp.save(state, storage_writer=writer, process_group=group), background=False)
        return pending.wait()
    # The background thread runs DCP's collectives on a group of its own: the main thread
    # keeps using `group` meanwhile, and two threads on one group would interleave and deadlock.
    background = checkpoint_group(timeout, purpose="async")
    # Staging is the part of an async save that blocks training. A FileSystemWriter would stage
    # itself: deep-copy every DTensor, then copy it again (bench_ckpt.py, 600 MB per rank on
    # CPU: 0.8-3.4 s). DCP's generic stager copies each tensor once (0.2-0.5 s). It is ours, so
    # we close it once the write is done.
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    upload = dcp.async_save(state, storage_writer=writer, process_group=background, async_stager=stager)
    # async_save returned: the state is copied to host memory; training may change parameters now.

    def write():
        try:
            return upload.result()
        finally:
            stager.close()

    pending.start(write, background=True)
    _in_flight.append(pending)
    return pending


_in_flight = []


def wait_pending():
    """Commit the save in flight, if any (on every rank). Call before exiting."""
    while _in_flight:
        _in_flight[0].wait()


class PendingSave:
    """A save being written. wait() blocks until it is committed, on every rank.

    The write and this rank's checksums run in a background thread; the commit
    (a collective, then rank 0's rename) runs in the caller's thread, in wait().
    """

    def __init__(self, tmp, final, manifest, group, keep):
        self.tmp, self.final, self.manifest, self.group, self.keep = tmp, final, manifest, group, keep
        self.path = None
        self.t0 = time.monotonic()

    def start(self, write, background):
        def job():
            write()
            return _describe_own(self.tmp)  # hashing a large shard takes a while: off the training thread too

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
                files, err = self.job.result(), None
            except _DCP_FAILURES as e:  # told to every rank below, so none commits or hangs
                files, err = None, f"{type(e).__name__}: {e}"
            finally:
                if self in _in_flight:
                    _in_flight.remove(self)
            try:
                _check_all(err, self.group, f"save of {self.final} (write)")
            except CheckpointError as e:
                raise CheckpointError(f"{e}. Nothing was committed; the previous checkpoint is intact") from None
            _commit(self.tmp, self.final, self.manifest, files, self.group, self.keep)
            self.path = self.final
            if dist.get_rank() == 0:
                log.info("checkpoint %s committed (%.2f s)", self.final, time.monotonic() - self.t0)
        return self.path


def _describe_own(tmp):
    """Size and sha256 of the files this rank wrote (DCP names rank r's files __r_*)."""
    rank = dist.get_rank()
    mine = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")]
    return {n: dict(_describe(os.path.join(tmp, n)), rank=rank) for n in mine}


def _prepare(root, tmp, final):
    os.makedirs(root, exist_ok=True)
    _check_root(root)
    if os.path.exists(final):
        raise CheckpointError(f"{final} already exists: refusing to overwrite a committed checkpoint")
    for name in os.listdir(root):
        if name.startswith(TMP_PREFIX):
            log.warning("removing %s, left by an interrupted save", os.path.join(root, name))
            shutil.rmtree(os.path.join(root, name))
    # DCP assumes an empty directory: old .metadata beside new shards would be trusted.
    os.makedirs(tmp)
    fsync_dir(root)


def _commit(tmp, final, manifest, described, group, keep):
    # 4. Every rank hashed its own files; rank 0 collects them for the manifest.
    rank = dist.get_rank()
    files = {}
    for part in _all_gather(described, group, "save: gather checksums"):
        files.update(part)

    # 5. Commit: until this rename the previous checkpoint stays the newest.
    err = None
    if rank == 0:
        _, err = _capture(_commit_rank0, tmp, final, dict(manifest, files=files))
    # No rank returns before the rename is done: returning means "committed".
    _check_all(err, group, f"save: commit {final}")

    # 6. Retain: after the commit, so a crash here never leaves fewer good checkpoints.
    if rank == 0 and keep:
        _retain(os.path.dirname(final), keep)


def _commit_rank0(tmp, final, manifest):
    on_disk = sorted(n for n in os.listdir(tmp))
    if ".metadata" not in on_disk or sorted(manifest["files"]) != on_disk:
        raise CheckpointError(f"{tmp} holds {on_disk} but ranks reported {sorted(manifest['files'])}")
    _write_manifest(tmp, manifest)
    fsync_dir(tmp)
    os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
    fsync_dir(os.path.dirname(final))  # without this a power cut can undo the rename


def _retain(root, keep):
    steps = committed_steps(root)
    for s in steps[: max(len(steps) - max(keep, 1), 0)]:  # never the newest
        doomed = step_dir(root, s)
        trash = os.path.join(root, f"{TMP_PREFIX}delete-step-{s:08d}")
        try:
            # Rename first: a crash mid-delete leaves a .tmp- directory, never a half checkpoint.
            os.rename(doomed, trash)
            shutil.rmtree(trash)
            log.info("retention: removed %s (keep=%d)", doomed, keep)
        except OSError as e:
            log.warning("retention: could not remove %s: %s", doomed, e)


# ---------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------


def find_checkpoint(path):
    """The checkpoint directory load() would use: path itself if it is one, else the newest under path."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or STEP_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    _check_root(path)
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.startswith(TMP_PREFIX):
                log.warning("ignoring %s: an uncommitted (interrupted or in-progress) save", os.path.join(path, name))
    # The rename into step-NNNNNNNN is the commit, so the newest such directory is chosen even if its
    # manifest is gone: load() then refuses it by name, where skipping it would silently go back a step.
    named = sorted(int(m.group(1)) for m in map(STEP_RE.match, os.listdir(path)) if m) if os.path.isdir(path) else []
    return step_dir(path, named[-1]) if named else None


def _older(ckpt_dir):
    root = os.path.dirname(os.path.abspath(ckpt_dir))
    step = int(STEP_RE.match(os.path.basename(os.path.abspath(ckpt_dir))).group(1)) if STEP_RE.match(
        os.path.basename(os.path.abspath(ckpt_dir))) else None
    older = [s for s in committed_steps(root) if step is None or s < step]
    return step_dir(root, older[-1]) if older else None


def verify_files(ckpt_dir, manifest, rank=0, world=1):
    """Compare sizes and checksums of this rank's share of the files; returns errors."""
    errors = []
    names = sorted(manifest["files"])
    for i, name in enumerate(names):
        if i % world != rank:
            continue
        path, want = os.path.join(ckpt_dir, name), manifest["files"][name]
        if not os.path.isfile(path):
            errors.append(f"{path} is missing")
        elif os.path.getsize(path) != want["bytes"]:
            errors.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']}")
        elif _sha256(path) != want["sha256"]:
            errors.append(f"{path} does not match its checksum (corrupted)")
    return errors


def _check_keys(metadata, state, path):
    """Name every missing, unexpected or reshaped key before DCP reads anything."""
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in state if k not in saved)
    unexpected = sorted(k for k in saved if k.startswith("model.") and k not in state)
    reshaped = [
        f"{k}: checkpoint {tuple(saved[k].size)} vs model {tuple(v.shape)}"
        for k, v in state.items()
        if k in saved and isinstance(v, torch.Tensor) and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)
    ]
    problems = []
    for label, keys in (("missing from the checkpoint", missing), ("not in the model", unexpected), ("of another shape", reshaped)):
        if keys:
            more = f" (+{len(keys) - 10} more)" if len(keys) > 10 else ""
            problems.append(f"{len(keys)} key(s) {label}: {keys[:10]}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model/optimizer: " + "; ".join(problems))


def load(path, model, optimizer, extra=None, *, rng=True, verify=True, timeout=DEFAULT_TIMEOUT):
    """Restore the newest committed checkpoint under path (or the checkpoint at path).

    Call on every rank. Returns the restored step, or None when there is nothing to resume.
    """
    group = checkpoint_group(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)

    # 1-2. Agree on the path; rank 0 chooses the checkpoint so all ranks load the same one.
    seen = _all_gather(path, group, "load: agree on path")
    if len(set(seen)) > 1:
        raise CheckpointError("load() was given different paths on different ranks: "
                              + ", ".join(f"rank {r}: {p}" for r, p in enumerate(seen)))
    chosen, err = _capture(find_checkpoint, path) if rank == 0 else (None, None)
    _check_all(err, group, f"load: find a checkpoint in {path}")
    ckpt_dir = _from_rank0(chosen, group, "load: share choice")
    if ckpt_dir is None:
        return None

    # 3. Verify files, each rank a share of them.
    manifest, err = _capture(read_manifest, ckpt_dir)
    if not err and verify:
        errors = verify_files(ckpt_dir, manifest, rank, world)
        err = "; ".join(errors) if errors else None
    try:
        _check_all(err, group, f"load: verify {ckpt_dir}")
    except CheckpointError as e:
        older = _older(ckpt_dir)
        hint = f" The newest older committed checkpoint is {older}; pass it explicitly to load it." if older else ""
        raise CheckpointError(f"refusing to load a damaged checkpoint: {e}.{hint}") from e

    # 4. Verify keys against DCP's metadata (read without executing anything from the file).
    same_world = manifest["world_size"] == world
    nested = _state(model, optimizer, extra, rng and same_world and manifest["rng"])
    state = _flatten(nested)
    metadata = read_metadata(ckpt_dir)
    _check_keys(metadata, state, ckpt_dir)

    # 5. Read into the live shards, then map by name onto parameters and optimizer.
    try:
        dcp.load(state, storage_reader=SafeReader(ckpt_dir, metadata), planner=SafeLoadPlanner(),
                 process_group=group)
    except _DCP_FAILURES as e:  # DCP raises every rank's failure on every rank
        raise CheckpointError(f"reading {ckpt_dir} failed: {e}") from e
    _unflatten_into(nested, state)
    set_state_dict(model, optimizer, model_state_dict=nested["model"], optim_state_dict=nested["optim"], options=SD_OPTIONS)
    for name, obj in (extra or {}).items():
        obj.load_state_dict(nested["extra"][name])
    if rng and "rng" in nested:
        _set_rng_state(nested["rng"][str(rank)])
    elif rng and manifest["rng"]:
        # RNG streams belong to ranks; with another world size there is no right mapping.
        seed = int(hashlib.sha256(f"{manifest['rng_seed']}-{manifest['step']}-{rank}".encode()).hexdigest()[:15], 16)
        torch.manual_seed(seed)
        random.seed(seed)
        if rank == 0:
            log.warning("world size changed %d -> %d: RNG reseeded from (seed, step, rank), not restored",
                        manifest["world_size"], world)

    # 6. Verify what was restored.
    got = fingerprint(model, group)
    bad = sorted(k for k in set(got) | set(manifest["fingerprint"]) if got.get(k) != manifest["fingerprint"].get(k))
    if bad:
        raise CheckpointError(f"after loading {ckpt_dir}, parameters differ from what was saved: {bad[:10]}")
    want = manifest["optimizer"]
    for name, p in model.named_parameters():
        st = optimizer.state.get(p, {})
        if p.requires_grad and want["state_keys"] and (
            not set(want["state_keys"]) <= set(st) or (want["step"] is not None and float(st["step"]) != want["step"])
        ):
            raise CheckpointError(
                f"after loading {ckpt_dir}, optimizer state of {name} is {sorted(st)} at step "
                f"{float(st['step']) if 'step' in st else None}; saved: {want['state_keys']} at step {want['step']}"
            )
    if rank == 0:
        log.info("loaded %s (step %d, saved at world size %d)", ckpt_dir, manifest["step"], manifest["world_size"])
    return manifest["step"]
