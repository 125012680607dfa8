"""The `[cluster]`, `[deployment]`, `[checkpoint]` and `[monitoring]` sections: where and how a run is placed."""
from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from rlctl.recipes.base import StrictModel


class ClusterConfig(StrictModel):
    """Which cluster profile the run targets."""

    profile: str = "local"
    """Built-in profile name (`local`, `h200-28`, ...) or a path to a cluster YAML file."""


class GroupResources(StrictModel):
    """Slurm settings of one heterogeneous-job group; empty values fall back to the cluster profile."""

    partition: str | None = None
    """Slurm partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QoS."""
    constraint: str | None = None
    """Slurm node constraint (features)."""
    cpus_per_task: int | None = None
    """CPUs per task."""
    mem_gib: int | None = None
    """Memory per node in GiB."""


class DeploymentConfig(StrictModel):
    """How many nodes each side gets and how the job is submitted."""

    trainer_nodes: int | Literal["auto"] = "auto"
    """Trainer nodes, or 'auto' to let the planner minimise the async step time."""
    inference_nodes: int | Literal["auto"] = "auto"
    """Inference nodes, or 'auto'."""
    total_nodes: int | None = None
    """With 'auto' splits: nodes to use in all (default: every node of the profile)."""
    orchestrator_placement: Literal["auto", "cpu_partition", "inference_node"] = "auto"
    """Where router + orchestrator run: a CPU partition if the profile has one, else beside inference."""
    time_limit: str = "24:00:00"
    """Slurm time limit of the job (HH:MM:SS or D-HH:MM:SS)."""
    grace_period_s: int = 120
    """After a component fails, seconds the others get to finish (e.g. a checkpoint) before being stopped."""
    max_restarts: int = 3
    """Automatic requeues after preemption or timeout."""
    output_dir: str | None = None
    """Root of run directories (default: the profile's shared filesystem path, else ./runs)."""
    trainer: GroupResources = GroupResources()
    """Slurm settings of the trainer group."""
    inference: GroupResources = GroupResources()
    """Slurm settings of the inference group."""
    orchestrator: GroupResources = GroupResources()
    """Slurm settings of the router + orchestrator group."""

    @field_validator("trainer_nodes", "inference_nodes")
    @classmethod
    def _nodes(cls, v, info):
        if v != "auto" and v < 1:
            raise ValueError(f"{info.field_name} must be >= 1 or 'auto'")
        return v

    @field_validator("grace_period_s", "max_restarts")
    @classmethod
    def _non_negative(cls, v: int, info) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name} must be >= 0")
        return v


class CheckpointConfig(StrictModel):
    """Periodic checkpoints (trainer state + orchestrator progress)."""

    interval: int = 50
    """Save every N steps; 0 disables checkpoints."""
    keep_last: int = 2
    """Complete checkpoints to keep (the newest complete one is never deleted)."""

    @field_validator("interval", "keep_last")
    @classmethod
    def _non_negative(cls, v: int, info) -> int:
        if v < 0:
            raise ValueError(f"{info.field_name} must be >= 0")
        return v


class MonitoringConfig(StrictModel):
    """Metrics and logging."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every component."""
    metrics_interval: int = 1
    """Write a metrics.jsonl record every N steps."""
