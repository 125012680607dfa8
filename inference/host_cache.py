"""Host-RAM copies of published full-weight steps, kept by a shared pool's server workers.

A pool switches a server between full-weight runs by reloading a run's newest step in place. Read
from the shared filesystem, that read is on the switch's critical path (a GPU cluster's shared
filesystem gives a node far less than its host-to-GPU bandwidth). So when a run that is not resident
publishes, its step is read into host RAM in the background (`stage`), and the switch to it loads
from there (`take`). Bounded by a byte budget, least recently staged or used first out; a run's older
step is dropped when its newer one is staged.

Runs inside vLLM's worker process (worker_ext.py), so it imports nothing of rlctl's.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("rlctl.host_cache")


@dataclass
class _Entry:
    step_dir: str
    tensors: dict = field(default_factory=dict)
    nbytes: int = 0
    read_s: float = 0.0
    error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)


class HostCache:
    """Steps in host RAM, keyed by their directory; thread-safe (reads run on threads of their own)."""

    def __init__(self, read_files):
        self._read_files = read_files  # step_dir -> the safetensors files to read, in order
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def stage(self, step_dir: str, budget_bytes: int, replaces: str | None = None) -> dict:
        """Start reading `step_dir` into RAM unless it is there or on its way; returns at once."""
        with self._lock:
            if replaces and replaces != step_dir:
                self._entries.pop(replaces, None)
            if step_dir in self._entries:
                self._entries.move_to_end(step_dir)
                return {"staged": False, "entries": len(self._entries)}
            entry = self._entries[step_dir] = _Entry(step_dir)
        threading.Thread(target=self._read, args=(entry, budget_bytes), name="rlctl-host-cache", daemon=True).start()
        return {"staged": True, "entries": len(self._entries)}

    def take(self, step_dir: str) -> dict | None:
        """The tensors of `step_dir` (waiting for a read in progress), or None if they are not here."""
        with self._lock:
            entry = self._entries.get(step_dir)
            if entry is not None:
                self._entries.move_to_end(step_dir)
        if entry is None:
            return None
        entry.ready.wait()
        return None if entry.error or not entry.tensors else entry.tensors

    def summary(self) -> dict:
        with self._lock:
            return {"entries": list(self._entries), "bytes": sum(e.nbytes for e in self._entries.values())}

    def _read(self, entry: _Entry, budget_bytes: int) -> None:
        from safetensors.torch import load_file

        start = time.perf_counter()
        try:
            for path in self._read_files(Path(entry.step_dir)):
                tensors = load_file(str(path))  # copies into RAM: the file may go once the step is pruned
                if _pinnable():
                    tensors = {k: v.pin_memory() for k, v in tensors.items()}
                entry.tensors.update(tensors)
                entry.nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        except Exception as exc:  # noqa: BLE001 - a failed read leaves the switch to read the files
            entry.error, entry.tensors = f"{type(exc).__name__}: {exc}", {}
            log.warning("staging %s failed: %s", entry.step_dir, entry.error)
        entry.read_s = time.perf_counter() - start
        with self._lock:
            self._evict(budget_bytes, keep=entry.step_dir)
            if entry.error:
                self._entries.pop(entry.step_dir, None)
        entry.ready.set()

    def _evict(self, budget_bytes: int, keep: str) -> None:
        """Drop the least recently used steps until the budget holds (never `keep`, never a read in
        progress); `keep` itself goes if it alone exceeds the budget."""
        total = sum(e.nbytes for e in self._entries.values())
        for key in list(self._entries):
            if total <= budget_bytes:
                return
            entry = self._entries[key]
            if key == keep or not entry.ready.is_set():
                continue
            total -= entry.nbytes
            del self._entries[key]
        if total > budget_bytes and keep in self._entries:
            log.warning("%s needs %d bytes, more than the host cache's %d: not kept", keep, total, budget_bytes)
            entry = self._entries.pop(keep)
            entry.error, entry.tensors = "larger than the host cache", {}


def _pinnable() -> bool:
    """Pinned host memory makes the copy to the GPU fast; only where there is a GPU."""
    import torch

    return torch.cuda.is_available()
