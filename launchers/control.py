"""Acting on a launched run: cancel it, find and follow its logs, tell whether it still runs."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.recipes.errors import RecipeError

LOG_GROUPS = ("orchestrator", "inference", "trainer", "job")


def _supervisor(run: RunDir) -> dict:
    try:
        return json.loads((run.status / "supervisor.json").read_text())
    except (OSError, ValueError):
        return {}


def _is_our_supervisor(pid: int, run: RunDir) -> bool:
    """Guard against a recycled pid: the process must be this run's supervisor."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"rlctl.launchers.local" in cmdline and str(run.root).encode() in cmdline


def run_active(run: RunDir) -> bool:
    """Whether the run is pending or running: the same check as `rlctl monitor` (status.run_state)."""
    from rlctl.launchers.status import run_state

    return run_state(run.root).state in ("pending", "running")


def cancel_run(run: RunDir, timeout: float = 60.0, kind: str = "run") -> str:
    """Under the run's lock: a resume or launch in progress makes this fail naming it (RunLocked),
    instead of finding nothing running while that attempt starts. `kind` (run, pool) names it in the answer."""
    from rlctl.launchers.run_dirs import run_lock

    with run_lock(run, f"rlctl cancel {run.root.name}"):
        return _cancel(run, timeout, kind)


def _cancel(run: RunDir, timeout: float, kind: str) -> str:
    info = run.read_manifest()
    if info.get("scheduler") == "slurm":
        job = info.get("job_id")
        if not job:
            raise RecipeError(f"{kind} {run.root.name} has no job id (dry run?): nothing to cancel")
        from rlctl.launchers.slurm_state import component_states, job_finished
        from rlctl.launchers.het_script import strip_slurm_env

        def summary(states: dict) -> str:
            return ", ".join(f"+{k} {v['state']}" for k, v in sorted(states.items()))

        before = component_states(job)
        if before and job_finished(before):  # scancel of an ended job succeeds and does nothing
            return f"{kind} {run.root.name} is not running (job {job} already ended: {summary(before)})"
        env = {k: v for k, v in os.environ.items() if k not in strip_slurm_env(dict(os.environ))}
        out = subprocess.run(["scancel", str(job)], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RecipeError(f"scancel {job} failed: {out.stderr.strip()}")
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = component_states(job)
            if not states or job_finished(states):
                return f"cancelled job {job} ({summary(states)})"
            time.sleep(0.5)
        return f"scancel sent to job {job}; it has not ended after {timeout:g}s"
    sup = _supervisor(run)
    pid = sup.get("pid") or info.get("supervisor_pid")
    if sup.get("state") in ("exited", "cancelled") or not pid or not _is_our_supervisor(int(pid), run):
        return f"{kind} {run.root.name} is not running (supervisor state: {sup.get('state', 'unknown')})"
    os.kill(int(pid), signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and _is_our_supervisor(int(pid), run):
        time.sleep(0.2)
    if _is_our_supervisor(int(pid), run):
        return f"sent SIGTERM to supervisor {pid}; still running after {timeout:g}s"
    return f"cancelled local {kind} {run.root.name} (supervisor {pid} stopped every task)"


def _attempt_dir(run: RunDir, attempt: int | None) -> Path:
    if attempt is not None:
        return run.attempt_logs(attempt)
    latest = run.logs / "latest"
    return latest.resolve() if latest.exists() else run.attempt_logs(int(run.read_manifest().get("attempt", 0)))


def _natural(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def log_files(run: RunDir, group: str | None, attempt: int | None = None) -> list[Path]:
    if group is not None and group not in LOG_GROUPS:
        raise RecipeError(f"unknown group {group!r} (allowed: {', '.join(LOG_GROUPS)})", key="GROUP")
    base = _attempt_dir(run, attempt)
    job_logs = sorted(base.glob("slurm-*.out")) + sorted(base.glob("supervisor.log"))
    if group == "job":
        return job_logs
    groups = [group] if group else ["orchestrator", "inference", "trainer"]
    comp = [p for g in groups for p in sorted((base / g).glob("*.log"), key=_natural)]
    return comp if group else job_logs + comp


def follow_logs(run: RunDir, group: str | None, attempt: int | None, active: Callable[[], bool],
                poll_s: float = 0.5, write=None) -> None:
    """Print new lines of every matching log (prefixed by its name) until the run is no longer active."""
    write = write or sys.stdout.write
    offsets: dict[Path, int] = {}
    finishing = False
    while True:
        for path in log_files(run, group, attempt):
            pos = offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            if not chunk:
                continue
            cut = chunk.rfind(b"\n") + 1 if not finishing else len(chunk)
            if cut == 0:
                continue
            offsets[path] = pos + cut
            tag = path.stem
            for line in chunk[:cut].decode(errors="replace").splitlines():
                write(f"[{tag}] {line}\n")
        sys.stdout.flush()
        if finishing:
            return
        if not active():
            finishing = True  # one last pass for lines written at the very end
            continue
        time.sleep(poll_s)
