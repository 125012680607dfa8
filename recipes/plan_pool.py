"""`rlctl plan` of a run attached to a shared inference pool (`deployment.inference_pool`).

The run's job holds only its trainer and orchestrator; the pool's servers do its rollouts. The
caller looks the pool up (cli/plan.py through launchers/pool_lookup.py: recipes/ does not import the
launchers) and passes what it found as a PoolInfo. A running pool is planned with its own servers
(the recipe and placement in its run.json); a pool not found or not running with this recipe's
`[inference]` section as its size, and a warning naming the key (launch would refuse it)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.hardware import gpu_spec
from rlctl.recipes.plan_compose import (AUTO, _async_step, _cpu_report, _degrees_of, _gpu_weights, _inference,
                                        _rollout_s, _search, _trainer)
from rlctl.recipes.plan_report import cpu_groups, cpu_placement, cpu_rollout_time, orchestrator_site
from rlctl.recipes.plan_sync import cpu_shape, weight_sync

log = logging.getLogger(__name__)

KEY = "deployment.inference_pool"
NEAR_BEST = 1.01
"""An `auto` trainer takes the fewest nodes whose step is within 1% of the best one (see _trainer_nodes)."""


@dataclass(frozen=True)
class PoolInfo:
    """What the caller found of pool `name` (plain data)."""

    name: str
    where: str = ""
    """The directory looked up: `<output root>/pools/<name>`."""
    state: str = "missing"
    """`running`, else why it serves nothing now (`missing`, `stopped`, `failed`, ...)."""
    manifest: dict = field(default_factory=dict)
    """Its run.json: the recipe it was launched from, its plan and placement."""
    announcement: dict = field(default_factory=dict)
    """Its front's `services/pool/0.json`: mode, model, max_model_len, live stats (attached runs)."""
    refusal: str | None = None
    """Why launch would refuse to attach this run to it (one line naming the key), if it would."""


@dataclass
class _Servers:
    """The servers the rollouts are planned on: the pool's, or the recipe's stand-in for them."""

    recipe: object
    """The run's recipe with the pool's [inference] section."""
    profile: object
    nodes: int
    per_node: int
    gpus_per_server: int
    from_pool: bool
    same_cluster: bool


@dataclass
class Attached:
    """build_report's parts for an attached run (recipes/plan_compose.py)."""

    placement: Placement
    trainer: dict
    inference: dict
    trainer_s: float
    rollout_s: float
    weights: dict
    groups: list
    nodes_used: int
    section: dict

    def parts(self) -> tuple:
        return self.placement, self.trainer, self.inference, self.trainer_s, self.rollout_s, self.weights


def _pool_servers(recipe, profile, pool: PoolInfo | None, warnings: list) -> _Servers | None:
    """The running pool's servers from its run.json; None (with a warning) when they cannot be used."""
    name = recipe.deployment.inference_pool
    if pool is None:  # a caller that does not look pools up (launch's placement, the monitor)
        warnings.append(f"{KEY}: pool {name!r} was not looked up; planned with this recipe's [inference] "
                        "section as the pool's size")
        return None
    if pool.state != "running":
        why = pool.refusal or f"{KEY}: pool {name!r} is {pool.state}"
        warnings.append(f"{why}; planned with this recipe's [inference] section as the pool's size "
                        "(launch would refuse)")
        return None
    if pool.refusal:
        warnings.append(f"{pool.refusal} (launch would refuse)")
    from rlctl.recipes.load import validate

    try:
        placement = pool.manifest.get("placement") or {}
        pool_recipe = validate(pool.manifest["recipe"])
        pool_profile = profile
        same = pool_recipe.cluster.profile == profile.name
        if not same:
            from rlctl.recipes.clusters import load_profile

            pool_profile = load_profile(pool_recipe.cluster.profile)
        nodes, per_node = int(placement["inference_nodes"]), int(placement["inference_servers_per_node"])
        gps = int(placement.get("inference_gpus_per_server") or 0)
    except (RecipeError, KeyError, TypeError, ValueError) as exc:  # a pool of another version, a bad file
        log.debug("pool %s: run.json unusable: %s", name, exc)
        warnings.append(f"{KEY}: pool {name!r}: cannot read its servers from {pool.where}/run.json ({exc}); "
                        "planned with this recipe's [inference] section as the pool's size")
        return None
    inference = pool_recipe.inference
    if gps and inference.tp == AUTO:  # the degree the pool runs with, not one chosen again
        inference = inference.model_copy(update={"tp": gps})
    view = recipe.model_copy(update={"inference": inference})
    return _Servers(view, pool_profile, max(1, nodes), max(1, per_node), gps, True, same)


def _stand_in(recipe, spec, profile, shape, cpu: bool) -> _Servers:
    """The recipe's own [inference] section, sized as the run itself would size it."""
    if cpu:
        pl = cpu_placement(recipe, profile)
        return _Servers(recipe, profile, pl.inference_nodes, pl.inference_servers_per_node, 0, False, True)
    nodes = recipe.deployment.inference_nodes
    if nodes == AUTO:
        nodes = _search(recipe, spec, profile, gpu_spec(profile.gpu), shape)[1]
    return _Servers(recipe, profile, nodes, 0, 0, False, True)


def _is_cpu(recipe, profile) -> bool:
    return profile.gpus_per_node == 0 or cpu_groups(recipe)


def _rollouts(spec, servers: _Servers, shape, errors: list, warnings: list):
    """(inference section, rollout step, InferencePlan or None) on `servers`."""
    rollouts, mean, completion, in_flight, _ = shape
    if _is_cpu(servers.recipe, servers.profile):
        pl = Placement(0, servers.nodes, 0, servers.per_node, 0, "inference_node")
        cpu_r = cpu_rollout_time(spec, servers.recipe, servers.profile, pl, rollouts, mean, completion, in_flight)
        inference = {"gpus": 0, "tp": 1, "servers": pl.inference_servers, **cpu_r,
                     "kv_cache_gib_per_gpu": servers.recipe.inference.kv_cache_gib_cpu, "completion_tokens": completion}
        return inference, cpu_r["rollout_step_time_s"], None
    gpu = gpu_spec(servers.profile.gpu)
    ip = _inference(servers.recipe, spec, servers.profile, gpu, servers.nodes, rollouts, mean, completion, in_flight)
    servers.per_node = max(1, servers.profile.gpus_per_node // ip.tp)
    servers.gpus_per_server = min(ip.tp, servers.profile.gpus_per_node)
    if not ip.fits:  # a running pool's servers do run: its own plan was optimistic, not this run's recipe wrong
        msg = "inference: " + ("; ".join(ip.notes) or "no KV cache left")
        (warnings if servers.from_pool else errors).append(
            msg + ("" if servers.from_pool else " — raise inference.tp or use fp8"))
    else:
        warnings += ip.notes
    return ip.to_json(), _rollout_s(ip), ip


def _weights(spec, servers: _Servers, tp_, ip, trainer_nodes: int, trainer_ranks: int) -> dict:
    if ip is None:  # CPU servers: each reads the whole model, the servers of a node share its page cache
        pl = Placement(trainer_nodes, servers.nodes, trainer_ranks, servers.per_node, 0, "inference_node")
        return weight_sync(servers.recipe, spec, servers.profile, cpu_shape(pl), on_gpu=False)
    return _gpu_weights(servers.recipe, spec, servers.profile, tp_, ip, trainer_nodes, servers.nodes)


def _own_orchestrator_nodes(profile) -> tuple[int, int]:
    """(nodes of the run's orchestrator, of them on the GPU partition). Attached, it has a component of
    its own (launchers/attach.py): on the CPU partition if there is one, else on a node of the GPU
    partition (with no GPU), as there is no inference node to sit beside. Local: one machine."""
    if profile.scheduler == "local":
        return 0, 0
    return 1, 0 if profile.partitions.cpu else 1


def _trainer_nodes(recipe, spec, profile, servers: _Servers, rollout_s: float, ip, shape) -> int:
    """`auto` trainer nodes of an attached run: the nodes the pool does not hold (of total_nodes, or of
    the cluster), but no more than keep up with the pool. The pool to itself is the fastest it serves
    this run, so a trainer that keeps up with it keeps up when other runs share it; nodes beyond that
    would only wait for rollouts."""
    _, gpu_partition = _own_orchestrator_nodes(profile)
    total = recipe.deployment.total_nodes or profile.nodes
    held = servers.nodes if servers.same_cluster else 0
    budget = max(1, min(total, profile.nodes - held - gpu_partition))
    gpu, off = gpu_spec(profile.gpu), recipe.orchestrator.max_off_policy_steps
    scores = []
    for t in range(1, budget + 1):
        tp_ = _trainer(recipe, spec, profile, gpu, t, shape[4], shape[1], [], [])
        if tp_ is None or not tp_.fits:
            scores.append(math.inf)
            continue
        weights = _weights(spec, servers, tp_, ip, t, profile.gpus_per_node)
        scores.append(_async_step(tp_.step_time_s, rollout_s, off, weights))
    best = min(scores)
    if not math.isfinite(best):
        return budget  # nothing fits: the most nodes, and the plan says what is missing
    return next(t for t, s in enumerate(scores, 1) if s <= best * NEAR_BEST)


def size_attached(recipe, spec, profile, shape, errors: list, warnings: list, pool: PoolInfo | None) -> Attached:
    """Placement, trainer, rollouts on the pool, weight sync and job groups of an attached run."""
    cpu = _is_cpu(recipe, profile)
    servers = _pool_servers(recipe, profile, pool, warnings) or _stand_in(recipe, spec, profile, shape, cpu)
    inference, rollout_s, ip = _rollouts(spec, servers, shape, errors, warnings)
    if cpu:
        own, trainer, _, trainer_s, _ = _cpu_report(recipe, spec, profile, shape, errors, warnings)
        t_nodes, tp_ = own.trainer_nodes, None
        degrees = own.trainer_degrees
    else:
        t_nodes = recipe.deployment.trainer_nodes
        if t_nodes == AUTO:
            t_nodes = _trainer_nodes(recipe, spec, profile, servers, rollout_s, ip, shape)
        tp_ = _trainer(recipe, spec, profile, gpu_spec(profile.gpu), t_nodes, shape[4], shape[1], warnings, errors)
        trainer = tp_.to_json() if tp_ else {"step_time_s": None, "tokens_per_s": None, "memory_gib_per_gpu": None}
        trainer_s = tp_.step_time_s if tp_ else math.inf
        degrees = _degrees_of(tp_)
    ranks = own.trainer_ranks_per_node if cpu else profile.gpus_per_node
    # no inference node of its own: the servers are the pool's (their shape is in the `pool` section)
    placement = Placement(t_nodes, 0, ranks, servers.per_node, servers.gpus_per_server,
                          orchestrator_site(recipe, profile), degrees)
    weights = _weights(spec, servers, tp_, ip, t_nodes, ranks)
    orch_nodes, orch_on_gpu = _own_orchestrator_nodes(profile)
    nodes_used = t_nodes + orch_on_gpu
    name = recipe.deployment.inference_pool
    where = ("cpu_partition" if profile.partitions.cpu else "gpu_partition") if orch_nodes else "local"
    groups = [{"name": "orchestrator", "nodes": orch_nodes, "where": where},
              {"name": "inference", "nodes": 0, "pool": name, "pool_servers": servers.nodes * servers.per_node},
              {"name": "trainer", "nodes": t_nodes, "ntasks_per_node": ranks}]
    if servers.from_pool and servers.same_cluster and profile.scheduler != "local" \
            and nodes_used + servers.nodes > profile.nodes:
        warnings.append(f"deployment.trainer_nodes: this run's {nodes_used} node(s) and the {servers.nodes} of pool "
                        f"{name!r} exceed the {profile.nodes} of {profile.name!r}: the job waits for nodes")
    inference["pool"] = name
    section = _section(recipe, pool, servers, rollout_s)
    room = (pool.announcement if pool else {}).get("max_loras")
    if section["mode"] == "lora" and isinstance(room, int) and section["attached_runs"] >= room:
        warnings.append(f"{KEY}: pool {name!r} holds {room} adapter(s) and {section['attached_runs']} run(s) are "
                        "attached now: this run would be refused when it attaches (inference.max_loras)")
    return Attached(placement, trainer, inference, trainer_s, rollout_s, weights, groups, nodes_used, section)


def sizer(pool: PoolInfo | None):
    """build_report's `size_attached` for a run attached to `pool`."""
    return lambda recipe, spec, profile, shape, errors, warnings: size_attached(
        recipe, spec, profile, shape, errors, warnings, pool)


def _section(recipe, pool: PoolInfo | None, servers: _Servers, rollout_s: float) -> dict:
    """The report's `pool` section."""
    ann = pool.announcement if pool else {}
    runs = sorted(((ann.get("stats") or {}).get("runs") or {}))
    gpus = servers.nodes * servers.profile.gpus_per_node if servers.gpus_per_server else 0
    return {"name": recipe.deployment.inference_pool, "state": pool.state if pool else "not looked up",
            "where": pool.where if pool else None, "planned_with": "pool" if servers.from_pool else "recipe",
            "mode": ann.get("mode") or ("lora" if recipe.trainer.lora.enabled else "full"),
            "model": ann.get("model") or recipe.model.name,
            "max_model_len": ann.get("max_model_len") or servers.recipe.inference.max_model_len,
            "nodes": servers.nodes, "servers": servers.nodes * servers.per_node,
            "gpus_per_server": servers.gpus_per_server, "gpus": gpus, "profile": servers.profile.name,
            "attached_runs": len(runs), "runs": runs,
            # the pool to itself: the other attached runs' requests are not in it
            "rollout_step_alone_s": rollout_s if math.isfinite(rollout_s) else None}


__all__ = ["Attached", "PoolInfo", "size_attached", "sizer"]
