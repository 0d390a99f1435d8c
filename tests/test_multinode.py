"""Multi-node: run_multinode.sh and torchrun's c10d rendezvous, tested as two "nodes" on one machine.

Each node is its own run_multinode.sh process (NNODES=2, NODE_RANK=0/1) meeting at 127.0.0.1,
as they would over the network. Guards against:
  - a multi-node resume that is not the run it continues (wrong rank-to-shard mapping, data
    position or RNG across nodes): losses, and the checkpoints the two nodes write, must equal a
    single-node run's bit for bit;
  - a job that cannot come back on other hardware (another node or process count): the
    checkpoint the two nodes wrote must reshard onto 3 ranks and the losses continue within
    float tolerance;
  - a launcher that loses SLURM's settings, mangles arguments, or stays in front of torchrun as
    a shell that does not pass a SIGTERM on (so no preemption checkpoint);
  - a checkpoint root on node-local disks, where each node keeps part of the shards and no disk
    holds a whole checkpoint: the run must fail at start-up on every rank, naming the cause.

Speed (2 cores): a two-node launch costs two torchrun agents and two ranks, each importing torch
(~5 s of CPU apiece), so there are two of them: the resume and the node-local root. The two-node
resume starts from the one-node reference's checkpoint (the same world of 2 ranks; that two nodes
write the same checkpoint is checked bit for bit). The runs that need no second node (the
reference, the 3-rank resume on one node) go through tests/launch.py (torch imported once per rank index).

    python -m pytest -q -s tests/test_multinode.py
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import warnings

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests.harness import REPO, SMALL, TRAIN, kill_tree, read_log

SCRIPT = os.path.join(REPO, "run_multinode.sh")
STEPS = 8
# --batch-size 12 splits over 2 and over 3 ranks; --dropout 0 because each rank draws dropout for its
# share of the batch, which the world size changes. Short collective timeouts: a lost node fails in a minute.
COMMON = SMALL + ["--batch-size", "12", "--steps", str(STEPS), "--save-every", "2", "--dropout", "0",
                  "--seed", "5", "--timeout", "60", "--ckpt-timeout", "60", "--n-layers", "1"]
TIMEOUT = 150  # seconds for one launch of all nodes, start-up included


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(args, out_dir, nnodes=2, nproc=1, wrap=None, extra_env=None):
    """Start one run_multinode.sh per node, each in its own session; returns [(process, output file)]."""
    port, procs = free_port(), []
    try:
        for i in range(nnodes):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
            env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, NNODES=str(nnodes), NPROC_PER_NODE=str(nproc),
                       NODE_RANK=str(i), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=f"test-{port}")
            env.update((extra_env or {}).get(i, {}))
            out = open(os.path.join(out_dir, f"node{i}-port{port}.txt"), "w+")
            cmd = [*(wrap or {}).get(i, []), SCRIPT, *args]
            procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                           start_new_session=True), out))
    except BaseException:
        stop_nodes(procs)
        raise
    return procs


def wait_nodes(procs, timeout=TIMEOUT):
    """Wait for started nodes; returns [(exit code, output)] by NODE_RANK. Each node is killed with its
    whole process group (torchrun and its ranks) when this returns, whether it succeeded, failed or timed out."""
    try:
        deadline = time.monotonic() + timeout
        for p, _ in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"nodes timed out after {timeout}s:\n" + tails(procs)) from None
        return [(p.returncode, read(out)) for p, out in procs]
    finally:
        stop_nodes(procs)


def stop_nodes(procs):
    for p, out in procs:
        if not out.closed:
            if p.poll() is None:  # torchrun's ranks run in sessions of their own: its process group is not enough
                kill_tree(p.pid)
            p.wait()
            out.close()


def launch_nodes(*args, **kw):
    return wait_nodes(start_nodes(*args, **kw))


def read(f):
    f.flush()
    f.seek(0)
    return f.read()


def tails(procs):
    return "\n".join(f"--- node {i}:\n{read(out)[-3000:]}" for i, (_, out) in enumerate(procs))


def check_ok(results):
    for i, (code, out) in enumerate(results):
        assert code == 0, f"node {i} exited {code}:\n{out[-6000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on one node: 8 steps, 2 ranks, saving every 2 steps (4, 6 and 8 kept)."""
    d = tmp_path_factory.mktemp("reference")
    launch.run([TRAIN, *COMMON, "--ckpt-dir", d / "ckpt", "--log-file", d / "log.jsonl"], 2, timeout=TIMEOUT)
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(1, STEPS + 1))
    return d, log


@pytest.fixture(scope="module")
def node_local(tmp_path_factory):
    """Two nodes, node 1 with a private disk at the checkpoint root; started in the background, so that its
    start-up and teardown (rendezvous, imports, exit) overlap the two-node resume's idle moments."""
    d = tmp_path_factory.mktemp("node_local")
    root = str(d / "ckpt")
    os.makedirs(root)  # the tmpfs needs an existing mount point
    wrap, extra_env, how = private_disk(root, d)
    procs = start_nodes(COMMON + ["--ckpt-dir", root], d, wrap=wrap, extra_env=extra_env)
    yield procs, root, how
    stop_nodes(procs)


@pytest.fixture(scope="module")
def two_nodes(reference, node_local, tmp_path_factory):
    """Two nodes x 1 rank resume the reference's step-4 checkpoint (2 ranks, as they are) and run steps 5-8,
    saving steps 6 and 8 from both nodes."""
    ref_dir, _ = reference
    d = tmp_path_factory.mktemp("two_nodes")
    shutil.copytree(ref_dir / "ckpt" / "step-00000004", d / "ckpt" / "step-00000004")
    results = launch_nodes(COMMON + ["--ckpt-dir", str(d / "ckpt"), "--log-file", str(d / "log.jsonl"), "--resume"], d)
    check_ok(results)
    return d, results


def checkpoint_values(path):
    """Every value of the checkpoint at path, tensors in full, read in this one process."""
    metadata = ckpt.read_metadata(str(path))
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) if hasattr(md, "size") else None
             for k, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled": one process is the point
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=ckpt.SafeReader(str(path), metadata), planner=ckpt.SafeLoadPlanner(),
                 no_dist=True)
    return state


def test_two_node_resume_is_bit_exact(reference, two_nodes):
    """Field failure: a job split over nodes resumes with shards, data position or RNG on the wrong
    rank, or writes its shards under the wrong rank. Two nodes x 1 rank are the same world as one node
    x 2 ranks: the losses, and the final checkpoint the two nodes wrote, must be equal bit for bit."""
    (ref_dir, ref), (d, results) = reference, two_nodes
    log = read_log(d / "log.jsonl")
    assert sorted(log) == list(range(5, STEPS + 1)), f"logged steps {sorted(log)}"
    assert any("resumed from step 4" in out for _, out in results), results[0][1][-3000:]  # global rank 0's node
    dloss = max(abs(log[s]["loss"] - ref[s]["loss"]) for s in log)
    for s in log:
        assert log[s]["loss"] == ref[s]["loss"], f"step {s}: loss {log[s]['loss']!r} != {ref[s]['loss']!r}"
        assert log[s]["lr"] == ref[s]["lr"], f"step {s}: lr differs"
        assert log[s]["samples"] == ref[s]["samples"], f"step {s}: data position differs"
    final = f"step-{STEPS:08d}"
    assert ckpt.read_manifest(str(d / "ckpt" / final))["world_size"] == 2
    want, got = checkpoint_values(ref_dir / "ckpt" / final), checkpoint_values(d / "ckpt" / final)
    assert sorted(want) == sorted(got), sorted(set(want) ^ set(got))
    worst, differ = 0.0, []
    for k in want:
        if isinstance(want[k], torch.Tensor):
            if want[k].numel():
                worst = max(worst, (want[k].double() - got[k].double()).abs().max().item())
            if not torch.equal(want[k], got[k]):
                differ.append(k)
        elif want[k] != got[k]:
            differ.append(k)
    print(f"\ntwo nodes, resumed at 4 to {STEPS}: max |dloss| vs one node = {dloss:.3e} over steps 5-{STEPS}; "
          f"their step-{STEPS} checkpoints: {len(want)} keys, {len(differ)} differ, max |dstate| = {worst:.3e}")
    assert not differ, f"the two-node checkpoint differs from the one-node run's at {differ[:5]}"


def test_resume_two_nodes_on_one_node_with_three_ranks(reference, two_nodes, tmp_path):
    """Field failure: a job requeued onto other hardware cannot use its checkpoint. The 2-rank
    checkpoint of step 6 the two nodes wrote continues on 1 node x 3 ranks (resharded: dim 64, ffn and
    vocab not multiples of 3), close to the uninterrupted run."""
    (_, ref), (d, _) = reference, two_nodes
    name = "step-00000006"
    shutil.copytree(d / "ckpt" / name, tmp_path / "ckpt" / name)
    args = COMMON + ["--ckpt-dir", str(tmp_path / "ckpt"), "--log-file", str(tmp_path / "log.jsonl"), "--resume"]
    _, out = launch.run([TRAIN, *args], 3, timeout=TIMEOUT)
    assert "resumed from step 6" in out and "(step 6, saved at world size 2)" in out, out[-3000:]
    log = read_log(tmp_path / "log.jsonl")
    after = range(7, STEPS + 1)
    assert sorted(log) == list(after)
    dloss = max(abs(log[s]["loss"] - ref[s]["loss"]) for s in after)
    rel = max(abs(log[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in after)
    print(f"\n2 nodes x 1 rank -> 1 node x 3 ranks at step 6: steps 7-{STEPS} max |dloss| = {dloss:.3e}, "
          f"max rel diff = {rel:.3e}")
    assert rel < 1e-4, f"losses after the reshard differ by {rel:.3e} (relative)"
    for s in after:
        assert log[s]["lr"] == ref[s]["lr"] and log[s]["samples"] == ref[s]["samples"], f"step {s}"


# Node 1 gets a private disk at the checkpoint root. Preferred: a private mount namespace with
# a tmpfs over the root (a real node-local filesystem at the same path). Where that is not
# allowed, a sitecustomize on node 1 hides the root's contents from os.path.isdir instead.
MOUNT = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
HIDE = '''import os, os.path
_hidden, _isdir, _exists = os.environ["HIDE_UNDER"] + os.sep, os.path.isdir, os.path.exists
os.path.isdir = lambda p: not os.path.abspath(p).startswith(_hidden) and _isdir(p)
os.path.exists = lambda p: not os.path.abspath(p).startswith(_hidden) and _exists(p)
'''


def private_disk(root, scratch):
    """(wrap, extra_env, how) that give node 1 its own view of root (or hide its contents from it)."""
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):  # as root; else via a user namespace
        if shutil.which("unshare") and subprocess.run(
            [*unshare, "sh", "-c", MOUNT, root, "true"], capture_output=True, timeout=30
        ).returncode == 0:
            return {1: [*unshare, "sh", "-c", MOUNT, root]}, {}, f"{' '.join(unshare)} + tmpfs"
    os.makedirs(scratch / "site")
    (scratch / "site" / "sitecustomize.py").write_text(HIDE)
    pythonpath = os.pathsep.join(filter(None, [str(scratch / "site"), os.environ.get("PYTHONPATH")]))
    return {}, {1: {"HIDE_UNDER": root, "PYTHONPATH": pythonpath}}, "no mount namespace: os.path patched on node 1"


def test_node_local_checkpoint_root_fails_on_every_rank(node_local):
    """Field failure: --ckpt-dir on node-local disks (/tmp, local NVMe). Each node would keep its
    own ranks' shards and node 0 would commit a checkpoint that lacks the others. Node 1 here has
    a private filesystem at the same path; the run must fail at start-up (check_root: node 1 cannot
    see the claim node 0 wrote), on every rank, saying why, before training a step."""
    procs, root, how = node_local
    results = wait_nodes(procs)
    # One rank per node, so "every node's output has the error" is "every rank raised it".
    failed = [i for i, (_, out) in enumerate(results) if "CheckpointError" in out and "cannot see" in out]
    print(f"\nnode-local root ({how}): exit codes {[c for c, _ in results]}, CheckpointError on nodes {failed}")
    for i, (code, out) in enumerate(results):
        assert code != 0, f"node {i} succeeded with a node-local checkpoint root:\n{out[-3000:]}"
        assert f"cannot see {os.path.join(root, ckpt.OWNER)}" in out, f"node {i}:\n{out[-6000:]}"
        assert "step     1 |" not in out, f"node {i} trained before failing:\n{out[-3000:]}"
    assert failed == [0, 1], "every rank must raise the shared-storage error"
    assert not [n for n in os.listdir(root) if n.startswith("step-")], "nothing may be committed"


def test_slurm_settings_arguments_and_exec(tmp_path):
    """Field failure: a launcher that drops SLURM's node list or job id, splits an argument, or
    stays alive as a shell in front of torchrun (a SIGTERM sent to the launcher's pid, as kill or
    a container runtime sends it, then kills the shell and never reaches torchrun or the ranks);
    two job steps of one allocation given one rendezvous (on one node the second failed at start-up,
    its port taken), or a step on part of the allocation sent to the allocation's first node; torchrun's
    30 s between its forwarded SIGTERM and its SIGKILL left shorter than SLURM's grace (a final save cut off).
    Stand-ins for python and scontrol record what the script runs, without starting torch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\ncase "$2" in\n'
        'config) echo "KillWait                = 45 sec";;\n'
        'partition) [ "$3" = gpu ] && echo "   DefaultTime=NONE GraceTime=120 Hidden=NO";;\n'
        '*) case "$3" in "gpu-a[17-18],gpu-b02") printf "gpu-a17\\ngpu-a18\\ngpu-b02\\n";; *) echo "$3";; esac;;\n'
        'esac\n')
    (bin_dir / "python").write_text('#!/bin/sh\necho "pid $$"\nprintf "%s\\n" "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    ours = ("NNODES", "NPROC_PER_NODE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "SHUTDOWN_TIMEOUT",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if k not in ours and not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=str(bin_dir / "python"), SLURM_JOB_ID="7342",
               SLURM_NNODES="3", SLURM_NODEID="2", SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b02", SLURM_GPUS_ON_NODE="4",
               SLURM_JOB_PARTITION="gpu")
    args = ["--ckpt-dir", "/shared/with space", "--resume"]
    # Step 0 on the whole allocation (as sbatch's first srun): SLURM's grace, KillWait 45 s + GraceTime 120 s.
    # Step 1 on its last node alone, its grace set by hand (as for sbatch --signal=TERM@S).
    steps = {"0": ({}, "gpu-a17:24104", "7342.0", "165"),
             "1": ({"SLURM_STEP_NODELIST": "gpu-b02", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                    "SHUTDOWN_TIMEOUT": "600"}, "gpu-b02:24105", "7342.1", "600")}
    for step, (step_env, endpoint, rdzv_id, grace) in steps.items():
        # From another directory, so the script must find train_fsdp.py next to itself, not in the cwd.
        proc = subprocess.Popen([SCRIPT, *args], stdout=subprocess.PIPE, text=True, env=dict(env, SLURM_STEP_ID=step,
                                **step_env), cwd=tmp_path)
        out, _ = proc.communicate(timeout=30)
        lines = out.splitlines()
        print(f"\nunder SLURM, job step {step}: {' '.join(lines[1:])}")
        assert proc.returncode == 0
        assert lines[0] == f"pid {proc.pid}", "torchrun must replace the script's shell (exec) to receive SIGTERM"
        nnodes, is_host = ("3", "0") if step == "0" else ("1", "1")
        assert lines[1:] == ["-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "4",
                             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
                             "--rdzv-conf", f"is_host={is_host}", "--shutdown-timeout", grace,
                             os.path.join(os.path.realpath(REPO), "train_fsdp.py"), *args]
    # Outside SLURM: torchrun's own variable, else its default 30 s; under SLURM, so too when scontrol fails.
    (tmp_path / "failing").mkdir()
    (tmp_path / "failing" / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "failing" / "scontrol").chmod(0o755)
    plain = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    cases = [(plain, "30"), (dict(plain, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="50"), "50"),
             (dict(env, PATH=f"{tmp_path / 'failing'}{os.pathsep}{env['PATH']}", MASTER_ADDR="gpu-a17"), "30")]
    got = []
    for case_env, grace in cases:
        proc = subprocess.run([SCRIPT], stdout=subprocess.PIPE, text=True, env=dict(case_env, NPROC_PER_NODE="1"),
                              cwd=tmp_path, timeout=30)
        lines = proc.stdout.splitlines()
        got.append(lines[lines.index("--shutdown-timeout") + 1] if "--shutdown-timeout" in lines else None)
    print(f"--shutdown-timeout without SLURM: {got[0]}; with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=50: {got[1]}; "
          f"under SLURM with a failing scontrol: {got[2]}")
    assert got == [grace for _, grace in cases]
