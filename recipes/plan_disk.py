"""Disk a run directory takes (`rlctl plan`): the size of each published step and the run's peak.

Peak = what retention keeps at its worst moment (see `rlctl.orchestrator.exchange.retention`):
  weights      max(weights.keep_last, max_off_policy_steps + 1) complete steps (servers may still be
               loading any step above the version they serve, which lags by at most the off-policy
               bound) + the step being published;
  rollouts     batches trained since the last checkpoint (up to checkpoint.interval; 1 without
               checkpoints, released right after training) + the max_off_policy_steps + 1 batches the
               orchestrator may write ahead of the trainer;
  checkpoints  max(checkpoint.keep_last, 1) complete + the one being written (1 without periodic
               checkpoints: the one a preemption writes).
Logs, metrics and the orchestrator's progress parts are small and not counted.
"""
from __future__ import annotations

from rlctl.recipes.plan_sync import model_bytes
from rlctl.trainer.plan import state_bytes

# The rollout contract (orchestrator/batch.py `build_batch_tensors`): per token input_ids int64,
# attention_mask and loss_mask bool, inference_logprobs float32, policy_version int32; per sample
# advantages and rewards float32. A batch is padded to its longest rollout: at most max_model_len.
ROLLOUT_BYTES_PER_TOKEN = 8 + 1 + 1 + 4 + 4
ROLLOUT_BYTES_PER_SAMPLE = 4 + 4
# Router replay (R3) payload: one int16 expert id per MoE layer, top-k slot and token of each sample.
ROUTED_EXPERT_ID_BYTES = 2


def rollout_batch_bytes(rollouts: int, seq_len: int) -> int:
    return rollouts * (seq_len * ROLLOUT_BYTES_PER_TOKEN + ROLLOUT_BYTES_PER_SAMPLE)


def router_replay_bytes(spec, rollouts: int, seq_len: int) -> int:
    """What the routed-expert payload adds to one batch when router replay is on (0 for dense models)."""
    return rollouts * seq_len * spec.moe_layers * spec.num_experts_per_tok * ROUTED_EXPERT_ID_BYTES


def plan_disk(recipe, spec) -> dict:
    """Bytes per step and at the peak. Router replay has no recipe key yet: what its payload would add
    to each batch is reported beside, not counted."""
    o, interval = recipe.orchestrator, recipe.checkpoint.interval
    seq, off = recipe.inference.max_model_len, o.max_off_policy_steps
    _, checkpoint = state_bytes(spec, recipe.trainer.optimizer_dtype)
    # a published step is the model in the serving dtype (only the adapter under LoRA)
    weights_step = int(sum(model_bytes(recipe, spec, on_gpu=False)[:2]))
    replay = router_replay_bytes(spec, o.rollouts_per_step, seq)
    batch = rollout_batch_bytes(o.rollouts_per_step, seq)
    kept = {
        "weights": max(recipe.weights.keep_last, off + 1) + 1,
        "rollouts": (interval or 1) + off + 1,
        "checkpoints": max(recipe.checkpoint.keep_last, 1) + 1 if interval else 1,
    }
    peak = {"weights": kept["weights"] * weights_step, "rollouts": kept["rollouts"] * batch,
            "checkpoints": kept["checkpoints"] * checkpoint}
    return {
        "weights_step_bytes": weights_step,
        "rollout_batch_bytes": batch,
        "router_replay_bytes_per_batch": replay,
        "checkpoint_bytes": checkpoint,
        "written_per_step_bytes": weights_step + batch + (checkpoint // interval if interval else 0),
        "kept": kept,
        "peak_bytes_by_kind": peak,
        "peak_bytes": sum(peak.values()),
        # without retention every step would stay: the disk of the whole run, for comparison
        "unpruned_run_bytes": o.max_steps * (weights_step + batch)
                              + (o.max_steps // interval * checkpoint if interval else 0),
    }
