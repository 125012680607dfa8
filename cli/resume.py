"""`rlctl resume RUN`: continue a stopped run from its newest complete checkpoint (a new attempt)."""
from __future__ import annotations

from typing import Optional

import typer

from rlctl.cli.common import print_json, user_errors


def resume_cmd(
    run: str = typer.Argument(..., help="Run directory or run name."),
    step: Optional[int] = typer.Option(None, "--step", help="Resume from checkpoints/step_N (default: the newest complete one)."),
    source: Optional[str] = typer.Option(None, "--from", help="Start from another run's checkpoint: OTHER_RUN/checkpoints/step_N (OTHER_RUN: a run directory or name)."),
    wait: bool = typer.Option(False, "--wait", help="Follow the new attempt until it ends; exit non-zero if it failed."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Start the next attempt of a run that is no longer running, from its newest complete checkpoint:
    newer rollouts, weights and metrics lines are removed so step numbers stay contiguous."""
    from rlctl.cli.launch import follow_run
    from rlctl.launchers.resume import resume
    from rlctl.launchers.status import resolve_run
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.errors import RecipeError

    if step is not None and source is not None:
        raise RecipeError("--step and --from exclude each other (--from names its step)", key="--step")
    if step is not None and step < 0:
        raise RecipeError(f"must be >= 0 (got {step})", key="--step")
    rd = RunDir(resolve_run(run))
    result, plan = resume(rd, step, _checkpoint_source(source) if source else None)
    submission = None
    if as_json:
        submission = {"run_dir": str(result.run.root), "attempt": result.attempt, "scheduler": result.scheduler,
                      "job_id": result.job_id, "supervisor_pid": result.supervisor_pid, **plan.to_dict()}
    else:
        typer.echo(plan.describe())
        who = f"job {result.job_id}" if result.job_id else f"local supervisor pid {result.supervisor_pid}"
        typer.echo(f"attempt {result.attempt} started: {who}; logs: {result.run.logs / 'latest'}")
    if wait:
        raise typer.Exit(follow_run(result, submission))
    if submission is not None:
        print_json(submission)


def register(app: typer.Typer) -> None:
    app.command("resume")(user_errors(resume_cmd))


def _checkpoint_source(source: str):
    """`--from` as a path; where no such path exists, `NAME/checkpoints/step_N` with NAME a run name, found
    as RUN is (under the output root)."""
    from pathlib import Path

    from rlctl.launchers.status import resolve_run

    path, parts = Path(source).expanduser(), Path(source).parts
    if not path.exists() and len(parts) == 3 and parts[1] == "checkpoints":
        return resolve_run(parts[0]) / "checkpoints" / parts[2]
    return path
