"""One Slurm state reader (launchers/slurm_state.py) read the same way by status, control and the
het executor, whatever squeue/sacct say (faked here; the virtual cluster tests cover the real ones)."""
from __future__ import annotations

from rlctl.launchers import slurm_state
from rlctl.launchers.status import run_state
from rlctl.orchestrator.exchange.files import atomic_write_json


def test_slurm_unavailable_is_unknown_with_reason(tmp_path, monkeypatch):
    run = tmp_path / "slurm-run"
    run.mkdir()
    atomic_write_json(run / "run.json", {"name": "s", "scheduler": "slurm", "job_id": "4242", "attempt": 1,
                                         "groups": [{"name": "trainer", "het_index": 0}]})
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no sacct / squeue on PATH
    status = run_state(run)
    assert status.state == "unknown" and "sacct not found" in status.reason


def _fake_slurm(monkeypatch, squeue: str, sacct: str) -> None:
    from rlctl.launchers import slurm_state

    def run(cmd):
        return (squeue if cmd[0] == "squeue" else sacct), ""

    monkeypatch.setattr(slurm_state, "_run", run)


def test_one_slurm_reader_preempted_is_an_end_state_everywhere(tmp_path, monkeypatch):
    from rlctl.launchers.control import run_active
    from rlctl.launchers.slurm_state import component_states, job_finished
    from rlctl.orchestrator.exchange.layout import RunDir

    run = tmp_path / "preempted"
    run.mkdir()
    atomic_write_json(run / "run.json", {"name": "p", "scheduler": "slurm", "job_id": "77", "attempt": 0,
                                         "groups": [{"name": "trainer", "het_index": 0}]})
    # preempted and not requeued: squeue no longer lists it, sacct's newest record says PREEMPTED
    _fake_slurm(monkeypatch, "", "77|rlctl-p|PREEMPTED|0:15|node1|2024-01-01T00:00:00|2024-01-01T00:10:00\n")
    status = run_state(run)
    assert status.state == "failed" and "preempted" in status.reason and "rlctl resume p" in status.reason
    _fake_slurm(monkeypatch, "", "77|rlctl-p|TIMEOUT|0:15|node1|2024-01-01T00:00:00|2024-01-01T00:10:00\n")
    status = run_state(run)  # the time limit ended it: said, with how to go on (it was a bare "failed")
    assert status.state == "failed" and status.reason.startswith("the time limit was reached"), status.reason
    _fake_slurm(monkeypatch, "", "77|rlctl-p|PREEMPTED|0:15|node1|2024-01-01T00:00:00|2024-01-01T00:10:00\n")
    assert job_finished(component_states("77")) and not run_active(RunDir(run))
    # preempted and requeued: a new record, PENDING in squeue — pending everywhere, and a restart
    _fake_slurm(monkeypatch, "77|PENDING|(null)|BeginTime\n",
                "77|rlctl-p|PREEMPTED|0:15|node1|2024-01-01T00:00:00|2024-01-01T00:10:00\n"
                "77|rlctl-p|PENDING|0:0|None assigned|Unknown|Unknown\n")
    status = run_state(run)
    assert status.state == "pending" and status.components[0].restarts == 1
    assert not job_finished(component_states("77")) and run_active(RunDir(run))


def test_a_slurm_command_that_timed_out_is_not_asked_again_at_once(monkeypatch):
    """With the controller down every query waits SLURM_TIMEOUT_S: `rlctl runs` over 36 runs showed nothing
    for 6 minutes. After one timeout the same command answers at once for a while."""
    import subprocess

    calls = []

    def hangs(cmd, **kwargs):
        calls.append(cmd[0])
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    monkeypatch.setattr(slurm_state, "_timed_out", {})
    monkeypatch.setattr(slurm_state.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(slurm_state.subprocess, "run", hangs)
    first = slurm_state._run(["squeue", "-j", "1"])
    later = [slurm_state._run(["squeue", "-j", str(j)]) for j in range(2, 30)]
    assert first[0] is None and "timed out" in first[1]
    assert calls == ["squeue"] and all(out is None and "not answering" in why for out, why in later)
    monkeypatch.setattr(slurm_state, "UNREACHABLE_S", 0.0)  # once it has passed, asked again
    slurm_state._run(["squeue", "-j", "1"])
    assert calls == ["squeue", "squeue"]
