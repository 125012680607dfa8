"""The recipe: one top-level model that composes the section each component owns."""
from __future__ import annotations

from pydantic import field_validator

from rlctl.inference.config import InferenceConfig, RouterConfig
from rlctl.launchers.config import CheckpointConfig, ClusterConfig, DeploymentConfig, MonitoringConfig
from rlctl.orchestrator.config import OrchestratorConfig
from rlctl.orchestrator.exchange.config import WeightsConfig
from rlctl.recipes.base import Count, RunName, StrictModel
from rlctl.recipes.errors import RecipeError
from rlctl.trainer.config import TrainerConfig


class ModelConfig(StrictModel):
    """The policy model."""

    name: str
    """Built-in catalog name (`qwen3-4b`, `glm-5`, `tiny-qwen3`, ...) or a local HF directory / config.json path."""
    build_seed: Count = 0
    """For built-in tiny models that are built offline: the seed of their random initialisation."""

    @field_validator("name")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model.name must not be empty")
        return v


class Recipe(StrictModel):
    """A complete RL run description. Every section is optional except `model`."""

    name: RunName = "run"
    """Run name (the run directory is `<output_dir>/<name>-<timestamp>`): letters, digits, '.', '_', '-'."""
    model: ModelConfig
    """The policy model."""
    cluster: ClusterConfig = ClusterConfig()
    """Target cluster profile."""
    deployment: DeploymentConfig = DeploymentConfig()
    """Node split and Slurm submission settings."""
    trainer: TrainerConfig = TrainerConfig()
    """FSDP2 trainer."""
    inference: InferenceConfig = InferenceConfig()
    """vLLM inference servers."""
    router: RouterConfig = RouterConfig()
    """Router in front of inference."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """Rollout loop."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""
    weights: WeightsConfig = WeightsConfig()
    """Published policy weights."""
    monitoring: MonitoringConfig = MonitoringConfig()
    """Logging and metrics."""


def check_lengths(recipe: Recipe) -> None:
    """Completion lengths the servers can grant: vLLM refuses every request whose `max_tokens` exceeds
    `inference.max_model_len` (a longer prompt only shortens the completion), so such a run would
    start, then fail on its first request or, for evaluation, skip every evaluation."""
    limit = recipe.inference.max_model_len
    evaluation = recipe.orchestrator.eval
    lengths = [("orchestrator.max_tokens", recipe.orchestrator.max_tokens)]
    if evaluation is not None and evaluation.max_tokens is not None:
        lengths.append(("orchestrator.eval.max_tokens", evaluation.max_tokens))
    for key, tokens in lengths:
        if tokens > limit:
            raise RecipeError(f"{tokens} exceeds inference.max_model_len={limit}, which vLLM refuses for every "
                              f"request; allowed: at most {limit}", key=key)
