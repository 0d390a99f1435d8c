"""Failure paths around a run's checkpoints (issue 12): rollback, one run per root, one rank failing, odd steps.

Guards against: a rollback that is inferred from a load instead of said (check_root(rollback_to=)), or whose
saves are deleted by retention, refused, or lose the old branch; a later resume loading the abandoned branch; a
weights-only load (an initialisation) letting a save replace a step's optimizer state; a run saving to two roots
refused on its resume; a file system without flock() failing with a raw OSError, or lock=False not working; two
live runs on one root deleting each other's saves, or a reader (an evaluation job) being refused or touching the
writer's claim; a requeue that cannot take over a dead run's root (also in a restarted container, where our pid
is the dead run's); a save that deletes a file system's own entries (.nfsXXXX, lost+found) or a data file; a
reader whose step was deleted by retention getting an unexplained error; one rank's local failure (user
state_dict(), mkdir, a node-local root, DCP's write, CRC, manifest, .metadata, shard read, set_model_state_dict,
the async copy to host memory) leaving the other ranks waiting out the hour-long checkpoint timeout; ranks given
different save/load arguments taking different collective paths; a timeout that kills every later save; steps
>= 10**8 ordered by name; a Ctrl-C in PendingSave.wait() losing the save.

Few launches, run concurrently (most of each is start-up and waiting): the main 2-rank job of
tests/failpath_job.py (its ranks forked from warm processes, tests/launch.py: no torch import) runs the scenarios
and is also the live run holding a root; a second one, under torchrun, runs the scenarios that mostly wait
(timeouts); train_fsdp.py (one rank, forked the same way) is launched on the held root as a second run, and runs
twice for --resume-from. Each test asserts and prints one scenario's figures.

    python -m pytest -v -s tests/test_failpaths.py
"""

import json
import os
import re
import threading
import time

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest

from tests.harness import REPO, SMALL, TRAIN, read_log, torchrun

JOB = os.path.join(REPO, "tests", "failpath_job.py")
ROLLBACK = ".rollback-to-"  # ckpt.ROLLBACK: this process does not import ckpt
BOUND = 30  # seconds: every rank must have raised by then, while the checkpoint timeout is an hour


# Scenarios that mostly wait (timeouts): a second job runs them beside the main one.
WAITING = ["timeout_recovery", "timeout_first_save", "timeout_async"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("failpaths")
    live = d / "live"
    t0 = time.monotonic()
    launched = {"main": {}, "waiting": {}}
    second, resume = {"rc": None, "out": "", "secs": 0.0}, {}

    def run_job(name, args):  # main: warm ranks, beside the plain runs; the other under torchrun
        t = time.monotonic()
        argv = [str(d / f"{name}_out"), str(d / f"{name}_work"), *args]
        try:
            if name == "main":
                rc, out = launch.start([JOB, *argv], out=d / "main_output.txt", beside=True).wait(timeout=420)
            else:
                rc, out = torchrun(argv, script=JOB, check=False, timeout=420)
        except AssertionError as e:  # killed at its time limit: the tests fail on its missing results
            rc, out = None, str(e)
        launched[name].update(rc=rc, out=out, secs=time.monotonic() - t)

    def run_resume():  # train_fsdp.py, then again with --resume-from an older step (a relaunched run)
        t = time.monotonic()
        root = d / "resume"
        common = SMALL + ["--steps", "8", "--save-every", "2", "--keep", "3", "--ckpt-dir", str(root)]
        try:
            resume["rc_a"], resume["out_a"] = plain(common + ["--log-file", str(d / "a.jsonl")])
            resume["old8"] = json.loads((root / "step-00000008" / "manifest.json").read_text())
            resume["old8_inode"] = (root / "step-00000008").stat().st_ino
            resume["rc_unsaid"], resume["out_unsaid"] = plain(common + ["--resume-from", str(root / "step-00000004")])
            resume["rc_b"], resume["out_b"] = plain(common + ["--resume-from", str(root / "step-00000004"),
                                                              "--rollback", "--log-file", str(d / "b.jsonl")])
            resume["entries"] = sorted(os.listdir(root))
            resume["a"], resume["b"] = read_log(d / "a.jsonl"), read_log(d / "b.jsonl")
            resume["root"] = root
        except (OSError, ValueError, AssertionError) as e:
            resume["error"] = f"{type(e).__name__}: {e}"
        resume["secs"] = time.monotonic() - t

    threads = [threading.Thread(target=run_job, args=("main", ["--live-root", str(live), "--skip", *WAITING])),
               threading.Thread(target=run_job, args=("waiting", ["--only", *WAITING])),
               threading.Thread(target=run_resume)]
    for t in threads:
        t.start()
    try:
        # The main job claims the live root early; then train_fsdp.py tries to use it too.
        ready = f"{live}.ready"
        while not os.path.exists(ready) and threads[0].is_alive() and time.monotonic() - t0 < 300:
            time.sleep(0.1)
        if os.path.exists(ready):
            t = time.monotonic()
            second["rc"], second["out"] = plain(SMALL + ["--steps", "4", "--save-every", "2", "--ckpt-dir", str(live),
                                                         "--log-file", str(d / "second.jsonl")])
            second["secs"] = time.monotonic() - t
    finally:
        open(f"{live}.release", "w").close()  # the main job then goes on saving to it, and closes
        for t in threads:
            t.join(timeout=480)
    second["logged"] = read_log(d / "second.jsonl") if (d / "second.jsonl").exists() else {}
    main, waiting = launched["main"], launched["waiting"]
    print(f"\nmain job: exit {main.get('rc')} after {main.get('secs', 0):.1f} s; job of the waiting scenarios: exit "
          f"{waiting.get('rc')} after {waiting.get('secs', 0):.1f} s; second train_fsdp.py run: exit {second['rc']} "
          f"after {second['secs']:.1f} s; train_fsdp.py twice for --resume-from: exits {resume.get('rc_a')}, "
          f"{resume.get('rc_b')} after {resume.get('secs', 0):.1f} s; all {time.monotonic() - t0:.1f} s")

    def results(name):
        return [json.loads((d / name / f"results.{r}.json").read_text()) if (d / name / f"results.{r}.json").exists()
                else {} for r in (0, 1)]

    return {"main": results("main_out"), "waiting": results("waiting_out"), "launched": launched,
            "second": second, "resume": resume, "live": live}


def plain(args):
    """`train_fsdp.py ARGS` in a world of one: one rank forked from a warm process (tests/launch.py), beside the
    fixture's other jobs (torchrun starts three processes, python one, each importing torch: on 2 cores that is
    most of these tests' time). What these runs check does not depend on the world size or the launcher;
    test_resume.py resumes at 2 ranks under torchrun."""
    return launch.run([TRAIN, *args], nproc=1, check=False, timeout=300, beside=True)


def scenario(jobs, name):
    """Both ranks' figures of one scenario; a scenario that hung or crashed fails here, by name."""
    job = "waiting" if name in WAITING else "main"
    res = [r.get(name) for r in jobs[job]]
    for rank, r in enumerate(res):
        assert r is not None, f"scenario {name} never finished on rank {rank}:\n{jobs['launched'][job]['out'][-4000:]}"
        assert "hung_after_s" not in r, f"scenario {name} still ran after {r['hung_after_s']} s on rank {rank}"
        assert "unexpected" not in r, f"scenario {name} on rank {rank}: {r['unexpected']}\n{r.get('trace', '')}"
    return res


def failed_fast(res, what, bound=BOUND):
    """Every rank raised CheckpointError within bound; prints the seconds per rank and the message."""
    for rank, r in enumerate(res):
        print(f"{what}: rank {rank} raised {r['raised']} after {r['secs']:.3f} s: {r['msg'][:300]}")
    for rank, r in enumerate(res):
        assert r["raised"] == "CheckpointError", f"rank {rank}: {r['raised']} instead of CheckpointError: {r['msg']}"
        assert r["secs"] < bound, f"rank {rank} took {r['secs']:.1f} s to fail"


def untimed(x):
    """x without its seconds, which differ between ranks."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if not k.endswith("secs")}
    return [untimed(v) for v in x] if isinstance(x, list) else x


def ok(r, what):
    assert r["raised"] is None, f"{what}: {r['raised']}: {r['msg']}"


def steps_in(names, prefix="step-"):
    """The step numbers of the entries named prefix<N>..."""
    return sorted(int(n[len(prefix):].split("-")[0]) for n in names if n.startswith(prefix))


# ---------------------------------------------------------------------------------- 1. rollback


@pytest.mark.parametrize("name, keep", [("rollback_same_run", 3), ("rollback_new_run", 1)])
def test_rollback(jobs, name, keep):
    """Save 1..4, load(step-00000002) explicitly (in the same run, or in a new one after close()), train
    differently. A save of step 3 is refused on every rank, naming step 4 and check_root(rollback_to=), and touches
    nothing (a load is no rollback: the old steps 3 and 4 would stay, step 4 the newest commit a resume picks).
    check_root(root, model, rollback_to=2) moves steps 3 and 4 aside, each logged, before any save; then save 3
    and 4 with keep. Guards against a rollback that is inferred (or silently refused later), the rollback's saves
    being refused or deleted by retention, the old branch being deleted (or left as the newest), and a save of a
    step the old branch also has failing. Retention counts live steps only and never deletes what was moved aside."""
    res = scenario(jobs, name)
    r = res[0]
    print(f"{name} (keep={keep}): save 3 unsaid: {r['unsaid']['raised']}: {r['unsaid']['msg'][-260:]}")
    print(f"check_root(rollback_to=2) moved: {r['moved_at_check_root']}; root then: {r['after_check_root']}; "
          f"after save 3: {r['after_save3']}; after save 4: {r.get('after_save4')}; moved-aside steps loaded by "
          f"path: {r.get('aside_loads')}")
    same = [{k: v for k, v in untimed(x).items() if not k.startswith("moved")} for x in res]  # logs: rank 0's
    assert same[0] == same[1], "ranks must see the same"
    assert r["loaded"] == 2
    failed_fast([x["unsaid"] for x in res], "save of step 3 after loading step 2, rollback unsaid")
    for x in res:
        assert "holds step-00000004, a later step than 3" in x["unsaid"]["msg"]
        assert "ckpt.check_root(root, model, rollback_to=<the step loaded>)" in x["unsaid"]["msg"]
    assert r["moved_at_unsaid"] == [] and steps_in(r["after_unsaid"]) == [1, 2, 3, 4], "a refusal touches nothing"
    assert steps_in(r["after_unsaid"], ".abandoned-step-") == []
    ok(r["check_root"], "check_root(rollback_to=2)")
    assert sorted(re.findall(r"moved aside step-(\d+) as", " ".join(r["moved_at_check_root"]))) == \
        ["00000003", "00000004"], "check_root must move the old steps 3 and 4 aside, each logged"
    assert len(r["moved_at_check_root"]) == 2
    assert all("given up by a rollback to step 2" in line for line in r["moved_at_check_root"])
    assert steps_in(r["after_check_root"]) == [1, 2] and r["found_after_check_root"] == "step-00000002"
    assert steps_in(r["after_check_root"], ".abandoned-step-") == [3, 4]
    assert not [n for n in r["after_check_root"] if n.startswith(ROLLBACK)], "the marker is removed"
    ok(r["save3"], "save of step 3 on the new branch")
    assert r["saved"] == "step-00000003" and r["moved_at_save3"] == []
    assert steps_in(r["after_save3"], ".abandoned-step-") == [3, 4]
    assert steps_in(r["after_save3"]) == ([1, 2, 3] if keep == 3 else [3]) == r["committed_steps"]
    assert r["found"] == "step-00000003"
    assert r["branch_weights"] != r["old_weights"]["3"], "the branches must differ, or the next check proves nothing"
    assert (r["reloaded"], r["reloaded_weights"]) == (3, r["branch_weights"]), "load(root) must pick the new branch"
    ok(r["save4"], "save of step 4, which the old branch also has")
    assert r["moved_at_save4"] == [], "nothing is above step 3 any more"
    assert steps_in(r["after_save4"]) == ([2, 3, 4] if keep == 3 else [4]) and r["found_after_save4"] == "step-00000004"
    assert steps_in(r["after_save4"], ".abandoned-step-") == [3, 4], "retention must not delete moved-aside steps"
    old = r["old_weights"]
    assert r["aside_loads"] == {"3": [3, old["3"]], "4": [4, old["4"]]}, "the old branch must be intact"
    assert r["new4_weights"] != old["4"]


def test_same_or_older_step(jobs):
    """save() of the step this run last committed, after another optimizer step (the step counter not advanced),
    replaces that step with the state given now, sync and async (each time holding the live weights, which the
    step before did not). An older step is refused ('holds step-00000002, a later step than 1') on every rank at
    once, and so it is after load(step 1) too (a load is no rollback); after check_root(rollback_to=1), save(1)
    replaces step 1 with the live state and step 2 is moved aside. Guards against a save that returns the path
    of a checkpoint not holding the state it was given, or rewinds history without the rollback being said."""
    res = scenario(jobs, "same_or_older_step")
    r = res[0]
    print(f"save(2) again: {r['again_path']}, holds the live weights {r['again_holds_live']}; async: done "
          f"{r['async_done']}, holds the live weights {r['async_holds_live']}; after load(step 1), save(1) unsaid: "
          f"{r['after_load_unsaid']['raised']}; after check_root(rollback_to=1), save(1): {r['after_load_path']} "
          f"(holds the live weights {r['after_load_holds_live']}); root: {r['listing_end']}")
    for x in res:
        for what in ("again", "async_again", "rollback", "after_load"):
            ok(x[what], what)
        assert x["again_path"] == x["async_path"] == os.path.join(x["root"], "step-00000002") and x["async_done"]
        assert x["again_holds_live"] and x["async_holds_live"] and x["after_load_holds_live"]
        assert x["after_load_path"] == os.path.join(x["root"], "step-00000001") and x["loaded"] == 1
    for what in ("older", "after_load_unsaid"):
        failed_fast([x[what] for x in res], f"{what}: save of step 1 while step 2 is committed")
        for x in res:
            assert "holds step-00000002, a later step than 1" in x[what]["msg"] and "rollback_to=" in x[what]["msg"]
        assert res[0][what]["msg"] == res[1][what]["msg"]
    assert r["listing"] == r["listing_unsaid"] == [".owner.json", "step-00000001", "step-00000002"]
    assert steps_in(r["listing_end"]) == [1] and steps_in(r["listing_end"], ".abandoned-step-") == [2]


def test_find_checkpoint_ignores_abandoned(jobs):
    """A commit moved aside (here: the last commit) is never "the newest"; it still loads by its path. Guards
    against a resume picking up a branch given up."""
    r = scenario(jobs, "find_ignores_abandoned")[0]
    print(f"root: {r['listing']}; newest: {r['found']}; load(root) -> {r['load_root']}; "
          f"load(abandoned dir) -> {r['load_explicit']}")
    assert r["found"] == "step-00000001" and r["committed_steps"] == [1]
    assert (r["load_root"], r["load_explicit"]) == (1, 2)


def test_train_resume_from(jobs):
    """train_fsdp.py --resume-from an older step --rollback (a relaunched run): its check_root(rollback_to=4), at
    start-up, moves the old steps 6 and 8 aside; it replays the original exactly from there (max |dloss| = 0), and
    its saves are the newest commits (the live step-00000008 is a new directory, the old one is kept aside).
    Guards against --resume-from loading the newest step instead, against its saves being refused or deleted by
    retention, and (without --rollback) against training until its first save is refused."""
    res = jobs["resume"]
    assert "error" not in res, res["error"]
    assert res["rc_a"] == 0, res["out_a"][-3000:]
    assert res["rc_b"] == 0, res["out_b"][-3000:]
    unsaid = res["out_unsaid"]  # the same without --rollback: refused before its first step, nothing moved
    print(f"\n--resume-from step 4 without --rollback: exit {res['rc_unsaid']}: ...{unsaid.strip()[-160:]}")
    assert res["rc_unsaid"] != 0 and "step     5 |" not in unsaid
    assert "holds step-00000008, a later step than 4 (the step its model continues from)" in unsaid
    assert "rollback_to=" in unsaid
    a, b, entries = res["a"], res["b"], res["entries"]
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in b)
    root = res["root"]
    aside8 = [n for n in entries if n.startswith(".abandoned-step-00000008-")]
    new8 = json.loads((root / "step-00000008" / "manifest.json").read_text())
    same_bytes = {k: v for k, v in new8["files"].items() if res["old8"]["files"].get(k) == v}
    print(f"rolled back to step 4, then steps {sorted(b)}: max |dloss| = {diff:.3e}; root: {entries}; "
          f"step-00000008 files with the same size and CRC as the old branch's: {sorted(same_bytes)}")
    moved = re.findall(r"moved aside step-(\d+) as .*given up by a rollback to step 4", res["out_b"])
    assert "resumed from step 4" in res["out_b"] and sorted(moved) == ["00000006", "00000008"], res["out_b"][-3000:]
    assert res["out_b"].index("moved aside") < res["out_b"].index("step     5 |"), "moved at start-up, not at a save"
    assert sorted(b) == [5, 6, 7, 8] and diff == 0
    assert steps_in(entries) == [4, 6, 8] and steps_in(entries, ".abandoned-step-") == [6, 8]
    assert (root / aside8[0]).stat().st_ino == res["old8_inode"], "the old step 8 must be the one moved aside"
    assert (root / "step-00000008").stat().st_ino != res["old8_inode"], "the live step 8 must be the new commit"


# ---------------------------------------------------------------- 1b. the explicit rules: resumes, roots, locks


def test_weights_only_load_never_replaces_a_step(jobs):
    """A run saved step 100 with its AdamW state and ended; the next run loads the weights alone (load(root,
    model): an initialisation), makes a fresh optimizer and saves step 100. Refused on every rank (check_root()
    too), naming the step and that a weights-only load is an initialisation; step 100 still holds every optimizer
    state entry (counted in its .metadata before and after), in the same directory, its manifest unchanged. Guards
    against a relaunch that forgot the optimizer silently replacing the last step with one whose optimizer state is
    gone. The control: the same model resumed (load() with the optimizer) replaces step 100, the state kept."""
    res = scenario(jobs, "weights_only_save")
    r = res[0]
    print(f"step 100 before: {len(r['before']['entries'])} optimizer state entries; weights-only load -> "
          f"{r['loaded']} (weights equal {r['weights_equal']}), fresh optimizer with {r['fresh_opt_state']} states; "
          f"save(100): {r['save']['raised']}: {r['save']['msg'][-300:]}")
    print(f"step 100 after the refusal: {len(r['after']['entries'])} entries, same directory "
          f"{r['after']['inode'] == r['before']['inode']}, same manifest "
          f"{r['after']['manifest'] == r['before']['manifest']}; resumed -> {r['resumed']}, save(100) again: "
          f"{r['resave']['raised']}, then {len(r['after_resave']['entries'])} entries")
    assert r["loaded"] == 100 and r["weights_equal"] and r["fresh_opt_state"] == 0
    for what in ("save", "check_root"):
        failed_fast([x[what] for x in res], f"{what} after a weights-only load")
        for x in res:
            assert "step-00000100, and this run loaded none of them into its model as a resume" in x[what]["msg"]
            assert "a weights-only load is an initialisation" in x[what]["msg"]
        assert res[0][what]["msg"] == res[1][what]["msg"]
    assert r["after"] == r["before"], "step 100 must be untouched: the same entries, directory and manifest"
    assert r["listing"] == [".owner.json", "step-00000100"]
    per_param = {".".join(k.split(".")[3:-1]): [] for k in r["before"]["entries"]}
    for k in r["before"]["entries"]:
        per_param[".".join(k.split(".")[3:-1])].append(k.split(".")[-1])
    assert sorted(per_param) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert all(sorted(v) == ["exp_avg", "exp_avg_sq", "step"] for v in per_param.values()), per_param
    for x in res:
        ok(x["resave"], "save(100) after a resume")
    assert r["resumed"] == 100 and r["after_resave"]["entries"] == r["before"]["entries"]
    assert r["after_resave"]["inode"] != r["before"]["inode"], "the control's save must have replaced step 100"


def test_two_roots_resume(jobs):
    """One model saved alternately to roots A (steps 1, 3) and B (2, 4); the run stopped; the next run loads the
    newer (B, step 4) with its optimizer. check_root() of both roots and saves at later steps to both (5 to A, 6 to
    B) succeed on every rank, and each root loads back what was saved there. Guards against a run that writes two
    roots (a local and a remote copy, say) being refused on one of them at its resume."""
    res = scenario(jobs, "two_roots")
    r = res[0]
    print(f"newest: {r['newest']}; loaded {r['newer']} -> step {r['loaded']} (weights equal {r['weights_equal']}); "
          f"check_root A: {r['check_root_A']['raised']}, B: {r['check_root_B']['raised']}; saves: A "
          f"{r.get('path_A')}, B {r.get('path_B')}; committed A {r['committed_A']}, B {r['committed_B']}; load back: "
          f"A {r['load_A']} ({r['load_A_weights_equal']}), B {r['load_B']} ({r['load_B_weights_equal']})")
    assert untimed(res[0]) == untimed(res[1]), "ranks must see the same"
    assert r["newest"] == {"A": 3, "B": 4} and r["newer"] == "B" and r["loaded"] == 4 and r["weights_equal"]
    for what in ("check_root_A", "check_root_B", "save_A", "save_B"):
        ok(r[what], what)
    assert (r["path_A"], r["path_B"]) == ("step-00000005", "step-00000006")
    assert r["committed_A"] == [1, 3, 5] and r["committed_B"] == [2, 4, 6]
    assert (r["load_A"], r["load_B"]) == (5, 6) and r["load_A_weights_equal"] and r["load_B_weights_equal"]


def test_file_system_without_flock(jobs):
    """flock() fails with ENOSYS on rank 0 (Lustre without -o flock; NFS without its lock manager): the first save,
    and check_root(), are refused on every rank, at once, naming '-o flock', '-o localflock' and the opt-out
    check_root(root, model, lock=False), with nothing saved. With lock=False the root is claimed without a lock
    (flock() is tried once per claim, and refused), two saves (keep=1) and a load work. .owner.json: the refused claim left it
    empty; the opt-out writes who claimed it and holds no lock on it (every rank must see it: a node-local root is
    still refused). Guards against a raw OSError naming no fix, and an opt-out that does not work."""
    res = scenario(jobs, "no_flock")
    r = res[0]
    print(f"save on a file system without flock(): {r['save']['raised']}: {r['save']['msg'][-420:]}")
    print(f"flock() calls: {r['flock_calls_refused']} refused, {r['flock_calls']} in all; lock=False: claim "
          f"{r['claim']}, saves {r.get('path1')}, {r.get('path2')}, load -> {r.get('loaded')} (weights equal "
          f"{r['weights_equal']}); root {r['listing']} (.owner.json {r['owner_bytes']} bytes, lock free "
          f"{r['lock_free']}); a root claimed with lock=False first: {r['made_listing']} (claim {r['made_claim']})")
    for what in ("save", "check_root"):
        failed_fast([x[what] for x in res], f"{what} without flock()")
        for x in res:
            msg = x[what]["msg"]
            assert "refuses flock()" in msg and "-o flock" in msg and "-o localflock" in msg
            assert "ckpt.check_root(root, model, lock=False)" in msg
        assert res[0][what]["msg"] == res[1][what]["msg"]
    assert r["after_refusal"] == [".owner.json"] and r["flock_calls_refused"] == 2
    for x in res:
        for what in ("opt_out", "save1", "save2", "load", "made_check_root", "made_save"):
            ok(x[what], what)
        assert (x["path1"], x["path2"], x["loaded"]) == ("step-00000001", "step-00000002", 2) and x["weights_equal"]
        assert x["listing"] == x["made_listing"] == [".owner.json", "step-00000002"]
    assert "absent" not in (r["claim"], r["made_claim"]) and r["flock_calls"] == 4, "one flock() per claim"
    assert r["owner_bytes"] > 0 and r["lock_free"], "the claim's record written, no lock held"


def test_lock_false_on_a_new_root(jobs):
    """check_root(root, model, lock=False) of a root that does not exist yet (a new run's first claim, the case the
    opt-out is for) makes it and claims it, and a save works."""
    res = scenario(jobs, "no_flock")
    print(f"check_root(new root, lock=False): {res[0]['new_check_root']['msg'][:300]}; save: "
          f"{res[0]['new_save']['msg'][:200]}; the root then {res[0]['new_listing']}")
    for x in res:
        ok(x["new_check_root"], "check_root(new root, lock=False)")
        ok(x["new_save"], "save to it")
        assert x["new_listing"] == [".owner.json", "step-00000002"]


def test_claim_again_after_lock_false(jobs):
    """A run that claimed its root with lock=False calls check_root() of it again (the lock argument left at its
    default): the claim it holds stands; it is not refused as a root the ranks cannot see."""
    res = scenario(jobs, "no_flock")
    print(f"check_root() again after lock=False: {res[0]['made_check_root_again']['msg'][:300]}")
    for x in res:
        ok(x["made_check_root_again"], "check_root() again")


# ---------------------------------------------------------------------------------- 2. one run per root


def test_second_live_run_is_refused(jobs):
    """train_fsdp.py on a root a live run holds (the main job) is refused before it trains a step, naming the
    owner's pid; the owner's files are untouched, it goes on saving there, and its close() releases the root.
    Guards against two live runs on one root deleting each other's checkpoints."""
    second = jobs["second"]
    held = scenario(jobs, "hold_live")[0]
    goes_on = jobs["main"][0].get("live_goes_on")
    assert goes_on, f"the main job did not go on after the second run:\n{jobs['launched']['main']['out'][-3000:]}"
    pid = held["owner"]["pid"]
    print(f"train_fsdp.py on the held root: exit {second['rc']} after {second['secs']:.1f} s, steps logged: "
          f"{sorted(second['logged'])}; held root before: {held['listing']}, when the owner went on: "
          f"{goes_on['before']}; owner afterwards: save {goes_on.get('path2')}, committed {goes_on['committed']}")
    assert second["rc"] not in (0, None) and "is in use by another run" in second["out"]
    assert f'"pid": {pid}' in second["out"] and pid == held["my_pid"]
    assert second["logged"] == {}, "the second run trained before being refused"
    assert goes_on["released"] and goes_on["before"] == held["listing"] == [".owner.json", "step-00000001"]
    assert goes_on["owner_before"] == held["owner"], "a refused run must not touch the claim"
    ok(goes_on["save2"], "the owner's next save")
    assert goes_on["committed"] == [1, 2] and goes_on["owner_after_save"] == held["owner"]
    assert "live" not in jobs["main"][0]["close"]["claims_after"], "close() must release the root"


def test_reading_claims_nothing(jobs):
    """While another live run (a process of its own, holding the root's lock, a save of its in progress) holds a
    root: check_root() and save() are refused naming it, check_root(lock=False) too; load() of the root and of its
    step directory, with or without optimizer, works; .owner.json and the save in progress stay as they were.
    Guards against an evaluation job being refused, or taking over or touching the claim of the run that trains,
    and against lock=False taking a live run for a gone one and deleting its save in progress."""
    res = scenario(jobs, "foreign_live_claim")
    r = res[0]
    print(f"claim of pid {r['other_pid']}: check_root/save refused: {r['check_root']['msg'][:200]}...; load(root, "
          f"model, None) -> {r['step_root']}, load(step dir) -> {r['step_dir']}, load with optimizer -> "
          f"{r['step_opt']}; claim unchanged: {r['owner_unchanged']}, still locked: {r['held_while_refused']}")
    print(f"check_root(lock=False) beside it: {r['lock_false']['msg'][:200]}")
    for what in ("check_root", "save", "lock_false"):
        failed_fast([x[what] for x in res], f"{what} on a root another live run holds")
        for x in res:
            assert "is in use by another run" in x[what]["msg"] and f'"pid": {r["other_pid"]}' in x[what]["msg"]
            assert "load() takes no claim" in x[what]["msg"]
    for x in res:
        for what in ("load_root", "load_dir", "load_with_opt"):
            ok(x[what], what)
        assert (x["step_root"], x["step_dir"], x["step_opt"]) == (1, 1, 1)
        assert x["weights_root"] == x["weights_dir"] == x["saved_weights"]
        in_progress = ".tmp-step-00000002-0badc0de"  # the other run's save: nothing of it may go
        assert x["owner_unchanged"] and x["listing_after"] == x["listing_before"] == [".owner.json", in_progress,
                                                                                   "step-00000001"]
        assert x["held_while_refused"]
    assert r["owner"]["pid"] == r["other_pid"] != r.get("my_pid")


def test_training_claims(jobs):
    """load() of checkpoints another run wrote takes no claim; the save after it (training) claims the root for
    this run, and check_root() keeps that claim. A model that loaded nothing from a root holding checkpoints (a
    forgotten resume), or loaded its weights alone (an initialisation), is refused at check_root() and at save()
    of a later step, naming the newest step, and touches nothing there. Guards against a trainer that loaded but
    never claims (two writers), and a fresh or weights-only run starting over on the root it was pointed at."""
    res = scenario(jobs, "training_claims")
    r = res[0]
    print(f"claim after load: {r['owner_after_load']}; after save: {r['owner_after_save']}; fresh run: "
          f"{r['fresh_check_root']['msg'][:300]}; weights-only load ({r['weights_only_loaded']}) then check_root: "
          f"{r['weights_only_check_root']['raised']}, save: {r['weights_only_save']['raised']}; its root after: "
          f"{r['fresh_listing']}")
    assert r["owner_initially"] is None and r["loaded"] == 2 and r["owner_after_load"] is None
    for x in res:
        for what in ("save3", "check_root"):
            ok(x[what], what)
    mine = r["owner_after_save"]
    assert (mine["host"], mine["pid"]) == (r["host"], r["my_pid"]) and r["owner_after_check_root"] == mine
    assert r["listing"] == [".owner.json", "step-00000001", "step-00000002", "step-00000003"]
    assert r["weights_only_loaded"] == 2
    for what in ("fresh_check_root", "fresh_save", "weights_only_check_root", "weights_only_save"):
        failed_fast([x[what] for x in res], f"{what} of a run that resumed nothing from a used root")
        for x in res:
            assert "holds checkpoints up to" in x[what]["msg"] and "step-00000002" in x[what]["msg"]
            assert "this run loaded none of them into its model as a resume (load() with the optimizer; a " \
                   "weights-only load is an initialisation)" in x[what]["msg"]
        assert res[0][what]["msg"] == res[1][what]["msg"]
    assert r["fresh_listing"] == [".owner.json", "step-00000001", "step-00000002"] and r["fresh_lock_free"]


def test_dead_owner_is_taken_over_at_once(jobs):
    """A claim whose run is gone (nothing holds its lock) is taken over at once, with a log line; only the dead
    run's temporaries (.tmp-) are removed, logged; .nfsXXXX and lost+found stay. Guards against a requeue
    waiting, or deleting entries that are not ckpt's."""
    res = scenario(jobs, "dead_owner")
    r = res[0]
    print(f"check_root took {r['check_root']['secs']:.3f} s; log: {r['log']}; root after the claim: "
          f"{r['after_check']}; after save: {r['after_save']}")
    for x in res:
        ok(x["check_root"], "check_root")
        ok(x["save"], "save")
        assert x["check_root"]["secs"] < BOUND
    assert len(r["log"]) == 2 and "nothing holds its lock, so that run is gone" in r["log"][0]
    assert "removed" in r["log"][1] and ".tmp-step-00000009-deadbeef" in r["log"][1]
    assert r["owner"]["pid"] == r["my_pid"]
    assert r["after_check"] == [".nfs1234", ".owner.json", "lost+found"]
    assert r["after_save"] == [".nfs1234", ".owner.json", "lost+found", "step-00000001"]


def test_stale_claim(jobs):
    """Records that no live process locks are taken over at once, whatever they say: another host's (a day old),
    our very pid (a container restarted with a fresh PID namespace repeats pids), a half-written one; each with a
    log line naming what it said. Guards against a requeued job refused by its own dead predecessor, and against
    guessing from hosts, pids or ages whether a run lives."""
    res = scenario(jobs, "stale_owner")
    r = res[0]
    for name in ("elsewhere", "own_pid", "half_written"):
        print(f"{name}: check_root in {r[name]['secs']:.3f} s; log: {r[name]['log']}")
        for x in res:
            ok(x[name], f"check_root() over the record of {name}")
            assert x[name]["secs"] < BOUND
        assert len(r[name]["log"]) == 1 and "nothing holds its lock" in r[name]["log"][0]
        assert r[name]["owner"]["pid"] == r["my_pid"]
    assert '"host": "elsewhere"' in r["elsewhere"]["log"][0] and '"half-wri' in r["half_written"]["log"][0]


def test_filesystem_entries_are_left_alone(jobs):
    """A root that is a mount point (lost+found), on NFS (.nfsXXXX) or a data directory (train.bin) is a
    checkpoint root; saves with keep=1 and a load keep those entries. Guards against a save or retention deleting
    what is not ckpt's, and against refusing such a root."""
    res = scenario(jobs, "foreign_entries")
    r = res[0]
    print(f"root after two saves (keep=1) and a load: {r['after']}")
    for x in res:
        for call in ("check_root", "save", "save2", "load"):
            ok(x[call], call)
    assert r["step"] == 2 and r["data_kept"]
    assert r["after"] == [".nfs0000000001234", ".owner.json", "lost+found", "step-00000002", "train.bin"]


@pytest.mark.parametrize("where", [
    "before verify",
    "before .metadata",
    "explicit",
])
def test_step_removed_while_loading(jobs, where):
    """A reader chose the newest step; a run writing the root commits the next and its retention removes the
    chosen one (before the reader checks the files, or before it reads .metadata); and an explicit step
    directory that no longer exists. Every rank raises at once, naming the step that 'does not exist' and the
    newest commit; loading again works. Guards against an unexplained 'missing file' error, or a hang."""
    res = scenario(jobs, "vanished_while_loading")
    r = res[0]
    gone, newest = {"before verify": r["advanced before verify"], "before .metadata": r["advanced before .metadata"],
                    "explicit": [r["explicit_dir"], r["advanced before .metadata"][1]]}[where]
    print(f"root at the end: {r['listing']}; load again -> {r['again_step']} (the weights saved as step 2: "
          f"{r['weights_match']})")
    failed_fast([x[where] for x in res], f"step removed {where}")
    for x in res:
        ok(x["again"], "load after the failures")
        assert x["again_step"] == 4 and x["weights_match"]
    for x in res:
        assert f"{gone} does not exist" in x[where]["msg"]
        assert "\n" not in x[where]["msg"] and "Traceback" not in x[where]["msg"], "one line, not DCP's traceback"
        assert f"The newest other commit is {newest}: pass it to load it" in x[where]["msg"]
    assert res[0][where]["msg"] == res[1][where]["msg"]


def test_close_releases_every_claim(jobs):
    """ckpt.close() releases every claim this run holds (its record emptied, its lock free: the next run takes
    the root without a takeover) and leaves other runs' records alone; the job then tears down and exits 0. The
    job of the waiting scenarios exits 0 too: no scenario hung (a rank's CRC failure at load, load_hash, once
    left the other rank waiting out the checkpoint timeout)."""
    main = jobs["main"][0]
    closed = main.get("close")
    assert closed, f"the main job did not reach close():\n{jobs['launched']['main']['out'][-3000:]}"
    before, after = closed["claims_before"], closed["claims_after"]
    ours = sorted(n for n, c in before.items() if c["pid"] == closed["my_pid"])
    print(f"claims before close(): {len(ours)} of this run, others: {sorted(set(before) - set(ours))}; "
          f"after: {sorted(after)}; locks free after close(): {closed['locks_free']}")
    assert len(ours) >= 20 and "live" in ours
    assert after == {n: c for n, c in before.items() if n not in ours}
    assert sorted(after) == ["foreign_live_claim"] and closed["locks_free"]
    assert jobs["launched"]["main"]["rc"] == 0, jobs["launched"]["main"]["out"][-3000:]
    waiting = jobs["launched"]["waiting"]
    hung = sorted(n for job in ("main", "waiting") for n, r in jobs[job][0].items()
                  if isinstance(r, dict) and "hung_after_s" in r)
    assert hung == [], f"scenarios that hung: {hung}"
    assert waiting["rc"] == 0, waiting["out"][-3000:]


# ---------------------------------------------------------------------------------- 3. one rank fails

INJECTED = {  # scenario: text of the cause that every rank's error must carry
    "save_user_state_dict": "state_dict() of the data loader broke on rank 1",
    "save_prepare_rank0": "mkdir, injected",
    "save_shared_storage": "the root must be on storage shared by every rank",
    "save_write_data": "write shard, injected",
    "save_checksum": "checksum, injected",
    "save_stage_async": "out of host memory while copying to host (injected)",
    "load_choose_rank0": "read manifest, injected",
    "load_hash": "checksum, injected",
    "load_read_metadata": "read .metadata, injected",
    "load_read_data": "read shard, injected",
    "load_set_state_dict": "set_model_state_dict broke (injected)",
    "load_user_load_state_dict": "load_state_dict() of the data loader broke on rank 0",
}


@pytest.mark.parametrize("name", list(INJECTED))
def test_one_rank_fails(jobs, name):
    """One rank raises at one local step of save/load, checkpoint timeout one hour: every rank raises the same
    CheckpointError within 30 s naming that rank and the cause; nothing is committed; then a normal save and
    load work on the same ranks. Guards against the healthy ranks waiting out the hour, or staying broken."""
    res = scenario(jobs, name)
    r = res[0]
    failed_fast(res, f"{name} ({r['where']} raises on rank {r['fail_rank']})")
    for x in res:
        assert INJECTED[name] in x["msg"], f"the cause is not named: {x['msg']}"
        assert re.search(rf"\brank {r['fail_rank']}\b", x["msg"].lower()), f"the rank is not named: {x['msg']}"
    assert res[0]["msg"] == res[1]["msg"], "ranks raised different errors"
    assert r["committed_after_failure"] == [1]
    print(f"then: {'load ' + str(r.get('reload')) + ', ' if 'reload' in r else ''}save -> {r.get('save_after')}, "
          f"load -> {r.get('load_after')} in {r['recover_secs']:.3f} s; committed {r['committed']}")
    step = 4 if name == "save_stage_async" else 3  # there, an async save of step 3 comes first
    for x in res:
        assert "recover_error" not in x, x["recover_error"]
        assert (x["save_after"], x["load_after"]) == (f"step-{step:08d}", step)
        if name == "save_stage_async":
            ok(x["async_after"], "the next async save")


def test_retention_failure_keeps_the_save(jobs):
    """Rank 0 cannot delete an old checkpoint (EACCES) during retention: the save still returns on every rank
    with its checkpoint committed, and the failure is logged; the next save and load work. Guards against a
    full or read-only old step failing every later save."""
    res = scenario(jobs, "retention_cannot_delete")
    r = res[0]
    print(f"save with rmtree failing on rank 0: {[x['raised'] for x in res]} after "
          f"{[x['secs'] for x in res]} s; log: {r['log']}; committed {r['committed']}; root {r['listing']}")
    for x in res:
        ok(x, "save whose retention failed")
        assert x["secs"] < BOUND and x["save_after"] == "step-00000004" and x["load_after"] == 4
    assert r["committed"] == [2, 3] and any("retention: could not remove" in ln for ln in r["log"])


@pytest.mark.parametrize("name, key, values", [("args_async_save", "async_save", (True, False)),
                                               ("args_keep", "keep", (5, 7)), ("args_rng", "rng", (True, False)),
                                               ("args_load_verify", "verify", (True, False))])
def test_different_arguments(jobs, name, key, values):
    """save()/load() given a different async_save/keep/rng/verify on the two ranks: both ranks fail at once, the
    error naming each rank's value; nothing is written; the next save works. Guards against ranks taking
    different collective paths (a hang until the timeout) or a checkpoint written half one way, half the other."""
    res = scenario(jobs, name)
    failed_fast(res, name)
    msg = res[0]["msg"]
    assert res[1]["msg"] == msg and "was given different arguments on different ranks" in msg
    parts = dict(re.findall(r"rank (\d+): (.*?)(?=; rank \d+: |$)", msg, flags=re.S))
    for rank, value in enumerate(values):
        assert f"{key}={value}" in parts.get(str(rank), ""), f"rank {rank}'s {key} not named"
    if name != "args_load_verify":
        assert res[0]["committed_after_failure"] == [] and res[0]["listing_after_failure"] == []
    assert all(x["save_after"] == "step-00000002" and "recover_error" not in x for x in res)


# ---------------------------------------------------------------------------------- 4. smaller ones


def test_step_of_any_size(jobs):
    """Steps 10**8 and 10**9 (step-100000000, step-1000000000) order by number, not by name (by name,
    step-1000000000 < step-100000001): the newest is 10**9, a save of 10**8 + 2 is refused for it, and
    check_root(rollback_to=10**8 + 1) moves 10**9 aside.
    Guards against a long run (or a step counted in samples) resuming from an older step, or retention deleting
    the newest one."""
    res = scenario(jobs, "big_step")
    r = res[0]
    print(f"saved {r['save']}, {r['save2']} (keep=1), {r['save3']}: newest {r['found']}, load(root) -> "
          f"{r['load_newest']}; after load({r['load_explicit']}), a save of 10**8 + 2: {r['unsaid']['raised']}; "
          f"after check_root(rollback_to=10**8 + 1) and save: {r['listing']}")
    assert (r["save"], r["save2"], r["save3"]) == ("step-100000000", "step-100000001", "step-1000000000")
    ok(r["check_root"], "check_root of a root holding step-100000001")
    assert r["committed_steps"] == [10**8 + 1] and r["load_root"] == 10**8 + 1 and r["weights_match"]
    assert r["found"] == "step-1000000000" and r["load_newest"] == 10**9 and r["first_differs"]
    assert r["load_explicit"] == 10**8 + 1 and r["save4"] == "step-100000002"
    failed_fast([x["unsaid"] for x in res], "save of 10**8 + 2 below 10**9, rollback unsaid")
    assert "holds step-1000000000, a later step than 100000002" in r["unsaid"]["msg"]
    ok(r["rollback"], "check_root(rollback_to=10**8 + 1)")
    assert steps_in(r["listing"]) == [10**8 + 1, 10**8 + 2] and steps_in(r["listing"], ".abandoned-step-") == [10**9]


def test_interrupted_wait_keeps_the_save(jobs):
    """Ctrl-C while PendingSave.wait() waits for a held background write: the save stays in flight with its
    directory (nothing committed yet), commits by itself once the write goes on (no ckpt call), and the next save
    follows it; wait() then returns its path. Guards against the save in flight being dropped, or its directory
    deleted by the next save."""
    res = scenario(jobs, "interrupted_wait")
    r = res[0]
    print(f"wait() raised {r['wait']['raised']}; committed then: {r['committed_after_interrupt']}, temp dir: "
          f"{r['tmp_after']}; once released, committed by itself: {r['committed_by_itself']}; after the next save: "
          f"committed {r['committed']}, root {r['listing']}")
    for x in res:
        assert x["wait"]["raised"] == "KeyboardInterrupt" and not x["done_after_interrupt"]
        assert x["committed_after_interrupt"] == [] and x["tmp_after"] and x["committed_by_itself"] == [1]
        ok(x["save2"], "the next save")
        assert x["wait_again"] == "step-00000001" and x["committed"] == [1, 2]
    assert r["listing"] == [".owner.json", "step-00000001", "step-00000002"]


def test_timeout_then_next_save_works(jobs):
    """timeout=2 s and rank 1 arrives 3 s late: both ranks fail (rank 0 after about 2 s), nothing is
    committed, and the next save with the same timeout works. Guards against a timed-out gloo group being reused,
    which fails every later save of the run."""
    res = scenario(jobs, "timeout_recovery")
    failed_fast(res, "save with rank 1 three seconds late (timeout 2 s)", bound=3 + 10)
    assert 2 <= res[0]["secs"] < 2 + 10 and "checkpoint coordination failed" in res[0]["msg"]
    print(f"next save: {res[0].get('save_after')} in {res[0]['recover_secs']:.3f} s; committed {res[0]['committed']}")
    for x in res:
        assert x["committed_after_failure"] == [1] and x.get("save_after") == "step-00000003", x


def test_async_save_with_a_stuck_rank(jobs):
    """An async save whose write is stuck on rank 1 (slow storage) past the checkpoint timeout (2 s): the commit,
    in the background thread, fails on both ranks, rank 0 after one timeout, naming the phase; wait() raises it,
    nothing is committed, and the next save works. Guards against a background commit that hangs the job, or a
    timed-out group that breaks every later save."""
    res = scenario(jobs, "timeout_async")
    for rank, x in enumerate(res):
        print(f"rank {rank}: save() blocked {x['blocked_secs']:.3f} s; wait() raised {x['raised']} after "
              f"{x['secs']:.1f} s: {x['msg'][:200]}; next save: {x.get('save_after')} in {x['recover_secs']:.1f} s")
    failed_fast(res, "async save with rank 1's write stuck 4 s (timeout 2 s)", bound=4 + 10)
    assert 2 <= res[0]["secs"] < 4, "rank 0 must give up after one timeout, while rank 1 is still stuck"
    for x in res:
        assert "save of step 2" in x["msg"] and x["blocked_secs"] < 2
        assert x["committed_after_failure"] == [1] and "recover_error" not in x, x.get("recover_error")
        assert x["save_after"] == "step-00000003" and x["committed"] == [1, 3]


def test_timeout_while_making_the_group(jobs):
    """The same late rank when save() must first create the group for this timeout (a loop's first save):
    both ranks raise CheckpointError naming that phase, and the next save works. Guards against a raw
    store/gloo error that names no phase, and a half-made group kept for later saves."""
    res = scenario(jobs, "timeout_first_save")
    for rank, x in enumerate(res):
        print(f"rank {rank}: {x['raised']} after {x['secs']:.1f} s: {x['msg'][:200]}; next save: {x.get('save_after')}")
    failed_fast(res, "first save, rank 1 2.5 s late (timeout 1 s)", bound=2.5 + 15)
    assert all("make ckpt's process group" in x["msg"] for x in res)
    assert all(x.get("save_after") == "step-00000002" for x in res)


def test_save_after_a_failed_load(jobs):
    """A load that failed on one rank mid-read leaves the ranks' state apart (rank 0 read its shards into the
    model, rank 1 did not): save() refuses on every rank, saying the load failed while reading, and commits
    nothing; loading again repairs it and the next save works. Guards against committing a checkpoint that mixes
    ranks holding the checkpoint with ranks holding the state before it."""
    res = scenario(jobs, "save_after_failed_load")
    r = res[0]
    failed_fast([x["failed_load"] for x in res], "load failing on rank 1 mid-read")
    print(f"optimizer steps per rank afterwards: {[x['optimizer_steps'] for x in res]}; then: reload "
          f"{r['reload']}, save {r['save_after']}, load {r['load_after']}")
    failed_fast([x["save"] for x in res], "save of the half-loaded state")
    for x in res:
        assert "failed once it was reading into it, so the model and optimizers may hold part of it" in x["save"]["msg"]
        assert "load() again before saving" in x["save"]["msg"]
        assert x["committed_after_refusal"] == [1]
        assert "recover_error" not in x, x["recover_error"]
        assert (x["reload"], x["save_after"], x["load_after"]) == (1, "step-00000002", 2)
