"""The tiny recipe as one heterogeneous job on the virtual Slurm cluster (tests/slurm/cluster.sh): the real
vLLM CPU server on a `gpu` node, router + orchestrator on the `cpu` node, a 2-rank FSDP2 trainer — the
reward rises and every het component ends COMPLETED."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import pytest
from e2e_checks import REPO, RLCTL, TINY, assert_contract_keys, metrics, monitor_json

ON_VSLURM = str(REPO / "recipes" / "tiny-vslurm.toml")
STEPS = 40  # reward ≈ 0.55 by then, a clear rise (the full 80 steps are the local test's job)


def test_tiny_recipe_places_like_cpu_on_a_gpu_profile():
    """8 GPUs per node must not turn the CPU recipe into 8 trainer ranks and 8 vLLM servers."""
    from rlctl.launchers.launch import load_for_launch

    _, profile, placement, groups = load_for_launch([TINY, ON_VSLURM])
    assert profile.name == "vslurm" and profile.gpus_per_node == 8
    assert (placement.trainer_ranks_per_node, placement.inference_servers, placement.inference_gpus_per_server) == (2, 1, 0)
    assert placement.orchestrator == "cpu_partition"
    by_name = {g.name: g for g in groups}
    assert by_name["orchestrator"].partition == "cpu" and by_name["trainer"].partition == "gpu"
    assert all(g.gpus_per_node == 0 for g in groups)
    # the plan report agrees with what is launched
    report = json.loads(subprocess.run([*RLCTL, "plan", TINY, ON_VSLURM, "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    assert report["placement"] == placement.to_dict() and report["fits"]


def sacct_states(job: str) -> dict[str, str]:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", "JobID,State"], capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split("|")[:2] for line in out.splitlines() if line.strip())


@pytest.mark.slow
@pytest.mark.slurm
def test_tiny_recipe_learns_as_a_het_job(vslurm, tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([*RLCTL, "launch", TINY, ON_VSLURM, "--cluster", vslurm, "--name", "e2e-slurm",
                           "-o", f"deployment.output_dir={tmp_path}", "-o", f"orchestrator.max_steps={STEPS}", "--wait"],
                          capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    run = tmp_path / "e2e-slurm"
    manifest = json.loads((run / "run.json").read_text())
    job = manifest["job_id"]
    try:
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    assert manifest["scheduler"] == "slurm"
    states = sacct_states(job)
    assert sorted(states) == [f"{job}+0", f"{job}+1", f"{job}+2"], states
    assert set(states.values()) == {"COMPLETED"}, states

    # The server bound to its node's address from Slurm (NodeAddr), not 0.0.0.0, and ran the CPU build
    # of vLLM (its announcement is withdrawn at shutdown, so read what it logged).
    inference_log = (run / "logs" / "latest" / "inference" / "inference.0.log").read_text()
    ready = re.search(r"ready at http://([^:]+):(\d+)", inference_log)
    assert ready and ready.group(1) != "0.0.0.0", inference_log[-2000:]
    socket.getaddrinfo(ready.group(1), int(ready.group(2)))  # resolvable
    assert "starting (cpu)" in inference_log

    trainer, orch = metrics(run)
    assert_contract_keys(trainer, orch)
    assert [r["step"] for r in orch] == list(range(STEPS)) and [r["step"] for r in trainer] == list(range(STEPS))
    rewards = [r["reward_mean"] for r in orch]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5
    assert last >= first + 0.25, f"reward did not rise: {rewards}"
    mon = monitor_json(run)
    assert mon["state"] == "completed" and mon["steps_done"] == STEPS, mon
    print(f"tiny-cpu on vslurm: {took:.0f}s wall, reward first-3 {first:.3f} -> last-5 {last:.3f}")


ATTACHED_STEPS = 20


@pytest.mark.slow
@pytest.mark.slurm
def test_a_pool_on_slurm_serves_a_run_attached_from_another_job(vslurm, tmp_path):
    """`rlctl pool launch` on the cluster: one plain job (the server and, beside it, the pool's front) on a
    `gpu` node, holding no `cpu` node; a run attached to it is a second job of trainer + orchestrator
    only, whose orchestrator takes the `cpu` node, and learns through the pool; `rlctl pool stop` ends it."""
    from e2e_checks import wait_for

    out = ["-o", f"deployment.output_dir={tmp_path}"]
    launched = subprocess.run([*RLCTL, "pool", "launch", TINY, ON_VSLURM, "--cluster", vslurm, "--name", "vpool", *out],
                              capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr
    pool_job = json.loads((tmp_path / "pools" / "vpool" / "run.json").read_text())["job_id"]

    def show() -> dict:
        shown = subprocess.run([*RLCTL, "pool", "show", "vpool", "--root", str(tmp_path), "--json"],
                               capture_output=True, text=True, timeout=60)
        return json.loads(shown.stdout) if shown.returncode == 0 else {}

    try:
        wait_for(lambda: show().get("url"), 600, "the pool to serve", poll=2)
        assert sacct_states(pool_job) == {pool_job: "RUNNING"}  # one component: a plain job
        queued = subprocess.run(["squeue", "-h", "-j", pool_job, "-o", "%P"], capture_output=True, text=True).stdout
        assert queued.split() == ["gpu"], queued

        t0 = time.monotonic()
        run = subprocess.run([*RLCTL, "launch", TINY, ON_VSLURM, "--cluster", vslurm, "--name", "attached", *out,
                              "-o", "deployment.inference_pool=vpool", "-o", f"orchestrator.max_steps={ATTACHED_STEPS}",
                              "--wait"], capture_output=True, text=True, timeout=600)
        took = time.monotonic() - t0
        assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        run_dir = tmp_path / "attached"
        job = json.loads((run_dir / "run.json").read_text())["job_id"]
        assert sacct_states(job) == {f"{job}+0": "COMPLETED", f"{job}+1": "COMPLETED"}  # orchestrator, trainer
        trainer, orch = metrics(run_dir)
        assert [r["step"] for r in orch] == list(range(ATTACHED_STEPS)) == [r["step"] for r in trainer]
        stats = show()["stats"]
        assert stats["holders"] == ["attached"] and stats["busy_s"] > 0, stats
        assert show()["state"] == "running"  # the run ended, the pool serves on
        print(f"attached run on a Slurm pool: {took:.0f}s wall for {ATTACHED_STEPS} steps, reward "
              f"{orch[0]['reward_mean']:.3f} -> {orch[-1]['reward_mean']:.3f}")
    finally:
        stopped = subprocess.run([*RLCTL, "pool", "stop", "vpool", "--root", str(tmp_path)], capture_output=True,
                                 text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not subprocess.run(["squeue", "-h", "-j", pool_job], capture_output=True, text=True).stdout.strip(),
             120, "the pool's job to leave the queue", poll=1)
