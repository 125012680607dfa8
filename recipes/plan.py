"""`rlctl plan`: compose the trainer, inference and orchestrator models into one plan report."""
from __future__ import annotations

from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.plan_compose import build_report
from rlctl.recipes.plan_report import PlanReport, cpu_groups, cpu_placement


def _profile(recipe, profile):
    if profile is None:
        from rlctl.recipes.clusters import load_profile

        profile = load_profile(recipe.cluster.profile)
    return profile


def compute_placement(recipe, profile=None, pool=None) -> Placement:
    """Node split and per-node process counts for `recipe` on `profile` (cheap; no torch).

    `profile` is a ClusterProfile; None loads `recipe.cluster.profile`. `auto` node counts are
    resolved by the planner (minimal async step time). `pool`: as for `plan`.
    """
    profile = _profile(recipe, profile)
    if profile.gpus_per_node == 0 or cpu_groups(recipe):
        return cpu_placement(recipe, profile)
    report = plan(recipe, profile, pool=pool)
    # An error naming a trainer degree (fsdp × cp × tp not dividing the trainer's GPUs, cp with sparse
    # attention) is certain, not an estimate: the trainer refuses it at start-up, after the job waited in the
    # queue. Refused here, before any run directory; a memory estimate that does not fit still launches.
    refused = next((e for e in report.errors if e.startswith(("trainer:", "trainer."))), None)
    if refused:
        raise RecipeError(f"{refused} (see `rlctl plan`)")
    return report.placement


def plan(recipe, profile=None, calibration: str | None = None, pool=None) -> PlanReport:
    """Size `recipe` on `profile` (ClusterProfile, or None to load `recipe.cluster.profile`), with the
    constants of `calibration` (a calibration file; default: the profile's `calibration`, if any).

    `pool` (a `plan_pool.PoolInfo`, found by the caller: recipes/ does not import the launchers) is the
    shared pool a run with `deployment.inference_pool` attaches to; None plans its rollouts with the
    recipe's own [inference] section as the pool's size, and says so."""
    import contextlib

    from rlctl.recipes.plan_extras import add_extras

    profile = _profile(recipe, profile)
    path = calibration or getattr(profile, "calibration", None)
    constants = contextlib.nullcontext()
    if path:  # the fitting module is imported only when a calibration file is in use
        from rlctl.recipes.run_calibration import applied, load_calibration, profile_calibration_key

        key = "calibration" if calibration else profile_calibration_key(profile)
        constants = applied(load_calibration(path, key=key))
    size_attached = None
    if recipe.deployment.inference_pool:  # served by a shared pool: sized by plan_pool.py
        from rlctl.recipes.plan_pool import sizer

        size_attached = sizer(pool)
    with constants:
        report = build_report(recipe, profile, size_attached)
        add_extras(report, recipe, profile)
    report.calibration = path
    return report


__all__ = ["PlanReport", "RecipeError", "compute_placement", "plan"]
