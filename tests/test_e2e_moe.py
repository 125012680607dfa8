"""`rlctl launch recipes/tiny-moe-cpu.toml --wait`: the real stack on a tiny MoE — vLLM's CPU build serving
tiny-qwen3-moe through its fused experts (reloaded in place under per-expert names each step) and returning
the experts it routed each token to, router, orchestrator, and a 2-rank trainer with grouped experts,
expert parallelism (ep = 2) and router replay — learns."""
from __future__ import annotations

import json
import statistics

import pytest
from e2e_checks import best_window_mean, launch_waiting, learning_report, leftover_processes, metrics

pytestmark = pytest.mark.slow
RECIPE = "recipes/tiny-moe-cpu.toml"


def test_tiny_moe_with_expert_parallelism_and_router_replay_learns(tmp_path):
    run, out, _ = launch_waiting(tmp_path, RECIPE, "moe")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    degrees = json.loads((run / "configs" / "placement.json").read_text())["trainer_degrees"]
    assert (degrees["dp_shard"], degrees["ep"], degrees["cp"]) == (2, 2, 1), degrees

    trainer, orch = metrics(run)
    rewards = [r["reward_mean"] for r in orch]
    assert rewards[0] < 0.2, rewards[:5]
    # Before the server repacked its CPU fused experts after each reload it served stale-layout experts:
    # mismatch_kl grew to ~0.15 and the last-5 mean ended 0.70-0.87. With the repack real runs end at
    # 0.98-0.99 (5 of 5 in a row), but one of ten recent runs (in a clean-clone suite) locked a few
    # prompts onto wrong answers once its entropy had collapsed (mismatch_kl ~0: the served weights were
    # faithful) and held a last-5 mean of 0.79. So the check is the stack's: it learns (a 5-step mean
    # reaches 0.8) and keeps what it learnt.
    why = learning_report(trainer, orch)
    assert best_window_mean(rewards) >= 0.8, f"reward never reached >= 0.8:\n{why}"
    assert sum(rewards[-5:]) / 5 >= 0.7, f"reward did not stay near 0.8:\n{why}"
    assert statistics.median(r["mismatch_kl"] for r in trainer) < 0.05, why
    # load-balance statistics: every MoE layer's 8 experts, all routed tokens of the step counted top-2 times
    last = trainer[-1]
    assert len(last["tokens_per_expert"]) == 2 and all(len(layer) == 8 for layer in last["tokens_per_expert"])
    assert last["expert_load_imbalance"] >= 1.0
    # router replay: every token-layer but each sample's last token (never run by vLLM) is routed by the
    # experts vLLM chose — samples are ~5 tokens here, so ~0.8. Step 0 trains on what the same weights
    # sampled (fp32 on both sides): the trainer's routers agree with vLLM's; later batches were sampled
    # by the previous policy (one step off-policy), whose routing the trainer's routers no longer repeat
    coverage = [r["router_replay_coverage"] for r in trainer]
    assert 0.7 < min(coverage) and max(coverage) < 1.0, coverage
    overrides = [r["router_replay_overrides"] for r in trainer]
    assert overrides[0] < 0.01 and all(0.0 <= o <= 1.0 for o in overrides) and max(overrides) > 0.01, overrides
    assert "routed experts are captured by the CPU model runner" in _inference_log(run)
    assert leftover_processes(run) == []
    print(f"tiny-moe ep=2 + router replay: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
          f"mismatch_kl last {last['mismatch_kl']:.3f}, expert imbalance {last['expert_load_imbalance']:.2f}, "
          f"replay coverage {statistics.median(coverage):.3f}, overrides median {statistics.median(overrides):.3f}")


def _inference_log(run) -> str:
    return "".join(f.read_text(errors="replace") for f in (run / "logs").rglob("*") if f.is_file() and "inference" in str(f))
