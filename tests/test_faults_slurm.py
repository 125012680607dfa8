"""Fault drills on the virtual Slurm cluster: the preemption signal (USR2 → trainer checkpoint →
`scontrol requeue` → the requeued job resumes by itself) and a node set DOWN under a running job
(NODE_FAIL → Slurm requeues the job → it resumes from the newest complete checkpoint).

The trainer is the smoke step counter (`deployment.smoke.steps`), which follows the real checkpoint
protocol (parts + markers, PREEMPT, RLCTL_RESUME_STEP); the batch script, requeue, attempt bookkeeping
and rewind are the real ones. Each run must end with contiguous steps 0..N-1 and every job ended."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.orchestrator.exchange.metrics import read_records
from rlctl.orchestrator.exchange.checkpoints import complete_checkpoints, is_complete
from e2e_checks import wait_for
from rlctl.launchers.status import run_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "recipes" / "smoke.toml")
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]
STEPS = 16


def launch(tmp_path: Path, jobs: list, name: str) -> tuple[Path, str]:
    out = subprocess.run(
        [*RLCTL, "launch", SMOKE, "--cluster", "vslurm", "--name", name, "--json",
         "-o", f"deployment.output_dir={tmp_path}", "-o", "deployment.trainer_nodes=1",
         "-o", f"deployment.smoke.steps={STEPS}", "-o", "deployment.smoke.step_s=0.4",
         "-o", "checkpoint.interval=3", "-o", "deployment.max_restarts=2", "-o", "deployment.grace_period_s=5"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    jobs.append(info["job_id"])
    return Path(info["run_dir"]), info["job_id"]



def wait_ended(run: Path, timeout: float = 240):
    return wait_for(lambda: (s := run_state(run)).ended and s, timeout, f"run {run.name} to end")


def trainer_steps(run: Path) -> list[dict]:
    lines = read_records(run)
    return [r for r in lines if r["component"] == "trainer"]


def assert_resumed_cleanly(run: Path, job: str, resume_step: int) -> None:
    status = wait_ended(run)
    batch_log = "".join(p.read_text() for p in (run / "logs").glob("attempt_*/slurm-*.out"))
    assert status.state == "completed", (status.to_dict(), batch_log)
    records = trainer_steps(run)
    assert [r["step"] for r in records] == list(range(STEPS)), batch_log  # contiguous: none lost or repeated
    rewards = [r["reward_mean"] for r in records]
    after = [r["reward_mean"] for r in records if r["step"] >= resume_step]
    assert min(after) >= max(r for r, rec in zip(rewards, records) if rec["step"] < resume_step) - 0.05
    assert {r["attempt"] for r in records if r["step"] >= resume_step} == {1}  # the requeued attempt
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["attempt"] == 1 and manifest["attempts"][-1]["requeued"] is True
    assert manifest["attempts"][-1]["resume_step"] == resume_step
    assert f"restart 1/2: attempt 1, resume step '{resume_step}'" in batch_log
    assert (run / "logs" / "latest").resolve().name == "attempt_1"
    # the requeued attempt's batch-script lines are in its own folder (`rlctl logs RUN job` shows them)
    assert "resume step" in (run / "logs" / "attempt_1" / f"slurm-{job}.out").read_text()
    assert any((run / "logs" / "attempt_1" / "trainer").glob("trainer.0.log"))
    squeue = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout
    assert squeue.strip() == "", squeue  # the allocation ended


def test_preemption_signal_checkpoints_requeues_and_resumes(tmp_path, vslurm, slurm_jobs):
    run, job = launch(tmp_path, slurm_jobs, "preempt")
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    sig = subprocess.run(["scancel", "--batch", "--signal=USR2", job], capture_output=True, text=True)
    assert sig.returncode == 0, sig.stderr
    # the trainer saves a checkpoint at the step it was on (not a multiple of the interval in general)
    wait_ended(run)
    preempt_log = (run / "logs" / "attempt_0" / "trainer" / "trainer.0.log").read_text()
    assert "preempted, checkpoint step_" in preempt_log, preempt_log
    resume_step = int(preempt_log.split("preempted, checkpoint step_")[1].split()[0])
    assert resume_step >= 3
    assert_resumed_cleanly(run, job, resume_step)
    assert not (run / "PREEMPT").exists()


def _job_nodes(job: str, het_index: int) -> list[str]:
    from rlctl.launchers.env import expand_nodelist

    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i|%N"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        jid, _, nodes = line.partition("|")
        if jid == f"{job}+{het_index}" and nodes:
            return expand_nodelist(nodes)
    return []


def test_node_down_under_a_running_job_requeues_and_resumes(tmp_path, vslurm, slurm_jobs):
    run, job = launch(tmp_path, slurm_jobs, "nodedown")
    trainer = next(g for g in json.loads((run / "run.json").read_text())["groups"] if g["name"] == "trainer")
    node = wait_for(lambda: _job_nodes(job, trainer["het_index"]), 60, "the trainer's node")[0]
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    try:
        down = subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=rlctl-fault-test"],
                              capture_output=True, text=True)
        assert down.returncode == 0, down.stderr
        # Slurm ends the job (NODE_FAIL) and requeues it (--requeue); it resumes on the other nodes
        wait_for(lambda: (run / "logs" / "attempt_1").is_dir(), 240, "the requeued attempt")
        newest_before = max(s for s in complete_checkpoints(run / "checkpoints") if s <= STEPS)
        assert newest_before >= 3
        status = wait_ended(run)
        batch_log = "".join(p.read_text() for p in (run / "logs").glob("attempt_*/slurm-*.out"))
        resume_step = int(batch_log.split("resume step '")[1].split("'")[0])
        # the newest complete checkpoint: a periodic one, or the step the trainer saved on Slurm's SIGTERM
        # (a DOWN node of the virtual cluster keeps its processes); the script itself asks for none
        assert resume_step >= 3, batch_log
        assert "a node failed, Slurm requeues the job" in batch_log and not (run / "PREEMPT").exists()
        acct = subprocess.run(["sacct", "-j", job, "-X", "-D", "-n", "-P", "-o", "JobID,State"],
                              capture_output=True, text=True).stdout
        assert f"{job}+{trainer['het_index']}|NODE_FAIL" in acct, acct  # the first allocation lost its node
        assert status.state == "completed", (status.to_dict(), batch_log)
        assert_resumed_cleanly(run, job, resume_step)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True,
                                                  text=True).stdout or "mix" in subprocess.run(
            ["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout, 60, f"{node} idle again")
