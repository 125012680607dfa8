"""Preemption and timeouts.

Fast: the batch script's supervisor (launchers/het_script.py SUPERVISOR, the real text) run by bash with a
fake `scontrol`/`sacct` and fake group steps, signalled as Slurm signals it; the orchestrator's bound
on the wait for servers. Slow, on the virtual cluster (partition `urgent` preempts `gpu`/`cpu` with
PreemptMode=REQUEUE, see tests/slurm/slurm.conf.in): a real preemption (SIGTERM to the batch script
and every step) checkpoints and requeues; `scancel` does not requeue; USR2 at the last allowed
restart checkpoints; USR2 after DONE does not requeue.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_checks import wait_for

from rlctl.launchers.het_script import SUPERVISOR
from rlctl.orchestrator.exchange.checkpoints import is_complete
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes.load import load_recipe

REPO = Path(__file__).resolve().parents[1]

# A trainer step: TERM or PREEMPT → "checkpoint" (a file) and exit, as rlctl's trainers do.
TRAINER = r"""
trap 'got_term=1' TERM; got_term=0
while [[ ! -e $RUN/PREEMPT ]] && (( ! got_term )); do sleep 0.05; done
echo saved > "$RUN/checkpointed"; exit 0
"""
# A trainer that checkpoints on PREEMPT only (TERM kills it): the supervisor must ask before stopping.
PREEMPT_ONLY_TRAINER = r"""
while [[ ! -e $RUN/PREEMPT ]]; do sleep 0.05; done
echo saved > "$RUN/checkpointed"; exit 0
"""
# A trainer that never checkpoints (hung in a collective, say).
HUNG_TRAINER = "trap '' TERM; while :; do sleep 0.05; done"


class Supervisor:
    """The supervisor part of the batch script over two fake steps (trainer, orchestrator)."""

    def __init__(self, tmp: Path, *, restarts: int = 0, max_restarts: int = 2, scontrol_line: str = "",
                 sacct_state: str = "RUNNING", trainer: str = TRAINER, preempt_timeout: int = 30):
        self.run = tmp / "run"
        self.run.mkdir()
        fake = tmp / "bin"
        fake.mkdir()
        (tmp / "job").write_text(scontrol_line or f"JobId=77 JobState=RUNNING Restarts={restarts}\n")
        (tmp / "sacct").write_text(sacct_state + "\n")
        self.requeued = tmp / "requeued"
        (fake / "scontrol").write_text(f'#!/bin/bash\ncase "$1" in show) cat {tmp / "job"} ;; '
                                       f'requeue) echo "$2" >> {self.requeued} ;; esac\n')
        (fake / "sacct").write_text(f"#!/bin/bash\ncat {tmp / 'sacct'}\n")
        for f in fake.iterdir():
            f.chmod(0o755)
        self.job = tmp / "job"
        script = "\n".join([
            "set -u", f"RUN={self.run}", f"RLCTL_RUN_DIR={self.run}", "SLURM_JOB_ID=77",
            f"RESTARTS={restarts}", f"MAX_RESTARTS={max_restarts}", f"PREEMPT_TIMEOUT={preempt_timeout}",
            "GRACE=30", "pids=(); names=()",
            f"( {trainer} ) & pids+=($!); names+=(trainer)",
            "( exec sleep 300 ) & pids+=($!); names+=(orchestrator)",
            SUPERVISOR])
        (tmp / "batch.sh").write_text(script)
        self.proc = subprocess.Popen(["bash", str(tmp / "batch.sh")], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
        time.sleep(0.5)  # the traps are set

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def requeues(self) -> int:
        return len(self.requeued.read_text().split()) if self.requeued.exists() else 0


@pytest.fixture
def supervisors():
    made: list[Supervisor] = []
    yield lambda *a, **k: made.append(Supervisor(*a, **k)) or made[-1]
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.communicate()


def test_term_of_a_requeueing_preemption_checkpoints_and_leaves_the_requeue_to_slurm(tmp_path, supervisors):
    sup = supervisors(tmp_path, sacct_state="PREEMPTED")
    sup.job.write_text("JobId=77 JobState=COMPLETING Restarts=1\n")  # what slurmctld shows by then
    sup.signal(signal.SIGTERM)
    code, out = sup.finish()
    assert (sup.run / "PREEMPT").exists() and (sup.run / "checkpointed").exists(), out
    assert "Slurm preempts it (requeue)" in out and "Slurm requeues job 77" in out, out
    assert sup.requeues() == 0 and code == 143, out


def test_term_of_a_node_failure_requeue_does_not_ask_for_a_checkpoint(tmp_path, supervisors):
    sup = supervisors(tmp_path, sacct_state="NODE_FAIL")
    sup.job.write_text("JobId=77 JobState=COMPLETING Restarts=1\n")
    sup.signal(signal.SIGTERM)
    code, out = sup.finish()
    assert "a node failed, Slurm requeues the job" in out and code == 143, out
    assert not (sup.run / "PREEMPT").exists() and sup.requeues() == 0, out


def test_term_of_a_cancelling_preemption_checkpoints_and_requeues(tmp_path, supervisors):
    sup = supervisors(tmp_path)
    sup.job.write_text("JobId=77 JobState=COMPLETING Restarts=0\n")
    (tmp_path / "sacct").write_text("PREEMPTED\n")  # PreemptMode=CANCEL
    sup.signal(signal.SIGTERM)
    wait_for(lambda: sup.requeues() == 1, 30, "scontrol requeue")
    assert (sup.run / "checkpointed").exists()
    sup.signal(signal.SIGTERM)  # Slurm ends the allocation of the requeued job
    code, out = sup.finish()
    assert code == 143 and sup.requeues() == 1, out


def test_term_of_scancel_stops_without_checkpoint_or_requeue(tmp_path, supervisors):
    sup = supervisors(tmp_path, scontrol_line="JobId=77 JobState=COMPLETING Restarts=0 PreemptTime=None\n",
                      sacct_state="CANCELLED by 0")
    sup.signal(signal.SIGTERM)
    code, out = sup.finish()
    assert code == 143 and "not a preemption" in out, out
    assert not (sup.run / "PREEMPT").exists() and sup.requeues() == 0, out


def test_usr2_at_the_last_restart_checkpoints_then_stops(tmp_path, supervisors):
    sup = supervisors(tmp_path, restarts=2, max_restarts=2, trainer=PREEMPT_ONLY_TRAINER)
    sup.signal(signal.SIGUSR2)
    code, out = sup.finish()
    assert (sup.run / "checkpointed").exists(), out  # the old script stopped without a checkpoint
    assert "no automatic restart left (2/2" in out and sup.requeues() == 0 and code == 143, out


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_preemption_after_done_never_requeues(tmp_path, supervisors, sig):
    sup = supervisors(tmp_path)
    sup.job.write_text("JobId=77 JobState=COMPLETING Restarts=1\n")
    (sup.run / "DONE").write_text("{}")
    sup.signal(sig)
    if sig == signal.SIGUSR2:  # the job goes on ending by itself
        time.sleep(2)
        assert sup.proc.poll() is None
        sup.job.write_text("JobId=77 JobState=COMPLETING Restarts=0\n")
        sup.signal(signal.SIGTERM)
    code, out = sup.finish()
    assert "after the run finished (DONE): no checkpoint, no requeue" in out, out
    assert not (sup.run / "PREEMPT").exists() and sup.requeues() == 0, out


def test_the_wait_for_the_trainer_checkpoint_is_bounded(tmp_path, supervisors):
    sup = supervisors(tmp_path, trainer=HUNG_TRAINER, preempt_timeout=2)
    t0 = time.monotonic()
    sup.signal(signal.SIGUSR2)
    wait_for(lambda: sup.requeues() == 1, 20, "the requeue after the bounded wait")
    assert time.monotonic() - t0 < 10
    sup.signal(signal.SIGTERM)
    code, out = sup.finish()
    assert "did not stop within 2s (deployment.preempt_timeout_s): killing it" in out, out


def test_scancel_during_the_checkpoint_does_not_requeue(tmp_path, supervisors):
    sup = supervisors(tmp_path, trainer=HUNG_TRAINER, preempt_timeout=3, sacct_state="CANCELLED by 0")
    sup.signal(signal.SIGUSR2)
    time.sleep(1)
    sup.signal(signal.SIGTERM)  # the user cancels while the trainer is checkpointing
    code, out = sup.finish()
    assert "cancelled during the checkpoint: no requeue" in out and sup.requeues() == 0, out


# ------------------------------------------------------------------------------------- timeouts


def test_orchestrator_waits_for_servers_as_long_as_the_recipe_says(tmp_path):
    recipe = load_recipe([str(REPO / "recipes" / "tiny-cpu.toml")], ["inference.startup_timeout_s=1"])
    run = RunDir(tmp_path / "run")
    run.create()
    (run.configs / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json")))
    (run.configs / "placement.json").write_text(json.dumps(Placement(1, 1, 1, 1, 0, "inference_node").to_dict()))
    run.admin_token(create=True), run.api_key(create=True)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlctl.orchestrator", "--run-dir", str(run.root)],
                         env={**os.environ, "RLCTL_ATTEMPT": "1"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "0/1 inference servers announced within 1 s (inference.startup_timeout_s)" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 60  # the old fixed wait was 900 s


# --------------------------------------------------------------------- on the virtual Slurm cluster

def _launch(tmp_path: Path, jobs: list, name: str, *overrides: str) -> tuple[Path, str]:
    from test_faults_slurm import RLCTL, SMOKE, STEPS

    out = subprocess.run(
        [*RLCTL, "launch", SMOKE, "--cluster", "vslurm", "--name", name, "--json",
         "-o", f"deployment.output_dir={tmp_path}", "-o", "deployment.trainer_nodes=1",
         "-o", f"deployment.smoke.steps={STEPS}", "-o", "deployment.smoke.step_s=0.4",
         "-o", "checkpoint.interval=3", "-o", "deployment.max_restarts=2", "-o", "deployment.grace_period_s=5",
         *[a for o in overrides for a in ("-o", o)]],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    jobs.append(info["job_id"])
    return Path(info["run_dir"]), info["job_id"]


def _batch_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("attempt_*/slurm-*.out")))


def _accounting(job: str) -> str:
    return subprocess.run(["sacct", "-j", job, "-X", "-D", "-n", "-P", "-o", "JobID,State"],
                          capture_output=True, text=True).stdout


def _checkpointed_step(run: Path, attempt: int = 0) -> tuple[int, str]:
    log = (run / "logs" / f"attempt_{attempt}" / "trainer" / "trainer.0.log").read_text()
    assert "preempted, checkpoint step_" in log, log
    return int(log.split("preempted, checkpoint step_")[1].split()[0]), log


@pytest.mark.slurm
@pytest.mark.slow
def test_term_of_a_slurm_preemption_checkpoints_and_requeues(tmp_path, vslurm, slurm_jobs):
    from test_faults_slurm import _job_nodes, assert_resumed_cleanly, wait_ended

    run, job = _launch(tmp_path, slurm_jobs, "preemptterm")
    trainer = next(g for g in json.loads((run / "run.json").read_text())["groups"] if g["name"] == "trainer")
    node = wait_for(lambda: _job_nodes(job, trainer["het_index"]), 60, "the trainer's node")[0]
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    # A job of the higher-tier partition that needs the trainer's whole node: Slurm preempts the run
    # (PreemptMode=REQUEUE: SIGCONT+SIGTERM to the batch script and every step, SIGKILL after KillWait).
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-w", node, "--exclusive", "-t", "1",
                             "-o", "/dev/null", "--wrap", "sleep 2"], capture_output=True, text=True)
    assert urgent.returncode == 0, urgent.stderr
    slurm_jobs.append(urgent.stdout.strip().split(";")[0])
    wait_for(lambda: (run / "logs" / "attempt_1").is_dir(), 240, "the requeued attempt")
    resume_step, trainer_log = _checkpointed_step(run)
    assert "(SIGTERM)" in trainer_log or "(PREEMPT)" in trainer_log, trainer_log
    assert resume_step >= 3
    wait_ended(run)
    batch_log = _batch_log(run)
    assert "Slurm preempts it (requeue)" in batch_log, batch_log  # the old trap stopped without a checkpoint
    assert f"{job}+{trainer['het_index']}|PREEMPTED" in _accounting(job)
    assert_resumed_cleanly(run, job, resume_step)


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_stops_without_requeue(tmp_path, vslurm, slurm_jobs):
    from test_faults_slurm import wait_ended

    run, job = _launch(tmp_path, slurm_jobs, "usercancel")
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    assert subprocess.run(["scancel", job]).returncode == 0
    status = wait_ended(run)
    time.sleep(15)  # longer than a requeued job needs to start again here (cred_expire=10)
    batch_log = _batch_log(run)
    assert status.state == "cancelled", (status.to_dict(), batch_log)
    assert "not a preemption" in batch_log and "requeue" not in batch_log.replace("no requeue", ""), batch_log
    assert not (run / "logs" / "attempt_1").exists() and not (run / "PREEMPT").exists()
    assert "REQUEUED" not in _accounting(job) and "PREEMPTED" not in _accounting(job)
    assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == ""


@pytest.mark.slurm
@pytest.mark.slow
def test_usr2_at_the_last_restart_on_slurm_checkpoints_then_stops(tmp_path, vslurm, slurm_jobs):
    from test_faults_slurm import wait_ended

    run, job = _launch(tmp_path, slurm_jobs, "lastrestart", "deployment.max_restarts=0")
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    assert subprocess.run(["scancel", "--batch", "--signal=USR2", job]).returncode == 0
    wait_ended(run)
    step, _log = _checkpointed_step(run)
    assert step >= 3 and is_complete(run / "checkpoints", step)  # resumable from where it stopped
    batch_log = _batch_log(run)
    assert "no automatic restart left (0/0" in batch_log, batch_log
    assert not (run / "logs" / "attempt_1").exists() and "REQUEUED" not in _accounting(job)


@pytest.mark.slurm
@pytest.mark.slow
def test_usr2_after_done_does_not_requeue(tmp_path, vslurm, slurm_jobs):
    from test_faults_slurm import STEPS, trainer_steps, wait_ended

    # A long grace period keeps the job alive after DONE (the smoke trainer still counts its steps)
    run, job = _launch(tmp_path, slurm_jobs, "afterdone", "deployment.grace_period_s=60")
    wait_for(lambda: is_complete(run / "checkpoints", 3), 120, "checkpoint step_3")
    (run / "DONE").write_text(json.dumps({"time": time.time(), "by": "test"}))
    wait_for(lambda: "stopping the other groups within 60s" in _batch_log(run), 60, "the orchestrator's exit")
    assert subprocess.run(["scancel", "--batch", "--signal=USR2", job]).returncode == 0
    status = wait_ended(run)
    batch_log = _batch_log(run)
    assert "after the run finished (DONE): no checkpoint, no requeue" in batch_log, batch_log
    assert not (run / "logs" / "attempt_1").exists() and "REQUEUED" not in _accounting(job), batch_log
    assert (run / "DONE").exists() and not (run / "PREEMPT").exists()
    assert status.state == "completed" and [r["step"] for r in trainer_steps(run)] == list(range(STEPS))
