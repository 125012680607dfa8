"""What `rlctl monitor` shows besides process states: metrics.jsonl series, medians, ETA, idle
fractions, the plan's predictions and the last error lines of the component logs. Pure data, no rich."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from rlctl.launchers.status import RunStatus

WINDOW = 20  # recent steps that medians, idle fractions and the ETA are computed over
ERROR_RE = re.compile(r"error|traceback|killed|out of memory", re.IGNORECASE)
MEASURED_KEYS = {
    "trainer": ("trainer_step_time_s", "wait_batch_s", "weight_publish_s"),
    "orchestrator": ("orchestrator_step_time_s", "wait_policy_s", "rollouts_per_s", "tokens_per_s",
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
        per_step = _median(trainer, "trainer_step_time_s")
    return None if per_step is None else per_step * (max_steps - steps_done)


def log_errors(run_dir: Path | str, attempt: int | None = None, limit: int = 8, per_file: int = 3) -> list[dict]:
    """The last error-looking lines of every component log of the latest attempt."""
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
        hits = [line.strip() for line in lines if ERROR_RE.search(line)]
        found.extend({"file": str(path.relative_to(folder)), "line": line[:300]} for line in hits[-per_file:])
    return found[-limit:]


def summarize(status: RunStatus, metrics: list[dict], errors: list[dict] | None = None) -> dict:
    """The `rlctl monitor --once --json` object."""
    trainer, orch = by_step(metrics, "trainer"), by_step(metrics, "orchestrator")
    rewards = series(orch, "reward_mean")
    last = trainer or orch
    steps_done = len(trainer) if trainer else len(orch)
    measured = {key: _median(recs, key) for recs, keys in ((trainer, MEASURED_KEYS["trainer"]), (orch, MEASURED_KEYS["orchestrator"])) for key in keys}
    return {
        "state": status.state,
        "reason": status.reason,
        "run_dir": status.run_dir,
        "name": status.name,
        "scheduler": status.scheduler,
        "job_id": status.job_id,
        "attempt": status.attempt,
        "step": last[-1]["step"] if last else None,
        "steps_done": steps_done,
        "max_steps": status.max_steps,
        "eta_s": None if status.ended else _eta(trainer, steps_done, status.max_steps),
        "reward_mean": rewards[-1][1] if rewards else None,
        "reward_first": rewards[0][1] if rewards else None,
        "components": [
            {k: getattr(c, k) for k in ("name", "group", "state", "nodes", "restarts", "exit_code", "pid")}
            for c in status.components
        ],
        "predicted": predicted_times(status.plan),
        "measured": {k: v for k, v in measured.items() if v is not None},
        "idle": {
            "trainer": _idle(trainer, "wait_batch_s", "trainer_step_time_s"),
            "inference": _idle(orch, "wait_policy_s", "orchestrator_step_time_s"),
        },
        "errors": errors or [],
        "last_update": max((r["time"] for r in metrics if isinstance(r.get("time"), (int, float))), default=None),
    }
