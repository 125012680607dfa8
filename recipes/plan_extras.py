"""What `rlctl plan` derives from a composed plan: cost, the off-policy lag it implies, how long a
checkpoint takes, and the warnings about GPUs a split leaves idle, a time limit too short to save and a stall
timeout shorter than the trainer's work between heartbeats."""
from __future__ import annotations

import math
import re

from rlctl.recipes.base import SLURM_DURATION
from rlctl.recipes.plan_report import cpu_groups
from rlctl.recipes.plan_sync import sync_warning

SLURM_TIME = re.compile(rf"^{SLURM_DURATION}$")


def slurm_seconds(text: str) -> float | None:
    """Seconds of a Slurm time limit (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`);
    None for `UNLIMITED`/`INFINITE` or what Slurm would refuse (the launcher reports that one)."""
    text = str(text).strip()
    m = SLURM_TIME.match(text)
    if not m:
        return None
    days, a, b, c = m.groups()
    a, b, c = int(a), int(b or 0), int(c or 0)
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + a * 3600 + b * 60 + c
    if m.group(4) is not None:  # HH:MM:SS
        return a * 3600 + b * 60 + c
    return a * 60 + b  # MM or MM:SS


def checkpoint_seconds(disk: dict, trainer_nodes: int, profile) -> float:
    """Writing one checkpoint: every trainer node writes its ranks' shards in parallel, bounded by the
    profile's per-node and aggregate filesystem bandwidth."""
    bandwidth = min(max(1, trainer_nodes) * profile.fs_node_gbs, profile.fs_aggregate_gbs) * 1e9
    return disk.get("checkpoint_bytes", 0) / bandwidth


def cost(report, recipe, profile) -> dict:
    """GPU-hours per step and per run, and the wall time to max_steps (checkpoint writes included: the
    trainer stops for them)."""
    pl, o = report.placement, recipe.orchestrator
    step = report.orchestrator.get("step_time_s")
    # the run's own groups: an attached run's inference group is the pool's (0 nodes of this run)
    nodes = sum(g.get("nodes", 0) for g in report.groups)
    # a CPU run on a GPU cluster asks for no GPUs (gres: none is allocated); without gres it holds the nodes
    held = 0 if cpu_groups(recipe) and profile.gres_gpu else profile.gpus_per_node
    gpus = (pl.trainer_nodes + pl.inference_nodes) * held
    interval = recipe.checkpoint.interval
    ckpt_s = checkpoint_seconds(report.disk, pl.trainer_nodes, profile)
    out = {"gpus": gpus, "nodes": nodes, "max_steps": o.max_steps, "checkpoint_write_s": ckpt_s,
           "gpu_hours_per_step": None, "gpu_hours_per_run": None, "node_hours_per_run": None,
           "wall_time_s": None}
    if step is None:
        return out
    wall = o.max_steps * step + (o.max_steps // interval if interval else 0) * ckpt_s
    out.update(gpu_hours_per_step=gpus * step / 3600, gpu_hours_per_run=gpus * wall / 3600,
               node_hours_per_run=nodes * wall / 3600, wall_time_s=wall)
    return out


def _decode_step_s(report) -> float | None:
    inf = report.inference
    step = inf.get("decode_step_s")
    if isinstance(step, (int, float)) and step > 0:
        return float(step)
    tps, batch = inf.get("decode_tokens_per_s"), inf.get("concurrency") or inf.get("max_concurrent_rollouts")
    return batch / tps if tps and batch else None


def off_policy(report, recipe) -> dict:
    """Lag the plan implies, in policy versions: how many steps the trainer completes while one rollout
    is generated (its duration over the async step). A rollout whose lag passes max_off_policy_steps is
    dropped; with 0 (synchronous RL) the trainer waits for every rollout, so there is no lag."""
    o, inf = recipe.orchestrator, report.inference
    bound, step, tok_s = o.max_off_policy_steps, report.orchestrator.get("step_time_s"), _decode_step_s(report)
    longest = min(o.max_generated_tokens, recipe.inference.max_model_len)
    out = {"max_off_policy_steps": bound, "rollout_mean_s": None, "rollout_max_s": None,
           "lag_mean_steps": None, "lag_max_steps": None}
    if not step or tok_s is None:
        return out
    mean_s, max_s = inf.get("completion_tokens", 0) * tok_s, longest * tok_s
    sync = bound == 0
    out.update(rollout_mean_s=mean_s, rollout_max_s=max_s, lag_mean_steps=0.0 if sync else mean_s / step,
               lag_max_steps=0.0 if sync else max_s / step)
    return out


def idle_gpus(report, recipe, profile) -> list[str]:
    """GPUs a split allocates but no rank or server uses (none in a CPU run, which uses none by choice)."""
    if not profile.gpus_per_node or cpu_groups(recipe):
        return []
    notes, tr, inf = [], report.trainer, report.inference
    used = 1
    for key in ("dp_replicate", "fsdp", "cp", "tp"):
        used *= tr.get(key) if isinstance(tr.get(key), int) and tr.get(key) > 0 else 1
    have = report.placement.trainer_nodes * profile.gpus_per_node
    if tr.get("step_time_s") is not None and have > used:
        notes.append(f"trainer: {have - used} of {have} GPUs idle (dp_replicate × fsdp × cp × tp = {used}); "
                     "lower deployment.trainer_nodes or raise the degrees")
    have = report.placement.inference_nodes * profile.gpus_per_node
    if inf.get("replicas") is not None:
        if inf.get("prefill_gpus"):
            used = inf["prefill_gpus"] + inf["decode_gpus"]
        else:
            used = inf["replicas"] * inf.get("dp_per_replica", 1) * inf.get("tp", 1)
        if have > used:
            notes.append(f"inference: {have - used} of {have} GPUs idle (the servers use {used}); lower "
                         "deployment.inference_nodes or add replicas/dp")
    return notes


def _fmt(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def warnings(report, recipe, profile) -> list[str]:
    out = idle_gpus(report, recipe, profile)
    lag = report.off_policy
    bound = lag.get("max_off_policy_steps")
    # A rollout is dropped when its lag passes the bound (orchestrator/advantages.py `is_stale`): warn
    # when the longest do; say so when even the mean rollout already reaches it.
    if bound and lag.get("lag_max_steps") is not None and lag["lag_max_steps"] > bound + 1e-9:
        mean_too = lag["lag_mean_steps"] >= bound
        who = "the mean rollout" if mean_too else f"a rollout of max_tokens={recipe.orchestrator.max_tokens}"
        spans = lag["lag_mean_steps"] if mean_too else lag["lag_max_steps"]
        out.append(f"off-policy: {who} spans {spans:.1f} trainer steps, ≥ orchestrator.max_off_policy_steps="
                   f"{bound}: such rollouts would be dropped; raise max_off_policy_steps or lower max_tokens")
    step, ckpt_s = report.orchestrator.get("step_time_s"), report.cost.get("checkpoint_write_s", 0.0)
    slow_sync = sync_warning(report.weights, step)
    if slow_sync:
        out.append(slow_sync)
    stall = _false_stall(report, recipe, ckpt_s)
    if stall:
        out.append(stall)
    if profile.scheduler == "slurm" and step is not None:
        for where, text in _time_limits(recipe):
            limit = slurm_seconds(text)
            if limit is not None and limit < step + ckpt_s:
                out.append(f"{where}={text} is shorter than one step plus a checkpoint ({_fmt(step + ckpt_s)}): "
                           "the job would end before it saves any progress")
    return out


def _false_stall(report, recipe, ckpt_s: float) -> str | None:
    """The trainer beats once per step and while it waits for a batch: its step with the weight publish,
    or a checkpoint save, is work without a beat. Longer than the stall timeout, a healthy trainer is
    reported stalled, and `launch --wait` exits 1."""
    step = report.trainer.get("step_time_s")
    if step is None:
        return None
    stretch = max(step + report.weights.get("trainer_side_s", 0.0), ckpt_s)
    timeout = recipe.monitoring.stall_timeout_s
    if timeout >= stretch:
        return None
    return (f"monitoring.stall_timeout_s={timeout:g} is shorter than the trainer's longest work between "
            f"heartbeats ({_fmt(stretch)}, a step with its weight publish or a checkpoint): rlctl monitor and "
            "launch --wait would report a working trainer stalled")


def _time_limits(recipe) -> list[tuple[str, str]]:
    dep = recipe.deployment
    limits = [("deployment.time_limit", dep.time_limit)]
    for group in ("trainer",) if dep.inference_pool else ("trainer", "inference"):
        own = getattr(getattr(dep, group, None), "time_limit", None)
        if own:
            limits.append((f"deployment.{group}.time_limit", own))
    return limits


def add_extras(report, recipe, profile) -> None:
    """Fill the report's cost and off-policy sections and append their warnings."""
    report.cost = cost(report, recipe, profile)
    report.off_policy = off_policy(report, recipe)
    report.warnings.extend(w for w in warnings(report, recipe, profile) if w not in report.warnings)
    for section in (report.cost, report.off_policy):  # JSON has no Infinity: unknown is None
        for k, v in section.items():
            if isinstance(v, float) and not math.isfinite(v):
                section[k] = None
