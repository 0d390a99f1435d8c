"""The bytes ckpt.py's own collectives send per rank per save, at 150 and at 1,500 parameters (CPU, gloo).

    python bench/collectives.py            # 2 ranks: FSDP2 over 75 and 750 nn.Linear(4, 4), after one AdamW step

ckpt's collectives go through ckpt._collective(); this wraps it and counts, for each call, what this rank puts into
the collective: an all-reduce's tensor, the pickled objects of all_gather_object() and gather_object() (torch pads
every rank's to the largest and first all-gathers each one's size, 8 bytes), and a broadcast's pickle on rank 0 (the
other ranks send nothing). DCP's own collectives (its plan and its metadata) are not ckpt's and are not counted;
the digests ckpt adds to each rank's DCP plan are counted apart. A save is counted from its call to its commit.
"""

import datetime
import json
import os
import pickle
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.distributed.fsdp import fully_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("CKPT_DIR", REPO))  # CKPT_DIR: another ckpt.py to measure (an older version)
import ckpt  # noqa: E402

SIZES = (75, 750)  # nn.Linear(4, 4) each: 150 and 1,500 parameters
SAVES = 3


def payload(what, fn, args, kwargs):  # (this rank's bytes into the collective, size exchanges of 8 bytes each)
    name = getattr(fn, "__name__", "")
    if name == "all_reduce":
        return args[0].nbytes, 0
    if name in ("all_gather_object", "gather_object"):
        obj = args[1] if name == "all_gather_object" else args[0]
        return len(pickle.dumps(obj)), 1
    if name == "broadcast_object_list":
        return (len(pickle.dumps(args[0])) if dist.get_rank() == 0 else 0), 1
    return 0, 0  # making the group: once per run, not per save


def worker(work):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, counted = dist.get_rank(), {"bytes": 0, "calls": 0, "size_exchanges": 0, "digests": 0}
    real_collective = ckpt._collective

    def counting(what, fn, *args, **kwargs):
        sent, exchanges = payload(what, fn, args, kwargs)
        counted["bytes"] += sent
        counted["size_exchanges"] += exchanges
        counted["calls"] += 1
        return real_collective(what, fn, *args, **kwargs)

    ckpt._collective = counting
    planner = getattr(ckpt, "AgreeingSavePlanner", None)  # absent before ckpt.py's format 5
    if planner:
        real_local_plan = planner.create_local_plan

        def local_plan(self):
            counted["digests"] += len(pickle.dumps(self.digests))
            return real_local_plan(self)
        planner.create_local_plan = local_plan
    results = {}
    for linears in SIZES:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(linears)))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        root = os.path.join(work, f"root-{linears}")
        ckpt.check_root(root, model) if planner else ckpt.check_root(root)  # uncounted, as at a run's start
        ckpt.save(root, 0, model, opt)  # the group exists from here on
        for key in counted:
            counted[key] = 0
        for step in range(1, SAVES + 1):
            ckpt.save(root, step, model, opt)
        results[2 * linears] = {key: value / SAVES for key, value in counted.items()}
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    ckpt.close()
    dist.destroy_process_group()


def main():
    if len(sys.argv) > 1:
        return worker(sys.argv[1])
    work = tempfile.mkdtemp(prefix="collectives-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, work]
    subprocess.run(cmd, check=True, timeout=600, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ranks = [json.load(open(os.path.join(work, f"rank{r}.json"))) for r in range(2)]
    print("| parameters | rank | ckpt's collectives per save | bytes this rank sends into them | size exchanges "
          "(8 bytes each) | digest bytes added to its DCP plan |\n|---|---|---|---|---|---|")
    for params in (str(2 * n) for n in SIZES):
        for r, result in enumerate(ranks):
            x = result[params]
            print(f"| {params} | {r} | {x['calls']:.0f} | {x['bytes']:.0f} | {x['size_exchanges']:.0f} | "
                  f"{x['digests']:.0f} |")


if __name__ == "__main__":
    main()
