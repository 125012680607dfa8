"""`rlctl launch recipes/tiny-moe-cpu.toml --wait`: the real stack on a tiny MoE — vLLM's CPU build serving
tiny-qwen3-moe through its fused experts (reloaded in place under per-expert names each step), router,
orchestrator, and a 2-rank trainer with grouped experts and expert parallelism (ep = 2) — learns."""
from __future__ import annotations

import json
import statistics

import pytest
from e2e_checks import launch_waiting, learning_report, leftover_processes, metrics

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny-moe-cpu.toml"


def test_tiny_moe_with_expert_parallelism_learns(tmp_path):
    run, out, _ = launch_waiting(tmp_path, RECIPE, "moe")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    degrees = json.loads((run / "configs" / "placement.json").read_text())["trainer_degrees"]
    assert (degrees["dp_shard"], degrees["ep"], degrees["cp"]) == (2, 2, 1), degrees

    trainer, orch = metrics(run)
    rewards = [r["reward_mean"] for r in orch]
    assert rewards[0] < 0.2, rewards[:5]
    # Before the server repacked its CPU fused experts after each reload it served stale-layout experts:
    # mismatch_kl grew to ~0.15 and the last-5 mean ended 0.70-0.87; with the repack it ended 0.92.
    why = learning_report(trainer, orch)
    assert sum(rewards[-5:]) / 5 >= 0.8, f"reward did not end >= 0.8:\n{why}"
    assert statistics.median(r["mismatch_kl"] for r in trainer) < 0.05, why
    # load-balance statistics: every MoE layer's 8 experts, all routed tokens of the step counted top-2 times
    last = trainer[-1]
    assert len(last["tokens_per_expert"]) == 2 and all(len(layer) == 8 for layer in last["tokens_per_expert"])
    assert last["expert_load_imbalance"] >= 1.0
    assert leftover_processes(run) == []
    print(f"tiny-moe ep=2: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
          f"mismatch_kl last {last['mismatch_kl']:.3f}, expert imbalance {last['expert_load_imbalance']:.2f}")
