"""The local launcher with the smoke entry points: env contract, logs, status files, teardown, cancel."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_checks import running, wait_for
from rlctl.launchers.status import run_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "recipes" / "smoke.toml")
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]
LOCAL = ("--cluster", "local", "-o", "deployment.trainer_nodes=1", "-o", "trainer.fsdp=2")


def rlctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout)


def launch(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--json", *extra)
    info = json.loads(out.stdout[: out.stdout.index("\n}") + 2])
    return out, Path(info["run_dir"])


def statuses(run: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (run / "status").glob("*.json")}


def test_local_run_follows_the_env_contract_with_logs_and_status(tmp_path):
    out, run = launch(tmp_path, "--wait")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)  # --wait --json: one document, at the end, with the run's final status
    assert info["run_dir"] == str(run) and info["final"]["state"] == "completed" and info["exit_code"] == 0
    recs = {p.stem: json.loads(p.read_text()) for p in (run / "smoke").glob("*.json")}
    assert sorted(recs) == ["inference.0", "orchestrator.0", "trainer.0", "trainer.1"]
    tr = [recs["trainer.0"]["env"], recs["trainer.1"]["env"]]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) for e in tr} == {
        ("127.0.0.1", tr[0]["MASTER_PORT"], "2", "2")}
    assert [e["RANK"] for e in tr] == ["0", "1"] and [e["LOCAL_RANK"] for e in tr] == ["0", "1"]
    # the ranks share the host with the server: the cores left after one for it, split between them
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, ((os.cpu_count() or 1) - 1) // 2))
    assert {e.get("OMP_NUM_THREADS") for e in tr} == {threads}
    inf = recs["inference.0"]["env"]
    assert inf["RLCTL_SERVER_INDEX"] == "0" and inf["RLCTL_BIND_HOST"] == "127.0.0.1"
    assert all(r["env"]["RLCTL_RUN_DIR"] == str(run) and r["env"]["RLCTL_ATTEMPT"] == "0" for r in recs.values())
    assert recs["orchestrator.0"]["saw"]["inference"] == [json.loads((run / "services/inference/0.json").read_text())["url"]]
    st = statuses(run)
    assert st["supervisor"]["state"] == "exited" and st["supervisor"]["returncode"] == 0
    tasks = {k: v for k, v in st.items() if k != "supervisor"}
    assert sorted(tasks) == ["inference.inference.0", "orchestrator.orchestrator.0", "trainer.trainer.0",
                             "trainer.trainer.1"]
    assert all(v["state"] == "exited" and v["returncode"] == 0 and v["ended"] >= v["started"] for v in tasks.values())
    for group, comp in [("trainer", "trainer.1"), ("inference", "inference.0"), ("orchestrator", "orchestrator.0")]:
        assert (run / "logs" / "latest" / group / f"{comp}.log").read_text().strip().endswith("clean exit")
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["scheduler"] == "local" and manifest["job_id"] is None
    logs = rlctl("logs", str(run), "trainer")
    assert logs.returncode == 0 and "smoke trainer rank 1" in logs.stdout


def test_a_failing_component_has_the_others_stopped_at_once(tmp_path):
    grace = 120  # the others are told at once (SIGTERM), not left idling through the grace period
    t0 = time.monotonic()
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--wait",
                "-o", "deployment.smoke.fail_group=inference", "-o", "deployment.smoke.fail_after_s=1",
                "-o", "deployment.smoke.run_s=600", "-o", f"deployment.grace_period_s={grace}")
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr  # as `monitor --wait`; the component's own code is in the verdict
    # what failed is printed with the verdict, so a CI log says why without the run dir
    assert ("last errors in the logs:\n  inference/inference.0.log: inference rank 0 failed first: exited with code 3\n"
            "  inference/inference.0.log: smoke inference rank 0: error: failing on purpose\n"
            "run FAILED, launcher exit code 3 (exit code 1)") in out.stdout, out.stdout
    run = Path(out.stdout.split("run dir:", 1)[1].split()[0])
    assert took < 60, took  # the others would otherwise hold for the grace period (or their 600 s)
    st = statuses(run)
    assert st["inference.inference.0"]["returncode"] == 3
    assert st["supervisor"] == {**st["supervisor"], "state": "exited", "returncode": 3}
    for name, s in st.items():
        if name != "supervisor":
            assert s["state"] == "exited" and not running(s["pid"]), name
        if name not in ("supervisor", "inference.inference.0"):
            assert s["returncode"] in (143, -15), (name, s)  # ended by the SIGTERM (a handler's 128+15, or the signal)
    log = (run / "logs" / "latest" / "supervisor.log").read_text()
    assert "inference rank 0 exited with code 3" in log and "asking the other tasks to stop" in log
    assert "grace period over" not in log


def test_cancel_stops_every_process(tmp_path):
    out, run = launch(tmp_path, "-o", "deployment.smoke.run_s=600")
    assert out.returncode == 0, out.stderr
    # the moment launch returns, the run reads as live (not lost) and names its supervisor
    assert run_state(run).state in ("pending", "running")
    assert statuses(run)["supervisor"]["pid"] == json.loads(out.stdout[: out.stdout.index("\n}") + 2])["supervisor_pid"]
    wait_for(lambda: len(list((run / "smoke").glob("*.json"))) >= 4, 60, "the tasks to start")
    st = statuses(run)
    pids = [s["pid"] for s in st.values()]
    assert all(running(p) for p in pids)
    cancel = rlctl("cancel", str(run))
    assert cancel.returncode == 0 and "cancelled local run" in cancel.stdout, cancel.stderr
    st = statuses(run)
    assert st["supervisor"]["state"] == "cancelled"
    assert not any(running(p) for p in pids)
    again = rlctl("cancel", str(run))
    assert again.returncode == 0 and "not running" in again.stdout


def test_existing_run_dir_is_refused_unless_resuming(tmp_path):
    first, run = launch(tmp_path, "--dry-run", "--name", "same")
    assert first.returncode == 0
    second = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--dry-run", "--name", "same")
    assert second.returncode == 2 and "already exists" in second.stderr and "Traceback" not in second.stderr
    before = (run / "run.json").read_text()
    third, _ = launch(tmp_path, "--dry-run", "--name", "same", "--resume")  # checked and shown, nothing written
    assert third.returncode == 0, third.stderr
    shown = json.loads(third.stdout)
    assert shown["dry_run"] and shown["attempt"] == 1 and shown["rewind"]["step"] == 0
    assert (run / "run.json").read_text() == before and (run / "logs" / "latest").resolve().name == "attempt_0"


def test_tasks_do_not_outlive_a_killed_supervisor(tmp_path):
    waiter = subprocess.Popen([*RLCTL, "launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}",
                               "-o", "deployment.smoke.run_s=600", "--name", "killed", "--wait"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "killed"
    wait_for(lambda: len(list((run / "smoke").glob("*.json"))) >= 4, 60, "the tasks to start")
    st = statuses(run)
    os.kill(st["supervisor"]["pid"], 9)
    # `launch --wait` notices the dead supervisor instead of waiting forever
    assert waiter.wait(timeout=30) == 1
    assert "lost" in waiter.stderr.read()
    pids = [s["pid"] for name, s in st.items() if name != "supervisor"]
    deadline = time.monotonic() + 20
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, "tasks outlived their supervisor"
        time.sleep(0.2)


def test_resume_wait_follows_the_new_attempt_to_its_end(tmp_path):
    first, run = launch(tmp_path, "--wait")
    assert first.returncode == 0, first.stderr
    before = (run / "run.json").read_text()
    finished = rlctl("resume", str(run), "--wait")  # nothing left to train: refused, the run left as it was
    assert finished.returncode == 2 and "already finished" in finished.stderr, finished.stderr
    assert (run / "run.json").read_text() == before and (run / "DONE").exists()
    (run / "DONE").unlink()  # as a run preempted after its last step has none
    again = rlctl("resume", str(run), "--wait")
    assert again.returncode == 0 and "run finished (exit code 0)" in again.stdout, (again.stdout, again.stderr)
    assert json.loads((run / "run.json").read_text())["attempt"] == 1
    assert statuses(run)["supervisor"]["state"] == "exited"
