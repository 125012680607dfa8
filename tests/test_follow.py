"""The follow loop of `launch --wait` / `monitor --wait` ends when there is nothing left to follow; `rlctl logs` output."""
import json
import shutil

from typer.testing import CliRunner

from rlctl.cli import follow as follow_module
from rlctl.cli.main import app


def _pending_run(tmp_path):
    run = tmp_path / "r-1"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"name": "r-1", "scheduler": "local", "attempt": 1}))
    return run


def test_a_deleted_run_directory_ends_the_wait_as_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(follow_module, "GONE_S", 0.3)
    run = _pending_run(tmp_path)
    shutil.rmtree(run)  # deleted while followed: the state is unknown from then on, and would stay so
    summary = follow_module.follow(run, quiet=True, interval=0.05, timeout=30)
    assert summary["state"] == "lost" and "run.json is gone" in summary["reason"]
    assert not summary.get("timed_out")
    assert follow_module.exit_code(summary) == 1


def test_a_run_that_keeps_its_manifest_is_followed_until_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(follow_module, "GONE_S", 0.1)
    summary = follow_module.follow(_pending_run(tmp_path), quiet=True, interval=0.05, timeout=0.5)
    assert summary.get("timed_out") and summary["state"] != "lost"


def test_monitor_wait_names_why_the_run_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(follow_module, "GONE_S", 0.2)
    run = _pending_run(tmp_path)

    def vanish(*args, **kwargs):  # deleted after the command found it
        shutil.rmtree(run, ignore_errors=True)
        return real(*args, **kwargs)

    real = follow_module.snapshot
    monkeypatch.setattr(follow_module, "snapshot", vanish)
    r = CliRunner().invoke(app, ["monitor", str(run), "--wait", "--interval", "0.05", "--timeout", "30"])
    assert r.exit_code == 1 and "lost" in r.output and "run.json is gone" in r.output, r.output


def test_sigterm_stops_the_following_only_and_says_so(tmp_path, capsys):
    import os
    import signal
    import threading

    import pytest

    run = _pending_run(tmp_path)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()  # a CI job's timeout
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(follow_module.Detached) as stopped:
        follow_module.follow_or_detach(run, "r-1", quiet=True, interval=0.05, timeout=30)
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) is handler  # restored
    assert "stopped following; run r-1 keeps running (`rlctl monitor r-1`, `rlctl cancel r-1`)" in capsys.readouterr().err


def test_logs_put_each_header_on_its_own_line(tmp_path, monkeypatch):
    """A log cut off mid-line (a process killed, a library's last words without a newline) ran into the
    next file's header."""
    run = _pending_run(tmp_path)
    for group, text in (("inference", "leaked 3 instances"), ("trainer", "trained\n")):
        (run / "logs" / "attempt_0" / group).mkdir(parents=True)
        (run / "logs" / "attempt_0" / group / f"{group}.0.log").write_text(text)
    r = CliRunner().invoke(app, ["logs", str(run), "--attempt", "0"])
    assert r.exit_code == 0, r.output
    assert "leaked 3 instances\n==> logs/attempt_0/trainer/trainer.0.log <==\ntrained\n" in r.output, r.output


def test_a_dry_run_is_shown_as_one_and_ends_a_wait(tmp_path, monkeypatch):
    """`launch --dry-run` starts nothing: `runs`/`monitor` said "pending, launcher starting" and
    `monitor --wait` waited forever. It is a state of its own, which `rlctl resume` starts."""
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    runner = CliRunner()
    assert runner.invoke(app, ["launch", "tiny-cpu", "--dry-run", "--name", "d"]).exit_code == 0
    r = runner.invoke(app, ["monitor", "d", "--json"])
    state = json.loads(r.output)
    assert state["state"] == "dry-run" and "rlctl resume d" in state["reason"], state
    r = runner.invoke(app, ["monitor", "d", "--wait", "--timeout", "30"])
    assert r.exit_code == 1, r.output  # ended at once: not the --timeout (3)
    summary = follow_module.follow(tmp_path / "d", quiet=True, interval=0.05, timeout=30)
    assert follow_module.verdict(summary) == "NOT STARTED (a dry run)" and not summary.get("timed_out")
