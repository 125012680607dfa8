"""Component heartbeats: the writer's throttling and the stall rule, and `rlctl monitor` marking a
component `stalled` (exit 1 with --wait, one line naming it) while a live one is not."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from rlctl.launchers.status import run_state
from rlctl.orchestrator.exchange.procstat import start_epoch
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.heartbeat import Beat, Heartbeat, read_beats, stalled_for
from rlctl.orchestrator.exchange.layout import RunDir

STALL_S = 2.0


def running_run(tmp_path, name: str = "hb", stall_s: float = STALL_S) -> RunDir:
    """A local run whose supervisor and trainer are this (live) test process, started a while ago."""
    run = RunDir(tmp_path / name)
    run.create()
    started = start_epoch(os.getpid())
    time.sleep(max(0.0, started + 2 * STALL_S - time.time()))  # the clock of a process starts at its start
    atomic_write_json(run.manifest, {"name": name, "scheduler": "local", "job_id": None, "attempt": 0,
                                     "groups": [{"name": "trainer", "het_index": 0}],
                                     "recipe": {"orchestrator": {"max_steps": 10},
                                                "monitoring": {"stall_timeout_s": stall_s}}})
    record = {"pid": os.getpid(), "state": "running", "host": socket.gethostname(), "started": started}
    atomic_write_json(run.status / "supervisor.json", record)
    atomic_write_json(run.status / "trainer.trainer.0.json", record)
    return run


def write_beat(run: RunDir, component: str, progress_age_s: float, waiting_for: str | None = None, beat_age_s: float = 0.0):
    now = time.time()
    atomic_write_json(run.heartbeats / f"{component}.json", {
        "component": component, "time": now - beat_age_s, "progress": 3, "progress_time": now - progress_age_s,
        "waiting_for": waiting_for, "pid": os.getpid(), "host": socket.gethostname(), "attempt": "0"})


def test_writer_beats_on_progress_and_every_interval_while_waiting(tmp_path):
    run = RunDir(tmp_path)
    hb = Heartbeat(run, "trainer", interval_s=0.2)
    assert hb.beat(0) and not hb.beat(0)  # the same progress within the interval: nothing written
    assert hb.beat(1)  # progress: written at once
    assert hb.beat(1, waiting_for="rollouts/step_1")  # starts waiting: written at once
    assert not hb.beat(1, waiting_for="rollouts/step_1")
    time.sleep(0.25)
    assert hb.beat(1, waiting_for="rollouts/step_1")  # still waiting after the interval: a new beat
    (beat,) = read_beats(run)
    assert (beat.component, beat.progress, beat.waiting_for, beat.pid) == ("trainer", 1, "rollouts/step_1", os.getpid())
    assert beat.time > beat.progress_time
    assert oct((run.heartbeats / "trainer.json").stat().st_mode & 0o777) == "0o600"


def test_stall_rule():
    now = 1000.0
    working = Beat("trainer", time=now - 100, progress=5, progress_time=now - 100, waiting_for=None, pid=1, host="h")
    assert stalled_for(working, 60, now) == pytest.approx(100)
    assert stalled_for(working, 200, now) is None
    # waiting on another component restarts the clock with every beat; a waiting beat that stopped does not
    waiting = Beat("trainer", time=now - 5, progress=5, progress_time=now - 500, waiting_for="rollouts/step_5", pid=1, host="h")
    assert stalled_for(waiting, 60, now) is None
    frozen = Beat("trainer", time=now - 90, progress=5, progress_time=now - 500, waiting_for="rollouts/step_5", pid=1, host="h")
    assert stalled_for(frozen, 60, now) == pytest.approx(90)
    # a beat from before the component's process started (an earlier attempt) does not count
    assert stalled_for(working, 60, now, since=now - 10) is None


def test_stale_heartbeat_is_stalled_and_wait_exits_1_naming_it(cli, tmp_path):
    run = running_run(tmp_path)
    write_beat(run, "trainer", progress_age_s=STALL_S + 60)
    write_beat(run, "orchestrator", progress_age_s=STALL_S + 60, waiting_for="trainer (policy v4)", beat_age_s=1)
    data = json.loads(cli("monitor", run.root, "--once", "--json").stdout)
    assert data["state"] == "running" and data["stalled"] == ["trainer"]
    assert {c["name"]: c["state"] for c in data["components"]} == {"trainer.trainer.0": "stalled"}
    rows = {h["component"]: h for h in data["heartbeats"]}
    assert rows["trainer"]["stalled"] and rows["trainer"]["stalled_s"] > STALL_S
    assert not rows["orchestrator"]["stalled"] and rows["orchestrator"]["waiting_for"] == "trainer (policy v4)"
    assert "stalled: trainer" in data["reason"] and "monitoring.stall_timeout_s" in data["reason"]

    started = time.monotonic()
    result = cli("monitor", run.root, "--wait", "--interval", "0.1", "--timeout", "30")
    assert result.exit_code == 1 and time.monotonic() - started < 10
    said = result.stdout.strip().splitlines()  # as `launch --wait` ends: why, then the verdict
    assert any(line.startswith("run hb stalled: trainer (no progress for") and "monitoring.stall_timeout_s = 2" in line
               for line in said), said
    assert said[-1].startswith("run STALLED (exit code 1)"), said

    screen = cli("monitor", run.root, "--once").stdout
    assert "stalled" in screen and "trainer" in screen


def test_live_heartbeat_is_not_stalled(cli, tmp_path):
    run = running_run(tmp_path)
    write_beat(run, "trainer", progress_age_s=0)
    write_beat(run, "inference.0", progress_age_s=STALL_S * 10, waiting_for="server startup")
    data = json.loads(cli("monitor", run.root, "--json").stdout)
    assert data["stalled"] == [] and all(not h["stalled"] for h in data["heartbeats"])
    assert {c["state"] for c in data["components"]} == {"running"}
    # --wait keeps following a live run: it ends on its --timeout (exit 3), not as stalled
    assert cli("monitor", run.root, "--wait", "--interval", "0.1", "--timeout", "1").exit_code == 3


def test_stale_heartbeat_of_an_ended_or_restarted_run_is_not_stalled(cli, tmp_path):
    # A timeout well above the monitor's own run time under load: the restarted trainer's clock runs
    # from its start (a second ago, recorded to the second), and only the old beat is past it.
    run = running_run(tmp_path, stall_s=30.0)
    write_beat(run, "trainer", progress_age_s=30.0 + 60)
    # the trainer process started after that beat (a new attempt): its clock starts at its start
    record = json.loads((run.status / "trainer.trainer.0.json").read_text())
    atomic_write_json(run.status / "trainer.trainer.0.json", {**record, "started": time.time() - 1})
    assert json.loads(cli("monitor", run.root, "--json").stdout)["stalled"] == []
    # a run that ended is not judged
    atomic_write_json(run.status / "trainer.trainer.0.json", record)
    atomic_write_json(run.status / "supervisor.json", {"pid": os.getpid(), "state": "exited", "returncode": 0})
    run.done.write_text("{}")
    assert run_state(run.root).state == "completed"
    data = json.loads(cli("monitor", run.root, "--json").stdout)
    assert data["stalled"] == [] and data["state"] == "completed"
