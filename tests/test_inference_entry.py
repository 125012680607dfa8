"""Fast checks of the inference entry point and the admin-token middleware (no vLLM started)."""
from __future__ import annotations

import asyncio
import json

import pytest

from rlctl.inference.__main__ import main
from rlctl.inference.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, AdminAuthMiddleware
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.recipes.load import load_recipe

TOKEN = "run-token-123"


async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def call(app, path: str, headers: dict[str, str] | None = None, method: str = "POST") -> int:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


@pytest.fixture
def guarded(monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(API_KEY_ENV, "run-api-key-456")
    return AdminAuthMiddleware(_ok_app)


@pytest.mark.parametrize("path", ["/pause", "/resume", "/collective_rpc", "/is_paused", "/v1/completions", "/abort_requests"])
def test_admin_routes_need_the_bearer_token(guarded, path):
    assert call(guarded, path) == 401
    assert call(guarded, path, {"Authorization": "Bearer nope"}) == 401
    assert call(guarded, path, {"Authorization": f"Basic {TOKEN}"}) == 401
    assert call(guarded, path, {"Authorization": f"Bearer {TOKEN}"}) == 200


def test_health_probes_stay_open(guarded):
    for path in ("/health", "/metrics", "/ping", "/version"):
        assert call(guarded, path, method="GET") == 200


def test_middleware_refuses_to_start_without_a_token(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.setenv(API_KEY_ENV, "run-api-key-456")
    with pytest.raises(RuntimeError, match=ADMIN_TOKEN_ENV):
        AdminAuthMiddleware(_ok_app)


def make_run(tmp_path, *overrides: str, token: bool = True, api_key: bool = True) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    atomic_write_json(run.recipe_json, load_recipe(["tiny-cpu"], list(overrides)).model_dump(mode="json"))
    if token:
        run.admin_token(create=True)
    if api_key:
        run.api_key(create=True)
    return run


def test_wildcard_bind_host_is_refused(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path)
    monkeypatch.setenv("RLCTL_BIND_HOST", "0.0.0.0")
    assert main(["--run-dir", str(run.root)]) == 1
    assert "not a wildcard" in capsys.readouterr().err


def test_missing_admin_token_is_a_clear_error(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, token=False)
    monkeypatch.setenv("RLCTL_BIND_HOST", "127.0.0.1")
    assert main(["--run-dir", str(run.root)]) == 1
    assert "no admin token" in capsys.readouterr().err


def test_missing_api_key_is_a_clear_error(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, api_key=False)
    monkeypatch.setenv("RLCTL_BIND_HOST", "127.0.0.1")
    assert main(["--run-dir", str(run.root)]) == 1
    err = capsys.readouterr().err
    assert "no api key" in err and "Traceback" not in err


def test_gpu_only_feature_on_a_cpu_run_fails_before_starting_vllm(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, "inference.fp8=true")
    monkeypatch.setenv("RLCTL_BIND_HOST", "127.0.0.1")
    assert main(["--run-dir", str(run.root)]) == 1
    err = capsys.readouterr().err
    assert "inference.fp8: FP8 serving needs GPUs" in err and "Traceback" not in err
    assert not (run.services / "inference").exists()


def test_unsupported_cpu_head_dim_fails_before_starting_vllm(tmp_path, monkeypatch, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}))
    run = make_run(tmp_path, f"model.name={json.dumps(str(model))}")
    monkeypatch.setenv("RLCTL_BIND_HOST", "127.0.0.1")
    assert main(["--run-dir", str(run.root)]) == 1
    assert "head_dim 16" in capsys.readouterr().err


def test_listening_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """A port from the ephemeral range can become the local end of any outgoing connection before the
    server binds it (a server once died of EADDRINUSE that way)."""
    import socket

    from rlctl.inference import server

    low = server.ephemeral_ports()[0]
    ports = {server.free_port("127.0.0.1") for _ in range(20)}
    assert all(server.LISTEN_PORTS[0] <= p < min(server.LISTEN_PORTS[1], low) for p in ports), ports
    with socket.socket() as taken:  # a port in use is never handed out
        taken.bind(("127.0.0.1", 0))
        monkeypatch.setattr(server, "LISTEN_PORTS", (taken.getsockname()[1], taken.getsockname()[1] + 1))
        assert server.free_port("127.0.0.1") != taken.getsockname()[1]  # the OS's pick instead
    monkeypatch.setattr(server, "ephemeral_ports", lambda: (1024, 65535))  # no room below: the OS picks
    assert server.free_port("127.0.0.1") > 0


FAKE_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    do_POST = do_GET  # the warm-up request
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
"""


def test_a_port_taken_before_the_server_binds_it_starts_the_server_again_on_another(tmp_path, monkeypatch, capsys):
    """The server binds its port seconds after free_port found it free; a resumed attempt's server once
    died of EADDRINUSE that way and failed the run. A stand-in server (no vLLM) keeps the entry fast."""
    import signal
    import socket
    import sys
    import threading
    import time

    from rlctl.inference import __main__ as entry

    run = make_run(tmp_path)
    monkeypatch.setenv("RLCTL_BIND_HOST", "127.0.0.1")
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    monkeypatch.setattr(entry, "render_server_command", lambda *a, host, port, **kw: [
        sys.executable, str(tmp_path / "fake.py"), host, str(port)])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held, real_free_port = taken.getsockname()[1], entry.free_port
        first = iter([held])
        monkeypatch.setattr(entry, "free_port", lambda host: next(first, None) or real_free_port(host))
        announced = run.services / "inference" / "0.json"

        def finish_once_announced():
            deadline = time.monotonic() + 60
            while not announced.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            run.done.touch()

        threading.Thread(target=finish_once_announced, daemon=True).start()
        try:
            code = main(["--run-dir", str(run.root)])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"port {held} was taken before the server could bind it; starting it again" in out
    assert "ready at http://127.0.0.1:" in out


def _joined(stream) -> list[str]:
    from rlctl.inference.vllm_main import joined_when_ready

    async def collect():
        return [text async for text in joined_when_ready(stream)]
    return asyncio.run(collect())


async def _bursts(bursts, fail: Exception | None = None):
    """Each burst's events yielded back to back (as vLLM yields a step's choices), a wait between bursts."""
    for burst in bursts:
        for event in burst:
            yield event
        await asyncio.sleep(0.01)
    if fail:
        raise fail


def test_stream_events_ready_at_once_leave_in_one_write():
    bursts = [[f"data: {s}.{c}\n\n" for c in range(16)] for s in range(3)]
    assert _joined(_bursts(bursts)) == ["".join(b) for b in bursts]  # same bytes, same order, 3 writes


def test_stream_error_is_raised_after_the_events_before_it():
    got = []

    async def collect():
        from rlctl.inference.vllm_main import joined_when_ready

        async for text in joined_when_ready(_bursts([["a", "b"], ["c"]], ValueError("engine died"))):
            got.append(text)
    with pytest.raises(ValueError, match="engine died"):
        asyncio.run(collect())
    assert got == ["ab", "c"]


def test_closing_the_joined_stream_cancels_the_request_stream():
    """A client that goes away closes the response's stream; vLLM's generator must see the cancellation
    (it aborts the request there), not keep generating into the queue."""
    from rlctl.inference.vllm_main import joined_when_ready

    seen = []

    async def endless():
        try:
            while True:
                yield "x"
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def first_then_close():
        stream = joined_when_ready(endless())
        first = await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.01)
        return first
    assert asyncio.run(first_then_close()) == "x" and seen == ["cancelled"]


def test_completion_streams_are_joined_in_vllms_server(monkeypatch):
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from rlctl.inference.vllm_main import stream_events_joined

    monkeypatch.setattr(OpenAIServingCompletion, "completion_stream_generator", _events_of_a_step)
    assert stream_events_joined()
    assert _joined(OpenAIServingCompletion.completion_stream_generator(None)) == ["data: 0\n\ndata: 1\n\n"]


async def _events_of_a_step(self):
    for choice in range(2):
        yield f"data: {choice}\n\n"


def test_vllms_server_runs_its_gc_at_the_larger_threshold(monkeypatch, gc_threshold):
    import gc

    from rlctl.inference import vllm_main
    from rlctl.inference.processes import GC_YOUNG_THRESHOLD

    for change in ("load_adapters_in_place_once", "logprobs_without_token_strings", "sampled_logprobs_only",
                   "stream_events_joined"):
        monkeypatch.setattr(vllm_main, change, lambda: True)  # this test process keeps vLLM's own classes
    gc.set_threshold(700, 10, 10)
    vllm_main.patch_vllm()
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
