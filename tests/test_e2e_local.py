"""The README demo end to end: `rlctl launch recipes/tiny-cpu.toml --wait` on this machine — real vLLM CPU
server, vllm-router, orchestrator and a 2-rank FSDP2 trainer — learns the task within max_steps."""
from __future__ import annotations

import pytest
from e2e_checks import assert_contract_keys, learning_report, leftover_processes, metrics, monitor_json

pytestmark = pytest.mark.slow


def test_tiny_recipe_learns_locally_and_leaves_nothing_behind(tiny_cpu_run):
    # No --cluster: the recipe's own profile (local) picks the local launcher, as in the README. The
    # run (conftest.py) is shared with the other slow tests that need a finished tiny run.
    out, took, run = tiny_cpu_run.out, tiny_cpu_run.took, tiny_cpu_run.run
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert "local supervisor pid" in out.stdout  # the local launcher, not a Slurm submission

    trainer, orch = metrics(run)
    assert_contract_keys(trainer, orch)
    max_steps = 80
    assert [r["step"] for r in trainer] == list(range(max_steps))
    assert [r["step"] for r in orch] == list(range(max_steps))
    rewards = [r["reward_mean"] for r in orch]
    assert rewards[0] < 0.2, rewards[:5]
    # It ends learned, as the README promises (the replay bench ends at 0.95-0.99 over 16 seeds).
    assert sum(rewards[-5:]) / 5 >= 0.8, f"reward did not end >= 0.8:\n{learning_report(trainer, orch)}"

    # --wait showed progress while it ran and ended with the final reward.
    assert "step " in out.stderr and "reward " in out.stderr, out.stderr
    assert f"final reward mean {rewards[-1]:.3f}" in out.stdout, out.stdout

    mon = monitor_json(run)
    assert mon["state"] == "completed", mon
    assert mon["reward_mean"] == pytest.approx(rewards[-1]) and mon["steps_done"] == max_steps
    assert (run / "DONE").exists()
    # retention: weights.keep_last (2) steps + 1 a server may load; batches covered by checkpoint step_80 gone
    assert len(list((run / "weights").glob("step_*"))) <= 3 and not list((run / "rollouts").glob("step_*"))
    # checkpoint.keep_last (2) complete checkpoints, and no orchestrator part the trainer did not join
    parts = {p.name: sorted(q.name for q in p.iterdir()) for p in (run / "checkpoints").glob("step_*")}
    assert parts == {"step_60": ["orchestrator", "trainer"], "step_80": ["orchestrator", "trainer"]}, parts
    assert leftover_processes(run) == []
    # the servers reloaded sharded publishes: what they read is reported, one step's shards per reload
    read = [r["weight_reload_bytes"] for r in orch if r.get("weight_reload_bytes")]
    assert read and max(read) < 10 * min(read), read
    print(f"tiny-cpu local: {took:.0f}s wall, reward {rewards[0]:.3f} -> {rewards[-1]:.3f}, "
          f"first step >= 0.8: {next(i for i, r in enumerate(rewards) if r >= 0.8)}")
