"""`rlctl launch recipes/tiny-cpu.toml -o weights.transport=broadcast --wait`: the README demo with the
weights sent from trainer rank 0 straight to the vLLM worker over a gloo group formed per step instead
of safetensors on the filesystem. One run, shared by every check of this module."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from e2e_checks import (TINY, assert_contract_keys, best_window_mean, launch_waiting, learning_report,
                        leftover_processes, metrics, monitor_json)

pytestmark = pytest.mark.slow
MAX_STEPS = 80


@pytest.fixture(scope="module")
def broadcast_run(tmp_path_factory):
    run, out, took = launch_waiting(tmp_path_factory.mktemp("broadcast"), TINY, "bcast", "weights.transport=broadcast")
    return SimpleNamespace(run=run, out=out, took=took)


def test_learns_like_the_filesystem_transport(broadcast_run):
    out, run = broadcast_run.out, broadcast_run.run
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    trainer, orch = metrics(run)
    assert_contract_keys(trainer, orch)
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS)) == [r["step"] for r in orch]
    rewards = [r["reward_mean"] for r in orch]
    assert rewards[0] < 0.2, rewards[:5]
    # the transport's check is that the run learns: its 5-step mean reaches 0.8 (of four runs of the final
    # code one then wandered to a last-5 mean of 0.79, the low tail of this recipe's spread; the served
    # weights' equality with the trainer's is test_weights_broadcast's)
    assert best_window_mean(rewards) >= 0.8, f"reward never reached >= 0.8:\n{learning_report(trainer, orch)}"
    assert monitor_json(run)["state"] == "completed"
    publish = sorted(r["weight_publish_s"] for r in trainer)
    reload = sorted(r["weight_reload_s"] for r in orch if r["weight_reload_s"])
    print(f"tiny-cpu broadcast: {broadcast_run.took:.0f}s wall, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
          f"median publish {publish[len(publish) // 2]:.3f}s, median reload {reload[len(reload) // 2]:.3f}s")


def test_steps_hold_a_manifest_and_the_last_the_trained_model(broadcast_run):
    """Every step but the last is a manifest (no tensor files); the last is the trained model as files, an
    HF folder as a filesystem run leaves it (a broadcast leaves no model anywhere else but the checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM

    weights = broadcast_run.run / "weights"
    steps = sorted(weights.glob("step_*"), key=lambda p: int(p.name[5:]))
    assert steps and steps[-1].name == f"step_{MAX_STEPS}" and 2 <= len(steps) <= 3  # retention as with files
    for step in steps[:-1]:
        assert sorted(p.name for p in step.iterdir()) == ["COMPLETE", "broadcast.json", "config.json"]
    assert json.loads((steps[-2] / "broadcast.json").read_text())["serving"] is True
    files = sorted(p.name for p in steps[-1].iterdir())
    assert "broadcast.json" not in files and {"COMPLETE", "config.json", "model.safetensors.index.json"} <= set(files)
    trained = AutoModelForCausalLM.from_pretrained(steps[-1]).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(broadcast_run.run / "model").state_dict()
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)


def test_every_step_but_the_last_was_broadcast_to_the_worker(broadcast_run):
    logs = "\n".join(p.read_text(errors="replace")
                     for p in (broadcast_run.run / "logs").glob("attempt_*/**/trainer*.log"))
    sent = [line for line in logs.splitlines() if "broadcast to 1 worker(s)" in line]
    assert len(sent) == MAX_STEPS - 1, logs[-3000:]  # steps 1..79; step 0 is the model the servers start from
    assert "not broadcast" not in logs


def test_leaves_nothing_behind(broadcast_run):
    assert (broadcast_run.run / "DONE").exists()
    assert leftover_processes(broadcast_run.run) == []
