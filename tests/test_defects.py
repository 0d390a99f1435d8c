"""The defects a first reading of ckpt.py and a new user's own trainer reproduced: each test fails on the ckpt.py
before this round (149318c) and passes now.

  * one rule for parameter names, from the model's own state dict: a DDP model saves, resumes bit for bit and loads
    into FSDP2; an FSDP1 model is refused naming fully_shard (it was refused as if ranks held different values);
  * foreign input named as foreign: a plain dcp.save() directory is not "damaged"; a resume whose param groups hold
    other parameters says what to do; a fine-tune's new head loads with strict=False;
  * a value no digest can read (a meta tensor) fails every rank at once, not one rank while the others wait;
  * the branch rule at every save: a rollback to another step than the one loaded, an older resume saving the newest
    step's number, a second model loaded weights-only re-saving a step: refused; a stray .rollback-to- file ignored;
  * a mistyped root is said; a peer that died is not called a timeout; an async save's failure after its process
    group is gone is logged, not lost; an empty EMA in a plain process reads a sharded run's shadows whole; storage
    paths forged into .metadata are refused; a corrupted shard is refused by name at 1 and 2 ranks, and save()
    refuses the part-loaded model until a load succeeds;
  * this round's readings: two values of an extra at one path, equal dicts built in another order, ranks given
    other timeouts, strict=False leaving an extra unsaid or advising itself; an extra whose state is None, a
    weights-only load that kept a resume's lineage; a step of part of a batch, a stream key dropped or added; an
    extra of another dtype, a file passed as a checkpoint; test_resume.py passing a script that ignores --stop-after,
    train_fsdp.py's --stop-after below the step resumed and flags out of range; a param group's own option, the
    live param_names; close() forgetting a part-loaded model; a default group made anew without close(); a
    fine-tune's resized head; check_root() of a checkpoint directory; an optimizer part-loaded; .metadata's
    CRC with verify=False; a SkippingSampler start that is not a multiple of the ranks.

The 2-rank parts run in ONE job, tests/defects_job.py (ranks forked by tests/launch.py), started as the module starts.

    python -m pytest -q -s tests/test_defects.py
"""

import dataclasses
import json
import os
import pickle
import re
import sys

from tests import launch  # first: its warm rank processes import torch while this one does

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckpt
from tests import defects_job, state_job
from tests.harness import REPO, SMALL, TRAIN, logged_steps, refused_everywhere, run, scenarios_result, torchrun

JOB = os.path.join(REPO, "tests", "defects_job.py")


@pytest.fixture(scope="module", autouse=True)
def job_launch(request, tmp_path_factory):
    yield from launch.module_job(request, tmp_path_factory, JOB)


@pytest.fixture(scope="module")
def job(job_launch):
    rc, out = job_launch["job"].wait(timeout=240)
    return dict(scenarios_result(out, "defects_job.py", f"exit {rc}"), out_dir=str(job_launch["dir"] / "out"))


def scenario(job, name):
    for r, res in enumerate(job[name]):
        assert "unexpected" not in res, f"scenario {name} on rank {r}: {res['unexpected']}\n{res.get('trace', '')}"
    return job[name]


@pytest.fixture
def plain():
    """A test in this process without a process group: ckpt's world of one; forgotten after."""
    yield
    ckpt.close()


# ------------------------------------------------------------------------- 2 ranks: one rule for names, input


def test_ddp_saves_resumes_exactly_and_loads_into_fsdp2(job):
    """A DDP-wrapped model (its parameters named module.*): saved under the model's own names, resumed bit for bit,
    and loaded (weights only) into the same model sharded by fully_shard. 149318c refused it at save:
    'parameter module.a.weight has no entry in the model's state dict'."""
    for r, x in enumerate(scenario(job, "ddp")):
        print(f"\nrank {r}: keys {x['keys']}; resumed losses {x['resumed']} vs uninterrupted {x['reference']}; "
              f"into FSDP2 ({x['sharded']}): step {x['into_fsdp2']}, max |dweight| {x['fsdp2_vs_saved']:.1e}")
        assert x["keys"] == ["model.a.bias", "model.a.weight", "model.b.bias", "model.b.weight"]
        assert x["loaded"] == 2 and x["resumed"] == x["reference"]
        assert x["into_fsdp2"] == 2 and x["sharded"] == "DTensor" and x["fsdp2_vs_saved"] == 0.0


def test_fsdp1_is_refused_naming_fully_shard(job):
    """An FSDP1 model (FullyShardedDataParallel, use_orig_params=True: Accelerate's setup) is refused at save() on
    every rank, naming FSDP1 and fully_shard, nothing written. 149318c: '1 value(s) stored once differ among the
    ranks ... optim.0.group...', which reads like the user's error."""
    res = scenario(job, "fsdp1")
    msg = refused_everywhere(res, "FullyShardedDataParallel", "fully_shard")
    print(f"\n{msg[:300]}")
    assert "differ among the ranks" not in msg and all(x["listing"] == [] for x in res)


def test_plain_dcp_directory_is_refused_as_foreign(job):
    """A directory a plain dcp.save() wrote (.metadata, no manifest.json) is refused as not written by
    ckpt.save(), not as a damaged checkpoint; nothing in it is touched."""
    res = scenario(job, "foreign")
    msg = refused_everywhere([x["refused"] for x in res], "ckpt.save() did not write it", "dcp.load()")
    print(f"\n{msg[:300]}")
    assert "damaged" not in msg and all(x["listing"] == [".metadata", "__0_0.distcp", "__1_0.distcp"] for x in res)


def test_new_head_loads_with_strict_false(job):
    """A fine-tune's model: the checkpoint's layers and a new head. strict (the default) refuses naming the head's
    keys and strict=False; strict=False loads the layers exactly, leaves the head as it was, and logs its keys;
    with an optimizer it is refused (an initialisation only). A smaller model loads what it has and logs the
    checkpoint's keys it lacks."""
    x = scenario(job, "strict")[0]
    print(f"\nstrict: {x['refused']['msg'][:200]}\nwith an optimizer: {x['with_opt']['msg'][:160]}\nstrict=False: "
          f"step {x['loaded']}, layers max |d| {x['body_vs_saved']}, head unchanged {x['head_unchanged']}; "
          f"said {x['said_new']}\nsmaller model: step {x['smaller_loaded']}, said {x['said_left']}")
    assert x["refused"]["raised"] == "CheckpointError" and "head.weight" in x["refused"]["msg"]
    assert "strict=False" in x["refused"]["msg"]
    assert x["with_opt"]["raised"] == "CheckpointError" and "initialisation" in x["with_opt"]["msg"]
    assert x["loaded"] == 3 and x["body_vs_saved"] == 0.0 and x["head_unchanged"]
    assert len(x["said_new"]) == 1 and "model.head.bias, model.head.weight" in x["said_new"][0]
    assert x["smaller_loaded"] == 3 and x["smaller_vs_saved"] == 0.0
    assert len(x["said_left"]) == 1 and "model.b.bias" in x["said_left"][0] and "model.b.weight" in x["said_left"][0]


def test_param_groups_changed_says_what_to_do(job):
    """Stage 2 of a fine-tune unfreezes the backbone: its optimizer's group holds parameters the saved one did not.
    Refused on every rank naming them, and saying how to go on (the weights alone, a fresh optimizer)."""
    msg = refused_everywhere(scenario(job, "groups_changed"), "does not hold the parameters its saved group held",
                  "'a.bias', 'a.weight'", "load the weights alone")
    print(f"\n{msg[:300]}")


def test_value_no_digest_reads_fails_every_rank_at_once(job):
    """A meta tensor in an extra stored once (its digest cannot be read): save() fails on every rank within
    seconds, naming the key; nothing written. 149318c computed digests outside the step voted on: the rank that
    raised left, the other waited out the timeout (one hour by default)."""
    res = scenario(job, "unhashable")
    msg = refused_everywhere(res, "extra.cache.t")
    print(f"\n{msg[:200]}; seconds {[x['secs'] for x in res]}")
    assert all(x["secs"] < 10 and x["listing"] == [] for x in res)


# ------------------------------------------------------------------------------------ 2 ranks: the branch rule


def test_branch_rule_holds_at_every_save(job):
    """Root holds steps 2 and 4. A model loaded from step 4 asking rollback_to=2 is refused (it is not the step
    loaded) and nothing moves; a resume from step 2 saving step 4 is refused (it would replace step 4 by another
    branch), step 4 unchanged; a copy of the model loaded weights-only in the same process, with a fresh
    optimizer, is refused saving step 4, step 4 unchanged. 149318c checked the rule at the first claim of a process
    only, and never compared rollback_to with the step loaded."""
    x = scenario(job, "branches")[0]
    for what in ("rollback_other", "older_saves_newest", "weights_only_resave"):
        print(f"\n{what}: {x[what]['raised']}: {x[what]['msg'][:220]}")
    assert "rollback_to=2, but the model continues from step 4" in x["rollback_other"]["msg"]
    assert x["after_rollback_other"] == [ckpt.OWNER, "step-00000002", "step-00000004"]
    assert "a later step than 2 (the step its model continues from)" in x["older_saves_newest"]["msg"]
    assert "loaded none of them into its model as a resume" in x["weights_only_resave"]["msg"]
    assert x["step4_unchanged"] and x["step4_still_unchanged"]


def test_stray_rollback_file_is_ignored(job):
    """A file named .rollback-to-00000002.swp (an editor's) names no step: load, check_root and save work, and the
    file stays. 149318c: a bare ValueError from every load, save and claim on the root."""
    x = scenario(job, "branches")[0]["stray"]
    print(f"\nwith the stray file: load {x['load']['raised']}, check_root {x['check_root']['raised']}, save "
          f"{x['save']['raised']}; root {x['listing']}")
    assert (x["load"]["raised"], x["check_root"]["raised"], x["save"]["raised"]) == (None, None, None)
    assert x["committed"] == [2, 4, 5] and f"{ckpt.ROLLBACK}00000002.swp" in x["listing"]


def test_mistyped_root_is_said(job):
    """A resume from a root that does not exist loads nothing and says so at WARNING, naming the absolute path;
    check_root() then says it makes a new root. 149318c said nothing at INFO or above."""
    x = scenario(job, "mistyped_root")[0]
    print(f"\nload: {x['found']}, said {x['said_load']}; check_root said {x['said_claim']}")
    assert x["found"] is None and len(x["said_load"]) == 1 and "-typo: it does not exist" in x["said_load"][0]
    assert len(x["said_claim"]) == 1 and "-typo" in x["said_claim"][0]


# ------------------------------------------------------------------------------------ checksums, read beside DCP


def test_corrupted_shard_refused_by_name_and_save_refused_after(job):
    """A byte flipped in one of rank 1's tensors in its shard: the load (CRCs beside DCP's read) fails on every rank
    within seconds, naming __1_0.distcp; save() is refused (the model may hold part of it) until a load succeeds;
    then the damaged step is given up (rollback_to=2) and the save works. The control, verify=False, loads the
    damaged step without a word: the check is what refuses it."""
    res = scenario(job, "corrupt")
    msg = refused_everywhere([x["load"] for x in res], "__1_0.distcp does not match its checksum (corrupted)")
    print(f"\n{msg[:260]}; seconds {[x['secs'] for x in res]}\nsave after it: {res[0]['save']['msg'][:160]}\n"
          f"reload step {res[0].get('reloaded')}, rollback {res[0]['rollback']['raised']}, save "
          f"{res[0].get('saved_after')}; control verify=False: step {res[0].get('control_loaded')}, max |dweight| "
          f"{res[0]['control_vs_saved']:.3e}")
    refused_everywhere([x["save"] for x in res], "failed once it was reading into it", "load() again before saving")
    for x in res:
        assert x["secs"] < 10 and x["reloaded"] == 2 and x["rollback"]["raised"] is None
        assert x["saved_after"] == "step-00000003" and x["control_loaded"] == 4 and x["control_vs_saved"] > 0


def test_corrupted_shard_at_one_rank(tmp_path, plain):
    """The same at one rank (a plain process): the flipped byte refused by name, save() refused after, a reload of
    the intact step lets it save again."""
    torch.manual_seed(0)
    model = state_job.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = tmp_path / "root"
    for s in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(root, s, model, opt)
    shard = root / "step-00000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(root, model, opt)
    with pytest.raises(ckpt.CheckpointError) as again:
        ckpt.save(root, 3, model, opt)
    ckpt.close()  # a new run in this process: the model still holds part of the checkpoint
    with pytest.raises(ckpt.CheckpointError) as after_close:
        ckpt.save(root, 3, model, opt)
    print(f"\n{str(e.value)[:200]}\nsave after it: {str(again.value)[:120]}\nafter close(): {after_close.value}")
    assert "__0_0.distcp does not match its checksum (corrupted)" in str(e.value)
    assert "load() again before saving" in str(again.value) and "load() again" in str(after_close.value)
    assert ckpt.load(root / "step-00000001", model) == 1  # the weights alone: the optimizer holds part of step 2
    with pytest.raises(ckpt.CheckpointError) as optimizer_part_loaded:
        ckpt.save(tmp_path / "new", 1, model, opt)
    meta = root / "step-00000001" / ".metadata"
    intact = meta.read_bytes()
    meta.write_bytes(intact[:10] + bytes([intact[10] ^ 0xFF]) + intact[11:])
    with pytest.raises(ckpt.CheckpointError) as metadata:
        ckpt.load(root / "step-00000001", model, opt, verify=False)  # .metadata's CRC is checked all the same
    meta.write_bytes(intact)
    print(f"optimizer part-loaded: {str(optimizer_part_loaded.value)[:100]}\n.metadata: {str(metadata.value)[:160]}")
    assert "load() again before saving" in str(optimizer_part_loaded.value)
    assert ".metadata does not match its checksum" in str(metadata.value)
    assert ckpt.load(root / "step-00000001", model, opt) == 1
    ckpt.check_root(root, model, rollback_to=1)
    assert os.path.basename(ckpt.save(root, 2, model, opt)) == "step-00000002"


def test_extra_whose_state_is_none_comes_back(tmp_path, plain):
    """An extra whose state_dict() returns None (nothing to keep yet) is saved and loaded back: load_state_dict(None).
    Before, its key was dropped at save (None was taken for "its state is one tensor"), and load() refused it."""
    class Empty:
        given = "unset"
        def state_dict(self):
            return None
        def load_state_dict(self, sd):
            self.given = sd
    model, empty = state_job.Net(), Empty()
    ckpt.save(tmp_path / "root", 1, model, extra={"empty": empty})
    step = ckpt.load(tmp_path / "root", model, extra={"empty": empty})
    print(f"\nloaded step {step}; load_state_dict() was given {empty.given!r}")
    assert step == 1 and empty.given is None


def test_weights_only_load_ends_the_lineage(tmp_path, plain):
    """A model resumed from root a at step 2, then given root b's weights (a weights-only load): it no longer holds
    step 2's state, so a save of step 3 to a is refused by the branch rule. Before, the resume's lineage stayed and
    the save was taken as continuing step 2."""
    model = state_job.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for root, step in (("a", 2), ("b", 5)):
        ckpt.save(tmp_path / root, step, model, opt)
    assert ckpt.load(tmp_path / "a", model, opt) == 2
    assert ckpt.load(tmp_path / "b", model) == 5
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(tmp_path / "a", 3, model, opt)
    print(f"\nsave to a after b's weights: {str(e.value)[:200]}")
    assert "loaded none of them into its model as a resume" in str(e.value)
    assert ckpt.committed_steps(tmp_path / "a") == [2]


def test_strict_false_leaves_a_resized_head_and_says_what_it_left(tmp_path, plain, caplog):
    """load(strict=False) of a checkpoint without the extra passed, into a model whose head has another number of
    classes under the same name: the body loads, the head and the extra are left as they are, each said by name (the
    extra was left silently, the resized head refused). check_root() of a checkpoint directory, not its root, is
    refused (it wrote .owner.json into the commit and left the root unclaimed)."""
    ema = {"shadow": torch.zeros(3)}
    class Extra:
        def state_dict(self):
            return dict(ema)
        def load_state_dict(self, sd):
            ema.update(sd)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    path = ckpt.save(tmp_path / "root", 1, model)
    tuned = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 5))
    head = tuned[1].weight.detach().clone()
    with caplog.at_level("WARNING", logger="ckpt"):
        step = ckpt.load(tmp_path / "root", tuned, extra={"ema": Extra()}, strict=False)
    said = [r.getMessage() for r in caplog.records if "left as they are" in r.getMessage()]
    with pytest.raises(ckpt.CheckpointError) as strict:
        ckpt.load(tmp_path / "root", tuned)
    with pytest.raises(ckpt.CheckpointError) as claim:
        ckpt.check_root(path, model)
    print(f"\nloaded {step}, said: {said}\nstrict: {str(strict.value)[-120:]}\ncheck_root: {claim.value}")
    assert step == 1 and len(said) == 1 and torch.equal(tuned[0].weight, model[0].weight)
    assert torch.equal(tuned[1].weight, head) and all(k in said[0] for k in ("extra.ema", "model.1.weight"))
    assert "(a fine-tune's new or resized layers: strict=False)" in str(strict.value)
    assert "is a checkpoint, not a root" in str(claim.value) and not os.path.exists(os.path.join(path, ckpt.OWNER))


AGREE = r'''
import datetime, json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
import ckpt
dist.init_process_group("gloo")
rank, root, out = dist.get_rank(), sys.argv[1], {}
model = torch.nn.Linear(4, 4)
torch.nn.init.constant_(model.weight, 1.0)
class Extra:
    def __init__(self, state):
        self.state = state
    def state_dict(self):
        return self.state
    def load_state_dict(self, sd):
        self.state = sd
def attempt(name, fn):
    try:
        out[name] = {"value": fn()}
    except ckpt.CheckpointError as e:
        out[name] = {"error": str(e)}
# two values at one path, one of them each rank's own: refused, not one rank's value kept for all
attempt("collide", lambda: ckpt.save(root, 1, model, extra={"x": Extra({"w.lr": float(rank), "w": {"lr": 0.5}})}))
# equal dicts built in another order: saved, and loaded equal
names = ["alpha", "beta", "gamma"] if rank == 0 else ["gamma", "alpha", "beta"]
seen = Extra({n: len(n) for n in names})
attempt("order", lambda: ckpt.save(root, 2, model, extra={"seen": seen}))
attempt("order_load", lambda: ckpt.load(root, torch.nn.Linear(4, 4), extra={"seen": seen})
        and seen.state == {n: len(n) for n in names})
# ranks given other timeouts: refused by name, and the next save with one timeout works at once
attempt("timeouts", lambda: ckpt.save(root, 3, model, extra={"seen": seen}, timeout=30 + rank))
attempt("after", lambda: ckpt.save(root, 3, model, extra={"seen": seen}, timeout=30))
with open(f"{root}.rank{rank}", "w") as f:
    json.dump(out, f)
ckpt.close()
dist.destroy_process_group()
'''


def test_values_at_one_path_orders_and_timeouts_at_two_ranks(tmp_path):
    """At 2 ranks: an extra holding two values at one path ({"w.lr": <each rank's own>, "w": {"lr": ..}}) is refused
    naming the path (a path's digest was overwritten, so one rank's value passed as stored once and was loaded on
    every rank); dicts equal on every rank but built in another order are saved (they were refused as differing);
    ranks given other timeouts are refused naming the timeout, and the next save with one timeout works within
    seconds (it ran into the timeout: each rank had made a group for its own)."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    root = tmp_path / "root"
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                   str(root)], timeout=150, check=False, env=dict(os.environ, REPO=REPO))
    res = [json.loads((tmp_path / f"root.rank{r}").read_text()) for r in (0, 1)
           if (tmp_path / f"root.rank{r}").exists()]
    assert len(res) == 2, out[-3000:]
    for r, x in enumerate(res):
        print(f"\nrank {r}: " + "; ".join(f"{k}: {str(v)[:150]}" for k, v in x.items()))
        assert "two values of one object have the key extra.x.w.lr" in x["collide"]["error"]
        assert x["order"]["value"].endswith("step-00000002") and x["order_load"]["value"] is True
        assert "different arguments" in x["timeouts"]["error"] and "timeout=" in x["timeouts"]["error"]
        assert x["after"]["value"].endswith("step-00000003")
    assert ckpt.committed_steps(root) == [2, 3]


def test_position_refuses_a_step_that_is_not_whole_batches_and_any_change_of_stream():
    """Position.batches() with a global batch of 8 over 3 ranks of 2 (the README's batch // world at world 3): refused
    naming the numbers (it counted 6 samples a step, silently, and ranks left the epoch at different steps); without a
    batch_size, refused by name (a bare TypeError before). A stream key dropped or added at a resume is refused by
    name, as a changed one is (they were accepted)."""
    dataset = list(range(40))
    def first(global_batch, batch_size, world):
        sampler = ckpt.SkippingSampler(dataset, num_replicas=world, rank=0, shuffle=False)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        try:
            return next(ckpt.Position(global_batch).batches(loader)).tolist()
        except ValueError as e:
            return str(e)
    saved = ckpt.Position(8, seed=1, seq_len=128).state_dict()
    streams = {}
    for name, now in (("dropped", {"seed": 1}), ("added", {"seed": 1, "seq_len": 128, "vocab": 2})):
        try:
            ckpt.Position(8, **now).load_state_dict(saved)
            streams[name] = "accepted"
        except ValueError as e:
            streams[name] = str(e)
    said = {"8 over 3 x 2": first(8, 2, 3), "no batch_size": first(8, None, 2), "8 over 2 x 4": first(8, 4, 2)}
    uneven = ckpt.SkippingSampler(dataset, num_replicas=3, rank=0, shuffle=False)
    uneven.start = 4  # set directly: ranks would read 3, 3 and 2 samples, len() saying 12 each
    with pytest.raises(ValueError) as e:
        iter(uneven)
    said["start 4 over 3 ranks"] = str(e.value)
    print(f"\n{said}\n{streams}")
    assert "global_batch 8 is not a whole number of batches of 2 x 3 ranks" in said["8 over 3 x 2"]
    assert "batches of None x 2 ranks" in said["no batch_size"] and said["8 over 2 x 4"] == [0, 2, 4, 6]
    assert "seq_len 128 saved, None now" in streams["dropped"] and "vocab None saved, 2 now" in streams["added"]
    assert "start 4 is not a multiple of the 3 ranks" in said["start 4 over 3 ranks"]


def test_extra_of_another_layout_and_a_file_are_refused(tmp_path, plain):
    """An extra whose live tensor has another dtype than the one saved (a bf16 EMA saved as fp32) is refused naming
    the key: it was read as saved, and the object silently held fp32. A load of a file (a manifest.json) is refused
    as a file: it was called "does not exist" and load() returned None, so a resume started over."""
    model, shadow = torch.nn.Linear(3, 2), {"w": torch.ones(3)}
    class EMA:
        def state_dict(self):
            return dict(shadow)
        def load_state_dict(self, sd):
            shadow.update(sd)
    path = ckpt.save(tmp_path / "root", 1, model, extra={"ema": EMA()})
    shadow["w"] = torch.ones(3, dtype=torch.bfloat16)
    errors = {}
    for name, where in (("layout", tmp_path / "root"), ("file", os.path.join(path, ckpt.MANIFEST))):
        with pytest.raises(ckpt.CheckpointError) as e:
            ckpt.load(where, model, extra={"ema": EMA()})
        errors[name] = str(e.value)
    print(f"\n{errors}")
    assert "extra.ema.w is torch.float32 (3,) saved, torch.bfloat16 (3,) here" in errors["layout"]
    assert shadow["w"].dtype == torch.bfloat16 and "manifest.json is a file" in errors["file"]


def test_param_group_options_matched_per_group_before_the_read(tmp_path, plain):
    """AdamW over named parameters with a second group carrying a "name" and a custom option: resumed as saved (it was
    refused: every saved group was compared with live group 0); the live names kept (the checkpoint's were taken, a
    torch.compile wrapper's prefix and all); an option only the live group has kept. A checkpoint whose groups hold a
    scheduler's initial_lr, loaded before the scheduler is made: refused before any tensor is read, so the model is
    not left part-loaded (it was refused after the read, and save() then refused the model)."""
    def build(prefix="", **option):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
        named = [(prefix + n, p) for n, p in model.named_parameters()]
        head = {"params": named[2:], "name": "head", "my_opt": 7, **option}
        return model, torch.optim.AdamW([{"params": named[:2]}, head], lr=1e-2)
    model, opt = build("_orig_mod.")
    torch.optim.lr_scheduler.StepLR(opt, 2)  # its initial_lr in every group
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    ckpt.save(tmp_path / "root", 1, model, opt)
    model, opt = build(clip=1.0)
    torch.optim.lr_scheduler.StepLR(opt, 2)
    step = ckpt.load(tmp_path / "root", model, opt)
    names, head = opt.param_groups[0]["param_names"], opt.param_groups[1]
    fresh, fresh_opt = build()  # its scheduler would come after load()
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(tmp_path / "root", fresh, fresh_opt)
    saved_after = os.path.basename(ckpt.save(tmp_path / "other", 1, fresh, fresh_opt))
    print(f"\nloaded {step}; names {names}; head {sorted(head)}; no scheduler yet: {str(e.value)[-120:]}")
    assert step == 1 and names == ["0.weight", "0.bias"] and head["my_opt"] == 7 and head["clip"] == 1.0
    assert "initial_lr" in str(e.value) and saved_after == "step-00000001"


def test_default_group_made_anew_without_close(tmp_path, plain):
    """A process group destroyed without ckpt.close() and made anew: the next save makes ckpt's group anew and commits
    (the stale group was used: the save failed, blaming a crashed rank); close() after the default group is gone
    ends cleanly (a bare ValueError, which hid a failed background save's error)."""
    import torch.distributed as dist
    def init(name):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)
    model, saved = torch.nn.Linear(2, 2), []
    try:
        for run in ("first", "second"):
            init(run)
            saved.append(os.path.basename(ckpt.save(tmp_path / "root", len(saved) + 1, model)))
            dist.destroy_process_group()
        ckpt.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"\nsaved {saved} across two default groups; close() after both were gone: ok")
    assert saved == ["step-00000001", "step-00000002"]


def test_forged_storage_paths_refused(tmp_path, plain):
    """.metadata's storage paths forged to point into another step (its checksums forged to match): load() of step 2
    refuses the path by name instead of reading step 1's files. The control: plain DCP reads step 1's weights."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    root = tmp_path / "root"
    ckpt.save(root, 1, model, None)
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.save(root, 2, model, None)
    two = root / "step-00000002"
    md = ckpt.read_metadata(two)
    md.storage_data = {k: dataclasses.replace(v, relative_path=f"../step-00000001/{v.relative_path}")
                       for k, v in md.storage_data.items()}
    with open(two / ".metadata", "wb") as f:
        pickle.dump(md, f)
    manifest = json.loads((two / ckpt.MANIFEST).read_text())
    manifest["files"][".metadata"] = {"bytes": os.path.getsize(two / ".metadata"),
                                      "crc32": ckpt.chunk_crcs([str(two / ".metadata")])[0]}
    manifest["crc32"] = ckpt._manifest_crc(manifest)
    (two / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load(two, torch.nn.Linear(4, 4))
    control = {"model.weight": torch.empty(4, 4)}
    dcp.load(control, storage_reader=ckpt.SafeReader(str(two), md), planner=ckpt.SafeLoadPlanner(), no_dist=True)
    step1 = ckpt.read_metadata(root / "step-00000001")
    print(f"\n{str(e.value)[:240]}\ncontrol: plain DCP read weights {control['model.weight'][0, :2].tolist()} "
          f"(step 2's: {model.weight[0, :2].tolist()})")
    assert "names '../step-00000001/" in str(e.value) and "not a file its manifest lists" in str(e.value)
    assert step1 is not None and not torch.equal(control["model.weight"], model.weight.detach())


def test_empty_ema_in_a_plain_process_reads_sharded_shadows_whole(job, plain):
    """An evaluation job: a plain process (no process group) loads a 2-rank FSDP2 run's checkpoint with an EMA whose
    shadows were DTensors into an EMA that holds nothing yet (built lazily). In a world of one a whole tensor is the
    only layout: each shadow comes back whole, equal to what was saved. 149318c refused it."""
    x = scenario(job, "ema")[0]
    saved = torch.load(os.path.join(job["out_dir"], "ema.pt"), weights_only=True)
    model = defects_job.Net()
    ema = state_job.EMA(model)  # lazy: empty
    step = ckpt.load(saved["path"], model, extra={"ema": ema})
    diffs = {k: (ema.shadow[k] - v).abs().max().item() for k, v in saved["shadows"].items()}
    print(f"\nsaved as {x['kinds']}; loaded at step {step} into an empty EMA: {sorted(ema.shadow)}, max |d| "
          f"{max(diffs.values())}")
    assert x["kinds"] == ["DTensor"] and step == 1 and sorted(ema.shadow) == sorted(saved["shadows"])
    assert all(type(v) is torch.Tensor for v in ema.shadow.values()) and max(diffs.values()) == 0.0


# ------------------------------------------------------------------------------------- a rank gone, a group gone

PEER = r'''
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
import ckpt
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
ckpt.save(sys.argv[1], 1, model, None)
if dist.get_rank() == 1:
    os._exit(3)  # a crash: it never reaches the next save
t0 = time.monotonic()
try:
    ckpt.save(sys.argv[1], 2, model, None)
except ckpt.CheckpointError as e:
    print(f"RESULT {time.monotonic() - t0:.2f} {e}", flush=True)
    os._exit(0)
os._exit(1)
'''

DESTROYED = r'''
import logging, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
import ckpt
logging.basicConfig(level=logging.ERROR, format=f"[rank{os.environ['RANK']}] %(message)s")
dist.init_process_group("gloo")
model = torch.nn.Linear(64, 64)
pending = ckpt.save(sys.argv[1], 1, model, None, async_save=True)
dist.destroy_process_group()  # before ckpt.close(): the save's thread finds its group gone
'''

COPY_FAILS = r'''
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, os.environ["REPO"])
import ckpt
dist.init_process_group("gloo")
if dist.get_rank() == 1:  # a failure the copy's own handling does not catch (its stream's synchronize, say)
    def settle(self):
        raise RuntimeError("injected: the copy failed outside its try")
    ckpt.HostCopy.settle = settle
model = torch.nn.Linear(64, 64)
t0 = time.monotonic()
try:
    ckpt.save(sys.argv[1], 1, model, None, async_save=True, timeout=60).wait()
except ckpt.CheckpointError as e:  # a file per rank: two ranks' prints can interleave on one line of the output
    with open(f"{sys.argv[1]}.rank{dist.get_rank()}", "w") as f:
        f.write(f"{time.monotonic() - t0:.2f} {e}")
ckpt.close()
dist.destroy_process_group()
'''


def test_peer_that_died_is_not_called_a_timeout(tmp_path):
    """Rank 1 crashes before a save; rank 0's save fails within seconds and says after how many (so that the reader
    tells a peer gone from the one-hour timeout), not that every rank failed to arrive within the checkpoint timeout.
    149318c said the latter, after 0.1 s."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                   str(tmp_path / "root")], timeout=120, check=False, env=dict(os.environ, REPO=REPO))
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), "")
    print(f"\n{line[:300]}")
    assert line, out[-3000:]
    secs, msg = float(line.split()[1]), line.split(" ", 2)[2]
    waited = float(re.search(r"after (\d+\.\d) s", msg)[1])
    assert secs < 60 and waited < 60 and "within the checkpoint timeout" not in msg


def test_async_save_failure_after_its_group_is_gone_is_logged(tmp_path):
    """An async save whose process group is destroyed before ckpt.close(): the save's thread fails, and says so at
    ERROR on every rank as it happens; nothing is committed and no .tmp- directory stays. 149318c lost it silently:
    the writer's ValueError escaped its coordination, sat unread in the future, the process exited 0."""
    script = tmp_path / "destroyed.py"
    script.write_text(DESTROYED)
    root = tmp_path / "root"
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                   str(root)], timeout=120, check=False, env=dict(os.environ, REPO=REPO))
    said = [ln for ln in out.splitlines() if "a background save failed on rank" in ln]
    left = sorted(os.listdir(root)) if root.exists() else []
    print(f"\nexit {rc}; said: {said}; root: {left}")
    assert len(said) == 2 and {ln[:7] for ln in said} == {"[rank0]", "[rank1]"}, out[-3000:]
    assert ckpt.committed_steps(root) == [] and not [n for n in left if n.startswith(ckpt.TMP)]


def test_async_copy_failure_on_one_rank_fails_every_rank_at_once(tmp_path):
    """An async save whose host copy raises on rank 1 outside the copy's own try: every rank's save fails within
    seconds, naming the cause. Before, rank 1's thread left before DCP's plan: rank 1 raised a bare RuntimeError and
    rank 0 failed on a lost peer, not knowing why (had rank 1 trained on, rank 0 would have waited out the checkpoint
    timeout, an hour by default)."""
    script = tmp_path / "copy_fails.py"
    script.write_text(COPY_FAILS)
    rc, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                   str(tmp_path / "root")], timeout=150, check=False, env=dict(os.environ, REPO=REPO))
    said = {r: (tmp_path / f"root.rank{r}").read_text().split(" ", 1) for r in (0, 1)
            if (tmp_path / f"root.rank{r}").exists()}
    print("\n" + "\n".join(f"rank {r}: {float(secs):.2f} s: {msg[:200]}" for r, (secs, msg) in said.items()))
    assert sorted(said) == [0, 1], out[-3000:]
    for secs, msg in said.values():
        assert float(secs) < 30 and "injected: the copy failed outside its try" in msg
    assert ckpt.committed_steps(tmp_path / "root") == []


# ------------------------------------------------------------------------- the trainer and the resume test

IGNORES_STOP = r'''
import sys
sys.path.insert(0, sys.argv.pop(1))
import train_fsdp
i = sys.argv.index("--stop-after") if "--stop-after" in sys.argv else None
if i is not None:  # the defect under test: the script runs on past --stop-after K
    del sys.argv[i: i + 2]
sys.exit(train_fsdp.main())
'''


def test_resume_test_fails_a_script_that_ignores_stop_after(tmp_path):
    """test_resume.py on a script that never stops at --stop-after K (it trains all 16 steps every launch): it must
    fail, saying so. Before, it passed ("0 differ"): it kept the last record of each step of the log."""
    script = tmp_path / "ignores_stop.py"
    script.write_text(IGNORES_STOP.replace("sys.argv.pop(1)", repr(REPO)))
    env = dict(os.environ, CKPT_TEST_SCRIPT=str(script), CKPT_TEST_NPROC="1",
               CKPT_TEST_ARGS=" ".join(SMALL + ["--save-every", "4", "--seed", "3"]))
    rc, out = run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "test_resume.py", "-k",
                   "bit_exact"], timeout=300, env=env, check=False)
    said = [ln for ln in out.splitlines() if "--stop-after 6 must" in ln]
    print(f"\nexit {rc}: {said[:1]}")
    assert rc != 0 and said, out[-3000:]


def test_trainer_stops_at_or_past_stop_after_and_refuses_flags_out_of_range(tmp_path):
    """train_fsdp.py --stop-after 0 ends before any step (it ran them all: the check was step == K, so a resume past
    K ran the whole training); --keep -1 and --rollback without --resume-from are refused at start-up (they failed at
    the first save, losing the steps trained, or said rollback_to=0)."""
    import train_fsdp
    refused = {}
    for flags in (["--keep", "-1"], ["--rollback"], ["--stop-after", "-2"]):
        with pytest.raises(SystemExit):
            train_fsdp.get_args(flags)
        refused[" ".join(flags)] = True
    log = tmp_path / "log.jsonl"
    rc, out = torchrun(SMALL + ["--steps", "8", "--stop-after", "0", "--ckpt-dir", str(tmp_path / "ckpt"),
                                "--log-file", str(log)], nproc=1, check=False, timeout=120)
    steps = logged_steps(log) if log.exists() else []
    print(f"\nrefused at start-up: {sorted(refused)}; --stop-after 0: exit {rc}, steps logged {steps}")
    assert rc == 0 and steps == [], out[-2000:]
