"""`rlctl plan`: compose the trainer, inference and orchestrator models into one plan report."""
from __future__ import annotations

from rlctl.launchers.placement import Placement


def _int_or(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _cpu_placement(recipe, profile) -> Placement:
    tr = recipe.trainer
    ranks = 1
    for degree in (tr.fsdp, tr.cp, tr.tp):
        ranks *= _int_or(degree, 1)
    dep = recipe.deployment
    return Placement(
        trainer_nodes=_int_or(dep.trainer_nodes, 1),
        inference_nodes=_int_or(dep.inference_nodes, 1),
        trainer_ranks_per_node=ranks,
        inference_servers_per_node=_int_or(recipe.inference.dp, 1),
        inference_gpus_per_server=0,
        orchestrator=_orchestrator_site(recipe, profile),
    )


def _orchestrator_site(recipe, profile) -> str:
    forced = recipe.deployment.orchestrator_placement
    if forced != "auto":
        return forced
    return "cpu_partition" if profile.partitions.cpu and profile.cpu_nodes > 0 else "inference_node"


def compute_placement(recipe, profile=None) -> Placement:
    """Node split and per-node process counts for `recipe` on `profile` (cheap; no torch).

    `profile` is a ClusterProfile; None loads `recipe.cluster.profile`.
    """
    if profile is None:
        from rlctl.launchers.cluster import load_profile

        profile = load_profile(recipe.cluster.profile)
    if profile.gpus_per_node == 0:
        return _cpu_placement(recipe, profile)
    gpus = profile.gpus_per_node
    dep = recipe.deployment
    tp = _int_or(recipe.inference.tp, gpus)
    trainer_nodes = dep.trainer_nodes if dep.trainer_nodes != "auto" else max(1, profile.nodes // 2)
    inference_nodes = dep.inference_nodes if dep.inference_nodes != "auto" else max(1, profile.nodes - trainer_nodes)
    return Placement(
        trainer_nodes=trainer_nodes,
        inference_nodes=inference_nodes,
        trainer_ranks_per_node=gpus,
        inference_servers_per_node=max(1, gpus // tp),
        inference_gpus_per_server=min(tp, gpus),
        orchestrator=_orchestrator_site(recipe, profile),
    )
