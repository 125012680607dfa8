"""The one reader of Slurm job state (squeue + sacct), used by status, cancel, logs and --wait.

Per het component it merges squeue (fresher while the job is queued or running) with the newest
sacct record (exit code, start/end, requeue count). Every call is bounded by a timeout.

PREEMPTED is an end state: Slurm gives it to a job (or to one run of it) that preemption
terminated. A job that is requeued after a preemption is PENDING again in squeue and gets a new
sacct record, so the newest state says "pending" by itself; a PREEMPTED job that stays PREEMPTED
was not requeued and will not run again (`rlctl resume` continues it).
"""
from __future__ import annotations

import shutil
import subprocess
import time

SLURM_TIMEOUT_S = 10.0

# Slurm job states → rlctl component states.
STATES = {
    "PENDING": "pending", "REQUEUED": "pending", "REQUEUE_FED": "pending", "REQUEUE_HOLD": "pending",
    "RESV_DEL_HOLD": "pending",
    "RUNNING": "running", "CONFIGURING": "running", "COMPLETING": "running", "SUSPENDED": "running",
    "RESIZING": "running", "SIGNALING": "running", "STAGE_OUT": "running", "STOPPED": "running",
    "COMPLETED": "completed",
    "CANCELLED": "cancelled", "REVOKED": "cancelled",
    "FAILED": "failed", "TIMEOUT": "failed", "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed", "DEADLINE": "failed", "SPECIAL_EXIT": "failed", "PREEMPTED": "failed",
}
# Raw states of a job or component that will still run (or runs now).
ACTIVE_STATES = tuple(raw for raw, ours in STATES.items() if ours in ("pending", "running"))


# After a command timed out (the controller or the accounting daemon is down), it is not asked again for
# this long: `rlctl runs` over 36 Slurm runs waited 10 s for each of them, 6 minutes with nothing shown.
UNREACHABLE_S = 30.0
_timed_out: dict[str, float] = {}  # command -> when it last timed out (monotonic)


def _run(cmd: list[str]) -> tuple[str | None, str]:
    """(stdout, "") on success, (None, why) when the command is missing, fails or times out."""
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]} not found"
    since = _timed_out.get(cmd[0])
    if since is not None and time.monotonic() - since < UNREACHABLE_S:
        return None, f"{cmd[0]} timed out after {SLURM_TIMEOUT_S:.0f}s a moment ago (Slurm not answering)"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _timed_out[cmd[0]] = time.monotonic()
        return None, f"{cmd[0]} timed out after {SLURM_TIMEOUT_S:.0f}s"
    except OSError as e:
        return None, f"{cmd[0]}: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["exit code %d" % proc.returncode])[-1]
        return None, f"{cmd[0]}: {last}"
    return proc.stdout, ""


def het_index(job_field: str, leader: str) -> int | None:
    """`123+1` → 1, `123` → 0 (a plain job is its own component 0); steps and other jobs → None."""
    if job_field == leader:
        return 0
    if job_field.startswith(leader + "+") and job_field[len(leader) + 1:].isdigit():
        return int(job_field[len(leader) + 1:])
    return None


def _nodes(value: str) -> str:
    return "" if value in ("", "None assigned", "(null)") or value.startswith("(") else value


def parse_component_rows(job_id: str, rows: list[list[str]]) -> dict[int, dict]:
    """`[['12+1', 'RUNNING', 'node[1-2]'], ...]` → {1: {'state': 'RUNNING', 'nodelist': 'node[1-2]'}}.
    A plain (non-het) job id counts as component 0; step rows (`12+1.0`) are skipped."""
    out: dict[int, dict] = {}
    for row in rows:
        if len(row) < 3:
            continue
        index = het_index(row[0], str(job_id))
        if index is not None:
            out[index] = {"state": row[1].split()[0] if row[1] else "UNKNOWN", "nodelist": _nodes(row[2]) or None}
    return out


def sacct_components(job_id: str) -> tuple[dict[int, dict] | None, str]:
    """Per het component: the newest allocation record and how many times it was requeued."""
    out, why = _run(["sacct", "-j", job_id, "-X", "-D", "-P", "-n",
                     "-o", "JobID,JobName,State,ExitCode,NodeList,Start,End"])
    if out is None:
        return None, why
    comps: dict[int, dict] = {}
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) < 7:
            continue
        index = het_index(parts[0], job_id)
        if index is None:
            continue
        record = dict(zip(("job", "name", "state", "exit_code", "nodes", "start", "end"), parts))
        record["state"] = record["state"].split()[0]  # "CANCELLED by 0" → CANCELLED
        previous = comps.get(index)
        record["records"] = previous["records"] + 1 if previous else 1
        comps[index] = record  # -D lists older (requeued) records first
    return comps, ""


def squeue_components(job_id: str) -> tuple[dict[int, dict] | None, str]:
    out, why = _run(["squeue", "-j", job_id, "-h", "-o", "%i|%T|%N|%R"])
    if out is None:
        # squeue errors on ids it no longer knows: that just means "not queued".
        return ({}, "") if "Invalid job id" in why else (None, why)
    comps = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3:
            index = het_index(parts[0], job_id)
            if index is not None:
                comps[index] = {"state": parts[1], "nodes": parts[2], "reason": parts[3] if len(parts) > 3 else ""}
    return comps, ""


def read_job(job_id: str) -> tuple[dict[int, dict] | None, str]:
    """Per het component {state (raw), ours, nodelist, exit_code, start, end, restarts, reason};
    (None, why) when neither squeue nor sacct can be asked."""
    job = str(job_id)
    acct, acct_why = sacct_components(job)
    queue, queue_why = squeue_components(job)
    if acct is None and queue is None:
        return None, f"cannot ask Slurm about job {job}: {acct_why}; {queue_why}"
    acct, queue = acct or {}, queue or {}
    out = {}
    for index in sorted(set(acct) | set(queue)):
        a, q = acct.get(index, {}), queue.get(index, {})
        raw = q.get("state") or a.get("state") or "UNKNOWN"  # squeue is fresher while queued/running
        out[index] = {"state": raw, "ours": STATES.get(raw, "unknown"),
                      "nodelist": _nodes(q.get("nodes") or a.get("nodes") or "") or None,
                      "exit_code": a.get("exit_code"), "start": _time(a.get("start")), "end": _time(a.get("end")),
                      "restarts": _restarts(a, q.get("state")), "reason": q.get("reason", "")}
    return out, "" if out else (acct_why or queue_why or "no accounting record")


def component_states(job_id: str) -> dict[int, dict]:
    """Live state (raw Slurm name) and nodes of each het component; {} when Slurm cannot be asked."""
    states, _ = read_job(job_id)
    return states or {}


def job_finished(states: dict[int, dict]) -> bool:
    return bool(states) and all(v["state"] not in ACTIVE_STATES for v in states.values())


def _restarts(record: dict, queued: str | None = None) -> int:
    """Earlier (requeued) records, plus the newest one when it is itself REQUEUED (sacct shows that
    record before the record of the next run exists) or when squeue (`queued`) already has the job
    pending again while accounting, a moment behind, still has its last run running."""
    if not record:
        return 0
    behind = queued in ("PENDING", "REQUEUED") and record["state"] in ("RUNNING", "COMPLETING")
    return record["records"] - 1 + (record["state"] == "REQUEUED" or behind)


def _time(value: str | None) -> str | None:
    return value if value and value not in ("Unknown", "None") else None
