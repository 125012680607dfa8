"""`rlctl plan`: compose the trainer, inference and orchestrator models into one plan report."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes.errors import RecipeError

AUTO = "auto"


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _orchestrator_site(recipe, profile) -> str:
    forced = recipe.deployment.orchestrator_placement
    if forced != AUTO:
        return forced
    return "cpu_partition" if profile.partitions.cpu and profile.cpu_nodes > 0 else "inference_node"


def _cpu_groups(recipe) -> bool:
    """Trainer and inference both request 0 GPUs per node: a CPU run (e.g. the tiny recipe on a GPU
    cluster), placed like on a CPU profile — ranks from the parallel degrees, the CPU build of vLLM."""
    dep = recipe.deployment
    return dep.trainer.gpus_per_node == 0 and dep.inference.gpus_per_node == 0


def _profile(recipe, profile):
    if profile is None:
        from rlctl.recipes.clusters import load_profile

        profile = load_profile(recipe.cluster.profile)
    return profile


def compute_placement(recipe, profile=None) -> Placement:
    """Node split and per-node process counts for `recipe` on `profile` (cheap; no torch).

    `profile` is a ClusterProfile; None loads `recipe.cluster.profile`. `auto` node counts are
    resolved by the planner (minimal async step time).
    """
    profile = _profile(recipe, profile)
    if profile.gpus_per_node == 0 or _cpu_groups(recipe):
        tr, dep = recipe.trainer, recipe.deployment
        ranks = _int_or(tr.fsdp, 1) * _int_or(tr.cp, 1) * _int_or(tr.tp, 1)
        return Placement(
            trainer_nodes=_int_or(dep.trainer_nodes, 1), inference_nodes=_int_or(dep.inference_nodes, 1),
            trainer_ranks_per_node=ranks, inference_servers_per_node=_int_or(recipe.inference.dp, 1),
            inference_gpus_per_server=0, orchestrator=_orchestrator_site(recipe, profile),
        )
    return plan(recipe, profile).placement


@dataclass
class PlanReport:
    recipe: str
    profile: str
    model: str
    placement: Placement
    groups: list
    trainer: dict
    inference: dict
    orchestrator: dict
    bottleneck: str
    fits: bool
    errors: list = field(default_factory=list)
    warnings: list = field(default_factory=list)

    def to_json(self) -> dict:
        """Machine-readable plan; numbers are SI (seconds, tokens/s) except the *_gib memory fields."""
        return {
            "recipe": self.recipe, "profile": self.profile, "model": self.model, "fits": self.fits,
            "placement": self.placement.to_dict(), "groups": self.groups, "trainer": self.trainer,
            "inference": self.inference, "orchestrator": self.orchestrator, "bottleneck": self.bottleneck,
            "errors": list(self.errors), "warnings": list(self.warnings),
        }


def plan(recipe, profile=None) -> PlanReport:
    """Size `recipe` on `profile` (ClusterProfile, or None to load `recipe.cluster.profile`)."""
    from rlctl.recipes.plan_compose import build_report

    return build_report(recipe, _profile(recipe, profile))


__all__ = ["PlanReport", "RecipeError", "compute_placement", "plan"]
