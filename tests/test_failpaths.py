"""Failure paths around a run's checkpoints (issue 12): rollback, one run per root, one rank failing, odd steps.

Guards against: a rollback whose next save is deleted by retention or refused as "already exists"; two live
runs on one root deleting each other's saves; a requeue that cannot take over a dead run's root; a save that
deletes a filesystem's own entries (.nfsXXXX, lost+found); one rank's local failure (user state_dict(),
hashing, .metadata, set_state_dict, staging, retention) leaving the other ranks waiting out the hour-long
checkpoint timeout; ranks given different save/load arguments taking different collective paths; a timeout
that kills every later save; step numbers >= 10**8; a Ctrl-C in PendingSave.wait() losing the save in flight.

Two 2-rank jobs of tests/failpath_job.py hold all the scenarios (a "holder" that keeps a root claimed, and the
main job, scenario after scenario); each test asserts and prints one scenario's figures.

    python -m pytest -v -s tests/test_failpaths.py
"""

import json
import os
import re
import threading
import time

import pytest

from tests.harness import REPO, SMALL, TRAIN, read_log, torchrun

JOB = os.path.join(REPO, "tests", "failpath_job.py")
BOUND = 30  # seconds: every rank must have raised by then, while the checkpoint timeout is an hour


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The holder claims d/live; while it lives, train_fsdp.py and the main job try to use d/live too."""
    d = tmp_path_factory.mktemp("failpaths")
    live = d / "live"
    holder = {}

    def run_holder():
        holder["rc"], holder["out"] = torchrun([str(d / "holder_out"), str(d / "work"), "--holder", str(live)],
                                               script=JOB, check=False, timeout=300)

    t0 = time.monotonic()
    thread = threading.Thread(target=run_holder)
    thread.start()
    while not (d / "ready").exists() and thread.is_alive() and time.monotonic() - t0 < 200:
        time.sleep(0.2)
    ready = (d / "ready").exists()  # if not, only test_second_live_run_is_refused fails
    second, main = {"rc": None, "out": "", "secs": 0.0}, {}

    def run_second():  # train_fsdp.py as users launch it, on the held root
        t = time.monotonic()
        args = SMALL + ["--steps", "4", "--save-every", "2", "--ckpt-dir", str(live),
                        "--log-file", str(d / "second.jsonl")]
        second["rc"], second["out"] = torchrun(args, check=False, timeout=240)
        second["secs"] = time.monotonic() - t

    try:
        # Concurrently: most of each job is start-up and waiting, and both need the holder alive.
        other = threading.Thread(target=run_second)
        if ready:
            other.start()
        t = time.monotonic()
        main["rc"], main["out"] = torchrun([str(d / "main_out"), str(d / "work")]
                                           + (["--live-root", str(live)] if ready else []),
                                           script=JOB, check=False, timeout=420)
        main["secs"] = time.monotonic() - t
        if ready:
            other.join(timeout=300)
    finally:
        (d / "release").touch()
        thread.join(timeout=300)
    second["logged"] = read_log(d / "second.jsonl") if (d / "second.jsonl").exists() else {}
    print(f"\nholder job: exit {holder.get('rc')}; second train_fsdp.py run: exit {second['rc']} after "
          f"{second['secs']:.1f} s; main job: exit {main['rc']} after {main['secs']:.1f} s; "
          f"all {time.monotonic() - t0:.1f} s")

    def results(name):
        return [json.loads((d / name / f"results.{r}.json").read_text()) if (d / name / f"results.{r}.json").exists()
                else {} for r in (0, 1)]

    return {"main": results("main_out"), "main_out": main["out"], "main_rc": main["rc"],
            "holder": results("holder_out"), "holder_out": holder.get("out", ""), "second": second, "live": live}


def scenario(jobs, name):
    """Both ranks' figures of one scenario; a scenario that hung or crashed fails here, by name."""
    res = [r.get(name) for r in jobs["main"]]
    for rank, r in enumerate(res):
        assert r is not None, f"scenario {name} never finished on rank {rank}:\n{jobs['main_out'][-4000:]}"
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


# ---------------------------------------------------------------------------------- 1. rollback


ROLLBACKS = {
    # Issue 12: a user loop that loads an explicit older step and goes on, in the same process.
    "rollback_same_run": 3,
    # train_fsdp.py --resume-from / a relaunch: the rollback is done by a new run.
    "rollback_new_run": 3,
    "rollback_keep1": 1,
}


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_rollback(jobs, name):
    """Save 1..4, load(step-00000002) explicitly, train differently, save 3, then 4. Guards against retention
    deleting the checkpoint just written (by step order), a save of a step of the abandoned branch failing
    with "already exists", and a later resume loading the abandoned branch."""
    keep = ROLLBACKS[name]
    res = scenario(jobs, name)
    r = res[0]
    print(f"{name} (keep={keep}): after save 3: {r['after_save3']}; newest: {r['found']}; "
          f"moved aside: {r['aside']}; after save 4: {r.get('after_save4')}")
    assert untimed(res[0]) == untimed(res[1]), "ranks must see the same"
    assert r["loaded"] == 2
    ok(r["save3"], "save of step 3 on the new branch")
    assert r["saved"] == "step-00000003" and r["new3"]["parent"] == "step-00000002"
    assert r["new3"]["seq"] > r["old3_seq"], "the new step 3 must be the newest commit"
    assert r["found"] == "step-00000003" and "step-00000003" in r["after_save3"], "retention deleted the new commit"
    commits = [n for n in r["after_save3"] if n.startswith(("step-", ".abandoned-step-"))]
    assert len(commits) == keep, f"keep={keep} but {commits}"
    if keep == 1:
        assert commits == ["step-00000003"]
    else:
        assert [a["seq"] for a in r["aside"]] == [r["old3_seq"]], "the old step 3 must be moved aside, not lost"
    assert r["branch_weights"] != r["old3_weights"], "the two branches must differ, or the next check proves nothing"
    assert (r["reloaded"], r["reloaded_weights"]) == (3, r["branch_weights"]), "load(root) must pick the new branch"
    ok(r["save4"], "save of step 4, which the abandoned branch also has")
    assert r["found_after_save4"] == "step-00000004"
    if keep > 1:
        assert any(n.startswith(".abandoned-step-00000004-") for n in r["after_save4"])


def test_same_step_twice_is_refused(jobs):
    """The other side of rollback: saving a step this run's state descends from (the same step again, or an
    older one, with no load in between) is refused, and nothing is moved aside."""
    res = scenario(jobs, "same_step_twice")
    for what in ("again", "older"):
        failed_fast([x[what] for x in res], f"save of a step this run already committed ({what})", bound=5)
        assert all("already exists" in x[what]["msg"] for x in res)
    print(f"root afterwards: {res[0]['listing']}")
    assert [n for n in res[0]["listing"] if "step-" in n] == ["step-00000001", "step-00000002"]


def test_find_checkpoint_ignores_abandoned(jobs):
    """A commit moved aside (here: the last commit) is never "the newest"; it still loads by its path."""
    r = scenario(jobs, "find_ignores_abandoned")[0]
    print(f"root: {r['listing']}; newest: {r['found']}; load(root) -> {r['load_root']}; "
          f"load(abandoned dir) -> {r['load_explicit']}")
    assert r["found"] == "step-00000001" and r["committed_steps"] == [1]
    assert (r["load_root"], r["load_explicit"]) == (1, 2)


@pytest.mark.skipif("--resume-from" not in open(TRAIN).read(), reason="train_fsdp.py has no --resume-from yet")
def test_train_resume_from(tmp_path):
    """train_fsdp.py --resume-from an older step (a new run): it replays the original exactly from there
    (max |dloss| = 0), and its saves of steps the old branch also has (6, then 8) move those aside and become
    the newest commits. Guards against --resume-from loading the newest step instead, and against the second
    save after a rollback being refused as "already exists" (issue 12) or deleted by retention."""
    root = tmp_path / "ckpt"
    common = SMALL + ["--steps", "8", "--save-every", "2", "--keep", "3", "--ckpt-dir", str(root)]
    torchrun(common + ["--log-file", str(tmp_path / "a.jsonl")])
    old8 = json.loads((root / "step-00000008" / "manifest.json").read_text())
    torchrun(common + ["--resume-from", str(root / "step-00000004"), "--log-file", str(tmp_path / "b.jsonl")])
    a, b = read_log(tmp_path / "a.jsonl"), read_log(tmp_path / "b.jsonl")
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in b)
    entries = sorted(os.listdir(root))
    new8 = json.loads((root / "step-00000008" / "manifest.json").read_text())
    print(f"rolled back to step 4, then steps {sorted(b)}: max |dloss| = {diff:.3e}; root: {entries}; "
          f"step-00000008: seq {old8['seq']} -> {new8['seq']}, parent {new8['parent']}")
    assert sorted(b) == [5, 6, 7, 8] and diff == 0
    assert new8["run"] != old8["run"] and new8["parent"] == "step-00000006" and new8["seq"] > old8["seq"]
    assert any(n.startswith(".abandoned-step-00000008-") for n in entries) and "step-00000006" in entries


# ---------------------------------------------------------------------------------- 2. one run per root


def test_second_live_run_is_refused(jobs):
    """A second run on a root a live run holds is refused before it trains a step, naming the owner; the
    owner's files are untouched and it goes on saving; its close() releases the root."""
    second, holder = jobs["second"], jobs["holder"][0].get("holder")
    assert holder, f"the holder job failed:\n{jobs['holder_out'][-3000:]}"
    res = scenario(jobs, "second_live_run")
    pid = res[0]["holder_owner"]["pid"]
    print(f"train_fsdp.py on the held root: exit {second['rc']} after {second['secs']:.1f} s, steps logged: "
          f"{sorted(second['logged'])}")
    assert second["rc"] != 0 and "is in use by" in second["out"] and f"pid {pid}" in second["out"]
    assert second["logged"] == {}, "the second run trained before being refused"
    for call in ("check_root", "save", "load"):
        failed_fast([r[call] for r in res], f"second run's {call}", bound=5)
        assert all("is in use by" in r[call]["msg"] and str(pid) in r[call]["msg"] for r in res)
    print(f"held root before: {res[0]['before']}, after: {res[0]['after']}; holder afterwards: {holder}")
    assert res[0]["before"] == res[0]["after"] and "step-00000001" in res[0]["before"]
    assert holder["released"] and holder["save2"] == "step-00000002" and holder["committed"] == [1, 2]
    assert holder["owner_before_close"]["pid"] == pid and holder["owner_after_close"] is None


def test_dead_owner_is_taken_over_at_once(jobs):
    """A claim whose process is gone (same host) is taken over at once, with a log line; only the dead run's
    temporaries are removed (.nfsXXXX and lost+found stay)."""
    res = scenario(jobs, "dead_owner")
    r = res[0]
    print(f"check_root took {r['check_root']['secs']:.3f} s; log: {r['log']}; root after the claim: "
          f"{r['after_check']}; after save: {r['after_save']}")
    for x in res:
        ok(x["check_root"], "check_root")
        ok(x["save"], "save")
        assert x["check_root"]["secs"] < 5
    assert len(r["log"]) == 1 and "its process is gone" in r["log"][0]
    assert r["owner"]["pid"] == r["my_pid"]
    assert ".tmp-step-00000009-deadbeef" not in r["after_check"]
    assert {".nfs1234", "lost+found"} <= set(r["after_save"]) and "step-00000001" in r["after_save"]


def test_stale_claim(jobs):
    """Another host's claim: refused while fresh (naming it), taken over once older than stale_after, logged."""
    res = scenario(jobs, "stale_owner")
    r = res[0]
    failed_fast([x["fresh"] for x in res], "fresh claim of host 'elsewhere'", bound=5)
    print(f"stale claim taken over in {r['stale']['secs']:.3f} s; log: {r['log']}")
    assert all("is in use by" in x["fresh"]["msg"] and "elsewhere" in x["fresh"]["msg"] for x in res)
    assert r["owner_after_refusal"]["host"] == "elsewhere", "a refused run must not touch the claim"
    for x in res:
        ok(x["stale"], "check_root(stale_after=2) of a 10 s old claim")
    assert len(r["log"]) == 1 and "stale after 2" in r["log"][0] and r["owner"]["pid"] == r["my_pid"]


def test_filesystem_entries_are_left_alone(jobs):
    """A root that is a mount point (lost+found) or on NFS (.nfsXXXX) is a checkpoint root; saves keep those."""
    res = scenario(jobs, "foreign_entries")
    r = res[0]
    print(f"root after two saves (keep=1) and a load: {r['after']}")
    for x in res:
        for call in ("check_root", "save", "save2", "load"):
            ok(x[call], call)
    assert r["step"] == 2 and {".nfs0000000001234", "lost+found", "step-00000002"} <= set(r["after"])


def test_close_releases_every_claim(jobs):
    """ckpt.close() removes this run's claims, so the next run needs no stale wait."""
    closed = jobs["main"][0].get("close")
    assert closed, f"the main job did not reach close():\n{jobs['main_out'][-3000:]}"
    print(f"claimed before close(): {closed['claimed_before']}; after: {closed['claimed_after']}")
    assert len(closed["claimed_before"]) >= 10 and closed["claimed_after"] == []
    assert jobs["main_rc"] == 0, jobs["main_out"][-3000:]


# ---------------------------------------------------------------------------------- 3. one rank fails

INJECTED = {  # scenario: text of the cause that every rank's error must carry
    "save_user_state_dict": "state_dict() of the data loader broke on rank 1",
    "load_user_load_state_dict": "load_state_dict() of the data loader broke on rank 0",
    "save_checksum": "checksum, injected",
    "load_hash": "checksum, injected",
    "load_read_metadata": "read .metadata, injected",
    "load_read_data": "read shard, injected",
    "load_set_state_dict": "set_state_dict broke (injected)",
    "save_prepare_rank0": "mkdir, injected",
    "save_retain": "retention, injected",
    "save_stage_async": "out of host memory while staging (injected)",
}


@pytest.mark.parametrize("name", list(INJECTED))
def test_one_rank_fails(jobs, name):
    """One rank raises at one local step of save/load, checkpoint timeout one hour: every rank raises the same
    CheckpointError within 30 s naming that rank and the cause; then a normal save and load work."""
    res = scenario(jobs, name)
    r = res[0]
    failed_fast(res, f"{name} ({r['where']} raises on rank {r['fail_rank']})")
    for x in res:
        assert INJECTED[name] in x["msg"], f"the cause is not named: {x['msg']}"
        assert re.search(rf"\brank {r['fail_rank']}\b", x["msg"].lower()), f"the rank is not named: {x['msg']}"
    assert res[0]["msg"] == res[1]["msg"], "ranks raised different errors"
    # Retention runs after the commit: that save's checkpoint exists although save() raised.
    assert r["committed_after_failure"] == ([1, 2] if name == "save_retain" else [1])
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
    with its checkpoint committed, and the failure is logged; the next save and load work."""
    res = scenario(jobs, "retention_cannot_delete")
    r = res[0]
    print(f"save with rmtree failing on rank 0: {[x['raised'] for x in res]} after "
          f"{[x['secs'] for x in res]} s; log: {r['log']}; committed {r['committed']}; root {r['listing']}")
    for x in res:
        ok(x, "save whose retention failed")
        assert x["secs"] < BOUND and x["save_after"] == "step-00000004" and x["load_after"] == 4
    assert 3 in r["committed"] and any("could not remove" in ln for ln in r["log"])


@pytest.mark.parametrize("name, key, values", [("args_async_save", "async_save", (True, False)),
                                               ("args_keep", "keep", (5, 7)), ("args_rng", "rng", (True, False)),
                                               ("args_load_rng", "rng", (True, False))])
def test_different_arguments(jobs, name, key, values):
    """save()/load() given a different async_save/keep/rng on the two ranks (they would take different
    collective paths): both ranks fail at once, the error naming each rank's value; nothing is written."""
    res = scenario(jobs, name)
    failed_fast(res, name, bound=5)
    msg = res[0]["msg"]
    assert res[1]["msg"] == msg
    parts = dict(re.findall(r"rank (\d+): (.*?)(?=, rank \d+: |$)", msg, flags=re.S))
    for rank, value in enumerate(values):
        assert re.search(rf"\b{key}[=:] ?{value}\b", parts.get(str(rank), "")), f"rank {rank}'s {key} not named"
    assert res[0].get("committed_after_failure", []) == []
    assert all(x["save_after"] == "step-00000002" and "recover_error" not in x for x in res)


# ---------------------------------------------------------------------------------- 4. smaller ones


def test_step_of_any_size(jobs):
    """Step 10**8 is step-100000000: the root stays a checkpoint root, orders by commit and loads back."""
    r = scenario(jobs, "big_step")[0]
    print(f"saved {r['save']}, {r['save2']} (keep=1): committed {r['committed_steps']}; load(root) -> "
          f"{r['load_root']} (weights equal: {r['weights_match']}); root at the end: {r['listing']}")
    assert (r["save"], r["save2"]) == ("step-100000000", "step-100000001")
    ok(r["check_root"], "check_root of a root holding step-100000001")
    assert r["committed_steps"] == [10**8 + 1] and r["load_root"] == 10**8 + 1 and r["weights_match"]
    assert r["first_differs"] and r["load_explicit"] == 10**8 + 1


def test_interrupted_wait_keeps_the_save(jobs):
    """Ctrl-C while PendingSave.wait() waits: the save stays in flight with its directory, and the next save
    commits it first (it used to be dropped, and the next save deleted the directory it was writing)."""
    res = scenario(jobs, "interrupted_wait")
    r = res[0]
    print(f"wait() raised {r['wait']['raised']}; still in flight: {r['in_flight_after']}; temp dir: "
          f"{r['tmp_after']}; after the next save: committed {r['committed']}, root {r['listing']}")
    for x in res:
        assert x["wait"]["raised"] == "KeyboardInterrupt" and x["in_flight_after"] and x["tmp_after"]
        ok(x["save2"], "the next save")
        assert x["pending_path"] == "step-00000001" and x["committed"] == [1, 2] and x["in_flight_end"] == 0
    assert not [n for n in r["listing"] if n.startswith(".tmp-")]


def test_timeout_then_next_save_works(jobs):
    """timeout=2 s and rank 1 arrives 5 s late: both ranks fail (rank 0 after about 2 s), nothing is
    committed, and the next save with the same timeout works: a timed-out group is not reused."""
    res = scenario(jobs, "timeout_recovery")
    failed_fast(res, "save with rank 1 five seconds late (timeout 2 s)", bound=5 + 10)
    assert 2 <= res[0]["secs"] < 2 + 10
    print(f"next save: {res[0].get('save_after')} in {res[0]['recover_secs']:.3f} s; committed {res[0]['committed']}")
    for x in res:
        assert x["committed_after_failure"] == [1] and x.get("save_after") == "step-00000003", x


def test_timeout_while_making_the_group(jobs):
    """The same late rank when save() must first create the group for this timeout (a loop's first save):
    both ranks raise CheckpointError, not a raw store/gloo error, and the next save works."""
    res = scenario(jobs, "timeout_first_save")
    for rank, x in enumerate(res):
        print(f"rank {rank}: {x['raised']} after {x['secs']:.1f} s: {x['msg'][:200]}; next save: {x.get('save_after')}")
    failed_fast(res, "first save, rank 1 2.5 s late (timeout 1 s)", bound=2.5 + 10)
    assert all(x.get("save_after") == "step-00000002" for x in res)


def test_save_after_a_failed_load(jobs):
    """A load that failed on one rank mid-read leaves ranks with different state (rank 0 read its shards,
    rank 1 did not). A save then must refuse, or commit a checkpoint that loads; never an unloadable one."""
    res = scenario(jobs, "save_after_failed_load")
    r = res[0]
    failed_fast([x["failed_load"] for x in res], "load failing on rank 1 mid-read")
    print(f"optimizer steps per rank afterwards: {[x['optimizer_steps'] for x in res]}; save: "
          f"{[x['save']['raised'] for x in res]} {r['save']['msg'][:200]}; load of it: "
          f"{[(x['load'] or {}).get('raised') for x in res]} {(r['load'] or {}).get('msg', '')[:300]}")
    if r["save"]["raised"]:
        failed_fast([x["save"] for x in res], "save of the half-loaded state")
        # It names the values that differ, not just "different arguments".
        assert "replicated_values[optim.state." in r["save"]["msg"] and "load a checkpoint" in r["save"]["msg"]
    else:
        for x in res:
            ok(x["load"], "load of what that save committed")
