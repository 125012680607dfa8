"""Unit tests of the launchers' pure parts: het script rendering, sacct row mapping, env contract."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlctl.launchers.env import component_env, expand_nodelist, master_port_for
from rlctl.launchers.groups import JobGroup, components
from rlctl.launchers.hetjob import HetInfoWatcher, combined_state
from rlctl.launchers.slurm_state import parse_component_rows
from rlctl.launchers.het_script import render_het_script, strip_slurm_env

ORCH = JobGroup("orchestrator", 0, 1, 1, "rlctl.orchestrator", partition="cpu", cpus_per_task=4)
INF = JobGroup("inference", 1, 2, 2, "rlctl.inference", gpus_per_node=8, partition="gpu", qos="high",
               mem_gib=64)
TR = JobGroup("trainer", 2, 3, 8, "rlctl.trainer", gpus_per_node=8, partition="gpu", account="rl",
              constraint="h200", time_limit="1:00:00")


def _script(groups, grace=7):
    return render_het_script(groups, Path("/runs/r/submitit/attempt_0"), "/usr/bin/python3", job_name="rlctl-r",
                             batch_log=Path("/runs/r/logs/attempt_0/slurm-%j.out"), grace_period_s=grace,
                             env={"RLCTL_RUN_DIR": "/runs/r"})


def _blocks(text: str) -> list[list[str]]:
    header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    blocks, cur = [], []
    for ln in header:
        if ln == "#SBATCH hetjob":
            blocks.append(cur)
            cur = []
        else:
            cur.append(ln)
    return blocks + [cur]


def test_script_has_one_block_per_component_with_its_resources():
    blocks = _blocks(_script([ORCH, INF, TR]))
    assert len(blocks) == 3
    assert "#SBATCH --partition=cpu" in blocks[0] and not any("gpus" in ln for ln in blocks[0])
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=8",
            "#SBATCH --qos=high", "#SBATCH --mem=64G"} <= set(blocks[1])
    assert {"#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=8", "#SBATCH --account=rl",
            "#SBATCH --constraint=h200", "#SBATCH --time=1:00:00"} <= set(blocks[2])


def test_script_runs_one_srun_step_per_group_into_its_own_folder():
    text = _script([ORCH, INF, TR], grace=7)
    sruns = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(sruns) == 3
    for k, name in enumerate(["orchestrator", "inference", "trainer"]):
        assert f"--het-group={k}" in sruns[k]
        assert sruns[k].endswith(f"submitit.core._submit /runs/r/submitit/attempt_0/{name} &")
    assert "GRACE=7" in text and "umask 077" in text


def test_orchestrator_beside_inference_is_an_overlapping_step_not_a_component():
    orch = JobGroup("orchestrator", 0, 1, 1, "m", shares_component=True)
    inf = JobGroup("inference", 0, 2, 1, "m", gpus_per_node=8)
    tr = JobGroup("trainer", 1, 1, 8, "m", gpus_per_node=8)
    assert [[g.name for g in c] for c in components([orch, inf, tr])] == [["inference", "orchestrator"], ["trainer"]]
    text = _script([orch, inf, tr])
    assert len(_blocks(text)) == 2
    orch_srun = next(ln for ln in text.splitlines() if ln.startswith("srun ") and "/orchestrator &" in ln)
    assert "--het-group=0" in orch_srun and "--overlap" in orch_srun and "--ntasks=1" in orch_srun


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n"], input=_script([ORCH, INF, TR]), text=True, check=True)


def test_sacct_rows_map_to_components_and_the_leader():
    sacct = "\n".join([
        "JobID|State|NodeList|ExitCode",
        "41+0|COMPLETED|node5|0:0", "41+0.batch|COMPLETED|node5|0:0", "41+0.0|COMPLETED|node5|0:0",
        "41+1|RUNNING|node1|0:0", "41+1.0|RUNNING|node1|0:0",
        "41+2|COMPLETED|node[2-3]|0:0",
        "50|PENDING|None assigned|0:0",
    ])
    info = HetInfoWatcher().read_info(sacct)
    assert info["41+1"]["State"] == "RUNNING" and info["41+2"]["NodeList"] == "node[2-3]"
    assert info["41"]["State"] == "RUNNING"  # one component still runs → the job runs
    assert info["50"]["State"] == "PENDING"  # plain jobs keep submitit's mapping
    assert not any("." in k for k in info)


def test_combined_state_prefers_failure_then_running():
    assert combined_state(["COMPLETED", "FAILED", "RUNNING"]) == "FAILED"
    assert combined_state(["CANCELLED by 0", "COMPLETED"]) == "CANCELLED"
    assert combined_state(["COMPLETED", "PENDING"]) == "PENDING"
    assert combined_state(["COMPLETED", "COMPLETED"]) == "COMPLETED"


def test_component_rows_skip_steps_and_other_jobs():
    rows = [["7+0", "RUNNING", "node5"], ["7+1", "PENDING", "(Resources)"], ["7+1.0", "RUNNING", "node1"],
            ["8+0", "RUNNING", "node4"]]
    assert parse_component_rows("7", rows) == {0: {"state": "RUNNING", "nodelist": "node5"},
                                               1: {"state": "PENDING", "nodelist": None}}


def test_inherited_slurm_variables_are_stripped_but_not_the_config_path():
    env = {"SLURM_JOB_ID": "3", "SLURM_NTASKS": "4", "SLURM_CONF": "/etc/slurm/slurm.conf", "HOME": "/root"}
    assert strip_slurm_env(env) == ["SLURM_JOB_ID", "SLURM_NTASKS"]


def test_trainer_env_comes_from_its_group_nodes():
    addrs = ["10.0.0.3", "10.0.0.4"]
    envs = [component_env(run_dir="/r", attempt=1, group="trainer", rank=r, local_rank=r % 2, local_world_size=2,
                          world_size=4, node_index=r // 2, node_addrs=addrs, master_port=master_port_for("123"))
            for r in range(4)]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.3"}
    assert {e["MASTER_PORT"] for e in envs} == {str(master_port_for("123"))}
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert all(e["WORLD_SIZE"] == "4" and e["RLCTL_ATTEMPT"] == "1" for e in envs)
    assert all(e["PYTHONFAULTHANDLER"] == "1" for e in envs)  # a native crash names its Python frames


def test_rendezvous_ports_stay_between_the_servers_ports_and_the_ephemeral_range():
    from rlctl.inference.server import LISTEN_PORTS

    ports = {master_port_for(str(job)) for job in range(30_000)} | {master_port_for("12345_7")}
    assert min(ports) >= LISTEN_PORTS[1] and max(ports) < 32768  # Linux's default ephemeral range starts there
    assert len(ports) > 10_000  # spread: jobs sharing a node rarely collide


def test_inference_env_binds_to_its_node_and_never_all_interfaces():
    e = component_env(run_dir="/r", attempt=0, group="inference", rank=3, local_rank=1, local_world_size=2,
                      world_size=4, node_index=1, node_addrs=["10.0.0.1", "10.0.0.2"], master_port=1)
    assert e["RLCTL_SERVER_INDEX"] == "3" and e["RLCTL_BIND_HOST"] == "10.0.0.2" and e["RLCTL_LOCAL_RANK"] == "1"
    assert "MASTER_ADDR" not in e


@pytest.mark.parametrize("nodelist,expected", [
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[07-08],cpu1", ["gpu07", "gpu08", "cpu1"]),
    ("node5", ["node5"]),
])
def test_nodelist_expansion(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_slurm_task_env_uses_its_own_group_nodelist_and_the_looked_up_addresses():
    from rlctl.launchers.env import slurm_task_env

    trainer = JobGroup("trainer", 2, 2, 8, "m")
    environ = {"SLURM_JOB_NODELIST": "node5", "SLURM_JOB_NODELIST_HET_GROUP_2": "node[2-3]",
               "RLCTL_NODE_ADDRS_2": "node2=10.1.0.2,node3=10.1.0.3", "SLURMD_NODENAME": "node3",
               "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77"}
    env = slurm_task_env(trainer, "/r", 2, environ)
    assert (env["MASTER_ADDR"], env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "10.1.0.2", "9", "1", "16", "8")
    assert env["MASTER_PORT"] == str(master_port_for("77")) and env["RLCTL_ATTEMPT"] == "2"
    assert env["OMP_NUM_THREADS"] == "1"  # the task's CPUs (JobGroup's default cpus_per_task)
    assert "OMP_NUM_THREADS" not in slurm_task_env(trainer, "/r", 2, environ | {"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in slurm_task_env(JobGroup("inference", 1, 1, 1, "m", cpus_per_task=4), "/r", 2,
                                                   environ | {"SLURM_JOB_NODELIST_HET_GROUP_1": "node5"})


@pytest.mark.parametrize("field,value", [("job_name", "rlctl-a\nscancel -u $USER"), ("partition", "gpu\nrm -rf ~"),
                                         ("env", {"RLCTL_RUN_DIR": "/runs/a\rb"}), ("qos", "high\x1b[2J")])
def test_control_characters_never_reach_the_batch_script(field, value):
    from rlctl.recipes.errors import RecipeError

    groups, kwargs = [ORCH, INF, TR], {}
    if field in ("partition", "qos"):
        groups = [ORCH, JobGroup(**{**INF.to_dict(), field: value}), TR]
    else:
        kwargs[field] = value
    with pytest.raises(RecipeError) as e:
        render_het_script(groups, Path("/runs/r/submitit/attempt_0"), "/usr/bin/python3",
                          **{"job_name": "rlctl-r", "batch_log": Path("/runs/r/logs/attempt_0/slurm-%j.out"),
                             "grace_period_s": 1, **kwargs})
    assert "\n" not in str(e.value) and "control character" in str(e.value)
    assert {"job_name": "name", "partition": "deployment.inference.partition", "env": "env RLCTL_RUN_DIR",
            "qos": "deployment.inference.qos"}[field] in str(e.value)


def test_percent_in_paths_is_escaped_for_slurm_and_the_job_runs_in_the_run_dir():
    text = render_het_script([ORCH, INF, TR], Path("/runs/50%-off/submitit/attempt_0"), "/usr/bin/python3",
                             job_name="rlctl-50%-off", batch_log=Path("/runs/50%-off/logs/attempt_0/slurm-%j.out"),
                             grace_period_s=1, env={"RLCTL_RUN_DIR": "/runs/50%-off"})
    assert "#SBATCH --output=/runs/50%%-off/logs/attempt_0/slurm-%j.out" in text  # the file name stays a pattern
    sruns = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert all("--output=/runs/50%%-off/submitit/attempt_0/" in ln and '"${SLURM_JOB_ID}"_%t_log.out' in ln
               for ln in sruns)
    assert all(" -P -u -m submitit.core._submit /runs/50%-off/submitit/attempt_0/" in ln for ln in sruns)
    assert "#SBATCH --chdir=/runs/50%-off" in text.split("#SBATCH hetjob")[0]
    assert "umask 077" in text


def test_a_model_directory_relative_to_the_launch_directory_travels_absolute(tmp_path, monkeypatch):
    """Components run in the run dir, so `model.name = "my-model"` must reach them as an absolute path."""
    import json

    from rlctl.launchers.launch import load_for_launch
    from rlctl.trainer.tiny_model import TINY_QWEN3

    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text(json.dumps(TINY_QWEN3))
    monkeypatch.chdir(tmp_path)
    recipe = load_for_launch(["tiny-cpu"], ["model.name=my-model"])[0]
    assert recipe.model.name == str(tmp_path / "my-model")
    assert load_for_launch(["tiny-cpu"])[0].model.name == "tiny-qwen3"  # catalog names stay names


def test_lora_launches_but_refuses_the_broadcast_transport_and_fp8():
    """LoRA runs launch; adapters travel as PEFT files, so the broadcast transport is refused by its key."""
    from rlctl.launchers.launch import load_for_launch
    from rlctl.recipes.errors import RecipeError

    assert load_for_launch(["tiny-cpu"], ["trainer.lora.rank=8"])[0].trainer.lora.rank == 8
    with pytest.raises(RecipeError) as err:
        load_for_launch(["tiny-cpu"], ["trainer.lora.rank=8", "weights.transport=broadcast"])
    assert err.value.key == "weights.transport"
    with pytest.raises(RecipeError) as err:
        load_for_launch(["tiny-cpu"], ["trainer.lora.rank=8", "trainer.fp8=true"])
    assert err.value.key == "trainer.fp8"
    assert load_for_launch(["tiny-cpu"], ["trainer.lora.rank=0"])[0].trainer.lora.rank == 0


def test_a_pool_is_one_plain_job_with_its_front_beside_the_servers():
    """A pool holds no CPU node (attached runs' orchestrators need it): its front is one task beside the
    servers, so the job has one component, which Slurm runs as a plain job (no --het-group, no
    per-component node list)."""
    from rlctl.launchers.launch import load_for_launch
    from rlctl.launchers.pool import POOL_MODULE, pool_job

    recipe, profile, placement, run_groups = load_for_launch(["tiny-cpu", "tiny-vslurm"])
    assert placement.orchestrator == "cpu_partition" and len(components(run_groups)) == 3  # a run: its own CPU node
    placement, (front, inference) = pool_job(recipe, profile, placement)
    assert placement.orchestrator == "inference_node"
    assert (front.module, front.het_index, front.shares_component, front.partition) == (POOL_MODULE, 0, True, "gpu")
    assert (front.nodes, front.ntasks_per_node, front.gpus_per_node) == (1, 1, 0)
    assert (inference.name, inference.het_index, inference.shares_component) == ("inference", 0, False)
    text = _script([front, inference])
    assert "#SBATCH hetjob" not in text and "--het-group" not in text
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --partition=cpu" not in text
    assert '"${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}"' in text
    sruns = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(sruns) == 2 and "--ntasks=1 --overlap" in sruns[0]
    # a run's het job still names its components
    assert all("--het-group=" in ln for ln in _script([ORCH, INF, TR]).splitlines() if ln.startswith("srun "))


@pytest.mark.parametrize("cpus, trainers, servers, threads", [
    (2, 1, 1, 1),   # the peer bench's one-rank trainer beside one CPU server: not 2 threads on 2 cores
    (2, 2, 1, 1),   # never fewer than one
    (16, 2, 1, 7),
    (16, 4, 0, 4),  # a run attached to a pool elsewhere: every core is the trainer's
])
def test_local_trainer_ranks_leave_a_core_to_each_server_on_the_host(cpus, trainers, servers, threads):
    from rlctl.launchers.local import trainer_threads

    groups = [JobGroup("orchestrator", 0, 1, 1, "rlctl.orchestrator"), JobGroup("trainer", 1, 1, trainers, "m")]
    groups += [JobGroup("inference", 2, servers, 1, "rlctl.inference")] if servers else []
    assert trainer_threads(groups, cpus) == threads


def test_a_requeue_counts_as_a_restart_before_accounting_catches_up(monkeypatch):
    """Right after `scontrol requeue`, squeue has the job pending while sacct still has its run running
    (a suite run saw 'pending, 0 restarts'); once sacct has the REQUEUED record the count stays 1."""
    from rlctl.launchers import slurm_state

    def acct(state: str, records: int = 1):
        return lambda job: ({0: {"state": state, "records": records, "exit_code": "0:0", "nodes": "node1",
                                 "start": "2026-12-03T10:00:00", "end": "Unknown"}}, "")

    monkeypatch.setattr(slurm_state, "squeue_components", lambda job: ({0: {"state": "PENDING", "nodes": ""}}, ""))
    for sacct, restarts in [(acct("RUNNING"), 1), (acct("REQUEUED"), 1), (acct("PENDING", 2), 1), (acct("PENDING"), 0)]:
        monkeypatch.setattr(slurm_state, "sacct_components", sacct)
        out, _ = slurm_state.read_job("7")
        assert out[0]["ours"] == "pending" and out[0]["restarts"] == restarts
    monkeypatch.setattr(slurm_state, "squeue_components", lambda job: ({0: {"state": "RUNNING", "nodes": "n"}}, ""))
    monkeypatch.setattr(slurm_state, "sacct_components", acct("RUNNING"))
    assert slurm_state.read_job("7")[0][0]["restarts"] == 0


def test_an_interrupt_never_leaves_a_started_run_unrecorded_nor_a_claimed_name_behind(tmp_path, monkeypatch):
    """Ctrl-C between spawning the supervisor and writing run.json left a run nothing could see or cancel;
    before anything started, it left a directory without run.json that blocked the name for good."""
    import os
    import signal

    from rlctl.launchers import launch as launch_module
    from rlctl.launchers import local

    args = (["smoke"], [f"deployment.output_dir={tmp_path}"])

    def interrupted_build(run, recipe):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_module, "_maybe_build_model", interrupted_build)
    with pytest.raises(KeyboardInterrupt):
        launch_module.launch(*args, cluster="local", name="early")
    assert not (tmp_path / "early").exists()  # the name is free again

    monkeypatch.setattr(launch_module, "_maybe_build_model", lambda run, recipe: None)

    def spawn_then_ctrl_c(run, attempt, extra_env=None):
        os.kill(os.getpid(), signal.SIGINT)  # arrives right after the spawn, before run.json records it
        return 4242424

    monkeypatch.setattr(local, "start_supervisor", spawn_then_ctrl_c)
    # Python ignores SIGINT when it starts ignored, as a shell's background job (`pytest ... &`) does
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # still interrupted, once the run is recorded
            launch_module.launch(*args, cluster="local", name="late")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert json.loads((tmp_path / "late" / "run.json").read_text())["supervisor_pid"] == 4242424


def test_the_built_tiny_model_is_the_owners_only_whatever_the_umask(tmp_path, monkeypatch):
    import os

    from rlctl.launchers.launch import _maybe_build_model
    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.load import load_recipe

    monkeypatch.setenv("RLCTL_TINY_MODEL_CACHE", str(tmp_path / "cache"))
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    old = os.umask(0o022)  # a user's usual umask: files would be 0644
    try:
        _maybe_build_model(run, load_recipe(["tiny-cpu"], []))
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in run.model.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o600"}, modes
    assert oct(run.model.stat().st_mode & 0o777) == "0o700"
