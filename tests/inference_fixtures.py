"""One real `python -m rlctl.inference` server for a module's tests, started as the launchers do."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_checks import leftover_processes
from rlctl.orchestrator.exchange.layout import RunDir

HOST = "127.0.0.1"
START_TIMEOUT_S = 900


def start_inference(run: RunDir, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RLCTL_RUN_DIR": str(run.root), "RLCTL_BIND_HOST": HOST, "RLCTL_SERVER_INDEX": "0",
           "RLCTL_GROUP": "inference", "RLCTL_ATTEMPT": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "rlctl.inference", "--run-dir", str(run.root)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def served(run: RunDir, log: Path):
    """Start the server, yield (its announcement, the process) once announced; on leaving, DONE must stop
    it cleanly: exit 0, announcement withdrawn, its whole process group gone (engine core included)."""
    started = time.monotonic()
    proc = start_inference(run, log)
    announcement = run.services / "inference" / "0.json"
    try:
        while not announcement.exists():
            if proc.poll() is not None:
                pytest.fail(f"inference exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"inference not ready after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        print(f"\n[measure] server start (python -m rlctl.inference → announced): {time.monotonic() - started:.1f} s")
        yield json.loads(announcement.read_text()), proc
        (run.root / "DONE").write_text("")
        assert proc.wait(120) == 0, log.read_text()[-4000:]
        assert not announcement.exists()
        assert not leftover_processes(run.root)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
