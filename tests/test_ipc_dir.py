"""Private IPC directories of inference servers: a killed server's leftover is removed by the next
server on the node, a live server's never."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlctl.inference.ipc_dir import PREFIX, YOUNG_S, PrivateIpcDir, ipc_safe_tmpdir

OWNER = """
import sys, time
from rlctl.inference.ipc_dir import PrivateIpcDir
print(PrivateIpcDir(sys.argv[1]).path, flush=True)
time.sleep(600)
"""


@pytest.fixture
def short_tmp(monkeypatch):
    """A temp dir short enough to hold the sockets (pytest's own are too deep), as TMPDIR."""
    base = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_killed_servers_directory_goes_a_live_ones_stays(tmp_path, short_tmp):
    base = short_tmp
    killed = subprocess.Popen([sys.executable, "-c", OWNER, str(base)], stdout=subprocess.PIPE, text=True)
    killed_dir = killed.stdout.readline().strip()
    os.kill(killed.pid, signal.SIGKILL)  # no chance to remove its directory
    killed.wait()
    live = PrivateIpcDir(str(base))
    unlocked_old = base / f"{PREFIX}old"  # its owner died between creating and locking it, long ago
    unlocked_old.mkdir()
    for old in (killed_dir, live.path, unlocked_old):  # past the age below which nothing is swept
        os.utime(old, (time.time() - 2 * YOUNG_S,) * 2)
    unlocked_new = base / f"{PREFIX}new"  # being created right now: not locked yet
    unlocked_new.mkdir()
    try:
        assert ipc_safe_tmpdir(str(tmp_path / "run" / "tmp")) is None  # short enough: nothing to do
        made = ipc_safe_tmpdir("/" + "x" * 200)
        try:
            left = {str(p) for p in base.iterdir()}
            assert left == {live.path, str(unlocked_new), made.path}, left
            assert killed_dir not in left
        finally:
            made.remove()
    finally:
        live.remove()
    assert sorted(p.name for p in base.iterdir()) == [unlocked_new.name]
