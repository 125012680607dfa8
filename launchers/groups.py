"""Placement + recipe + cluster profile → the job groups a launcher starts.

A group is one kind of component (`orchestrator`, `inference`, `trainer`) with its node count, tasks per
node, the Python module each task runs, and its Slurm resources. On Slurm each group is one component
of a heterogeneous job (`het_index`), except an orchestrator placed beside inference: it then runs as
an extra one-task step inside the inference component (`shares_component`), because het components
cannot share a node.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rlctl.recipes.errors import RecipeError

DEFAULT_MODULES = {
    "orchestrator": "rlctl.orchestrator",
    "inference": "rlctl.inference",
    "trainer": "rlctl.trainer",
}


@dataclass(frozen=True)
class JobGroup:
    name: str
    """`orchestrator`, `inference` or `trainer`."""
    het_index: int
    """Index K of the het-job component the group runs in (`srun --het-group=K`)."""
    nodes: int
    ntasks_per_node: int
    module: str
    """Entry point: every task runs `python -m <module> --run-dir DIR`."""
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    mem_gib: int | None = None
    time_limit: str = "24:00:00"
    shares_component: bool = False
    """True when the group is a one-task step inside another group's het component."""

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node

    def manifest_entry(self) -> dict:
        return {"name": self.name, "het_index": self.het_index, "nodes": self.nodes,
                "ntasks_per_node": self.ntasks_per_node}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "JobGroup":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def _resources(recipe, profile, name: str, partition: str | None, ntasks_per_node: int,
               gpus: int, het_index: int, nodes: int, default_cpus: int, shares: bool = False) -> JobGroup:
    res = getattr(recipe.deployment, name)
    gpus_req = res.gpus_per_node if res.gpus_per_node is not None else gpus
    if not profile.gres_gpu:
        gpus_req = 0
    elif gpus_req > profile.gpus_per_node:  # sbatch's "Requested node configuration is not available"
        raise RecipeError(f"asks for {gpus_req} GPUs per node; cluster profile '{profile.name}' has "
                          f"{profile.gpus_per_node} (allowed: 0-{profile.gpus_per_node})",
                          key=f"deployment.{name}.gpus_per_node")
    return JobGroup(
        name=name,
        het_index=het_index,
        nodes=nodes,
        ntasks_per_node=ntasks_per_node,
        module=recipe.deployment.entrypoints.get(name, DEFAULT_MODULES[name]),
        gpus_per_node=gpus_req,
        cpus_per_task=res.cpus_per_task or default_cpus,
        partition=res.partition or partition,
        account=res.account or profile.account,
        qos=res.qos or profile.qos,
        constraint=res.constraint or profile.constraint,
        mem_gib=res.mem_gib,
        time_limit=res.time_limit or recipe.deployment.time_limit,
        shares_component=shares,
    )


def build_groups(recipe, profile, placement) -> list[JobGroup]:
    """Groups ordered by het index; the orchestrator's own component (if any) comes first so the
    batch script, which runs on component 0's first node, sits on a cheap CPU node."""
    gpu_part = profile.partitions.gpu
    cpus = profile.cpus_per_node
    own_orch = placement.orchestrator == "cpu_partition"
    first = 1 if own_orch else 0
    inf_per_node = placement.inference_servers_per_node
    inference = _resources(
        recipe, profile, "inference", gpu_part, inf_per_node,
        min(profile.gpus_per_node, inf_per_node * placement.inference_gpus_per_server),
        first, placement.inference_nodes, max(1, cpus // inf_per_node))
    tr_per_node = placement.trainer_ranks_per_node
    trainer = _resources(
        recipe, profile, "trainer", gpu_part, tr_per_node,
        min(profile.gpus_per_node, tr_per_node), first + 1, placement.trainer_nodes,
        max(1, cpus // tr_per_node))
    if own_orch:
        orchestrator = _resources(recipe, profile, "orchestrator", profile.partitions.cpu, 1, 0, 0, 1,
                                  min(4, cpus))
    else:
        orchestrator = _resources(recipe, profile, "orchestrator", gpu_part, 1, 0, inference.het_index, 1,
                                  1, shares=True)
    return [orchestrator, inference, trainer]


def group_by_name(groups: list[JobGroup], name: str) -> JobGroup:
    for g in groups:
        if g.name == name:
            return g
    raise KeyError(name)


def components(groups: list[JobGroup]) -> list[list[JobGroup]]:
    """Groups per het-job component, by het index (a shared component lists its owner first)."""
    out: dict[int, list[JobGroup]] = {}
    for g in sorted(groups, key=lambda g: (g.het_index, g.shares_component)):
        out.setdefault(g.het_index, []).append(g)
    return [out[k] for k in sorted(out)]


def check_preempt_signal(signal_s: int, groups: list[JobGroup]) -> None:
    """Slurm sends USR2 `preempt_signal_s` before the time limit: at or past a group's whole limit it
    comes as the job starts, and the run checkpoints and requeues at once, again and again."""
    from rlctl.recipes.plan_extras import slurm_seconds

    for group in groups:
        limit = slurm_seconds(group.time_limit)
        if limit is not None and signal_s >= limit:
            raise RecipeError(f"{signal_s} s before the {group.name} group's time limit ({group.time_limit}) is before it "
                              "starts: the run would checkpoint and requeue at once; allowed: less than the time limit, "
                              "more than a trainer step plus a checkpoint", key="deployment.preempt_signal_s")


def check_group_time_limits(signal_s: int, groups: list[JobGroup]) -> None:
    """Slurm sends the preemption USR2 to the batch script only, before the limit of the component it
    runs in (het index 0): a group whose own limit is shorter is killed at it without that signal, so
    without the checkpoint and requeue the signal brings (the run just fails there)."""
    from rlctl.recipes.plan_extras import slurm_seconds

    if signal_s <= 0:
        return
    first = next(g for g in components(groups)[0] if not g.shares_component)
    first_s = slurm_seconds(first.time_limit)
    for group in groups:
        limit = slurm_seconds(group.time_limit)
        if limit is not None and (first_s is None or limit < first_s) and not group.shares_component:
            raise RecipeError(
                f"{group.time_limit} is shorter than the {first.name} group's limit ({first.time_limit}): Slurm "
                "sends the preemption signal (deployment.preempt_signal_s) to the batch script before that limit "
                f"only, so this group would be killed at its own without a checkpoint; allowed: at least "
                f"{first.time_limit}", key=f"deployment.{group.name}.time_limit")
