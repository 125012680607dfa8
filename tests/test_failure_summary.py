"""The error summary of a failed local run (`launch --wait`, `monitor`) names the cause first: the task
that exited abnormally first as the supervisor recorded it, then its own last error lines, then the
others' without their shutdown noise. Run directories are written here as launchers/local.py and the
components write them (status files, logs/attempt_N/<group>/<group>.<rank>.log, supervisor.log)."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from rlctl.launchers.run_summary import log_errors

T0 = time.time() - 600  # the attempt started ten minutes ago
GROUPS = (("orchestrator", 1), ("inference", 1), ("trainer", 2))
ATTEMPT = 0

# The logs of a healthy run so far, per task: what each writes before anything goes wrong.
HEALTHY = {
    "orchestrator.0": ["[orchestrator 12:00:05] step 3 reward=0.41 rollouts/s=38.0"],
    "inference.0": ["rlctl.inference[0]: starting (generate): vllm serve /run/model --port 8000",
                    "INFO 05-01 12:00:02 [api_server.py:1000] Starting vLLM API server",
                    # a warning that mentions errors is not one (it was listed on every Slurm run)
                    "(APIServer pid=24610) WARNING 12-05 18:15:37 [system_utils.py:255] Found ulimit of 20000 and "
                    "failed to automatically increase with error current limit exceeds maximum limit. This can "
                    "cause fd limit errors like `OSError: [Errno 24] Too many open files`.",
                    "rlctl.inference[0]: ready at http://127.0.0.1:8000 after 12.0 s (healthy at 11.0 s, first request 1.0 s)"],
    "trainer.0": ["[trainer 12:00:06] step 3 loss=0.5000 entropy=1.2 step=0.800s"],
    "trainer.1": [],  # only rank 0 logs
}
STOPPED_SERVER = ["rlctl.inference[0]: stop requested, stopping the server",
                  "ERROR 05-01 12:00:09 [core_client.py:564] Engine core proc EngineCore_0 died unexpectedly, shutting down client.",
                  "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."]
TRAINER_TERM = ["[trainer 12:00:09] preemption requested (SIGTERM): checkpoint step_4 saved in 0.100s; stopping"]
GLOO_RESET = ["Traceback (most recent call last):",
              '  File "site-packages/rlctl/trainer/train.py", line 219, in _agree_on_preemption',
              "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: Connection reset by peer"]


def make_run(root: Path, exits: list[tuple[str, int, float]], logs: dict[str, list[str]],
             supervisor_state: str = "exited") -> Path:
    """A run whose attempt ATTEMPT ended: `exits` are (task, returncode, seconds after T0 at which the
    supervisor stamped its end), in the order the supervisor saw them; `logs` the task logs' lines."""
    run = root / "run"
    status, folder = run / "status", run / "logs" / f"attempt_{ATTEMPT}"
    for d in (status, folder, run / "configs"):
        d.mkdir(parents=True, exist_ok=True)
    os.symlink(f"attempt_{ATTEMPT}", run / "logs" / "latest")
    (run / "run.json").write_text(json.dumps({
        "name": "run", "run_dir": str(run), "scheduler": "local", "job_id": None, "attempt": ATTEMPT,
        "groups": [{"name": g, "het_index": i, "nodes": 1, "ntasks_per_node": n} for i, (g, n) in enumerate(GROUPS)],
        "recipe": {"name": "run", "orchestrator": {"max_steps": 10}}, "plan": {}}))
    host = socket.gethostname()
    sup_log = [f"[rlctl 12:00:00] started {sum(n for _, n in GROUPS)} tasks"]
    rc_final = 0
    for i, (task, rc, after) in enumerate(exits):
        group, rank = task.split(".")
        json_path = status / f"{group}.{group}.{rank}.json"
        json_path.write_text(json.dumps({"pid": 1000 + i, "state": "exited", "returncode": rc, "host": host,
                                         "started": T0 + 1.0, "ended": T0 + after}))
        sup_log.append(f"[rlctl 12:00:{int(after):02d}] {group} rank {rank} exited with code {rc}")
        if rc != 0 and rc_final == 0:
            rc_final = rc if rc > 0 else 128 - rc
            sup_log.append("[rlctl 12:00:08] asking the other tasks to stop (SIGTERM); what is left in 30s is terminated")
    sup_log.append(f"[rlctl 12:00:20] done with code {rc_final}")
    (folder / "supervisor.log").write_text("\n".join(sup_log) + "\n")
    os.utime(folder / "supervisor.log", (T0 + 20, T0 + 20))
    (status / "supervisor.json").write_text(json.dumps({
        "pid": 999, "state": supervisor_state, "returncode": 143 if supervisor_state == "cancelled" else rc_final,
        "attempt": ATTEMPT, "started": T0, "time": T0 + 20}))
    ended = {task: after for task, _, after in exits}
    for task, lines in logs.items():
        group, rank = task.split(".")
        path = folder / group / f"{group}.{rank}.log"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines))
        # a log is last written when its task ends (a killed one: when it was killed)
        os.utime(path, (T0 + ended.get(task, 20), T0 + ended.get(task, 20)))
    return run


def test_killed_orchestrator_is_named_not_the_servers_shutdown(tmp_path):
    # kill -9 of the orchestrator: the supervisor stops the others, the server's engine dies on the way out
    run = make_run(tmp_path, [("orchestrator.0", -9, 7.0), ("inference.0", 143, 12.0),
                              ("trainer.0", 143, 13.0), ("trainer.1", 143, 13.0)],
                   {**HEALTHY, "inference.0": HEALTHY["inference.0"] + STOPPED_SERVER,
                    "trainer.0": HEALTHY["trainer.0"] + TRAINER_TERM})
    errors = log_errors(run, ATTEMPT)
    assert errors[0] == {"file": "orchestrator/orchestrator.0.log", "cause": True, "component": "orchestrator.orchestrator.0",
                         "returncode": -9, "line": "orchestrator rank 0 failed first: exited with code -9 (killed by SIGKILL)"}
    assert not any("EngineDeadError" in e["line"] or "died unexpectedly" in e["line"] for e in errors), errors
    assert not any(e["file"] == "supervisor.log" for e in errors), errors  # said by the first entry
    assert len(errors) == 1


def test_killed_api_server_names_inference_and_its_message(tmp_path):
    # kill -9 of the vLLM API server: the inference wrapper says so (with the server's last lines
    # repeated after it) and exits 1; the orchestrator's requests fail meanwhile, then it is stopped
    server_tail = ["INFO 05-01 12:00:06 [loggers.py:123] Avg generation throughput: 300.0 tokens/s",
                   "ERROR 05-01 12:00:07 [core.py:400] EngineCore failed to send output: Broken pipe"]
    inference = (HEALTHY["inference.0"] + server_tail
                 + ["rlctl.inference: server 0 died with code -9", f"--- last {len(server_tail)} lines of the server log ---"]
                 + server_tail)
    orchestrator = HEALTHY["orchestrator.0"] + [
        "WARNING 12:00:07 request to http://127.0.0.1:8000 failed: ConnectError: [Errno 111] Connection refused (retrying)"]
    run = make_run(tmp_path, [("inference.0", 1, 8.5), ("orchestrator.0", 143, 9.0),
                              ("trainer.0", 143, 12.0), ("trainer.1", 143, 12.0)],
                   {**HEALTHY, "inference.0": inference, "orchestrator.0": orchestrator,
                    "trainer.0": HEALTHY["trainer.0"] + TRAINER_TERM})
    errors = log_errors(run, ATTEMPT)
    assert errors[0]["line"] == "inference rank 0 failed first: exited with code 1"
    assert errors[0]["file"] == "inference/inference.0.log" and errors[0]["component"] == "inference.inference.0"
    own = [e["line"] for e in errors[1:] if e["file"] == "inference/inference.0.log"]
    # its own last error lines, its message last (the repeated server lines are not counted twice)
    assert own == [server_tail[1], "rlctl.inference: server 0 died with code -9"], errors
    assert [e["file"] for e in errors[:3]] == ["inference/inference.0.log"] * 3
    assert errors[3]["file"] == "orchestrator/orchestrator.0.log" and "Connection refused" in errors[3]["line"]


def test_killed_trainer_rank_is_named_not_its_peers_connection_reset(tmp_path):
    # kill -9 of trainer rank 1: rank 0 fails at once on the lost peer; the supervisor sees both in one
    # poll and stamps rank 0 (first in task order) a little earlier
    run = make_run(tmp_path, [("trainer.0", 1, 7.00), ("trainer.1", -9, 7.05),
                              ("orchestrator.0", 143, 9.0), ("inference.0", 143, 12.0)],
                   {**HEALTHY, "trainer.0": HEALTHY["trainer.0"] + GLOO_RESET,
                    "inference.0": HEALTHY["inference.0"] + STOPPED_SERVER})
    trainer = run / "logs" / "latest" / "trainer"
    os.utime(trainer / "trainer.1.log", (T0 + 2.0, T0 + 2.0))  # rank 1 wrote nothing since its start
    os.utime(trainer / "trainer.0.log", (T0 + 6.95, T0 + 6.95))  # rank 0's traceback came after rank 1 was gone
    errors = log_errors(run, ATTEMPT)
    assert errors[0]["line"] == "trainer rank 1 failed first: exited with code -9 (killed by SIGKILL)", errors
    assert errors[0]["file"] == "trainer/trainer.1.log"
    rest = [(e["file"], e["line"]) for e in errors[1:]]
    assert rest == [("trainer/trainer.0.log", GLOO_RESET[0]), ("trainer/trainer.0.log", GLOO_RESET[2])], errors


def test_the_summary_of_the_follow_loop_leads_with_the_cause(tmp_path):
    from rlctl.cli.follow import snapshot

    run = make_run(tmp_path, [("orchestrator.0", -9, 7.0), ("inference.0", 143, 12.0),
                              ("trainer.0", 143, 13.0), ("trainer.1", 143, 13.0)],
                   {**HEALTHY, "inference.0": HEALTHY["inference.0"] + STOPPED_SERVER})
    summary, _ = snapshot(run)
    assert summary["state"] == "failed"
    assert summary["errors"][0]["line"].startswith("orchestrator rank 0 failed first")


def test_bounded_to_limit_cause_first(tmp_path):
    noisy = HEALTHY["trainer.0"] + [f"ERROR retrying {i}" for i in range(20)]
    run = make_run(tmp_path, [("orchestrator.0", 2, 7.0), ("trainer.0", 143, 13.0)],
                   {**HEALTHY, "orchestrator.0": ["Traceback (most recent call last):", "ValueError: bad batch"],
                    "trainer.0": noisy})
    errors = log_errors(run, ATTEMPT, limit=3, per_file=2)
    assert [e["line"] for e in errors] == ["orchestrator rank 0 failed first: exited with code 2",
                                           "Traceback (most recent call last):", "ValueError: bad batch"]


@pytest.mark.parametrize("case", ["cancelled", "stale", "completed"])
def test_no_cause_named(tmp_path, case):
    logs = {**HEALTHY, "inference.0": HEALTHY["inference.0"] + STOPPED_SERVER}
    if case == "cancelled":  # rlctl cancel: every task stopped at once, none of them the cause
        run = make_run(tmp_path, [(t, -15, 7.0) for t in ("orchestrator.0", "inference.0", "trainer.0", "trainer.1")],
                       logs, supervisor_state="cancelled")
    else:
        run = make_run(tmp_path, [("orchestrator.0", 0, 7.0), ("inference.0", 0, 9.0)], logs)
        if case == "stale":  # a task file an earlier attempt left behind
            (run / "status" / "trainer.trainer.3.json").write_text(json.dumps(
                {"pid": 5, "state": "exited", "returncode": 1, "host": "h", "started": T0 - 900, "ended": T0 - 800}))
    errors = log_errors(run, ATTEMPT, completed=case == "completed")
    assert not any(e.get("cause") for e in errors), errors
    # without a cause the server's lines after its stop cannot be judged: shown unless the run completed
    assert any("EngineDeadError" in e["line"] for e in errors) == (case != "completed")


def test_a_traceback_shows_its_exception_not_its_frames(tmp_path):
    """A reward's `RewardsFailing: ...` (no 'error' in it) was left out, while the frame line
    `raise self._error` was shown as the run's last error."""
    tb = ["Traceback (most recent call last):", '  File "rlctl/orchestrator/loop.py", line 9, in run',
          "    raise self._error", "TimeoutError", "",
          "The above exception was the direct cause of the following exception:", "",
          "Traceback (most recent call last):", '  File "rlctl/orchestrator/__main__.py", line 5, in main',
          "    await loop.run()",
          "rlctl.orchestrator.rewards.RewardsFailing: 6 reward calls in a row failed; last: no result within 2 s"]
    run = make_run(tmp_path, [("orchestrator.0", 1, 7.0), ("trainer.0", 143, 13.0)], {**HEALTHY, "orchestrator.0": tb})
    lines = [e["line"] for e in log_errors(run, ATTEMPT, per_file=3)]
    assert lines[:4] == ["orchestrator rank 0 failed first: exited with code 1", "TimeoutError",
                         "Traceback (most recent call last):",
                         "rlctl.orchestrator.rewards.RewardsFailing: 6 reward calls in a row failed; last: no result "
                         "within 2 s"], lines
    assert not any("raise self._error" in line for line in lines)
