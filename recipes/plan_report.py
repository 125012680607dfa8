"""The plan report and the placement rules every part of the planner shares (no search here)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.orchestrator.exchange.placement import DEGREE_KEYS, Placement
from rlctl.trainer.degrees import resolve_dims
from rlctl.trainer.fp8 import check_fp8

AUTO = "auto"


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def orchestrator_site(recipe, profile) -> str:
    forced = recipe.deployment.orchestrator_placement
    if forced != AUTO:
        return forced
    return "cpu_partition" if profile.partitions.cpu and profile.cpu_nodes > 0 else "inference_node"


def cpu_groups(recipe) -> bool:
    """Trainer and inference both request 0 GPUs per node: a CPU run (e.g. the tiny recipe on a GPU
    cluster), placed like on a CPU profile — ranks from the parallel degrees, the CPU build of vLLM."""
    dep = recipe.deployment
    return dep.trainer.gpus_per_node == 0 and dep.inference.gpus_per_node == 0


def cpu_placement(recipe, profile) -> Placement:
    """Placement of a CPU run: ranks from the parallel degrees, node counts as given (no search), and
    the trainer degrees the trainer will run with (refused here, naming the key, when it cannot)."""
    tr, dep = recipe.trainer, recipe.deployment
    check_fp8(tr, "cpu")
    # fsdp 'auto' on CPU: as many shard ranks as the expert degree needs (ep borrows from them), else 1
    shard = _int_or(tr.fsdp, _int_or(tr.ep, 1))
    ranks = shard * _int_or(tr.cp, 1) * _int_or(tr.tp, 1)
    nodes = _int_or(dep.trainer_nodes, 1)
    dims = resolve_dims(tr, nodes * ranks, "cpu")
    return Placement(
        trainer_nodes=nodes, inference_nodes=_int_or(dep.inference_nodes, 1),
        trainer_ranks_per_node=ranks, inference_servers_per_node=_int_or(recipe.inference.dp, 1),
        inference_gpus_per_server=0, orchestrator=orchestrator_site(recipe, profile),
        trainer_degrees={k: getattr(dims, k) for k in DEGREE_KEYS},
    )


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
    disk: dict = field(default_factory=dict)
    """Run-directory disk: bytes per step and at the peak (see `rlctl.recipes.plan_disk`)."""

    def to_json(self) -> dict:
        """Machine-readable plan; numbers are SI (seconds, tokens/s, bytes) except the *_gib memory fields."""
        return {
            "recipe": self.recipe, "profile": self.profile, "model": self.model, "fits": self.fits,
            "placement": self.placement.to_dict(), "groups": self.groups, "trainer": self.trainer,
            "inference": self.inference, "orchestrator": self.orchestrator, "bottleneck": self.bottleneck,
            "errors": list(self.errors), "warnings": list(self.warnings), "disk": self.disk,
        }
