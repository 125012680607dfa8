"""Durable, private file writes on the shared filesystem.

Everything under a run directory is owner-only (files 0600, directories 0700) whatever the caller's
umask: the run dir holds pickles that execute code (submitit), tokens, and weights. Modes are set
explicitly after creation because `mkdir(mode=...)` and `open()` are both filtered by the umask.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

FILE_MODE = 0o600
DIR_MODE = 0o700
WRITEBACK_CHUNK = 8 << 20  # bytes written before their writeback is started (write_durably)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def _start_writeback() -> Callable[[int, int, int], None]:
    """Linux's sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE): starts writing those dirty
    pages to storage without waiting; a no-op where libc has no such call."""
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return lambda fd, offset, length: None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return lambda fd, offset, length: call(fd, offset, length, 2)  # 2: SYNC_FILE_RANGE_WRITE


def write_durably(fd: int, buffers: Iterable[memoryview]) -> int:
    """Write `buffers` in order to `fd` (at its offset 0) and fsync it; returns the bytes written.
    Writeback of each chunk starts as soon as it is written, so storage works while the next chunk is
    copied and the closing fsync waits for the tail only (96 MiB here: 35 ms instead of 60 ms for a
    write then an fsync). sync_file_range alone is no durability guarantee: the fsync is."""
    start_writeback, offset = _start_writeback(), 0
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        for chunk_start in range(0, len(view), WRITEBACK_CHUNK):
            chunk = view[chunk_start:chunk_start + WRITEBACK_CHUNK]
            length = len(chunk)
            while chunk:  # os.write may write less than asked
                chunk = chunk[os.write(fd, chunk):]
            start_writeback(fd, offset, length)
            offset += length
    os.fsync(fd)
    return offset


def private_dir(path: Path) -> Path:
    """mkdir -p with every directory this call creates set to 0700 (existing ones are left alone)."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:  # a concurrent writer made it first
            continue
        os.chmod(folder, DIR_MODE)
    return path


def atomic_write_bytes(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write to a temp file in the same directory, fsync, then rename: readers see old or new, never partial."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any, mode: int = FILE_MODE) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=str) + "\n").encode(), mode)


def append_line(path: Path, line: str) -> None:
    """Append one line with a single write. Only for files that have a single writer: O_APPEND is not
    atomic across hosts on NFS, which is why every writer of metrics or heartbeats has its own file."""
    data = (line.rstrip("\n") + "\n").encode()
    private_dir(Path(path).parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def append_jsonl(path: Path, record: dict) -> None:
    append_line(path, json.dumps(record, default=str))
