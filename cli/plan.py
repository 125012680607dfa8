"""`rlctl plan`: size a run before launch (placement, memory, throughput, step times, cost), and
`rlctl plan --calibrate RUN`: fit the planner's efficiency constants to a finished run."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli.common import print_json, pydantic_plugins_off, user_errors

HELP = """Plan RECIPE(s) on a cluster profile without launching anything.

RECIPE is a TOML file or a built-in recipe name (`rlctl recipes list`). Several recipes are merged
left to right (later tables override earlier keys); then every `-o key.path=value` override is applied
in order (values are TOML literals: `-o trainer.cp=4 -o inference.fp8=true`).

With `--calibrate RUN`, the efficiency constants are fitted to the finished run's measured step times
and written to a calibration file (`--calibration-out`); point a cluster profile at it
(`calibration: PATH` in its YAML) and later plans on that profile use it.

Exit code 0 when the run fits, 1 when it does not (the plan is still printed in full, its errors last),
2 for bad input."""

PLAN_DOES_NOT_FIT = 1


def register(app: typer.Typer) -> None:
    @app.command("plan", help=HELP)
    @user_errors
    def plan_cmd(
        recipe: List[str] = typer.Argument(..., help="Recipe TOML files or built-in names, merged left to right."),
        cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="Cluster profile name or YAML path (overrides cluster.profile)."),
        override: List[str] = typer.Option([], "--override", "-o", help="key.path=value override (repeatable)."),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
        calibrate: Optional[str] = typer.Option(None, "--calibrate", help="Finished run (directory or name) to fit the constants to."),
        calibration_out: Optional[Path] = typer.Option(None, "--calibration-out", help="Where --calibrate writes (default RUN/calibration.toml)."),
        calibration: Optional[Path] = typer.Option(None, "--calibration", help="Plan with this calibration file (overrides the profile's)."),
        multiplex: bool = typer.Option(False, "--multiplex", help="Each RECIPE is one run: simulate them on the cluster isolated vs sharing an inference pool (docs/multiplex.md)."),
    ) -> None:
        with pydantic_plugins_off():  # the recipe models, the config.json adapter: no plugin scan
            if multiplex:
                return _multiplex(recipe, cluster, override, as_json, calibrate, calibration)
            _plan(recipe, cluster, override, as_json, calibrate, calibration_out, calibration)


def _plan(recipe, cluster, override, as_json, calibrate, calibration_out, calibration) -> None:
    from rlctl.recipes.clusters import load_profile
    from rlctl.recipes.input_checks import check_inputs
    from rlctl.recipes.load import load_recipe
    from rlctl.recipes.plan import plan

    overrides = list(override) + ([f'cluster.profile="{cluster}"'] if cluster else [])
    rec = load_recipe(recipe, overrides)
    check_inputs(rec)  # what `rlctl launch` would refuse, the plan refuses too
    profile = load_profile(rec.cluster.profile)
    if calibration is not None:
        from rlctl.recipes.run_calibration import load_calibration

        load_calibration(calibration, key="--calibration")  # its errors name the option, not the profile
        profile = profile.model_copy(update={"calibration": str(calibration)})
    if calibrate is not None:
        out = _calibrate(rec, profile, calibrate, calibration_out, as_json)
        profile = profile.model_copy(update={"calibration": str(out)})
    pool = None
    if rec.deployment.inference_pool:  # attached: plan its rollouts on the pool's servers, if it runs
        from rlctl.launchers.output_root import output_root
        from rlctl.launchers.pool_lookup import pool_for_plan

        pool = pool_for_plan(rec, output_root(rec, profile))
    report = plan(rec, profile, pool=pool)
    if as_json:
        print_json(report.to_json())
    else:
        from rlctl.cli.plan_view import render

        render(report.to_json())
    if not report.fits:  # printed in full all the same; a CI script gating a launch on the plan sees it
        raise typer.Exit(PLAN_DOES_NOT_FIT)


def _multiplex(recipe, cluster, override, as_json, calibrate, calibration) -> None:
    # imported only with --multiplex: `rlctl plan` of one recipe does not pay for the simulation
    from rlctl.recipes.errors import RecipeError
    from rlctl.recipes.multiplex import multiplex

    if calibrate is not None or calibration is not None:
        raise RecipeError("cannot be combined with --calibrate/--calibration; allowed: plain plans", key="--multiplex")
    report = multiplex(list(recipe), list(override), cluster)
    if as_json:
        print_json(report)
    else:
        from rlctl.cli.multiplex_view import render

        render(report)


def _calibrate(rec, profile, ref: str, out: Optional[Path], as_json: bool) -> Path:
    """Fit and write the file; returns its path (the plan printed next uses it). `ref` is found the way
    every command finds a run: a run directory, or a run name under the output root."""
    from rlctl.launchers.status import RunNotFound, resolve_run
    from rlctl.recipes.errors import RecipeError, path_kind, shown
    from rlctl.recipes.run_calibration import calibrate

    try:
        run = resolve_run(ref)
    except (RunNotFound, OSError, ValueError):  # OSError/ValueError: a name no filesystem can hold
        run = Path(ref)
    if path_kind(run / "run.json") != "file":  # path_kind: a name too long or with a NUL is "not there"
        raise RecipeError(f"{shown(str(run))} is not a run directory (no run.json)", key="--calibrate")
    out = out if out is not None else run / "calibration.toml"
    written = calibrate(run, profile, out, recipe=_pinned(rec, run))
    if not as_json:
        from rlctl.cli.plan_view import render_calibration

        render_calibration(written, profile.name)
    return out


def _pinned(rec, run: Path):
    """The recipe given, its node split pinned to the one the run used (an `auto` split could move)."""
    from rlctl.recipes.run_calibration import run_recipe

    ran = run_recipe(run)
    for side in ("trainer_nodes", "inference_nodes"):
        setattr(rec.deployment, side, getattr(ran.deployment, side))
    return rec
