"""What `rlctl monitor` shows besides process states: metric series, medians, ETA, idle fractions,
the plan's predictions, stalled components (heartbeats) and the last error lines of the component
logs. Pure data, no rich."""
from __future__ import annotations

import re
import signal
import statistics
import time
from pathlib import Path

from rlctl.launchers.status import CANCEL_CODES, RunStatus, epoch, read_json_record
from rlctl.orchestrator.exchange.heartbeat import Beat, stalled_for
from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord as Orch
from rlctl.orchestrator.exchange.metrics import TrainerStepRecord as Trainer
from rlctl.orchestrator.exchange.metrics import keys_of

WINDOW = 20  # recent steps that medians, idle fractions and the ETA are computed over
# "died", "exited with code N": what a wrapper says when its process went away ("server 0 died with code -9")
ERROR_RE = re.compile(r"error|traceback|killed|out of memory|\bdied\b|exited with code -?[1-9]", re.IGNORECASE)
# What a wrapper prints when its component is told to stop (inference/__main__.py before it stops its
# server, trainer/train.py once it saved its SIGTERM checkpoint): what the log holds after that (vLLM's
# EngineDeadError as its engine goes away, a lost peer) is shutdown, not failure.
SHUTDOWN_RE = re.compile(r"rlctl\.inference\[\d+\]: (run finished|stop requested), stopping the server"
                         r"|\[trainer [\d:]+\] preemption requested \(SIGTERM\)")
# A line vLLM logged below ERROR (`(APIServer pid=N) WARNING 12-05 18:15:37 [file.py:N] ...`): its ulimit
# warning mentions "fd limit errors like OSError" on every Slurm run. (rlctl's own warnings, a failed
# request being retried, stay: they are what a failure looks like from the other side.)
PROCESS_PREFIX = r"\(\S+ pid=\d+\)"  # what vLLM puts before each line of its processes: `(EngineCore pid=N)`
BELOW_ERROR_RE = re.compile(rf"^({PROCESS_PREFIX}\s+)?(DEBUG|INFO|WARNING) \d\d-\d\d [\d:]+ \[")
PROCESS_PREFIX_RE = re.compile(rf"^{PROCESS_PREFIX} ")
TRACEBACK_RE = re.compile(r"^Traceback \(most recent call last\):$")
CHAINED_RE = re.compile(r"^(The above exception was the direct cause|During handling of the above exception)")
# The local supervisor's bookkeeping (launchers/local.py): the culprit entry says it better.
BOOKKEEPING_RE = re.compile(r"\] \S+ rank \d+ exited with code -?\d+$")
# inference/__main__.py:_fail repeats the server's last lines after its message: already in the log above.
REPEAT_RE = re.compile(r"^--- last (\d+) lines of the server log ---$")
# The supervisor polls every 0.2 s and stamps the exits it sees in one poll in task order: exits this
# close together are one event, and which of them came first is decided otherwise (see culprit()).
TIE_S = 0.5
TRAINER_STEP_S, WAIT_BATCH_S, PUBLISH_S, ATTEMPT_START = keys_of(
    Trainer, "trainer_step_time_s", "wait_batch_s", "weight_publish_s", "attempt_start")
ORCH_STEP_S, WAIT_POLICY_S, REWARD = keys_of(Orch, "orchestrator_step_time_s", "wait_policy_s", "reward_mean")
MEASURED_KEYS = {
    "trainer": (TRAINER_STEP_S, WAIT_BATCH_S, PUBLISH_S),
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


def recent_median(records: list[dict], key: str) -> float | None:
    """The median of `key` over the last WINDOW records (a record without it is left out)."""
    values = [v for _, v in series(records[-WINDOW:], key)]
    return statistics.median(values) if values else None


def _idle(records: list[dict], wait_key: str, wall_keys: tuple[str, ...]) -> float | None:
    """The share of the recent steps' wall time (the sum of `wall_keys`) spent in `wait_key`. An attempt's
    first step is left out: the trainer's wait there is the servers' start-up, not inference being behind."""
    rows = [[r.get(k) for k in (wait_key, *wall_keys)] for r in records[-WINDOW:] if not r.get(ATTEMPT_START)]
    rows = [row for row in rows if all(isinstance(v, (int, float)) for v in row)]
    total = sum(sum(row[1:]) for row in rows)
    return min(1.0, max(0.0, sum(row[0] for row in rows) / total)) if total > 0 else None


def _this_attempt(records: list[dict]) -> list[dict]:
    """The recent records from the newest attempt's first step on: the time before it (a resume's gap) is no step."""
    recent = records[-WINDOW:]
    starts = [i for i, r in enumerate(recent) if r.get(ATTEMPT_START)]
    return recent[starts[-1]:] if starts else recent


def resumed_at(trainer: list[dict]) -> list[int]:
    """The steps a later attempt (a resume after a crash, preemption or cancel) began at."""
    return [r["step"] for r in trainer[1:] if r.get(ATTEMPT_START)]


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
    times = [r["time"] for r in _this_attempt(trainer) if isinstance(r.get("time"), (int, float))]
    if len(times) >= 2:
        per_step = (times[-1] - times[0]) / (len(times) - 1)
    else:
        per_step = recent_median(trainer, TRAINER_STEP_S)
    return None if per_step is None else per_step * (max_steps - steps_done)


def _before_shutdown(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        if SHUTDOWN_RE.search(line):
            return lines[:i + 1]
    return lines


def _without_repeats(lines: list[str]) -> list[str]:
    """The lines less the server-log excerpts a wrapper repeats after its message (shown twice, they
    would push the message itself out of the last lines)."""
    out, skip = [], 0
    for line in lines:
        if skip:
            skip -= 1
        elif m := REPEAT_RE.match(line.strip()):
            skip = int(m.group(1))
        else:
            out.append(line)
    return out


def _error_lines(lines: list[str]) -> list[str]:
    """The lines that say something failed. In a Python traceback the frames (indented) never count,
    though their code may read `raise self._error`, and the exception line that ends it always does,
    though `RewardsFailing: 6 reward calls in a row failed` has no 'error' in it: it is the cause."""
    hits, in_traceback = [], False
    for line in lines:
        text = line.strip()
        body = PROCESS_PREFIX_RE.sub("", line, count=1)
        if TRACEBACK_RE.match(body):
            in_traceback = True
        elif in_traceback:
            if not body.strip() or body[:1].isspace() or CHAINED_RE.match(body):
                continue  # a frame, or the line joining a chained exception to the next traceback
            in_traceback = False
            hits.append(text)
            continue
        if ERROR_RE.search(text) and not BELOW_ERROR_RE.match(text):
            hits.append(text)
    return hits


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _tail(path: Path, size: int = 65536) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))  # only the tail: logs of long runs are large
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def _attempt_of(folder: Path) -> int | None:
    m = re.fullmatch(r"attempt_(\d+)", folder.resolve().name)
    return int(m.group(1)) if m else None


def culprit(run_dir: Path | str, folder: Path) -> dict | None:
    """The task whose abnormal exit ended the attempt whose logs are in `folder`, from the status files
    the local supervisor or (Slurm) each task's wrapper writes (`status/<group>.<component>.<rank>.json`:
    returncode, ended, on Slurm the attempt): the
    earliest non-zero exit. The others' exits follow it (the supervisor SIGTERMs them; a peer fails
    on the lost connection), so their log lines are consequences, however many and however late.
    Exits within TIE_S of the first are told apart by: not a stop code, then the log last written
    first (a killed process writes nothing more; a peer that reacts writes its traceback after).
    None for a cancelled attempt, without status files of this attempt, or when nothing failed."""
    status, attempt = Path(run_dir) / "status", _attempt_of(folder)
    sup = read_json_record(status / "supervisor.json")
    if sup is not None and (sup.get("state") == "cancelled" or sup.get("attempt") not in (None, attempt)):
        return None
    since = epoch(sup.get("started")) if sup is not None else None
    exits = []
    for path in status.glob("*.json"):
        record = read_json_record(path) if path.name != "supervisor.json" else None
        if record is None or (sup is None and record.get("attempt") != attempt):
            continue  # without a supervisor (Slurm) the task wrappers' records carry their attempt
        rc, ended, started = record.get("returncode"), epoch(record.get("ended")), epoch(record.get("started"))
        if type(rc) is not int or rc == 0 or ended is None:
            continue
        if since is not None and started is not None and started < since - 1.0:
            continue  # an earlier attempt's task that this one does not have
        group, _, component = path.stem.partition(".")
        log = folder / group / f"{component}.log"
        exits.append({"component": path.stem, "group": group, "rank": component.rpartition(".")[2],
                      "returncode": rc, "ended": ended, "log": log, "mtime": _mtime(log)})
    if not exits or (sup is None and all(e["returncode"] in CANCEL_CODES for e in exits)):
        return None  # nothing failed, or (Slurm) every task was told to stop: a cancel
    first = min(e["ended"] for e in exits)
    tied = [e for e in exits if e["ended"] <= first + TIE_S]
    return min(tied, key=lambda e: (e["returncode"] in CANCEL_CODES,  # told to stop: a consequence
                                      e["mtime"], e["ended"]))


def _cause_entry(cause: dict, folder: Path) -> dict:
    rc = cause["returncode"]
    how = ""
    if rc < 0:
        try:
            how = f" (killed by {signal.Signals(-rc).name})"
        except ValueError:
            how = f" (killed by signal {-rc})"
    line = f"{cause['group']} rank {cause['rank']} failed first: exited with code {rc}{how}"
    return {"file": str(cause["log"].relative_to(folder)), "line": line, "cause": True,
            "component": cause["component"], "returncode": rc}


def log_errors(run_dir: Path | str, attempt: int | None = None, limit: int = 8, per_file: int = 3,
               completed: bool = False) -> list[dict]:
    """The last error-looking lines of every component log of the latest attempt. For a `completed`
    run, what a log holds after its component was told to stop is shutdown noise and left out.
    When a task failed (see culprit()), the first entry names it (`cause`: True), its own last error
    lines follow, then the other logs' (without their shutdown noise), earliest written first; the
    first `limit` are kept. Otherwise the last `limit` lines, the most recently written log last."""
    logs = Path(run_dir) / "logs"
    folder = logs / "latest"
    if not folder.is_dir() and attempt is not None:
        folder = logs / f"attempt_{attempt}"
    if not folder.is_dir():
        return []
    cause = None if completed else culprit(run_dir, folder)
    own: list[dict] = []
    found: list[dict] = []
    for path in sorted(folder.rglob("*.log"), key=_mtime):
        lines = _tail(path)
        if lines is None:
            continue
        mine = cause is not None and path == cause["log"]
        if completed or (cause is not None and not mine):
            lines = _before_shutdown(lines)
        hits = [line for line in _error_lines(_without_repeats(lines)) if not (cause and BOOKKEEPING_RE.search(line))]
        entries = [{"file": str(path.relative_to(folder)), "line": line[:300]} for line in hits[-per_file:]]
        (own if mine else found).extend(entries)
    if cause is None:
        return found[-limit:]
    return ([_cause_entry(cause, folder)] + own + found)[:limit]


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
    measured = {key: recent_median(recs, key) for recs, keys in ((trainer, MEASURED_KEYS["trainer"]), (orch, MEASURED_KEYS["orchestrator"])) for key in keys}
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
            # The trainer's step time leaves out its wait and publish; the orchestrator's includes its wait.
            "trainer": _idle(trainer, WAIT_BATCH_S, (WAIT_BATCH_S, TRAINER_STEP_S, PUBLISH_S)),
            "inference": _idle(orch, WAIT_POLICY_S, (ORCH_STEP_S,)),
        },
        "errors": errors or [],
        "last_update": max((r["time"] for r in metrics if isinstance(r.get("time"), (int, float))), default=None),
    }
    out["stalled"] = sorted(h["component"] for h in beat_rows if h["stalled"])
    message = stall_message(out)
    if message:
        out["reason"] = f"{out['reason']}; {message}" if out["reason"] else message
    return out
