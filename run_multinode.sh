#!/usr/bin/env bash
# Run train_fsdp.py on one or more nodes through torchrun's c10d rendezvous.
# Every argument goes to train_fsdp.py unchanged; the launch itself is set by environment variables.
#
#   SLURM (one task per node; settings come from SLURM's variables):
#     srun --nodes=2 --ntasks-per-node=1 ./run_multinode.sh --ckpt-dir /shared/ckpt --resume
#   Plain SSH (the same command on every node, only NODE_RANK differs):
#     NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./run_multinode.sh --ckpt-dir /shared/ckpt --resume   # on node0
#     NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 ./run_multinode.sh --ckpt-dir /shared/ckpt --resume   # on node1
#
# --ckpt-dir must be on storage every node sees (NFS, Lustre, GPFS, ...): each rank writes its own
# shards into it. ckpt.save() checks this at the first save and fails on every rank if it is not.
#
# Network: gloo and NCCL pick an interface by themselves, and on nodes with several (docker0,
# a management network, InfiniBand) they sometimes pick a wrong one and hang at start-up. Then set,
# for your cluster, before calling this script (we set none of them: a wrong value breaks a
# working setup):
#   GLOO_SOCKET_IFNAME=eth0     interface for gloo (CPU runs, and ckpt's coordination group)
#   NCCL_SOCKET_IFNAME=eth0     interface for NCCL's bootstrap and TCP traffic
#   NCCL_IB_HCA=mlx5_0          which InfiniBand adapters NCCL uses;  NCCL_DEBUG=INFO shows its choice
# The nodes must also resolve each other's hostnames and reach any TCP port: the ranks meet at a
# fresh port on the node holding global rank 0, by its hostname (torchrun --local-addr overrides).
#
# Grace: after it forwards a SIGTERM to the ranks, torchrun waits --shutdown-timeout seconds (its
# default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30), then SIGKILLs them, whatever time the scheduler
# gives: a step and a final save longer than that are lost. SHUTDOWN_TIMEOUT=seconds sets it. Under
# SLURM it defaults to SLURM's grace: KillWait (`scontrol show config`: the wait between SIGTERM and
# SIGKILL at the time limit or a scancel) plus the partition's GraceTime (`scontrol show partition`:
# the extra time of a preempted job). Set it yourself for what SLURM does not say: with
# `sbatch --signal=TERM@S` (the signal comes S seconds before the end) SHUTDOWN_TIMEOUT=$((S + KillWait));
# a QOS's GraceTime. A larger value costs nothing when the ranks exit on time; when one hangs, torchrun
# waits that long after a failure too.
set -euo pipefail

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # Under SLURM, derive what is not set explicitly (an explicit variable always wins).
    NNODES=${NNODES:-$SLURM_NNODES}
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?launch this script with srun, one task per node}}
    # The first host of this job step (srun sets SLURM_STEP_NODELIST; a step may run on part of the
    # allocation, and SLURM_NNODES and SLURM_NODEID count the step's nodes). sed, not head: head exits
    # early, and with pipefail an scontrol killed by SIGPIPE on a long node list would fail the launch.
    MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" | sed -n 1p)}
    # One rendezvous per job step: two steps of one allocation (two sruns) are two runs, which on one
    # node would otherwise meet at one port (the second failed at start-up: EADDRINUSE). A requeued
    # job numbers its steps from 0 again, so it gets its dead run's id and port back.
    STEP=${SLURM_STEP_ID:-0}
    RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID.$STEP}
    # Ports 20000-31999, below Linux's ephemeral ones: jobs sharing a node get ports of their own
    # unless their ids are equal modulo 1000, and so do steps 0-11 of one job.
    MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 1000 * 12 + STEP % 12))}
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    if [[ -z "${SHUTDOWN_TIMEOUT:-}" ]]; then  # SLURM's grace; "|| true": a failed scontrol leaves the default
        KILL_WAIT=$(scontrol show config 2>/dev/null | sed -n 's/^KillWait *= *\([0-9]*\).*/\1/p' || true)
        GRACE_TIME=$(scontrol show partition "${SLURM_JOB_PARTITION:-}" 2>/dev/null \
                     | sed -n 's/.*GraceTime=\([0-9]*\).*/\1/p' || true)
        if [[ -n "$KILL_WAIT" ]]; then
            SHUTDOWN_TIMEOUT=$((KILL_WAIT + ${GRACE_TIME:-0}))
        fi
    fi
fi

# The caller's python, so an activated virtualenv is the one that runs torchrun and the ranks.
PYTHON=${PYTHON:-python3}
# Number of nodes: torchrun waits until this many have joined the rendezvous, then starts all ranks.
NNODES=${NNODES:-1}
# Processes (ranks) on this node: default one per visible GPU (torch honours CUDA_VISIBLE_DEVICES,
# which SLURM sets to the job's GPUs), else 1 on a CPU-only node.
NPROC_PER_NODE=${NPROC_PER_NODE:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')}
# 0 on the node that hosts the rendezvous store (the one at MASTER_ADDR), anything else elsewhere.
# torchrun assigns global ranks itself at the rendezvous, so global rank 0 may be on any node.
NODE_RANK=${NODE_RANK:-0}
# Address of node 0 as the other nodes reach it, and a free TCP port there for the rendezvous store
# (one node: 0, any free port, so that two jobs on one machine do not collide, as with --standalone).
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$([[ "$NNODES" == 1 ]] && echo 0 || echo 29500)}
# Names this job at the rendezvous; identical on all nodes.
RDZV_ID=${RDZV_ID:-train_fsdp}
# Seconds torchrun gives the ranks to save and exit after a SIGTERM, before its SIGKILL (see the header).
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-30}}

# is_host says outright which node serves the store: torchrun's own guess compares MASTER_ADDR with
# the machine's hostname and addresses, which misfires with aliases and multi-homed nodes.
IS_HOST=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)

# exec: torchrun replaces this shell, so a SIGTERM sent to this pid (kill, a container runtime, a
# scheduler's preemption) reaches torchrun rather than killing a shell in front of it; torchrun
# forwards it to each rank's process group (DataLoader workers included: train_fsdp.py's outlive it);
# train_fsdp.py then finishes the step, saves and exits, within SHUTDOWN_TIMEOUT.
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-conf "is_host=$IS_HOST" \
    --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
    "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/train_fsdp.py" "$@"
