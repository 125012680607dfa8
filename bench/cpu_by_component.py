"""CPU seconds each part of a local run uses, sampled from /proc from outside the run.

A run's processes are found by their command lines: every component gets `--run-dir RUN` (vLLM's API
server `--model RUN/model`), and their children (vLLM's engine, the router) descend from them. The
sampler keeps each process's cumulative user + system time; `per_step` turns two moments into CPU
seconds per step for each part, and `floor_s` into the shortest step interval those seconds allow on
this host's cores, however well they are scheduled.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from rlctl.orchestrator.exchange.procstat import proc_stat

TICKS = os.sysconf("SC_CLK_TCK")
LABELS = (  # first match wins
    ("VLLM::EngineCore", "vLLM engine"),
    ("vllm_cpu_main", "vLLM API server"),
    ("vllm_main", "vLLM API server"),
    ("inference.router", "router"),
    ("rlctl.trainer", "trainer (all ranks)"),
    ("rlctl.orchestrator", "orchestrator"),
)


def _label(cmdline: str) -> str:
    return next((name for key, name in LABELS if key in cmdline), "other (supervisor, watchers)")


def _read(pid: str) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds so far, command line) of one process, None once it is gone."""
    fields = proc_stat(int(pid))  # the project's one reader of /proc/<pid>/stat (fields after the name)
    if fields is None:
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, cmdline


class CpuSampler(threading.Thread):
    """Every `every` seconds: the cumulative CPU seconds of each process of the runs under `root`."""

    def __init__(self, root: Path, every: float = 0.5):
        super().__init__(daemon=True)
        self.root, self.every, self.stop = str(root), every, threading.Event()
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.labels: dict[int, str] = {}

    def snapshot(self) -> None:
        procs = {int(p): info for p in os.listdir("/proc") if p.isdigit() and (info := _read(p))}
        mine = {pid for pid, (_, _, cmd) in procs.items() if self.root in cmd}
        grew = True
        while grew:  # children of the run's processes (vLLM's engine, the router) belong to it
            new = {pid for pid, (ppid, _, _) in procs.items() if ppid in mine and pid not in mine}
            mine |= new
            grew = bool(new)
        for pid in mine:  # relabelled every time: a child seen between fork and exec has its parent's command line
            if procs[pid][2].strip() or pid not in self.labels:  # an exited, unreaped child's is empty: keep its label
                self.labels[pid] = _label(procs[pid][2])
        self.samples.append((time.time(), {pid: procs[pid][1] for pid in mine}))

    def run(self) -> None:
        while not self.stop.is_set():
            self.snapshot()
            self.stop.wait(self.every)

    def _at(self, t: float) -> dict[int, float]:
        """CPU seconds per process at the last sample before `t` (empty before the first)."""
        before = [cpu for when, cpu in self.samples if when <= t]
        return before[-1] if before else {}

    def per_step(self, t0: float, t1: float, steps: int) -> dict[str, float]:
        """CPU seconds per step of each part between two moments (a process that started in between
        counts from zero; one that ended counts up to its last sample)."""
        start, last = self._at(t0), {}
        for when, cpu in self.samples:
            if t0 < when <= t1:
                last.update(cpu)
        used: dict[str, float] = defaultdict(float)
        for pid, cpu in last.items():
            used[self.labels[pid]] += max(0.0, cpu - start.get(pid, 0.0))
        return {name: round(s / max(1, steps), 3) for name, s in sorted(used.items(), key=lambda kv: -kv[1])}


def floor_s(per_step: dict[str, float], cores: int | None = None) -> float:
    """The shortest step interval the parts' CPU seconds allow on `cores` cores."""
    return sum(per_step.values()) / (cores or os.cpu_count() or 1)
