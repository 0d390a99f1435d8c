"""A small 2-rank FSDP2 job that trains, checkpoints and exits: the exit-time abort check of issue 12.3.

    torchrun --standalone --nproc-per-node 2 tests/teardown_script.py --ckpt DIR    # save + load, our teardown
    torchrun --standalone --nproc-per-node 2 tests/teardown_script.py --no-ckpt     # the same training, no ckpt calls
    ... --naive                                    # tear down with dist.destroy_process_group() alone

tests/test_teardown.py launches it many times in a row and counts the launches that do not exit 0.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckpt  # noqa: E402

STEPS = 4


def threads():
    """This process's thread names (Linux): a gloo group's are pt_gloo_runloop x2 and gloo_tcp_loop; Python's
    threads (ckpt's root-claim refresher) show as python."""
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


def train(args, rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    print(f"rank {rank}: threads before ckpt {threads()}", flush=True)
    if args.ckpt:
        ckpt.check_root(args.ckpt, model)
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 2 + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if args.ckpt and step % 2 == 0:
            ckpt.save(args.ckpt, step, model, opt, keep=1)
    loaded = ckpt.load(args.ckpt, model, opt) if args.ckpt else None
    # The last collectives before the teardown: a backward's (--no-ckpt) or a load's (--ckpt).
    print(f"rank {rank}: trained {STEPS} steps, loaded step {loaded}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ckpt", metavar="DIR", help="save at steps 2 and 4 under DIR, then load the newest")
    mode.add_argument("--no-ckpt", action="store_true", help="the same training without any ckpt call")
    p.add_argument("--naive", action="store_true", help="tear down with dist.destroy_process_group() alone")
    args = p.parse_args()
    dist.init_process_group("gloo")
    try:
        train(args, dist.get_rank())
    finally:
        if args.naive:
            print(f"rank {dist.get_rank()}: threads at teardown {threads()}", flush=True)
            dist.destroy_process_group()
        else:
            teardown()


def teardown():
    """The teardown of README and train_fsdp.py (see there for why), and a report of the threads left."""
    try:
        if hasattr(ckpt, "close"):  # the ckpt.py of before issue 12 has none
            ckpt.close()
        print(f"rank {dist.get_rank()}: threads at teardown {threads()}", flush=True)
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
