"""Start and stop `vllm-router` in front of the inference servers (the orchestrator runs it as a child).

Completions go through the router (with the recipe's policy) carrying only the run's *api key*;
admin calls (pause/reload/resume) go to every server's own URL with the admin token, never through
the router (see `auth.py`).

vllm-router's control routes (`/add_worker`, `/remove_worker`, `/workers`, ...) cannot be turned
off, and its CLI has no way to guard them. Its Rust core can: with `api_key_validation_urls` every
route (control, health and completions alike) needs a bearer that one of those URLs answers 200 to.
So the router runs as `python -m rlctl.inference.router`, which starts that core with the servers'
own `/v1/models` as validators: only the api key (or the admin token, never sent there) passes.
It listens on the loopback only (its one client is the orchestrator on the same node), its Prometheus
exporter too (on its own port: the default 29000 collides between runs), and the orchestrator still compares its worker list with the announced servers
(`check_workers`), aborting the run on any difference.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rlctl.inference.server import ADDRESS_IN_USE, PORT_TRIES, free_port
from rlctl.inference.processes import (has_exited, own_group_dying_with_parent, python_module_argv,
                                       stop_process_group)

log = logging.getLogger("rlctl.router")

# vllm-router's HTTP client keeps an idle connection to a server this long (its server.rs); the servers
# keep theirs longer (server.SERVER_KEEPALIVE_S).
POOL_IDLE_S = 50
NEVER = 2**32 - 1  # a count vllm-router never reaches (its largest u32)

ROUTER_HOST = "127.0.0.1"  # only the orchestrator, on this node, talks to the router
KEY_CHECK_ROUTE = "/v1/models"  # cheap, and open to the api key on every server (auth.py)
# The router child's exit code when one of its two ports was taken before it bound it (EX_TEMPFAIL):
# started again on other ports, up to server.PORT_TRIES in all.
PORT_TAKEN_EXIT = 75


class RouterWorkersChanged(RuntimeError):
    """The router's worker list differs from the servers this run announced (message: one line)."""


def render_router_command(worker_urls: list[str], policy: str, port: int, prometheus_port: int,
                          python: str | None = None) -> list[str]:
    """argv of the router child. Holds no secret: the key is validated by asking the servers."""
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    cmd = [*python_module_argv("rlctl.inference.router", python or sys.executable),
           "--port", str(port), "--prometheus-port", str(prometheus_port), "--policy", policy,
           "--worker-urls", *worker_urls]
    for url in worker_urls:
        cmd += ["--key-check-url", url.rstrip("/") + KEY_CHECK_ROUTE]
    return cmd


def _get(url: str, api_key: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET with the api key; status 0 when the router did not answer."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def list_workers(router_url: str, api_key: str, timeout: float = 5.0) -> list[str]:
    """The worker URLs the router currently routes to (`GET /list_workers`)."""
    status, body = _get(f"{router_url}/list_workers", api_key, timeout)
    if status != 200:
        raise ConnectionError(f"{router_url}/list_workers answered {status or 'nothing'}")
    return list(json.loads(body)["urls"])


def check_workers(router_url: str, api_key: str, expected: list[str]) -> None:
    """Raise RouterWorkersChanged unless the router routes to exactly the `expected` servers."""
    listed = {u.rstrip("/") for u in list_workers(router_url, api_key)}
    wanted = {u.rstrip("/") for u in expected}
    if listed - wanted:
        raise RouterWorkersChanged(f"the router lists a worker this run never announced: "
                                   f"{', '.join(sorted(listed - wanted))}; aborting (was its control route used?)")
    if wanted - listed:
        raise RouterWorkersChanged(f"the router no longer lists the announced server(s) "
                                   f"{', '.join(sorted(wanted - listed))}; aborting")


@dataclass
class RouterProcess:
    """A running router: `url` for completions; `stop()` ends it and everything it spawned."""

    proc: subprocess.Popen
    url: str
    command: list[str]

    def stop(self, timeout_s: float = 5.0) -> int | None:
        return stop_process_group(self.proc, timeout_s)

    def alive(self) -> bool:
        return not has_exited(self.proc)  # without reaping it: stop() still needs its group


def start_router(worker_urls: list[str], policy: str, *, api_key: str, log_path: Path | None = None,
                 timeout_s: float = 60.0) -> RouterProcess:
    """Start the router on a free loopback port, wait until it is healthy (asked with `api_key`, as
    every route needs it) and check that it routes to exactly `worker_urls`."""
    if importlib.util.find_spec("vllm_router_rs") is None:
        raise FileNotFoundError("vllm-router is not installed (it comes with the `cpu`/`gpu` extra: vllm-router)")
    where = f" (log: {log_path})" if log_path else ""
    for tries in range(1, PORT_TRIES + 1):
        router = _spawn(worker_urls, policy, log_path)
        code = _wait_ready(router, api_key, timeout_s, where)
        if code is None:
            break
        if code != PORT_TAKEN_EXIT:
            raise RuntimeError(f"vllm-router exited with code {code} before becoming ready{where}")
        log.warning("vllm-router: a port was taken before it could bind it (try %d of %d)", tries, PORT_TRIES)
    else:
        raise RuntimeError(f"vllm-router: {PORT_TRIES} pairs of ports in a row were taken before it could bind them{where}")
    try:
        check_workers(router.url, api_key, worker_urls)
    except (RouterWorkersChanged, ConnectionError):
        router.stop()
        raise
    return router


def _spawn(worker_urls: list[str], policy: str, log_path: Path | None) -> RouterProcess:
    port, prometheus_port = free_port(ROUTER_HOST), free_port(ROUTER_HOST)
    cmd = render_router_command(worker_urls, policy, port, prometheus_port)
    out = open(log_path, "ab") if log_path is not None else None
    try:
        # Own group (in our session) so stop() can take it down; dies with us if we are killed before stop().
        proc = subprocess.Popen(cmd, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                                stdin=subprocess.DEVNULL, preexec_fn=own_group_dying_with_parent)
    finally:
        if out is not None:
            out.close()
    return RouterProcess(proc, f"http://{ROUTER_HOST}:{port}", cmd)


def _wait_ready(router: RouterProcess, api_key: str, timeout_s: float, where: str) -> int | None:
    """None once the router answers its health route; its exit code if it ends first."""
    deadline = time.monotonic() + timeout_s
    # A short timeout per poll: it answers in milliseconds, and when another process took the port between
    # free_port() and the bind without accepting on it, each poll would otherwise hang 5 s before we see
    # the router's exit.
    while _get(f"{router.url}/health", api_key, timeout=1.0)[0] != 200:
        if not router.alive():
            return router.stop()
        if time.monotonic() > deadline:
            router.stop()
            raise RuntimeError(f"vllm-router not ready after {timeout_s:.0f} s{where}")
        time.sleep(0.05)  # it is ready within a second; every poll we skip delays the first batch
    return None


def main(argv: list[str] | None = None) -> int:
    """Run vllm-router's core in this process with every route behind the key check (blocks)."""
    parser = argparse.ArgumentParser(prog="python -m rlctl.inference.router", description=main.__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prometheus-port", type=int, required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    parser.add_argument("--key-check-url", action="append", required=True,
                        help="a request passes when one of these URLs answers 200 to its bearer (repeatable)")
    parser.add_argument("--health-check-interval-s", type=int, default=60, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    from vllm_router.router import policy_from_str
    from vllm_router_rs import Router

    router = Router(worker_urls=args.worker_urls, policy=policy_from_str(args.policy), host=ROUTER_HOST, port=args.port,
                    api_key_validation_urls=args.key_check_url,
                    # Workers are already healthy when the router starts; don't sleep 30 s between checks.
                    worker_startup_check_interval=1,
                    # The breaker answers 503 for 60 s once ten requests to a server failed in two minutes: a
                    # burst of transient errors (each already retried here) would stall the whole run. A server
                    # that is really gone fails its component, which the launcher's supervision acts on.
                    disable_circuit_breaker=True,
                    # Its health check (every 60 s) marks a server that missed three 5 s deadlines in a row
                    # unhealthy, and the run then gets 503 for every request: a CI run was lost so, its server's
                    # event loop busy with streams on two CPUs. A dead server fails its component instead.
                    health_failure_threshold=NEVER, health_check_interval_secs=args.health_check_interval_s,
                    prometheus_host=ROUTER_HOST, prometheus_port=args.prometheus_port)
    try:
        router.start()
    # A taken port comes back as RuntimeError (the router's own) or as pyo3's PanicException (its
    # Prometheus exporter), which derives from BaseException.
    except BaseException as e:
        if ADDRESS_IN_USE not in str(e):
            raise
        print(f"rlctl.inference.router: {e}", file=sys.stderr, flush=True)
        return PORT_TAKEN_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
