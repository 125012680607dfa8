"""`rlctl monitor RUN` (live view, `--once --json` for scripts, `--wait` for CI, `--plot` for curves)
and `rlctl runs` (the runs under an output root with their state)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from rlctl.cli.common import fail, print_json, user_errors

EXIT_OK, EXIT_RUN_FAILED, EXIT_TIMEOUT = 0, 1, 3


def _exit_code(state: str) -> int:
    return EXIT_OK if state == "completed" else EXIT_RUN_FAILED


def _resolve(run: str, root: Optional[Path], profile: Optional[str]) -> tuple[Path, bool]:
    """(directory, is it a pool): a run by path or name, else a pool by name (`rlctl pool list`)."""
    from rlctl.launchers.output_root import default_root
    from rlctl.launchers.pool import is_pool, resolve_pool
    from rlctl.launchers.status import BrokenRun, RunNotFound, resolve_run
    from rlctl.recipes.errors import RecipeError

    base = root if root is not None else default_root(profile)
    try:
        found = resolve_run(run, base)
        return found, is_pool(found)
    except RunNotFound as e:
        try:
            return resolve_pool(run, base).root, True
        except BrokenRun:
            raise
        except RecipeError:
            fail(f"{e} (nor is it a pool: `rlctl pool list`)")


def _pool(pool_dir: Path, once: bool, as_json: bool, interval: float) -> None:
    """`rlctl monitor POOL`: the pool's share, queue and residency switches per attached run."""
    from rich.console import Console

    from rlctl.cli.pool_view import render_pool
    from rlctl.launchers.pool import describe_pool
    from rlctl.orchestrator.exchange.layout import RunDir

    info = describe_pool(RunDir(pool_dir))
    if as_json:
        print_json(info)
    elif once:
        Console().print(render_pool(info))
    else:
        from rich.live import Live

        with Live(render_pool(info), refresh_per_second=4, screen=False) as live:
            while info["state"] in ("pending", "running"):
                time.sleep(interval)
                info = describe_pool(RunDir(pool_dir))
                live.update(render_pool(info))


def _snapshot(run_dir: Path):
    from rlctl.cli.follow import snapshot

    summary, metrics = snapshot(run_dir)
    return with_plan(summary, run_dir), metrics


_PLANS: dict[str, dict] = {}


def planned_times(run_dir: Path) -> dict:
    """The plan's step times for a run, planned again from the recipe and placement in its run.json
    (what launch records is the placement only); {} when the run cannot be planned any more (its
    profile is gone, say). Planned once per run and process: the live view refreshes every second."""
    key = str(Path(run_dir).resolve())
    if key not in _PLANS:
        from rlctl.recipes.clusters import load_profile
        from rlctl.recipes.errors import RecipeError
        from rlctl.recipes.plan import plan
        from rlctl.recipes.run_calibration import run_recipe

        try:
            recipe = run_recipe(Path(run_dir))
            orch = plan(recipe, load_profile(recipe.cluster.profile)).orchestrator
            _PLANS[key] = {"trainer_step_time_s": orch["trainer_step_time_s"],
                           "orchestrator_step_time_s": orch["step_time_s"],
                           "rollout_step_time_s": orch["rollout_step_time_s"]}
        except (RecipeError, OSError, ValueError):
            _PLANS[key] = {}
    return _PLANS[key]


def with_plan(summary: dict, run_dir: Path) -> dict:
    """`summary` with the plan's step times beside the measured ones (those the manifest had win)."""
    planned = {k: v for k, v in planned_times(run_dir).items() if v is not None}
    summary["predicted"] = {**planned, **(summary.get("predicted") or {})}
    return summary


def write_plot(run_dir: Path, out: Path) -> None:
    """A PNG with reward (and eval scores), trainer/orchestrator step times and off-policy lag over steps;
    a dashed line where a resumed attempt began."""
    try:
        import matplotlib
    except ImportError:
        fail("--plot needs matplotlib (pip install 'rlctl[report]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlctl.launchers.run_summary import ORCH_STEP_S, REWARD, TRAINER_STEP_S, by_step, resumed_at, series
    from rlctl.orchestrator.exchange.metrics import EvalRecord, OrchestratorStepRecord, keys_of, read_records

    LAG_MEAN, LAG_MAX = keys_of(OrchestratorStepRecord, "off_policy_lag_mean", "off_policy_lag_max")
    metrics = read_records(run_dir)
    trainer, orch = by_step(metrics, "trainer"), by_step(metrics, "orchestrator")
    evals = by_step(metrics, EvalRecord.component)  # step = the policy version evaluated
    EVAL_REWARD, EVAL_PASS = keys_of(EvalRecord, "reward_mean", "pass_at_k")
    if not trainer and not orch and not evals:
        fail(f"--plot: no metrics yet in {Path(run_dir) / 'metrics'}")
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    panels = (
        ("reward", [(orch, REWARD, "reward mean"), (evals, EVAL_REWARD, "eval reward"),
                    (evals, EVAL_PASS, f"eval pass@{evals[-1].get('k', 'k')}" if evals else "")]),
        ("step time (s)", [(trainer, TRAINER_STEP_S, "trainer"), (orch, ORCH_STEP_S, "orchestrator")]),
        ("off-policy lag (steps)", [(orch, LAG_MEAN, "mean"), (orch, LAG_MAX, "max")]),
    )
    resumes = resumed_at(trainer)
    for ax, (ylabel, lines) in zip(axes, panels):
        for records, key, label in lines:
            points = series(records, key)
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=label, marker="." if len(points) < 50 else None)
        for i, step in enumerate(resumes):  # a jump in a curve there is the restart, not the policy
            named = i == 0 and ax is axes[0]  # one legend entry says what the lines are, for all panels
            ax.axvline(step, color="gray", linestyle="--", linewidth=0.8, label="resumed" if named else None)
        ax.set_ylabel(ylabel)
        if ylabel.startswith("off-policy"):
            ax.set_ylim(bottom=0)  # lag is a count of steps; a zero baseline keeps it honest
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"rlctl run {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)  # the format follows the suffix, which stays .png for the temp file
    plt.close(fig)
    tmp.replace(out)


def _live(run_dir: Path, interval: float) -> dict:
    from rich.live import Live

    from rlctl.cli.monitor_view import render_summary

    summary, metrics = _snapshot(run_dir)
    with Live(render_summary(summary, metrics), refresh_per_second=4, screen=False) as live:
        while summary["state"] not in ("completed", "failed", "cancelled", "lost"):
            time.sleep(interval)
            summary, metrics = _snapshot(run_dir)
            live.update(render_summary(summary, metrics))
    return summary


def register(app: typer.Typer) -> None:
    @app.command()
    @user_errors
    def monitor(
        run: str = typer.Argument(..., help="Run directory, or a run (or shared pool) name under the output root."),
        once: bool = typer.Option(False, "--once", help="Print the status once and exit."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON status object (implies --once unless --wait)."),
        wait: bool = typer.Option(False, "--wait", help="Block until the run ends: exit 0 if completed, 1 if failed/cancelled/lost or a component stalled."),
        interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes."),
        timeout: Optional[float] = typer.Option(None, "--timeout", help="With --wait: give up after S seconds (exit 3)."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of reward, step times and lag over steps."),
        root: Optional[Path] = typer.Option(None, "--root", help="Output root to look up run names in (default: $RLCTL_OUTPUT_DIR, else --profile's shared filesystem, else ./runs)."),
        profile: Optional[str] = typer.Option(None, "--profile", help="Cluster profile whose shared filesystem is the output root."),
    ) -> None:
        """Show the state, progress and health of a run, or of a shared pool (live TUI by default)."""
        if not interval > 0:
            fail(f"--interval must be > 0 seconds, got {interval}")
        if timeout is not None and not timeout > 0:
            fail(f"--timeout must be > 0 seconds, got {timeout}")
        if plot is not None and plot.suffix.lower() != ".png":
            fail(f"--plot writes a PNG; the file name must end in .png, got {plot}")
        run_dir, pool = _resolve(run, root, profile)
        if pool:
            if wait or plot is not None:
                fail(f"{'--wait' if wait else '--plot'} follows a run; {run!r} is a shared pool, which serves until "
                     "`rlctl pool stop` (allowed: --once, --json)")
            return _pool(run_dir, once, as_json, interval)
        if wait:
            from rlctl.cli.follow import Detached, follow_or_detach

            try:
                summary = with_plan(follow_or_detach(run_dir, run_dir.name, quiet=as_json, interval=interval,
                                                     timeout=timeout), run_dir)
            except Detached as e:
                raise typer.Exit(e.code) from None
        elif once or as_json or plot is not None:
            summary, metrics = _snapshot(run_dir)
            if not as_json and (once or plot is None):
                from rich.console import Console

                from rlctl.cli.monitor_view import render_summary

                Console().print(render_summary(summary, metrics))
        else:
            summary = _live(run_dir, interval)
        if plot is not None:
            write_plot(run_dir, plot)
            if not as_json:
                typer.echo(f"wrote {plot}", err=True)
        if as_json:
            print_json(summary)
        if wait:
            if summary.get("timed_out"):
                raise typer.Exit(EXIT_TIMEOUT)
            from rlctl.cli.follow import end_report, exit_code

            if not as_json:  # as `launch --wait` ends: the reward, the last errors, the verdict
                typer.echo("\n".join(end_report(summary, run_dir / "logs" / "latest")))
            raise typer.Exit(exit_code(summary))
        if not (once or as_json or plot is not None):
            raise typer.Exit(_exit_code(summary["state"]))

    @app.command()
    @user_errors
    def runs(
        root: Optional[Path] = typer.Option(None, "--root", help="Output root (default: $RLCTL_OUTPUT_DIR, else --profile's shared filesystem, else ./runs)."),
        profile: Optional[str] = typer.Option(None, "--profile", help="Cluster profile whose shared filesystem is the output root."),
        as_json: bool = typer.Option(False, "--json", help="Print a JSON list."),
    ) -> None:
        """List the runs under an output root with their state and progress."""
        from rlctl.launchers.output_root import default_root
        from rlctl.launchers.run_summary import REWARD, by_step, series
        from rlctl.launchers.status import list_runs, run_state
        from rlctl.orchestrator.exchange.metrics import read_records

        base = root if root is not None else default_root(profile)
        if root is not None and not root.is_dir():
            fail(f"--root {root}: not a directory")
        rows = []
        for run_dir in list_runs(base):
            status = run_state(run_dir)
            metrics = read_records(run_dir)
            trainer, orch = by_step(metrics, "trainer"), by_step(metrics, "orchestrator")
            rewards = series(orch, REWARD)
            rows.append({
                "name": status.name, "run_dir": str(run_dir), "state": status.state, "scheduler": status.scheduler,
                "job_id": status.job_id, "attempt": status.attempt, "steps_done": len(trainer or orch),
                "max_steps": status.max_steps, "reward_mean": rewards[-1][1] if rewards else None,
                "reason": status.reason,
            })
        if as_json:
            print_json(rows)
            return
        from rich.console import Console
        from rich.table import Table

        from rlctl.cli.monitor_view import STATE_STYLE

        table = Table(title=f"runs under {base}", title_justify="left")
        for col in ("run", "state", "scheduler", "job", "attempt", "steps", "reward"):
            table.add_column(col)
        for r in rows:
            reward = "-" if r["reward_mean"] is None else f"{r['reward_mean']:.3g}"
            table.add_row(Path(r["run_dir"]).name, f"[{STATE_STYLE.get(r['state'], '')}]{r['state']}[/]", r["scheduler"],
                          r["job_id"] or "-", str(r["attempt"]), f"{r['steps_done']}/{r['max_steps'] or '?'}", reward)
        if not rows:
            typer.echo(f"no runs under {base}")
            return
        Console().print(table)
