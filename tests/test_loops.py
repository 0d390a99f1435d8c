"""Test the way users train: the loops people write around ckpt.py, not the protocol's corner cases.

Guards against: a save that changes the run (a save at step 0 that steps the optimizer with lr 0 to make its
state, placeholders for parameters without state); an async save that is committed only if the loop calls ckpt
again; a second save of the same step that keeps the first state, or leaves leftovers; values stored once that
differ between ranks, saved as rank 0's or refused without saying which; a forgotten --resume that trains from
scratch over a root of checkpoints; a plain `python` script (no process group) whose checkpoint does not load
elsewhere.

Few launches (ranks are forked from warm processes, tests/launch.py, with torchrun's environment):
  * tests/loops_job.py `ranks`: ONE 2-rank FSDP2 job for scenarios 1, 3, 4 and the 2-rank half of 6;
  * `python tests/loops_job.py plain-save` (a real plain process), then plain-load in a fresh process;
  * train_fsdp.py three times on one root: an --async-save run SIGKILLed after its commit, a relaunch without
    --resume (refused), a relaunch with --resume (scenarios 2 and 5).

    python -m pytest -q -s tests/test_loops.py
"""

import os
import signal
import sys
import time

import pytest

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
from tests.harness import REPO, SMALL, TRAIN, read_log, result_line, run  # noqa: E402

JOB = os.path.join(REPO, "tests", "loops_job.py")
INJECT = os.path.join(REPO, "tests", "inject.py")
KINDS = ["adamw", "sgd_momentum", "muon_adamw"]


def wait_for(predicate, timeout, every=0.02):
    """The time predicate() first held (time.monotonic()), or None after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(every)
    return None


def listing(root):
    return sorted(n for n in os.listdir(root) if n != ckpt.OWNER) if os.path.isdir(root) else []


def leftovers(names):
    return [n for n in names if n.startswith((ckpt.TMP, ckpt.ABANDONED))]


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Scenario 6, first half: a plain `python` process saves; another plain process (a fresh fork of a warm
    interpreter, no process group either) loads."""
    d = tmp_path_factory.mktemp("loops_plain")
    t0 = time.monotonic()
    _, out = run([sys.executable, JOB, "plain-save", str(d)], timeout=120)
    saved, t1 = result_line(out), time.monotonic()
    _, out_load = launch.run([JOB, "plain-load", d], nproc=1, timeout=60)
    print(f"\nplain processes: save {t1 - t0:.1f} s (python start-up included), load {time.monotonic() - t1:.1f} s")
    return d, saved, dict(result_line(out_load), warned=[ln for ln in out.splitlines() + out_load.splitlines()
                                                        if "torch.distributed is disabled" in ln])


@pytest.fixture(scope="module")
def job(plain, tmp_path_factory):
    """Scenarios 1, 3, 4 and 6 (2-rank half) in one 2-rank job: {scenario: [rank 0's figures, rank 1's]}."""
    d = tmp_path_factory.mktemp("loops_job")
    t0 = time.monotonic()
    _, out = launch.run([JOB, "ranks", d / "work", plain[0]], timeout=150)
    res = result_line(out)
    secs = {name: res[name][0].get("secs") for name in res if isinstance(res[name], list)}
    print(f"\n2-rank job: {time.monotonic() - t0:.1f} s; scenarios (s): {secs}")
    assert "hung" not in res, f"scenario {res['hung']} hung:\n{out[-4000:]}"
    for name, every in res.items():
        for r, mine in enumerate(every if isinstance(every, list) else []):
            assert "unexpected" not in mine, f"{name} on rank {r}: {mine['unexpected']}\n{mine['trace']}"
    return res


N = 3  # the async save's step
MODEL = SMALL + ["--n-layers", "1"]  # argparse keeps the last --n-layers
ARGS = MODEL + ["--steps", "40", "--save-every", str(N), "--async-save", "--seed", "3", "--dropout", "0.1",
                "--timeout", "60", "--ckpt-timeout", "60"]
DELAY = 0.75  # seconds each rank sleeps after each optimizer step in the first run: >= 2.25 s from save to save


@pytest.fixture(scope="module")
def relaunch(tmp_path_factory):
    """train_fsdp.py --async-save, run 1: saves step N in the background, trains on and never calls ckpt again
    (the next save is at 2N, each step takes over DELAY s), SIGKILLed from outside after step N's commit appeared
    and two more steps were logged. Run 2: relaunched without --resume. Run 3: relaunched with --resume."""
    d = tmp_path_factory.mktemp("loops_relaunch")
    root = d / "ckpt"
    args = ARGS + ["--ckpt-dir", root]
    logs = {name: d / f"{name}.jsonl" for name in ("killed", "forgot", "resumed")}

    def logged(name):
        return max(read_log(logs[name])) if logs[name].exists() and logs[name].stat().st_size else 0

    # FAULT=preempt only slows training here (FAULT_STEP 0: it never signals readiness).
    env = dict(os.environ, FAULT="preempt", FAULT_RANK="all", FAULT_STEP="0", FAULT_DELAY=str(DELAY),
               FAULT_DIR=str(d))
    t0 = time.monotonic()
    killed = launch.start([INJECT, *args, "--log-file", logs["killed"]], env=env, out=d / "killed.txt")
    saved_at = wait_for(lambda: logged("killed") >= N, 60)  # logged right before save(N) is called
    manifest = os.path.join(ckpt.step_dir(str(root), N), ckpt.MANIFEST)
    committed_at = saved_at and wait_for(lambda: os.path.isfile(manifest), 30, every=0.005)
    at_commit = {"logged": logged("killed"), "listing": listing(root)}
    went_on = committed_at and wait_for(lambda: logged("killed") >= N + 2, 30)
    killed.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    _, out = killed.wait(30)
    first = {"rcs": killed.rcs, "secs": killed_at - t0, "commit_after_save": committed_at and committed_at - saved_at,
             "kill_after_save": saved_at and killed_at - saved_at, "at_commit": at_commit, "went_on": bool(went_on),
             "logged": logged("killed"), "listing": listing(root), "out": out}

    def snapshot():
        return {os.path.relpath(os.path.join(p, f), root): (os.path.getsize(os.path.join(p, f)),
                                                            os.stat(os.path.join(p, f)).st_mtime_ns)
                for p, _, files in os.walk(root) for f in files if f != ckpt.OWNER}

    before, t = snapshot(), time.monotonic()
    rc, out = launch.run([TRAIN, *args, "--log-file", logs["forgot"]], timeout=60, check=False)
    forgot = {"rc": rc, "out": out, "secs": time.monotonic() - t, "logged": logs["forgot"].exists() and
              logs["forgot"].read_text(), "unchanged": snapshot() == before, "listing": listing(root)}
    t = time.monotonic()
    rc, out = launch.run([TRAIN, *args, "--resume", "--stop-after", str(N + 2), "--log-file", logs["resumed"]],
                         timeout=60, check=False)
    resumed = {"rc": rc, "out": out, "secs": time.monotonic() - t, "listing": listing(root)}
    print(f"\ntrain_fsdp.py: killed run {first['secs']:.1f} s, relaunch without --resume {forgot['secs']:.1f} s, "
          f"with --resume {resumed['secs']:.1f} s")
    return {"root": str(root), "first": first, "forgot": forgot, "resumed": resumed,
            "logs": {name: read_log(path) if path.exists() else {} for name, path in logs.items()}}


# ------------------------------------------------------------------------- 1. saves at step 0, in a loop


@pytest.mark.parametrize("kind", KINDS)
def test_saving_at_step_0_changes_nothing(job, kind):
    """A loop that saves at the top of every other iteration (step 0 before the optimizer's first step) must
    train bit-identically to the same loop without saves: losses, final weights, every optimizer value. Guards
    against a save that makes the optimizer's state by stepping it with lr 0 (torch's get_optimizer_state_dict
    on an optimizer without state): Adam's bias correction would then start one step late, forever. Also each
    save must leave opt.state as it was: the same parameters with state (none at step 0; all but `aux`, whose
    first gradient comes at step 3, at step 2), every tensor and option unchanged."""
    for r, every in enumerate(job["step0"]):
        mine = every[kind]
        for s in mine["saves"]:
            print(f"\n{kind} rank {r}: save of step {s['step']}: {len(s['with_state'])} parameters with state, "
                  f"unchanged by the save: {s['same_params_with_state']}, max |dstate| {s['max_dstate']:.1e}", end="")
        print(f"\n{kind} rank {r}: with saves vs without: max |dloss| {mine['dloss']:.1e} over {len(mine['losses'])} "
              f"steps, max |dweights| {mine['dweights']:.1e}, max |dstate| {mine['dopt']:.1e} "
              f"({mine['n_opt_values']} optimizer values)")
        assert [s["step"] for s in mine["saves"]] == [0, 2]
        assert [s["with_state"] for s in mine["saves"]] == [[], ["a.bias", "a.weight", "b.bias", "b.weight",
                                                                  "norm.bias", "norm.weight"]]
        for s in mine["saves"]:
            assert s["same_params_with_state"] and s["same_keys"] and s["max_dstate"] == 0.0, s
        assert mine["dloss"] == 0.0 and mine["dweights"] == 0.0 and mine["dopt"] == 0.0
        assert mine["losses"] == mine["ref_losses"]
        assert "aux.weight" in mine["ref_with_state"], "aux must have state by the end, or the case tests nothing"


def test_state_check_sees_a_save_that_steps_the_optimizer(job):
    """Control: torch's get_optimizer_state_dict (what ckpt.py used before) gives every parameter state, at step
    1.0, on an optimizer that had none: the `with_state` check above would catch a save that did so."""
    control = job["step0"][0]["control"]
    print(f"\nget_optimizer_state_dict on a fresh AdamW: parameters with state {len(control['before'])} -> "
          f"{len(control['after'])}, their step {control['steps']}")
    assert control["before"] == [] and len(control["after"]) == 8


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_step_0_and_from_lazy_state(job, kind):
    """A resume from the step-0 checkpoint (saved before any optimizer step: no state at all; a rollback, said with
    check_root(rollback_to=0)) and from step 2 (aux without state) must train bit-identically to the run without
    saves, and load() must give state only to the parameters saved with state (no placeholders: a zero moment at
    step 0 differs from none). The resumed loops save too (the step they loaded is saved again first), as a
    resumed user loop does."""
    for r, every in enumerate(job["step0"]):
        mine = every[kind]
        for name, start in (("resume0", 0), ("resume2", 2)):
            res = mine[name]
            print(f"\n{kind} rank {r}: loaded step {res['loaded']} into fresh weights: "
                  f"{len(res['with_state_at_load'])} parameters with state; trained steps {start}-3: max |dloss| "
                  f"{res['dloss']:.1e}, max |dweights| {res['dweights']:.1e}, max |dstate| {res['dopt']:.1e}", end="")
            assert res["loaded"] == start
            assert res["with_state_at_load"] == mine["saves"][start // 2]["with_state"]
            assert res["dloss"] == 0.0 and res["dweights"] == 0.0 and res["dopt"] == 0.0
            assert res["losses"] == mine["ref_losses"][start:]
            for s in res["saves"]:
                assert s["same_params_with_state"] and s["max_dstate"] == 0.0, s
        print(f"\n{kind}: root after the rollback to step 0: {mine['listing']}")
        assert [n for n in mine["listing"] if not n.startswith(ckpt.ABANDONED)] == ["step-00000000", "step-00000002"]
        aside = [n for n in mine["listing"] if n.startswith(ckpt.ABANDONED)]
        assert len(aside) == 1 and aside[0].startswith(f"{ckpt.ABANDONED}step-00000002-"), "the old step 2, given up"


# --------------------------------------------------------- 2. async save, then the loop never calls ckpt again


def test_async_save_commits_without_another_ckpt_call(relaunch):
    """An async save must be committed by itself, while the loop trains on without calling ckpt again (no
    wait(), no next save): a job killed (preempted, OOM) seconds later must resume from that step. Guards
    against a commit left for the next save(), load() or close() call, which a killed job never makes."""
    first, resumed, logs = relaunch["first"], relaunch["resumed"], relaunch["logs"]
    at_commit = first["at_commit"]
    print(f"\nasync save of step {N}: committed {first['commit_after_save']:.3f} s after the save started (training "
          f"had logged step {at_commit['logged']}), SIGKILL {first['kill_after_save']:.2f} s after the save at step "
          f"{first['logged']}; exit codes {first['rcs']}; root then held {first['listing']}")
    assert f"checkpoint of step {N} staged, writing in the background" in first["out"], first["out"][-3000:]
    assert first["commit_after_save"] is not None, f"step {N} was never committed:\n{first['out'][-3000:]}"
    assert at_commit["logged"] < 2 * N, "the commit came only after the loop reached its next save (a ckpt call)"
    assert first["went_on"] and first["logged"] < 2 * N, "training did not go on, or reached the next save"
    assert first["rcs"] == [-signal.SIGKILL] * 2
    assert first["listing"] == [f"step-{N:08d}"], "nothing else: no other save was started"
    assert ckpt.verify_files(ckpt.step_dir(relaunch["root"], N), ckpt.read_manifest(ckpt.step_dir(relaunch["root"],
                                                                                                     N))) == []

    killed, again = logs["killed"], logs["resumed"]
    steps = sorted(again)
    dloss = max(abs(killed[s]["loss"] - again[s]["loss"]) for s in steps)
    print(f"--resume: exit {resumed['rc']}, trained steps {steps} in {resumed['secs']:.1f} s; vs the killed run: "
          f"max |dloss| {dloss:.1e}")
    assert resumed["rc"] == 0, resumed["out"][-3000:]
    assert f"resumed from step {N}" in resumed["out"]
    assert steps == list(range(N + 1, N + 3))
    for s in steps:
        assert (again[s]["loss"], again[s]["lr"]) == (killed[s]["loss"], killed[s]["lr"]), f"step {s} differs"


# ------------------------------------------------------------------ 3. the same step saved twice


def test_same_step_saved_twice_holds_the_second_state(job):
    """save(5), another optimizer step with the loop's counter still at 5, save(5): the checkpoint at the returned
    path must hold the second state. Guards against a second save of a step being skipped ("already saved"), or
    committed beside the first, so that a resume silently continues from the first."""
    for r, mine in enumerate(job["same_step"]):
        print(f"\nrank {r}: loaded {os.path.basename(mine['path'])}: vs second state max |diff| "
              f"{mine['vs_second']:.1e}, vs first {mine['vs_first']:.3e}, its weights {mine['vs_first_weights']:.3e} "
              f"({mine['n_values']} values); root holds {mine['listing']}")
        assert mine["path"] == mine["first_path"] and mine["loaded"] == 5
        assert mine["vs_second"] == 0.0 and mine["vs_first"] > 0.0 and mine["vs_first_weights"] > 0.0
        assert mine["listing"] == ["step-00000005"]


@pytest.mark.parametrize("periodic", ["final_sync", "final_async"])
def test_periodic_save_at_the_last_step_then_final_save(job, periodic):
    """The usual end of a loop: the periodic save fires at the last step (synchronous, or async and not waited
    for), then the final save of the same state. Both must succeed, leaving exactly one step-N and no
    .tmp-/.abandoned- leftovers, and it must load equal to the state."""
    for r, every in enumerate(job["same_step"]):
        mine = every[periodic]
        print(f"\n{periodic} rank {r}: periodic -> {os.path.basename(mine['periodic'])}, final -> "
              f"{os.path.basename(mine['final'])}; root holds {mine['listing']}; loaded vs state max |diff| "
              f"{mine['vs_state']:.1e}")
        assert mine["periodic"] == mine["final"] and mine["loaded"] == 4
        assert mine["listing"] == ["step-00000004"] and leftovers(mine["listing"]) == []
        assert mine["committed"] == [4] and mine["vs_state"] == 0.0


# ------------------------------------------------------------- 4. values stored once, differing between ranks


@pytest.mark.parametrize("case, key", [("buffer", "model.stats.running_mean"), ("lr", "optim.0.groups.")])
def test_values_differing_between_ranks_are_refused_by_key(job, case, key):
    """DCP stores one copy of every value that is not a DTensor (buffers, optimizer options and steps): if ranks
    hold different ones, rank 0's would be saved and every other rank resumed with it. An unsynchronised running
    mean, and an LR scaled by the rank, must make save() raise CheckpointError on every rank, within seconds,
    naming the key and the ranks, with nothing written."""
    for r, every in enumerate(job["refusals"]):
        mine = every[case]
        print(f"\n{case} rank {r}: {mine['raised']} after {mine['secs']:.3f} s: {mine['msg'][:160]}; root "
              f"{'holds ' + str(mine['listing']) if mine['exists'] else 'not created'}")
        assert mine["raised"] == "CheckpointError" and mine["secs"] < 5
        assert "1 value(s) stored once differ among the ranks that hold them" in mine["msg"]
        assert f": {key}" in mine["msg"]
        assert "(ranks 0 | 1)" in mine["msg"] and "Nothing was written" in mine["msg"]
        assert mine["listing"] == []
    if case == "buffer":
        values = [every["buffer"]["value"] for every in job["refusals"]]
        assert values[0] != values[1], "the ranks' running means must differ, or the case tests nothing"


# ------------------------------------------------------------------------------- 5. a forgotten --resume


def test_forgotten_resume_fails_before_training(relaunch):
    """A relaunch without --resume on a root holding checkpoints would train from scratch and, at its first save,
    move the old run's steps aside (or, with retention, delete them). It must exit non-zero before training a
    step, naming the newest commit, leaving the root's steps untouched; with --resume it continues."""
    forgot, resumed, root = relaunch["forgot"], relaunch["resumed"], relaunch["root"]
    newest = ckpt.step_dir(root, N)
    print(f"\nwithout --resume: exit {forgot['rc']} after {forgot['secs']:.1f} s; log file "
          f"{'empty' if not forgot['logged'] else 'written'}; root unchanged: {forgot['unchanged']}; "
          f"with --resume: exit {resumed['rc']}, root then {resumed['listing']}")
    assert forgot["rc"] != 0
    assert not forgot["logged"], "a step was trained"
    assert "step     1 |" not in forgot["out"]
    message = f"holds checkpoints up to {newest}, and this run loaded none of them"
    assert forgot["out"].count(message) >= 2, f"every rank must say why:\n{forgot['out'][-3000:]}"
    assert forgot["unchanged"] and forgot["listing"] == [f"step-{N:08d}"]
    assert resumed["rc"] == 0 and f"resumed from step {N}" in resumed["out"]
    assert resumed["listing"] == [f"step-{N:08d}", f"step-{N + 2:08d}"]


# ------------------------------------------------------------------ 6. a plain process, no process group


def test_readme_loop_resumes(plain):
    """README's "Use it in your own training loop", as written: ckpt.load(root, ...), then ckpt.check_root(root).
    Run again on a root holding a checkpoint (a resume), it must load it; check_root() first, before any load, is
    refused, the message saying what a resume is (load() with the optimizer) and the fix. Guards against a
    documented loop that cannot resume, and a claim that lets a run that forgot to resume start over on a used
    root."""
    readme, claim_first = plain[2]["readme_order"], plain[2]["claim_first"]
    print(f"\nREADME's order (load, then check_root) on a root holding step 3: "
          f"{readme['error'] or 'loaded step %d, max |dweights| %.1e' % (readme['step'], readme['dweights'])}"
          f"\ncheck_root() first: {claim_first}")
    assert readme["error"] is None, f"README's loop cannot resume: {readme['error']}"
    assert readme["step"] == 3 and readme["dweights"] == 0.0
    assert claim_first and "this run loaded none of them into its model as a resume" in claim_first
    assert "(load() with the optimizer; a weights-only load is an initialisation)" in claim_first
    assert "resume from the root, or use another" in claim_first


def test_plain_process_save_and_load(plain):
    """A script run with plain `python` (no init_process_group, a plain nn.Module and AdamW) must save, and
    another plain process must load it: weights only, weights and extras (a scheduler, a data position), and
    with the optimizer, which then trains on exactly as the saving process did; neither prints DCP's warning that
    it assumes one process."""
    _, saved, loaded = plain
    print(f"\nplain save: {saved['path']} in {saved['secs']:.3f} s, manifest world size "
          f"{saved['manifest_world_size']}, process group: {saved['initialized']}")
    assert not saved["initialized"] and saved["manifest_world_size"] == 1
    assert not loaded["initialized"]
    print(f"DCP's 'torch.distributed is disabled' warnings printed: {len(loaded['warned'])}")
    assert loaded["warned"] == [], "a plain process knows it is one: DCP's warning is noise there"
    for name in ("weights_only", "extras", "optimizer"):
        r = loaded[name]
        print(f"plain load, {name}: step {r['loaded']}, max |dweights| {r['dweights']:.1e}, parameters with state "
              f"{len(r['with_state'])}" + (f", max |dstate| {r['dopt']:.1e}, next 2 steps max |dloss| "
                                          f"{r['dloss_next']:.1e}" if name == "optimizer" else ""))
        assert r["loaded"] == 3 and r["dweights"] == 0.0
    assert loaded["weights_only"]["with_state"] == [] and loaded["extras"]["with_state"] == []
    for name in ("extras", "optimizer"):
        assert loaded[name]["sched_equal"] and loaded[name]["position"] == {"samples": 12}
    opt = loaded["optimizer"]
    assert opt["dopt"] == 0.0 and opt["dloss_next"] == 0.0
    assert opt["with_state"] == saved["with_state"] and "aux.weight" not in opt["with_state"]


def test_plain_checkpoint_loads_at_two_ranks(job):
    """A checkpoint saved by a plain process (world of one) must load into a 2-rank FSDP2 job: its full weights
    equal the saved ones."""
    for r, every in enumerate(job["plain_at_two"]):
        mine = every["weights_only"]
        print(f"\nrank {r}: plain checkpoint into FSDP2 at 2 ranks: step {mine['loaded']}, max |dweights| "
              f"{mine['dweights']:.1e} over {mine['n']} parameters")
        assert mine["loaded"] == 3 and mine["dweights"] == 0.0


def test_plain_checkpoint_with_optimizer_trains_at_two_ranks(job):
    """The same checkpoint with its optimizer (and scheduler): the optimizer state must come back laid out like
    the FSDP2 parameters (DTensors), so that the next step runs. Guards against a resume that loads without
    error and then fails at its first optimizer step (plain tensors beside DTensors)."""
    for r, every in enumerate(job["plain_at_two"]):
        mine = every["with_optimizer"]
        print(f"\nrank {r}: with the optimizer: step {mine.get('loaded')}, max |dweights| {mine.get('dweights')}, "
              f"max |dstate| {mine.get('dopt')}, moments held as {mine.get('moment_types')} (a.weight: local shard "
              f"{mine.get('a.weight', {}).get('param_local_shape')}, exp_avg {mine.get('a.weight', {}).get('exp_avg')})"
              f"; next step: {mine.get('error') or 'loss %.4f' % mine['next_loss']}")
        assert mine.get("loaded") == 3 and mine["dweights"] == 0.0 and mine["dopt"] == 0.0
        assert "error" not in mine, mine["error"]
        assert mine["moment_types"] == ["DTensor"], "optimizer moments loaded as plain tensors for DTensor parameters"


# ------------------------------------------------------------- 7. an evaluation copy, per-rank declarations


def test_evaluation_copy_changes_nothing_of_the_run(job):
    """An evaluation copy (a second model) loads step 1, weights only, beside a run that committed step 2; the run
    trains on and saves step 3. In the field the last load anywhere in the process was taken for the step the run
    continues from: step 2 was moved aside as abandoned, and the weights-only load rewound the run's torch and
    Python generators (its dropout stream jumped back). No load moves anything (a rollback is said), and a
    weights-only load touches no generator. Control: the training model itself loading step 1 with its optimizer
    then saving step 2 is refused on every rank (step 3 is later), naming check_root(rollback_to=) and moving
    nothing; check_root(rollback_to=1) moves steps 2 and 3 aside, and the save of step 2 works."""
    for r, res in enumerate(job["eval_copy"]):
        print(f"\nrank {r}: evaluation copy loaded step {res['eval_loaded']}; generators kept: torch "
              f"{res['torch_rng_kept']}, python {res['python_rng_kept']}; after save 3: {res['after_save3']}; "
              f"control, save 2 after loading step 1: {res['save2_unsaid']['raised']}: "
              f"{res['save2_unsaid']['msg'][-160:]}; after check_root(rollback_to=1) and save 2: {res['after_save2']}")
        assert res["eval_loaded"] == 1 and res["torch_rng_kept"] and res["python_rng_kept"]
        assert res["save3"]["raised"] is None
        assert res["after_save3"] == ["step-00000001", "step-00000002", "step-00000003"]
        assert res["rollback_loaded"] == 1
        unsaid = res["save2_unsaid"]
        assert unsaid["raised"] == "CheckpointError" and unsaid["secs"] < 5
        assert "holds step-00000003, a later step than 2" in unsaid["msg"] and "rollback_to=" in unsaid["msg"]
        assert res["after_unsaid"] == res["after_save3"], "a refused save moves nothing"
        assert res["rollback"]["raised"] is None and res["save2"]["raised"] is None
        aside = sorted(n.split("-")[2] for n in res["after_save2"] if n.startswith(".abandoned-step-"))
        assert aside == ["00000002", "00000003"]
        assert [n for n in res["after_save2"] if not n.startswith(".abandoned-")] == ["step-00000001", "step-00000002"]


def test_per_rank_is_declared_not_guessed(job):
    """A Sampler and a ckpt.PerRank extra whose states are equal on every rank are stored per rank (rank.<r>.*),
    and come back to each rank; an undeclared extra whose state differs between ranks is refused naming the key,
    the ranks and the fix. In the field a per-rank position equal on every rank was stored once, and resumed at the
    wrong samples at another world size, silently."""
    for r, res in enumerate(job["per_rank"]):
        print(f"\nrank {r}: keys {res['keys']}; sampler back at {res['sampler_back']}, position {res['position_back']}"
              f"; differing values: {res['differing']['msg'][:200]}")
        assert res["keys"] == ["rank.0.extra.position", "rank.0.extra.sampler", "rank.1.extra.position",
                               "rank.1.extra.sampler"]
        assert res["sampler_back"] == 5 and res["position_back"] == {"batches": 5}
        msg = res["differing"]["msg"]
        assert res["differing"]["raised"] == "CheckpointError" and "extra.seen.n (ranks 0 | 1)" in msg
        assert "ckpt.PerRank(obj)" in msg and res["differ_listing"] == []
        assert res["same_meta"]["raised"] is None, f"meta equal as JSON, in another key order: {res['same_meta']}"
