"""Correct sharded checkpointing for FSDP2 training, on Distributed Checkpoint (DCP) and public torch APIs.

    extra = {"scheduler": scheduler, "data": position}   # anything with state_dict() and load_state_dict()
    step = ckpt.load("checkpoints", model, optimizer, extra) or 0   # resume: the newest commit, None if none
    ckpt.check_root("checkpoints", model)                # claims the root for this run: a wrong path fails now
    ckpt.save("checkpoints", step, model, optimizer, extra, keep=3)
    ckpt.close()                                         # before dist.destroy_process_group()

save(), load(), check_root() and close() are collective: call them on every rank, naming the same checkpoint (root,
step, keep, meta, ...); the model, optimizers and extras are each rank's own (pipeline stages hold different ones).
A failure on any rank is raised on every rank as CheckpointError. Without a process group (a plain Python process)
they work as a world of one. Each rule is said by the caller or read from the objects' own structure, never
inferred from names, values or history:
  - Keys by construction. model.<fqn>; each optimizer's state by its parameters' names, optim.<i>.state.<fqn>.<name>
    (its tensors), and one value per param group, optim.<i>.group.<first fqn> (options, names, the rest of their
    state); an extra's state at extra.<name>, each of its tensors at extra.<name>.<path>; per rank rank.<r>.extra.*.
  - A key's value must agree among the ranks that hold it: DCP stores a DTensor's shards, any other value once. All
    are compared but DTensors, the model's parameters and their optimizer state (the gradient all-reduce keeps those
    equal: hashing them would read the whole model at every save).
  - Per rank, declared: an extra that is a DataLoader, a Sampler or PerRank(obj), and the random generators. At
    another world size such an extra is refused by name; generators stay as this process seeded them.
  - A resume is a load() with the optimizer; a load without it is an initialisation. A root that holds commits takes
    saves only from a resumed model, and never one that leaves a later step its newest commit: giving up later steps
    is said, check_root(root, model, rollback_to=step).

Save (the code carries the same numbers):
  1. Collect the model's state (get_model_state_dict), each optimizer's state_dict() by parameter name, and each
     extra's state_dict(); nothing runs an optimizer step. Refuse what load() could not restore.
  2. Agree: one all-reduce tells every rank that no rank failed and all name the same checkpoint.
  3. Prepare: rank 0 claims the root (a lock held while the run lives; refused if another run holds it, if the root
     holds commits and the model was not resumed, or a later step) and makes .tmp-step-N-<id>; every rank sees it.
  4. Write: dcp.save() writes and fsyncs each rank's files; each rank's plan carries a digest of each value compared,
     which its holders must agree on. Each rank CRCs its share of the files, in 64 MiB chunks, in parallel.
     async_save: the tensors are first copied to host memory beside the loop (a CUDA stream, else a thread) while
     the next forward and backward run, into buffers made once (prepare_async(): before the first save); each
     optimizer's next step() waits for the copy; steps 4-6 run in a thread.
  5. Commit: rank 0 writes manifest.json (the step, each file's size and CRCs, its own CRC) and renames the
     directory to step-N (an older copy of step N is replaced).
  6. Retain: rank 0 removes all but the newest `keep` steps.
Load:
  1-2. Agree on the arguments; rank 0 chooses the highest step-N under the root (or the directory given).
  3-4. Verify: the manifest's CRC and step; each rank the size and CRCs of its share of the files and .metadata
     before anything is read or unpickled; match .metadata, unpickled without running code, to this rank's model,
     optimizers and extras. Every model key of the checkpoint must be some rank's; a resume, the stage count.
  5. Read: dcp.load() into the live shards, resharding if the layout changed; each optimizer gets its groups and
     each parameter's state by name (Optimizer.load_state_dict); each extra's load_state_dict() what it saved.
  6. Verify each parameter's optimizer state: its keys and values are what was saved under its name.

    root/
      .owner.json                     locked by the run that writes here; says who it is: host, pid, job
      step-00000100/                  a commit: appears by one rename, once every rank's files are on disk
        manifest.json                 ours: step, world size, stages, optimizer types, each file's CRCs, meta
        .metadata  __0_0.distcp ...   DCP's: where each key is; each rank's shards, the values stored once
      .tmp-step-00000200-1a2b3c4d/    a save in progress, or interrupted (.tmp-delete-: retention's): never loaded
      .replaced-step-00000100-5e6f/   the older copy of a step saved again, between two renames: step 100 if alone
      .rollback-to-00000100           a rollback in progress: steps above 100 are unseen until it is finished
      .abandoned-step-00000150-9f8e/  a step given up by a rollback: kept, loaded only if named
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import socket
import threading
import uuid
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor
import torch.utils.data
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

OLDEST_TORCH = (2, 9)  # tested: 2.9.0 to 2.15.0
if tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2]) < OLDEST_TORCH:
    raise ImportError(f"ckpt.py needs torch >= {'.'.join(map(str, OLDEST_TORCH))}, not {torch.__version__}")

log = logging.getLogger("ckpt")
FORMAT = 6  # of manifest.json and of the keys
DEFAULT_TIMEOUT = datetime.timedelta(hours=1)  # of checkpoint collectives; training keeps its own, shorter one
MANIFEST, OWNER, TMP, REPLACED, ABANDONED = "manifest.json", ".owner.json", ".tmp-", ".replaced-", ".abandoned-"
ROLLBACK = ".rollback-to-"
STEP_RE = re.compile(r"^step-(\d{8,})$")
REPLACED_RE = re.compile(r"^\.replaced-step-(\d{8,})-[0-9a-f]+$")
NAMED_STEP_RE = re.compile(r"^(?:\.[a-z]+-)?step-(\d{8,})(?:-[0-9a-f]+)?$")  # the step a directory's name says
CHUNK = 64 << 20  # bytes per CRC in the manifest: chunks are checked in parallel
FAILURES = (Exception, dcp.CheckpointException)  # DCP raises any rank's failure as a BaseException
# What torch.load(weights_only=True) restores, inside dicts, OrderedDicts, lists and tuples: no checkpoint runs code.
PLAIN = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str, bytes, torch.dtype, torch.device,
         torch.Size)
CONTAINERS = (dict, collections.OrderedDict, list, tuple)  # exactly these: a namedtuple would come back a tuple

class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank."""

class PerRank:
    """An extra whose state is this rank's alone (a data iterator, a random generator): stored per rank, restored
    at the same world size only, refused by name at another. A DataLoader or a Sampler is per rank without it."""
    def __init__(self, obj):
        self.state_dict = obj.state_dict
        self.load_state_dict = obj.load_state_dict

Outcome = collections.namedtuple("Outcome", "value error")  # a local step's result, or its error message
Generator = collections.namedtuple("Generator", "state_dict load_state_dict")  # a random generator's two calls
_groups = {}  # timeout -> the gloo group of checkpoint collectives
_locks = {}  # root -> the open .owner.json whose lock claims it for this run (rank 0)
_resumed = weakref.WeakSet()  # the modules of models a load() with their optimizer restored
_part_loaded = weakref.WeakSet()  # models a load failed to finish writing into: save() refuses them until a load does
_in_flight = []  # the async save being copied and written, at most one
_host = {}  # async saves' host memory: the layout it is for, one allocation, a view per key; dropped by close()
_making = []  # the threads of prepare_async() making _host: joined before anything else reads it

def save(root, step, model, optimizer=None, extra=None, *, keep=None, meta=None, rng=True, async_save=False,
         timeout=DEFAULT_TIMEOUT):
    """Write a checkpoint of `step` under root; return its path once committed (async_save: a PendingSave).

    optimizer: one, a list, or None (the model alone). extra: {name: object with state_dict() and load_state_dict()}.
    keep: how many steps to keep (None: all). meta: JSON for the manifest. A step saved again is replaced."""
    wait_pending()  # one save in flight at a time: two would race for the root and the host buffers
    group, root, optimizers = checkpoint_group(timeout), os.path.realpath(root), _as_list(optimizer)
    # 1. Collect (user code runs here: the extras' state_dict()).
    collected = _attempt(_collect, step, keep, model, optimizers, extra, rng, meta)
    # 2. Agree: rank 0 is about to touch the root, for a checkpoint every rank names alike.
    args = {"root": root, "step": step, "keep": keep, "rng": rng, "async_save": async_save,
            "meta": json.dumps(meta, sort_keys=True, default=repr),  # equal JSON, whatever the order of its keys
            "optimizers": [type(o).__name__ for o in optimizers]}
    _vote(group, "save()", collected.error, args)
    flat, hashed = collected.value.flat, collected.value.hashed
    # 3. Prepare: rank 0 alone touches the root, so ranks never race on it.
    tmp = _rank0(group, f"save: prepare step {step} in {root} (rank 0)", _prepare, root, step, _was_resumed(model))
    _check_shared(group, tmp)
    manifest = {"format": FORMAT, "step": step, "world_size": _world_size(), "torch_version": torch.__version__,
                "meta": meta or {}, "optimizers": args["optimizers"]}
    commit = Commit(root=root, step=step, tmp=tmp, manifest=manifest, group=group, keep=keep, hashed=hashed)
    # 4. Write, 5. commit, 6. retain: here, or in a thread once the tensors are copied to host memory.
    if not async_save:
        return _write_and_commit(flat, commit)
    copy = HostCopy(flat)  # started: the loop goes on while it runs
    hooks = [opt.register_step_pre_hook(lambda *_: copy.release())  # a step would write what is being copied
             for opt in [*optimizers, *(extra or {}).values()] if isinstance(opt, torch.optim.Optimizer)]
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-save")
    pending = PendingSave(copy, pool.submit(_write_and_commit, flat, commit, copy), hooks)
    pool.shutdown(wait=False)  # not "with": leaving it would wait for the write
    _in_flight.append(pending)
    return pending

def load(path, model, optimizer=None, extra=None, *, verify=True, timeout=DEFAULT_TIMEOUT):
    """Restore the highest step under path, or the checkpoint at path; return its step (None if there is none).

    optimizer: as in save(); with one, a resume: the random generators are restored too, and the model may save to
    roots holding commits. Without (None), an initialisation: the weights and the extras given alone. verify=False
    skips the CRCs. Loading claims nothing: an evaluation job reads a root that training writes."""
    wait_pending()  # a background save uses the same group
    group, path, optimizers = checkpoint_group(timeout), os.path.realpath(path), _as_list(optimizer)
    # 1. Agree on the arguments (a rank in save() and another in load() meet here, not in a hang), and 2. rank 0
    # alone chooses, so that every rank loads the same checkpoint.
    _vote(group, "load()", None, {"path": path, "verify": verify, "resume": bool(optimizers)})
    ckpt_dir = _rank0(group, "load(): rank 0 chooses the checkpoint", find_checkpoint, path)
    if ckpt_dir is None:
        _say_why_none(path)
        return None
    # 3. Verify, each rank its share of the files, before anything is read; 4. match the checkpoint to this
    # rank's model, optimizers and extras, and the model keys of the checkpoint to some rank's model.
    plan = _attempt(_plan, ckpt_dir, verify, model, optimizers, extra)
    _vote(group, f"load: verify {ckpt_dir} and match it to the model", plan.error)
    _check_covered(group, ckpt_dir, plan.value, resuming=bool(optimizers))
    # 5. Read into the live shards and the objects' empty tensors, then hand everything over.
    _part_loaded.add(model)  # until every rank restored it all: a failure leaves it part-loaded
    try:
        reader = SafeReader(ckpt_dir, plan.value.metadata)
        planner = SafeLoadPlanner(plan.value.stages if optimizers else None)  # a resume: the same stage count
        _dcp(dcp.load, plan.value.request, storage_reader=reader, planner=planner, process_group=group)
    except FAILURES as e:  # DCP raises every rank's failure on every rank
        cause = f": {_describe(e)}" if os.path.isdir(ckpt_dir) else ""  # a vanished step: _instead() says so
        raise CheckpointError(f"reading {ckpt_dir} failed{cause}.{_instead(ckpt_dir)}") from e
    restored = _attempt(_restore, plan.value, model)
    _vote(group, f"load: restore {ckpt_dir}", restored.error)
    _part_loaded.discard(model)
    if optimizers:  # its run continues: it may save where commits are (check_root(), save() step 3)
        _resumed.update(model.modules())  # each module: a torch.compile wrapper finds its model's
    log.info("loaded %s (step %d, saved at world size %d)", ckpt_dir, plan.value.step, plan.value.world_size)
    return plan.value.step

def check_root(root, model, *, rollback_to=None, lock=True, timeout=DEFAULT_TIMEOUT):
    """Claim root for the run that trains model, after load(): a wrong or node-local path, another live run there,
    or commits there while model was not resumed (a forgotten resume) fail now, not at the first save.

    rollback_to=step: give up every step after it (moved aside as .abandoned-, durably, before this returns): to
    continue from an older step than the newest. lock=False: claim no lock (file systems without flock, under a
    scheduler that runs one job per root): nothing then stops a second run from deleting this one's saves."""
    wait_pending()
    group, root = checkpoint_group(timeout), os.path.realpath(root)
    valid = rollback_to is None or _count(rollback_to, 0)
    _vote(group, "check_root()", None if valid else f"rollback_to must be a step (an int >= 0), not {rollback_to!r}",
          {"root": root, "rollback_to": rollback_to, "lock": lock})
    _rank0(group, "check_root() (rank 0)", _claim, root, None, _was_resumed(model), rollback_to, lock)
    _check_shared(group, os.path.join(root, OWNER))

def prepare_async(model, optimizer=None, extra=None, *, rng=True):
    """Make the host memory of async saves now, in a thread beside the loop, and return the thread: the first async
    save then blocks no longer than the later ones (page-locking takes seconds per 5 GB). Call it on every rank with
    what save() will be given, once the optimizers hold state (after a step or a resume); not collective. A save that
    comes first waits for it; a save of a state laid out otherwise (other keys, shapes, dtypes) makes its own."""
    wait_pending()  # its copy uses the buffers
    _join_buffers()
    sources = HostCopy.sources_of(_collect(0, None, model, _as_list(optimizer), extra, rng, None).flat)
    thread = threading.Thread(target=_make_buffers, args=(sources,), name="ckpt-buffers", daemon=True)
    thread.start()
    _making.append(thread)
    return thread

def close():
    """End ckpt's part of the run, on every rank, before dist.destroy_process_group(): wait for a save in flight,
    release the root, drop the async host buffers, and destroy ckpt's process groups (not to outlive the default)."""
    try:
        wait_pending()
    finally:
        _join_buffers()  # before the buffers are dropped: it would make them again
        for owner in _locks.values():  # first: the root is released whatever fails below
            os.ftruncate(owner, 0)  # a run that ended: the next one has nobody to take over from
            os.close(owner)  # releases the lock
        for registry in (_host, _locks, _resumed, _part_loaded):  # the next run in this process starts afresh
            registry.clear()
        while _groups:  # last: it raises if the default group is gone already
            dist.destroy_process_group(_groups.popitem()[1])

class PendingSave:
    """An async save: copied to host memory, then written and committed by a thread on every rank. wait_copy():
    the copy is done, anything may be written again; done(): over on this rank (committed, or failed); wait(): its
    path once committed, or its error. The next save, load, check_root, prepare_async or close waits for it, and
    raises its error unless wait() did. Training goes on meanwhile: poll done() to learn of a failure sooner."""
    def __init__(self, copy, job, hooks):
        self.copy, self.job, self.hooks = copy, job, hooks  # job: a Future of _write_and_commit()

    def wait_copy(self):
        self.copy.release()

    def done(self):
        return self.job.done()

    def wait(self):
        try:
            return self.job.result()
        finally:  # a Ctrl-C while it runs leaves it in flight: the next call waits for it
            if self.job.done() and self in _in_flight:
                _in_flight.remove(self)
                for hook in self.hooks:  # here, not in the hook: an optimizer iterates over its hooks
                    hook.remove()

def _was_resumed(model):  # by a load() with its optimizer; any module: a torch.compile wrapper finds its model's
    return any(m in _resumed for m in model.modules())

def wait_pending():  # the save in flight, if any, must be over before the group is used again
    while _in_flight:
        _in_flight[0].wait()

# ---- save, step by step ----

# flat: {DCP key: value}; hashed: the keys whose holders must agree, compared by digest at the write.
Collected = collections.namedtuple("Collected", "flat hashed")

def _collect(step, keep, model, optimizers, extra, rng, meta):  # step 1
    if not _count(step, 0) or not (keep is None or _count(keep, 1)):
        raise CheckpointError(f"save(): step must be an int >= 0 and keep None or an int > 0, not {step!r}, {keep!r}")
    json.dumps(meta, sort_keys=True)  # refused now if it is not JSON, not at the commit after every rank wrote
    if model in _part_loaded:  # its shards would mix ranks that read a checkpoint with ranks that did not
        raise CheckpointError("save(): the last load() into this model failed while reading, so the model and "
                              "optimizers may hold part of it: load() again before saving")
    model_sd = get_model_state_dict(model)
    names = _param_names(model, model_sd)
    flat = {f"model.{k}": v if isinstance(v, torch.Tensor) else _walk(v, _restorable, f"model.{k}")
            for k, v in model_sd.items()}  # an object from get_extra_state() too: load() must restore it
    unhashed = {f"model.{fqns[0]}" for fqns in names.values()}  # parameters; their optimizer state below
    for key, obj in _objects(optimizers, names, extra, rng).items():
        if isinstance(obj, OptimizerByName):  # its state's tensors by parameter; the groups' options in their value
            sd = obj.state_dict()
            sd["state"] = _walk(sd["state"], _lift(flat), f"{key}.state")
            sd["param_groups"] = _walk(sd["param_groups"], _restorable, f"{key}.param_groups")
            flat.update(obj.by_group(sd, key))
            unhashed.update(k for k in flat if k.startswith(f"{key}.state."))
        else:
            skeleton = _walk(obj.state_dict(), _lift(flat), key)  # its tensors into flat
            if key not in flat:  # else its state is one tensor (rng.torch), stored under its key
                flat[key] = skeleton
    if _world_size() == 1:
        return Collected(flat, set())
    return Collected(flat, {key for key, value in flat.items()
                            if key not in unhashed and not key.startswith("rank.") and not isinstance(value, DTensor)})

def _lift(flat):
    """Each tensor of an object's state gets a key of its own, its path (DCP stores a DTensor's shards, a tensor's
    bytes); its place in the object's value says which it was: load() refuses a DTensor it could only read whole."""
    def leaf(path, value):
        if not isinstance(value, torch.Tensor):
            return _restorable(path, value)
        if path in flat:
            raise CheckpointError(f"two values of one object have the key {path}: rename one ('a.b' and a: {{b}})")
        flat[path] = value
        return "<DTensor>" if isinstance(value, DTensor) else "<tensor>"
    return leaf

def _count(n, least):  # an int, not a bool (True would keep one step)
    return isinstance(n, int) and not isinstance(n, bool) and n >= least

def _walk(value, leaf, path=""):
    """value, with leaf(path, x) for each leaf x of its containers; refuses keys load() cannot restore."""
    kind = type(value)
    if kind in (dict, collections.OrderedDict):
        for key in value:
            _restorable(f"{path}: the key {key!r}", key)
        return kind((k, _walk(v, leaf, f"{path}.{k}")) for k, v in value.items())
    if kind in (list, tuple):
        return kind(_walk(v, leaf, f"{path}.{i}") for i, v in enumerate(value))
    return leaf(path, value)

def _restorable(path, value):  # value, or a copy of a tensor (a tensor lr): an async save pickles it later
    # The exact types: a subclass (numpy's float64, an IntEnum, a namedtuple) would pickle, then be refused.
    if type(value) not in PLAIN:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise CheckpointError(f"{path} is a {kind}, which load() cannot restore without running code from the "
                              "checkpoint: convert it in state_dict() (or get_extra_state()), and back when loaded "
                              f"(containers: {', '.join(t.__name__ for t in CONTAINERS)})")
    return value.detach().clone() if isinstance(value, torch.Tensor) else value

def _objects(optimizers, names, extra, rng):
    """{key: what holds state there}: each optimizer by parameter name; each extra, per rank or stored once."""
    for name, obj in (extra or {}).items():
        if not isinstance(name, str) or not name or "." in name or name == "rng":
            raise CheckpointError(f"extra {name!r}: a name is part of the keys: a str without '.', and not 'rng'")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):  # restored in place
            raise CheckpointError(f"extra {name!r} is a {type(obj).__name__}, which has no state_dict() and "
                                  "load_state_dict(): wrap it in an object that has both")
    generators = {"rng.torch": PerRank(Generator(torch.get_rng_state, torch.set_rng_state)),
                  "rng.python": PerRank(Generator(random.getstate, random.setstate))}
    if torch.cuda.is_available():
        generators["rng.cuda"] = PerRank(Generator(torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    objects = {f"optim.{i}": OptimizerByName(opt, names) for i, opt in enumerate(optimizers)}
    for name, obj in {**(extra or {}), **(generators if rng else {})}.items():
        obj = OptimizerByName(obj, names) if isinstance(obj, torch.optim.Optimizer) else obj  # by name here too
        objects[f"rank.{_rank()}.extra.{name}" if _per_rank(obj) else f"extra.{name}"] = obj
    return objects

def _per_rank(obj):
    """The rule for where an extra is stored, declared, never guessed from its values: per rank if it is a PerRank
    (the generators are) or a DataLoader or Sampler (its position is within this rank's shard); else once."""
    return isinstance(obj, (PerRank, torch.utils.data.DataLoader, torch.utils.data.Sampler))

class OptimizerByName:
    """An optimizer's state_dict() and load_state_dict() keyed by parameter name, not by position, and stored one
    value per param group, under the name of its first parameter: pipeline stages, which hold other parameters,
    never write one key. Optimizer.state_dict() runs no step (get_optimizer_state_dict would step it)."""
    def __init__(self, optimizer, names):  # names: {parameter: its names in the model's state dict}
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]  # torch's numbering
        if any(p not in names for p in self.params):
            raise CheckpointError(f"{type(optimizer).__name__} holds parameters that are not the model's")
        self.fqns = [names[p][0] for p in self.params]
        self.names = set(self.fqns)

    def state_dict(self):  # the optimizer's own, parameter numbers replaced by names
        sd = self.optimizer.state_dict()
        groups = [dict(group, params=[self.fqns[i] for i in group["params"]]) for group in sd["param_groups"]]
        return {"state": {self.fqns[i]: state for i, state in sd["state"].items()}, "param_groups": groups}

    def by_group(self, sd, key):  # {key.group.<first name>: a group's position, options, names, their state}
        return {f"{key}.group.{group['params'][0]}": {"index": i, "group": group, "state": {
                name: sd["state"][name] for name in group["params"] if name in sd["state"]}}
                for i, group in enumerate(sd["param_groups"]) if group["params"]}

    def from_groups(self, saved):
        """The state_dict of the saved groups (values of by_group()) that hold the names of this optimizer's."""
        kind, live = type(self.optimizer).__name__, self.state_dict()["param_groups"]  # names, in this order
        groups, state = [], {}
        for i, group in enumerate(live):
            names = set(group["params"])
            if not names:  # an empty group: nothing was saved for it
                groups.append(group)
                continue
            entry = max(saved, key=lambda e: len(names & set(e["group"]["params"])))  # the one most like it
            other = sorted(names ^ set(entry["group"]["params"]))
            if other:  # built otherwise: state would go to other parameters
                raise CheckpointError(f"{kind}'s param group {i} does not hold the parameters its saved group held: "
                                      f"{other[:10]} are in one of them only")
            if entry["index"] != i:  # an LR scheduler's state (base_lrs) is a list in the groups' order
                raise CheckpointError(f"{kind}'s param group {i} was group {entry['index']} when saved: build the "
                                      "groups in their saved order (an LR scheduler's state follows it)")
            groups.append(dict(entry["group"], params=group["params"]))  # in this optimizer's parameter order
            state.update(entry["state"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd):
        saved_options = {option for group in sd["param_groups"] for option in group}
        lacking = sorted(saved_options - set(self.optimizer.param_groups[0]))
        if lacking:
            raise CheckpointError(f"{type(self.optimizer).__name__} has no option {lacking} of the checkpoint's"
                                  + (" (an LR scheduler adds 'initial_lr' to param_groups: create schedulers before "
                                     "load(), as at save())" if "initial_lr" in lacking else ""))
        self.optimizer.load_state_dict(sd)  # it maps the saved ids (names) onto its parameters in order
        for name, param in zip(self.fqns, self.params):  # 6. each parameter holds the state saved under its name
            now, saved = self.optimizer.state.get(param, {}), sd["state"].get(name, {})
            differ = sorted(set(now) ^ set(saved)) or [k for k in saved if not _same(now[k], saved[k])]
            if differ:
                raise CheckpointError(f"optimizer state of {name} after loading is not what was saved under its "
                                      f"name: {differ} differ")

    def owner(self, key, prefix):  # the parameter of optim.<i>.state.<fqn>.<name>: names of parameters nest not
        parts = key[len(prefix):].split(".")
        return next((".".join(parts[:j]) for j in range(1, len(parts)) if ".".join(parts[:j]) in self.names), None)

def _same(now, saved):  # the tensor read (torch keeps it), or equal values on this rank (torch made a copy)
    if not isinstance(saved, torch.Tensor):
        return now == saved
    if now is saved:
        return True
    local = [t.to_local() if isinstance(t, DTensor) else t for t in (now, saved)]
    return local[0].shape == local[1].shape and torch.equal(local[0].cpu().to(local[1].dtype), local[1].cpu())

def _digest(value):  # of every leaf in order; a tensor's of its bytes (its pickle varies)
    h = hashlib.sha256()
    def leaf(path, x):
        h.update(path.encode())
        if isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        else:
            h.update(repr(x).encode())  # exact for the plain types _restorable() admits
    _walk(value, leaf)
    return h.hexdigest()[:16]

class AgreeingSavePlanner(dcp.DefaultSavePlanner):
    """DCP's save planner. Each rank's plan also carries a digest of each value it holds that must agree; the
    coordinator, which receives every plan anyway, refuses a key whose holders disagree (one copy is stored) and
    counts the pipeline stages (the distinct sets of model keys). An async save's writer reads the host copies."""
    def __init__(self, digests, host):
        # Our keys are flat already, and an object's skeleton is one value: DCP must not rebuild it (flattening
        # would turn its keys into str and drop its empty dicts). load() asks for these keys.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.digests, self.host, self.stages = digests, host, None

    def create_local_plan(self):
        stage = _model_keys(self.state_dict)
        self.plan = dataclasses.replace(super().create_local_plan(), planner_data={"stage": stage, **self.digests})
        return self.plan

    def create_global_plan(self, all_plans):
        holders = collections.defaultdict(lambda: collections.defaultdict(list))  # key -> digest -> ranks
        for rank, plan in enumerate(all_plans):
            for key, digest in plan.planner_data.items():
                holders[key][digest].append(rank)
        self.stages = len(holders.pop("stage"))  # pipeline stages: the ranks of one hold the same model keys
        differ = {key: list(ranks.values()) for key, ranks in sorted(holders.items()) if len(ranks) > 1}
        if differ:
            raise CheckpointError(_disagreement(differ))
        return super().create_global_plan(all_plans)

    def lookup_object(self, index):  # the host copy of a tensor (a DTensor's local shard), if there is one
        return self.host[index.fqn] if index.fqn in self.host else super().lookup_object(index)

def _model_keys(state):  # a digest of the model keys a rank holds: ranks of one pipeline stage hold the same
    return hashlib.sha256(" ".join(sorted(k for k in state if k.startswith("model."))).encode()).hexdigest()[:16]

def _disagreement(differ):  # {key: [ranks holding one value, ranks holding another, ...]}
    def ranks(group):
        return " ".join(map(str, group[:4])) + (f" and {len(group) - 4} more" if len(group) > 4 else "")
    shown = [f"{key} (ranks {' | '.join(map(ranks, groups))})" for key, groups in list(differ.items())[:5]]
    advice = {"model": "a buffer that ranks update alone: make it equal (broadcast it)",
              "optim": "an option or a step that differs between ranks: make it equal",
              "extra": "state of each rank's own (a data position, a residual): wrap it as ckpt.PerRank(obj); of "
                       "each pipeline stage's own: give each stage's its own name; else make it equal"}
    kinds = sorted({key.split(".")[0] for key in differ})
    return (f"{len(differ)} value(s) stored once differ among the ranks that hold them (rank 0 compares every "
            f"rank's plan): {'; '.join(shown)}. "
            + "; ".join(f"{kind}.*: {advice[kind]}" for kind in kinds))

def _prepare(root, step, resumed):  # step 3, rank 0
    _claim(root, step, resumed)
    # DCP assumes an empty directory: an old .metadata beside new shards would be trusted. A unique name also
    # means that a leftover we could not remove never blocks a later save.
    tmp = _unique(root, TMP, step)
    os.makedirs(tmp)  # not fsynced: lost in a crash, it held nothing committed; the commit's fsyncs cover it
    return tmp

def _check_shared(group, path):
    # A rank that cannot see what rank 0 made has a node-local root: a save would scatter its shards over disks.
    unseen = None if os.path.exists(path) else f"cannot see {path}: the root must be on storage shared by every rank"
    _vote(group, "shared storage check", unseen)

Commit = collections.namedtuple("Commit", "root step tmp manifest group keep hashed")

class HostCopy:
    """An async save's tensors copied to host memory beside the loop: one rule on every device, copy on the side
    and wait before the next write. A thread copies into host memory made once per layout of the state (by
    prepare_async(), else here); CUDA tensors on a side stream, after the work that made them (an event), the rest
    in the thread. release() is the wait before a write: an optimizer's step, a ckpt call, PendingSave.wait_copy().
    Its host waits until the copies are queued (and for the memory, if it is made here); on CUDA its stream then
    waits for them to land, the host does not. A tensor written in place while the copy runs (its Tensor._version)
    fails the save by name: a check, blind to writes through .data, a DTensor's to_local(), a fused kernel, or
    another stream (wait_copy() first)."""
    def __init__(self, flat):
        self.sources = self.sources_of(flat)
        self.flat, self.host, self.error, self.lock, self.tensors_now = flat, {}, None, threading.Lock(), None
        self.versions = self.read_versions()
        self.device = self.stream = self.ready = self.done = self.failed = None
        try:  # a failure here fails the copy on every rank, at its vote, not save() on this rank alone
            self.device = _cuda_device(self.sources)  # the sources' (not the current one: a loop need not set it)
            if self.device is not None:
                self.stream = torch.cuda.Stream(self.device)
                self.ready = torch.cuda.current_stream(self.device).record_event()  # the work that made the values
                self.done = torch.cuda.Event(blocking=True)  # its waiter sleeps, not spins a core
        except Exception as e:
            self.failed = e
        self.queued = threading.Event()  # every copy is queued (on CUDA: not yet landed, self.done says when)
        self.thread = threading.Thread(target=self.copy, name="ckpt-copy", daemon=True)
        self.thread.start()

    @staticmethod
    def sources_of(flat):  # {key: the tensor copied}: a DTensor's local shard
        with torch.no_grad():  # to_local() of a parameter: no autograd graph
            return {k: v.to_local() if isinstance(v, DTensor) else v.detach() for k, v in flat.items()
                    if isinstance(v, torch.Tensor)}

    def read_versions(self):  # a DTensor's and its shard's: either counts a write in place
        return {k: (self.flat[k]._version, t._version) for k, t in self.sources.items()}

    def copy(self):
        try:
            if self.failed is not None:
                raise self.failed
            if self.stream is not None:  # this thread's current device and stream (a new thread has device 0's)
                torch.cuda.set_device(self.device)
                torch.cuda.set_stream(self.stream)
                self.stream.wait_event(self.ready)
            _join_buffers()
            views = _host_views(self.sources, pinned=self.stream is not None)
            for key, t in self.sources.items():
                views[key].copy_(t, non_blocking=t.is_cuda)  # on the stream of t's device: ours (one device)
                if t.is_cuda:
                    t.record_stream(self.stream)  # its memory is not reused until the copy has read it
            self.host = views
            if self.stream is not None:
                self.done.record(self.stream)
        except Exception as e:
            self.error = f"copy to host memory: {_describe(e)}"
            with contextlib.suppress(Exception):  # what was queued lands before its memory is reused or freed
                if self.stream is not None:
                    self.stream.synchronize()
        finally:
            self.queued.set()
        try:
            if self.done is not None and self.error is None:
                self.done.synchronize()  # this thread waits for the device, not the loop
        finally:
            self.settle()

    def settle(self):  # the versions once the copy is over: a write counted before then raced it, later ones follow
        with self.lock:
            if self.tensors_now is None:
                self.tensors_now = self.read_versions()

    def release(self):
        self.queued.wait()
        if self.done is not None and self.error is None:
            torch.cuda.current_stream(self.device).wait_event(self.done)  # what it runs next runs after the copy
        self.settle()

    def finish(self):  # in the writer thread: the copy complete on the host; what failed it, or None
        self.thread.join()
        if self.device is not None and self.error is None:  # the writer's device too (a new thread's is device 0)
            self.error = _attempt(torch.cuda.set_device, self.device).error
        changed = [k for k, v in self.tensors_now.items() if v != self.versions[k]]
        if changed and self.error is None:
            self.error = (f"{changed[:5]} were written in place while being copied to host memory (an EMA update, a "
                          "weight edit, a buffer in forward()): call pending.wait_copy() before writing them")
        return self.error

def _cuda_device(sources):  # the one CUDA device of the tensors copied, or None
    devices = {t.device for t in sources.values() if t.is_cuda}
    if len(devices) > 1:  # the copies from another device would run on its stream, unordered with ours
        raise CheckpointError(f"an async save copies from one CUDA device per rank, not {sorted(map(str, devices))}")
    return devices.pop() if devices else None

def _host_views(sources, pinned):
    """A tensor by key in one host allocation for the whole state, made for its layout, reused while the layout
    holds. One allocation, page-locked by cudaHostRegister with CUDA: the pinned-memory allocator would round each
    tensor up to a power of two (up to twice the state) and keep the memory after close(). Each tensor owns exactly
    its bytes of it (a slice of its storage): DCP would copy a view of a larger storage before writing it."""
    layout = {key: (t.shape, t.dtype, pinned) for key, t in sources.items()}
    if _host.get("layout") != layout:
        _host.clear()  # the old one is unregistered now (no copy is in flight), freed with its last tensor
        offsets, total = {}, 0
        for key, t in sources.items():
            offsets[key], total = total, total + math.ceil(t.nbytes / 64) * 64  # aligned for any dtype
        memory = torch.empty(total, dtype=torch.uint8)
        if pinned and total:
            _page_lock(memory)
        elif not pinned:
            memory.zero_()  # its pages made now, not while a copy waits for them
        storage = memory.untyped_storage()
        views = {key: torch.empty(0, dtype=t.dtype).set_(storage[offsets[key]: offsets[key] + t.nbytes], 0, t.shape)
                 for key, t in sources.items()}
        _host.update(layout=layout, memory=memory, views=views)
    return _host["views"]

def _page_lock(memory):  # so that the device copies into it beside the loop; unlocked when the tensor is freed
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(memory.data_ptr(), memory.numel(), 1))  # 1: cudaHostRegisterPortable
    if error:
        raise RuntimeError(f"cudaHostRegister of {memory.numel()} bytes of host memory failed: cudaError {error}")
    weakref.finalize(memory, cudart.cudaHostUnregister, memory.data_ptr())

def _make_buffers(sources):  # prepare_async()'s thread
    try:
        device = _cuda_device(sources)
        if device is not None:
            torch.cuda.set_device(device)  # a new thread's is device 0, where another rank's GPU would get a context
        _host_views(sources, pinned=device is not None)
    except Exception as e:  # the first save makes them, or fails naming why
        log.warning("prepare_async(): making the host buffers failed: %s", _describe(e))

def _join_buffers():
    while _making:
        _making.pop().join()

def _write_and_commit(flat, c, copy=None):  # steps 4-6 on every rank; in a background thread for an async save
    try:
        if copy is not None:  # every rank learns of any rank's failed copy: nobody enters DCP's plan alone
            _vote(c.group, f"save of step {c.step}: copy the state to host memory", copy.finish())
        host = copy.host if copy is not None else {}
        written = _attempt(_write, flat, {k: _digest(host.get(k, flat[k])) for k in c.hashed}, host, c.tmp, c.group)
        reports = _gather(c.group, f"save of step {c.step}: writing", written)  # rank 0 lists every rank's files
        path = _rank0(c.group, f"save of step {c.step}", _commit, c, reports)
    except CheckpointError:  # a failed copy, or a rank lost mid-write (its collective failed): nothing is committed
        if _rank() == 0:
            shutil.rmtree(c.tmp, ignore_errors=True)  # gone already if committed
        raise
    log.info("checkpoint %s committed", path)
    return path

def _write(flat, digests, host, tmp, group):
    """Step 4: DCP writes every rank's files; then this rank CRCs its share from the page cache (not DCP's stream)."""
    # fsync: "committed" must mean "on disk". Host copies: no copy-ahead loader (its CUDA stream syncs, for nothing).
    writer = dcp.FileSystemWriter(tmp, sync_files=True, **({"per_thread_copy_ahead": 0} if host else {}))
    planner = AgreeingSavePlanner(digests, host)
    _dcp(dcp.save, flat, storage_writer=writer, planner=planner, process_group=group)
    names = _share(os.listdir(tmp))
    crcs = chunk_crcs([os.path.join(tmp, name) for name in names])
    files = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "crc32": crc} for name, crc in zip(names, crcs)}
    return {"files": files, "stages": planner.stages}  # stages: rank 0's, the coordinator's

def _commit(c, reports):  # steps 5-6, rank 0; reports: each rank's Outcome of _write()
    try:
        return _commit_files(c, reports)
    finally:  # gone once committed; else removed before any rank hears of the failure: frees the space (a full disk)
        if os.path.isdir(c.tmp):
            shutil.rmtree(c.tmp, ignore_errors=True)

def _commit_files(c, reports):
    if any(report.error is not None for report in reports):  # "" from a rank that failed because another did
        failed = [f"rank {r}: {report.error}" for r, report in enumerate(reports) if report.error]
        raise CheckpointError(f"writing failed on {len(failed)} rank(s): {'; '.join(failed)}. Nothing was "
                              "committed; the previous checkpoint is intact")
    files = dict(collections.ChainMap(*(report.value["files"] for report in reports)))  # each rank's share
    if sorted(files) != sorted(os.listdir(c.tmp)):
        raise CheckpointError(f"{c.tmp} holds {sorted(os.listdir(c.tmp))}; the ranks checksummed {sorted(files)}")
    manifest = dict(c.manifest, files=files, stages=reports[0].value["stages"])
    with open(os.path.join(c.tmp, MANIFEST), "w") as f:
        json.dump(dict(manifest, crc32=_manifest_crc(manifest)), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename points at it
    fsync_dir(c.tmp)  # and the directory's entries
    replaced = _unique(c.root, REPLACED, c.step) if os.path.isdir(step_dir(c.root, c.step)) else None
    if replaced:  # step N saved again: until the new copy takes its name, the old one is step N under this name
        os.rename(step_dir(c.root, c.step), replaced)
    try:
        os.rename(c.tmp, step_dir(c.root, c.step))  # atomic: the checkpoint appears whole or not at all
    except OSError:
        if replaced:  # this run goes on: its step N is the older copy again
            os.rename(replaced, step_dir(c.root, c.step))
        raise
    try:  # the commit stands from here: a later failure is logged, and the next save keeps this step
        fsync_dir(c.root)  # without this, a power cut can undo the renames
    except OSError as e:
        log.warning("step %d is committed, but the fsync of %s failed (a power cut may undo it): %s", c.step, c.root, e)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)
    _retain(c.root, c.keep)
    return step_dir(c.root, c.step)

def _retain(root, keep):  # step 6, rank 0: a failure is logged, the commit stands
    old = sorted(_steps(root).items())[: -keep] if keep else []
    trash = [_unique(root, f"{TMP}delete-", step) for step, _ in old]
    try:  # out of load()'s sight first, durably: a crash or a power cut mid-delete leaves .tmp- directories
        for (_, name), path in zip(old, trash):
            os.rename(os.path.join(root, name), path)
        if old:
            fsync_dir(root)
        for path in trash:
            shutil.rmtree(path)
    except OSError as e:
        log.warning("retention: could not remove %s: %s", ", ".join(name for _, name in old), e)

def _unique(root, prefix, step):
    return os.path.join(root, f"{prefix}step-{step:08d}-{uuid.uuid4().hex[:8]}")

# ---- load, step by step ----

def _say_why_none(path):  # a fresh root, or one whose only save was interrupted: say which
    interrupted = [n for n in (os.listdir(path) if os.path.isdir(path) else []) if n.startswith(TMP)]
    if interrupted and _rank() == 0:
        log.warning("no checkpoint in %s: %s is an interrupted save (never loaded)", path, ", ".join(interrupted))

def _instead(ckpt_dir):  # what to load instead of a checkpoint that is damaged or gone
    root = os.path.dirname(ckpt_dir)
    others = [os.path.join(root, name) for _, name in sorted(_steps(root).items())]
    others = [other for other in others if other != ckpt_dir]
    gone = "" if os.path.isdir(ckpt_dir) else f" {ckpt_dir} does not exist (removed by another run's retention?)."
    return gone + (f" The newest other commit is {others[-1]}: pass it to load it." if others else "")

# request: what dcp.load() reads into; objects: {key: object whose state is stored there}.
# unplaced: the keys of an extra's tensors that it held none of at load, read as CPU tensors.
Plan = collections.namedtuple("Plan", "step world_size stages metadata request objects unplaced")

def _plan(ckpt_dir, verify, model, optimizers, extra):  # steps 3-4, on every rank
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        raise CheckpointError(f"refusing to load a damaged checkpoint: {e}.{_instead(ckpt_dir)}") from None
    damage = verify_files(ckpt_dir, manifest, sorted({*_share(manifest["files"]), ".metadata"}), verify)
    if damage:  # before .metadata is unpickled: every rank checks it
        raise CheckpointError(f"refusing to load a damaged checkpoint: {'; '.join(damage)}.{_instead(ckpt_dir)}")
    try:
        metadata = read_metadata(ckpt_dir)
    except CheckpointError as e:  # removed by another run's retention since (_instead() says so), or too new
        if os.path.isdir(ckpt_dir) and manifest["torch_version"] != torch.__version__:
            raise CheckpointError(f"{e}: torch {manifest['torch_version']} saved it, and an older torch may not "
                                  f"read a newer one's metadata (this is {torch.__version__})") from None
        raise CheckpointError(f"{e}.{_instead(ckpt_dir)}") from None
    types = [type(o).__name__ for o in optimizers]
    if optimizers and manifest["optimizers"] != types:
        raise CheckpointError(f"{ckpt_dir} was saved with optimizers {manifest['optimizers']}, not {types}: pass "
                              "the same ones, in the same order (to load the weights alone, pass optimizer=None)")
    saved = metadata.state_dict_metadata
    model_sd = get_model_state_dict(model)
    request = {f"model.{k}": v for k, v in model_sd.items()}
    _match(ckpt_dir, saved, request)
    names = _param_names(model, model_sd)
    params = {fqn: param for param, fqns in names.items() for fqn in fqns}
    resized = manifest["world_size"] != _world_size()
    objects, unplaced = {}, set()
    for key, obj in _objects(optimizers, names, extra, rng=bool(optimizers)).items():
        if ".rng." in key and (resized or key not in saved):
            continue  # generators: at another world size, or saved with rng=False or without CUDA, left as seeded
        if key.startswith("rank.") and resized:
            raise CheckpointError(f"extra {key.split('.', 3)[3]!r} is per rank (a position within one rank's shard), "
                                  f"saved at world size {manifest['world_size']}, not {_world_size()}: resume at that "
                                  "size, or rebuild it from a global position and leave it out of load()")
        owners = {}  # an optimizer's state tensors of this rank's parameters: {key: the parameter}
        if isinstance(obj, OptimizerByName):  # and every group of every stage: matched by the names they hold
            values = [k for k in saved if k.startswith(f"{key}.group.")]
            owners = {k: obj.owner(k, f"{key}.state.") for k in saved if k.startswith(f"{key}.state.")}
            owners = {k: params[fqn] for k, fqn in owners.items() if fqn is not None}
        else:  # the object's value, and each of its tensors
            values = [k for k in saved if k == key or k.startswith(f"{key}.")]
        if not values:
            raise CheckpointError(f"{_object_of(key)} is not in {ckpt_dir}, which holds {_objects_in(saved)}")
        live = {}  # the object's present tensors: read into in place, as plain DCP does (no second copy)
        _walk(obj.state_dict(), lambda path, value: live.setdefault(path, value), key)
        for k in values + list(owners):
            request[k] = _empty_like(saved[k], live.get(k), owners.get(k))
            if k not in owners and live.get(k) is None and request[k] is not None:
                unplaced.add(k)
        objects[key] = obj
    return Plan(manifest["step"], manifest["world_size"], manifest["stages"], metadata, request, objects, unplaced)

def _objects_in(keys):  # the optimizers and extras that keys belong to
    return sorted({_object_of(key) for key in keys if not key.startswith("model.")})

def _object_of(key):  # optim.<i>, extra.<name> or "extra.<name> (per rank)"
    found = re.match(r"(rank\.\d+\.)?(optim\.\d+|extra\.rng\.\w+|extra\.[^.]+)", key)
    return found[2] + (" (per rank)" if found[1] else "")

def _match(ckpt_dir, saved, live):
    """Refuse, naming the keys, a checkpoint that lacks this rank's model keys or holds them in another dtype or
    shape (a checkpoint's keys of no rank's model: _check_covered())."""
    live = {k: f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else "no tensor" for k, v in live.items()}
    kept = {k: f"{m.properties.dtype} {tuple(m.size)}" if hasattr(m, "size") else "no tensor"
            for k, m in saved.items() if k.startswith("model.")}
    found = {"missing from the checkpoint": [k for k in live if k not in kept],
             "of another dtype or shape": [f"{k}: {kept[k]} saved, {live[k]} here"
                                           for k in live if k in kept and kept[k] != live[k]]}
    problems = [f"{len(keys)} key(s) {what}: {keys[:10]}" for what, keys in found.items() if keys]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model: {'; '.join(problems)}")

def _check_covered(group, ckpt_dir, plan, resuming):
    """Every key of the checkpoint some rank asks for (pipeline stages each ask for theirs): one all-reduce of a
    byte per key. A model key no rank has is refused; the rest, not restored, is named on a resume."""
    keys = sorted(plan.metadata.state_dict_metadata)
    asked = torch.tensor([key in plan.request for key in keys], dtype=torch.uint8)
    if group is not None:
        _collective("load: which keys some rank restores", dist.all_reduce, asked, op=dist.ReduceOp.MAX, group=group)
    left = [key for key, some in zip(keys, asked.tolist()) if not some]
    not_in_model = [key for key in left if key.startswith("model.")]
    if not_in_model:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not match the model: {len(not_in_model)} key(s) not in "
                              f"the model: {not_in_model[:10]}")
    def why(name):  # generators at another world size, or what load() was not given
        if name.startswith("extra.rng.") and plan.world_size != _world_size():
            return f"{name[:-1]}, saved at world size {plan.world_size}: left as this process seeded it)"
        return f"{name} (not passed to load())"
    if resuming and left and _rank() == 0:  # a weights-only load leaves the rest behind by design
        log.warning("not restored from %s: %s", ckpt_dir, ", ".join(map(why, _objects_in(left))))

def _empty_like(saved, live, param):
    """What a value is read into: None if pickled; the object's own tensor there if it has one alike (read in
    place), else one laid out as it is (DCP reshards a DTensor); a DTensor parameter's state of its shape laid out
    like it; else a tensor on the CPU (an optimizer's load_state_dict() places it)."""
    if not hasattr(saved, "size"):
        return None  # DCP's load_bytes() replaces it
    size, dtype = tuple(saved.size), saved.properties.dtype
    if isinstance(live, torch.Tensor) and tuple(live.shape) == size and live.dtype == dtype:
        return live
    if live is None and isinstance(param, DTensor) and tuple(param.shape) == size:
        live = param
    if isinstance(live, DTensor):
        return torch.distributed.tensor.empty(size, dtype=dtype, device_mesh=live.device_mesh,
                                              placements=live.placements)
    return torch.empty(size, dtype=dtype, device=live.device if isinstance(live, torch.Tensor) else "cpu")

def _restore(plan, model):  # steps 5-6, after dcp.load(); user code runs
    model_sd = {key.removeprefix("model."): value for key, value in plan.request.items() if key.startswith("model.")}
    set_model_state_dict(model, model_sd)
    def read(path, value):  # a leaf where a tensor was saved becomes the tensor read
        if path not in plan.request or not isinstance(value, str) or value not in ("<tensor>", "<DTensor>"):
            return value
        if value == "<DTensor>" and path in plan.unplaced:  # it would come back whole, on the CPU, on every rank
            raise CheckpointError(f"{path} was saved as a DTensor, and the object held no tensor there to lay it "
                                  "out like: give it its tensors before load() (an EMA's shadows from the parameters)")
        return plan.request[path]
    for key, obj in plan.objects.items():
        if isinstance(obj, OptimizerByName):
            value = obj.from_groups([value for k, value in plan.request.items() if k.startswith(f"{key}.group.")])
        else:
            value = plan.request[key]
        obj.load_state_dict(value if isinstance(value, torch.Tensor) else _walk(value, read, key))

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

def _step_of(name):  # the step a directory holds a commit of, else None
    found = STEP_RE.match(name) or REPLACED_RE.match(name)
    return int(found[1]) if found else None

def _steps(root):
    """{step: its directory's name}. Each step-N is a commit (it appeared by a rename); a .replaced-step-N-<id>
    with no step-N beside it is step N, its save again interrupted between the two renames. A rollback in progress
    (.rollback-to-N) hides the steps above N: they are being given up."""
    names = os.listdir(root) if os.path.isdir(root) else []
    limit = min([int(name[len(ROLLBACK):]) for name in names if name.startswith(ROLLBACK)], default=math.inf)
    interrupted = {_step_of(name): name for name in names if REPLACED_RE.match(name)}
    steps = interrupted | {_step_of(name): name for name in names if STEP_RE.match(name)}  # step-N wins
    return {step: name for step, name in steps.items() if step <= limit}

def committed_steps(root):
    return [s for s, name in sorted(_steps(root).items()) if os.path.isfile(os.path.join(root, name, MANIFEST))]

def find_checkpoint(path):
    """The checkpoint load() uses: path itself if it is a checkpoint directory, else the highest step under path.
    A step whose manifest is damaged is still chosen: load() refuses it by name instead of silently going back."""
    name = os.path.basename(os.path.normpath(path))
    if name.startswith(TMP):
        raise CheckpointError(f"{path} is an uncommitted save (interrupted, or in progress): it is never loaded")
    if NAMED_STEP_RE.match(name) or os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    steps = _steps(path)
    return os.path.join(path, steps[max(steps)]) if steps else None

def _share(names):
    """The files this rank checks: the first number in their names modulo the world size (__r_0.distcp: rank r's)."""
    numbers = {name: int((re.findall(r"\d+", name) or [0])[0]) for name in names}
    return sorted(name for name, n in numbers.items() if n % _world_size() == _rank())

def chunk_crcs(paths):
    """[the CRC-32s of each file's 64 MiB chunks], computed in parallel (zlib releases the GIL): at the disk's speed,
    not one core's. They catch corruption and truncation, not forgery (the manifest is not signed)."""
    chunks = [(path, offset) for path in paths for offset in range(0, max(os.path.getsize(path), 1), CHUNK)]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="ckpt-crc") as pool:
        crcs = dict(zip(chunks, pool.map(_chunk_crc, chunks)))
    return [[crc for (p, _), crc in crcs.items() if p == path] for path in paths]

def _chunk_crc(chunk):
    path, offset = chunk
    crc, left = 0, CHUNK
    with open(path, "rb") as f:
        f.seek(offset)
        while left and (block := f.read(min(left, 1 << 18))):  # 256 KiB reads: little added to the peak memory
            crc, left = zlib.crc32(block, crc), left - len(block)
    return f"{crc:08x}"

def verify_files(ckpt_dir, manifest, names=None, checksums=True):
    """The errors in the size (and CRCs) of the files the manifest lists, or of names."""
    names = sorted(manifest["files"]) if names is None else names
    paths, errors = [os.path.join(ckpt_dir, name) for name in names], []
    for name, path in zip(names, paths):
        if not os.path.isfile(path):
            errors.append(f"{path} is missing")
        elif os.path.getsize(path) != manifest["files"][name]["bytes"]:
            errors.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says "
                          f"{manifest['files'][name]['bytes']} (truncated?)")
    if checksums and not errors:
        errors = [f"{path} does not match its checksum (corrupted)" for name, path, crc in
                  zip(names, paths, chunk_crcs(paths)) if crc != manifest["files"][name]["crc32"]]
    return errors

def read_manifest(ckpt_dir):
    """manifest.json, checked against its own CRC and its directory's step before anything it lists is trusted."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}): {ckpt_dir} is not a committed checkpoint") from e
    saved_format = manifest.get("format") if isinstance(manifest, dict) else None
    if saved_format != FORMAT:
        raise CheckpointError(f"{path} is not a manifest of format {FORMAT}, the one this ckpt.py reads (format: "
                              f"{saved_format}): load it with the ckpt.py that saved it")
    if manifest.get("crc32") != _manifest_crc(manifest):
        raise CheckpointError(f"{path} does not match its own checksum (edited or corrupted)")
    named = NAMED_STEP_RE.match(os.path.basename(os.path.normpath(ckpt_dir)))
    if named and int(named[1]) != manifest["step"]:
        raise CheckpointError(f"{path} is the manifest of step {manifest['step']}, not of {ckpt_dir}'s step")
    return manifest

def _manifest_crc(manifest):  # of its canonical JSON, without its own CRC
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"

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
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which is not among the types of DCP's metadata that this ckpt.py knows "
                f"(torch {torch.__version__} is loading it). If a newer torch wrote it and the type holds plain data, "
                "add it to _METADATA_TYPES")
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
    """DCP's load planner: values unpickled by torch.load(weights_only=True), into the caller's dict by key. With
    stages, its coordinator refuses another number of pipeline stages before anything is read."""
    def __init__(self, stages=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.stages = stages

    def create_local_plan(self):
        return dataclasses.replace(super().create_local_plan(), planner_data=_model_keys(self.state_dict))

    def create_global_plan(self, global_plan):
        now = len({plan.planner_data for plan in global_plan})  # the stages: distinct sets of model keys
        if self.stages is not None and now != self.stages:  # param groups, stage extras: split otherwise
            raise CheckpointError(f"saved by {self.stages} pipeline stage(s) (ranks holding different model keys), "
                                  f"resumed by {now}: resume with {self.stages}, or load the weights alone")
        return super().create_global_plan(global_plan)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True, map_location="cpu")

def _dcp(fn, *args, **kwargs):  # dcp.save() or dcp.load(); in one process, without its warning that it assumes so
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=not dist.is_initialized(), **kwargs)

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

def _attempt(fn, *args):  # a local step's Outcome, for _vote() and _gather() to share
    try:
        return Outcome(fn(*args), None)
    except FAILURES as e:
        log.debug("on rank %d", _rank(), exc_info=True)
        return Outcome(None, _describe(e, only_mine=True))

def _describe(e, only_mine=False):
    """In one line. DCP raises every rank's failure on every rank; only_mine: this rank's alone, so that each is
    counted once ("": it failed because another rank did)."""
    if isinstance(e, dcp.CheckpointException):
        return "; ".join(("" if only_mine else f"on rank {rank}: ") + _describe(error)
                         for rank, (error, _) in e.failures.items() if not only_mine or rank == _rank())
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"  # ours say what they are

def _vote(group, what, error=None, args=None):
    """Raise the same CheckpointError on every rank if a rank failed (error: its message) or was given other args.
    One all-reduce of three numbers when all is well; only a disagreement gathers what to name it by."""
    given = [f"{name}={value!r}" for name, value in (args or {}).items()]  # compared as the error shows them
    given += [f"(in {what})"] if args else []  # names each rank's call where ranks called different ones
    if group is None:
        reports = [(error, given)]
    else:
        digest = int(hashlib.sha256(repr(given).encode()).hexdigest()[:15], 16)  # 60 bits: fits an int64
        votes = torch.tensor([error is not None, digest, -digest], dtype=torch.int64)
        _collective(what, dist.all_reduce, votes, op=dist.ReduceOp.MAX, group=group)
        if votes[0] == 0 and votes[1] == -votes[2]:  # nobody failed; the largest digest is the smallest: all alike
            return
        reports = [None] * dist.get_world_size()
        _collective(what, dist.all_gather_object, reports, (error, given), group=group)
    failed = [f"rank {r}: {message}" for r, (message, _) in enumerate(reports) if message]  # "": another did
    if any(message is not None for message, _ in reports):
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): " + "; ".join(failed))
    alike = set.intersection(*[set(other) for _, other in reports])  # what every rank was given
    if any(len(other) > len(alike) for _, other in reports):
        ranks = [f"rank {r}: " + " ".join(sorted(set(other) - alike)) for r, (_, other) in enumerate(reports)]
        raise CheckpointError(f"{what} was given different arguments on different ranks: " + "; ".join(ranks))

def _rank0(group, what, fn, *args):
    """Rank 0 alone runs fn(*args) (it alone touches the root), and tells every rank its result or its error."""
    outcome = _attempt(fn, *args) if _rank() == 0 else None
    if group is not None:
        box = [tuple(outcome) if outcome else None]
        _collective(what, dist.broadcast_object_list, box, src=0, group=group)
        outcome = Outcome(*box[0])
    if outcome.error is not None:
        raise CheckpointError(f"{what}: {outcome.error}")
    return outcome.value

def _gather(group, what, outcome):  # rank 0: every rank's Outcome, in rank order; other ranks: None
    if group is None:
        return [outcome]
    reports = [None] * dist.get_world_size() if _rank() == 0 else None
    _collective(what, dist.gather_object, tuple(outcome), reports, dst=0, group=group)
    return reports and [Outcome(*report) for report in reports]

def _as_list(optimizer):
    return [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]

# ---- the root: one live run writes to it ----

def _claim(root, step, resumed, rollback_to=None, lock=True):
    """Rank 0: make this run the only writer of root, or raise naming the run that is (two runs on one root delete
    each other's saves in progress, each taking them for a crashed run's). A root holding commits takes a model
    that was resumed (a forgotten resume would start over), and no save that leaves a later step the newest."""
    if root not in _locks:
        owner = _lock(root, lock)
        steps = _steps(root)
        if steps and not resumed:  # this run does not hold the root: its record goes, and the lock with the file
            os.ftruncate(owner, 0)
            os.close(owner)
            raise CheckpointError(f"{root} holds checkpoints up to {os.path.join(root, steps[max(steps)])}, and this "
                                  "run loaded none of them into its model as a resume (load() with the optimizer; "
                                  "a weights-only load is an initialisation): resume from the root, or use another")
        if not _locks:  # a forked child (a DataLoader worker, a helper) is not the run: it must not keep the root
            os.register_at_fork(after_in_child=_release_in_child)
        _locks[root] = owner
        _clean(root)
    if rollback_to is not None:
        _roll_back(root, rollback_to)
    later = [name for s, name in sorted(_steps(root).items()) if step is not None and s > step]
    if later:
        raise CheckpointError(f"{root} holds {later[-1]}, a later step than {step}: this save would leave it the "
                              "newest commit, which a resume continues from. To continue from an older step and give "
                              "up the later ones, say so: ckpt.check_root(root, model, rollback_to=<the step loaded>)")

def _clean(root):  # what a run that is gone left: no other run writes here
    markers = sorted(int(name[len(ROLLBACK):]) for name in os.listdir(root) if name.startswith(ROLLBACK))
    if markers:  # a rollback cut short: finish it
        _roll_back(root, markers[0])
    for name in os.listdir(root):
        path, step = os.path.join(root, name), _step_of(name)
        if name.startswith(REPLACED) and step is not None and not os.path.isdir(step_dir(root, step)):
            os.rename(path, step_dir(root, step))  # killed between a save's two renames: the older copy is step N
            fsync_dir(root)
            log.warning("%s is step %d again: a save of that step was interrupted", step_dir(root, step), step)
        elif name.startswith((TMP, REPLACED)):
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s, left by an interrupted save", path)

def _roll_back(root, step):
    """Move every step after `step` aside, durably, as the user said: a marker first, so that a crash part-way
    leaves the later steps unseen (_steps()) and the next claim finishes the moves; then the moves; then the
    marker's removal, durable too (a marker back after a power cut would hide this run's own later commits)."""
    marker = os.path.join(root, f"{ROLLBACK}{step:08d}")
    with open(marker, "w"):
        pass
    fsync_dir(root)  # from here, load() never chooses a given-up step
    given_up = sorted((s, name) for name in os.listdir(root) if (s := _step_of(name)) is not None and s > step)
    for s, name in given_up:
        aside = _unique(root, ABANDONED, s)
        os.rename(os.path.join(root, name), aside)
        log.warning("moved aside %s as %s: given up by a rollback to step %d", name, os.path.basename(aside), step)
    fsync_dir(root)
    for name in os.listdir(root):
        if name.startswith(ROLLBACK):
            os.remove(os.path.join(root, name))
    fsync_dir(root)

def _lock(root, lock=True):
    """An exclusive lock on root's .owner.json, which the kernel (or NFS's lock manager) releases once every
    process holding the file open is gone: no run id, pid or age is guessed at. Writes who holds it (lock=False:
    no lock, the file alone, which every rank must see)."""
    os.makedirs(root, exist_ok=True)
    owner = os.open(os.path.join(root, OWNER), os.O_RDWR | os.O_CREAT, 0o644)
    try:  # relies on the file system's locks (NFS with locking, Lustre -o flock); one of two takers at once wins
        if lock:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(owner, 4096).decode(errors="replace") or "(it is starting)"
        os.close(owner)
        raise CheckpointError(f"{root} is in use by another run, which holds the lock on {OWNER}: {holder}. Stop it "
                              "or use another root (load() takes no claim: an evaluation job can read it).") from None
    except OSError as e:
        os.close(owner)
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            raise
        raise CheckpointError(f"{root}: its file system refuses flock() ({e.strerror}), which keeps a second run from "
                              "writing here. Lustre: mount with -o flock (-o localflock locks within one node only); "
                              "NFS: run its lock manager. If your scheduler runs one job per root, say so: "
                              "ckpt.check_root(root, model, lock=False) before the first save; then nothing stops a "
                              "second run here from deleting this one's saves in progress") from None
    previous = os.read(owner, 4096).decode(errors="replace")
    if previous:
        log.warning("taking over %s from %s: nothing holds its lock, so that run is gone", root, previous)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
          "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(owner, 0)
    os.pwrite(owner, json.dumps(me).encode(), 0)  # says who holds the lock, to the runs it refuses
    return owner

def _release_in_child():  # after os.fork(), in the child: its copy of the lock's file would keep the lock held
    for owner in _locks.values():
        os.close(owner)
    _locks.clear()

# ---- the resume glue a loop needs beside save() and load(): the data's place, preemption ----

class Position:
    """The data's place as global samples: the epoch, and the samples handed out in it. Stored once, it holds at any
    world size. global_batch: the samples one optimizer step consumes, batch x accumulation x data-parallel degree
    (pipeline stages and tensor-parallel ranks read the same samples: not counted). A changed one is refused."""
    def __init__(self, global_batch):
        self.epoch, self.samples, self.global_batch = 0, 0, global_batch

    def state_dict(self):
        return {"epoch": self.epoch, "samples": self.samples, "global_batch": self.global_batch}

    def load_state_dict(self, sd):
        if sd["global_batch"] != self.global_batch:  # 4 ranks resumed on 2 at the same accumulation, say
            raise ValueError(f"global batch {sd['global_batch']} saved, {self.global_batch} now: keep batch x "
                             "accumulation x data-parallel degree")
        self.epoch, self.samples = sd["epoch"], sd["samples"]

    def batches(self, loader):
        """loader's batches, epoch after epoch from this position (its sampler a SkippingSampler), counted."""
        while True:
            loader.sampler.set_epoch(self.epoch)
            loader.sampler.start = self.samples  # where the epoch resumes, whatever a StatefulDataLoader restored
            for batch in loader:
                self.samples += loader.batch_size * loader.sampler.num_replicas
                yield batch
            self.epoch, self.samples = self.epoch + 1, 0

class SkippingSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler's order from global sample `start` of the epoch on: its permutation, padded or cut as it
    does for today's world size, strided over the ranks, so the first k global samples are the same at any size.
    Its state is Position's: a StatefulDataLoader restores its workers, and `start` decides where the epoch goes on."""
    start = 0

    def __iter__(self):
        n, generator = len(self.dataset), torch.Generator().manual_seed(self.seed + self.epoch)
        order = (torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)).tolist()
        order = (order * math.ceil(self.total_size / n))[: self.total_size]
        return iter(order[self.start + self.rank:: self.num_replicas])

    def __len__(self):
        return max(0, self.total_size - self.start) // self.num_replicas

    def state_dict(self):  # none of its own: a StatefulDataLoader must not skip again what `start` skipped
        return {}

    def load_state_dict(self, sd):
        pass

class Preemption:
    """A SIGTERM to any rank (a scheduler's preemption) known to every rank at the same step: after each step, on
    every rank, `if preemption.requested(): save and exit`. One rank leaving alone would hang the others in their
    next collective. device: where the default process group's collectives run (cuda:<local rank> under NCCL)."""
    def __init__(self, device):
        self.device, self.received = device, False
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "received", True))

    def requested(self):  # one all-reduce of one number
        flag = torch.tensor([float(self.received)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag)
        return flag.item() > 0

def ignore_sigterm(worker_id):
    """A DataLoader's worker_init_fn: torchrun and SLURM signal its workers too, and a dead worker fails its rank's
    next batch before the rank can save. SIG_IGN would hang the exit (which terminates and joins the workers): the
    signal is blocked, and the rank's own SIGTERM at its exit ends the worker."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # in this thread and in the one below

    def wait():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != os.getppid():
            pass
        os._exit(0)
    threading.Thread(target=wait, daemon=True).start()
