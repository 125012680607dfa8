"""The state of a run: run.json + Slurm accounting (sacct/squeue) or the local launcher's status files.

`run_state(run_dir)` never raises for a run that exists: when the scheduler cannot be asked, the state
is `unknown` and `reason` says why. Every Slurm call is bounded by a timeout.

Overall states: pending | running | completed | failed | cancelled | lost | unknown.
`completed` means the orchestrator finished cleanly: the job (or local supervisor) exited 0 and
`<run>/DONE` exists. `lost` means the record says running but the process is gone (local launcher).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlctl.launchers.output_root import default_root
from rlctl.orchestrator.exchange.layout import POOLS_DIR
from rlctl.orchestrator.exchange.procstat import HAVE_PROC, start_epoch
from rlctl.recipes.errors import RecipeError

# "dry-run": `launch --dry-run` wrote the run directory and started nothing (`rlctl resume` starts it);
# nothing of it runs, so it ends a `--wait` and holds no lock, like the states of a run that ended.
DRY_RUN = "dry-run"
ENDED = ("completed", "failed", "cancelled", "lost", DRY_RUN)
# Slurm end states that are not the run's own failure, as the run's reason
SLURM_ENDS = {"PREEMPTED": "preempted and not requeued",
              "TIMEOUT": "the time limit was reached (deployment.time_limit)", "NODE_FAIL": "a node failed",
              "OUT_OF_MEMORY": "a task ran out of memory (deployment.<group>.mem_gib)"}
DEFAULT_STALL_TIMEOUT_S = 1800.0  # monitoring.stall_timeout_s when the manifest has none
# A supervisor ended by these signals (or exit codes 128+sig) was cancelled, not failed.
CANCEL_CODES = {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}


@dataclass
class ComponentStatus:
    """One job component (Slurm het component) or one local process."""

    name: str
    """`trainer`, `inference`, `orchestrator` (Slurm) or `group.component.rank` (local)."""
    group: str
    state: str
    nodes: str = ""
    """Slurm node list, or the host of a local process."""
    restarts: int = 0
    exit_code: str | None = None
    pid: int | None = None
    started: str | None = None
    ended: str | None = None


@dataclass
class RunStatus:
    state: str
    run_dir: str
    name: str
    scheduler: str
    job_id: str | None = None
    attempt: int = 0
    max_steps: int | None = None
    reason: str = ""
    components: list[ComponentStatus] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    done: bool = False
    exit_code: int | None = None
    """Exit code of the local supervisor once it exited (None on Slurm or while it runs)."""
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    """The recipe's `monitoring.stall_timeout_s`."""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------- run refs


class RunNotFound(RecipeError, ValueError):
    """A run reference that names no run directory, or more than one (bad user input: exit 2)."""


class BrokenRun(RecipeError, ValueError):
    """A run directory whose run.json is not a manifest (bad user input: exit 2). Not a RunNotFound:
    the run was found, and no lookup elsewhere (pools) should hide what is wrong with it."""


def load_manifest(run_dir: Path | str) -> tuple[dict | None, str]:
    """(`run_dir/run.json` as a dict, "") or (None, why not): unreadable, not JSON, not a JSON object.
    rlctl writes it atomically, so a bad one was edited or damaged; every reader takes it for an object."""
    try:
        data = json.loads((Path(run_dir) / "run.json").read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8, a huge integer
        return None, f"cannot read run.json: {str(e)[:100]}"
    if not isinstance(data, dict):
        return None, f"run.json is not a JSON object (it holds a {type(data).__name__})"
    return data, ""


def _is_run(path: Path) -> bool:
    try:
        return (path / "run.json").is_file()
    except OSError:  # another user's private run directory
        return False


def _mine(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def resolve_run(ref: str, root: Path | str | None = None, kind: str = "run") -> Path:
    """The one way every command finds a run: a run directory path; else a run name under `root`
    (default: `default_root()`); else the one run of ours named `<ref>-*` there. Never another
    user's run by name, never a guess among several: both are one-line errors (RunNotFound). A run found
    whose run.json is no manifest is BrokenRun (`kind`, run or pool, names it in the message)."""
    path = Path(ref).expanduser()
    if _is_run(path):
        return usable_run(path, ref, kind)
    base = Path(root) if root is not None else default_root()
    hint = "pass the run directory, or a run name (see `rlctl runs`)"
    if "/" in ref or not ref or ref.startswith("."):
        raise RunNotFound(f"run {ref!r}: no run.json at {path}; {hint}")
    candidate = base / ref
    if _is_run(candidate) or candidate.is_dir():
        if not _mine(candidate):
            raise RunNotFound(f"run {ref!r} under {base} belongs to another user; pass its path to use it anyway")
        if _is_run(candidate):
            return usable_run(candidate, ref, kind)
    named = [d for d in list_runs(base) if d.name.startswith(f"{ref}-")]
    if len(named) == 1:
        return usable_run(named[0], ref, kind)
    if named:
        shown = ", ".join(d.name for d in named[-5:]) + (" ..." if len(named) > 5 else "")
        raise RunNotFound(f"run {ref!r} is ambiguous under {base}: {len(named)} runs match ({shown}); "
                          "pass the full run name")
    if kind == "run" and _is_run(base / POOLS_DIR / ref):
        raise RunNotFound(f"{ref!r} is a shared pool ({base / POOLS_DIR / ref}), not a run: `rlctl pool stop {ref}` "
                          f"stops it, `rlctl monitor {ref}` shows it")
    raise RunNotFound(f"run {ref!r}: no run.json at {path} or under {base}; {hint}")


def usable_run(path: Path, ref: str, kind: str = "run") -> Path:
    """`path`, absolute, if its run.json is a manifest; else BrokenRun naming `ref` as a `kind` (run, pool)."""
    _, problem = load_manifest(path)
    if problem:
        raise BrokenRun(f"{kind} {ref!r}: {path} is not a {kind} directory ({problem})")
    return path.absolute()


def list_runs(root: Path | str) -> list[Path]:
    """The runs of the current user under `root` (others' runs in a shared root are not listed)."""
    root = Path(root)
    try:
        entries = list(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []
    return sorted((d for d in entries if _mine(d) and _is_run(d)), key=lambda d: d.name)


# ------------------------------------------------------------------------------------------- state


def run_state(run_dir: Path | str, manifest: dict | None = None) -> RunStatus:
    """The run's state; `manifest`: its run.json as the caller already read it (read here when None)."""
    run_dir, problem = Path(run_dir), ""
    if manifest is None:
        manifest, problem = load_manifest(run_dir)
    if manifest is None:
        return RunStatus("unknown", str(run_dir), run_dir.name, "unknown", reason=problem)
    recipe = manifest.get("recipe") or {}
    status = RunStatus(
        state="unknown",
        run_dir=str(run_dir),
        name=manifest.get("name") or run_dir.name,
        scheduler=manifest.get("scheduler", "local"),
        job_id=manifest.get("job_id"),
        attempt=int(manifest.get("attempt") or 0),  # the first attempt is 0 (logs/attempt_0)
        max_steps=(recipe.get("orchestrator") or {}).get("max_steps"),
        plan=manifest.get("plan") or {},
        done=(run_dir / "DONE").exists(),
        stall_timeout_s=float((recipe.get("monitoring") or {}).get("stall_timeout_s") or DEFAULT_STALL_TIMEOUT_S),
    )
    if manifest.get("dry_run"):
        status.state, status.reason = DRY_RUN, f"nothing was started (`rlctl resume {status.name}` starts it)"
    elif status.scheduler == "slurm":
        _slurm_state(status, manifest.get("groups") or [])
    else:
        _local_state(status, run_dir / "status")
        order = {g.get("name"): i for i, g in enumerate(manifest.get("groups") or [])}
        status.components.sort(key=lambda c: (order.get(c.group, len(order)), c.name))
    return status


# ------------------------------------------------------------------------------------------- local


def read_json_record(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # being replaced right now, or vanished: the next poll sees it
    return data if isinstance(data, dict) else None


def epoch(value) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        from datetime import datetime

        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def pid_alive(pid: int | None, started=None) -> bool:
    """Whether `pid` runs and (when `started` is known) is the process that started then."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    if HAVE_PROC:
        began = start_epoch(pid)
        if began is None:
            return False
        since = epoch(started)
        # The pid was recycled if its process began well after the record says it started.
        return since is None or began <= since + 5.0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _local_process_state(record: dict, here: str) -> str:
    state = record.get("state", "unknown")
    if state in ("starting", "running"):
        if state == "starting" and record.get("pid") is None:
            return state  # the launcher is spawning it this instant; the pid follows
        host = record.get("host")
        if host and host not in (here, "localhost", "127.0.0.1"):
            return state  # cannot check a pid on another host; trust the record
        return state if pid_alive(record.get("pid"), record.get("started")) else "lost"
    if state == "exited":
        rc = record.get("returncode")
        if rc == 0:
            return "completed"
        return "cancelled" if rc in CANCEL_CODES else "failed"
    return state if state in ("cancelled", "failed", "completed") else "unknown"


def _local_state(status: RunStatus, folder: Path) -> None:
    here = socket.gethostname()
    supervisor = read_json_record(folder / "supervisor.json")
    sup_state = _local_process_state(supervisor, here) if supervisor is not None else None
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name == "supervisor.json":
            continue
        record = read_json_record(path)
        if record is None:
            continue
        parts = path.stem.split(".")
        state = _local_process_state(record, here)
        if state == "lost" and sup_state in ("starting", "running"):
            state = record["state"]  # exited a moment ago: its live supervisor records how within its next poll
        status.components.append(ComponentStatus(
            name=path.stem, group=parts[0], state=state,
            nodes=record.get("host") or "", restarts=int(record.get("restarts") or 0),
            exit_code=None if record.get("returncode") is None else str(record["returncode"]),
            pid=record.get("pid"), started=_fmt_time(record.get("started")), ended=_fmt_time(record.get("ended")),
        ))
    if supervisor is None:
        status.state, status.reason = ("pending", "launcher starting") if not status.components else ("unknown", "no supervisor status")
        if not folder.is_dir():
            status.state, status.reason = "unknown", f"no status files in {folder}"
        return
    if isinstance(supervisor.get("returncode"), int):
        status.exit_code = supervisor["returncode"]
    if sup_state in ("starting", "running"):
        # pending until a task runs; once one ran, the run is running until its supervisor ends (at the end
        # every task has exited a moment before it does: that is not "pending" again)
        status.state = "pending" if all(c.state == "starting" for c in status.components) else "running"
    elif sup_state == "completed":
        status.state = "completed" if status.done else "failed"
        if not status.done:
            status.reason = "launcher exited 0 but the orchestrator wrote no DONE marker"
    else:
        status.state = sup_state
        if sup_state == "lost":
            status.reason = f"launcher process {supervisor.get('pid')} is gone but its status says {supervisor.get('state')}"
        elif sup_state == "failed":
            status.reason = f"launcher exited with code {supervisor.get('returncode')}"
    _explain_failure(status)


def _fmt_time(value) -> str | None:
    when = epoch(value)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(when)) if when is not None else (str(value) if value else None)


def _explain_failure(status: RunStatus) -> None:
    bad = [c for c in status.components if c.state in ("failed", "lost")]
    if status.state in ("failed", "lost") and bad:
        names = ", ".join(f"{c.name} ({c.state}{'' if c.exit_code is None else ', exit ' + c.exit_code})" for c in bad)
        status.reason = (status.reason + "; " if status.reason else "") + f"failed components: {names}"


# ------------------------------------------------------------------------------------------- slurm


def _slurm_state(status: RunStatus, groups: list[dict]) -> None:
    from rlctl.launchers.slurm_state import read_job

    if not status.job_id:
        status.state, status.reason = "pending", "not submitted yet (no job_id in run.json)"
        return
    job = str(status.job_id)
    comps, why = read_job(job)
    if comps is None:
        status.reason = why
        return
    # Several groups can share one het component (an orchestrator beside inference): each gets a row.
    members: dict[int, list[str]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g.get("het_index", i)), []).append(g.get("name", f"group{i}"))
    het = len(set(members) | set(comps)) > 1
    for index in sorted(set(members) | set(comps)):
        c = comps.get(index, {"ours": "unknown", "state": "UNKNOWN"})
        for group in members.get(index, [f"component{index}"]):
            status.components.append(ComponentStatus(
                name=f"{group} ({job}+{index})" if het else group, group=group, state=c["ours"],
                nodes=c.get("nodelist") or "", restarts=c.get("restarts", 0), exit_code=c.get("exit_code"),
                started=c.get("start"), ended=c.get("end"),
            ))
    states = [c.state for c in status.components]
    if not comps:
        status.reason = f"Slurm does not know job {job} ({why})"
    elif "running" in states:
        status.state = "running"
    elif "pending" in states:
        status.state = "pending"
        status.reason = ", ".join(sorted({c["reason"] for c in comps.values() if c.get("reason")}))
    elif "unknown" in states:
        status.reason = "Slurm reports a state rlctl does not know"
    elif "cancelled" in states:
        status.state = "cancelled"
    elif "failed" in states:
        status.state = "failed"
        raw = {c["state"] for c in comps.values()}
        why = [text for state, text in SLURM_ENDS.items() if state in raw]
        if why:  # not the run's own failure: Slurm ended it
            status.reason = f"{'; '.join(why)} (`rlctl resume {status.name}` continues from the newest checkpoint)"
        _explain_failure(status)
    elif status.done:
        status.state = "completed"
    else:
        status.state, status.reason = "failed", "job completed but the orchestrator wrote no DONE marker"
