"""An attached run whose pool ends (`rlctl pool stop`, a crash): its orchestrator fails with one line
saying so, not with the tracebacks of whatever request or reload hit the stopped pool first."""
from __future__ import annotations

import functools
import http.server
import signal
import threading
from types import SimpleNamespace

import pytest

from rlctl.orchestrator import __main__ as orchestrator_main
from rlctl.orchestrator import pool_attach
from rlctl.orchestrator.exchange.layout import RunDir

FAILURE = RuntimeError("group 736: request to http://127.0.0.1:9/runs/fa failed 4 times, last: ClientConnectorError")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args):
        pass


@pytest.fixture
def live_front():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def attached_run(tmp_path, monkeypatch, front: str) -> RunDir:
    """Run fa attached to pool fp through `front`, whose loop fails with FAILURE."""
    run = RunDir(tmp_path / "fa")
    run.create()
    RunDir(tmp_path / "pools" / "fp").create()
    monkeypatch.setattr(pool_attach, "open_session", lambda _run, _name: pool_attach.PoolSession(front, "k", "fa"))
    monkeypatch.setattr(pool_attach, "pool_gone", functools.partial(pool_attach.pool_gone, wait_s=0.5))
    monkeypatch.setattr(signal, "signal", lambda *_args: None)  # the orchestrator's SIGTERM handler, not pytest's

    async def failing(*_args, **_kwargs):
        raise FAILURE

    monkeypatch.setattr(orchestrator_main, "orchestrate", failing)
    return run


def in_pool(run: RunDir):
    return orchestrator_main._orchestrate_in_pool(run, SimpleNamespace(deployment=SimpleNamespace(inference_pool="fp")))


def test_a_pool_whose_front_is_gone_fails_the_run_in_one_line(tmp_path, monkeypatch):
    run = attached_run(tmp_path, monkeypatch, "http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(orchestrator_main.OrchestratorError) as err:
        in_pool(run)
    assert str(err.value) == "pool fp is gone (stopped or failed): `rlctl resume fa` once it runs again"


def test_a_stopped_pool_fails_the_run_in_one_line(tmp_path, monkeypatch, live_front):
    run = attached_run(tmp_path, monkeypatch, live_front)  # the front still answers, DONE is written
    (tmp_path / "pools" / "fp" / "DONE").write_text("{}")
    with pytest.raises(orchestrator_main.OrchestratorError, match="pool fp is gone"):
        in_pool(run)


def test_a_failure_while_the_pool_runs_is_the_runs_own(tmp_path, monkeypatch, live_front):
    run = attached_run(tmp_path, monkeypatch, live_front)
    with pytest.raises(RuntimeError) as err:
        in_pool(run)
    assert err.value is FAILURE
