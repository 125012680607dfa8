"""Who may call which route: the servers' two keys (api key for /v1, admin token for the rest), the
router's control routes behind the api key, and the orchestrator's check of the router's worker list.

The router tests start the real vllm-router the way the orchestrator does (`start_router`) in front of
a recording stand-in server, and try to slip in a second recording server the way another user on
the node could (`POST /add_worker?url=...` without credentials).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sim_inference import sim_server

from rlctl.inference.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, AdminAuthMiddleware
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.orchestrator.exchange.steps import MARKER
from rlctl.recipes.load import load_recipe

ADMIN, API = "admin-token-abc", "api-key-xyz"


# ---- the servers' middleware ---------------------------------------------------------------------
async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(app, path: str, bearer: str | None = None, method: str = "POST") -> int:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    headers = [(b"authorization", f"Bearer {bearer}".encode())] if bearer else []
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(API_KEY_ENV, API)
    return AdminAuthMiddleware(_ok_app)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
def test_api_key_and_admin_token_open_the_openai_routes(guarded, path):
    assert call(guarded, path) == 401
    assert call(guarded, path, API) == 200
    assert call(guarded, path, ADMIN) == 200


@pytest.mark.parametrize("path", ["/pause", "/resume", "/collective_rpc", "/abort_requests", "/is_paused",
                                  "/tokenize", "/reset_prefix_cache", "/v1/../collective_rpc", "/v1//pause"])
def test_api_key_is_refused_on_admin_routes_which_take_the_admin_token(guarded, path):
    assert call(guarded, path, API) == 401
    assert call(guarded, path) == 401
    assert call(guarded, path, ADMIN) == 200


@pytest.mark.parametrize("env", [{ADMIN_TOKEN_ENV: ADMIN}, {API_KEY_ENV: API}, {ADMIN_TOKEN_ENV: API, API_KEY_ENV: API}])
def test_middleware_needs_two_distinct_keys(monkeypatch, env):
    for name in (ADMIN_TOKEN_ENV, API_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="RLCTL_"):
        AdminAuthMiddleware(_ok_app)


# ---- the real router -----------------------------------------------------------------------------
class RecordingServer:
    """A stand-in vLLM server that records the Authorization header of every request it gets.
    `/v1/...` answers 200 to the api key or the admin token (as auth.py does), 401 otherwise;
    `hang_completions` holds completions open (an intruder that never answers); `/health` answers 503
    while `sick` is set."""

    def __init__(self, hang_completions: bool = False):
        self.seen: list[tuple[str, str, str | None]] = []
        self.sick = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                auth = self.headers.get("Authorization")
                outer.seen.append((self.command, self.path, auth))
                if self.path.startswith("/v1/") and auth not in (f"Bearer {API}", f"Bearer {ADMIN}"):
                    return self._send(401, {"error": "unauthorized"})
                if self.path == "/health" and outer.sick:
                    return self._send(503, {})
                if self.path.startswith("/v1/completions") and hang_completions:
                    time.sleep(20)
                self._send(200, {"object": "list", "data": [{"id": "policy"}], "choices": []})

            def _send(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def tokens_seen(self) -> set[str | None]:
        return {auth for _, _, auth in self.seen}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def post(url: str, bearer: str | None = None, body: bytes = b"", method: str = "POST") -> int:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {bearer}"} if bearer else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method), timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def routed(tmp_path):
    from rlctl.inference.router import start_router

    server, intruder = RecordingServer(), RecordingServer(hang_completions=True)
    router = start_router([server.url], "round_robin", api_key=API, log_path=tmp_path / "router.log")
    try:
        yield router, server, intruder
    finally:
        router.stop()
        server.close()
        intruder.close()


def test_failed_health_checks_do_not_take_the_runs_server_away(tmp_path):
    """vllm-router marks a server that fails three health checks in a row unhealthy and then answers
    every request 503 (a CI run was lost so, its server too busy to answer /health within 5 s): our
    router never does; a server that is really gone fails its component instead."""
    from rlctl.inference.processes import stop_process_group
    from rlctl.inference.router import render_router_command
    from rlctl.inference.server import free_port

    server = RecordingServer()
    port = free_port("127.0.0.1")
    cmd = [*render_router_command([server.url], "round_robin", port, free_port("127.0.0.1")),
           "--health-check-interval-s", "1"]
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    body = json.dumps({"model": "policy", "prompt": "a", "max_tokens": 1}).encode()

    def complete() -> int:
        try:
            return post(f"http://127.0.0.1:{port}/v1/completions", API, body)
        except urllib.error.URLError:  # not listening yet
            return 0
    try:
        deadline = time.monotonic() + 60
        while complete() != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.2)
        server.sick = True
        deadline = time.monotonic() + 30
        while sum(path == "/health" for _, path, _ in server.seen) < 8:  # well past three failures in a row
            assert time.monotonic() < deadline, server.seen
            time.sleep(0.2)
        assert complete() == 200
    finally:
        stop_process_group(proc, 5.0)
        server.close()


def test_the_router_starts_again_on_other_ports_when_one_is_taken_before_it_binds(tmp_path, monkeypatch, caplog):
    """Between free_port and the router's bind another process can take a port: its main port (the
    router's own RuntimeError) or its exporter's (a pyo3 panic). Either way it is started on new ports;
    three pairs taken in a row fail in one line."""
    import socket

    from rlctl.inference import router as router_mod

    holders: list[socket.socket] = []

    def taken_port(host: str) -> int:
        s = socket.socket()
        s.bind((host, 0))  # bound, not listening: the router's bind fails, and a poll is refused at once
        holders.append(s)
        return s.getsockname()[1]

    def ports(*taken: bool):  # free_port's answers in turn: (main, exporter) per try
        answers = iter(taken)
        monkeypatch.setattr(router_mod, "free_port",
                            lambda host: (taken_port if next(answers) else real_free_port)(host))

    real_free_port = router_mod.free_port
    server = RecordingServer()
    try:
        ports(True, False, False, True, False, False)
        with caplog.at_level("WARNING", logger="rlctl.router"):
            router = router_mod.start_router([server.url], "round_robin", api_key=API, log_path=tmp_path / "r.log")
        try:
            body = json.dumps({"model": "policy", "prompt": "a", "max_tokens": 1}).encode()
            assert post(f"{router.url}/v1/completions", API, body) == 200
        finally:
            router.stop()
        assert [r.getMessage() for r in caplog.records] == [
            f"vllm-router: a port was taken before it could bind it (try {n} of 3)" for n in (1, 2)]
        ports(*[True, False] * 3)
        with pytest.raises(RuntimeError, match="3 pairs of ports in a row were taken") as caught:
            router_mod.start_router([server.url], "round_robin", api_key=API, log_path=tmp_path / "r.log")
        assert "\n" not in str(caught.value)
    finally:
        server.close()
        for s in holders:
            s.close()
    said = [line for line in (tmp_path / "r.log").read_text().splitlines() if line.startswith("rlctl.inference.router:")]
    assert len(said) == 5 and all("Address already in use" in line for line in said), said


def test_control_routes_refuse_an_unauthenticated_add_worker(routed):
    from rlctl.inference.router import check_workers, list_workers

    router, server, intruder = routed
    assert router.url.startswith("http://127.0.0.1:")  # loopback only
    assert not any(API in part or ADMIN in part for part in router.command)  # no key on the command line
    for bearer in (None, "guess", ADMIN[:-1]):
        assert post(f"{router.url}/add_worker?url={intruder.url}", bearer) == 401
        assert post(f"{router.url}/workers", bearer, json.dumps({"url": intruder.url}).encode()) == 401
        assert post(f"{router.url}/remove_worker?url={server.url}", bearer) == 401
        assert post(f"{router.url}/list_workers", bearer, method="GET") == 401
    assert list_workers(router.url, API) == [server.url]
    check_workers(router.url, API, [server.url])
    # Completions through the router carry the api key, and only it.
    body = json.dumps({"model": "policy", "prompt": "a", "max_tokens": 1}).encode()
    assert post(f"{router.url}/v1/completions", API, body) == 200
    assert ("POST", "/v1/completions", f"Bearer {API}") in server.seen
    assert f"Bearer {ADMIN}" not in server.tokens_seen()
    assert intruder.seen == []  # never added, never asked anything


def test_worker_check_names_a_worker_the_run_did_not_announce(routed):
    from rlctl.inference.router import RouterWorkersChanged, check_workers

    router, server, intruder = routed
    # A key holder (or a hole in the control routes) changes the list: the check must notice.
    assert post(f"{router.url}/add_worker?url={intruder.url}", API) == 200
    with pytest.raises(RouterWorkersChanged) as caught:
        check_workers(router.url, API, [server.url])
    assert intruder.url in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(RouterWorkersChanged, match="no longer lists"):
        check_workers(router.url, API, [server.url, intruder.url, "http://127.0.0.1:9"])


def test_orchestrator_aborts_in_one_line_when_the_router_gains_a_worker(tmp_path):
    recipe = load_recipe([str(Path(__file__).parents[1] / "recipes" / "tiny-cpu.toml")],
                         ["orchestrator.max_steps=50", "orchestrator.rollouts_per_step=8",
                          "orchestrator.group_size=4", "orchestrator.max_tokens=50"])
    run = RunDir(tmp_path / "run")
    run.create()
    run.recipe_json.write_text(json.dumps(recipe.model_dump(mode="json")))
    (run.configs / "placement.json").write_text(json.dumps(Placement(1, 1, 2, 1, 0, "inference_node").to_dict()))
    admin, api = run.admin_token(create=True), run.api_key(create=True)
    (run.weights / "step_0").mkdir(parents=True)
    (run.weights / "step_0" / MARKER).write_text("{}")
    intruder = RecordingServer(hang_completions=True)
    try:
        with sim_server(token_delay=0.05, token=admin, api_key=api) as url:
            run.announce("inference", "0", {"url": url, "index": 0, "pid": 0, "host": "127.0.0.1"})
            env = {**os.environ, "RLCTL_ATTEMPT": "1", "RLCTL_WORKER_CHECK_S": "0.3"}
            proc = subprocess.Popen([sys.executable, "-m", "rlctl.orchestrator", "--run-dir", str(run.root)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 60
                while not run.announced("router") and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                router = run.announced("router")[0]
                assert post(f"{router['url']}/add_worker?url={intruder.url}", api) == 200
                out, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    finally:
        intruder.close()
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    errors = [line for line in err.splitlines() if line.strip()]
    assert len(errors) == 1 and intruder.url in errors[0] and errors[0].startswith("orchestrator: error:"), err
    assert "Traceback" not in err and not run.done.exists()
    assert f"Bearer {admin}" not in intruder.tokens_seen()  # the admin token never goes through the router
