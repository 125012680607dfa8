"""What a run that attaches to a shared inference pool (`deployment.inference_pool`) needs at launch:
the pool must run and be able to serve it, and the run's job holds no servers."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from rlctl.launchers.groups import JobGroup
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.pool_attach import POOLS_DIR, PoolUnavailable, pool_endpoint
from rlctl.recipes.errors import RecipeError


def pools_root(output_root: Path) -> Path:
    return Path(output_root) / POOLS_DIR


def attached_groups(groups: list[JobGroup], cpu_partition: str | None) -> list[JobGroup]:
    """An attached run's job: the trainer and the orchestrator (in a component of its own), no servers."""
    orch = next(g for g in groups if g.name == "orchestrator")
    trainer = next(g for g in groups if g.name == "trainer")
    partition = cpu_partition or orch.partition
    return [dataclasses.replace(orch, het_index=0, shares_component=False, partition=partition, gpus_per_node=0),
            dataclasses.replace(trainer, het_index=1)]


def check_attachable(recipe, root: Path) -> None:
    """A run with `deployment.inference_pool` may start only if that pool runs and can serve it."""
    name = recipe.deployment.inference_pool
    key = "deployment.inference_pool"
    pool = RunDir(pools_root(root) / name)
    if not pool.manifest.is_file():
        raise RecipeError(f"no pool {name!r} under {pools_root(root)} (start one with `rlctl pool launch`)", key=key)
    try:
        endpoint = pool_endpoint(pool)
    except PoolUnavailable as exc:
        raise RecipeError(str(exc), key=key) from None
    from rlctl.launchers.status import run_state

    state = run_state(pool.root).state
    if state != "running":
        raise RecipeError(f"pool {name!r} is {state}, not running (see `rlctl pool show {name}`)", key=key)
    if (endpoint.get("model"), endpoint.get("build_seed")) != (recipe.model.name, recipe.model.build_seed):
        raise RecipeError(f"pool {name!r} serves {endpoint.get('model')} (build_seed {endpoint.get('build_seed')}), "
                          f"the run trains {recipe.model.name} (build_seed {recipe.model.build_seed})",
                          key="model.name" if endpoint.get("model") != recipe.model.name else "model.build_seed")
    lora = recipe.trainer.lora
    if (endpoint.get("mode") == "lora") != lora.enabled:
        raise RecipeError(f"pool {name!r} serves {endpoint.get('mode')} runs (allowed for this run: "
                          f"{'a LoRA pool' if lora.enabled else 'a full-weight pool'})", key="trainer.lora.rank")
    if lora.enabled and lora.rank > int(endpoint.get("lora_rank") or 0):
        raise RecipeError(f"rank={lora.rank}: pool {name!r} serves adapters up to rank {endpoint.get('lora_rank')}",
                          key="trainer.lora.rank")
    if recipe.inference.max_model_len > int(endpoint.get("max_model_len") or 0):
        raise RecipeError(f"max_model_len={recipe.inference.max_model_len}: pool {name!r} serves sequences up to "
                          f"{endpoint.get('max_model_len')} tokens", key="inference.max_model_len")
    if recipe.weights.transport != "filesystem":
        raise RecipeError(f"transport={recipe.weights.transport!r} with a shared pool: the pool loads published "
                          "files (allowed: 'filesystem')", key="weights.transport")
