"""DCP trainer checkpoints: pruning rules, and a resumed 2-rank run continuing exactly where it stopped."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlctl.orchestrator.exchange.steps import MARKER
from rlctl.recipes.errors import RecipeError
from rlctl.trainer.checkpoint import complete_checkpoints, prune, resolve_resume_step, trainer_part
from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, read_weights

from trainer_fixtures import launch_ranks, make_run, synthetic_batch, trainer_metrics, wait_all, write_batches


def _fake_checkpoint(root, step, complete=True, other_part=False):
    part = trainer_part(root, step)
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (part / MARKER).write_text("{}")
    if other_part:
        (part.parent / "orchestrator").mkdir()


def test_prune_keeps_the_newest_complete_ones_and_anything_newer(tmp_path):
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 5, complete=False)  # crash leftover older than the newest complete
    _fake_checkpoint(tmp_path, 8, complete=False)  # a checkpoint being written right now
    assert complete_checkpoints(tmp_path) == [2, 4, 6]
    assert prune(tmp_path, keep_last=2) == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5", "step_6", "step_8"]
    assert prune(tmp_path, keep_last=0) == [4, 5]  # keep_last < 1 still keeps the newest complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_6", "step_8"]
    assert prune(tmp_path / "missing", keep_last=1) == []


def test_resume_step_values(tmp_path):
    assert resolve_resume_step(tmp_path, None) is None
    assert resolve_resume_step(tmp_path, "latest") is None
    _fake_checkpoint(tmp_path, 3)
    _fake_checkpoint(tmp_path, 7, complete=False)
    assert resolve_resume_step(tmp_path, "latest") == 3
    assert resolve_resume_step(tmp_path, "12") == 12
    with pytest.raises(RecipeError, match="resume step"):
        resolve_resume_step(tmp_path, "-1")


@pytest.mark.slow
def test_resumed_run_matches_an_uninterrupted_one(tmp_path):
    total = 4
    overrides = [f"orchestrator.max_steps={total}", "checkpoint.interval=1", "checkpoint.keep_last=2"]
    full = make_run(tmp_path / "full", overrides)
    batches = [synthetic_batch(full.model, rows=8, seed=s) for s in range(total)]
    for step, batch in enumerate(batches):
        write_batches(full, batch, [step])
    assert wait_all(launch_ranks(full, 2)) == [0, 0], (full.root / "trainer_rank0.log").read_text()[-3000:]
    assert complete_checkpoints(full.checkpoints) == [3, 4]  # keep_last=2 pruned steps 1 and 2

    # a second run holding only the state after step 3, as if the first had died right after saving it
    resumed = make_run(tmp_path / "resumed", overrides)
    shutil.copytree(full.checkpoints / "step_3", resumed.checkpoints / "step_3")
    for step in range(3, total):
        write_batches(resumed, batches[step], [step])
    # a policy the abandoned attempt had published beyond the checkpoint must not survive the rewind
    stale = {k: v + 1 for k, v in read_weights(full.weights / "step_4").items()}
    FilesystemWeightStore(resumed.weights).publish_state(
        4, stale, json.loads((full.weights / "step_4" / "config.json").read_text()))
    codes = wait_all(launch_ranks(resumed, 2, {"RLCTL_RESUME_STEP": "latest"}))
    assert codes == [0, 0], (resumed.root / "trainer_rank0.log").read_text()[-3000:]

    assert [m["step"] for m in trainer_metrics(resumed)] == [3]
    expected = read_weights(full.weights / f"step_{total}")
    got = read_weights(resumed.weights / f"step_{total}")
    # the optimizer moments were restored too: without them Adam's 4th step would differ
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-6), name
    # the resumed trainer first published the policy it restored (step_3), identical to the original
    before = read_weights(full.weights / "step_3")
    restored = read_weights(resumed.weights / "step_3")
    assert all(torch.equal(before[k], restored[k]) for k in before)


@pytest.mark.slow
def test_resume_from_a_missing_checkpoint_fails_with_exit_code_2(tmp_path):
    run = make_run(tmp_path / "run", ["orchestrator.max_steps=2", "trainer.fsdp=1"])
    codes = wait_all(launch_ranks(run, 1, args=["--resume-step", "5"]))
    log = (run.root / "trainer_rank0.log").read_text()
    assert codes == [2], log[-2000:]
    assert "resume step: no complete trainer checkpoint for step 5" in log
    assert "Traceback" not in log
    assert not (run.weights / "step_0").exists()  # failed before doing anything
