"""Correct sharded checkpointing for FSDP2 training, on Distributed Checkpoint (DCP) and public torch APIs.

    step = ckpt.load("checkpoints", model, optimizer, extra) or 0  # a resume: the newest commit (None: none there)
    ckpt.check_root("checkpoints", model)   # claims the root before the first step: a misuse fails now
    ckpt.save("checkpoints", step, model, optimizer, extra, keep=3)
    ckpt.close()                            # before dist.destroy_process_group()

Every rank calls these with the same arguments and its own model, optimizers and extras ({name: an object with
state_dict() and load_state_dict()}). A failure on any rank raises a CheckpointError on every rank.

The branch rule: a save continues the root's newest commit, which its model was loaded from (with its optimizer)
or saved since. To continue from an older step, say so: check_root(root, model, rollback_to=<the step loaded>).

Save
  1. Collect each rank's state by key (_collect() says which); refuse what load() could not restore.
  2. Agree, in one all-reduce: no rank failed, all name the same checkpoint, each value stored once is equal.
  3. Prepare: rank 0 claims the root (a lock held while the run lives), holds the branch rule and makes a new
     .tmp-step-N-<id>, which every rank must see: on a node-local root the shards would scatter.
  4. Write: dcp.save() writes and fsyncs every rank's files; each rank CRCs its own, 64 MiB chunks in parallel.
  5. Commit: rank 0 writes and fsyncs manifest.json (step, files, CRCs, its own CRC), renames the directory to
     step-N (an older copy of step N is replaced) and fsyncs the root.
  6. Retain: rank 0 removes all but the newest `keep` steps.
Load
  1. Agree on the arguments. Rank 0 chooses the checkpoint: the one given, or the highest step under the root.
  2. Check the manifest's CRC and step, and .metadata's CRC before it is unpickled (running none of its code).
     Each rank starts the CRCs of its own files: they read ahead of DCP, so a resume reads the disk once.
  3. Match: read the small values (param groups, skeletons); match them and .metadata to this rank's model,
     optimizers and extras by key, dtype and shape. Every model key must be some rank's.
  4. Read: dcp.load() into the live shards (parameters and optimizer state), resharding if the layout changed.
  5. Restore, once this rank's files match their CRCs: the model, the optimizers by name (their state checked
     after), the extras. From step 4 on, a failure leaves the model holding part of the checkpoint: save()
     refuses it until a load into it succeeds.

The root (ENTRIES reads its names; a name it does not know is left alone):
    .owner.json                          locked (flock) by the run that writes here, which it names
    step-00000100/                       a commit: manifest.json, DCP's .metadata and __<rank>_0.distcp
    .tmp-step-00000200-1a2b3c4d/         a save in progress or interrupted: never loaded; the next claim removes it
    .replaced-step-00000100-5e6f7a8b/    the older copy of a step saved again: step 100 while step-00000100 is absent
    .tmp-delete-step-00000050-0a1b2c3d/  a step being removed by retention
    .rollback-to-00000100, .abandoned-step-00000150-9f8e7d6c/: a rollback's (appendix C)
"""

import collections
import concurrent.futures
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
import threading
import time
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.tensor
import torch.utils.data
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

OLDEST_TORCH = (2, 9)  # tested: 2.9.0 to 2.15.0
if tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2]) < OLDEST_TORCH:
    raise ImportError(f"ckpt.py needs torch >= {'.'.join(map(str, OLDEST_TORCH))}, not {torch.__version__}")

log = logging.getLogger("ckpt")
FORMAT = 7  # of manifest.json and of the keys
DEFAULT_TIMEOUT = datetime.timedelta(hours=1)  # of checkpoint collectives; training keeps its own, shorter one
MANIFEST, OWNER, TMP, REPLACED, ABANDONED, ROLLBACK = (
    "manifest.json", ".owner.json", ".tmp-", ".replaced-", ".abandoned-", ".rollback-to-")
ENTRIES = {"commit": r"step-(\d{8,})", "rollback": r"\.rollback-to-(\d{8,})",  # a name under a root: kind, step
           "tmp": r"\.tmp-(?:delete-)?step-(\d{8,})-[0-9a-f]{8}", "replaced": r"\.replaced-step-(\d{8,})-[0-9a-f]{8}",
           "abandoned": r"\.abandoned-step-(\d{8,})-[0-9a-f]{8}"}
CHUNK = 64 << 20  # bytes per CRC in the manifest: chunks are checked in parallel
FAILURES = (Exception, dcp.CheckpointException)  # DCP raises any rank's failure as a BaseException
# What torch.load(weights_only=True) restores besides tensors, in exactly dict, OrderedDict, list and tuple (a
# namedtuple would come back a tuple): no checkpoint runs code.
PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)
NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # a file system without flock(): Lustre, NFS without lockd

_groups = {}  # (timeout, the default group) -> the gloo group of checkpoint collectives
_locks = {}  # root -> the open .owner.json whose lock claims the root for this run (rank 0)
_lineage = weakref.WeakKeyDictionary()  # module -> the step its model continues from: resumed from, or saved
_part_loaded = weakref.WeakSet()  # modules and optimizers a load failed to finish writing into: refused by save()
_pending = []  # work in a thread (appendix A) that every call waits for first: at most one save in flight
_cache = {}  # what appendix A keeps between saves (the host memory of async saves); dropped by close()

class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank."""

class PerRank:
    """An extra whose state is this rank's alone (a data iterator, a generator): stored per rank, restored at the
    same world size only, refused by name at another. A DataLoader with state (torchdata's StatefulDataLoader)
    or a Sampler is stored per rank without this wrapper."""
    def __init__(self, obj):
        self.state_dict, self.load_state_dict = obj.state_dict, obj.load_state_dict

def save(root, step, model, optimizer=None, extra=None, *, keep=None, meta=None, rng=True, async_save=False,
         timeout=DEFAULT_TIMEOUT):
    """Write a checkpoint of `step` under root; return its path once committed (async_save: a PendingSave).
    optimizer: one, a list or None; keep: the newest steps kept (None: all); meta: JSON for the manifest; timeout:
    of ckpt's collectives, a timedelta or seconds."""
    wait_pending()  # one save in flight at a time: two would race for the root
    group, root, optimizers = checkpoint_group(timeout), os.path.realpath(root), _as_list(optimizer)
    lineage, kinds = _continues_from(model), [type(o).__name__ for o in optimizers]
    # 1. Collect (user code runs here: the extras' state_dict()), 2. agree, before rank 0 touches the root.
    digests = {}  # of each value stored once, by path: every rank holding it must hold the same
    flat, error = _attempt(_collect, step, keep, model, optimizers, extra, rng, meta, digests)
    args = {"root": root, "step": step, "keep": keep, "rng": rng, "async_save": async_save, "optimizers": kinds,
            "continues_from": lineage, "meta": _attempt(lambda: json.dumps(meta, sort_keys=True))[0],
            "timeout": _timeout(timeout)}
    _vote(group, "save()", error, args, digests)
    # 3. Prepare: rank 0 alone touches the root, so that ranks never race on it.
    tmp = _rank0(group, f"save: prepare step {step} in {root} (rank 0)", _prepare, root, step, lineage)
    _check_shared(group, tmp, made=True)
    manifest = {"format": FORMAT, "step": step, "world_size": _world_size(), "torch_version": torch.__version__,
                "meta": meta or {}, "optimizers": kinds}
    commit = Commit(root, step, tmp, manifest, group, keep)
    # 4. Write, 5. commit, 6. retain: here, or in a thread once the tensors are copied to host memory.
    if async_save:
        done = _save_in_background(flat, commit, [*optimizers, *(extra or {}).values()])
    else:
        done = _write_and_commit(flat, commit)
    _lineage.update(dict.fromkeys(model.modules(), step))  # it holds step's state: its next save continues from it
    return done

def load(path, model, optimizer=None, extra=None, *, strict=True, verify=True, timeout=DEFAULT_TIMEOUT):
    """Restore the highest step under path, or the checkpoint at path; return its step (None if there is none).
    With an optimizer, a resume (the generators too); without, an initialisation: the weights and the extras given.
    strict=False (initialisations): what the checkpoint or the model lacks is left, and logged. verify=False: a CRC
    mismatch is not refused (the files are read ahead all the same: the CRC pass is the faster reader)."""
    wait_pending()  # a background save uses the same group
    group, path, optimizers = checkpoint_group(timeout), os.path.realpath(path), _as_list(optimizer)
    # 1. Agree (a rank in save() and another in load() meet here, not in a hang); rank 0 alone chooses.
    objects, error = _attempt(_objects, optimizers, extra, bool(optimizers))
    if optimizers and not strict:
        error = CheckpointError("load(strict=False) is an initialisation: pass optimizer=None, then build it afresh")
    _vote(group, "load()", error, {"path": path, "strict": strict, "verify": verify, "resume": bool(optimizers),
                                   "timeout": _timeout(timeout)})
    ckpt_dir = _rank0(group, "load(): rank 0 chooses the checkpoint", find_checkpoint, path)
    if ckpt_dir is None:  # a wrong path, or a root whose only save was interrupted: rank 0 says which
        interrupted = [name for name in os.listdir(path) if _entry(name)[0] == "tmp"] if os.path.isdir(path) else []
        if _rank() == 0 and (interrupted or not os.path.isdir(path)):
            log.warning("no checkpoint in %s: %s", path, f"{', '.join(interrupted)} is an interrupted save (never "
                        "loaded)" if interrupted else "it does not exist")
        return None
    # The CRC thread is joined before load() returns: a DataLoader that forks beside a live thread is unsafe.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as pool:
        # 2. Check what must be trusted before it is read; this rank's CRCs run from here, beside DCP's reads.
        found = _each(group, f"load: check {ckpt_dir}", _open, ckpt_dir, optimizers, verify, pool)
        # 3. Match the objects, once their small values are read; every model key must be some rank's.
        small = _read(found, dict.fromkeys(_small_keys(found, objects)), group)
        request, loaded = _each(group, f"load: match {ckpt_dir}", _match, found, small, model, objects, strict)
        _check_covered(group, found, {*request, *small}, strict, resuming=bool(optimizers))
        # 4. Read into the live shards and the objects' tensors; 5. restore.
        _part_loaded.update([*model.modules(), *optimizers])  # until every rank restored it all
        _read(found, request, group)
        _each(group, f"load: restore {ckpt_dir}", _restore, found, request, loaded, model, strict)
        _part_loaded.difference_update([*model.modules(), *optimizers])
    _lineage.update(dict.fromkeys(model.modules(), found.step if optimizers else None))  # a resume's, else none
    log.info("loaded %s (step %d, saved at world size %d)", ckpt_dir, found.step, found.world_size)
    return found.step

def check_root(root, model, *, rollback_to=None, lock=True, timeout=DEFAULT_TIMEOUT):
    """Claim root for the run that trains model, after load() and before the first step: another live run there, a
    node-local path or a break of the branch rule fail now. rollback_to=<the step loaded>: the later steps are moved
    aside, durably. lock=False: go on where the file system refuses flock() (a scheduler runs one job per root)."""
    wait_pending()
    group, root, lineage = checkpoint_group(timeout), os.path.realpath(root), _continues_from(model)
    bad = rollback_to is not None and not _count(rollback_to, 0)
    error = CheckpointError(f"rollback_to must be a step (an int >= 0), not {rollback_to!r}") if bad else None
    _vote(group, "check_root()", error, {"root": root, "rollback_to": rollback_to, "lock": lock,
                                         "continues_from": lineage, "timeout": _timeout(timeout)})
    _rank0(group, "check_root() (rank 0)", _claim, root, lineage, None, rollback_to, lock)  # None: no step saved
    _check_shared(group, os.path.join(root, OWNER))

def close():
    """End ckpt's part of the run on every rank, before dist.destroy_process_group(): wait for a save in flight,
    release the root, forget what the run kept, destroy ckpt's process groups (not to outlive the default)."""
    try:
        wait_pending()
    finally:
        for root in list(_locks):  # first: the root is released whatever fails below
            _release(root)
        for registry in (_cache, _lineage):  # the next run in this process starts afresh (a part-loaded model stays)
            registry.clear()
        while _groups:  # last; a destroyed default group took ours with it
            group = _groups.popitem()[1]
            if dist.is_initialized():
                dist.destroy_process_group(group)

def wait_pending():  # ckpt's work in a thread (appendix A) is over; raises a failed save's error nobody waited for
    while _pending:
        _pending[0].wait()

def _continues_from(model):  # any module: a torch.compile wrapper finds its model's
    return next((_lineage[m] for m in model.modules() if m in _lineage), None)

# ---- coordination: a gloo group with a long timeout; every rank learns of any rank's failure ----

def checkpoint_group(timeout=DEFAULT_TIMEOUT):
    """The gloo group of every checkpoint collective (None without a process group: a world of one). Its own long
    timeout: training's short one (for a hung rank) would kill the job in a save to slow storage; gloo: off the GPU."""
    if not dist.is_initialized():
        return None
    key = (_timeout(timeout), dist.group.WORLD)  # a default group made anew (no close() before) needs ours anew
    if key not in _groups:
        _groups[key] = _collective("make ckpt's process group", dist.new_group, backend="gloo", timeout=key[0])
    return _groups[key]

def _timeout(timeout):  # a timedelta, or seconds
    return timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)

def _rank():
    return dist.get_rank() if dist.is_initialized() else 0

def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1

def _as_list(optimizer):
    return [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]

def _collective(what, fn, *args, **kwargs):  # a timeout, a peer gone, a destroyed group: a CheckpointError
    if kwargs.get("group") is not None and not dist.is_initialized():  # a save in flight outlived its world
        raise CheckpointError(f"checkpoint coordination failed at '{what}': process group destroyed before close()")
    start = time.monotonic()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the seconds tell a peer gone (at once) from a timeout (the group's)
        _groups.clear()  # a gloo group that failed is unusable: the next call makes a fresh one
        raise CheckpointError(f"checkpoint coordination failed at '{what}' on rank {_rank()} after "
                              f"{time.monotonic() - start:.1f} s (a rank crashed or hung, or not called on every "
                              f"rank?): {_describe(e)}") from e

def _attempt(fn, *args):  # a local step's (value, None), or (None, the exception): the ranks vote on it next
    try:
        return fn(*args), None
    except FAILURES as e:
        log.debug("on rank %d", _rank(), exc_info=True)
        return None, e

def _each(group, what, fn, *args):  # fn(*args) on every rank: a failure on any raises on every rank
    value, error = _attempt(fn, *args)
    _vote(group, what, error)
    return value

def _rank0(group, what, fn, *args):  # fn(*args) on rank 0 alone (it alone touches the root): its value, everywhere
    value, error = _attempt(fn, *args) if _rank() == 0 else (None, None)
    said = [(value, None if error is None else _describe(error))]
    if group is not None:
        _collective(what, dist.broadcast_object_list, said, src=0, group=group)  # src: rank 0 of the world's ranks
    value, message = said[0]
    if message is not None:
        raise CheckpointError(f"{what}: {message}") from error
    return value

def _describe(e, only_mine=False):  # in one line; only_mine: of DCP's error, which lists every rank's, this rank's
    if isinstance(e, dcp.CheckpointException):
        return "; ".join(("" if only_mine else f"on rank {rank}: ") + _describe(error)
                         for rank, (error, _) in e.failures.items() if not only_mine or rank == _rank())
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"  # ours say what they are

def _vote(group, what, error=None, args=None, claims=None):
    """Raise a CheckpointError on every rank if a rank failed (error, chained), was given other args, or claims a value
    under a name that another rank claims otherwise; else return every rank's claims ({name: value}). One all-reduce of
    five numbers (a digest and its negation per kind: the MAXes are opposite iff all agree); else a gather."""
    given = [f"{name}={value!r}" for name, value in (args or {}).items()] + ([f"(in {what})"] if args else [])
    mine = (None if error is None else _describe(error, only_mine=True), given, claims or {})
    reports = [mine]
    if group is not None:
        votes = torch.tensor([error is not None, *_signed(given), *_signed(sorted(mine[2].items()))])
        _collective(what, dist.all_reduce, votes, op=dist.ReduceOp.MAX, group=group)
        if votes[0] == 0 and votes[1] == -votes[2] and votes[3] == -votes[4]:
            return mine[2]  # nobody failed, and each largest digest is also the smallest: all alike
        reports = [None] * dist.get_world_size()
        _collective(what, dist.all_gather_object, reports, mine, group=group)
    failed = [f"rank {r}: {message}" for r, (message, _, _) in enumerate(reports) if message]  # "": another did
    if any(message is not None for message, _, _ in reports):
        raise CheckpointError(f"{what} failed on {len(failed)} rank(s): " + "; ".join(failed)) from error
    alike = set.intersection(*[set(other) for _, other, _ in reports])  # what every rank was given
    if any(len(other) > len(alike) for _, other, _ in reports):
        _groups.clear()  # each rank made the group of its own timeout: the next call starts alike on every rank
        ranks = [f"rank {r}: " + " ".join(sorted(set(other) - alike)) for r, (_, other, _) in enumerate(reports)]
        raise CheckpointError(f"{what} was given different arguments on different ranks: " + "; ".join(ranks))
    holders = collections.defaultdict(lambda: collections.defaultdict(list))  # name -> value -> ranks
    for r, (_, _, claimed) in enumerate(reports):
        for name, value in claimed.items():
            holders[name][repr(value)].append(r)
    differ = {name: list(ranks.values()) for name, ranks in sorted(holders.items()) if len(ranks) > 1}
    if differ:
        raise CheckpointError(_disagreement(what, differ))
    return {name: value for _, _, claimed in reports for name, value in claimed.items()}

def _signed(value):  # a 60-bit digest of value, and its negation: one MAX all-reduce yields the largest and smallest
    digest = int(hashlib.sha256(repr(value).encode()).hexdigest()[:15], 16)
    return digest, -digest

def _disagreement(what, differ):  # {path: [ranks holding one value, ranks holding another, ...]}
    def ranks(group):
        return " ".join(map(str, group[:4])) + (f" and {len(group) - 4} more" if len(group) > 4 else "")
    shown = [f"{path} (ranks {' | '.join(map(ranks, groups))})" for path, groups in list(differ.items())[:5]]
    return (f"{what}: {len(differ)} value(s) stored once differ among the ranks that hold them: {'; '.join(shown)}. "
            "Make each equal (a buffer: broadcast it; an option: set it alike), or store it per rank: an extra as "
            "ckpt.PerRank(obj), a pipeline stage's under a name of its own. An optimizer's state that each rank "
            "computes alone (LBFGS's prev_loss) cannot be stored. Nothing was written")

# ---- save, steps 1 and 3: collect each rank's state by key, prepare a directory ----

# The keys: model.<fqn>; optim.<i>.state.<fqn>.<name> (a parameter's state tensors), optim.<i>.groups.<its first
# fqn> (the rest of the optimizer); extra.<name> (an extra's state, its tensors at extra.<name>.<path>);
# rank.<r>.extra.<name> (rank r's own: a PerRank, a DataLoader, a Sampler, the generators). A value stored once is
# compared among the ranks that hold it, except parameters and their optimizer state (the gradient all-reduce's).
def _collect(step, keep, model, optimizers, extra, rng, meta, digests):  # step 1, on every rank: {key: value}
    if not _count(step, 0) or not (keep is None or _count(keep, 1)):
        raise CheckpointError(f"save(): step must be an int >= 0 and keep None or an int > 0, not {step!r}, {keep!r}")
    not_json = _attempt(lambda: json.dumps(meta, sort_keys=True))[1]  # refused now, not at the commit after the write
    if not_json:
        raise CheckpointError(f"save(): meta must be JSON, its keys str: {_describe(not_json)}") from not_json
    if any(m in _part_loaded for m in [*model.modules(), *optimizers]):  # ranks' shards would mix two states
        raise CheckpointError("save(): the last load() into this model or optimizer failed once it was reading into "
                              "it, so the model and optimizers may hold part of it: load() again before saving")
    compare = digests if _world_size() > 1 else None  # a world of one has nobody to disagree with
    model_sd = get_model_state_dict(model)
    names = _param_names(model, model_sd)
    params = {fqn for fqns in names.values() for fqn in fqns}  # kept equal by the gradient all-reduce
    flat = {}
    for key, value in model_sd.items():
        if isinstance(value, torch.Tensor):
            _lift(value, f"model.{key}", flat, None if key in params else compare)
        else:  # an object from get_extra_state(): pickled whole
            flat[f"model.{key}"] = _lift(value, f"model.{key}", None, compare).value
    for key, obj in _objects(optimizers, extra, rng).items():
        if isinstance(obj, torch.optim.Optimizer):  # its state tensors by parameter, not compared; the rest together
            obj = OptimizerByName(obj, names)
            sd = obj.state_dict()
            state = {fqn: _lift(st, f"{key}.state.{fqn}", flat, compare, compare_tensors=False)
                     for fqn, st in sd["state"].items()}
            groups = _lift(sd["param_groups"], obj.key(key), None, compare).value  # options: in the value
            flat[obj.key(key)] = {"state": {"state": {fqn: st.value for fqn, st in state.items()},
                                            "param_groups": groups},
                                  "tensors": {p: kind for st in state.values() for p, kind in st.tensors.items()}}
        else:
            state = _lift(obj.state_dict(), key, flat, None if key.startswith("rank.") else compare)
            if key not in flat:  # else its state is one tensor (rng.torch), stored at its key
                flat[key] = {"state": state.value, "tensors": state.tensors}
    return flat

# An object's state as saved: value, with None where each tensor of tensors ({path: "DTensor" or "Tensor"}) was;
# the paths start from base. Stored as {"state": value, "tensors": tensors}.
Skeleton = collections.namedtuple("Skeleton", "value tensors base")

def _lift(value, base, flat, digests, compare_tensors=True):
    """Each tensor of value into flat, at its path (flat=None: it stays in the value, copied, for an async save);
    digests: of each leaf (not DTensors, nor tensors unless compare_tensors) and of each container's keys."""
    tensors, seen = {}, set()
    def leaf(path, x):
        if type(x) not in PLAIN and not isinstance(x, torch.Tensor):  # exact: numpy's float64 would not come back
            raise CheckpointError(f"{path} is a {type(x).__module__}.{type(x).__qualname__}, which load() cannot "
                                  "restore without running code from the checkpoint: convert it in state_dict() (or "
                                  "get_extra_state()), and back")
        if path in seen or (flat is not None and path in flat):  # paths are keys: two values would be one
            raise CheckpointError(f"two values of one object have the key {path}: rename one ('a.b' and a: {{b}}, "
                                  "or 1 and '1')")
        seen.add(path)
        if digests is not None and not isinstance(x, DTensor) and (compare_tensors or not isinstance(x, torch.Tensor)):
            digests[path] = _digest(path, x)
        if not isinstance(x, torch.Tensor):
            return x
        if flat is None:
            return x.detach().clone()
        flat[path], tensors[path] = x, "DTensor" if isinstance(x, DTensor) else "Tensor"
        return None
    skeleton = Skeleton(_walk(value, leaf, base), tensors, base)
    if digests is not None and type(value) in (dict, collections.OrderedDict, list, tuple):  # its keys, by its path
        digests[base] = _digest(base, repr(_shape(skeleton.value)))
    return skeleton

def _shape(value):  # its containers' types and keys, for a digest equal where == holds (a dict's order aside)
    if type(value) in (dict, collections.OrderedDict, list, tuple):
        shape = [(repr(k), _shape(v)) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
        return type(value).__name__, sorted(shape) if type(value) is dict else shape
    return type(value).__name__

def _walk(value, leaf, path=""):  # value, with leaf(path, x) for each leaf x of its containers
    if type(value) in (dict, collections.OrderedDict):
        for key in value:
            _lift(key, f"{path}: the key {key!r}", None, None)  # refused as a value would be
        return type(value)((k, _walk(v, leaf, f"{path}.{k}")) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_walk(v, leaf, f"{path}.{i}") for i, v in enumerate(value))
    return leaf(path, value)

def _digest(path, x):  # at memory speed: a CRC of a tensor's bytes (its pickle varies), else of the exact repr
    if not isinstance(x, torch.Tensor):
        return zlib.crc32(x if isinstance(x, bytes) else repr(x).encode())
    try:
        data = x.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)
    except Exception as e:  # a meta or sparse tensor: nothing to compare, or store
        raise CheckpointError(f"{path}: its bytes cannot be read ({_describe(e)})") from e
    return f"{x.dtype} {tuple(x.shape)} {zlib.crc32(data.numpy()):08x}"

def _count(n, least):  # an int, not a bool (True would keep one step)
    return isinstance(n, int) and not isinstance(n, bool) and n >= least

def _objects(optimizers, extra, rng):  # {key: what holds state there}; an extra per rank (declared) or stored once
    for name, obj in (extra or {}).items():
        if not isinstance(name, str) or not name or "." in name or name == "rng":
            raise CheckpointError(f"extra {name!r}: a name is part of the keys: a str without '.', and not 'rng'")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):  # restored in place
            raise CheckpointError(f"extra {name!r} is a {type(obj).__name__}, which has no state_dict() and "
                                  "load_state_dict(): wrap it in an object that has both")
    generators = {"rng.torch": (torch.get_rng_state, torch.set_rng_state),
                  "rng.python": (random.getstate, random.setstate)}
    if torch.cuda.is_available():
        generators["rng.cuda"] = (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
    objects = {f"optim.{i}": opt for i, opt in enumerate(optimizers)}
    for name, obj in {**(extra or {}), **{k: PerRank(Generator(*g)) for k, g in generators.items() if rng}}.items():
        per_rank = isinstance(obj, (PerRank, torch.utils.data.DataLoader, torch.utils.data.Sampler))
        objects[f"rank.{_rank()}.extra.{name}" if per_rank else f"extra.{name}"] = obj
    return objects

Generator = collections.namedtuple("Generator", "state_dict load_state_dict")  # a random generator's two calls

class OptimizerByName:
    """An optimizer's state_dict() by parameter name, not number: it runs no step (get_optimizer_state_dict() could)."""
    def __init__(self, optimizer, names):  # names: {parameter: its names in the model's state dict}
        self.optimizer, self.kind = optimizer, type(optimizer).__name__
        self.params = [p for group in optimizer.param_groups for p in group["params"]]  # torch's numbering
        if any(p not in names for p in self.params):
            raise CheckpointError(f"{self.kind} holds parameters that are not the model's")
        self.fqns = [names[p][0] for p in self.params]

    def key(self, base):  # under its first parameter's name: two pipeline stages never write the same key
        return f"{base}.groups.{self.fqns[0] if self.fqns else ''}"

    def state_dict(self):
        sd = self.optimizer.state_dict()
        groups = [dict(group, params=[self.fqns[i] for i in group["params"]]) for group in sd["param_groups"]]
        return {"state": {self.fqns[i]: state for i, state in sd["state"].items()}, "param_groups": groups}

    def saved(self, base, records):
        """Its saved Skeleton (the record holding most of its names), if each group is, in its place, the saved
        group most like it: else state would go to other parameters, or an LR scheduler's lr to another group."""
        def overlap(group, names):
            return len(set(group["params"]) & names)
        mine = set(self.fqns)
        record = max(records, key=lambda r: sum(overlap(g, mine) for g in r["state"]["param_groups"]), default=None)
        live, saved = self.state_dict()["param_groups"], record["state"]["param_groups"] if record else []
        for i, group in enumerate(live):
            names = set(group["params"])
            j = max(range(len(saved)), key=lambda j: (overlap(saved[j], names), j == i), default=None)
            other = sorted(names ^ set(saved[j]["params"] if j is not None else ()))
            if other or j != i:
                raise CheckpointError(f"{self.kind}'s param group {i} " + (
                    f"was group {j} when saved: build them in their saved order (an LR scheduler's state follows it)"
                    if not other else f"does not hold the parameters its saved group held: {other[:10]} are in one "
                    "of them only (optimizers passed in another order: pass them as saved; param groups or pipeline "
                    "stages built otherwise: load the weights alone instead)"))
        if len(saved) != len(live):  # a group less
            raise CheckpointError(f"{self.kind} has {len(live)} param groups, the checkpoint {len(saved)}")
        groups = []
        for i, (group, now) in enumerate(zip(saved, live)):  # the saved options over the live ones; the live names
            lacking = sorted(set(group) - set(now) - {"param_names"})
            if lacking:
                raise CheckpointError(f"{self.kind}'s param group {i} has no option {lacking} of the checkpoint's" + (
                    " (an LR scheduler adds 'initial_lr': create schedulers before load(), as at save())"
                    if "initial_lr" in lacking else ""))
            groups.append({**now, **{k: v for k, v in group.items() if k != "param_names"}, "params": now["params"]})
        return Skeleton({"state": record["state"]["state"], "param_groups": groups}, record["tensors"], base)

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)  # it maps the saved ids (names) onto its parameters in order
        for name, param in zip(self.fqns, self.params):  # each parameter holds the state saved under its name
            now, saved = self.optimizer.state.get(param, {}), sd["state"].get(name, {})
            differ = sorted(set(now) ^ set(saved)) or [k for k in saved if not _same(now[k], saved[k])]
            if differ:
                raise CheckpointError(f"optimizer state of {name} after loading is not what was saved under its "
                                      f"name: {differ} differ")

def _same(now, saved):  # the tensor read (torch kept it), else equal on the tensor's own device (torch copied it)
    if now is saved or not isinstance(saved, torch.Tensor):
        return now is saved or now == saved
    now, saved = (t.to_local() if isinstance(t, DTensor) else t for t in (now, saved))
    return now.shape == saved.shape and torch.equal(now, saved.to(now.device, now.dtype))

def _prepare(root, step, lineage):  # step 3, rank 0
    _claim(root, lineage, step)
    # DCP assumes an empty directory: an old .metadata beside new shards would be trusted. A unique name also
    # means that a leftover we could not remove never blocks a later save.
    tmp = _unique(root, TMP, step)
    os.makedirs(tmp)  # not fsynced: lost in a crash, it held nothing committed; the commit's fsyncs cover it
    return tmp

def _check_shared(group, path, made=False):  # a rank that cannot see what rank 0 made: shards would scatter
    try:
        _vote(group, "shared storage check", None if os.path.exists(path) else CheckpointError(
            f"cannot see {path}: the root must be on storage shared by every rank"))
    except CheckpointError:
        if made and _rank() == 0:  # not left for the next run to clean
            shutil.rmtree(path, ignore_errors=True)
        raise

# ---- the root, claimed at step 3: one live run writes to it, and it continues the newest commit ----

def _claim(root, lineage, step=None, rollback_to=None, lock=True):
    """Rank 0: make this run the only writer of root (two runs on one root delete each other's saves in progress,
    each taking them for a crashed run's); then hold the branch rule for a save of step (None: check_root())."""
    if _entry(os.path.basename(root))[0] or os.path.exists(os.path.join(root, MANIFEST)):
        raise CheckpointError(f"{root} is a checkpoint, not a root: pass the directory that holds the step-N")
    first = root not in _locks
    if first:
        if not _locks:  # a forked child (a DataLoader worker) is not the run
            os.register_at_fork(after_in_child=_release_in_child)
        _locks[root] = _lock(root, lock)
    try:
        _check_branch(root, lineage, step, rollback_to)
    except CheckpointError:
        if first:  # this run does not hold the root: its record goes, and the lock with the file
            _release(root)
        raise
    if first:
        _clean(root)
    if rollback_to is not None:
        _roll_back(root, rollback_to)

def _check_branch(root, lineage, step, rollback_to):  # the branch rule (module docstring); rollback_to: steps above go
    if rollback_to is not None and rollback_to != lineage:
        now = f"step {lineage}" if lineage is not None else "no step (it was not resumed)"
        raise CheckpointError(f"rollback_to={rollback_to}, but the model continues from {now}: name the step loaded")
    steps = {s: name for s, name in _steps(root).items() if rollback_to is None or s <= rollback_to}
    newest = max(steps, default=-1)
    if newest >= 0 and lineage is None:
        raise CheckpointError(f"{root} holds checkpoints up to {os.path.join(root, steps[newest])}, and this run "
                              "loaded none of them into its model as a resume (load() with the optimizer; a "
                              "weights-only load is an initialisation): resume from the root, or use another")
    for limit, what in ((step, "the step saved"), (lineage, "the step its model continues from")):
        if limit is not None and newest > limit:
            raise CheckpointError(f"{root} holds {steps[newest]}, a later step than {limit} ({what}), which a resume "
                                  "would continue from. To give up the later steps: ckpt.check_root(root, model, "
                                  "rollback_to=<the step loaded>)")

def _clean(root):  # rank 0, at its first claim: what a run that is gone left (no other run writes here)
    markers = sorted(step for kind, step in map(_entry, os.listdir(root)) if kind == "rollback")
    if markers:  # a rollback cut short: finish it
        _roll_back(root, markers[0])
    for name in os.listdir(root):
        (kind, step), path = _entry(name), os.path.join(root, name)
        if kind == "replaced" and not os.path.isdir(step_dir(root, step)):
            os.rename(path, step_dir(root, step))  # killed between a save's two renames: the older copy is step N
            fsync_dir(root)
            log.warning("%s is step %d again: a save of that step was interrupted", step_dir(root, step), step)
        elif kind in ("tmp", "replaced"):
            shutil.rmtree(path, ignore_errors=True)
            log.warning("removed %s, left by an interrupted save", path)

def _lock(root, lock):
    """An exclusive flock on root's .owner.json, which the kernel (or NFS's lock manager) releases once every
    process holding the file open is gone: no pid or age is guessed at. The file names the run that holds it."""
    if not os.path.isdir(root):
        log.info("making %s, a new checkpoint root", root)
    os.makedirs(root, exist_ok=True)
    owner = os.open(os.path.join(root, OWNER), os.O_RDWR | os.O_CREAT, 0o644)
    try:  # relies on the file system's locks (NFS with locking, Lustre -o flock); one of two takers at once wins
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        how = "nothing holds its lock, so that run is gone"
    except OSError as e:
        if lock or e.errno not in NO_FLOCK:  # lock=False goes on where flock() is missing, not where it is held
            holder = os.read(owner, 4096).decode(errors="replace") or "(it is starting)"
            os.close(owner)
            if isinstance(e, BlockingIOError):
                raise CheckpointError(f"{root} is in use by another run, which holds the lock on {OWNER}: {holder}. "
                                      "Stop it or use another root (load() takes no claim: an evaluation job can "
                                      "read it).") from None
            if e.errno not in NO_FLOCK:
                raise
            raise CheckpointError(f"{root}: its file system refuses flock() ({e.strerror}), which keeps a second run "
                                  "from writing here. Lustre: mount with -o flock (-o localflock locks within one "
                                  "node only); NFS: run its lock manager. If your scheduler runs one job per root, "
                                  "say so: ckpt.check_root(root, model, lock=False) (then nothing stops a second run "
                                  "from deleting this one's saves)") from None
        how = "its file system has no flock(), and lock=False says that no other run writes here"
    previous = os.read(owner, 4096).decode(errors="replace")
    if previous:
        log.warning("taking over %s from %s: %s", root, previous, how)
    me = {"host": os.uname().nodename, "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
          "started": datetime.datetime.now().isoformat(timespec="seconds")}
    os.ftruncate(owner, 0)
    os.pwrite(owner, json.dumps(me).encode(), 0)  # says who holds the lock, to the runs it refuses
    return owner

def _release(root):  # rank 0: this run no longer writes to root
    owner = _locks.pop(root)
    os.ftruncate(owner, 0)  # a run that ended: the next one has nobody to take over from
    os.close(owner)  # releases the lock

def _release_in_child():  # after os.fork(), in the child: its copy of the lock's file would keep the lock held
    for owner in _locks.values():
        os.close(owner)
    _locks.clear()

# ---- save, steps 4-6: write, commit, retain ----

Commit = collections.namedtuple("Commit", "root step tmp manifest group keep")

def _write_and_commit(flat, c, planner=None):  # steps 4-6 on every rank; appendix A runs it in a thread
    try:
        files, error = _attempt(_write, flat, c.tmp, c.group, planner)
        mine = {_rank(): (files, None if error is None else _describe(error, only_mine=True))}
        written = _vote(c.group, f"save of step {c.step}: writing", claims=mine)  # each rank's files, or its failure
        path = _rank0(c.group, f"save of step {c.step}", _commit, c, written)
    except CheckpointError:  # a rank failed or was lost: rank 0 removes what it did not commit
        if _rank() == 0:
            shutil.rmtree(c.tmp, ignore_errors=True)
        raise
    log.info("checkpoint %s committed", path)
    return path

def _write(flat, tmp, group, planner):  # step 4: DCP writes every rank's files; this rank CRCs its own
    writer = dcp.FileSystemWriter(tmp, sync_files=True)  # fsync: "committed" must mean "on disk"
    # flatten off: our keys are flat already, and DCP would rebuild a skeleton (its keys into str, empty dicts gone)
    planner = planner or dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    _dcp(dcp.save, flat, storage_writer=writer, planner=planner, process_group=group)
    names = _my_files(os.listdir(tmp))
    crcs = chunk_crcs([os.path.join(tmp, name) for name in names])  # from the page cache, not DCP's stream
    return {name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "crc32": crc} for name, crc in zip(names, crcs)}

def _commit(c, written):  # steps 5-6, rank 0; written: {rank: (its files, or None; its failure, or None)}
    try:
        failed = [f"rank {r}: {message}" for r, (_, message) in sorted(written.items()) if message]  # "": another's
        if any(message is not None for _, message in written.values()):
            raise CheckpointError(f"writing failed on {len(failed)} rank(s): {'; '.join(failed)}. Nothing was "
                                  "committed; the previous checkpoint is intact")
        manifest = dict(c.manifest, files={name: entry for files, _ in written.values()
                                           for name, entry in files.items()})
        with open(os.path.join(c.tmp, MANIFEST), "w") as f:
            json.dump(dict(manifest, crc32=_manifest_crc(manifest)), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename points at it
        fsync_dir(c.tmp)  # and the directory's entries
        final = step_dir(c.root, c.step)
        replaced = _unique(c.root, REPLACED, c.step) if os.path.isdir(final) else None
        if replaced:  # step N saved again: until the new copy takes its name, the old one is step N under this name
            os.rename(final, replaced)
        try:
            os.rename(c.tmp, final)  # atomic: the checkpoint appears whole or not at all
        except OSError:
            if replaced:  # this run goes on: its step N is the older copy again
                os.rename(replaced, final)
            raise
    finally:  # not committed: removed before any rank hears of the failure, to free the space (a full disk)
        if os.path.isdir(c.tmp):
            shutil.rmtree(c.tmp, ignore_errors=True)
    try:  # the commit stands from here: a later failure is logged, and the next save keeps this step
        fsync_dir(c.root)  # without this, a power cut can undo the renames
    except OSError as e:
        log.warning("step %d is committed, but the fsync of %s failed (a power cut may undo it): %s", c.step, c.root, e)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)
    _retain(c.root, c.keep)
    return final

def _retain(root, keep):  # step 6, rank 0: a failure is logged, the commit stands
    old = []
    try:  # out of load()'s sight first, durably: a crash or a power cut mid-delete leaves .tmp- directories
        old = sorted(_steps(root).items())[: -keep] if keep else []
        trash = [_unique(root, f"{TMP}delete-", step) for step, _ in old]
        for (_, name), path in zip(old, trash):
            os.rename(os.path.join(root, name), path)
        if old:
            fsync_dir(root)
        for path in trash:
            shutil.rmtree(path)
    except OSError as e:
        log.warning("retention: could not remove %s: %s", ", ".join(name for _, name in old), e)

# ---- load, step by step ----

def _instead(ckpt_dir):  # what to load instead of a checkpoint that is damaged or gone
    root = os.path.dirname(ckpt_dir)
    others = [os.path.join(root, name) for _, name in sorted(_steps(root).items())
              if name != os.path.basename(ckpt_dir)]
    gone = "" if os.path.isdir(ckpt_dir) else f" {ckpt_dir} does not exist (removed by another run's retention?)."
    return gone + (f" The newest other commit is {others[-1]}: pass it to load it." if others else "")

# The checkpoint being loaded; crcs: a Future of the CRC errors of this rank's files, checked beside the reads.
Checkpoint = collections.namedtuple("Checkpoint", "dir step world_size metadata crcs verify")

def _open(ckpt_dir, optimizers, verify, pool):  # step 2, on every rank
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:  # a foreign directory is not a damaged one, nor is one that is gone
        damaged = _entry(os.path.basename(ckpt_dir))[0] and os.path.isdir(ckpt_dir)
        what = "a damaged checkpoint" if damaged else ckpt_dir
        raise CheckpointError(f"refusing to load {what}: {e}.{_instead(ckpt_dir)}") from None
    mine = _my_files(manifest["files"])
    sizes = verify_files(ckpt_dir, manifest, mine, False)  # this rank's files; .metadata whole before it is unpickled
    _refuse(ckpt_dir, sizes + verify_files(ckpt_dir, manifest, [".metadata"]))  # verify=False too: it is small
    try:
        metadata = read_metadata(ckpt_dir)
    except CheckpointError as e:  # removed by another run's retention since (_instead() says so), or too new
        raise CheckpointError(f"{e} (torch {manifest['torch_version']} saved it).{_instead(ckpt_dir)}") from None
    for info in (metadata.storage_data or {}).values():  # the files DCP will open: this checkpoint's only
        if getattr(info, "relative_path", None) not in manifest["files"]:
            raise CheckpointError(f"{ckpt_dir}/.metadata names {getattr(info, 'relative_path', info)!r}, not a file "
                                  "its manifest lists: refusing to read it")
    kinds = [type(o).__name__ for o in optimizers]
    if optimizers and manifest["optimizers"] != kinds:
        raise CheckpointError(f"{ckpt_dir} was saved with optimizers {manifest['optimizers']}, not {kinds}: pass "
                              "the same ones, in the same order (to load the weights alone, pass optimizer=None)")
    crcs = pool.submit(verify_files, ckpt_dir, manifest, mine)  # ahead of DCP, which reads from the cache
    return Checkpoint(ckpt_dir, manifest["step"], manifest["world_size"], metadata, crcs, verify)

def _refuse(ckpt_dir, damage):  # damage: the errors verify_files() found
    if damage:
        raise CheckpointError(f"refusing to load a damaged checkpoint: {'; '.join(damage)}.{_instead(ckpt_dir)}")

def _small_keys(ckpt, objects):  # the pickled values this rank reads first: each extra's, its optimizers'
    prefixes = tuple(f"{key}.groups." for key, obj in objects.items() if isinstance(obj, torch.optim.Optimizer))
    mine = [key for key in objects if ckpt.world_size == _world_size() or not key.startswith("rank.")]
    return [key for key, md in ckpt.metadata.state_dict_metadata.items()  # every stage's: they are small
            if not hasattr(md, "size") and (key in mine or key.startswith(prefixes))]

def _read(ckpt, request, group):  # steps 3-4: dcp.load(), which raises a failure on every rank
    try:
        _dcp(dcp.load, request, storage_reader=SafeReader(ckpt.dir, ckpt.metadata), planner=SafeLoadPlanner(),
             process_group=group)
    except FAILURES as e:
        _each(group, f"load: reading {ckpt.dir}", _damage_or, ckpt, e)
    return request

def _damage_or(ckpt, error):  # a failed read: the damage behind it if this rank's CRCs found some, else why
    _refuse(ckpt.dir, ckpt.crcs.result())
    mine = _describe(error, only_mine=True)  # "": another rank's failure, which that rank names
    raise CheckpointError(mine and f"{mine}.{_instead(ckpt.dir)}")

def _match(ckpt, small, model, objects, strict):  # step 3, on every rank: what it refuses, nothing was read for
    """(request: {key: what dcp.load() reads into}, {key: (an object, the Skeleton of what it loads)})."""
    def layout(v):  # a model value's, here or saved
        return (f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else
                f"{v.properties.dtype} {tuple(v.size)}" if hasattr(v, "size") else "no tensor")
    saved = ckpt.metadata.state_dict_metadata
    model_sd = get_model_state_dict(model)
    def fits(key, v):  # strict=False leaves what the checkpoint lacks or holds in another layout (a resized head)
        return strict or (key in saved and layout(saved[key]) == layout(v))
    request = {f"model.{k}": v for k, v in model_sd.items() if fits(f"model.{k}", v)}
    left = [f"model.{k}" for k in model_sd if f"model.{k}" not in request]
    missing = [key for key in request if key not in saved]
    other = [f"{key}: {layout(saved[key])} saved, {layout(v)} here" for key, v in request.items()
             if key in saved and layout(saved[key]) != layout(v)]
    if missing or other:  # strict only
        raise CheckpointError(f"checkpoint {ckpt.dir} does not match the model: {len(missing)} key(s) missing from "
                              f"the checkpoint {missing[:10]}; {len(other)} key(s) of another dtype or shape "
                              f"{other[:10]} (a fine-tune's new or resized layers: strict=False)")
    names = _param_names(model, model_sd)
    params = {fqn: param for param, fqns in names.items() for fqn in fqns}
    resized = ckpt.world_size != _world_size()
    loaded = {}
    for key, obj in objects.items():
        if key.startswith("rank.") and resized:  # a generator is left as seeded (rank 0 says so); the rest refused
            if ".rng." in key:
                continue
            raise CheckpointError(f"extra {key.split('.', 3)[3]!r} is per rank, saved at world size {ckpt.world_size}, "
                                  f"not {_world_size()}: resume at that size, or leave it out of load() and rebuild it")
        obj = OptimizerByName(obj, names) if isinstance(obj, torch.optim.Optimizer) else obj
        live, like = {}, {}  # the object's own tensors, read into in place (no second copy); optimizer state's layout
        _walk(obj.state_dict(), lambda path, value: live.setdefault(path, value), key)
        if isinstance(obj, OptimizerByName):
            skeleton = obj.saved(key, [v for k, v in small.items() if k.startswith(f"{key}.groups.")])
            for fqn, state in skeleton.value["state"].items():  # laid out like its parameter
                _walk(state, lambda path, x: like.setdefault(path, params[fqn]), f"{key}.state.{fqn}")
        elif key in small:
            skeleton = Skeleton(small[key]["state"], small[key]["tensors"], key)
        elif key in saved:  # its state is one tensor (rng.torch)
            skeleton = Skeleton(None, {key: "Tensor"}, key)
        elif ".rng." in key:  # a generator saved without CUDA or with rng=False: left as it is
            continue
        elif not strict:
            left.append(key)
            continue
        else:
            raise CheckpointError(f"{_objects_in([key])[0]} is not in {ckpt.dir}, which holds {_objects_in(saved)}")
        for path, kind in skeleton.tensors.items():
            here = live.get(path)  # an extra's own tensor is read in place: nobody casts it (torch casts optimizers')
            unlike = isinstance(here, torch.Tensor) and layout(here) != layout(saved[path])
            if unlike and not isinstance(obj, OptimizerByName):
                raise CheckpointError(f"checkpoint {ckpt.dir} does not match extra {key}: {path} is "
                                      f"{layout(saved[path])} saved, {layout(here)} here (an extra loads as saved)")
            if kind == "DTensor" and not isinstance(live.get(path, like.get(path)), torch.Tensor) and _world_size() > 1:
                raise CheckpointError(f"{path} was saved as a DTensor, and the object held no tensor there to shard it "
                                      "like: give it its tensors before load() (an EMA's shadows from the parameters)")
            request[path] = _empty_like(saved[path], live.get(path), like.get(path))
        loaded[key] = (obj, skeleton)
    if left:
        log.warning("not in %s, or in another layout: left as they are (strict=False): %s", ckpt.dir,
                    ", ".join(sorted(left)))
    return request, loaded

def _check_covered(group, ckpt, read, strict, resuming):  # every model key some rank's (a pipeline stage reads its)
    keys = sorted(ckpt.metadata.state_dict_metadata)
    some = torch.tensor([key in read for key in keys], dtype=torch.uint8)  # one all-reduce of a byte per key
    if group is not None:
        _collective("load: which keys some rank reads", dist.all_reduce, some, op=dist.ReduceOp.MAX, group=group)
    left = [key for key, read in zip(keys, some.tolist()) if not read]
    lost = [key for key in left if key.startswith("model.")]
    if lost and strict:
        raise CheckpointError(f"checkpoint {ckpt.dir} does not match the model: {len(lost)} key(s) not in the model: "
                              f"{lost[:10]} (to load what the model has: strict=False)")
    seeded = f"(per rank, saved at world size {ckpt.world_size}: left as this process seeded it)"
    left = [name.replace("(per rank)", seeded) if ".rng." in name else f"{name} (not passed to load())"  # resized
            for name in (_objects_in(left) if resuming else [])]  # a weights-only load leaves them by design
    for what, keys in (("in %s but not in the model (strict=False): %s", lost), ("not restored from %s: %s", left)):
        if keys and _rank() == 0:
            log.warning(what, ckpt.dir, ", ".join(keys))

def _objects_in(keys):  # the optimizers and extras that keys belong to: optim.<i>, extra.<name> (per rank)
    found = [re.match(r"(rank\.\d+\.)?(optim\.\d+|extra\.rng\.\w+|extra\.[^.]+)", key) for key in keys]
    return sorted({m[2] + (" (per rank)" if m[1] else "") for m in found if m})

def _empty_like(saved, live, like):  # what a tensor is read into: the object's own (live) if alike, read in place;
    # else one laid out as it or as like (the parameter whose state it is; DCP reshards); else plain, on its device
    size, dtype = tuple(saved.size), saved.properties.dtype
    if isinstance(live, torch.Tensor) and tuple(live.shape) == size and live.dtype == dtype:
        return live
    layout = live if isinstance(live, torch.Tensor) else like
    if isinstance(layout, DTensor) and tuple(layout.shape) == size:
        return torch.distributed.tensor.empty(size, dtype=dtype, device_mesh=layout.device_mesh,
                                              placements=layout.placements)
    return torch.empty(size, dtype=dtype, device=live.device if isinstance(live, torch.Tensor) else "cpu")

def _restore(ckpt, request, loaded, model, strict):  # step 5, on every rank, after dcp.load(); user code runs
    damage = ckpt.crcs.result()  # this rank's files, read beside DCP: a damaged one stops the load before any
    # load_state_dict() (the shards were read in place already: the model is refused by save() until a load works)
    _refuse(ckpt.dir, damage if ckpt.verify else [])
    model_sd = {key.removeprefix("model."): value for key, value in request.items() if key.startswith("model.")}
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
    for obj, skeleton in loaded.values():  # each tensor read, put back where it was
        obj.load_state_dict(_walk(skeleton.value, lambda path, x: request[path] if path in skeleton.tensors
                                  else x, skeleton.base))

def _param_names(model, model_sd):
    """{parameter: its keys in get_model_state_dict()}: those whose value is the parameter's own memory
    (Tensor.is_set_to), whatever a wrapper (DDP, torch.compile, activation checkpointing) adds to its name."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t
    at = collections.defaultdict(list)
    for key, value in model_sd.items():  # a tensor or a DTensor (FSDP1's ShardedTensor holds no memory of its own)
        if isinstance(value, DTensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
            at[local(value).data_ptr()].append(key)
    names = {}
    for name, param in model.named_parameters():
        names[param] = [key for key in at[local(param).data_ptr()] if local(model_sd[key]).is_set_to(local(param))]
        if not names[param]:
            raise CheckpointError(f"parameter {name} is the value of no key of get_model_state_dict(model): FSDP1 "
                                  "(FullyShardedDataParallel) keeps flat parameters; shard with fully_shard (FSDP2)")
    return names

# ---- files: the root's names, checksums, manifests ----

def step_dir(root, step):
    return os.path.join(root, f"step-{step:08d}")

def _unique(root, prefix, step):
    return os.path.join(root, f"{prefix}step-{step:08d}-{os.urandom(4).hex()}")

def _entry(name):  # (kind, step) of a name under a root, by ENTRIES; (None, None) for any other name
    found = [(kind, re.fullmatch(pattern, name)) for kind, pattern in ENTRIES.items()]
    return next(((kind, int(m[1])) for kind, m in found if m), (None, None))

def _steps(root):  # {step: the name of its commit}: step-N, else .replaced-step-N-<id>; none above .rollback-to-N
    entries = [(*_entry(name), name) for name in (os.listdir(root) if os.path.isdir(root) else [])]
    limit = min([step for kind, step, _ in entries if kind == "rollback"], default=math.inf)
    steps = {step: name for kind, step, name in entries if kind == "replaced"}
    steps.update({step: name for kind, step, name in entries if kind == "commit"})  # step-N wins
    return {step: name for step, name in steps.items() if step <= limit}

def committed_steps(root):  # the steps load() may choose under root, in order (it refuses a damaged one by name)
    return sorted(_steps(root))

def find_checkpoint(path):
    """The checkpoint load() reads: path, if it is one (named as a step, or holding a manifest or DCP's .metadata);
    else the highest commit under path; None if there is none."""
    kind, _ = _entry(os.path.basename(os.path.normpath(path)))
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file: pass a checkpoint's directory (step-N) or a root")
    if kind == "tmp":
        raise CheckpointError(f"{path} is an uncommitted save (interrupted, or in progress): it is never loaded")
    if kind or any(os.path.exists(os.path.join(path, name)) for name in (MANIFEST, ".metadata")):
        return path
    steps = _steps(path)
    return os.path.join(path, steps[max(steps)]) if steps else None

def _my_files(names):  # the files this rank checks: the first number in a name modulo the world size (__r_0.distcp)
    return sorted(name for name in names if int((re.findall(r"\d+", name) or [0])[0]) % _world_size() == _rank())

def chunk_crcs(paths):
    """[the CRC-32s of each file's 64 MiB chunks], in parallel threads (zlib releases the GIL): at the disk's speed,
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

def verify_files(ckpt_dir, manifest, names=None, checksums=True):  # the errors in the files' sizes (and CRCs)
    names = sorted(manifest["files"]) if names is None else names
    paths = [os.path.join(ckpt_dir, name) for name in names]
    sizes = [os.path.getsize(path) if os.path.isfile(path) else None for path in paths]
    errors = [f"{path} is missing" if size is None else f"{path} has {size} bytes, the manifest says "
              f"{manifest['files'][name]['bytes']} (truncated?)" for name, path, size in zip(names, paths, sizes)
              if size != manifest["files"][name]["bytes"]]
    if errors or not checksums:
        return errors
    try:
        crcs = chunk_crcs(paths)
    except OSError as e:  # removed while read (another run's retention), or a read error (no file named: its dir)
        return [f"{e.filename or ckpt_dir} cannot be read: {e.strerror or e}"]
    return [f"{path} does not match its checksum (corrupted)" for name, path, crc in zip(names, paths, crcs)
            if crc != manifest["files"][name]["crc32"]]

def read_manifest(ckpt_dir):
    """manifest.json, checked against its own CRC and its directory's step before anything it lists is trusted."""
    path = os.path.join(ckpt_dir, MANIFEST)
    named, step = _entry(os.path.basename(os.path.normpath(ckpt_dir)))
    if not named and not os.path.exists(path) and os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        raise CheckpointError(f"it holds DCP's .metadata but no {MANIFEST}, so ckpt.save() did not write it: read it "
                              "with dcp.load() (and save it with ckpt.save() to load it here)")
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
    if step is not None and step != manifest["step"]:
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
# Three are private to torch (_StorageInfo, _MEM_FORMAT_ENCODING, _get_layout): DCP's own metadata holds them.
METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device"}, "pathlib": {"PosixPath"}, "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"}}

class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype_or_layout = module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        if not dtype_or_layout and name not in METADATA_TYPES.get(module, ()):
            raise pickle.UnpicklingError(f"it names {module}.{name}, which is not among the types of DCP's metadata "
                                         f"that this ckpt.py knows (torch {torch.__version__} is loading it): if it "
                                         "holds plain data (a newer torch's), add it to METADATA_TYPES")
        return super().find_class(module, name)

def read_metadata(ckpt_dir):  # DCP's .metadata, read without running code from it
    path = os.path.join(ckpt_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            return MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read safely: {e}") from e

class SafeReader(dcp.FileSystemReader):  # DCP's file reader, with the .metadata that read_metadata() unpickled
    def __init__(self, path, metadata):
        super().__init__(path)
        self.safe_metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self.safe_metadata

class SafeLoadPlanner(dcp.DefaultLoadPlanner):  # into the caller's dict by key; values by torch.load(weights_only)
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True, map_location="cpu")

def _dcp(fn, *args, **kwargs):  # dcp.save() or dcp.load(); no group: this process alone (DCP's warning silenced)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, no_dist=kwargs.get("process_group") is None, **kwargs)

# ---- appendix A: background saves. save(async_save=True) reaches them through _save_in_background() alone ----

def prepare_async(model, optimizer=None, extra=None, *, rng=True):
    """Make the host memory of async saves now, in a thread beside the loop (page-locking takes seconds per 5 GB),
    so that the first async save blocks no longer than the later ones. On every rank (not collective), with what
    save() will be given once the optimizers hold state; every ckpt call waits for the PendingSave it returns."""
    wait_pending()  # a copy in flight uses the memory
    return PendingSave(_make_host_memory, _sources(_collect(0, None, model, _as_list(optimizer), extra, rng, None, {})))

def _save_in_background(flat, commit, holders):  # save()'s one call into this appendix
    copy = HostCopy(flat)
    hooks = [opt.register_step_pre_hook(lambda *_: copy.release())  # a step would write what is being copied
             for opt in holders if isinstance(opt, torch.optim.Optimizer)]
    return PendingSave(_copy_and_write, flat, commit, copy, copy=copy, hooks=hooks)

def _copy_and_write(flat, commit, copy):  # the save's thread, on every rank: the copy, then steps 4-6
    try:
        copy.run()
    except Exception as e:  # fails every rank at the write's plan: a rank that left alone would hang the others
        copy.error = copy.error or f"copy to host memory: {_describe(e)}"
    return _write_and_commit(flat, commit, HostPlanner(copy))

class PendingSave:
    """ckpt's work in a thread on this rank: an async save (a copy to host memory, then every rank's write and
    commit) or prepare_async(). wait_copy(): the state may be written again; done(): over here; wait(): the path
    once committed, or its error, which the next ckpt call raises unless wait() did (and the log says at once)."""
    def __init__(self, fn, *args, copy=None, hooks=()):
        self.copy, self.hooks, self.rank = copy, hooks, _rank()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-background")
        self.job = pool.submit(self.run, fn, *args)
        pool.shutdown(wait=False)  # not "with": leaving it would wait for the job
        _pending.append(self)

    def run(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:
            log.error("a background save failed on rank %d: %s", self.rank, _describe(e))
            raise

    def wait_copy(self):
        if self.copy is not None:
            self.copy.release()

    def done(self):
        return self.job.done()

    def wait(self):
        try:
            return self.job.result()
        finally:  # a Ctrl-C while it runs leaves it in flight: the next call waits for it
            if self.job.done() and self in _pending:
                _pending.remove(self)
                for hook in self.hooks:  # here, not in the hook: an optimizer iterates over its hooks
                    hook.remove()

class HostPlanner(dcp.DefaultSavePlanner):  # an async save's: the host copies; a failed copy fails every rank's plan
    def __init__(self, copy):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.copy = copy

    def create_local_plan(self):
        if self.copy.error:
            raise CheckpointError(self.copy.error)
        return super().create_local_plan()

    def lookup_object(self, index):  # the host copy of a tensor (a DTensor's local shard)
        return self.copy.host[index.fqn] if index.fqn in self.copy.host else super().lookup_object(index)

def _sources(flat):  # {key: the tensor copied}: a DTensor's local shard
    with torch.no_grad():  # to_local() of a parameter: no autograd graph
        return {k: v.to_local() if isinstance(v, DTensor) else v.detach() for k, v in flat.items()
                if isinstance(v, torch.Tensor)}

class HostCopy:
    """An async save's tensors copied to host memory beside the loop, into memory made once per layout of the state
    (by prepare_async(), else here); CUDA tensors on a side stream of their device, after the work that made them.
    release() is the wait before a write (an optimizer's step, a ckpt call, PendingSave.wait_copy()): the host waits
    until the copies are queued; on CUDA its stream then waits for them to land, the host does not. A tensor written
    in place while the copy runs (its Tensor._version) fails the save by name: a check blind to writes through .data,
    a DTensor's to_local(), a fused kernel or another stream."""
    def __init__(self, flat):
        self.flat, self.sources, self.host, self.error, self.after = flat, _sources(flat), {}, None, None
        self.versions, self.lock, self.queued = self.read_versions(), threading.Lock(), threading.Event()
        self.device = self.stream = self.ready = self.done = None
        try:  # a failure here fails the copy on every rank, at the write's plan, not save() on this rank alone
            self.device = _cuda_device(self.sources)  # the sources' (not the current one: a loop need not set it)
            if self.device is not None:
                self.stream = torch.cuda.Stream(self.device)
                self.ready = torch.cuda.current_stream(self.device).record_event()  # the work that made the values
                self.done = torch.cuda.Event(blocking=True)  # its waiter sleeps, not spins a core
        except Exception as e:
            self.error = f"copy to host memory: {_describe(e)}"

    def read_versions(self):  # a DTensor's and its shard's: either counts a write in place
        return {k: (self.flat[k]._version, t._version) for k, t in self.sources.items()}

    def copy(self):  # into host memory; CUDA's on the sources' device and our stream (a new thread's is device 0's)
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            self.stream.wait_event(self.ready)
        views = _host_views(self.sources, pinned=self.stream is not None)
        for key, t in self.sources.items():
            views[key].copy_(t, non_blocking=t.is_cuda)  # on the stream of t's device: ours (one device)
            if t.is_cuda:
                t.record_stream(self.stream)  # its memory is not reused until the copy has read it
        self.host = views
        if self.stream is not None:
            self.done.record(self.stream)

    def run(self):  # in the save's thread: the copy, then the check that nothing was written meanwhile
        try:
            if self.error is None:
                self.copy()
        except Exception as e:
            self.error = f"copy to host memory: {_describe(e)}"
            if self.stream is not None:  # what was queued lands before its memory is reused or freed
                self.stream.synchronize()
        finally:
            self.queued.set()
        try:
            if self.done is not None and self.error is None:
                self.done.synchronize()  # this thread waits for the device, not the loop
        finally:
            self.settle()
        changed = [k for k, v in self.after.items() if v != self.versions[k]]
        if changed and self.error is None:
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            self.error = (f"{changed[:5]}{more} were written in place while being copied to host memory (an EMA "
                          "update, a weight edit, a buffer in forward()): call pending.wait_copy() before writing them")

    def settle(self):  # the versions once the copy is over: a write counted before then raced it, later ones follow
        with self.lock:
            if self.after is None:
                self.after = self.read_versions()

    def release(self):
        self.queued.wait()
        if self.done is not None and self.error is None:
            torch.cuda.current_stream(self.device).wait_event(self.done)  # what it runs next runs after the copy
        self.settle()

def _cuda_device(sources):  # the one CUDA device of the tensors copied, or None
    devices = {t.device for t in sources.values() if t.is_cuda}
    if len(devices) > 1:  # the copies from another device would run on its stream, unordered with ours
        raise CheckpointError(f"an async save copies from one CUDA device per rank, not {sorted(map(str, devices))}")
    return devices.pop() if devices else None

def _host_views(sources, pinned):
    """One host allocation for the whole state, made for its layout and reused while it holds: a tensor by key, each
    its own slice of the storage (DCP would copy a view of a larger one). With CUDA, page-locked by cudaHostRegister:
    the pinned-memory allocator would round each tensor up to a power of two and keep the memory after close()."""
    layout = {key: (t.shape, t.dtype, pinned) for key, t in sources.items()}
    if _cache.get("layout") != layout:
        _cache.clear()  # the old one is unregistered now (no copy is in flight), freed with its last tensor
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
        _cache.update(layout=layout, memory=memory, views=views)
    return _cache["views"]

def _page_lock(memory):  # so that the device copies into it beside the loop; unlocked when the tensor is freed
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(memory.data_ptr(), memory.numel(), 1))  # 1: cudaHostRegisterPortable
    if error:
        raise RuntimeError(f"cudaHostRegister of {memory.numel()} bytes of host memory failed: cudaError {error}")
    weakref.finalize(memory, cudart.cudaHostUnregister, memory.data_ptr())

def _make_host_memory(sources):  # prepare_async()'s thread
    try:
        device = _cuda_device(sources)
        if device is not None:
            torch.cuda.set_device(device)  # a new thread's is device 0, where another rank's GPU would get a context
        _host_views(sources, pinned=device is not None)
    except Exception as e:  # the first save makes them, or fails naming why
        log.warning("prepare_async(): making the host memory failed: %s", _describe(e))

# ---- appendix B: the resume glue a loop needs beside save() and load(): the data's place, preemption ----

class Position:
    """The data's place as global samples: the epoch, and the samples handed out in it. Stored once, it holds at any
    world size. global_batch: the samples one optimizer step consumes, batch x accumulation x data-parallel degree
    (pipeline stages and tensor-parallel ranks read the same samples: not counted). stream: what else defines the
    samples (a seed, a sequence length). A resume that changes any of them is refused by name."""
    def __init__(self, global_batch, **stream):
        self.epoch, self.samples, self.stream = 0, 0, {"global_batch": global_batch, **stream}

    def state_dict(self):
        return {"epoch": self.epoch, "samples": self.samples, **self.stream}

    def load_state_dict(self, sd):
        saved = {k: v for k, v in sd.items() if k not in ("epoch", "samples")}
        changed = [f"{k} {saved.get(k)!r} saved, {self.stream.get(k)!r} now" for k in sorted({*saved, *self.stream})
                   if saved.get(k) != self.stream.get(k)]
        if changed:  # 4 ranks resumed on 2 at the same accumulation, say: other samples than the run it continues
            raise ValueError(f"this resume changes the data stream ({'; '.join(changed)}): keep them (global batch: "
                             "batch x accumulation x data-parallel degree)")
        self.epoch, self.samples = sd["epoch"], sd["samples"]

    def batches(self, loader):
        """loader's batches, epoch after epoch from this position (its sampler a SkippingSampler), counted."""
        per_batch = (loader.batch_size or 0) * loader.sampler.num_replicas  # the global samples of one batch
        if not per_batch or self.stream["global_batch"] % per_batch:  # else steps would read across ranks' batches
            raise ValueError(f"global_batch {self.stream['global_batch']} is not a whole number of batches of "
                             f"{loader.batch_size} x {loader.sampler.num_replicas} ranks: make it one")
        while True:
            loader.sampler.set_epoch(self.epoch)
            loader.sampler.start = self.samples  # where the epoch resumes, whatever a StatefulDataLoader restored
            for batch in loader:
                self.samples += per_batch
                yield batch
            self.epoch, self.samples = self.epoch + 1, 0

class SkippingSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler's order from global sample `start` of the epoch on: its permutation, padded or cut as it
    does for today's world size, strided over the ranks, so the first k global samples are the same at any size.
    Its state is Position's: a StatefulDataLoader restores its workers, and `start` decides where the epoch goes on."""
    start = 0

    def __iter__(self):
        if self.start % self.num_replicas:  # else the ranks would read different numbers of batches, and hang
            raise ValueError(f"SkippingSampler: start {self.start} is not a multiple of the {self.num_replicas} ranks")
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

# ---- appendix C: rollback. check_root(rollback_to=N) and the claim that finds one cut short call _roll_back() ----

def _roll_back(root, step):  # every step after `step` moved aside, durably; the marker first
    with open(os.path.join(root, f"{ROLLBACK}{step:08d}"), "w"):
        pass
    fsync_dir(root)  # from here, load() never chooses a given-up step (_steps()); the next claim finishes a crashed one
    for name in sorted(os.listdir(root)):
        kind, s = _entry(name)
        if kind in ("commit", "replaced") and s > step:
            aside = _unique(root, ABANDONED, s)
            os.rename(os.path.join(root, name), aside)
            log.warning("moved aside %s as %s: given up by a rollback to step %d", name, os.path.basename(aside), step)
    fsync_dir(root)
    for name in os.listdir(root):
        if _entry(name)[0] == "rollback":
            os.remove(os.path.join(root, name))
    fsync_dir(root)  # a marker back after a power cut would hide this run's own later commits
