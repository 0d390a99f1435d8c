"""Exit-time aborts (issue 12.3): consecutive 2-rank launches that train, save, load and tear down as README says.

Guards against: a job that did all its work and then dies at exit with SIGABRT ("terminate called without an
active exception"), so torchrun reports a failure and a scheduler requeues or alerts. On gloo a plain FSDP2 script
that ends with dist.destroy_process_group() does this in a few percent of runs, with or without ckpt.py; the
teardown of tests/teardown_script.py (the README's) must not, and ckpt.py must add nothing to it.

    python -m pytest -s tests/test_teardown.py                    # CI: one launch per variant, side by side
    TEARDOWN_RUNS=30 python -m pytest -s tests/test_teardown.py   # the full check: 30 launches per test
    python tests/test_teardown.py 30 --no-ckpt --naive            # a rate for any variant (no assert)
"""

import ast
import collections
import os
import re
import sys
import threading

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

from tests.harness import REPO, torchrun  # noqa: E402

SCRIPT = os.path.join(REPO, "tests", "teardown_script.py")
RUNS = int(os.environ.get("TEARDOWN_RUNS", "1"))  # CI: one launch per variant (the thread check is deterministic)


def launches(n, tmp, flags):
    """n launches in a row; returns the failures as (launch, exit code, output tail) and, per launch, the
    threads each rank still had at teardown beyond those it had before its first ckpt call."""
    failed, extra = [], []
    for i in range(n):
        args = ["--ckpt", os.path.join(tmp, f"run{i}")] if "--ckpt" in flags else []
        rc, out = torchrun(args + [f for f in flags if f != "--ckpt"], script=SCRIPT, check=False, timeout=240)
        loaded = "loaded step 4" if "--ckpt" in flags else "loaded step None"
        # Both ranks finished their work: an exit code alone would pass a script that never trained.
        if rc != 0 or out.count(f"trained 4 steps, {loaded}") != 2:
            failed.append((i, rc, out[-1500:]))
        extra.append(leftover_threads(out))
    print(f"\n{' '.join(flags)}{' (our teardown)' if '--naive' not in flags else ''}: {n - len(failed)}/{n} "
          f"launches exited 0 having trained, abort rate {len(failed) / n:.1%}; failed launches: "
          f"{[(i, rc) for i, rc, _ in failed]}; threads at teardown beyond those before the first ckpt call: "
          f"{sorted(set(map(str, extra)))}")
    return failed, extra


def leftover_threads(out):
    """Per rank, the threads alive at teardown that were not there before the first ckpt call."""
    # Not anchored to line starts: the two ranks' lines can interleave on torchrun's stdout.
    seen = {(int(r), when): collections.Counter(ast.literal_eval(names)) for r, when, names in
            re.findall(r"rank (\d+): threads (before ckpt|at teardown) (\[[^]]*\])", out)}
    return {r: sorted((seen[r, w] - seen.get((r, "before ckpt"), collections.Counter())).elements())
            for r, w in seen if w == "at teardown"}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """Both variants' launches, side by side (each launch is mostly start-up: importing torch in three
    processes); {variant: (failed, threads left)}."""
    tmp, out = str(tmp_path_factory.mktemp("teardown")), {}

    def run(variant):
        try:
            out[variant] = launches(RUNS, tmp, [variant])
        except AssertionError as e:  # a launch past its time limit
            out[variant] = [(None, None, str(e)[-1500:])], []

    threads = [threading.Thread(target=run, args=(v,)) for v in ("--ckpt", "--no-ckpt")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240 * RUNS + 60)  # each launch has its own 240-s limit
    return out


def control_threads(variants):
    """Per rank, the threads that the same job without ckpt still has at teardown beyond those before its first
    step (the most of each name over its launches): torch's own, started by training (torch 2.14.1's build starts
    8 pt_autograd_* threads at the first backward; 2.13.0's none). A test of ckpt's threads subtracts them."""
    _, extra = variants["--no-ckpt"]
    control = {}
    for launch in extra:
        for rank, names in launch.items():
            control[rank] = control.get(rank, collections.Counter()) | collections.Counter(names)
    return control


def test_teardown_with_ckpt(variants):
    """Train, save twice, load, then ckpt.close(), gc.collect(), destroy_process_group(): every launch exits 0,
    and after ckpt.close() no thread ckpt started (its gloo groups' workers, the root-claim refresher) is left
    to run into interpreter shutdown: beyond those that the same job without ckpt has too (torch's own). Guards
    against a job that did its work dying at exit (SIGABRT)."""
    failed, extra = variants["--ckpt"]
    assert not failed, failed[0][2]
    control = control_threads(variants)
    ours = [{rank: sorted((collections.Counter(names) - control.get(rank, collections.Counter())).elements())
             for rank, names in launch.items()} for launch in extra]
    shown = {rank: sorted(names.elements()) for rank, names in sorted(control.items())}
    print(f"\nthreads at teardown beyond those before the first step: without ckpt {shown}; with ckpt, beyond "
          f"those: {ours}")
    assert ours == [{0: [], 1: []}] * RUNS, (ours, extra)


def test_teardown_without_ckpt(variants):
    """The same job with no ckpt call and the same teardown: every launch exits 0. Guards against the README's
    teardown itself aborting at exit (then a failure of the test above would not be ckpt's)."""
    failed, _ = variants["--no-ckpt"]
    assert not failed, failed[0][2]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        flags = sys.argv[2:] or ["--ckpt"]
        launches(int(sys.argv[1]), d, flags)
