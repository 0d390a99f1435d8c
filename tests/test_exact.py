"""The exact rules' fixes of issue items 6-10, each against the failure seen in the field:

  6. a re-save of step N killed between its two renames: the next run's claim deleted the complete new copy,
     and the run restarted from an older step, or from scratch;
  7. the root's lock inherited by a child forked without exec (a helper, a DataLoader worker under fork): a
     run that died left its root locked while the child lived;
  8. a failure after the commit's rename (the root's fsync) reported as a failed save, while the step was on
     disk and load() picked it, and the next save moved it aside as abandoned;
  9. an optimizer built with the same param groups in another order (a refactor) refused;
 10. a write error on one rank counted twice ("failed on 2 rank(s): rank 0: on rank 1: ...; rank 1: on rank 1");
and a rollback (check_root(rollback_to=)) killed between its moves: the later step left in place must never be
loaded, and the next claim finishes the rollback.

Jobs: tests/exact_job.py, as ranks forked from warm processes with torchrun's environment (tests/launch.py), or
as one plain process; a reader between a crash and the next run is this test process (a plain process).
Items 8-10 share one 2-rank job (scenarios, as tests/failpath_job.py runs them).

    python -m pytest -v -s tests/test_exact.py
"""

import collections
import json
import os
import re
import signal
import socket
import time

import pytest

from tests import launch  # first: its warm rank processes import torch while this one does

import ckpt  # noqa: E402
from tests import exact_job  # noqa: E402
from tests.harness import REPO, lock_is_free, processes  # noqa: E402

JOB = os.path.join(REPO, "tests", "exact_job.py")
STEPS = 8  # exact_job.py train's defaults: save every 2 steps, keep 2


def alive(pid):
    state = processes().get(pid)
    return state is not None and state[1] != "Z"


def read_json(path):
    return json.loads(path.read_text()) if path.exists() else None


def read_log(path):
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


# ---------------------------------------------------------------------- 6. a re-save killed between renames

Run = collections.namedtuple("Run", "rcs out run log fired secs")


def train_run(out, root, args, timeout=60):
    """One 2-rank exact_job.py train job; its ranks' exit codes, output, run.json, log and fired.json."""
    out.mkdir()
    t0 = time.monotonic()
    job = launch.start([JOB, "train", out, "--root", root, *map(str, args)], out=out / "output.txt")
    _, output = job.wait(timeout)
    return Run(job.rcs, output, read_json(out / "run.json") or {}, read_log(out / "log.jsonl"),
               read_json(out / "fired.json"), time.monotonic() - t0)


def copies(root):
    """{entry: (which save it holds, its files verify)} for each copy of a step under root."""
    found = {}
    for name in sorted(os.listdir(root)):
        if name.startswith(("step-", ckpt.TMP, ckpt.REPLACED)):
            manifest = ckpt.read_manifest(os.path.join(root, name))
            found[name] = (manifest["meta"]["save"], ckpt.verify_files(os.path.join(root, name), manifest) == [])
    return found


# kill point, the step re-saved, which copy the next run resumes from
CHAIN = [("first_rename", 2, "periodic"), ("second_rename", 4, "final"), ("after_fsync", 6, "final")]
Link = collections.namedtuple("Link", "run crash")


@pytest.fixture(scope="module")
def resave(tmp_path_factory):
    """An uninterrupted run; then a chain on one root: each run re-saves its last step and is killed at one point
    of that re-save; between the crash and the next run, this process reads the root; the next run resumes and
    is the run the next kill hits; the last one trains to the end."""
    d = tmp_path_factory.mktemp("resave")
    t0 = time.monotonic()
    reference = train_run(d / "reference", d / "reference-ckpt", [])
    assert reference.rcs == [0, 0], reference.out[-3000:]
    root, links = d / "ckpt", []
    for i, (point, n, _) in enumerate(CHAIN + [(None, None, None)]):
        args = (["--resume"] if i else []) + (["--stop-after", n, "--kill", point, "--kill-step", n] if point else [])
        run = train_run(d / f"run{i}-{point}", root, args)
        crash = None
        if point:
            crash = {"listing": sorted(os.listdir(root)), "copies": copies(root), "committed": ckpt.committed_steps(
                str(root)), "found": os.path.basename(ckpt.find_checkpoint(str(root)))}
            reader = exact_job.Net()  # an evaluation job: a plain process, its own plain model
            t = time.monotonic()
            crash["reader_step"] = ckpt.load(str(root), reader)
            crash["reader_secs"], crash["reader_weights"] = time.monotonic() - t, exact_job.weights(reader)
        links.append(Link(run, crash))
    print(f"\nre-save chain: reference run {reference.secs:.1f} s; runs "
          f"{', '.join(f'{link.run.secs:.1f}' for link in links)} s; all {time.monotonic() - t0:.1f} s")
    return reference, root, links


def same_as_reference(reference, log, steps):
    """Bit for bit: the same loss float and the same full weights after every step; returns max |dloss|."""
    assert sorted(log) == list(steps), f"logged steps {sorted(log)}, expected {list(steps)}"
    for s in steps:
        assert log[s]["loss"] == reference.log[s]["loss"], f"step {s}: loss differs"
        assert log[s]["weights"] == reference.log[s]["weights"], f"step {s}: weights differ"
    return max((abs(log[s]["loss"] - reference.log[s]["loss"]) for s in steps), default=0.0)


@pytest.mark.parametrize("i", range(len(CHAIN)), ids=[c[0] for c in CHAIN])
def test_resave_killed(resave, i):
    """A re-save of step N (the loop's final save of the step its periodic save just wrote) killed at one point
    of its commit, every rank SIGKILLed: the field's next run whose claim deleted the complete new copy and
    restarted from an older step or from scratch. A reader between the crash and the next run loads step N; the
    next run resumes from step N (the old copy if the new one was not yet step-N, else the new one), its claim
    leaves no .replaced-/.tmp- behind, and it trains bit for bit as the uninterrupted run."""
    reference, root, links = resave
    point, n, copy = CHAIN[i]
    link, after = links[i], links[i + 1]
    crash, tag = link.crash, f"step-{n:08d}"
    print(f"\nkill {point} in the re-save of step {n}: fired {link.run.fired}; exit codes {link.run.rcs}")
    print(f"on disk after the crash: {crash['copies']} (save, verifies); find_checkpoint: {crash['found']}; "
          f"committed {crash['committed']}")
    print(f"reader (plain process): load() -> step {crash['reader_step']} in {crash['reader_secs']:.3f} s, "
          f"weights {crash['reader_weights']} (saved at step {n}: {link.run.run['saved'].get(str(n))})")
    print(f"next run: chose {after.run.run.get('chosen')} (the {after.run.run.get('copy')} copy), resumed from step "
          f"{after.run.run.get('resumed')}; root after its claim: {after.run.run.get('after_claim')}")
    assert link.run.fired and link.run.rcs == [-signal.SIGKILL] * 2, link.run.out[-3000:]
    assert link.run.run["saved"].get(str(n)), "the periodic save of step N must have returned before the re-save"
    names = {name.rsplit("-", 1)[0] if not name.startswith("step-") else name: name for name in crash["copies"]}
    old, new = names[f"{ckpt.REPLACED}{tag}"], names[f"{ckpt.TMP}{tag}" if point == "first_rename" else tag]
    assert crash["copies"][old] == ("periodic", True) and crash["copies"][new] == ("final", True)
    assert len(crash["copies"]) == len(names) == (2 if n == 2 else 3), "one older step (keep=2), two copies of N"
    assert crash["found"] == (old if point == "first_rename" else tag) and crash["committed"][-1] == n
    assert (crash["reader_step"], crash["reader_weights"]) == (n, link.run.run["saved"][str(n)])
    assert after.run.run["resumed"] == n and after.run.run["copy"] == copy
    leftovers = [e for e in after.run.run["after_claim"] if e.startswith((ckpt.TMP, ckpt.REPLACED))]
    assert leftovers == [] and tag in after.run.run["after_claim"], after.run.run["after_claim"]
    said = [ln for ln in after.run.out.splitlines() if tag in ln and ("again" in ln or "removed" in ln)]
    print(f"its claim said: {said}")
    if point == "first_rename":
        assert any(f"{tag} is step {n} again" in ln for ln in said)
        assert any(f"removed {root / new}, left by an interrupted save" in ln for ln in said)
    else:
        assert any(f"removed {root / old}, left by an interrupted save" in ln for ln in said)
    before = same_as_reference(reference, link.run.log, range(min(link.run.log), n + 1))
    last = max(after.run.log)
    dloss = same_as_reference(reference, after.run.log, range(n + 1, last + 1))
    print(f"steps {min(link.run.log)}..{n} before the kill: max |dloss| {before:.1e}; steps {n + 1}..{last} after "
          f"the resume: max |dloss| {dloss:.1e}, weights equal at every step")


def test_resave_chain_ends_clean(resave):
    """After the three kills, the last run trains to the end: its root holds the uninterrupted run's steps and
    nothing else, and every step of the chain equals the uninterrupted run bit for bit."""
    reference, root, links = resave
    final = links[-1].run
    end = sorted(os.listdir(root))
    print(f"\nlast run: exit codes {final.rcs}; root at the end {end}; the reference's {reference.run['end']}; "
          f"final weights {final.log[STEPS]['weights']} (reference {reference.log[STEPS]['weights']})")
    assert final.rcs == [0, 0] and final.run["resumed"] == CHAIN[-1][1]
    assert end == reference.run["end"] == [ckpt.OWNER, "step-00000006", "step-00000008"]
    assert copies(root) == {"step-00000006": ("final", True), "step-00000008": ("final", True)}  # the new copies
    for link in links:
        same_as_reference(reference, link.run.log, sorted(link.run.log))
    assert sorted(s for link in links for s in link.run.log) == list(range(1, STEPS + 1)), "each step trained once"


# ------------------------------------------------------------------------ 7. a forked child and the lock


def hold_then_claim(d, hook):
    """A run claims a root and forks a child; this process tries the root while the run lives; the run's ranks
    are SIGKILLed; a new run claims the root while the child lives; then the child ends."""
    name = "hook" if hook else "no_hook"
    out, root = d / name, d / f"{name}-root"
    out.mkdir()
    res = {}
    job = launch.start([JOB, "hold", out, "--root", root] + ([] if hook else ["--no-fork-hook"]),
                       out=out / "output.txt")
    ready, child = None, None
    try:
        deadline = time.monotonic() + 60
        while not (out / "ready.json").exists():
            assert not job.poll() and time.monotonic() < deadline, f"no ready.json:\n{job.wait(5)[1][-3000:]}"
            time.sleep(0.02)
        ready = read_json(out / "ready.json")
        child = ready["child"]
        res["ready"] = ready
        # A second run while the first lives (this plain process): refused, naming the holder.
        try:
            ckpt.check_root(str(root), exact_job.Net())
            res["refusal"] = None
            ckpt.close()  # a claim that went through is released (the test then fails)
        except ckpt.CheckpointError as e:
            res["refusal"] = str(e)
        named = re.search(r"holds the lock on \.owner\.json: (\{.*?\})\. Stop", res["refusal"] or "")
        res["named"] = json.loads(named[1]) if named else None
        res["named_alive"] = alive(res["named"]["pid"]) if named else None
        res["kill_time"] = time.time()
        job.kill()  # SIGKILL every rank of the run (the OOM killer, a lost node)
        job.wait(30)
        res["rcs"], res["child_alive_at_claim"] = job.rcs, alive(child)
        claim_out = out / "claim"
        launch.run([JOB, "claim", claim_out, "--root", root], timeout=60)
        res["claim"] = read_json(claim_out / "claim.json")
        res["child_alive_after_claim"] = alive(child)
        res["lock_free_while_child_lives"] = lock_is_free(str(root))  # the new run closed: who holds it now?
    finally:
        job.kill()
        (out / "release").touch()
        deadline = time.monotonic() + 10
        while child and alive(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
    res["lock_free_after_child"] = lock_is_free(str(root))
    return res


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    d = tmp_path_factory.mktemp("fork")
    t0 = time.monotonic()
    res = {hook: hold_then_claim(d, hook) for hook in (True, False)}
    print(f"\nfork runs (with the hook, then the control without): {time.monotonic() - t0:.1f} s")
    return res


def test_forked_child_does_not_keep_the_lock(forks):
    """A run claimed its root, forked a helper without exec, and was SIGKILLed while the helper lived: the field's
    root left locked ('in use by another run') as long as the child lived. The next run claims it at once."""
    r = forks[True]
    c = r["claim"]
    print(f"\nrun ranks SIGKILLed (exit codes {r['rcs']}); child {r['ready']['child']} alive at the claim: "
          f"{r['child_alive_at_claim']}; the new run's check_root: error {c['error']}, {c['secs']:.3f} s, "
          f"{c['claimed_at'] - r['kill_time']:.2f} s after the SIGKILL (the job's start-up included); child alive "
          f"after the claim: {r['child_alive_after_claim']}; owner then {c['owner']}")
    assert r["rcs"] == [-signal.SIGKILL] * 2 and r["child_alive_at_claim"] and r["child_alive_after_claim"]
    assert c["error"] is None and c["secs"] < 5
    assert json.loads(c["owner"])["pid"] == c["pid"]
    assert r["lock_free_while_child_lives"], "the new run closed: nothing may hold the lock, the child included"


def test_fork_hook_control(forks):
    """The control: the same run with os.register_at_fork a no-op (ckpt's hook never registered) leaves the root
    locked by the child, and the new run is refused naming the dead rank; once the child ends, the root is free.
    Shows that the test above can fail."""
    r = forks[False]
    c = r["claim"]
    named = re.search(r"holds the lock on \.owner\.json: (\{.*?\})\. Stop", c["error"] or "")
    holder = json.loads(named[1]) if named else {}
    print(f"\nwithout the hook: child {r['ready']['child']} alive at the claim: {r['child_alive_at_claim']}; the new "
          f"run's check_root after {c['secs']:.3f} s: {str(c['error'])[:300]}; it names pid {holder.get('pid')} "
          f"(alive: {alive(holder['pid']) if holder else None}); lock free while the child lived: "
          f"{r['lock_free_while_child_lives']}, after it ended: {r['lock_free_after_child']}")
    assert r["child_alive_at_claim"] and c["error"] and "is in use by another run" in c["error"]
    assert holder.get("pid") == r["ready"]["pid"] and not alive(holder["pid"])
    assert not r["lock_free_while_child_lives"] and r["lock_free_after_child"]


@pytest.mark.parametrize("hook", [True, False], ids=["hook", "no_hook"])
def test_refusal_names_a_live_holder(forks, hook):
    """While a run holds its root, a second run is refused naming the first run's process (rank 0's pid and host),
    which is alive: not a forked child, not a dead process."""
    r = forks[hook]
    print(f"\nwhile the first run lived: refused: {str(r['refusal'])[:300]}; named pid "
          f"{r['named'] and r['named']['pid']} (alive: {r['named_alive']}); the run's rank 0 is pid "
          f"{r['ready']['pid']}, its child {r['ready']['child']}")
    assert r["refusal"] and "is in use by another run" in r["refusal"]
    assert r["named"]["pid"] == r["ready"]["pid"] != r["ready"]["child"]
    assert r["named_alive"] and r["named"]["host"] == socket.gethostname()


# ------------------------------------------------------------------- a rollback killed between its moves


@pytest.fixture(scope="module")
def rollback_killed(tmp_path_factory):
    """exact_job.py rollback-crash: steps 1-3 committed, a run resumes step 1 and is SIGKILLed (every rank) inside
    check_root(rollback_to=1), right after its first rename to .abandoned-. Between the crash and the next run,
    this process (a plain one, a reader) looks at the root and loads it. Then rollback-next: the next run."""
    d = tmp_path_factory.mktemp("rollback")
    root = d / "ckpt"
    t0 = time.monotonic()
    res = {}
    for mode in ("rollback-crash", "rollback-next"):
        out = d / mode
        out.mkdir()
        t = time.monotonic()
        job = launch.start([JOB, mode, out, "--root", root], out=out / "output.txt")
        _, output = job.wait(60)
        res[mode] = {"rcs": job.rcs, "out": output, "run": read_json(out / "run.json") or {},
                     "fired": read_json(out / "fired.json"), "secs": time.monotonic() - t}
        if mode == "rollback-crash":
            crash = {"listing": sorted(os.listdir(root)), "committed": ckpt.committed_steps(str(root)),
                     "found": os.path.basename(ckpt.find_checkpoint(str(root)) or "")}
            reader = exact_job.Net()
            crash["reader_step"] = ckpt.load(str(root), reader)
            crash["reader_weights"] = exact_job.weights(reader)
            res["reader"] = crash
    print(f"\nrollback killed, then the next run: {res['rollback-crash']['secs']:.1f} s, "
          f"{res['rollback-next']['secs']:.1f} s; all {time.monotonic() - t0:.1f} s")
    return res


def test_rollback_killed_between_its_moves(rollback_killed):
    """Steps 1, 2, 3 committed; a run resumes step 1 (load() of step-00000001 with the optimizer). Its save of step 2
    is refused on every rank, naming step 3 and rollback_to (a load is no rollback). It calls
    check_root(rollback_to=1) and every rank is SIGKILLed after the durable marker and the first of the two moves:
    one later step is .abandoned-, the other still step-N. A fresh process's load(root) returns 1 (never the later
    step left in place), as does the next run's load(root) with the optimizer, before any claim; that run's claim
    finishes the rollback (both later steps .abandoned-, the marker gone), and its save of step 2 is the newest
    commit. Guards against a rollback cut short leaving an old-branch step as the newest commit a resume picks."""
    crash, reader, nxt = (rollback_killed["rollback-crash"], rollback_killed["reader"],
                          rollback_killed["rollback-next"])
    run, fired = crash["run"], crash["fired"]
    print(f"\nresumed step {run.get('loaded')}; save of step 2 unsaid: {run.get('unsaid', {}).get('raised')}: "
          f"{run.get('unsaid', {}).get('msg', '')[-200:]}")
    print(f"killed after moving {fired and fired['moved']}: exit codes {crash['rcs']}; "
          f"root then {fired and fired['listing']}")
    print(f"a fresh process (this one): find_checkpoint {reader['found']}, committed {reader['committed']}, "
          f"load(root) -> {reader['reader_step']} "
          f"(step 1's weights: {reader['reader_weights'] == run.get('saved', {}).get('1')})")
    assert crash["rcs"] == [-signal.SIGKILL] * 2 and fired, crash["out"][-3000:]
    assert "check_root_returned" not in run
    assert run["loaded"] == 1 and run["loaded_weights"] == run["saved"]["1"]
    assert run["unsaid"]["raised"] == "CheckpointError"
    assert "holds step-00000003, a later step than 2" in run["unsaid"]["msg"] and "rollback_to=" in run["unsaid"]["msg"]
    assert run["after_unsaid"] == [ckpt.OWNER, "step-00000001", "step-00000002", "step-00000003"]
    marker = f"{ckpt.ROLLBACK}00000001"
    at_kill = fired["listing"]
    moved = [n for n in at_kill if n.startswith(ckpt.ABANDONED)]
    left = [n for n in at_kill if n.startswith("step-")]
    assert marker in at_kill, "the marker must be on disk before the first move"
    assert len(moved) == 1 and moved[0] == fired["moved"][1] and fired["moved"][0] in ("step-00000002", "step-00000003")
    assert left == ["step-00000001", ({"step-00000002", "step-00000003"} - {fired["moved"][0]}).pop()], \
        "the kill must fall between the two moves"
    assert reader["listing"] == at_kill
    assert reader["found"] == "step-00000001" and reader["committed"] == [1]
    assert reader["reader_step"] == 1 and reader["reader_weights"] == run["saved"]["1"]
    n = nxt["run"]
    print(f"next run: chose {n.get('chosen')}, load(root) with the optimizer -> {n.get('loaded')}; root before its "
          f"claim {n.get('before_claim')}; its claim: {n.get('claim', {}).get('raised')}, logged {n.get('moved')}; "
          f"root after {n.get('after_claim')}; save 2 -> {n.get('path2')}, reload -> {n.get('reload')}; root at the "
          f"end {n.get('end')}")
    assert nxt["rcs"] == [0, 0], nxt["out"][-3000:]
    assert n["chosen"] == "step-00000001" and n["loaded"] == 1 and n["loaded_weights"] == run["saved"]["1"]
    assert n["before_claim"] == at_kill, "load() claims nothing and moves nothing"
    assert n["claim"]["raised"] is None
    assert [ln.split()[2] for ln in n["moved"]] == [left[1]] and "given up by a rollback to step 1" in n["moved"][0]
    aside = sorted(name.split("-")[2] for name in n["after_claim"] if name.startswith(ckpt.ABANDONED))
    assert aside == ["00000002", "00000003"] and moved[0] in n["after_claim"]
    assert [name for name in n["after_claim"] if not name.startswith(ckpt.ABANDONED)] == [ckpt.OWNER, "step-00000001"]
    assert n["save2"]["raised"] is None and n["path2"] == "step-00000002"
    assert n["reload"] == 2 and n["reload_weights"] == n["saved2"] and n["committed"] == [1, 2]
    assert not [name for name in n["end"] if name.startswith(ckpt.ROLLBACK)]


# ---------------------------------------------------------------------------------- 8-10. scenarios


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """One 2-rank job runs every scenario; a plain process runs the param groups' one."""
    d = tmp_path_factory.mktemp("scenarios")
    t0 = time.monotonic()
    rc, out = launch.run([JOB, "scenarios", d / "out", d / "work"], timeout=120, check=False)
    t1 = time.monotonic()
    rc_plain, out_plain = launch.run([JOB, "scenarios", d / "plain", d / "plain-work", "--plain", "--only", "groups",
                                      "groups_scheduler"],
                                     nproc=1, timeout=60, check=False)
    print(f"\nscenario job: exit {rc} after {t1 - t0:.1f} s; plain process: exit {rc_plain} after "
          f"{time.monotonic() - t1:.1f} s")
    assert rc == 0 and rc_plain == 0, (out + out_plain)[-4000:]
    return {"fsdp": [read_json(d / "out" / f"results.{r}.json") for r in (0, 1)],
            "plain": [read_json(d / "plain" / "results.0.json")]}


def scenario(scenarios, name, kind="fsdp"):
    res = [r.get(name) for r in scenarios[kind]]
    for rank, r in enumerate(res):
        assert r is not None, f"scenario {name} never finished on rank {rank}"
        assert "hung_after_s" not in r, f"scenario {name} still ran after {r['hung_after_s']} s on rank {rank}"
        assert "unexpected" not in r, f"scenario {name} on rank {rank}: {r['unexpected']}\n{r.get('trace', '')}"
    return res


def untimed(x):
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if not k.endswith("secs")}
    return [untimed(v) for v in x] if isinstance(x, list) else x


@pytest.mark.parametrize("name", ["root_fsync_fails", "root_fsync_fails_async"])
def test_commit_stands_when_the_root_fsync_fails(scenarios, name):
    """The fsync of the root after the commit's rename fails (EIO) on rank 0: the field's save reported as failed
    while its step was on disk and load() picked it, and the next save moved it aside as abandoned. Now save()
    returns the path on every rank, the warning names the step as committed, load() finds it, and the next save
    keeps it."""
    res = scenario(scenarios, name)
    r = res[0]
    print(f"\n{name}: the root's fsync raised {r['raised_on_rank']['count']} time(s) on rank 0 (root then "
          f"{r['raised_on_rank']['listing']}); save() on each rank: {[(x['save']['raised'], x['path']) for x in res]}")
    print(f"rank 0 logged: {r['warnings'][0]}; find_checkpoint: {r['found']}; load() -> {r['load']} (weights equal: "
          f"{r['load_weights_equal']}); the next save -> {os.path.basename(r['path3'])}, moved aside: "
          f"{r['moved_aside_log']}; root {r['end']}")
    assert r["raised_on_rank"]["count"] == 1 and res[1]["raised_on_rank"]["count"] == 0
    assert "step-00000002" in r["raised_on_rank"]["listing"][0], "it must fail after the rename only"
    assert re.match(r"step 2 is committed, but the fsync of .* failed", r["warnings"][0])
    assert not any("committed, but" in ln for ln in res[1]["warnings"])
    for x in res:
        assert x["save"]["raised"] is None and x["path"].endswith("/step-00000002")
        assert (x["found"], x["load"], x["load_weights_equal"]) == ("step-00000002", 2, True)
        assert x["save3"]["raised"] is None and x["moved_aside_log"] == []
        assert x["committed"] == [1, 2, 3] and not [e for e in x["end"] if e.startswith(ckpt.ABANDONED)]
    strip = ("warnings", "raised_on_rank")
    assert untimed({k: v for k, v in res[0].items() if k not in strip}) == \
        untimed({k: v for k, v in res[1].items() if k not in strip}), "every rank must agree"


@pytest.mark.parametrize("kind", ["fsdp", "plain"])
def test_param_groups_matched_by_the_names_they_hold(scenarios, kind):
    """Saved with AdamW groups [decay, no_decay] (their own lr, weight_decay, betas), loaded into the same groups
    each listing its parameters in another order (torch numbers the parameters otherwise: state by position would
    go to the wrong ones): each group gets its own options and each parameter its own state, and training continues
    bit for bit (2 ranks FSDP2; a plain process). The groups themselves in another order are refused naming them:
    an LR scheduler's state is a list in the groups' order, and would give each group another group's lr."""
    res = scenario(scenarios, "groups", kind)
    r = res[0]
    shown = [(g["params"], g["lr"], g["weight_decay"], g["betas"]) for g in r["saved_groups"]]
    print(f"\n{kind}: saved groups {shown}")
    print(f"loaded into the same groups, parameters listed in reverse (load -> {r.get('loaded')}): "
          f"{[(g['params'], g['lr'], g['weight_decay'], g['betas'], g['steps']) for g in r['loaded_groups']]}")
    print(f"3 steps after: losses {r['resumed']['losses']} vs uninterrupted {r['ref']['losses']}; weights "
          f"{r['resumed']['weights']} vs {r['ref']['weights']}; optimizer state equal by name: "
          f"{r['resumed']['opt'] == r['ref']['opt']}")
    print(f"groups in another order: {r['reordered']['raised']}: {r['reordered']['msg'][-200:]}")
    options = ("lr", "weight_decay", "betas")
    saved = {tuple(sorted(g["params"])): [g[k] for k in options] for g in r["saved_groups"]}
    assert r["load"]["raised"] is None and r["loaded"] == 2
    assert [g["params"] for g in r["loaded_groups"]] == [exact_job.DECAY[::-1], exact_job.NO_DECAY[::-1]]
    for g, set_ in zip(r["loaded_groups"], ("decay", "no_decay")):
        want = [exact_job.OPTIONS[set_][k] for k in options]
        assert [g[k] for k in options] == saved[tuple(sorted(g["params"]))] == [*want[:2], list(want[2])]
        assert g["steps"] == [2.0]
    assert r["resumed"]["losses"] == r["ref"]["losses"], "bit for bit: the same loss floats"
    assert r["resumed"]["weights"] == r["ref"]["weights"] and r["resumed"]["opt"] == r["ref"]["opt"]
    assert [g["steps"] for g in r["resumed"]["groups"]] == [[5.0], [5.0]]
    assert r["reordered"]["raised"] == "CheckpointError"
    assert "param group 0 was group 1 when saved" in r["reordered"]["msg"] and "LR scheduler" in r["reordered"]["msg"]
    assert all(untimed(x) == untimed(r) for x in res), "every rank must agree"


@pytest.mark.parametrize("kind", ["fsdp", "plain"])
def test_param_groups_in_another_order_with_a_scheduler(scenarios, kind):
    """The groups in another order with a LambdaLR over the optimizer in extra (as train_fsdp.py and the README's
    loop have): matched by name alone, the load would succeed and the scheduler, whose base_lrs follow the saved
    order, give each group another group's lr from its next step (a silent change of the run). Refused."""
    res = scenario(scenarios, "groups_scheduler", kind)
    r = res[0]
    print(f"\n{kind}: load -> {r.get('loaded')} {r['load']['raised']}: {r['load']['msg'][-200:]}")
    assert all(untimed(x) == untimed(r) for x in res), "every rank must agree"
    assert r["load"]["raised"] == "CheckpointError" and "was group 1 when saved" in r["load"]["msg"]


@pytest.mark.parametrize("where", [
    "end",
    "front",
])
@pytest.mark.parametrize("kind", ["fsdp", "plain"])
def test_moved_parameter_is_refused(scenarios, kind, where):
    """b.weight moved from the decay group to the no_decay group (at its end, or at its front): the optimizer's
    groups hold other parameters than they did, and the load is refused naming the moved parameter and it alone
    (a refusal naming the wrong parameters sends the user hunting)."""
    res = scenario(scenarios, "groups", kind)
    for rank, x in enumerate(res):
        m = x[f"moved_{where}"]
        named = re.findall(r"\[([^\]]*)\] are in one of them only", m["msg"])
        print(f"\n{kind}, rank {rank}, groups {m['groups']}: {m['raised']}: {m['msg'][:400]}")
        print(f"named as moved: {named}")
        assert m["raised"] == "CheckpointError" and "does not hold the parameters its saved group held" in m["msg"]
        assert named and all(n == "'b.weight'" for n in named), f"must name b.weight alone: {named}"


@pytest.mark.parametrize("name", ["write_error_fsync", "write_error_write_data", "write_error_async"])
def test_write_error_counted_once(scenarios, name):
    """A write error (EIO) on rank 1 inside DCP's write (its fsync of a shard, its write_data, or in the
    background thread of an async save): the field's 'failed on 2 rank(s): rank 0: on rank 1: ...; rank 1: on
    rank 1: ...'. Each rank must report only its own failure: 'failed on 1 rank(s)', rank 1 named once, the same
    message on both ranks; nothing committed; the next save and a load work."""
    res = scenario(scenarios, name)
    for rank, x in enumerate(res):
        print(f"\n{name}: rank {rank} raised {x['raised']} after {x['secs']:.3f} s: {x['msg']}")
    r = res[0]
    print(f"committed after the failure {r['committed_after']}, root {r['listing_after']}; next save -> {r['path']}, "
          f"load -> {r['load_after']} (weights equal {r['load_weights_equal']}); committed {r['committed']}")
    for x in res:
        assert x["raised"] == "CheckpointError" and "writing failed on 1 rank(s): rank 1: OSError" in x["msg"]
        assert len(re.findall(r"\brank 1\b", x["msg"])) == 1 and "rank 0" not in x["msg"]
        assert "Input/output error" in x["msg"] and "on rank" not in x["msg"]
        assert x["committed_after"] == [1] and x["listing_after"] == [ckpt.OWNER, "step-00000001"]
        assert x["save_after"]["raised"] is None and x["path"] == "step-00000002"
        assert (x["load_after"], x["load_weights_equal"], x["committed"]) == (2, True, [1, 2])
    assert untimed(res[0]) == untimed(res[1]), "every rank must agree"


def test_resave_whose_second_rename_fails(scenarios):
    """A re-save of step 2 whose second rename fails (EIO) on rank 0, in a run that goes on (the error caught):
    the older copy is step-2 again (renamed back at once). The run's next saves must work and honour
    keep: after a resume of step 1, a save of step 2 is refused until the rollback to step 1 is said (the branch
    rule: step 2 would be replaced by a state that does not descend from it), and then works; with keep=1, a save
    of step 3 leaves step 3 alone. Guards against a run that cannot save any more, a root that grows past keep,
    and a newest commit silently replaced by another branch."""
    res = scenario(scenarios, "resave_rename_fails")
    for rank, x in enumerate(res):
        for case in ("rollback", "keep"):
            r = x[case]
            print(f"\nrank {rank}, {case}: the re-save raised {r['raised']}: {r['msg'][:200]}; root {r['after']}, "
                  f"find_checkpoint {r['found']}; then save: {r['save']['raised']}: {r['save']['msg'][:300]}; "
                  f"{r.get('retention_log', '')} root {r['end']}, committed {r['committed']}")
    for x in res:
        assert x["rollback"]["raised"] == x["keep"]["raised"] == "CheckpointError"
        assert re.search(r"step-00000002", x["rollback"]["found"]) and x["rollback"]["loaded"] == 1  # either name
        unsaid = x["rollback"]["unsaid"]
        assert unsaid["raised"] == "CheckpointError" and "rollback_to=" in unsaid["msg"], unsaid
        assert "holds step-00000002, a later step than 1 (the step its model continues from)" in unsaid["msg"]
        assert x["rollback"]["save"]["raised"] is None, "the rollback's save must work"
        assert x["keep"]["save"]["raised"] is None and x["keep"]["committed"] == [3]
        assert x["keep"]["end"] == [ckpt.OWNER, "step-00000003"], "keep=1: nothing else may stay"
