"""`rlctl launch`, `rlctl cancel`, `rlctl logs`. Domain code is imported inside the commands."""
from __future__ import annotations

import json
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
    typer.echo(f"run dir:  {result.run.root}")
    if result.dry_run:
        if result.script:
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


def _wait_slurm(result, as_json: bool, progress: _Progress) -> int:
    from rlctl.launchers.hetjob import component_states, job_finished

    last = None
    while True:
        states = component_states(result.job_id)
        view = {k: (v["state"], v["nodelist"]) for k, v in states.items()}
        if view != last and not as_json:
            progress.break_line()
            typer.echo(time.strftime("%H:%M:%S ") + "  ".join(
                f"{g.name}={states.get(g.het_index, {}).get('state', '?')}" for g in result.groups), err=True)
            last = view
        progress.update()
        if job_finished(states):
            bad = {k: v["state"] for k, v in states.items() if v["state"] != "COMPLETED"}
            return 1 if bad else 0
        time.sleep(1.0)


class _Progress:
    """Steps, reward and ETA on stderr while --wait follows a run: one rewritten line on a terminal,
    a new line only when something changed in logs and pipes."""

    def __init__(self, run_root, enabled: bool):
        self.run_root, self.enabled = run_root, enabled
        self.tty = sys.stderr.isatty()
        self.last_line, self.last_time = None, 0.0
        self.summary: dict | None = None

    def update(self, force: bool = False) -> None:
        if not self.enabled or (not force and time.monotonic() - self.last_time < 2.0):
            return
        from rlctl.cli.monitor_view import progress_line
        from rlctl.launchers.run_summary import summarize
        from rlctl.orchestrator.exchange.metrics import read_records
        from rlctl.launchers.status import run_state

        self.last_time = time.monotonic()
        try:
            self.summary = summarize(run_state(self.run_root), read_records(self.run_root))
        except (OSError, ValueError):
            return  # a half-written status file; the next poll reads it whole
        line = progress_line(self.summary)
        if line != self.last_line:
            sys.stderr.write(("\r\033[K" + line) if self.tty else line + "\n")
            sys.stderr.flush()
            self.last_line = line

    def break_line(self) -> None:
        """End the rewritten terminal line before other output is printed."""
        if self.enabled and self.tty and self.last_line is not None:
            sys.stderr.write("\n")
            self.last_line = None

    close = break_line


def _wait_local(result, progress: _Progress) -> int:
    from rlctl.launchers.local import status_dir
    from rlctl.launchers.status import pid_alive

    path = status_dir(result.run) / "supervisor.json"

    def read() -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    while True:
        st = read()
        if st.get("pid") and not pid_alive(st["pid"], st.get("started")):
            st = read()  # it may have written its end just before exiting
            if st.get("state") not in ("exited", "cancelled"):
                progress.update(force=True)
                return 1  # killed before it could write its end
        if st.get("state") in ("exited", "cancelled"):
            return int(st.get("returncode") or 0)
        progress.update()
        time.sleep(0.5)


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
        from rlctl.launchers.hetjob import component_states

        while True:
            states = component_states(result.job_id)
            allocated = bool(states) and all(s.get("nodelist") for s in states.values())
            if allocated or time.monotonic() - started > ALLOCATION_PEEK_S:
                break
            time.sleep(0.2)
    rows = _group_rows(result, states)
    rewind = result.extra.get("rewind")  # --resume of an existing run
    if as_json:
        print_json({"run_dir": str(result.run.root), "name": result.name, "scheduler": result.scheduler,
                    "job_id": result.job_id, "attempt": result.attempt, "dry_run": result.dry_run,
                    "script": str(result.script) if result.script else None,
                    "supervisor_pid": result.supervisor_pid, "groups": rows,
                    **({"rewind": rewind.to_dict()} if rewind else {})})
    else:
        if rewind and not dry_run:
            typer.echo(rewind.describe())
        _print_summary(result, rows)
    sys.stdout.flush()  # the summary must reach a pipe before --wait blocks
    if wait and not dry_run:
        raise typer.Exit(follow_run(result, as_json))


def follow_run(result, as_json: bool) -> int:
    """--wait of `launch` and `resume`: follow the started attempt with progress until it ends; its exit code."""
    progress = _Progress(result.run.root, enabled=not as_json)
    rc = _wait_slurm(result, as_json, progress) if result.job_id else _wait_local(result, progress)
    progress.update(force=True)
    progress.close()
    if not as_json:
        final = progress.summary or {}
        if final.get("reward_mean") is not None:
            typer.echo(f"final reward mean {final['reward_mean']:.3f} (first {final['reward_first']:.3f}) "
                       f"after {final['steps_done']} step(s)")
        typer.echo(f"run {'finished' if rc == 0 else 'FAILED'} (exit code {rc}); logs: {result.run.logs / 'latest'}")
    return rc


def cancel_cmd(run: str = typer.Argument(..., help="Run directory or run name."),
               timeout: float = typer.Option(60.0, help="Seconds to wait until everything has stopped.")) -> None:
    """Stop a run: scancel its het job, or stop the local supervisor and all its processes."""
    from rlctl.launchers.control import cancel_run
    from rlctl.launchers.status import resolve_run
    from rlctl.orchestrator.exchange.layout import RunDir

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

    rd = RunDir(resolve_run(run))
    files = log_files(rd, group, attempt)
    if not files:
        fail(f"no logs yet for {group or 'any group'} in {rd.root}/logs")
    if not follow:
        for path in files:
            typer.echo(f"==> {path.relative_to(rd.root)} <==")
            sys.stdout.write(path.read_text(errors="replace"))
        return
    follow_logs(rd, group, attempt, lambda: run_active(rd))


def register(app: typer.Typer) -> None:
    app.command("launch")(user_errors(launch_cmd))
    app.command("cancel")(user_errors(cancel_cmd))
    app.command("logs")(user_errors(logs_cmd))
