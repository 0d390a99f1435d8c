"""Export a sharded checkpoint to Hugging Face safetensors: one CPU process, memory of one read group.

    python consolidate.py checkpoints out/                    # the newest checkpoint under checkpoints/
    python consolidate.py checkpoints/step-00000200 out/ --dtype bf16 --max-shard-size 2GB
    python consolidate.py checkpoints out/ --overwrite        # replace out/ once the new one is complete
    python consolidate.py checkpoints ema/ --prefix extra.ema.shadow.   # the shadow weights of an EMA extra

out/, what `transformers` and `train_fsdp.py --init-from` read: DCP's "<prefix><name>" (model.: the model) as "<name>".
    config.json                          the manifest's meta["model_config"], torch_dtype set to --dtype
    model.safetensors                    when everything fits in --max-shard-size; otherwise
    model-00001-of-00003.safetensors     ... one file per shard, and
    model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: file}}

  1. Find: CKPT is a checkpoint directory, or a root (then its highest step, the one ckpt.load would choose).
  2. Verify, before anything is written: the size and CRC-32 of each file the manifest lists (--no-checksum: sizes).
  3. Plan from DCP's .metadata (read without running code from it): names, shapes and dtypes, packed in
     checkpoint order into files of at most --max-shard-size, so every header is known before a tensor is read.
  4. Stream: a file's tensors are read in groups of at most READ_GROUP bytes by dcp.load(no_dist=True) into
     fresh full tensors, written and freed. Peak memory: one group (or one tensor, if larger) plus torch.
  5. Commit: the files go into .OUT.tmp-<id> beside OUT, are fsynced, read back by safetensors.safe_open and
     renamed to OUT. A failure removes them; a killed process leaves them there, never at OUT.

The format (an 8-byte length, a JSON header, raw little-endian bytes) is written tensor by tensor, not by save_file,
which takes a file's tensors at once. Tied weights are read into buffers of their own; transformers ties them again.
"""

import argparse
import collections
import ctypes
import json
import os
import re
import shutil
import sys
import time
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import ckpt

READ_GROUP = 64 * 2**20  # bytes per dcp.load: the memory bound; larger would only amortize DCP's planning
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # safetensors' dtype names
INDEX = "model.safetensors.index.json"
OUTPUT = r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"  # the files written
Entry = collections.namedtuple("Entry", "key name shape dtype_in dtype_out bytes_in bytes_out")  # _in: as saved

class ConsolidateError(RuntimeError):
    """Bad input or output path; the message names it. Nothing was written at OUT."""

def parse_size(text):
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes (GB as Hugging Face counts it)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?))?B?\s*", text.upper())
    size = match and int(float(match[1]) * (1024 if match[3] else 1000) ** "_KMGT".index(match[2] or "_"))
    if not size:  # no match, or under a byte
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    return size

def find(path):
    """Step 1: the checkpoint directory at or under path."""
    path = os.path.abspath(path)
    found = ckpt.find_checkpoint(path)  # refuses a file, and a .tmp- directory: an uncommitted save's files
    if found is None:
        where = f"under {path}" if os.path.exists(path) else f"at {path}, which does not exist"
        raise ConsolidateError(f"no committed checkpoint (step-NNNNNNNN with {ckpt.MANIFEST}) {where}")
    return found

def batches(entries, limit, size):
    """Consecutive runs of entries of at most limit bytes (by size(entry)); a larger entry is a run of its own."""
    run, run_bytes = [], 0
    for entry in entries:
        if run and run_bytes + size(entry) > limit:
            yield run
            run, run_bytes = [], 0
        run.append(entry)
        run_bytes += size(entry)
    if run:
        yield run

def plan(ckpt_dir, metadata, dtype, prefix):
    """Step 3: an Entry per tensor under prefix (the model's: "model."), in checkpoint order."""
    entries = []
    for key, saved in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(saved, dcp.TensorStorageMetadata):
            continue  # optimizer state, extras, RNG
        dtype_in = saved.properties.dtype
        dtype_out = dtype if dtype_in.is_floating_point else dtype_in  # integer buffers are never cast
        if dtype_out not in ST_DTYPES:
            raise ConsolidateError(f"{key} in {ckpt_dir} has dtype {dtype_out}, which safetensors cannot store")
        numel = saved.size.numel()
        entries.append(Entry(key, key.removeprefix(prefix), tuple(saved.size), dtype_in, dtype_out,
                             numel * dtype_in.itemsize, numel * dtype_out.itemsize))
    if not entries:
        raise ConsolidateError(f"no tensor in {ckpt_dir} is named {prefix}*")
    return entries

def header(entries):
    """The safetensors header: its length (8 bytes, little-endian), then JSON padded with spaces to 8 bytes."""
    body, start = {"__metadata__": {"format": "pt"}}, 0  # transformers reads only files marked "pt"
    for e in entries:  # offsets count from the end of the header
        body[e.name] = {"dtype": ST_DTYPES[e.dtype_out], "shape": list(e.shape),
                        "data_offsets": [start, start + e.bytes_out]}
        start += e.bytes_out
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensor data stays 8-byte aligned for readers that mmap it
    return len(text).to_bytes(8, "little") + text

def write_file(path, entries, ckpt_dir, metadata, progress):
    """Step 4 for one output file; then fsync it and read it back with the safetensors library."""
    with open(path, "wb") as f:
        f.write(header(entries))
        for group in batches(entries, READ_GROUP, lambda e: e.bytes_in):
            # Full tensors of this group's keys alone: DCP reads their pieces from every rank's file.
            tensors = {e.key: torch.empty(e.shape, dtype=e.dtype_in) for e in group}
            try:
                dcp.load(tensors, storage_reader=ckpt.SafeReader(ckpt_dir, metadata),
                         planner=ckpt.SafeLoadPlanner(), no_dist=True)
            except dcp.CheckpointException as e:  # a damaged file that --no-checksum let through
                raise ConsolidateError(f"{ckpt_dir}: its files cannot be read (damaged? check their CRCs)") from e
            for e in group:
                tensor = tensors.pop(e.key).to(e.dtype_out)  # freed once written
                # write() takes the tensor's memory through ctypes, without a copy (tensor.numpy() would need numpy).
                f.write((ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr()))
                progress.add(e.bytes_out)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename publishes it
    with safe_open(path, framework="pt") as f:  # a mistake in our header or offsets fails here, before the commit
        got = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name in f.keys()}
    if got != {e.name: (ST_DTYPES[e.dtype_out], list(e.shape)) for e in entries}:
        raise ConsolidateError(f"{path} does not read back as written")

class Progress:
    """Tensors, MB and MB/s on stderr, at most once a second, and when done."""
    def __init__(self, tensors, nbytes, quiet):
        self.total, self.total_mb, self.quiet, self.start = tensors, nbytes / 1e6, quiet, time.monotonic()
        self.tensors, self.nbytes, self.shown = 0, 0, self.start

    def add(self, nbytes):
        self.tensors, self.nbytes, now = self.tensors + 1, self.nbytes + nbytes, time.monotonic()
        if not self.quiet and (now - self.shown >= 1 or self.tensors == self.total):
            self.shown = now
            print(f"consolidate: {self.tensors}/{self.total} tensors, {self.nbytes / 1e6:.1f}/{self.total_mb:.1f} MB, "
                  f"{self.nbytes / 1e6 / (now - self.start):.1f} MB/s", file=sys.stderr, flush=True)

def consolidate(path, out, dtype="fp32", max_shard_size=5 * 10**9, overwrite=False, checksums=True, quiet=False,
                prefix="model."):
    """Write the checkpoint's model to out: {"checkpoint", "files", "tensors", "bytes", "seconds"}. Raises
    ConsolidateError, ckpt.CheckpointError or OSError naming the bad path, with nothing written at out."""
    if sys.byteorder != "little":  # an s390x, say
        raise ConsolidateError("safetensors stores little-endian bytes: run this on a little-endian machine")
    start, out = time.monotonic(), os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise ConsolidateError(f"{out} already exists: pass --overwrite to replace it")
    ours = os.path.isdir(out) and not os.path.islink(out) and all(re.fullmatch(OUTPUT, n) for n in os.listdir(out))
    if os.path.lexists(out) and not ours:  # --overwrite replaces an export, never a directory of other files
        raise ConsolidateError(f"{out} is not an export of this script: --overwrite replaces only its files")
    ckpt_dir = find(path)
    root = os.path.dirname(ckpt_dir)  # a checkpoint copied on its own has none: it alone is protected then
    protected = root if ckpt.committed_steps(root) else ckpt_dir
    if os.path.commonpath([out, protected]) in (out, protected):  # inside: copied and cleaned up with them
        raise ConsolidateError(f"{out} is inside {protected}, or holds it: write the output elsewhere")
    manifest = ckpt.read_manifest(ckpt_dir)
    errors = ckpt.verify_files(ckpt_dir, manifest, checksums=checksums)  # 2. before anything is written
    if errors:
        raise ConsolidateError(f"checkpoint {ckpt_dir} is damaged, nothing written: " + "; ".join(errors))
    metadata = ckpt.read_metadata(ckpt_dir)
    entries = plan(ckpt_dir, metadata, DTYPES[dtype], prefix)
    files = list(batches(entries, max_shard_size, lambda e: e.bytes_out))
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    total = sum(e.bytes_out for e in entries)
    verified = time.monotonic() - start
    if not quiet:
        print(f"consolidate: {ckpt_dir} (step {manifest['step']}) -> {out}: {len(entries)} tensors, "
              f"{total / 1e6:.1f} MB {dtype} in {len(files)} file(s)", file=sys.stderr, flush=True)
    # 5. Beside OUT, so that the final rename stays within one file system, where it is atomic.
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        progress = Progress(len(entries), total, quiet)
        with warnings.catch_warnings():  # "torch.distributed is disabled": one process is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            for name, file_entries in zip(names, files):
                write_file(os.path.join(tmp, name), file_entries, ckpt_dir, metadata, progress)
        if len(files) > 1:
            weight_map = {e.name: name for name, file_entries in zip(names, files) for e in file_entries}
            write_json(os.path.join(tmp, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
        config = manifest["meta"].get("model_config")  # train_fsdp.py stores its Hugging Face config there
        if config:
            torch_dtype = str(DTYPES[dtype]).removeprefix("torch.")
            write_json(os.path.join(tmp, "config.json"), dict(config, torch_dtype=torch_dtype))
        ckpt.fsync_dir(tmp)
        commit(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written output left behind, even on Ctrl-C
        raise
    seconds = time.monotonic() - start
    if not config:
        print("consolidate: no config.json written: the checkpoint was saved without meta={'model_config': "
              "<a Hugging Face config dict>}", file=sys.stderr)
    if not quiet:
        print(f"consolidate: wrote {out} ({len(files)} file(s), {total / 1e6:.1f} MB) in {seconds:.2f} s "
              f"(verify {verified:.2f} s, stream {seconds - verified:.2f} s)", file=sys.stderr)
    return {"checkpoint": ckpt_dir, "files": names, "tensors": len(entries), "bytes": total, "seconds": seconds}

def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())

def commit(tmp, out, overwrite):
    """tmp to out; an old out goes aside first, deleted last: a crash leaves it whole at .<out>.old-<id>."""
    old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.old-{uuid.uuid4().hex[:8]}")
    if overwrite and os.path.lexists(out):
        os.rename(out, old)
    os.rename(tmp, out)  # without --overwrite, an out that appeared meanwhile makes this fail (unless empty)
    ckpt.fsync_dir(os.path.dirname(out))  # a rename survives a power cut only once its directory is flushed
    if os.path.lexists(old):
        shutil.rmtree(old)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="a committed checkpoint directory, or a checkpoint root (its newest is used)")
    p.add_argument("out", help="output directory (created; must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of floating-point weights")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="largest output file, e.g. 5GB, 500MB")
    p.add_argument("--overwrite", action="store_true", help="replace OUT, once the new output is complete")
    p.add_argument("--no-checksum", action="store_true", help="check the files' sizes only, not their checksums")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--prefix", default="model.", help="export the tensors under this key prefix (an EMA's)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the copies are memory-bound: more threads gain little, and stall them on busy cores
    try:
        consolidate(args.ckpt, args.out, args.dtype, args.max_shard_size, args.overwrite, not args.no_checksum,
                    args.quiet, args.prefix)
    except (ConsolidateError, ckpt.CheckpointError, OSError) as e:
        print(f"consolidate.py: error: {e}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
