"""`rlctl launch` against the real virtual Slurm cluster (tests/slurm/cluster.sh): het jobs, env
contract, teardown on failure, cancel, dry-run scripts. Entry points are the smoke ones."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_checks import wait_for
from rlctl.launchers.env import expand_nodelist
from rlctl.launchers.slurm_state import component_states, job_finished
from rlctl.orchestrator.exchange.checkpoints import is_complete

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "recipes" / "smoke.toml")
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]


def rlctl(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def launch_json(tmp_path: Path, jobs: list, *extra: str, env: dict | None = None) -> tuple[dict, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen([*RLCTL, "launch", SMOKE, "--cluster", "vslurm", "-o", f"deployment.output_dir={tmp_path}",
                             "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    first = proc.stdout.readline()  # the JSON summary starts with '{' on its own line
    took = time.monotonic() - t0
    rest, err = proc.stdout.read(), proc.stderr.read()  # stderr: a few progress lines at most
    proc.wait(timeout=600)
    assert proc.returncode == 0, err
    info = json.loads(first + rest)
    if info["job_id"]:
        jobs.append(info["job_id"])
    return info, took


def sacct_rows(job: str) -> dict[str, dict]:
    out = subprocess.run(["sacct", "-P", "-j", job, "-o", "JobID,State,NodeList,NTasks"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    head = out[0].split("|")
    return {r.split("|")[0]: dict(zip(head, r.split("|"))) for r in out[1:]}


def records(run: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in sorted((run / "smoke").glob("*.json")):
        rec = json.loads(p.read_text())
        out.setdefault(rec["group"], []).append(rec)
    return out


def processes_of(run: Path) -> list[int]:
    """Live processes whose command line mentions the run dir (components, submitit tasks, supervisor)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(run).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def all_checked_in(run: Path) -> bool:
    recs = records(run)
    return sum(len(v) for v in recs.values()) == 19  # 1 orchestrator + 2 servers + 16 trainer ranks


def test_smoke_launch_wait_runs_one_het_job_with_the_contract(vslurm, tmp_path, slurm_jobs):
    inherited = {"SLURM_JOB_ID": "424242", "SLURM_JOB_NODELIST": "elsewhere[1-9]", "SLURM_NNODES": "9",
                 "SLURM_NTASKS": "99", "SLURM_CPUS_PER_TASK": "64"}  # as if launched from inside a job
    info, _ = launch_json(tmp_path, slurm_jobs, "--wait", env=inherited)
    job, run = info["job_id"], Path(info["run_dir"])
    rows = sacct_rows(job)
    assert [rows[f"{job}+{k}"]["State"] for k in range(3)] == ["COMPLETED"] * 3
    assert not any(k.startswith(f"{job}+3") for k in rows)
    nodes = {k: set(expand_nodelist(rows[f"{job}+{k}"]["NodeList"])) for k in range(3)}
    assert nodes[0] == {"node5"} and len(nodes[1]) == 1 and len(nodes[2]) == 2
    assert not (nodes[0] & nodes[1] or nodes[0] & nodes[2] or nodes[1] & nodes[2])

    recs = records(run)
    by_group = {g: len(v) for g, v in recs.items()}
    assert by_group == {"orchestrator": 1, "inference": 2, "trainer": 16}
    for k, group in enumerate(["orchestrator", "inference", "trainer"]):
        assert {r["node"] for r in recs[group]} == nodes[k], group
        assert {r["env"]["SLURM_JOB_ID"] for r in recs[group]} == {job}  # not the inherited 424242
    tr = recs["trainer"]
    assert {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"], r["env"]["WORLD_SIZE"]) for r in tr} == {
        ("127.0.0.1", tr[0]["env"]["MASTER_PORT"], "16")}
    assert sorted(int(r["env"]["RANK"]) for r in tr) == list(range(16))
    cpus = {g["name"]: g["cpus_per_task"] for g in json.loads((run / "configs" / "groups.json").read_text())}
    # a rank's threads: its own task's CPUs (or the OMP_NUM_THREADS the job was submitted with)
    assert {r["env"].get("OMP_NUM_THREADS") for r in tr} == {os.environ.get("OMP_NUM_THREADS") or str(cpus["trainer"])}
    for node in nodes[2]:
        assert sorted(int(r["env"]["LOCAL_RANK"]) for r in tr if r["node"] == node) == list(range(8))
    inf = recs["inference"]
    assert sorted(int(r["env"]["RLCTL_SERVER_INDEX"]) for r in inf) == [0, 1]
    assert {r["env"]["RLCTL_BIND_HOST"] for r in inf} == {"127.0.0.1"}
    orch = recs["orchestrator"][0]
    announced = sorted(json.loads(p.read_text())["url"] for p in (run / "services" / "inference").glob("*.json"))
    assert sorted(orch["saw"]["inference"]) == announced and len(announced) == 2
    assert orch["saw"]["router"] == json.loads((run / "services" / "router" / "0.json").read_text())["url"]

    manifest = json.loads((run / "run.json").read_text())
    assert manifest["job_id"] == job and manifest["scheduler"] == "slurm" and manifest["attempt"] == 0
    assert [g["name"] for g in manifest["groups"]] == ["orchestrator", "inference", "trainer"]
    assert (run / "logs" / "latest" / "trainer" / "trainer.15.log").read_text().strip().endswith("clean exit")
    assert not os.stat(run).st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    pickles = list((run / "submitit").rglob("*.pkl"))
    assert pickles and all(p.stat().st_mode & 0o077 == 0 for p in pickles)
    # submitit's view of the het job: the watcher maps JOB+K rows back to JOB; results per group folder
    from rlctl.launchers.groups import JobGroup
    from rlctl.launchers.hetjob import HetJob

    het = HetJob(folder=run / "submitit" / "attempt_0", job_id=job)
    het.groups = [JobGroup.from_dict(g) for g in json.loads((run / "configs" / "groups.json").read_text())]
    assert het.state == "COMPLETED" and het.component_info(2)["NodeList"] == rows[f"{job}+2"]["NodeList"]
    results = het.group_job("trainer").results()
    assert sorted(r["rank"] for r in results) == list(range(16)) and {r["returncode"] for r in results} == {0}


def test_killing_one_group_ends_the_whole_job_at_once(vslurm, tmp_path, slurm_jobs):
    grace = 120  # the other groups are told at once (TERM), not left idling through the grace period
    info, took = launch_json(tmp_path, slurm_jobs, "-o", "deployment.smoke.run_s=600", "-o", f"deployment.grace_period_s={grace}")
    job, run = info["job_id"], Path(info["run_dir"])
    # launch must not block on the job (it holds for 600 s); the 2 s target is measured in bench/
    assert took < 15.0, f"launch took {took:.1f}s"
    wait_for(lambda: all_checked_in(run), 120, "every task to check in")
    victim = json.loads((run / "smoke" / "trainer.11.json").read_text())["pid"]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    states = wait_for(lambda: (s := component_states(job)) and job_finished(s) and s, 90, "the job to end",
                      poll=0.5)
    elapsed = time.monotonic() - t0
    assert elapsed < 60, elapsed
    assert any(v["state"] != "COMPLETED" for v in states.values())
    assert subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == ""
    batch_log = next((run / "logs" / "latest").glob("slurm-*.out")).read_text()
    assert "group trainer step exited with code" in batch_log and "asking the other groups to stop" in batch_log
    assert "grace period over" not in batch_log
    wait_for(lambda: not processes_of(run), 30, "every process of the run to exit")


def test_when_a_group_fails_the_trainer_checkpoints_in_the_grace_period(vslurm, tmp_path, slurm_jobs):
    """The others are told to stop through their tasks (TERM): the trainer saves the step it is on. A TERM
    to their srun instead made srun kill its step a second later, with no checkpoint."""
    info, _ = launch_json(tmp_path, slurm_jobs, "-o", "deployment.trainer_nodes=1", "-o", "deployment.smoke.steps=400",
                          "-o", "deployment.smoke.step_s=0.5", "-o", "checkpoint.interval=100",
                          "-o", "deployment.grace_period_s=60", "-o", "deployment.smoke.fail_group=inference",
                          "-o", "deployment.smoke.fail_after_s=8")
    run = Path(info["run_dir"])
    wait_for(lambda: job_finished(component_states(info["job_id"])), 50, "the job to end before its grace period")
    trainer_log = (run / "logs" / "latest" / "trainer" / "trainer.0.log").read_text()
    assert "(SIGTERM)" in trainer_log and "checkpoint step_" in trainer_log, trainer_log
    assert any(is_complete(run / "checkpoints", int(p.name[5:])) for p in (run / "checkpoints").glob("step_*"))
    # the failure summary names the task that failed first, from its wrapper's record, not a bystander
    errors = json.loads(rlctl("monitor", str(run), "--json").stdout)["errors"]
    assert errors[0]["line"] == "inference rank 0 failed first: exited with code 3", errors  # its own code
    assert any("failing on purpose" in e["line"] for e in errors[1:]), errors
    wait_for(lambda: not processes_of(run), 30, "every process of the run to exit")


def test_cancel_ends_the_job_and_leaves_no_process(vslurm, tmp_path, slurm_jobs):
    info, _ = launch_json(tmp_path, slurm_jobs, "-o", "deployment.smoke.run_s=600")
    job, run = info["job_id"], Path(info["run_dir"])
    wait_for(lambda: all_checked_in(run), 120, "every task to check in")
    out = rlctl("cancel", str(run))
    assert out.returncode == 0, out.stderr
    assert f"cancelled job {job}" in out.stdout
    states = component_states(job)
    assert job_finished(states) and {v["state"] for v in states.values()} == {"CANCELLED"}
    wait_for(lambda: not processes_of(run), 30, "every process of the run to exit")
    logs = rlctl("logs", str(run), "orchestrator")
    assert logs.returncode == 0 and "smoke orchestrator rank 0" in logs.stdout
    again = rlctl("cancel", str(run))  # an ended job: said so, not "cancelled" a second time
    assert again.returncode == 0 and f"is not running (job {job} already ended: +0 CANCELLED" in again.stdout, again


def test_dry_run_writes_a_valid_sbatch_script_and_submits_nothing(vslurm, tmp_path, slurm_jobs):
    info, _ = launch_json(tmp_path, slurm_jobs, "--dry-run", "--name", "dry")
    script = Path(info["script"])
    assert info["job_id"] is None and script.is_file()
    for name in ("recipe.json", "recipe.toml", "placement.json"):
        assert (Path(info["run_dir"]) / "configs" / name).is_file()
    text = script.read_text()
    assert text.count("#SBATCH hetjob") == 2 and text.count("srun --het-group=") == 3
    test = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True)
    assert test.returncode == 0, test.stderr
    assert "to start at" in test.stderr
    assert "rlctl-dry" not in subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout
    again = rlctl("launch", SMOKE, "--cluster", "vslurm", "-o", f"deployment.output_dir={tmp_path}", "--dry-run",
                  "--name", "dry")
    assert again.returncode == 2 and "already exists" in again.stderr


def test_a_job_sbatch_refuses_is_one_line_and_exit_2(vslurm, tmp_path):
    out = rlctl("launch", SMOKE, "--cluster", "vslurm", "-o", f"deployment.output_dir={tmp_path}",
                "-o", "deployment.trainer.partition=nope")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "sbatch refused the job: invalid partition" in out.stderr
    # nothing ran: no run directory is left to show as pending forever, the name is free again
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_submission_command_drops_inherited_slurm_variables(vslurm, tmp_path, monkeypatch):
    from rlctl.launchers.groups import JobGroup
    from rlctl.launchers.hetjob import HetSlurmExecutor

    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    monkeypatch.setenv("SLURM_MEM_PER_CPU", "999999")
    ex = HetSlurmExecutor(tmp_path / "sub", [JobGroup("trainer", 0, 1, 1, "m")], job_name="j",
                          batch_log=tmp_path / "log", grace_period_s=1)
    cmd = ex._make_submission_command(tmp_path / "script.sh")
    assert cmd[0] == "env" and cmd[-2:] == ["sbatch", str(tmp_path / "script.sh")]
    unset = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-u"}
    assert {"SLURM_JOB_ID", "SLURM_MEM_PER_CPU"} <= unset and "SLURM_CONF" not in unset
    assert oct((tmp_path / "sub").stat().st_mode & 0o777) == "0o700"


def test_orchestrator_beside_inference_when_there_is_no_cpu_partition(vslurm, tmp_path, slurm_jobs):
    info, _ = launch_json(tmp_path, slurm_jobs, "--wait", "-o", "deployment.orchestrator_placement=inference_node")
    job, run = info["job_id"], Path(info["run_dir"])
    rows = sacct_rows(job)
    assert [rows[f"{job}+{k}"]["State"] for k in range(2)] == ["COMPLETED"] * 2 and f"{job}+2" not in rows
    recs = records(run)
    assert recs["orchestrator"][0]["node"] == rows[f"{job}+0"]["NodeList"] == recs["inference"][0]["node"]
    assert {r["node"] for r in recs["trainer"]} == set(expand_nodelist(rows[f"{job}+1"]["NodeList"]))
