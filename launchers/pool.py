"""Shared inference pools: what `rlctl pool launch|list|show` do.

A pool is started from a recipe like a run, but its job holds only the recipe's inference servers and
the pool's front (`rlctl.inference.pool_service`, in the orchestrator's group) — no trainer. It lives
in `<output_root>/pools/<name>/` (a run directory: same lock, logs, status, cancel: `rlctl pool stop`
is `rlctl cancel`), and a run attaches with `deployment.inference_pool = "<name>"` under the same
output root (launchers/attach.py). A LoRA recipe (`trainer.lora.rank` > 0) makes a pool of LoRA runs
(one adapter per run, `inference.max_loras` at once); otherwise it serves full-weight runs by turns
(see inference/pool_dispatch.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from rlctl.launchers.attach import pools_root
from rlctl.launchers.groups import JobGroup, build_groups
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.orchestrator.pool_attach import POOLS_DIR, PoolUnavailable, pool_endpoint
from rlctl.recipes.errors import RecipeError

POOL_MODULE = "rlctl.inference.pool_service"


def pool_job(recipe, profile, placement) -> tuple[Placement, list[JobGroup]]:
    """A pool's placement and job: the inference servers, and the front beside them on their first node
    (`inference_node`, where a run's orchestrator goes without a CPU partition); no trainer. The front is a
    proxy next to its servers: it takes no CPU node, which the attached runs' orchestrators need (on the
    test cluster's one CPU node, a front holding it kept every attached run pending). Its job then has one
    component: a plain job."""
    placement = dataclasses.replace(placement, orchestrator="inference_node")
    groups = [dataclasses.replace(g, module=POOL_MODULE) if g.name == "orchestrator" else g
              for g in build_groups(recipe, profile, placement) if g.name != "trainer"]
    return placement, groups


def launch_pool(refs, overrides=(), *, cluster: str | None = None, name: str | None = None):
    """Start pool `name` (default: the recipe's name), or a new attempt of a stopped pool of that name."""
    from rlctl.launchers.launch import check_submitter, load_for_launch, start_attempt
    from rlctl.launchers.output_root import output_root_and_origin
    from rlctl.launchers.run_dirs import check_run_name, claim_run_dir, first_attempt, run_lock
    from rlctl.launchers.status import run_state

    if name is not None:  # "" too: refused as by `rlctl launch`, not replaced by the recipe's name
        check_run_name(name)
    recipe, profile, placement, _ = load_for_launch(refs, overrides, cluster)
    if recipe.deployment.inference_pool:
        raise RecipeError("a pool cannot itself attach to a pool (allowed: unset)", key="deployment.inference_pool")
    if recipe.inference.disaggregation.enabled:
        raise RecipeError("prefill/decode replicas cannot form a shared pool (allowed: false)",
                          key="inference.disaggregation.enabled")
    check_submitter(profile, dry_run=False)
    name = check_run_name(recipe.name if name is None else name)
    output, origin = output_root_and_origin(recipe, profile)
    root = pools_root(output)
    pool = claim_run_dir(root, name, name, origin)
    loaded = (recipe, profile, *pool_job(recipe, profile, placement))
    if pool is not None:
        with first_attempt(pool, f"rlctl pool launch {name}"):  # a refused submission leaves no folder
            return start_attempt(pool, loaded, refs, 0)
    pool = RunDir(root / name)
    with run_lock(pool, f"rlctl pool launch {name}"):
        if not pool.manifest.is_file():
            raise RecipeError(f"{pool.root} exists but holds no run.json (not a pool directory)", key="--name")
        state = run_state(pool.root).state
        if state in ("pending", "running"):
            raise RecipeError(f"pool {name!r} is already {state} ({pool.root}); stop it first with "
                              f"`rlctl pool stop {name}`", key="--name")
        previous = pool.read_manifest()
        pool.done.unlink(missing_ok=True)  # written when it was stopped: its new servers must not read it
        return start_attempt(pool, loaded, refs, int(previous.get("attempt", 0)) + 1, previous=previous)


def resolve_pool(name: str, root: Path) -> RunDir:
    """Pool `name` under output root `root` (a path to a pool directory also works)."""
    from rlctl.launchers.status import RunNotFound, resolve_run

    try:
        return RunDir(resolve_run(name, pools_root(root), kind="pool"))
    except RunNotFound:
        raise RecipeError(f"no pool {name!r} under {pools_root(root)} (see `rlctl pool list`)", key="POOL") from None


def is_pool(run_dir: Path) -> bool:
    """Whether a run directory is a pool's: pools live in `<output root>/pools/<name>`."""
    return Path(run_dir).parent.name == POOLS_DIR


def list_pools(root: Path) -> list[dict]:
    from rlctl.launchers.status import list_runs

    return [describe_pool(RunDir(d)) for d in list_runs(pools_root(root))]


def describe_pool(pool: RunDir) -> dict:
    """State, endpoint and live statistics of a pool (what `rlctl pool show` prints)."""
    from rlctl.launchers.status import load_manifest, run_state

    manifest, problem = load_manifest(pool.root)
    if manifest is None:  # listed, not raised: one damaged pool must not hide the others
        return {"name": pool.root.name, "pool_dir": str(pool.root), "state": "unknown", "reason": problem,
                "mode": "-", "model": None}
    status = run_state(pool.root, manifest)
    recipe = manifest.get("recipe") or {}
    try:
        endpoint = pool_endpoint(pool) if status.state == "running" else {}
    except PoolUnavailable:
        endpoint = {}
    lora = ((recipe.get("trainer") or {}).get("lora") or {}).get("rank", 0)
    return {"name": pool.root.name, "pool_dir": str(pool.root), "state": status.state,
            "scheduler": status.scheduler, "job_id": status.job_id,
            "model": (recipe.get("model") or {}).get("name"), "mode": "lora" if lora else "full",
            "servers": (manifest.get("plan") or {}).get("inference_servers"),
            "url": endpoint.get("url"), "stats": endpoint.get("stats")}
