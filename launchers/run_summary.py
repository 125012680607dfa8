"""What `rlctl monitor` shows besides process states: metric series, medians, ETA, idle fractions,
the plan's predictions, stalled components (heartbeats) and the last error lines of the component
logs. Pure data, no rich."""
from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from rlctl.launchers.status import RunStatus, epoch
from rlctl.orchestrator.exchange.heartbeat import Beat, stalled_for
from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord as Orch
from rlctl.orchestrator.exchange.metrics import TrainerStepRecord as Trainer
from rlctl.orchestrator.exchange.metrics import keys_of

WINDOW = 20  # recent steps that medians, idle fractions and the ETA are computed over
ERROR_RE = re.compile(r"error|traceback|killed|out of memory", re.IGNORECASE)
# What an inference wrapper prints before it stops its server (inference/__main__.py): what the
# server logs after that (vLLM's EngineDeadError as its engine goes away) is shutdown, not failure.
SHUTDOWN_RE = re.compile(r"rlctl\.inference\[\d+\]: (run finished|stop requested), stopping the server")
TRAINER_STEP_S, WAIT_BATCH_S = keys_of(Trainer, "trainer_step_time_s", "wait_batch_s")
ORCH_STEP_S, WAIT_POLICY_S, REWARD = keys_of(Orch, "orchestrator_step_time_s", "wait_policy_s", "reward_mean")
MEASURED_KEYS = {
    "trainer": keys_of(Trainer, TRAINER_STEP_S, WAIT_BATCH_S, "weight_publish_s"),
    "orchestrator": keys_of(Orch, ORCH_STEP_S, WAIT_POLICY_S, "rollouts_per_s", "tokens_per_s",
                            "off_policy_lag_mean", "weight_reload_s"),
}


def by_step(metrics: list[dict], component: str) -> list[dict]:
    """The records of one component, one per step (the last one wins), ordered by step."""
    latest: dict[int, dict] = {}
    for record in metrics:
        if record.get("component") == component and isinstance(record.get("step"), int):
            latest[record["step"]] = record
    return [latest[s] for s in sorted(latest)]


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]


def _median(records: list[dict], key: str) -> float | None:
    values = [v for _, v in series(records[-WINDOW:], key)]
    return statistics.median(values) if values else None


def _idle(records: list[dict], wait_key: str, step_key: str) -> float | None:
    pairs = [(r[wait_key], r[step_key]) for r in records[-WINDOW:]
             if isinstance(r.get(wait_key), (int, float)) and isinstance(r.get(step_key), (int, float))]
    total = sum(s for _, s in pairs)
    return min(1.0, max(0.0, sum(w for w, _ in pairs) / total)) if total > 0 else None


def predicted_times(plan: dict) -> dict[str, float]:
    """Numeric `*step_time*` entries of the plan summary (top level or one section down)."""
    out: dict[str, float] = {}
    for key, value in (plan or {}).items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if "step_time" in sub and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(sub if sub.startswith(key) else f"{key}_{sub}", float(v))
        elif "step_time" in key and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def _eta(trainer: list[dict], steps_done: int, max_steps: int | None) -> float | None:
    if not max_steps or steps_done >= max_steps:
        return 0.0 if max_steps else None
    times = [r["time"] for r in trainer[-WINDOW:] if isinstance(r.get("time"), (int, float))]
    if len(times) >= 2:
        per_step = (times[-1] - times[0]) / (len(times) - 1)
    else:
        per_step = _median(trainer, TRAINER_STEP_S)
    return None if per_step is None else per_step * (max_steps - steps_done)


def _before_shutdown(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        if SHUTDOWN_RE.search(line):
            return lines[:i + 1]
    return lines


def log_errors(run_dir: Path | str, attempt: int | None = None, limit: int = 8, per_file: int = 3,
               completed: bool = False) -> list[dict]:
    """The last error-looking lines of every component log of the latest attempt. For a `completed`
    run, what a log holds after its component was told to stop is shutdown noise and left out."""
    logs = Path(run_dir) / "logs"
    folder = logs / "latest"
    if not folder.is_dir() and attempt is not None:
        folder = logs / f"attempt_{attempt}"
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.rglob("*.log"), key=lambda p: p.stat().st_mtime if p.exists() else 0):
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 65536))  # only the tail: logs of long runs are large
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        if completed:
            lines = _before_shutdown(lines)
        hits = [line.strip() for line in lines if ERROR_RE.search(line)]
        found.extend({"file": str(path.relative_to(folder)), "line": line[:300]} for line in hits[-per_file:])
    return found[-limit:]


def health(status: RunStatus, beats: list[Beat], now: float | None = None) -> list[dict]:
    """One row per heartbeat: progress, what it waits on, and whether it is stalled. Stalls are only
    judged while the run runs, and the clock of a component starts no earlier than its process."""
    now = time.time() if now is None else now
    rows = []
    for beat in beats:
        group = [c for c in status.components if c.group == beat.group]
        live = status.state == "running" and (not group or any(c.state == "running" for c in group))
        started = max((e for e in (epoch(c.started) for c in group) if e is not None), default=None)
        stalled = stalled_for(beat, status.stall_timeout_s, now, started) if live else None
        rows.append({"component": beat.component, "group": beat.group, "progress": beat.progress,
                     "waiting_for": beat.waiting_for, "since_progress_s": round(now - beat.progress_time, 1),
                     "stalled": stalled is not None, "stalled_s": None if stalled is None else round(stalled)})
    return rows


def stall_message(summary: dict) -> str | None:
    """One line naming the stalled components, or None."""
    rows = [h for h in summary.get("heartbeats", []) if h["stalled"]]
    if not rows:
        return None
    names = ", ".join(f"{h['component']} (no progress for {h['stalled_s']:.0f} s)" for h in rows)
    return f"stalled: {names}; monitoring.stall_timeout_s = {summary['stall_timeout_s']:g}"


def summarize(status: RunStatus, metrics: list[dict], errors: list[dict] | None = None,
              beats: list[Beat] | None = None) -> dict:
    """The `rlctl monitor --once --json` object."""
    trainer, orch = by_step(metrics, "trainer"), by_step(metrics, "orchestrator")
    rewards = series(orch, REWARD)
    beat_rows = health(status, beats or [])
    stalled_groups = {h["group"] for h in beat_rows if h["stalled"]}
    last = trainer or orch
    steps_done = len(trainer) if trainer else len(orch)
    measured = {key: _median(recs, key) for recs, keys in ((trainer, MEASURED_KEYS["trainer"]), (orch, MEASURED_KEYS["orchestrator"])) for key in keys}
    out = {
        "state": status.state,
        "reason": status.reason,
        "run_dir": status.run_dir,
        "name": status.name,
        "scheduler": status.scheduler,
        "job_id": status.job_id,
        "attempt": status.attempt,
        "exit_code": status.exit_code,
        "step": last[-1]["step"] if last else None,
        "steps_done": steps_done,
        "max_steps": status.max_steps,
        "eta_s": None if status.ended else _eta(trainer, steps_done, status.max_steps),
        "reward_mean": rewards[-1][1] if rewards else None,
        "reward_first": rewards[0][1] if rewards else None,
        "components": [
            {**{k: getattr(c, k) for k in ("name", "group", "nodes", "restarts", "exit_code", "pid")},
             "state": "stalled" if c.group in stalled_groups and c.state == "running" else c.state}
            for c in status.components
        ],
        "heartbeats": beat_rows,
        "stall_timeout_s": status.stall_timeout_s,
        "predicted": predicted_times(status.plan),
        "measured": {k: v for k, v in measured.items() if v is not None},
        "idle": {
            "trainer": _idle(trainer, WAIT_BATCH_S, TRAINER_STEP_S),
            "inference": _idle(orch, WAIT_POLICY_S, ORCH_STEP_S),
        },
        "errors": errors or [],
        "last_update": max((r["time"] for r in metrics if isinstance(r.get("time"), (int, float))), default=None),
    }
    out["stalled"] = sorted(h["component"] for h in beat_rows if h["stalled"])
    message = stall_message(out)
    if message:
        out["reason"] = f"{out['reason']}; {message}" if out["reason"] else message
    return out
