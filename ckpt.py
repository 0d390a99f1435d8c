"""Correct sharded checkpointing for FSDP2 training, on Distributed Checkpoint (DCP) and public torch APIs.

    extra = {"scheduler": scheduler, "data": position}   # anything with state_dict() and load_state_dict()
    step = ckpt.load("checkpoints", model, optimizer, extra) or 0   # resume: the newest commit, None if none
    ckpt.check_root("checkpoints")                       # claims the root for this run: a wrong path fails now
    ckpt.save("checkpoints", step, model, optimizer, extra, keep=3)
    ckpt.close()                                         # before dist.destroy_process_group()

save(), load(), check_root() and close() are collective: call them on every rank with the same arguments. Each
rank writes and reads its own shards. A failure on any rank is raised on every rank as CheckpointError. Without a
process group (a plain Python process) they work as a world of one.

Save (the code carries the same numbers):
  1. Collect the model's state (get_model_state_dict), each optimizer's state_dict() keyed by parameter name, and
     each extra's state_dict(): their tensors laid out like a parameter under keys of their own, the rest as one
     value. Nothing runs an optimizer step. Refuse what load() could not restore.
  2. Agree: no rank failed, all got the same arguments and hold the same values where DCP stores one copy (all
     but DTensors), else refuse naming them. An extra whose state differs between ranks is stored per rank.
  3. Prepare: rank 0 claims the root (a lock held while the run lives; refused if another run holds it, or if
     the root holds checkpoints this run did not load) and makes .tmp-step-N-<id>; every rank must see it.
  4. Write: dcp.save() writes and fsyncs each rank's files; each rank CRCs its share of them. With async_save,
     the state was copied to host memory after step 2, and steps 4-6 run in a background thread.
  5. Commit: rank 0 writes manifest.json (each file's size and CRC), moves aside the steps after the one this run
     continues from, and renames the directory to step-N (an older copy of step N is replaced).
  6. Retain: rank 0 removes all but the newest `keep` steps.
Load:
  1-2. Agree on the arguments; rank 0 chooses the highest step-N under the root (or the directory given).
  3-4. Verify: each rank checks the size and CRC of its share of the files, before anything is read. Match DCP's
     .metadata, unpickled without running code, to the model, the optimizers and the extras.
  5. Read: dcp.load() into the live shards, resharding if the layout changed; each optimizer gets each
     parameter's state by name (Optimizer.load_state_dict); each extra's load_state_dict() gets what it saved.
  6. Verify each parameter's optimizer state: its keys and the step it was saved with.

    root/
      .owner.json                      locked by the run that writes here; says who it is: host, pid, job
      step-00000100/                   a commit: appears by one rename, once every rank's files are on disk
        manifest.json                  ours: step, world size, each file's size and CRC-32, what each object holds
        .metadata  __0_0.distcp ...    DCP's: where each key is stored; each rank's shards, the values stored once
      .tmp-step-00000200-1a2b3c4d/     a save in progress, or interrupted: never loaded
      .abandoned-step-00000150-9f8e/   a step given up by a rollback: kept, loaded only if named
Keys: model.<fqn>; optim.<i>, optimizer i's state_dict() by parameter name, its tensors optim.<i>.state.<fqn>.<name>;
extra.<name>, an extra's state (rank.<r>.extra.<name> where it differs between ranks), its tensors laid out like a
parameter extra.<name>.<path>. The random generators are the extras rng.torch, rng.cuda and rng.python.
"""

import collections
import concurrent.futures
import datetime
import fcntl
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import uuid
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

log = logging.getLogger("ckpt")
FORMAT = 4  # of manifest.json and of the keys
DEFAULT_TIMEOUT = datetime.timedelta(hours=1)  # of checkpoint collectives; training keeps its own, shorter one
MANIFEST, OWNER, TMP, ABANDONED = "manifest.json", ".owner.json", ".tmp-", ".abandoned-"
STEP_RE = re.compile(r"^step-(\d{8,})$")
FAILURES = (Exception, dcp.CheckpointException)  # DCP raises any rank's failure as a BaseException
# What torch.load(weights_only=True) restores, inside dicts, lists and tuples: no code from a checkpoint runs.
PLAIN = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, bytes, torch.dtype, torch.device,
         torch.Size)

class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank."""

Outcome = collections.namedtuple("Outcome", "value error")  # a local step's result, or its error message
Generator = collections.namedtuple("Generator", "state_dict load_state_dict")  # a random generator, as an extra
_groups = {}  # timeout -> the gloo group of checkpoint collectives
_locks = {}  # root -> the open .owner.json whose lock claims it for this run (rank 0)
_base = {}  # root -> the step this run continues from there (loaded or last committed)
_in_flight = []  # the async save being written, at most one
_half_loaded = weakref.WeakSet()  # models a load failed to finish writing into: save() refuses them until a load does
_stagers = []  # the async saves' host buffers, kept until close()

def save(root, step, model, optimizer=None, extra=None, *, keep=None, meta=None, rng=True, async_save=False,
         timeout=DEFAULT_TIMEOUT):
    """Write a checkpoint of `step` under root; return its path once committed (async_save: a PendingSave).

    optimizer: one, a list, or None (the model alone). extra: {name: object with state_dict() and load_state_dict()}.
    keep: how many steps to keep (None: all). meta: JSON for the manifest. A step this run committed or loaded is
    replaced by the state given now; an older one is refused."""
    wait_pending()  # one save in flight at a time: two would race for the root
    group, world = checkpoint_group(timeout), _world_size()
    root, optimizers = os.path.realpath(root), _as_list(optimizer)
    # 1. Collect (user code runs here: the extras' state_dict()).
    state, collect_error = _attempt(_collect, step, keep, model, optimizers, extra, rng, meta)
    # 2. Agree. DCP stores one copy of each value that is not a DTensor: every rank must hold the same one, but an
    # extra whose state differs between ranks is stored per rank. Every rank decides from the same reports.
    args = {"root": root, "step": step, "keep": keep, "rng": rng, "async_save": async_save, "meta": meta,
            "optimizers": [type(o).__name__ for o in optimizers], "extra": sorted(extra or {})}
    stored_once = {k: v for k, v in state.flat.items() if not isinstance(v, DTensor)} if state and world > 1 else {}
    extras_digest = {name: _digest({name: skeleton}) for name, skeleton in state.extras.items()} if state else {}
    reports = _check_all(collect_error, group, "save()", args, info=(_fingerprints(stored_once), extras_digest))
    once = [prints for prints, _ in reports]  # each rank's {key or path of a value stored once: its digest}
    differ = sorted(key for key in set().union(*once) if len({prints.get(key) for prints in once}) > 1)
    if differ:
        raise CheckpointError(f"save(): values DCP stores one copy of differ between ranks ({len(differ)}: "
                              f"{', '.join(differ[:10])}): make them equal on every rank (broadcast a buffer)")
    per_rank = {name for name, mine in extras_digest.items() if any(theirs.get(name) != mine for _, theirs in reports)}
    if world == 1:  # one rank cannot tell a generator seeded per rank from one seeded alike: kept per rank
        per_rank |= {name for name in state.extras if name.startswith("rng.")}
    base = _base.get(root)
    if base is not None and step < base:
        raise CheckpointError(f"save(): step {step} is before step {base}, which this run loaded or committed in "
                              f"{root}: to go back, load that step first (a rollback)")
    for name, skeleton in state.extras.items():
        state.flat[f"rank.{_rank()}.extra.{name}" if name in per_rank else f"extra.{name}"] = skeleton
    if async_save:  # copied to host memory first: a rank that cannot (out of memory) fails every rank, nothing made
        if not _stagers:  # kept until close(): from the second async save on, it copies into memory already there
            options = StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                     use_async_staging=False, use_non_blocking_copy=False)  # a plain, finished copy
            _stagers.append(DefaultStager(options))
        staged = _attempt(_stagers[0].stage, state.flat)
        _check_all(staged.error, group, "save: copy the state to host memory")
    # 3. Prepare: rank 0 alone touches the root, so ranks never race on it.
    tmp = _rank0(group, f"save: prepare step {step} in {root}", _prepare, root, step)
    _check_shared(group, tmp)
    objects = {key: {"per_rank": key.removeprefix("extra.") in per_rank, "like": like}
               for key, like in state.like.items()}
    manifest = {"format": FORMAT, "step": step, "world_size": world, "torch_version": torch.__version__,
                "meta": meta or {}, "objects": objects, "optimizers": args["optimizers"],
                "optimizer_state": state.optimizer_state}
    commit = Commit(root, step, tmp, manifest, group, keep, base)

    # 4. Write, 5. commit, 6. retain: here, or in a thread on the copy, while training changes the parameters.
    if not async_save:
        return _write_and_commit(state.flat, commit)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
    pending = PendingSave(pool.submit(_write_and_commit, staged.value, commit))
    pool.shutdown(wait=False)  # not "with": leaving it would wait for the write
    _in_flight.append(pending)
    return pending

def load(path, model, optimizer=None, extra=None, *, rng=True, verify=True, timeout=DEFAULT_TIMEOUT):
    """Restore the highest step under path, or the checkpoint at path; return its step (None if there is none).

    optimizer: as in save(), or None for the weights (and the extras given) alone. verify=False skips the CRCs.
    Loading claims nothing (an evaluation job reads a root training writes); an older step is a rollback."""
    wait_pending()  # a background save uses the same group
    group, path, optimizers = checkpoint_group(timeout), os.path.realpath(path), _as_list(optimizer)
    # 1. Agree on the arguments (a rank in save() and another in load() meet here, not in a hang), and 2. rank 0
    # alone chooses, in the same round, so that every rank loads the same checkpoint (choosing only reads).
    args = {"path": path, "optimizers": [type(o).__name__ for o in optimizers], "extra": sorted(extra or {}),
            "rng": rng, "verify": verify}
    ckpt_dir, manifest = _rank0(group, "load()", _choose, path, arguments=args)
    if ckpt_dir is None:
        return None
    # 3. Verify, each rank its share of the files, before anything is read; 4. match the checkpoint to the model,
    # the optimizers and the extras. One round reports either.
    plan = _attempt(_plan, ckpt_dir, manifest, verify, model, optimizers, extra, rng)
    _check_all(plan.error, group, f"load: verify {ckpt_dir} and match it to the model")
    # 5. Read into the live shards and the objects' empty tensors, then hand everything over.
    _half_loaded.add(model)  # until every rank restored it all: a failure leaves it part-loaded
    try:
        reader = SafeReader(ckpt_dir, plan.value.metadata)
        dcp.load(plan.value.request, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group)
    except FAILURES as e:  # DCP raises every rank's failure on every rank
        cause = f": {_describe(e)}" if os.path.isdir(ckpt_dir) else ""  # a vanished step: _instead() says so
        raise CheckpointError(f"reading {ckpt_dir} failed{cause}.{_instead(ckpt_dir)}") from e
    restored = _attempt(_restore, plan.value, model, optimizers, manifest["optimizer_state"] if optimizers else {})
    _check_all(restored.error, group, f"load: restore {ckpt_dir}")
    _half_loaded.discard(model)
    # The next save continues from here. A step moved aside is no ancestor of the live ones: they all go aside.
    _base[os.path.dirname(ckpt_dir)] = manifest["step"] if STEP_RE.match(os.path.basename(ckpt_dir)) else -1
    log.info("loaded %s (step %d, saved at world size %d)", ckpt_dir, manifest["step"], manifest["world_size"])
    return manifest["step"]

def check_root(root, timeout=DEFAULT_TIMEOUT):
    """Claim root for this run, after load(): a wrong or node-local path, another live run there, or checkpoints
    there that this run did not load (a forgotten resume) fail now, on every rank, not at the first save."""
    wait_pending()
    group, root = checkpoint_group(timeout), os.path.realpath(root)
    _rank0(group, "check_root()", _claim, root, arguments={"root": root})  # rank 0's own root, whatever others got
    _check_shared(group, os.path.join(root, OWNER))

def close():
    """End ckpt's part of the run, on every rank, before dist.destroy_process_group(): wait for a save in flight,
    release the root, free the async host buffers, and destroy ckpt's process groups (not to outlive the default)."""
    try:
        wait_pending()
    finally:
        for owner in _locks.values():  # first: the root is released whatever fails below
            os.ftruncate(owner, 0)  # a run that ended: the next one has nobody to take over from
            os.close(owner)  # releases the lock
        for stager in _stagers:
            stager.close()
        for registry in (_stagers, _locks, _base, _half_loaded):  # the next run in this process starts afresh
            registry.clear()
        while _groups:  # last: it raises if the default group is gone already
            dist.destroy_process_group(_groups.popitem()[1])

class PendingSave:
    """An async save, written and committed by a background thread on every rank. done(): it is over on this rank
    (committed, or failed); wait(): its path once committed, or its error. The next save, load or close waits."""
    def __init__(self, job):
        self.job = job  # a Future of _write_and_commit()

    def done(self):
        return self.job.done()

    def wait(self):
        try:
            return self.job.result()
        finally:  # a Ctrl-C while it runs leaves it in flight: the next call waits for it
            if self.job.done() and self in _in_flight:
                _in_flight.remove(self)

def wait_pending():  # the save in flight, if any, must be over before the group is used again
    while _in_flight:
        _in_flight[0].wait()

# ---- save, step by step ----

# flat: {DCP key: value}; extras: {extra's name: its skeleton: its state but the tensors laid out like a parameter};
# like: {object's key: {key of such a tensor: that parameter}}; optimizer_state: see _optimizer_summary().
Collected = collections.namedtuple("Collected", "flat extras like optimizer_state")

def _collect(step, keep, model, optimizers, extra, rng, meta):  # step 1
    if not isinstance(step, int) or step < 0 or not (keep is None or isinstance(keep, int) and keep > 0):
        raise CheckpointError(f"save(): step must be an int >= 0 and keep None or an int > 0, not {step!r}, {keep!r}")
    json.dumps(meta)  # refused now if it is not JSON, not at the commit after every rank wrote
    if model in _half_loaded:  # its shards would mix ranks that read a checkpoint with ranks that did not
        raise CheckpointError("save(): the last load() into this model failed while reading, so the model and "
                              "optimizers may hold part of it: load() again before saving")
    model_sd = get_model_state_dict(model)
    names = _param_names(model, model_sd)
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    # A tensor in an object's state laid out like a parameter (optimizer moments, an EMA's shadows) is stored under
    # a key of its own and restored laid out like that parameter now: it reshards as the parameter does, and a
    # plain one saved by an unsharded model comes back sharded in an FSDP2 job.
    fqns_of_layout = collections.defaultdict(set)
    for param, fqns in names.items():
        fqns_of_layout[_layout(param)].update(fqns)
    skeletons, like = {}, {}
    for key, obj in _objects(optimizers, names, extra, rng).items():
        like[key] = {}
        def leaf(path, value):  # path: <key>.<path in its state>
            if not isinstance(value, torch.Tensor):
                return _restorable(path, value)
            alike = fqns_of_layout.get(_layout(value), set())
            parts = path.split(".")  # the parameter whose name the path holds (exp_avg of <fqn>, shadow.<fqn>)
            named = [".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
            named = [name for name in named if name in alike]
            if not named and not isinstance(value, DTensor):
                return _restorable(path, value)  # a plain tensor of no parameter's: stored in the skeleton
            if not alike:
                raise CheckpointError(f"{path} is a DTensor laid out like no parameter ({value.placements}, shape "
                                      f"{tuple(value.shape)}): load() could not place it; store its full_tensor()")
            flat[path] = value  # under a key of its own, so that DCP saves each rank's shard
            like[key][path] = max(named, key=len) if named else min(alike)
            return None  # its place in the skeleton
        skeletons[key] = _walk(obj.state_dict(), leaf, key)
    flat.update({key: skeleton for key, skeleton in skeletons.items() if key.startswith("optim.")})
    extras = {key.removeprefix("extra."): s for key, s in skeletons.items() if key.startswith("extra.")}
    return Collected(flat, extras, like, _optimizer_summary(optimizers, names))

def _layout(t):  # what a tensor laid out like a parameter shares with it
    return (t.device_mesh, t.placements, t.shape) if isinstance(t, DTensor) else t.shape

def _walk(value, leaf, path=""):
    """value, with leaf(path, x) for each leaf x of its dicts, lists and tuples; refuses keys load() cannot restore."""
    if isinstance(value, dict):
        for key in value:
            _restorable(f"{path}: the key {key!r}", key)
        return {k: _walk(v, leaf, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        items = [_walk(v, leaf, f"{path}.{i}") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return leaf(path, value)

def _restorable(path, value):
    # The exact types: a subclass (numpy's float64, an IntEnum, a tensor subclass) would pickle, then be refused.
    if type(value) not in PLAIN:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise CheckpointError(f"{path} is a {kind}, which load() cannot restore without running code from the "
                              "checkpoint: convert it in state_dict(), and back in load_state_dict()")
    return value

def _objects(optimizers, names, extra, rng):  # {key: what holds state there}: optimizers, extras, generators
    for name, obj in (extra or {}).items():
        if not isinstance(name, str) or not name or "." in name or name == "rng":
            raise CheckpointError(f"extra {name!r}: a name is part of the keys: a str without '.', and not 'rng'")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):  # restored in place
            raise CheckpointError(f"extra {name!r} is a {type(obj).__name__}, which has no state_dict() and "
                                  "load_state_dict(): wrap it in an object that has both")
    generators = {"rng.torch": Generator(torch.get_rng_state, torch.set_rng_state),
                  "rng.python": Generator(random.getstate, random.setstate)}
    if torch.cuda.is_available():
        generators["rng.cuda"] = Generator(torch.cuda.get_rng_state, torch.cuda.set_rng_state)
    extras = {**(extra or {}), **(generators if rng else {})}
    optimizers_by_name = {f"optim.{i}": OptimizerByName(opt, names) for i, opt in enumerate(optimizers)}
    return optimizers_by_name | {f"extra.{name}": obj for name, obj in extras.items()}

class OptimizerByName:
    """An optimizer's state_dict() and load_state_dict() keyed by parameter name, not by position. Optimizer's own
    state_dict() runs no step: a save before the first leaves it as it was (get_optimizer_state_dict would step it)."""
    def __init__(self, optimizer, names):  # names: {parameter: its names in the model's state dict}
        self.optimizer = optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(p not in names for p in params):
            raise CheckpointError(f"{type(optimizer).__name__} holds parameters that are not the model's")
        self.fqns = [names[p][0] for p in params]  # by index in state_dict()

    def state_dict(self):
        sd = self.optimizer.state_dict()
        groups = [dict(group, params=[self.fqns[i] for i in group["params"]]) for group in sd["param_groups"]]
        return {"state": {self.fqns[i]: state for i, state in sd["state"].items()}, "param_groups": groups}

    def load_state_dict(self, sd):
        groups = self.state_dict()["param_groups"]
        saved_params = [group["params"] for group in sd["param_groups"]]
        params = [group["params"] for group in groups]
        if saved_params != params:  # built otherwise: the checkpoint's groups would go to other parameters
            firsts = {"now": [p[:1] for p in params], "saved": [p[:1] for p in saved_params]}
            raise CheckpointError(f"{type(self.optimizer).__name__}'s param groups hold other parameters than the "
                                  f"checkpoint's (the first of each: {firsts}): build it as it was when saved")
        lacking = sorted({option for group in sd["param_groups"] for option in group} - set(groups[0]))
        if lacking:
            raise CheckpointError(f"{type(self.optimizer).__name__} has no option {lacking} of the checkpoint's"
                                  + (" (an LR scheduler adds 'initial_lr' to param_groups: create schedulers before "
                                     "load(), as at save())" if "initial_lr" in lacking else ""))
        self.optimizer.load_state_dict(sd)  # it maps the saved ids (names) onto its parameters in order: equal above

def _fingerprints(values):
    """{key or path of each leaf of values (a dict): its digest}; a tensor's of its bytes (its pickle varies)."""
    found = {}
    def leaf(path, x):
        if isinstance(x, torch.Tensor):
            x = (x.dtype, x.shape, x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        found[path] = hashlib.sha256(pickle.dumps(x)).hexdigest()[:16]
    for key, value in values.items():
        _walk(value, leaf, key)
    return found

def _digest(values):  # one digest of all the fingerprints: little to gather where no leaf need be named
    return hashlib.sha256(repr(sorted(_fingerprints(values).items())).encode()).hexdigest()[:16]

def _prepare(root, step):  # step 3, rank 0
    _claim(root)
    # DCP assumes an empty directory: an old .metadata beside new shards would be trusted. A unique name also
    # means that a leftover we could not remove never blocks a later save.
    tmp = _unique(root, TMP, step)
    os.makedirs(tmp)  # not fsynced: lost in a crash, it held nothing committed; the commit's fsyncs cover it
    return tmp

def _check_shared(group, path):
    # A rank that cannot see what rank 0 made has a node-local root: a save would scatter its shards over disks.
    unseen = None if os.path.exists(path) else f"cannot see {path}: the root must be on storage shared by every rank"
    _check_all(unseen, group, "shared storage check")

Commit = collections.namedtuple("Commit", "root step tmp manifest group keep base")

def _write_and_commit(state, c):  # steps 4-6 on every rank; in a background thread for an async save
    written = _attempt(_write, state, c.tmp, c.group)
    try:
        checksums = _check_all(written.error, c.group, f"save of step {c.step}: writing", info=written.value)
    except CheckpointError as e:
        if _rank() == 0:
            shutil.rmtree(c.tmp, ignore_errors=True)  # frees the space (a full disk, say)
        raise CheckpointError(f"{e}. Nothing was committed; the previous checkpoint is intact") from e
    path = _rank0(c.group, f"save of step {c.step}: commit", _commit, c, checksums)
    _base[c.root] = c.step
    log.info("checkpoint %s committed", path)
    return path

def _write(state, tmp, group):
    """Step 4: DCP writes every rank's files; then this rank CRCs its share from the page cache (not DCP's stream)."""
    writer = dcp.FileSystemWriter(tmp, sync_files=True)  # fsync: "committed" must mean "on disk"
    # Our keys are flat already, and an object's skeleton is one value: DCP must not rebuild it (flattening would
    # turn its keys into str and drop its empty dicts). load() asks for these keys.
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    paths = {name: os.path.join(tmp, name) for name in _share(os.listdir(tmp))}
    return {name: {"bytes": os.path.getsize(path), "crc32": _crc32(path)} for name, path in paths.items()}

def _commit(c, checksums):  # steps 5-6, rank 0; checksums: each rank's {file: its size and CRC}
    files = dict(collections.ChainMap(*checksums))  # each rank's share, merged
    if sorted(files) != sorted(os.listdir(c.tmp)):
        raise CheckpointError(f"{c.tmp} holds {sorted(os.listdir(c.tmp))}; the ranks checksummed {sorted(files)}")
    with open(os.path.join(c.tmp, MANIFEST), "w") as f:
        json.dump(dict(c.manifest, files=files), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename points at it
    fsync_dir(c.tmp)  # and the directory's entries
    _move_aside(c.root, c.base)
    replaced = _unique(c.root, ABANDONED, c.step) if os.path.isdir(step_dir(c.root, c.step)) else None
    if replaced:  # this step saved again: its older copy goes aside, right before the new one takes its name
        os.rename(step_dir(c.root, c.step), replaced)
    os.rename(c.tmp, step_dir(c.root, c.step))  # atomic: the checkpoint appears whole or not at all
    fsync_dir(c.root)  # without this, a power cut can undo the renames
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)
    for step in _steps(c.root)[: -c.keep] if c.keep else []:  # 6. A failure is logged: the commit stands.
        trash = _unique(c.root, f"{TMP}delete-", step)
        try:  # out of load()'s sight first: a crash mid-delete leaves a .tmp- directory, never half a checkpoint
            os.rename(step_dir(c.root, step), trash)
            shutil.rmtree(trash)
        except OSError as e:
            log.warning("retention: could not remove %s: %s", step_dir(c.root, step), e)
    return step_dir(c.root, c.step)

def _move_aside(root, base):
    """Steps after the one this run continues from belong to a branch given up (a rollback): moved aside, highest
    first, they keep their data, and the steps under a root stay one history, the highest the newest commit."""
    given_up = [s for s in reversed(_steps(root)) if base is not None and s > base]
    for step in given_up:
        aside = _unique(root, ABANDONED, step)
        os.rename(step_dir(root, step), aside)
        log.warning("moved aside %s: not on the branch this run continues from (delete it when not needed)", aside)
    if given_up:
        fsync_dir(root)  # or a power cut brings a given-up step back as the newest

def _unique(root, prefix, step):
    return os.path.join(root, f"{prefix}step-{step:08d}-{uuid.uuid4().hex[:8]}")

# ---- load, step by step ----

def _choose(path):  # step 2, rank 0
    found = find_checkpoint(path)
    if found is None:  # a fresh root, or one whose only save was interrupted: say which
        interrupted = [n for n in (os.listdir(path) if os.path.isdir(path) else []) if n.startswith(TMP)]
        if interrupted:
            log.warning("no checkpoint in %s: %s is an interrupted save (never loaded)", path, ", ".join(interrupted))
        return None, None
    try:
        return found, read_manifest(found)
    except CheckpointError as e:
        raise CheckpointError(f"refusing to load a damaged checkpoint: {e}.{_instead(found)}") from None

def _instead(ckpt_dir):  # what to load instead of a checkpoint that is damaged or gone
    root = os.path.dirname(ckpt_dir)
    others = [step_dir(root, step) for step in _steps(root) if step_dir(root, step) != ckpt_dir]
    gone = "" if os.path.isdir(ckpt_dir) else f" {ckpt_dir} does not exist (removed by another run's retention?)."
    return gone + (f" The newest other commit is {others[-1]}: pass it to load it." if others else "")

# request: what dcp.load() reads into; objects: {key: (object, the key its skeleton is read under)}.
Plan = collections.namedtuple("Plan", "metadata request names objects")

def _plan(ckpt_dir, manifest, verify, model, optimizers, extra, rng):  # steps 3-4
    damage = verify_files(ckpt_dir, manifest, _share(manifest["files"]), verify)
    try:
        metadata = read_metadata(ckpt_dir)  # every rank reads it; rank 0, whose share it is, verified it
    except CheckpointError as e:
        damage.append(str(e))
    if damage:
        raise CheckpointError(f"refusing to load a damaged checkpoint: {'; '.join(damage)}.{_instead(ckpt_dir)}")
    saved = metadata.state_dict_metadata
    types = [type(o).__name__ for o in optimizers]
    if optimizers and manifest["optimizers"] != types:
        raise CheckpointError(f"{ckpt_dir} was saved with optimizers {manifest['optimizers']}, not {types}: pass "
                              "the same ones, in the same order (to load the weights alone, pass optimizer=None)")
    model_sd = get_model_state_dict(model)
    request = {f"model.{k}": v for k, v in model_sd.items()}
    _match(ckpt_dir, saved, request)
    names = _param_names(model, model_sd)
    wanted = _objects(optimizers, names, extra, rng)
    objects, resized = {}, manifest["world_size"] != _world_size()
    unrestored = [f"{key} (not passed to load())" for key in sorted(set(manifest["objects"]) - set(wanted))
                  if key.startswith("extra.") and (rng or not key.startswith("extra.rng."))]
    for key, obj in wanted.items():
        entry = manifest["objects"].get(key)
        if entry is None and key.startswith("extra.rng."):
            continue  # a generator saved with rng=False, or without CUDA
        if entry is None:
            raise CheckpointError(f"{key} is not in {ckpt_dir}, which holds {sorted(manifest['objects'])}")
        if entry["per_rank"] and resized and key.startswith("extra.rng."):  # N streams do not map onto M ranks
            unrestored.append(f"{key} (per rank at another world size: left as this process has it)")
            continue
        if entry["per_rank"] and resized:
            raise CheckpointError(f"{key} differed between ranks when saved at world size {manifest['world_size']}: "
                                  "resume at that size, or make its state_dict() the same on every rank")
        skeleton = f"rank.{_rank()}.{key}" if entry["per_rank"] else key
        request[skeleton] = _empty_like(saved[skeleton], None)
        live = {}  # an optimizer's present tensors: read into in place, as plain DCP does (no second copy)
        if isinstance(obj, OptimizerByName):
            _walk(obj.state_dict(), lambda path, value: live.setdefault(path, value), key)
        for tensor_key, fqn in entry["like"].items():
            request[tensor_key] = _empty_like(saved[tensor_key], model_sd.get(fqn), live.get(tensor_key))
        objects[key] = (obj, skeleton)
    if unrestored and optimizers and _rank() == 0:  # a resume that leaves state behind (not a weights-only load)
        log.warning("not restored from %s: %s", ckpt_dir, ", ".join(unrestored))
    return Plan(metadata, request, names, objects)

def _match(ckpt_dir, saved, live):
    """Refuse, naming the keys, a checkpoint whose model keys, shapes or dtypes are not the live ones."""
    live = {k: f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else "no tensor" for k, v in live.items()}
    kept = {k: f"{m.properties.dtype} {tuple(m.size)}" if hasattr(m, "size") else "no tensor"
            for k, m in saved.items() if k.startswith("model.")}
    found = {"missing from the checkpoint": [k for k in live if k not in kept],
             "not in the model": [k for k in kept if k not in live],
             "of another dtype or shape": [f"{k}: {kept[k]} saved, {live[k]} here"
                                           for k in live if k in kept and kept[k] != live[k]]}
    problems = [f"{len(keys)} key(s) {what}: {keys[:10]}" for what, keys in found.items() if keys]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model: {'; '.join(problems)}")

def _empty_like(saved, param, live=None):
    """What a value is read into: None if pickled; live if laid out like param already; else one laid out so."""
    if not hasattr(saved, "size"):
        return None
    if isinstance(live, torch.Tensor) and _layout(live) == _layout(param) and live.dtype == saved.properties.dtype:
        return live
    if isinstance(param, DTensor):
        return torch.distributed.tensor.empty(saved.size, dtype=saved.properties.dtype,
                                              device_mesh=param.device_mesh, placements=param.placements)
    return torch.empty(saved.size, dtype=saved.properties.dtype, device=param.device if param is not None else "cpu")

def _restore(plan, model, optimizers, saved_summary):  # steps 5-6, after dcp.load(); user code runs
    model_sd = {k.removeprefix("model."): v for k, v in plan.request.items() if k.startswith("model.")}
    set_model_state_dict(model, model_sd)
    for key, (obj, skeleton) in plan.objects.items():  # a leaf whose key a tensor was read under becomes it
        obj.load_state_dict(_walk(plan.request[skeleton], lambda path, value: plan.request.get(path, value), key))
    summary = _optimizer_summary(optimizers, plan.names)
    for fqn in sorted(set(summary) | set(saved_summary)):
        if summary.get(fqn) != saved_summary.get(fqn):
            raise CheckpointError(f"optimizer state of {fqn} after loading: {summary.get(fqn)} ([keys, step]); "
                                  f"saved: {saved_summary.get(fqn)}")

def _optimizer_summary(optimizers, names):
    """{parameter name: [its optimizer state's keys, its step]}: saved in the manifest, checked after a load."""
    summary = {}
    for opt in optimizers:
        for param, state in opt.state.items():
            summary[names[param][0]] = [sorted(state), float(state["step"]) if "step" in state else None]
    return summary

def _param_names(model, model_sd):
    """{parameter: its names in the state dict}: torch.compile (_orig_mod) and activation checkpointing
    (_checkpoint_wrapped_module) put underscore-named modules into parameter names; the state dict has none."""
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        unwrapped = ".".join(part for part in name.split(".") if not part.startswith("_"))
        canonical = name if name in model_sd else unwrapped
        if canonical not in model_sd:
            raise CheckpointError(f"parameter {name} has no entry in the model's state dict ({list(model_sd)[:5]}...)")
        names.setdefault(param, []).append(canonical)
    return names

# ---- files: the steps, checksums, manifests ----

def step_dir(root, step):
    return os.path.join(root, f"step-{step:08d}")

def _steps(root):  # each step-N directory is a commit: it appeared by a rename
    matches = [STEP_RE.match(n) for n in (os.listdir(root) if os.path.isdir(root) else [])]
    return sorted(int(m.group(1)) for m in matches if m)

def committed_steps(root):
    return [s for s in _steps(root) if os.path.isfile(os.path.join(step_dir(root, s), MANIFEST))]

def find_checkpoint(path):
    """The checkpoint load() uses: path itself if it is a checkpoint directory, else the highest step under path.
    A step whose manifest is damaged is still chosen: load() refuses it by name instead of silently going back."""
    name = os.path.basename(os.path.normpath(path))
    if name.startswith(TMP):
        raise CheckpointError(f"{path} is an uncommitted save (interrupted, or in progress): it is never loaded")
    if STEP_RE.match(name) or name.startswith(ABANDONED) or os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    steps = _steps(path)
    return step_dir(path, steps[-1]) if steps else None

def _share(names):
    """The files this rank checks: the first number in their names modulo the world size (__r_0.distcp: rank r's)."""
    numbers = {name: int((re.findall(r"\d+", name) or [0])[0]) for name in names}
    return sorted(name for name, n in numbers.items() if n % _world_size() == _rank())

def _crc32(path):  # catches corruption and truncation, not forgery (the manifest is not signed)
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 18), b""):  # 256 KiB: adds little to the peak memory
            crc = zlib.crc32(block, crc)  # releases the GIL: training goes on in another thread
    return f"{crc:08x}"

def verify_files(ckpt_dir, manifest, names=None, checksums=True):
    """The errors in the size (and CRC) of the files the manifest lists, or of names."""
    errors = []
    for name in sorted(manifest["files"]) if names is None else names:
        path, want = os.path.join(ckpt_dir, name), manifest["files"][name]
        if not os.path.isfile(path):
            errors.append(f"{path} is missing")
        elif os.path.getsize(path) != want["bytes"]:
            errors.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']} (truncated?)")
        elif checksums and _crc32(path) != want["crc32"]:
            errors.append(f"{path} does not match its checksum (corrupted)")
    return errors

def read_manifest(ckpt_dir):
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): {ckpt_dir} is not a committed checkpoint") from e
    saved_format = manifest.get("format") if isinstance(manifest, dict) else None
    if saved_format != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{path} is not a manifest of format {FORMAT}, the one this ckpt.py reads (format: "
                              f"{saved_format}): load it with the ckpt.py that saved it")
    return manifest

def fsync_dir(path):  # a rename is durable only once the directory that holds it is flushed
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

# ---- untrusted input: DCP pickles .metadata and every value that is not a tensor ----

# pickle.load of a file from elsewhere runs any code it names: .metadata may name DCP's types alone (and dtypes).
_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device"}, "pathlib": {"PosixPath"}, "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}

class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype_or_layout = module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        if not dtype_or_layout and name not in _METADATA_TYPES.get(module, ()):
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a type of DCP's metadata")
        return super().find_class(module, name)

def read_metadata(ckpt_dir):  # DCP's .metadata, read without running code from it
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read safely: {e}") from e

class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the .metadata that read_metadata() unpickled without running code from it."""
    def __init__(self, path, metadata):
        super().__init__(path)
        self.safe_metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self.safe_metadata

class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner: values unpickled by torch.load(weights_only=True), into the caller's dict by key."""
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True, map_location="cpu")

# ---- coordination: a gloo group with a long timeout; every rank learns of any rank's failure ----

def checkpoint_group(timeout=DEFAULT_TIMEOUT):
    """The gloo group, with its own long timeout, of every checkpoint collective (None without a process group:
    a world of one). Training keeps a short timeout, to notice a hung rank; under it, the first save to slow
    storage would kill the job (or the NCCL watchdog would). gloo keeps coordination off the GPU."""
    if not dist.is_initialized():
        return None
    timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if timeout not in _groups:
        _groups[timeout] = _collective("make ckpt's process group", dist.new_group, backend="gloo", timeout=timeout)
    return _groups[timeout]

def _rank():
    return dist.get_rank() if dist.is_initialized() else 0

def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1

def _collective(what, fn, *args, **kwargs):  # a timeout or a lost peer becomes a CheckpointError naming the phase
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        _groups.clear()  # a gloo group that timed out is unusable: the next call makes a fresh one
        raise CheckpointError(f"checkpoint coordination failed at '{what}' on rank {_rank()}: not every rank reached "
                              f"it within the checkpoint timeout (called on every rank? crashed or hung?): {e}") from e

def _attempt(fn, *args):  # a local step's Outcome, for _check_all() to share
    try:
        return Outcome(fn(*args), None)
    except FAILURES as e:
        log.debug("on rank %d", _rank(), exc_info=True)
        return Outcome(None, _describe(e))

def _describe(e):  # in one line: DCP's exception holds every rank's failure, with its traceback
    if isinstance(e, dcp.CheckpointException):
        return "; ".join(f"on rank {r}: {type(error).__name__}: {error}" for r, (error, _) in e.failures.items())
    return f"{type(e).__name__}: {e}"

def _check_all(error, group, what, args=None, info=None):
    """Raise the same CheckpointError on every rank if a rank failed (error: its message) or got other args; else
    return every rank's info."""
    given = [f"{name}={value!r}" for name, value in (args or {}).items()]  # compared as the error shows them
    if args:
        given.append(f"(in {what})")  # names each rank's call where ranks called different ones (sorted first)
    reports = [(error, given, info)]
    if group is not None:
        reports = [None] * dist.get_world_size()
        _collective(what, dist.all_gather_object, reports, (error, given, info), group=group)
    failed = [f"rank {r}: {message}" for r, (message, _, _) in enumerate(reports) if message]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): " + "; ".join(failed))
    alike = set.intersection(*[set(other) for _, other, _ in reports])  # what every rank was given
    if any(len(other) > len(alike) for _, other, _ in reports):  # the same test on every rank: they all raise
        ranks = [f"rank {r}: " + " ".join(sorted(set(other) - alike)) for r, (_, other, _) in enumerate(reports)]
        raise CheckpointError(f"{what} was given different arguments on different ranks: " + "; ".join(ranks))
    return [rank_info for _, _, rank_info in reports]

def _rank0(group, what, fn, *args, arguments=None):
    """Rank 0 alone runs fn(*args) (it alone touches the root); every rank returns its result or raises its error."""
    outcome = _attempt(fn, *args) if _rank() == 0 else Outcome(None, None)
    return _check_all(outcome.error, group, what, arguments, info=outcome.value)[0]

def _as_list(optimizer):
    return [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]

# ---- the root: one live run writes to it ----

def _claim(root):
    """Rank 0: make this run the only writer of root, or raise naming the run that is (two runs on one root delete
    each other's saves in progress, each taking them for a crashed run's). The claim is a lock on .owner.json, which
    the kernel (or NFS's lock manager) releases once its process is gone: no run id, pid or age is guessed at."""
    if root in _locks:
        return
    os.makedirs(root, exist_ok=True)
    owner = os.open(os.path.join(root, OWNER), os.O_RDWR | os.O_CREAT, 0o644)
    try:  # relies on the file system's locks (NFS with locking, Lustre -o flock); one of two takers at once wins
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        previous = os.read(owner, 4096).decode(errors="replace")
        steps = _steps(root)
        if steps and root not in _base:  # a run that loaded nothing would start over, moving every step aside
            raise CheckpointError(f"{root} holds checkpoints up to {step_dir(root, steps[-1])}, and this run loaded "
                                  "none of them: load() the root before check_root() and save(), or use another root")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(owner, 0)
        os.pwrite(owner, json.dumps(me).encode(), 0)  # says who holds the lock, to the runs it refuses
    except BlockingIOError:
        holder = os.read(owner, 4096).decode(errors="replace") or "(it is starting)"
        os.close(owner)
        raise CheckpointError(f"{root} is in use by another run, which holds the lock on {OWNER}: {holder}. Stop it "
                              "or use another root (load() takes no claim: an evaluation job can read it).") from None
    except BaseException:  # ENOLCK on a file system without locks, say: the README lists those it relies on
        os.close(owner)  # releases the lock, if taken: this run does not hold the root
        raise
    if previous:
        log.warning("taking over %s from %s: nothing holds its lock, so that run is gone", root, previous)
    _locks[root] = owner
    for name in os.listdir(root):  # left by a run that is gone: no other run writes here
        if name.startswith(TMP):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log.warning("removed %s, left by an interrupted save", os.path.join(root, name))
