"""`rlctl launch`, `rlctl cancel`, `rlctl logs`. Domain code is imported inside the commands."""
from __future__ import annotations

import sys
import time
from typing import List, Optional

import typer

from rlctl.cli.common import fail, print_json, user_errors

# Without --wait, launch looks for the allocation until this many seconds after it started, then returns.
ALLOCATION_PEEK_S = 1.0


def _group_rows(result, states: dict) -> list[dict]:
    rows = []
    for g in result.groups:
        st = states.get(g.het_index, {})
        rows.append({**g.manifest_entry(), "state": st.get("state", "PENDING" if result.job_id else None),
                     "nodelist": st.get("nodelist")})
    return rows


def _print_summary(result, rows: list[dict]) -> None:
    from rlctl.orchestrator.exchange.placement import describe_degrees

    typer.echo(f"run dir:  {result.run.root}")
    typer.echo(f"trainer degrees: {describe_degrees(result.extra.get('trainer_degrees'))}")
    if result.dry_run:
        rewind = result.extra.get("rewind")
        if rewind is not None:  # a resume's dry run writes nothing (launchers.launch.start_attempt)
            typer.echo(f"dry run, nothing written or started; attempt {result.attempt}: {rewind.describe()}")
        elif result.script:
            typer.echo(f"sbatch script (not submitted): {result.script}")
        else:
            typer.echo("dry run: configs written, nothing started")
        return
    if result.job_id:
        typer.echo(f"job id:   {result.job_id}  (attempt {result.attempt})")
    else:
        typer.echo(f"local supervisor pid: {result.supervisor_pid}  (attempt {result.attempt})")
    for r in rows:
        if result.job_id:
            where = f"het-group {r['het_index']}  {r['state'] or ''}  {r['nodelist'] or 'not allocated yet'}"
        else:
            where = "this host"
        typer.echo(f"  {r['name']:<13} {r['nodes']} node(s) x {r['ntasks_per_node']} task(s)  {where}")


def launch_cmd(
    recipes: List[str] = typer.Argument(..., help="Recipe TOML files (or built-in names), composed left to right."),
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="Cluster profile (name or YAML path); overrides cluster.profile."),
    override: List[str] = typer.Option([], "--override", "-o", help="key.path=value override (repeatable)."),
    name: Optional[str] = typer.Option(None, "--name", help="Run name (default: <recipe name>-<timestamp>)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the run dir, configs and the sbatch script; submit nothing."),
    wait: bool = typer.Option(False, "--wait", help="Follow the job until it ends; exit non-zero if it failed."),
    resume: bool = typer.Option(False, "--resume", help="With --name of an existing run: its next attempt, exactly as `rlctl resume` (refused while it runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Submit a recipe: one heterogeneous Slurm job (or local processes with --cluster local)."""
    started = time.monotonic()
    from rlctl.launchers.launch import RunExists, launch
    from rlctl.recipes.errors import RecipeError

    if resume and not name:
        raise RecipeError("--resume needs the run name (--name) of the run to continue", key="--resume")
    try:
        result = launch(recipes, override, cluster=cluster, name=name, dry_run=dry_run)
    except RunExists as existing:
        if not resume:
            raise
        from rlctl.launchers.resume import resume as resume_run

        result, plan = resume_run(existing.run, refs=recipes, overrides=override, cluster=cluster, dry_run=dry_run,
                                  command=f"rlctl launch --name {name} --resume")
        result.extra["rewind"] = plan
    states: dict = {}
    if result.job_id:
        from rlctl.launchers.slurm_state import component_states

        while True:
            states = component_states(result.job_id)
            allocated = bool(states) and all(s.get("nodelist") for s in states.values())
            if allocated or time.monotonic() - started > ALLOCATION_PEEK_S:
                break
            time.sleep(0.2)
    rows = _group_rows(result, states)
    rewind = result.extra.get("rewind")  # --resume of an existing run
    submission = None
    if as_json:
        submission = {"run_dir": str(result.run.root), "name": result.name, "scheduler": result.scheduler,
                      "job_id": result.job_id, "attempt": result.attempt, "dry_run": result.dry_run,
                      "script": str(result.script) if result.script else None,
                      "supervisor_pid": result.supervisor_pid, "groups": rows,
                      "trainer_degrees": result.extra.get("trainer_degrees"),
                      **({"rewind": rewind.to_dict()} if rewind else {})}
    else:
        if rewind and not dry_run:
            typer.echo(rewind.describe())
        _print_summary(result, rows)
    if wait and not dry_run:
        raise typer.Exit(follow_run(result, submission))
    if submission is not None:
        print_json(submission)


def follow_run(result, submission: dict | None) -> int:
    """--wait of `launch` and `resume`: follow the started attempt with progress until it ends (or a
    component stalls); its exit code. With --json (`submission`: what the command would print without
    --wait) stdout gets one JSON object at the end: the submission with the run's `final` status (null
    when the following was stopped) and the `exit_code`; two documents would break a parser."""
    from rlctl.cli.follow import Detached, end_report, exit_code, follow_or_detach

    sys.stdout.flush()  # the summary must reach a pipe before --wait blocks
    final = None
    try:
        final = follow_or_detach(result.run.root, result.name, quiet=submission is not None,
                                 interval=2.0 if result.job_id else 0.5)
        code = exit_code(final)
    except Detached as e:
        code = e.code
    if submission is not None:
        print_json({**submission, "final": final, "exit_code": code})
    elif final is not None:
        typer.echo("\n".join(end_report(final, result.run.logs / "latest")))
    return code


def cancel_cmd(run: str = typer.Argument(..., help="Run directory or run name."),
               timeout: float = typer.Option(60.0, help="Seconds to wait until everything has stopped.")) -> None:
    """Stop a run: scancel its het job, or stop the local supervisor and all its processes."""
    from rlctl.launchers.control import cancel_run
    from rlctl.launchers.status import resolve_run
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.errors import RecipeError

    if not timeout >= 0:  # nan too
        raise RecipeError(f"must be >= 0 seconds (got {timeout})", key="--timeout")
    msg = cancel_run(RunDir(resolve_run(run)), timeout)
    typer.echo(msg)


def logs_cmd(run: str = typer.Argument(..., help="Run directory or run name."),
             group: Optional[str] = typer.Argument(None, help="orchestrator | inference | trainer | job"),
             follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the run ends."),
             attempt: Optional[int] = typer.Option(None, help="Attempt number (default: latest).")) -> None:
    """Print the logs of a run (per component), optionally following them."""
    from rlctl.launchers.control import follow_logs, log_files, run_active
    from rlctl.launchers.status import resolve_run
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.errors import RecipeError

    if attempt is not None and attempt < 0:
        raise RecipeError(f"must be >= 0 (got {attempt})", key="--attempt")
    rd = RunDir(resolve_run(run))
    files = log_files(rd, group, attempt)
    if not files:
        where = f"{rd.root}/logs" + (f" (attempt {attempt})" if attempt is not None else "")
        fail(f"no logs yet for {group or 'any group'} in {where}")
    if not follow:
        for path in files:
            typer.echo(f"==> {path.relative_to(rd.root)} <==")
            text = path.read_text(errors="replace")
            sys.stdout.write(text if not text or text.endswith("\n") else text + "\n")  # next header on a line of its own
        return
    follow_logs(rd, group, attempt, lambda: run_active(rd))


def register(app: typer.Typer) -> None:
    app.command("launch")(user_errors(launch_cmd))
    app.command("cancel")(user_errors(cancel_cmd))
    app.command("logs")(user_errors(logs_cmd))
