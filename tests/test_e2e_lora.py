"""`rlctl launch recipes/tiny-lora-cpu.toml --wait`: the README demo trained with LoRA adapters — base
frozen, adapter-only publishes, the vLLM server swapping the adapter in place. One run, shared by every
check of this module."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from e2e_checks import assert_contract_keys, launch_waiting, learning_report, leftover_processes, metrics, monitor_json

pytestmark = pytest.mark.slow
MAX_STEPS = 120
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-lora-cpu.toml")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run, out, took = launch_waiting(tmp_path_factory.mktemp("lora"), RECIPE, "lora")
    return SimpleNamespace(run=run, out=out, took=took)


def test_learns_with_adapters_only(lora_run):
    out, run = lora_run.out, lora_run.run
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    trainer, orch = metrics(run)
    assert_contract_keys(trainer, orch)
    assert [r["step"] for r in trainer] == list(range(MAX_STEPS)) == [r["step"] for r in orch]
    rewards = [r["reward_mean"] for r in orch]
    assert rewards[0] < 0.2, rewards[:5]
    # LoRA learns this task but not to a reliable 0.8. With normalized advantages four real 120-step runs
    # ended (last 5) at 0.91, 0.99, 0.89 and 0.78; without, three ended at 0.62, 0.63 and 0.84. Checked:
    # it learns (start < 0.2, the last 10 steps >= 0.4), not the 0.8, which stays open.
    report = learning_report(trainer, orch)
    assert sum(rewards[-10:]) / 10 >= 0.4, f"reward did not rise to 0.4:\n{report}"
    assert monitor_json(run)["state"] == "completed"
    publish = statistics.median(r["weight_publish_s"] for r in trainer)
    reload = statistics.median(r["weight_reload_s"] for r in orch if r["weight_reload_s"])
    print(f"tiny-lora-cpu: {lora_run.took:.0f}s wall, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
          f"median publish {publish:.3f}s, median adapter swap {reload:.3f}s")


def test_served_policy_is_the_trained_one(lora_run):
    """The trainer recomputes the logprobs vLLM sampled with. At step 0 the server's zero adapter and the
    trainer's (B = 0) are both the base: they must agree to rounding. Later batches mix one step of lag
    and requests frozen across a swap (prompt KV from the older adapter), so only their median is
    bounded here; bench/bench_lora_swap.py checks served == trained right after a swap."""
    trainer, _ = metrics(lora_run.run)
    assert trainer[0]["mismatch_kl"] < 1e-6, trainer[0]
    late = statistics.median(r["mismatch_kl"] for r in trainer[MAX_STEPS // 2:])
    assert late < 0.01, late
    print(f"mismatch_kl at step 0: {trainer[0]['mismatch_kl']:.1e}, median over the second half {late:.1e}")


def test_steps_hold_only_the_adapter(lora_run):
    weights = lora_run.run / "weights"
    steps = sorted(weights.glob("step_*"), key=lambda p: int(p.name[5:]))
    assert steps and steps[-1].name == f"step_{MAX_STEPS}" and len(steps) <= 3  # retention as with full weights
    for step in steps:
        assert sorted(p.name for p in step.iterdir()) == ["COMPLETE", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((steps[-1] / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    logs = "\n".join(p.read_text(errors="replace") for p in (lora_run.run / "logs").glob("attempt_*/**/*.log"))
    swaps = [line for line in logs.splitlines() if "Loaded new LoRA adapter: name 'policy'" in line]
    assert len(swaps) >= MAX_STEPS // 2, logs[-3000:]  # several published steps may land between two looks


def test_leaves_nothing_behind(lora_run):
    assert (lora_run.run / "DONE").exists()
    assert leftover_processes(lora_run.run) == []
