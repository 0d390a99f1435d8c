"""Count the bytes this process sends and receives through torch.distributed collectives (benchmarks only).

    import comm_count
    comm_count.install()              # once, after init_process_group; wraps torch.distributed's functions
    with comm_count.counting() as c:  # everything this process sends and receives inside the block
        ckpt.save(...)
    c["sent"], c["recv"], c["calls"]  # bytes, bytes, Counter of the outermost calls ("all_gather_object": 3, ...)
    with comm_count.label("dcp"):     # bytes sent inside the block (this thread) also add up under c["dcp sent"], ...
        dcp.save(...)

The functions are replaced on both torch.distributed and torch.distributed.distributed_c10d, so callers that
look them up at call time (ckpt.py's `dist.x(...)`, DCP's `dist.x(...)`) are counted, and so are the tensor
collectives that the object collectives call inside distributed_c10d: bytes are counted once, at the tensor
level (gather_object is an all_gather of sizes plus a gather of pickles padded to the largest, and both show).
Nothing in ckpt.py or torch is edited; a caller that bound a function at import time would escape the count.

Bytes are the payload a rank must send or receive under a direct exchange, whatever the backend's algorithm,
for a group of W ranks and a tensor of n bytes (the per-rank input; for all_gather every rank's is the same):
    all_gather, all_gather_into_tensor   sent (W-1)n, received (W-1)n  (every rank ends with every rank's data)
    gather, reduce                       sent n by every rank but the root, which receives (W-1)n
    broadcast, scatter                   the root sends (W-1)n, every other rank receives n
    all_reduce                           sent 2(W-1)/W n, received the same (a ring: reduce-scatter + all-gather)
    reduce_scatter(_tensor)              sent (W-1)/W n_in, received the same
    all_to_all(_single)                  what leaves for / arrives from the other ranks
    send/isend, recv/irecv               n
    barrier, monitored_barrier           0 bytes (counted as calls)
A tree or ring moves the root's (W-1)n of broadcast/gather through other ranks instead, changing constants, not
whether a non-root rank's traffic grows with W.
"""

import collections
import contextlib
import inspect
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TENSOR_OPS = ("all_gather", "all_gather_into_tensor", "gather", "broadcast", "all_reduce", "reduce", "scatter",
              "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
              "monitored_barrier", "send", "recv", "isend", "irecv")
OBJECT_OPS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
              "send_object_list", "recv_object_list")

_lock = threading.Lock()
_local = threading.local()  # depth of nested calls; label of the bytes (per thread: a background save has its own)
_counter = None  # the dict being filled, or None when not counting


def _nbytes(t):
    if t is None:
        return 0
    if isinstance(t, (list, tuple)):
        return sum(map(_nbytes, t))
    return t.numel() * t.element_size()


def _is_root(a, group, rank_key, group_key):
    """Whether this rank is the src/dst of a rooted collective (global rank, group rank, or default 0)."""
    if a.get(group_key) is not None:
        return dist.get_rank(group) == a[group_key]
    if a.get(rank_key) is not None:
        return dist.get_rank() == a[rank_key]
    return dist.get_rank(group) == 0


def _bytes(name, a):
    """(sent, received) by this rank for one tensor-level call, a = its bound arguments."""
    group = a.get("group")
    w = dist.get_world_size(group)
    if name == "all_gather":
        n = _nbytes(a["tensor"])
        return (w - 1) * n, (w - 1) * n
    if name == "all_gather_into_tensor":
        n = _nbytes(a["input_tensor"])
        return (w - 1) * n, (w - 1) * n
    if name in ("gather", "reduce"):
        n = _nbytes(a["tensor"])
        return (0, (w - 1) * n) if _is_root(a, group, "dst", "group_dst") else (n, 0)
    if name in ("broadcast", "scatter"):
        n = _nbytes(a["tensor"])
        return ((w - 1) * n, 0) if _is_root(a, group, "src", "group_src") else (0, n)
    if name == "all_reduce":
        n = 2 * (w - 1) * _nbytes(a["tensor"]) // w
        return n, n
    if name in ("reduce_scatter", "reduce_scatter_tensor"):
        n = (w - 1) * _nbytes(a.get("input_list", a.get("input"))) // w
        return n, n
    if name == "all_to_all":
        me = dist.get_rank(group)
        return (sum(_nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != me),
                sum(_nbytes(t) for i, t in enumerate(a["output_tensor_list"]) if i != me))
    if name == "all_to_all_single":
        n = (w - 1) * _nbytes(a["input"]) // w
        return n, (w - 1) * _nbytes(a["output"]) // w
    if name in ("send", "isend"):
        return _nbytes(a["tensor"]), 0
    if name in ("recv", "irecv"):
        return 0, _nbytes(a["tensor"])
    return 0, 0  # barriers


def _wrap(name, fn):
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        counter = _counter
        if counter is None:
            return fn(*args, **kwargs)
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            with _lock:
                if depth == 0:
                    counter["calls"][name] += 1
                if name in TENSOR_OPS:
                    bound = sig.bind(*args, **kwargs)
                    sent, recv = _bytes(name, bound.arguments)
                    counter["sent"] += sent
                    counter["recv"] += recv
                    label = getattr(_local, "label", None)
                    if label:
                        counter[f"{label} sent"] += sent
                        counter[f"{label} recv"] += recv
            return fn(*args, **kwargs)
        finally:
            _local.depth = depth

    wrapper.__wrapped__ = fn
    return wrapper


def install():
    """Replace the collectives on torch.distributed and distributed_c10d with counting wrappers (idempotent)."""
    for name in TENSOR_OPS + OBJECT_OPS:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "_counting", False):
            continue
        w = _wrap(name, fn)
        w._counting = True
        setattr(c10d, name, w)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, w)


@contextlib.contextmanager
def label(name):
    """Bytes this thread sends and receives inside the block also count under "<name> sent" / "<name> recv"."""
    outer = getattr(_local, "label", None)
    _local.label = name
    try:
        yield
    finally:
        _local.label = outer


@contextlib.contextmanager
def counting():
    """Count this process's collective traffic inside the block; yields {"sent", "recv", "calls", ...}."""
    global _counter
    c = collections.defaultdict(int, calls=collections.Counter())
    _counter = c
    try:
        yield c
    finally:
        _counter = None
