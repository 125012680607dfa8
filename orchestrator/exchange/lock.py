"""The run lock: `<run>/LOCK`, held by whoever changes what a run is doing (launch, resume, the
requeue of a Slurm job, cancel), so two of them never act on one run at once.

The lock file holds its owner (host, pid, the process's start time, command, since when, a nonce).
It is created whole and exclusively: the record is written to a private temp file, then hard-linked
to `LOCK` (atomic on local filesystems and NFS, where the link count tells whether a retried link
succeeded); filesystems without hard links get `O_CREAT|O_EXCL`.

A lock is *stale*, and is broken with a line on stderr, only when its owner certainly is gone:
  * same host, and the pid is gone, is another process (other start time), or the host rebooted;
  * another host: we cannot see its processes, so only when the lock is older than
    `OTHER_HOST_STALE_S` and the caller says the run is not active (be conservative);
  * the same Slurm job at an earlier restart (the node of the previous incarnation died).
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from rlctl.orchestrator.exchange.files import FILE_MODE, fsync_path
from rlctl.orchestrator.exchange.procstat import HAVE_PROC, start_ticks

OTHER_HOST_STALE_S = 3600.0
POLL_S = 0.2


class RunLocked(RuntimeError):
    """Another live owner holds the lock; `str()` is the one line shown to the user."""

    exit_code = 1


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_is(pid: int, ticks: int | None) -> bool:
    """Whether `pid` is still the process that took the lock."""
    if HAVE_PROC:
        return ticks is not None and start_ticks(pid) == ticks
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)[:200]


def describe(holder: dict) -> str:
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"`{_printable(str(holder.get('command', '?')))}` (host {_printable(str(holder.get('host', '?')))}, "
            f"pid {holder.get('pid', '?')}, since {when})")


class RunLock:
    """`with RunLock(run.lock, "rlctl resume r1"):` — raises RunLocked naming the live holder.

    `active()` (optional) tells whether the run may still be running; a lock of another host is broken
    only when it is old and `active()` is False. `wait_s` keeps retrying that long before giving up."""

    def __init__(self, path: Path, command: str, *, active: Callable[[], bool] | None = None,
                 wait_s: float = 0.0, stale_after_s: float = OTHER_HOST_STALE_S):
        self.path = Path(path)
        self.active, self.wait_s, self.stale_after_s = active, wait_s, stale_after_s
        pid = os.getpid()
        self.record = {
            "host": socket.gethostname(), "pid": pid, "start_ticks": start_ticks(pid), "boot_id": _boot_id(),
            "command": _printable(command), "since": None, "nonce": secrets.token_hex(8),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_restart": os.environ.get("SLURM_RESTART_COUNT"),
        }
        self.held = False

    # ------------------------------------------------------------------------------ acquire/release

    def acquire(self) -> "RunLock":
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                created = self._create()
            except PermissionError as e:
                raise RunLocked(f"cannot take the lock {self.path}: {e.strerror}") from None
            if created:
                self.held = True
                return self
            holder = self.read()
            if holder is None:
                continue  # released between our attempt and the read: try again at once
            why = self._stale(holder)
            if why:
                self._break(holder, why)
                continue
            if time.monotonic() >= deadline:
                raise RunLocked(f"run {self.path.parent.name} is locked by {describe(holder)}; "
                                f"try again once it is done (the lock is {self.path})")
            time.sleep(POLL_S)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self.read()
        if holder is not None and holder.get("nonce") == self.record["nonce"]:
            self.path.unlink(missing_ok=True)
        else:
            print(f"rlctl: warning: {self.path} was taken from us while held "
                  f"(now {describe(holder) if holder else 'absent'})", file=sys.stderr)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------------------------ internals

    def read(self) -> dict | None:
        """The holder's record; {} for a lock file that cannot be parsed (the O_EXCL fallback while it
        is being written, or damaged); None when there is no lock file."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            try:
                return {"since": self.path.stat().st_mtime}
            except FileNotFoundError:
                return None
        return record

    def _create(self) -> bool:
        self.record["since"] = time.time()
        data = (json.dumps(self.record) + "\n").encode()
        tmp = self.path.with_name(f".{self.path.name}.{self.record['nonce']}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass  # on NFS a retried link can report EEXIST although it worked: the count below tells
            except OSError:
                return self._create_excl(data)  # no hard links on this filesystem
            linked = os.stat(tmp).st_nlink == 2
        finally:
            tmp.unlink(missing_ok=True)
        if linked:
            fsync_path(self.path.parent)
        return linked

    def _create_excl(self, data: bytes) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is certainly gone, or None while it may be alive."""
        me = self.record
        job, restart = holder.get("slurm_job"), holder.get("slurm_restart")
        if (job and job == me["slurm_job"] and str(restart or "0").isdigit()
                and str(me["slurm_restart"] or "0").isdigit() and int(restart or 0) < int(me["slurm_restart"] or 0)):
            return f"an earlier run of Slurm job {job} (restart {restart or 0})"
        pid = holder.get("pid")
        if holder.get("host") == me["host"] and isinstance(pid, int):
            if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
                return "the host rebooted since"
            if not _pid_is(pid, holder.get("start_ticks")):
                return f"pid {pid} is gone"
            return None
        since = holder.get("since")
        age = time.time() - since if isinstance(since, (int, float)) else 0.0
        if age > self.stale_after_s and self.active is not None and not self.active():
            return f"{age / 3600:.1f} h old and the run is not active"
        return None

    def _break(self, holder: dict, why: str) -> None:
        """Move the stale lock aside (atomic: of two breakers only one moves it), then check that what
        moved is the stale record and not a fresh lock taken meanwhile; a fresh one is put back."""
        aside = self.path.with_name(f".{self.path.name}.stale.{self.record['nonce']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read_json(aside)
        if holder.get("nonce") is not None and moved.get("nonce") != holder.get("nonce"):
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        print(f"rlctl: broke the stale lock of {describe(holder)} on {self.path.parent.name}: {why}",
              file=sys.stderr)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
