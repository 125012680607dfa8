"""A private temp directory for vLLM's IPC sockets when the run directory's own is too deep for them.

vLLM binds ZMQ IPC sockets at $TMPDIR/<uuid4>, and a unix socket path holds at most 107 bytes, so a
server whose run directory is deep gets a directory of its own under the node's temp dir instead. Its
owner holds an exclusive `flock` on a file inside it for as long as it lives (the kernel drops the lock
when the process dies, SIGKILL included, in whatever pid namespace), so a later server on the node can
tell a leftover of a killed one from a live one and remove it: killed servers no longer pile them up.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

SOCKET_PATH_MAX = 107 - len("/") - 36  # what is left of a socket path for its directory
PREFIX = "rlctl-vllm-"
OWNER_LOCK = "owner.lock"
YOUNG_S = 60.0  # a directory this recent may still be between its creation and its owner's lock


class PrivateIpcDir:
    """A new directory under `base`, locked by this process until `remove`."""

    def __init__(self, base: str):
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
        self._lock = os.open(os.path.join(self.path, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock)


def _owner_alive(path: Path) -> bool:
    """Whether a process holds the directory's lock (a directory without a lock file has no owner)."""
    try:
        fd = os.open(path / OWNER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: nobody holds it
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def sweep_leftovers(base: str) -> list[str]:
    """Remove this user's directories under `base` whose owner is gone; returns their paths. Young ones
    are left alone: their owner may not have taken its lock yet."""
    removed = []
    for path in Path(base).glob(PREFIX + "*"):
        try:
            info = path.lstat()
            if (not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid()
                    or time.time() - info.st_mtime < YOUNG_S or _owner_alive(path)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def ipc_safe_tmpdir(preferred: str) -> PrivateIpcDir | None:
    """None when `preferred` (the run dir's tmp) is short enough for vLLM's IPC sockets; else a new
    private directory under the node's temp dir (the caller removes it when the server is gone), after
    removing those that servers killed before they could remove theirs left behind."""
    if len(os.fsencode(preferred)) <= SOCKET_PATH_MAX:
        return None
    base = os.environ.get("TMPDIR") or "/tmp"
    if len(os.fsencode(base)) > SOCKET_PATH_MAX - 24:
        base = "/tmp"
    sweep_leftovers(base)
    return PrivateIpcDir(base)
