"""Stream a sharded checkpoint into Hugging Face safetensors: one CPU process, memory of a few read groups.

    python consolidate.py checkpoints out/                          # the newest committed checkpoint under checkpoints/
    python consolidate.py checkpoints/step-00000200 out/ --dtype bf16 --max-shard-size 2GB
    python consolidate.py checkpoints out/ --overwrite              # replace out/ once the new one is complete

Output, the layout `transformers` and `train_fsdp.py --init-from out/` read:
    out/
      config.json                          the manifest's meta["model_config"], torch_dtype set to --dtype
      model.safetensors                    when everything fits in --max-shard-size; otherwise
      model-00001-of-00003.safetensors     ... one file per shard, and
      model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}

Only model weights: the DCP key "model.<name>" is written as "<name>" (model.embed_tokens.weight,
lm_head.weight, ...); optimizer, extra and RNG entries are left out.

Steps:
  1. Find. CKPT is a committed checkpoint or a checkpoint root (then its newest committed one, as
     ckpt.load would choose). A .tmp- directory or a step directory without manifest.json is refused.
  2. Check, before anything is written: the manifest's own digest, the size of every file it lists, and
     the checksum of DCP's .metadata, which is then read by ckpt.read_metadata (a restricted unpickler: no
     code from the checkpoint runs).
  3. Plan. Names, shapes and dtypes come from .metadata. Tensors are packed greedily, in checkpoint order,
     into files of at most --max-shard-size, so every file's safetensors header is known before a tensor is read.
  4. Stream. Each file's tensors are read in groups of at most READ_GROUP bytes, by dcp.load(no_dist=True)
     into freshly allocated full-size tensors, in READERS threads; the main thread writes them in order and
     frees them. Peak memory is IN_FLIGHT bytes of groups (or one tensor, if larger) plus torch itself,
     whatever the model's size.
     Reads go through ckpt.SafeReader, which checks every block it reads against the manifest's checksums
     before the bytes are used: exactly what is exported is read and verified, and optimizer state, 2/3 of
     a checkpoint, is neither read nor checked (--no-checksum: sizes only; a truncated shard is still caught).
     The written bytes go to the disk in the background (fdatasync every SYNC_EVERY bytes), while reading goes on.
  5. Commit. Everything goes into a temporary directory beside OUT; each file is fsynced and re-opened with
     safetensors.safe_open to check its names and shapes; then the directory is renamed to OUT. OUT may not
     be inside the checkpoint root: ckpt.py refuses a root that holds anything but checkpoints.

Why not safetensors.torch.save_file: it takes a whole file's tensors at once (memory = the file, and it
needs numpy). The format is three parts (8-byte header length, JSON header, raw little-endian bytes), so
we write it tensor by tensor and let the safetensors library check the result.

Tied weights (e.g. lm_head.weight sharing embed_tokens.weight): every name is read into its own buffer from
its own DCP entry, so no two written tensors share memory (safetensors refuses those) and a tied pair is
simply written twice; transformers re-ties it on load when config.json says tie_word_embeddings.
"""

import argparse
import collections
import concurrent.futures
import ctypes
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import ckpt

READ_GROUP = 64 * 2**20  # bytes per dcp.load call; larger amortizes DCP's planning and the blocks two groups share
IN_FLIGHT = 2 * READ_GROUP  # bytes of groups being read or written at once: the memory bound
READERS = 2  # threads calling dcp.load; reads, checksums and copies release the GIL, so reading overlaps writing
SYNC_EVERY = 256 * 2**20  # written bytes between background fdatasyncs: the disk writes while we read
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors' names for torch dtypes.
ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
INDEX = "model.safetensors.index.json"
# One output tensor: DCP key, output name, full shape, dtype in the checkpoint, dtype written, bytes written.
Entry = collections.namedtuple("Entry", "key name shape dtype_in dtype_out nbytes")


class ConsolidateError(RuntimeError):
    """Bad input or output path; the message names it. Nothing was written at OUT."""


def parse_size(text):
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (GB as Hugging Face counts it)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    number, unit, binary = m.groups()
    return int(float(number) * (1024 if binary else 1000) ** "_KMGT".index(unit or "_"))


def find(path):
    """The committed checkpoint directory at or under path (step 1)."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ConsolidateError(f"{path} {'is not a directory' if os.path.exists(path) else 'does not exist'}: "
                               "give a checkpoint directory (step-NNNNNNNN) or a checkpoint root")
    if os.path.basename(path).startswith(ckpt.TMP_PREFIX):
        # Its files may be incomplete: a save that crashed or is still being written.
        raise ConsolidateError(f"{path} is an uncommitted save (interrupted or in progress); "
                               "give a committed step-NNNNNNNN checkpoint or its root")
    found = ckpt.find_checkpoint(path)
    if found is None:
        raise ConsolidateError(f"no committed checkpoint (step-NNNNNNNN with manifest.json) under {path}")
    return found


def check(ckpt_dir, checksums=True):
    """The manifest (its digest checked), every listed file's size, and DCP's metadata (step 2)."""
    manifest = ckpt.read_manifest(ckpt_dir)
    errors = ckpt.verify_files(ckpt_dir, manifest, checksums=False)  # a stat per file; the data is checked as read
    if errors:
        raise ConsolidateError(f"checkpoint {ckpt_dir} is damaged, nothing written: " + "; ".join(errors))
    return manifest, ckpt.read_metadata(ckpt_dir, manifest if checksums else None)


def plan(ckpt_dir, metadata, dtype, max_bytes):
    """[[Entry, ...] per output file], in checkpoint order (step 3)."""
    entries = []
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("model.") or not hasattr(md, "chunks"):
            continue  # optimizer, extra, RNG; and non-tensor items, which weights do not have
        dtype_in = md.properties.dtype
        dtype_out = dtype if dtype_in.is_floating_point else dtype_in  # never cast integer buffers
        if dtype_out not in ST_DTYPES:
            raise ConsolidateError(f"{key} has dtype {dtype_out}, which safetensors cannot store")
        shape = tuple(md.size)
        nbytes = dtype_out.itemsize * torch.Size(shape).numel()
        entries.append(Entry(key, key.removeprefix("model."), shape, dtype_in, dtype_out, nbytes))
    if not entries:
        raise ConsolidateError(f"{ckpt_dir} has no model.* tensors: not a checkpoint written by ckpt.save")
    files, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > max_bytes:  # a tensor larger than max_bytes gets a file of its own
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    files.append(current)
    return files


def header(entries):
    """The safetensors header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    body, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        body[e.name] = {"dtype": ST_DTYPES[e.dtype_out], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # keeps the tensor data 8-byte aligned for readers that mmap it
    return len(text).to_bytes(8, "little") + text


def groups(entries):
    """Consecutive runs of a file's entries of at most READ_GROUP bytes (at least one tensor each)."""
    run, size = [], 0
    for e in entries:
        nbytes = e.dtype_in.itemsize * torch.Size(e.shape).numel()  # what dcp.load allocates
        if run and size + nbytes > READ_GROUP:
            yield run
            run, size = [], 0
        run.append(e)
        size += nbytes
    if run:
        yield run


def write_tensor(f, t):
    # Zero-copy: hand the tensor's memory to write() through ctypes (t.numpy() would need numpy).
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n:
        f.write((ctypes.c_char * n).from_address(t.data_ptr()))


def read_group(ckpt_dir, metadata, manifest, run):
    """One group's tensors, full size, in their output dtype (in a reader thread)."""
    state = {e.key: torch.empty(e.shape, dtype=e.dtype_in) for e in run}
    try:
        # Only this group's keys: DCP reads just their chunks, from every rank's file.
        dcp.load(state, storage_reader=ckpt.SafeReader(ckpt_dir, metadata, manifest), planner=ckpt.SafeLoadPlanner(),
                 no_dist=True)
    except dcp.CheckpointException as e:  # a BaseException; its failures hold (the reader's error, its stack)
        cause = next((f[0] if isinstance(f, tuple) else f for f in e.failures.values()), e)
        raise ConsolidateError(f"checkpoint {ckpt_dir} is damaged, nothing written: {cause}") from e
    return [state.pop(e.key).to(e.dtype_out) for e in run]


def stream(ckpt_dir, metadata, manifest, paths, files, progress):
    """Write each output file's header and tensors; reads run ahead in threads, within IN_FLIGHT bytes (step 4)."""
    per_file = [list(groups(entries)) for entries in files]
    runs = [run for file_runs in per_file for run in file_runs]  # in the order they are written
    nbytes = lambda run: sum(e.dtype_in.itemsize * torch.Size(e.shape).numel() for e in run)  # noqa: E731
    readers = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="consolidate-read")
    syncer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="consolidate-sync")
    ahead, synced, opened, next_run = collections.deque(), [], [], 0

    def read_ahead():
        nonlocal next_run
        # Always one group in flight, even a single tensor larger than IN_FLIGHT; otherwise within the bound.
        while next_run < len(runs) and (not ahead or sum(n for n, _ in ahead) + nbytes(runs[next_run]) <= IN_FLIGHT):
            ahead.append((nbytes(runs[next_run]), readers.submit(read_group, ckpt_dir, metadata, manifest, runs[next_run])))
            next_run += 1

    def close_synced(f):
        os.fsync(f.fileno())  # on disk before the rename publishes it
        f.close()

    # DCP warns that no process group exists (one process is the point); in the reader threads too, and
    # until the last read has stopped, on an error as well.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            for path, entries, file_runs in zip(paths, files, per_file):
                f = open(path, "wb")
                opened.append(f)
                f.write(header(entries))
                unsynced = 0
                for run in file_runs:
                    read_ahead()
                    tensors = ahead.popleft()[1].result()  # its bytes count against IN_FLIGHT until written
                    for e in run:
                        write_tensor(f, tensors.pop(0))  # each tensor freed once written
                        progress(1, e.nbytes)
                        unsynced += e.nbytes
                    if unsynced >= SYNC_EVERY:  # the kernel would otherwise start writing only at the final fsync
                        f.flush()
                        synced.append(syncer.submit(os.fdatasync, f.fileno()))
                        unsynced = 0
                f.flush()
                synced.append(syncer.submit(close_synced, f))
            for job in synced:
                job.result()
        finally:
            readers.shutdown(wait=True, cancel_futures=True)  # on an error, no read outlives this call
            syncer.shutdown(wait=True)
            for f in opened:
                f.close()


def check_file(path, entries):
    """Re-open with the safetensors library: a header or offset mistake fails here, before the commit."""
    with safe_open(path, framework="pt") as f:
        got = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    want = {e.name: e.shape for e in entries}
    if got != want:
        raise ConsolidateError(f"{path} does not read back as written: {sorted(set(got) ^ set(want))[:5]}")


class Progress:
    """Tensors and bytes done and MB/s on stderr, at most once a second and at the end."""

    def __init__(self, tensors, nbytes, quiet=False):
        self.tensors, self.nbytes, self.quiet = tensors, nbytes, quiet
        self.done, self.bytes, self.t0 = 0, 0, time.monotonic()
        self.last = self.t0

    def __call__(self, tensors, nbytes):
        self.done += tensors
        self.bytes += nbytes
        now = time.monotonic()
        if not self.quiet and (now - self.last >= 1 or self.done == self.tensors):
            self.last = now
            print(f"consolidate: {self.done}/{self.tensors} tensors, {self.bytes / 1e6:.1f}/{self.nbytes / 1e6:.1f} MB, "
                  f"{self.bytes / 1e6 / max(now - self.t0, 1e-9):.1f} MB/s", file=sys.stderr, flush=True)


def consolidate(path, out, dtype="fp32", max_shard_size=5 * 10**9, overwrite=False, checksums=True, quiet=False):
    """Write the model weights of the checkpoint at or under path to out/ (see the module docstring).

    Returns {"checkpoint", "files", "tensors", "bytes", "seconds"}. Raises ConsolidateError or
    ckpt.CheckpointError naming the bad path; out is then untouched.
    """
    if sys.byteorder != "little":
        raise ConsolidateError("safetensors stores little-endian bytes; this writer runs on little-endian machines only")
    out = os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise ConsolidateError(f"{out} already exists: pass --overwrite to replace it")
    t0 = time.monotonic()
    ckpt_dir = find(path)
    root = os.path.dirname(os.path.abspath(ckpt_dir))
    if os.path.commonpath([out, ckpt_dir]) == ckpt_dir or (os.path.dirname(out) == root and ckpt.committed_steps(root)):
        # ckpt.py refuses a root holding anything but step-NNNNNNNN directories: training could not resume.
        raise ConsolidateError(f"{out} is inside the checkpoint root {root}: write the output elsewhere")
    manifest, metadata = check(ckpt_dir, checksums)
    files = plan(ckpt_dir, metadata, DTYPES[dtype], max_shard_size)
    planned = time.monotonic() - t0
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = sum(e.nbytes for entries in files for e in entries)
    progress = Progress(sum(map(len, files)), total, quiet)
    if not quiet:
        print(f"consolidate: {ckpt_dir} (step {manifest['step']}) -> {out}: {progress.tensors} tensors, "
              f"{total / 1e6:.1f} MB {dtype} in {len(files)} file(s)", file=sys.stderr, flush=True)

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    # Beside OUT, so the final rename stays within one filesystem (and is atomic).
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; OUT gets the usual permissions
    try:
        paths = [os.path.join(tmp, name) for name in names]
        stream(ckpt_dir, metadata, manifest if checksums else None, paths, files, progress)
        for path, entries in zip(paths, files):
            check_file(path, entries)
        if len(files) > 1:
            weight_map = {e.name: name for name, entries in zip(names, files) for e in entries}
            write_json(os.path.join(tmp, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
        config = manifest.get("meta", {}).get("model_config")
        if config:  # train_fsdp.py stores the Hugging Face config of the model there
            write_json(os.path.join(tmp, "config.json"), dict(config, torch_dtype=str(DTYPES[dtype]).removeprefix("torch.")))
        ckpt.fsync_dir(tmp)
        commit(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written output behind, even on Ctrl-C
        raise
    seconds = time.monotonic() - t0
    if not quiet:
        print(f"consolidate: wrote {out} ({len(files)} file(s), {total / 1e6:.1f} MB) in {seconds:.2f} s "
              f"(check and plan {planned:.2f} s, stream {seconds - planned:.2f} s)", file=sys.stderr)
        if not config:
            print("consolidate: no config.json: the checkpoint was saved without meta={'model_config': {...}} "
                  "(a Hugging Face config dict); the weights alone were written", file=sys.stderr)
    return {"checkpoint": ckpt_dir, "files": names, "tensors": progress.tensors, "bytes": total, "seconds": seconds}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp, out, overwrite):
    """Rename the finished tmp directory to out; with overwrite, the old out goes only now."""
    old = None
    if os.path.lexists(out):
        if not overwrite:  # appeared while we were writing
            raise ConsolidateError(f"{out} already exists: pass --overwrite to replace it")
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rename(out, os.path.join(old, "out"))  # between this and the next rename, out is briefly absent
    try:
        os.rename(tmp, out)
    except OSError:
        if old:
            os.rename(os.path.join(old, "out"), out)  # put the old output back
            os.rmdir(old)
        raise
    ckpt.fsync_dir(os.path.dirname(out))  # the rename survives a power cut only once the parent is flushed
    if old:
        shutil.rmtree(old)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a committed checkpoint directory, or a checkpoint root (its newest is used)")
    p.add_argument("out", help="output directory (created; must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of floating-point weights")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest output file, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace OUT, once the new output is complete")
    p.add_argument("--no-checksum", action="store_true", help="check file sizes only, not the checksums of what is read")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    try:
        consolidate(args.ckpt, args.out, args.dtype, args.max_shard_size, args.overwrite, not args.no_checksum, args.quiet)
    except (ConsolidateError, ckpt.CheckpointError, OSError) as e:
        print(f"consolidate.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
