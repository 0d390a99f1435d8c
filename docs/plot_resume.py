"""Draw docs/resume.png from real runs: uninterrupted, resumed with ckpt.py, and naive resumes.

    pip install matplotlib          # optional extra, only for this picture
    python docs/plot_resume.py      # about 3 minutes on a 2-core CPU

Four 2-rank runs of train_fsdp.py with the same seed: one uninterrupted; one stopped at
step 60 and resumed with ckpt.load; two resumed from the same checkpoint by the naive
loaders of tests/naive_resume.py (optimizer state dropped / matched by position).
"""

import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.harness import read_log, torchrun  # noqa: E402

STEPS, STOP = 120, 60
ARGS = ["--steps", str(STEPS), "--save-every", "0", "--lr", "1e-2", "--warmup", "10"]


def main(out=os.path.join(REPO, "docs", "resume.png")):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    work = tempfile.mkdtemp(prefix="plot-resume-")
    try:
        def run(name, *extra, script=None, env=None, ckpt="ckpt"):
            kw = {"script": script} if script else {}
            torchrun(ARGS + ["--ckpt-dir", os.path.join(work, ckpt), "--log-file", os.path.join(work, name + ".jsonl"), *extra],
                     timeout=600, env=env, **kw)
            return read_log(os.path.join(work, name + ".jsonl"))

        ref = run("uninterrupted", ckpt="ref")
        run("resumed", "--stop-after", str(STOP))
        for mode in ("dropped", "by_position"):
            shutil.copytree(os.path.join(work, "ckpt"), os.path.join(work, mode))
        resumed = run("resumed", "--resume")
        naive = {mode: run(mode, "--resume", ckpt=mode, script=os.path.join(REPO, "tests", "naive_resume.py"),
                           env=dict(os.environ, NAIVE_MODE=mode)) for mode in ("dropped", "by_position")}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    steps = sorted(ref)
    after = [s for s in steps if s > STOP]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    for ax, lo in zip(axes, (1, STOP - 15)):  # the whole run, and a zoom on the resume
        shown = [s for s in steps if s >= lo]
        ax.plot(shown, [ref[s]["loss"] for s in shown], color="black", lw=4, alpha=0.3, label="uninterrupted")
        ax.plot(after, [resumed[s]["loss"] for s in after], color="tab:blue", lw=1.2,
                label=f"resumed at {STOP} with ckpt.py (max |Δloss| = {max(abs(resumed[s]['loss'] - ref[s]['loss']) for s in after):.0e})")
        for mode, color, text in (("dropped", "tab:red", "optimizer state not restored"),
                                  ("by_position", "tab:orange", "optimizer state matched by position")):
            ax.plot(after, [naive[mode][s]["loss"] for s in after], color=color, lw=1.2,
                    label=f"naive: {text} (max |Δloss| = {max(abs(naive[mode][s]['loss'] - ref[s]['loss']) for s in after):.2f})")
        ax.axvline(STOP, color="gray", ls=":", lw=1)
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss (mean over 2 ranks)")
    axes[0].set_title("whole run")
    axes[1].set_title(f"around the resume at step {STOP}")
    axes[1].legend(fontsize=8)
    fig.suptitle("Resuming an FSDP2 run from a sharded checkpoint (train_fsdp.py, 2 ranks, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    for mode in naive:
        print(f"{mode}: max |dloss| after resume = {max(abs(naive[mode][s]['loss'] - ref[s]['loss']) for s in after):.4f}")
    print(f"ckpt.py resume: max |dloss| = {max(abs(resumed[s]['loss'] - ref[s]['loss']) for s in after):.3e}")


if __name__ == "__main__":
    main()
