"""Fault drills on the real local stack (vLLM CPU server, router, orchestrator, 2 FSDP trainer ranks).

One run, three faults, each followed by `rlctl resume`:
  (b) SIGKILL one trainer rank   → the run fails (teardown) → resume from the newest complete checkpoint
  (c) SIGKILL the orchestrator   → the run fails               → resume
  (a) SIGKILL the vLLM server    → the orchestrator's requests fail after their retries, the run fails
      cleanly                    → resume (a fresh server gets the resumed weights from the watcher)
then the run finishes. We choose "fail cleanly and resume" for a dead server: a server that vanished
does not come back by itself, and a resumed attempt costs one server start (≈ 80 s here).
The run must end `completed` with contiguous trainer and orchestrator steps and a reward curve that
continues after each resume, and leave no process behind.
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

from rlctl.orchestrator.exchange.metrics import read_records
from rlctl.orchestrator.exchange.checkpoints import newest_complete
from e2e_checks import leftover_processes, wait_for
from rlctl.launchers.status import pid_alive, run_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]
STEPS, INTERVAL = 21, 3
RECIPE = [str(REPO / "recipes" / "tiny-cpu.toml"), "--cluster", "local",
          "-o", f"orchestrator.max_steps={STEPS}", "-o", f"checkpoint.interval={INTERVAL}",
          "-o", "orchestrator.rollouts_per_step=128", "-o", "orchestrator.max_in_flight=256",
          "-o", "deployment.grace_period_s=3"]


def rlctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout)



def pid_of(run: Path, name: str) -> int:
    return json.loads((run / "status" / f"{name}.json").read_text())["pid"]


def ended(run: Path, timeout: float = 120):
    return wait_for(lambda: (s := run_state(run)).ended and s, timeout, f"{run.name} to end")


def metrics(run: Path, component: str) -> list[dict]:
    lines = read_records(run)
    return [r for r in lines if r["component"] == component]


def kill_after_checkpoint(run: Path, after: int, victim: str) -> int:
    """Wait for a complete checkpoint newer than `after`, SIGKILL `victim`; returns that checkpoint.
    Only a checkpoint that leaves 2 intervals to go: after a kill the trainer goes on with the batches
    already written (2-token steps are fast) and checkpoints where teardown stops it; killed 3 steps
    before the end (12 steps, checkpoint 9), a run once trained to the end first, leaving nothing to resume."""
    step = wait_for(lambda: (n := newest_complete(run / "checkpoints")) is not None and after < n <= STEPS - 2 * INTERVAL
                    and n, 400, f"a checkpoint after step {after}")
    os.kill(pid_of(run, victim), signal.SIGKILL)
    status = ended(run)
    assert status.state == "failed", status.to_dict()
    return step


def resume(run: Path, expect_step: int) -> int:
    out = rlctl("resume", str(run), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    step = newest_complete(run / "checkpoints")
    assert info["from_checkpoint"] and info["step"] == step >= expect_step, info
    # rewound: nothing newer than the checkpoint survives
    assert all(int(p.name[5:]) < step for p in (run / "rollouts").glob("step_*"))
    assert all(int(p.name[5:]) <= step for p in (run / "weights").glob("step_*"))
    assert max(r["step"] for r in metrics(run, "trainer")) == step - 1
    return step


def test_kill_trainer_rank_orchestrator_and_vllm_then_resume_to_the_end(tmp_path):
    t0 = time.monotonic()
    out = rlctl("launch", *RECIPE, "-o", f"deployment.output_dir={tmp_path}", "--name", "faults", "--json")
    assert out.returncode == 0, out.stderr
    run = Path(json.loads(out.stdout)["run_dir"])
    resumed_at = []
    try:
        for victim in ("trainer.trainer.1", "orchestrator.orchestrator.0", "inference.inference.0"):
            ckpt = kill_after_checkpoint(run, resumed_at[-1] if resumed_at else 0, victim)
            log_tail = "\n".join(p.read_text()[-1500:] for p in (run / "logs" / "latest").glob("*/*.log"))
            resumed_at.append(resume(run, ckpt))
            print(f"killed {victim} after checkpoint {ckpt}; resumed at {resumed_at[-1]} "
                  f"({time.monotonic() - t0:.0f}s)")
        status = ended(run, 400)
        assert status.state == "completed", (status.to_dict(), log_tail)
    finally:
        rlctl("cancel", str(run), timeout=60)

    trainer, orch = metrics(run, "trainer"), metrics(run, "orchestrator")
    assert [r["step"] for r in trainer] == list(range(STEPS))  # contiguous: none lost, none repeated
    assert [r["step"] for r in orch] == list(range(STEPS))
    rewards = [r["reward_mean"] for r in orch]
    for k in resumed_at:
        first = next(r for r in orch if r["step"] == k)
        # the fresh servers served the resumed policy (the watcher applied weights/step_K at start);
        # without it the gate (version >= K-1) could never open
        assert first["policy_version"] >= k - 1, first
        before, after = sum(rewards[k - INTERVAL:k]) / INTERVAL, sum(rewards[k:k + INTERVAL]) / len(rewards[k:k + INTERVAL])
        assert after >= before - 0.1, (k, rewards)
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["attempt"] == 3 and [a["resume_step"] for a in manifest["attempts"][1:]] == resumed_at
    assert (run / "logs" / "latest").resolve().name == "attempt_3"
    for rec in (json.loads(p.read_text()) for p in (run / "status").glob("*.json")):
        assert rec["state"] == "exited" and not pid_alive(rec["pid"], rec.get("started")), rec
    assert (run / "DONE").exists()
    # Nothing of any attempt lingers: not the killed components' children (router, vLLM engine) either.
    wait_for(lambda: not leftover_processes(run), 10, f"no process of the run left: {leftover_processes(run)}")
