"""Component heartbeats: `heartbeats/<component>.json`, the last progress of each component.

Each component (trainer rank 0, the orchestrator, each inference wrapper) writes one small file,
atomically, whenever its progress counter moves and, while it waits on another component (the
trainer for a batch, the orchestrator for the policy, a server for its startup), at least every
`interval_s` seconds. Nothing is written from a background thread: a hung main loop must stop
beating, or a hang would look healthy.

A component is stalled when it has neither progressed nor been legitimately waiting for
`monitoring.stall_timeout_s`: `now - activity > stall_timeout_s`, where activity is the last
beat while waiting and the last progress otherwise.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.layout import RunDir

MAX_INTERVAL_S = 10.0


def beat_interval(stall_timeout_s: float) -> float:
    """Seconds between beats while waiting: well inside the stall timeout, never more than 10 s."""
    return min(MAX_INTERVAL_S, stall_timeout_s / 4)


@dataclass
class Beat:
    """The content of one heartbeat file."""

    component: str
    """`trainer`, `orchestrator`, `inference.<index>`; the part before the dot is the job group."""
    time: float
    """Unix time of this beat."""
    progress: int
    """A counter that only grows while the component does its own work (steps, tokens, health probes)."""
    progress_time: float
    """Unix time the counter last moved."""
    waiting_for: str | None
    """What the component waits on right now (another component's work), or None while it works."""
    pid: int
    host: str
    attempt: str = ""

    @property
    def group(self) -> str:
        return self.component.split(".")[0]

    def activity(self) -> float:
        """When the stall clock last restarted: a waiting beat, else the last progress."""
        return self.time if self.waiting_for else self.progress_time


class Heartbeat:
    """The writer side of one component's heartbeat file."""

    def __init__(self, run: RunDir, component: str, interval_s: float = MAX_INTERVAL_S):
        self.path = run.heartbeats / f"{component}.json"
        self.component, self.interval_s = component, interval_s
        self.progress_value: int | None = None
        self.progress_time = 0.0
        self.last_write = 0.0
        self.last_waiting: str | None = None

    def beat(self, progress: int, waiting_for: str | None = None) -> bool:
        """Record `progress` (and what the component waits on); writes when the counter moved, the
        waiting state changed, or `interval_s` passed. Returns whether it wrote."""
        now = time.time()
        moved = progress != self.progress_value
        if moved:
            self.progress_value, self.progress_time = progress, now
        if not (moved or waiting_for != self.last_waiting or now - self.last_write >= self.interval_s):
            return False
        self.last_write, self.last_waiting = now, waiting_for
        atomic_write_json(self.path, asdict(Beat(self.component, now, progress, self.progress_time, waiting_for,
                                                 os.getpid(), socket.gethostname(),
                                                 os.environ.get("RLCTL_ATTEMPT", ""))))
        return True


def read_beats(run_dir: Path | RunDir) -> list[Beat]:
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    beats = []
    for path in sorted(run.heartbeats.glob("*.json")) if run.heartbeats.is_dir() else ():
        try:
            data = json.loads(path.read_text())
            beats.append(Beat(**{k: data[k] for k in Beat.__dataclass_fields__ if k in data}))
        except (OSError, ValueError, TypeError):
            continue  # vanished or written by something else: the next poll sees the new one
    return beats


def stalled_for(beat: Beat, stall_timeout_s: float, now: float | None = None, since: float | None = None) -> float | None:
    """Seconds `beat`'s component has been without activity, when that is more than
    `stall_timeout_s`; else None. The clock starts no earlier than `since` (when the
    component's current process started), so a beat of an earlier attempt never counts."""
    now = time.time() if now is None else now
    idle = now - max(beat.activity(), since or 0.0)
    return idle if idle > stall_timeout_s else None
