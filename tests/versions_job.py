"""Load a checkpoint of train_fsdp.py and save what was loaded, unchanged, under another root (tests/test_versions.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/versions_job.py SRC DST <train_fsdp flags>
    python tests/versions_job.py --compare A B       # in one process: prints one JSON line, see compare()

Builds train_fsdp.py's model, optimizer, LR schedule and training state from the flags, as train_fsdp.py does,
restores them with ckpt.load(SRC) (SRC: a root or one step's directory) and writes them with ckpt.save(DST) at the
loaded step, with no training in between: run under one torch release on a checkpoint another release saved, DST
must equal SRC key by key, bit for bit.
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ckpt  # noqa: E402
import train_fsdp  # noqa: E402


def compare(a, b):
    """The newest checkpoints under roots (or step directories) a and b, compared as test_resume.py compares them, in
    this interpreter: tests/test_versions.py runs it under the newer torch of the two that wrote them, which an older
    torch may be unable to read. Prints {"steps": [a's, b's], "keys": [a's, b's], "differ": [keys]}."""
    from test_resume import differing_keys, final_state
    (step_a, want), (step_b, got) = final_state(a), final_state(b)
    print(json.dumps({"steps": [step_a, step_b], "keys": [sorted(want), sorted(got)],
                      "differ": list(differing_keys(want, got))}))


def main():
    if sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3])
    src, dst, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    args = train_fsdp.get_args(argv)
    dist.init_process_group("gloo")
    try:
        model = train_fsdp.build_model(args, torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
        extra = {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, train_fsdp.lr_lambda(args)),
                 "data": ckpt.Position(args.batch_size, seed=args.seed, seq_len=args.seq_len)}
        step = ckpt.load(src, model, opt, extra)
        if step is None:
            raise SystemExit(f"versions_job.py: no checkpoint in {src}")
        path = ckpt.save(dst, step, model, opt, extra)
        print(f"rank {dist.get_rank()}: torch {torch.__version__} loaded step {step} from {src}, saved {path}",
              flush=True)
    finally:  # train_fsdp.py's teardown: a bare destroy_process_group() can abort at exit on gloo
        try:
            ckpt.close()
        finally:
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
