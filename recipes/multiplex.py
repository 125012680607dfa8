"""`rlctl plan A.toml B.toml … --multiplex`: several runs on one cluster, isolated vs a shared inference
pool (PlexRL). Each run's phase trace comes from its plan; the simulation is in `multiplex_sim`, the
pool's scheduler in `rlctl.inference.pool_scheduler`. Explained in docs/multiplex.md."""
from __future__ import annotations

from rlctl.recipes.errors import RecipeError
from rlctl.recipes.multiplex_sim import (PoolNode, RunTrace, pool_candidates, simulate_isolated,
                                         simulate_shared)

GIB = 2**30
PCIE_BYTES_PER_S = 50e9
"""Host RAM → one GPU (PCIe Gen5 x16 measures ≈ 50 GB/s of its 64): every GPU of a node loads its
shard at once, so a node loads at GPUs × this."""
COLD_READ_BYTES_PER_S_PER_GPU = 2e9
"""NVMe / shared filesystem → one GPU; the node's rate is also capped by its interconnect (the profile's
`interconnect_gbps` per GPU). Parallel filesystems give a client a few GB/s."""
POOL_WEIGHT_FRACTION = 0.5
"""Share of a pool GPU's HBM that resident weights may take; the rest is KV cache."""
HOST_CACHE_FRACTION = 0.5
"""Share of a node's host RAM that caches runs' weights (the rest is the processes' own)."""
ENGINE_RESTART_S = 60.0
"""Switching a node to another architecture restarts the inference engine (load, CUDA graphs, warm-up)
instead of reloading weights in place."""
MAX_SLOWDOWN = 1.10
"""The pool size chosen is the smallest whose runs are each at most this much slower than isolated (else
the largest tried)."""
MIN_RUNS = 2


def _trace(path: str, report: dict, recipe) -> RunTrace:
    key = lambda k: f"{path}: {k}"  # noqa: E731 - names the recipe as well as its key
    if report["errors"]:
        raise RecipeError(f"{path}: the run does not fit on its own: {report['errors'][0]}", key="--multiplex")
    inf, pl, orch = report["inference"], report["placement"], report["orchestrator"]
    if recipe.inference.disaggregation.enabled:
        raise RecipeError("prefill/decode replicas cannot join a shared pool; allowed: false",
                          key=key("inference.disaggregation.enabled"))
    if not inf.get("gpus"):
        raise RecipeError("a CPU run cannot share a GPU pool; allowed: GPU runs (gpus_per_node >= 1)",
                          key=key("deployment.inference.gpus_per_node"))
    trainer_s, rollout_s = orch.get("trainer_step_time_s"), orch.get("rollout_step_time_s")
    if not trainer_s or not rollout_s:
        raise RecipeError(f"{path}: the plan has no step time to simulate", key="--multiplex")
    step = orch["step_time_s"]
    off = recipe.orchestrator.max_off_policy_steps
    if off >= 1 and step > max(trainer_s, rollout_s):  # the trainer's weight hand-off (calibrated)
        trainer_s = step
    return RunTrace(name=report["recipe"], model=report["model"], trainer_s=trainer_s, rollout_s=rollout_s,
                    steps=recipe.orchestrator.max_steps, off_policy=off, trainer_nodes=pl["trainer_nodes"],
                    inference_nodes=pl["inference_nodes"],
                    weight_bytes_per_node=inf["weights_gib_per_gpu"] * GIB * min(inf["gpus"], _gpn(report)))


def _gpn(report) -> int:
    return max(1, report["placement"]["trainer_ranks_per_node"])


def _check_replica(path: str, report: dict, profile, gpu) -> None:
    inf = report["inference"]
    span = inf["tp"] * inf.get("dp_per_replica", 1)
    budget = gpu.hbm_gib * POOL_WEIGHT_FRACTION
    if span > profile.gpus_per_node or inf["weights_gib_per_gpu"] > budget:
        raise RecipeError(
            f"{report['model']} cannot share a pool in full-weight mode: a replica needs {span} GPUs and "
            f"{inf['weights_gib_per_gpu']:.0f} GiB of weights per GPU; allowed: replicas within one node "
            f"({profile.gpus_per_node} GPUs) with at most {budget:.0f} GiB of weights per GPU",
            key=f"{path}: model.name")


def _pool_node(profile, gpu) -> PoolNode:
    gpn = profile.gpus_per_node
    cold = gpn * min(COLD_READ_BYTES_PER_S_PER_GPU, profile.interconnect_gbps * 1e9 / 8)
    return PoolNode(hbm_bytes=gpn * gpu.hbm_gib * POOL_WEIGHT_FRACTION * GIB,
                    host_bytes=profile.mem_gib_per_node * HOST_CACHE_FRACTION * GIB,
                    host_load_bytes_per_s=gpn * PCIE_BYTES_PER_S, cold_load_bytes_per_s=cold,
                    engine_restart_s=ENGINE_RESTART_S)


def plan_runs(refs: list[str], overrides: list[str], profile_ref: str | None):
    """Load and plan each recipe (one run each) on one profile: [(ref, recipe, plan JSON)], profile."""
    from rlctl.recipes.clusters import load_profile
    from rlctl.recipes.load import load_recipe
    from rlctl.recipes.plan import plan

    if len(refs) < MIN_RUNS:
        raise RecipeError(f"needs at least {MIN_RUNS} recipes (one run each), got {len(refs)}", key="--multiplex")
    extra = [f'cluster.profile="{profile_ref}"'] if profile_ref else []
    planned, profile = [], None
    for ref in refs:
        rec = load_recipe([ref], list(overrides) + extra)
        prof = load_profile(rec.cluster.profile)
        if profile is None:
            profile = prof
        elif prof.name != profile.name:
            raise RecipeError(f"{ref} plans on {prof.name!r} but {refs[0]} on {profile.name!r}; allowed: one "
                              "profile for all runs (pass -c PROFILE)", key="cluster.profile")
        planned.append((ref, rec, plan(rec, prof).to_json()))
    if profile.gpus_per_node == 0:
        raise RecipeError(f"{profile.name!r} has no GPUs; allowed: a GPU cluster profile", key="cluster.profile")
    return planned, profile


def multiplex(refs: list[str], overrides: list[str] = (), profile_ref: str | None = None) -> dict:
    """Plan the runs, simulate both modes, and return the report (JSON-ready)."""
    from rlctl.recipes.hardware import gpu_spec

    planned, profile = plan_runs(refs, overrides, profile_ref)
    gpu = gpu_spec(profile.gpu)
    names = [p[2]["recipe"] for p in planned]
    traces = []
    for i, (ref, rec, report) in enumerate(planned):
        _check_replica(ref, report, profile, gpu)
        if names.count(report["recipe"]) > 1:  # the same recipe twice: two runs, two names
            report = {**report, "recipe": f"{report['recipe']}#{i + 1}"}
        traces.append(_trace(ref, report, rec))
    biggest = max(traces, key=lambda t: t.nodes)
    if biggest.nodes > profile.nodes:
        raise RecipeError(f"{biggest.name} needs {biggest.nodes} nodes but {profile.name!r} has {profile.nodes}",
                          key="deployment")
    gpn = profile.gpus_per_node
    isolated = simulate_isolated(traces, profile.nodes, gpn)
    node = _pool_node(profile, gpu)
    tried = []
    for size in pool_candidates(traces, profile.nodes):  # smallest first: a larger pool only holds more
        tried.append(simulate_shared(traces, profile.nodes, size, gpn, node))
        if max(r["slowdown"] for r in tried[-1]["runs"]) <= MAX_SLOWDOWN:
            break
    shared = min(tried, key=lambda s: (max(r["slowdown"] for r in s["runs"]) > MAX_SLOWDOWN, s["gpu_hours"]))
    shared["pool_sizes_tried"] = [s["pool_nodes"] for s in tried]
    runs = [{"name": t.name, "model": t.model, "trainer_nodes": t.trainer_nodes, "inference_nodes": t.inference_nodes,
             "steps": t.steps, "max_off_policy_steps": t.off_policy, "trainer_step_s": t.trainer_s,
             "rollout_step_s": t.rollout_s, "weight_gib_per_node": t.weight_bytes_per_node / GIB}
            for t in traces]
    saving = 1 - shared["gpu_hours"] / isolated["gpu_hours"] if isolated["gpu_hours"] else None
    return {"profile": profile.name, "nodes": profile.nodes, "gpus_per_node": gpn, "runs": runs,
            "isolated": isolated, "shared": shared, "gpu_hours_saving": saving,
            "makespan_ratio": shared["makespan_s"] / isolated["makespan_s"] if isolated["makespan_s"] else None}
