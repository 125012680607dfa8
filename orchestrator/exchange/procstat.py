"""What /proc says about a process (Linux): the one reader of `/proc/<pid>/stat` for every component.

Owner records (the run lock, status and heartbeat files) carry a pid *and* its start time, because a
pid alone may have been recycled by another process by the time someone reads the record.
"""
from __future__ import annotations

import os
from pathlib import Path

HAVE_PROC = Path("/proc/self/stat").exists()


def proc_stat(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (state first); None when it is gone.
    The name sits in parentheses and may itself hold spaces and parentheses, hence the split at the last ')'."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields or None


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot; None when it is gone or a zombie (it has exited)."""
    fields = proc_stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def start_epoch(pid: int) -> float | None:
    """When `pid` started, as a Unix time; None when it is gone or a zombie."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
