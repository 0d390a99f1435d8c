"""Save time as commits accumulate in a root with keep=None (one process, world size 1, gloo, a small model).

    python bench/bench_many_commits.py                 # 200 saves; ~1 min

Rank 0 orders commits by the sequence numbers in their manifests at every save. It reads each manifest once per
process (then a stat per commit); the last 20 saves alternate with the cache cleared, as if every manifest were
read again at every save, which is what the previous version did. Prints the median of each.
"""

import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ckpt  # noqa: E402


def main(saves=200):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    root = tempfile.mkdtemp(prefix="bench_many_commits-")
    times = {"a stat per commit (now)": [], "every manifest read (as before)": []}
    try:
        for i in range(1, saves + 1):
            cold = i > saves - 20 and i % 2 == 0
            if cold:
                ckpt._seqs.clear()
            t0 = time.perf_counter()
            ckpt.save(root, i, model, opt)
            if i > saves - 20:
                times[list(times)[cold]].append(time.perf_counter() - t0)
        print(f"## bench_many_commits.py\n\ncommand: python {' '.join(sys.argv)}\n\nload average "
              f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}\n")
        for name, t in times.items():
            print(f"save with {saves - 20}-{saves} commits in the root, {name}: "
                  f"{1000 * statistics.median(t):.1f} ms (median of {len(t)})")
    finally:
        ckpt.close()
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
