"""Start and stop `vllm-router` in front of the inference servers (the orchestrator runs it as a child).

Completions go through the router (with the recipe's policy); admin calls (pause/reload/resume) go
to every server directly, because the router forwards unknown routes to a single backend.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rlctl.inference.server import free_port
from rlctl.inference.processes import die_with_parent


def router_executable() -> str:
    """The `vllm-router` next to this interpreter (venvs without activation), else the one on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError("vllm-router is not installed (it comes with the `cpu`/`gpu` extra: vllm-router)")
    return found


def render_router_command(worker_urls: list[str], policy: str, host: str, port: int, prometheus_port: int,
                          executable: str | None = None) -> list[str]:
    """argv of the router. Each router needs its own Prometheus port (the default 29000 collides)."""
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    return [
        executable or router_executable(),
        "--host", host, "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        # Workers are already healthy when the router starts; don't sleep 30 s between checks.
        "--worker-startup-check-interval", "1",
    ]


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after `timeout_s`; returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while workers it spawned linger in the group: make sure they are too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return 0


@dataclass
class RouterProcess:
    """A running router: `url` for completions; `stop()` ends it and everything it spawned."""

    proc: subprocess.Popen
    url: str
    command: list[str]

    def stop(self, timeout_s: float = 10.0) -> int | None:
        return stop_process_group(self.proc, timeout_s)

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_router(worker_urls: list[str], policy: str, host: str, *, log_path: Path | None = None,
                 timeout_s: float = 60.0) -> RouterProcess:
    """Start the router on a free port of `host` and wait until it reports healthy workers."""
    port, prom = free_port(host), free_port(host)
    cmd = render_router_command(worker_urls, policy, host, port, prom)
    out = open(log_path, "ab") if log_path is not None else None
    try:
        # Own session so stop() can take its group down; dies with us if we are killed before stop().
        proc = subprocess.Popen(cmd, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
    finally:
        if out is not None:
            out.close()
    router = RouterProcess(proc, f"http://{host}:{port}", cmd)
    deadline = time.monotonic() + timeout_s
    while _get(f"{router.url}/health") != 200:
        if not router.alive():
            raise RuntimeError(f"vllm-router exited with code {proc.returncode} before becoming ready"
                               + (f" (log: {log_path})" if log_path else ""))
        if time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(f"vllm-router not ready after {timeout_s:.0f} s" + (f" (log: {log_path})" if log_path else ""))
        time.sleep(0.2)
    return router
