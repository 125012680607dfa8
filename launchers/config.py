"""The `[cluster]`, `[deployment]`, `[checkpoint]` and `[monitoring]` sections: where and how a run is placed."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from rlctl.recipes.base import (MAX_GPUS_PER_NODE, Count, Delay, NodeCount, PositiveCount, RunName, Seconds, SlurmTime,
                                StrictModel)


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
    cpus_per_task: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    """CPUs per task."""
    mem_gib: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    """Memory per node in GiB."""
    gpus_per_node: Annotated[int, Field(ge=0, le=MAX_GPUS_PER_NODE)] | None = None
    """GPUs requested per node (default: what the placement uses; 0 requests none)."""
    time_limit: SlurmTime | None = None
    """Time limit of this group (default: `deployment.time_limit`)."""


GROUP_NAMES = ("orchestrator", "inference", "trainer")


class SmokeConfig(StrictModel):
    """Behaviour of the trivial `rlctl.launchers.smoke` entry points (launcher tests and fault drills)."""

    run_s: Delay = 1.0
    """Seconds the smoke orchestrator holds after seeing every service, before it writes DONE."""
    fail_group: str | None = None
    """Group whose rank `fail_rank` exits with `exit_code` after `fail_after_s` (None: nobody fails)."""
    fail_rank: Count = 0
    """Rank (within `fail_group`) that fails."""
    fail_after_s: Delay = 0.0
    """Seconds before the failing rank exits."""
    exit_code: Annotated[int, Field(ge=0, le=255)] = 3
    """Exit code of the failing rank."""
    steps: Count = 0
    """With steps > 0 the smoke trainer (rank 0) counts `steps` training steps of `step_s` seconds with
    checkpoints every `checkpoint.interval`, resumes from RLCTL_RESUME_STEP, checkpoints and stops on
    `<run>/PREEMPT`, and writes DONE after the last step (fault drills of checkpoint/requeue)."""
    step_s: Delay = 0.5
    """Seconds per smoke training step."""

    @field_validator("fail_group")
    @classmethod
    def _group(cls, v: str | None) -> str | None:
        if v is not None and v not in GROUP_NAMES:
            raise ValueError(f"fail_group must be one of {', '.join(GROUP_NAMES)}")
        return v


class DeploymentConfig(StrictModel):
    """How many nodes each side gets and how the job is submitted."""

    trainer_nodes: NodeCount | Literal["auto"] = "auto"
    """Trainer nodes, or 'auto' to let the planner minimise the async step time."""
    inference_nodes: NodeCount | Literal["auto"] = "auto"
    """Inference nodes, or 'auto'."""
    total_nodes: NodeCount | None = None
    """With 'auto' splits: nodes to use in all (default: every node of the profile)."""
    orchestrator_placement: Literal["auto", "cpu_partition", "inference_node"] = "auto"
    """Where router + orchestrator run: a CPU partition if the profile has one, else beside inference."""
    time_limit: SlurmTime = "24:00:00"
    """Slurm time limit of the job (MM, HH:MM:SS, D-HH:MM:SS, ... or UNLIMITED)."""
    grace_period_s: Count = 120
    """After a component fails the others are asked to stop (SIGTERM: the trainer saves a checkpoint first); seconds they get before being killed. Also how long the others get to exit after the orchestrator finishes."""
    max_restarts: Count = 3
    """Automatic requeues after preemption, timeout or node failure (Slurm); each resumes from the newest complete checkpoint."""
    preempt_signal_s: Count = 300
    """Seconds before the time limit Slurm sends USR2 to the batch script (trainer checkpoints, job requeues); must exceed a trainer step + checkpoint."""
    preempt_timeout_s: Seconds = 240.0
    """After a preemption (USR2, or Slurm's SIGTERM), seconds the batch script waits for the trainer to save its checkpoint and exit before it kills it; keep it below `preempt_signal_s` (and, for SIGTERM, below the cluster's KillWait/GraceTime)."""
    output_dir: str | None = None
    """Root of run directories (default: the profile's shared filesystem path, else ./runs)."""
    inference_pool: RunName | None = None
    """Name of a running shared inference pool (`rlctl pool launch`, under `<output_dir>/pools/`) that
    serves this run: the job then holds only the trainer and orchestrator, and the recipe's `[inference]`
    and `[router]` sections are the pool's, not this run's."""
    trainer: GroupResources = GroupResources()
    """Slurm settings of the trainer group."""
    inference: GroupResources = GroupResources()
    """Slurm settings of the inference group."""
    orchestrator: GroupResources = GroupResources()
    """Slurm settings of the router + orchestrator group."""
    entrypoints: dict[str, str] = {}
    """Python module run per group instead of `rlctl.<group>` (e.g. {trainer="rlctl.launchers.smoke"})."""
    smoke: SmokeConfig = SmokeConfig()
    """Settings read by the smoke entry points (ignored by the real components)."""

    @field_validator("entrypoints")
    @classmethod
    def _entrypoints(cls, v: dict[str, str]) -> dict[str, str]:
        for group, module in v.items():
            if group not in GROUP_NAMES:
                raise ValueError(f"entrypoints: unknown group {group!r} (allowed: {', '.join(GROUP_NAMES)})")
            if not module or not all(part.isidentifier() for part in module.split(".")):
                raise ValueError(f"entrypoints.{group}: {module!r} is not a Python module name")
        return v


class CheckpointConfig(StrictModel):
    """Periodic checkpoints (trainer state + orchestrator progress)."""

    interval: Count = 50
    """Save every N steps; 0 disables checkpoints."""
    keep_last: Count = 2
    """Complete checkpoints to keep (the newest complete one is never deleted)."""


class MonitoringConfig(StrictModel):
    """Metrics and logging."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of every component."""
    metrics_interval: PositiveCount = 1
    """Write a metrics.jsonl record every N steps."""
    stall_timeout_s: Seconds = 1800.0
    """Seconds a component (trainer, orchestrator, an inference server) may go without progress
    before `rlctl monitor` marks it `stalled` and `monitor --wait` / `launch --wait` exit 1 naming it.
    Waiting on another component does not count (the trainer waiting for rollouts is not stalled);
    set it above the longest trainer step, checkpoint save, model load and compile warm-up you expect
    (`rlctl plan` warns when the planned step with its weight publish, or a checkpoint, is longer)."""
    backends: list[Literal["wandb", "tensorboard"]] = []
    """Where the orchestrator also sends every metric record, under `<run>/monitoring/`:
    `wandb` (offline mode; `wandb sync` uploads it later) and/or `tensorboard` (event files).
    Each needs its package (`pip install 'rlctl[monitoring]'`)."""

    @field_validator("backends")
    @classmethod
    def _installed(cls, v: list[str]) -> list[str]:
        import importlib.util

        missing = [b for b in dict.fromkeys(v) if importlib.util.find_spec(b) is None]  # package = backend name
        if missing:
            raise ValueError(f"{', '.join(missing)} chosen but not installed (pip install 'rlctl[monitoring]')")
        return list(dict.fromkeys(v))
