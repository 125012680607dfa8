"""`rlctl monitor` / `rlctl runs` against run dirs kept by a real (small) supervisor process that follows
the local launcher's contract: status/*.json with real pids, metrics/<writer>.jsonl, logs/latest, DONE."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.launchers.status import resolve_run, run_state

# A supervisor like the local launcher's: starts component processes, records their pids, appends
# metrics per step, records exit codes, writes DONE only when everything exited 0.
SUPERVISOR = r'''
import json, os, socket, subprocess, sys, time
from pathlib import Path
from rlctl.orchestrator.exchange.files import append_jsonl, atomic_write_json
run, steps, step_s, trainer_rc = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
status, host = run / "status", socket.gethostname()
logs = run / "logs" / "attempt_1"
os.symlink("attempt_1", run / "logs" / "latest")
atomic_write_json(status / "supervisor.json", {"pid": os.getpid(), "state": "running", "returncode": None, "host": host, "started": time.time()})
child = "import sys, time; time.sleep(float(sys.argv[1])); print(sys.argv[3], flush=True); sys.exit(int(sys.argv[2]))"
procs = {}
for group, comp, rank, rc, msg in [("orchestrator", "orchestrator", 0, 0, "orchestrator finished"),
                                   ("inference", "server", 0, 0, "server stopped"),
                                   ("trainer", "trainer", 0, trainer_rc, "Traceback (most recent call last):\nRuntimeError: boom" if trainer_rc else "trained"),
                                   ("trainer", "trainer", 1, 0, "trained")]:
    (logs / group).mkdir(parents=True, exist_ok=True)
    log = open(logs / group / f"{comp}.{rank}.log", "w")
    p = subprocess.Popen([sys.executable, "-c", child, str(steps * step_s), str(rc), msg], stdout=log, stderr=subprocess.STDOUT)
    name = f"{group}.{comp}.{rank}"
    procs[name] = p
    atomic_write_json(status / f"{name}.json", {"pid": p.pid, "state": "running", "returncode": None, "host": host, "started": time.time(), "ended": None})
for step in range(steps):
    time.sleep(step_s)
    now = time.time()
    append_jsonl(run / "metrics" / "orchestrator.jsonl", {"component": "orchestrator", "step": step, "time": now, "reward_mean": 0.1 + 0.05 * step,
        "orchestrator_step_time_s": 1.0 + 0.1 * (step % 3), "wait_policy_s": 0.25, "rollouts_per_s": 40.0 + step,
        "tokens_per_s": 320.0, "off_policy_lag_mean": 0.5 + 0.1 * (step % 2), "off_policy_lag_max": 1, "dropped_groups": 0,
        "weight_reload_s": 0.05, "policy_version": step})
    append_jsonl(run / "metrics" / "trainer.jsonl", {"component": "trainer", "step": step, "time": now, "trainer_step_time_s": 0.8 + 0.05 * step,
        "wait_batch_s": 0.2, "loss": 0.5, "mismatch_kl": 0.001, "entropy": 1.2, "grad_norm": 0.3, "weight_publish_s": 0.04, "tokens": 512})
rc = 0
for name, p in procs.items():
    code = p.wait()
    rc = rc or code
    atomic_write_json(status / f"{name}.json", {"pid": p.pid, "state": "exited", "returncode": code, "host": host, "started": None, "ended": time.time()})
if rc == 0:
    (run / "DONE").write_text("")
atomic_write_json(status / "supervisor.json", {"pid": os.getpid(), "state": "exited", "returncode": rc, "host": host})
sys.exit(rc)
'''

PLAN = {"trainer_step_time_s": 0.9, "orchestrator_step_time_s": 1.1, "async_step_time_s": 1.1}


def make_run(root: Path, name: str, steps: int = 6, max_steps: int | None = None, step_s: float = 0.0,
             trainer_rc: int = 0) -> tuple[Path, subprocess.Popen]:
    run = root / name
    for sub in ("status", "logs", "configs"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_json(run / "run.json", {
        "name": name, "run_dir": str(run), "scheduler": "local", "job_id": None, "attempt": 1,
        "groups": [{"name": g, "het_index": i, "nodes": 1, "ntasks_per_node": n}
                   for i, (g, n) in enumerate((("orchestrator", 1), ("inference", 1), ("trainer", 2)))],
        "recipe": {"name": name, "orchestrator": {"max_steps": max_steps or steps}}, "plan": PLAN,
        "placement": {}, "rlctl_version": "0.1.0", "git_commit": None, "submit_time": time.time(), "host": "localhost",
    })
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(run), str(steps), str(step_s), str(trainer_rc)])
    return run, proc


@pytest.fixture
def finished(tmp_path):
    run, proc = make_run(tmp_path, "tiny-ok", steps=6)
    assert proc.wait(timeout=60) == 0
    return run


def test_once_json_on_finished_run(cli, finished):
    result = cli("monitor", finished, "--once", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["state"] == "completed"
    assert data["step"] == 5 and data["steps_done"] == 6 and data["max_steps"] == 6
    assert data["reward_mean"] == pytest.approx(0.1 + 0.05 * 5)
    assert data["reward_first"] == pytest.approx(0.1)
    assert {c["name"] for c in data["components"]} == {
        "orchestrator.orchestrator.0", "inference.server.0", "trainer.trainer.0", "trainer.trainer.1"}
    assert all(c["state"] == "completed" for c in data["components"])
    assert data["predicted"]["trainer_step_time_s"] == 0.9
    # median over steps 0..5 of 0.8 + 0.05*step
    assert data["measured"]["trainer_step_time_s"] == pytest.approx(0.8 + 0.05 * 2.5)
    # waiting over the trainer's wall time: wait + step + publish (its step time leaves out both)
    assert data["idle"]["trainer"] == pytest.approx(1.2 / (1.2 + sum(0.8 + 0.05 * s for s in range(6)) + 6 * 0.04))
    assert data["idle"]["inference"] == pytest.approx(6 * 0.25 / sum(1.0 + 0.1 * (s % 3) for s in range(6)))
    assert data["errors"] == []


def test_live_view_exits_with_the_run_state(cli, finished):
    result = cli("monitor", finished, "--interval", "0.1")
    assert result.exit_code == 0, result.output
    assert "6/6 steps" in result.stdout and "completed" in result.stdout


def test_run_resolved_by_name_under_root(cli, finished):
    assert resolve_run("tiny-ok", finished.parent) == finished
    result = cli("monitor", "tiny-ok", "--root", finished.parent, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["state"] == "completed"


def test_failed_run_reports_component_and_traceback(cli, tmp_path):
    run, proc = make_run(tmp_path, "tiny-bad", steps=3, trainer_rc=1)
    assert proc.wait(timeout=60) == 1
    data = json.loads(cli("monitor", run, "--json").stdout)
    assert data["state"] == "failed"
    assert "trainer.trainer.0" in data["reason"]
    assert any("RuntimeError: boom" in e["line"] for e in data["errors"])
    assert all(e["file"] == "trainer/trainer.0.log" for e in data["errors"])


def test_wait_exit_codes(cli, tmp_path):
    ok, ok_proc = make_run(tmp_path, "wait-ok", steps=4, step_s=0.3)
    bad, bad_proc = make_run(tmp_path, "wait-bad", steps=4, step_s=0.3, trainer_rc=3)
    try:
        assert run_state(ok).state in ("pending", "running")
        started = time.monotonic()
        result = cli("monitor", ok, "--wait", "--interval", "0.2")
        assert result.exit_code == 0, result.output
        assert time.monotonic() - started > 0.5  # it really waited for the run
        assert "wait-ok: completed step 4/4" in result.stderr
        result = cli("monitor", bad, "--wait", "--interval", "0.2", "--json")
        assert result.exit_code == 1
        assert json.loads(result.stdout)["state"] == "failed"
    finally:
        for p in (ok_proc, bad_proc):
            p.wait(timeout=60)
    result = cli("monitor", tmp_path / "no-such-run", "--wait")
    assert result.exit_code == 2
    assert "no-such-run" in result.stderr and "Traceback" not in result.output
    assert cli("monitor", ok, "--interval", "0").exit_code == 2


def test_killed_launcher_is_lost(cli, tmp_path):
    run, proc = make_run(tmp_path, "killed", steps=50, step_s=0.2)
    try:
        deadline = time.time() + 30
        while run_state(run).state != "running" and time.time() < deadline:
            time.sleep(0.1)
        assert run_state(run).state == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        status = run_state(run)
        assert status.state == "lost" and str(proc.pid) in status.reason
        assert cli("monitor", run, "--wait", "--interval", "0.1").exit_code == 1
    finally:
        for f in (run / "status").glob("*.*.*.json"):  # the orphaned component processes
            pid = json.loads(f.read_text())["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_tui_renders_to_text(finished):
    from rich.console import Console

    from rlctl.cli.monitor_view import BLOCKS, render_status
    from rlctl.launchers.run_summary import log_errors
    from rlctl.orchestrator.exchange.metrics import read_records

    status = run_state(finished)
    metrics = read_records(finished)
    console = Console(record=True, width=130, color_system=None)
    console.print(render_status(status, metrics, log_errors(finished)))
    text = console.export_text()
    for expected in ("tiny-ok", "completed", "trainer.trainer.1", "6/6 steps (100%)", "reward",
                     "trainer step (s)", "orchestrator step (s)", "off-policy lag", "rollouts/s",
                     "idle", "async_step_time_s=1.1"):
        assert expected in text, expected
    reward_line = next(line for line in text.splitlines() if line.strip("│ ").startswith("reward"))
    # reward rises every step: the sparkline climbs from the lowest to the highest block
    spark = "".join(ch for ch in reward_line if ch in BLOCKS)
    assert len(spark) == 6 and spark[0] == BLOCKS[0] and spark[-1] == BLOCKS[-1] and list(spark) == sorted(spark)
    trainer_line = next(line for line in text.splitlines() if "trainer step (s)" in line)
    assert "0.9" in trainer_line  # the plan's prediction beside the measured median


def test_tui_shows_progress_and_eta_while_running(tmp_path):
    from rich.console import Console

    from rlctl.cli.monitor_view import render_status
    from rlctl.orchestrator.exchange.metrics import read_records

    run, proc = make_run(tmp_path, "live", steps=4, max_steps=40, step_s=0.3)
    try:
        deadline = time.time() + 30
        while len(read_records(run)) < 6 and time.time() < deadline:
            time.sleep(0.1)
        console = Console(record=True, width=130, color_system=None)
        console.print(render_status(run_state(run), read_records(run)))
        text = console.export_text()
        assert "running" in text and "/40 steps" in text and "ETA" in text
    finally:
        proc.wait(timeout=60)


def test_runs_listing(cli, tmp_path):
    for name, rc in (("a-ok", 0), ("b-bad", 2)):
        _, proc = make_run(tmp_path, name, steps=2, trainer_rc=rc)
        proc.wait(timeout=60)
    (tmp_path / "not-a-run").mkdir()
    result = cli("runs", "--root", tmp_path, "--json")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert [(r["name"], r["state"], r["steps_done"]) for r in rows] == [("a-ok", "completed", 2), ("b-bad", "failed", 2)]
    table = cli("runs", "--root", tmp_path).stdout
    assert "a-ok" in table and "completed" in table and "b-bad" in table and "failed" in table
    assert cli("runs", "--root", tmp_path / "missing").exit_code == 2


def test_plot_writes_png(cli, finished, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "curves.png"
    result = cli("monitor", finished, "--plot", out)
    assert result.exit_code == 0, result.output
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert cli("monitor", finished, "--plot", tmp_path / "x.jpg").exit_code == 2


HET_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1 --ntasks=1 --partition=cpu
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=1 --partition=gpu
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks-per-node=1 --partition=gpu
sleep {sleep}
{finish}
"""


def _slurm_run(root: Path, name: str, sleep: float, finish: str, *extra: str) -> tuple[Path, str]:
    run = root / name
    run.mkdir()
    script = run / "job.sh"
    script.write_text(HET_SCRIPT.format(sleep=sleep, finish=finish.replace("RUN", str(run))))
    job = subprocess.run(["sbatch", "--parsable", *extra, "-o", str(run / "slurm-%j.out"), str(script)],
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip().split(";")[0]
    groups = [{"name": g, "het_index": i, "nodes": n, "ntasks_per_node": 1}
              for i, (g, n) in enumerate((("orchestrator", 1), ("inference", 1), ("trainer", 2)))]
    atomic_write_json(run / "run.json", {"name": name, "run_dir": str(run), "scheduler": "slurm", "job_id": job,
                                         "attempt": 1, "groups": groups, "recipe": {"orchestrator": {"max_steps": 3}},
                                         "plan": PLAN})
    return run, job


def _until(run: Path, states: tuple[str, ...], timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        status = run_state(run)
        if status.state in states or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_het_components_mapped_to_groups(vslurm, cli, tmp_path):
    run, job = _slurm_run(tmp_path, "het-ok", 3, "touch RUN/DONE")
    status = _until(run, ("running",) + ("completed", "failed", "cancelled"))
    assert status.state == "running", status.reason
    comps = {c.group: c for c in status.components}
    assert set(comps) == {"orchestrator", "inference", "trainer"}
    assert comps["orchestrator"].name == f"orchestrator ({job}+0)" and comps["trainer"].name == f"trainer ({job}+2)"
    assert comps["orchestrator"].nodes == "node5"  # the cpu partition
    assert comps["trainer"].nodes.startswith("node[") and comps["inference"].nodes.startswith("node")
    assert all(c.state == "running" for c in status.components)
    result = cli("monitor", run, "--wait", "--interval", "0.5", "--timeout", "90")
    assert result.exit_code == 0, result.output
    done = run_state(run)
    assert done.state == "completed" and all(c.exit_code == "0:0" for c in done.components)

    # Without the orchestrator's DONE marker a job that exits 0 did not finish the run.
    run2, _ = _slurm_run(tmp_path, "het-no-done", 0, "exit 0")
    assert cli("monitor", run2, "--wait", "--interval", "0.5", "--timeout", "90").exit_code == 1
    assert "DONE" in run_state(run2).reason

    # A requeue shows as a restart of every component; scancel ends the run as cancelled.
    run3, job3 = _slurm_run(tmp_path, "het-requeue", 60, "exit 0", "--requeue")
    try:
        assert _until(run3, ("running",)).state == "running"
        subprocess.run(["scontrol", "requeue", job3], check=True, timeout=30)
        requeued = _until(run3, ("pending",))
        assert requeued.state == "pending" and [c.restarts for c in requeued.components] == [1, 1, 1]
    finally:
        subprocess.run(["scancel", job3], check=True, timeout=30)
    assert _until(run3, ("cancelled",)).state == "cancelled"


# ------------------------------------------------------------------------- typed records, errors, Slurm


def test_metric_records_are_typed_and_renamed_keys_fail_loudly(tmp_path):
    import dataclasses

    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.orchestrator.exchange.metrics import (OrchestratorStepRecord, TrainerStepRecord, append_record,
                                                     keys_of, read_records, typed)

    run = RunDir(tmp_path)
    fields = {f.name for f in dataclasses.fields(TrainerStepRecord)}
    record = TrainerStepRecord(step=0, **{k: 1.0 for k in fields - {"step", "time"}})
    append_record(run, "trainer", record)
    (line,) = (run.metrics / "trainer.jsonl").read_text().splitlines()
    assert json.loads(line) == {"component": "trainer", **dataclasses.asdict(record)}  # plain JSON on disk
    assert typed(read_records(run), TrainerStepRecord) == [record]
    with pytest.raises(TypeError):
        TrainerStepRecord(step=1, trainer_step_s=1.0)  # a writer with a renamed key fails at once
    with pytest.raises(KeyError, match="reward_mean_x"):
        append_record(run, "orchestrator", {"step": 1, "reward_mean_x": 0.5})
    with pytest.raises(KeyError, match="reward"):
        keys_of(OrchestratorStepRecord, "reward")  # so does a reader's key (at import)


def test_shutdown_errors_after_a_completed_run_are_not_its_errors(cli, finished):
    log = finished / "logs" / "latest" / "inference" / "server.0.log"
    log.write_text("INFO starting\nERROR 05-01 12:00:00 could not reach the trainer (retrying)\n"
                   "rlctl.inference[0]: run finished, stopping the server\n"
                   "ERROR 05-01 12:00:01 [core_client.py:564] Engine core proc EngineCore_0 died unexpectedly\n"
                   "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    data = json.loads(cli("monitor", finished, "--json").stdout)
    assert data["state"] == "completed"
    assert [e["line"] for e in data["errors"]] == ["ERROR 05-01 12:00:00 could not reach the trainer (retrying)"]
    # for a run that did not complete the same lines are shown: they may be why it failed
    from rlctl.launchers.run_summary import log_errors

    assert any("EngineDeadError" in e["line"] for e in log_errors(finished))


def test_a_new_attempt_clears_announcements_and_heartbeats(tmp_path):
    from rlctl.launchers.launch import launch, load_for_launch, start_attempt

    first = launch(["smoke"], [f"deployment.output_dir={tmp_path}"], cluster="local", name="again", dry_run=True)
    run = first.run
    atomic_write_json(run.services / "inference" / "0.json", {"url": "http://127.0.0.1:1"})
    atomic_write_json(run.heartbeats / "trainer.json", {"component": "trainer"})
    # attempt 1 written as a start writes it, without spawning (a resume's own dry run writes nothing)
    refs = [str(run.recipe_toml)]
    start_attempt(run, load_for_launch(refs, [], "local"), refs, 1, dry_run=True)
    assert run.announced("inference") == [] and not list(run.heartbeats.glob("*.json"))


def test_monitor_shows_plan_beside_measured_for_a_cpu_run(tmp_path, cli):
    """What launch records is the placement only; monitor plans the run's recipe again, so the plan
    column is filled for every run, CPU ones included."""
    from rlctl.orchestrator.exchange.files import append_jsonl
    from rlctl.recipes.load import load_recipe

    run = tmp_path / "cpu-run"
    (run / "status").mkdir(parents=True)
    recipe = load_recipe([str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.toml")])
    atomic_write_json(run / "run.json", {
        "name": "cpu-run", "run_dir": str(run), "scheduler": "local", "job_id": None, "attempt": 1, "groups": [],
        "recipe": recipe.model_dump(mode="json"), "plan": {"trainer_nodes": 1, "inference_nodes": 1},
        "placement": {"trainer_nodes": 1, "inference_nodes": 1}, "submit_time": time.time()})
    for step in range(3):
        append_jsonl(run / "metrics" / "trainer.jsonl", {"component": "trainer", "step": step, "time": time.time(),
                                                        "trainer_step_time_s": 0.2, "wait_batch_s": 0.0})
    out = cli("monitor", run, "--json")
    assert out.exit_code == 0, out.output
    predicted = json.loads(out.output)["predicted"]
    assert predicted["trainer_step_time_s"] > 0 and predicted["orchestrator_step_time_s"] > 0
    out = cli("monitor", run, "--once")
    row = next(line for line in out.output.splitlines() if "trainer step" in line)
    assert f"{predicted['trainer_step_time_s']:.3g}" in row


def test_the_first_attempt_is_attempt_0(tmp_path):
    """launch starts attempt 0 (logs/attempt_0); monitor and `rlctl runs` said 1, and read errors from attempt_1."""
    from rlctl.launchers.status import run_state

    atomic_write_json(tmp_path / "run.json", {"name": "r", "scheduler": "local", "attempt": 0})
    assert run_state(tmp_path).attempt == 0
