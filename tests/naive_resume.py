"""train_fsdp.py with a naive resume, as the field does it wrong (a negative control).

    NAIVE_MODE=dropped|by_position torchrun ... tests/naive_resume.py [train_fsdp.py flags] --resume

ckpt.load is patched from here, outside the shipped files; train_fsdp.py runs unchanged.
  dropped      the weights are restored, the optimizer state is not (fresh AdamW moments, step 0)
  by_position  Optimizer.load_state_dict matches state to parameters by position: with
               same-shaped parameters registered in another order (q/k/v/o_proj, say) the
               moments land silently on the wrong tensors
"""

import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import ckpt  # noqa: E402

real_load = ckpt.load


def naive_load(path, model, optimizer, extra=None, **kw):
    step = real_load(path, model, optimizer, extra, **kw)
    if step is None:
        return step
    if os.environ["NAIVE_MODE"] == "dropped":
        optimizer.state.clear()
    else:
        sd = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        by_shape = {}
        for i, p in enumerate(params):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        perm = {}
        for idx in by_shape.values():
            perm.update(zip(idx, reversed(idx)))
        sd["state"] = {perm[i]: s for i, s in sd["state"].items()}
        optimizer.load_state_dict(sd)
    return step


ckpt.load = naive_load
train = os.path.join(REPO, "train_fsdp.py")
sys.argv = [train] + sys.argv[1:]
runpy.run_path(train, run_name="__main__")
