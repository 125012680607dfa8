"""What `rlctl plan` needs to know of the shared pool a run attaches to (`deployment.inference_pool`):
read-only, no request to the pool. The planner gets it as plain data (recipes/ does not import the
launchers)."""
from __future__ import annotations

import logging

from rlctl.recipes.errors import RecipeError
from rlctl.recipes.plan_pool import KEY, PoolInfo

log = logging.getLogger(__name__)


def pool_for_plan(recipe, root, strict: bool = False) -> PoolInfo | None:
    """Pool `deployment.inference_pool` under the run's output root `root`: its state, run.json and its
    front's announcement, and why launch would refuse this run there (None: the run has no pool).
    `strict` (launch): that refusal is raised (RecipeError naming the key) instead of recorded."""
    name = recipe.deployment.inference_pool
    if not name:
        return None
    from rlctl.launchers.attach import check_attachable, pools_root
    from rlctl.launchers.status import run_state
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.orchestrator.pool_attach import POOL_SERVICE

    pool = RunDir(pools_root(root) / name)
    refusal = None
    try:
        check_attachable(recipe, root)
    except RecipeError as exc:
        if strict:
            raise
        refusal = str(exc)
    try:
        if not pool.manifest.is_file():
            return PoolInfo(name, str(pool.root), "missing", refusal=refusal)
        manifest = pool.read_manifest()
        state = run_state(pool.root).state
        announced = pool.announced(POOL_SERVICE) if state == "running" else []
    except (OSError, ValueError) as exc:  # unreadable, or a run.json / announcement half written
        log.debug("pool %s: %s", pool.root, exc)
        return PoolInfo(name, str(pool.root), "unreadable",
                        refusal=refusal or f"{KEY}: pool {name!r}: cannot read {pool.root} ({exc})")
    return PoolInfo(name, str(pool.root), state, manifest if isinstance(manifest, dict) else {},
                    announced[0] if announced else {}, refusal)
