"""`rlctl plan` of a run attached to a shared inference pool (`deployment.inference_pool`): the run's
groups and node counts hold no inference, its rollouts are planned on the pool's servers when the pool
runs, and on the recipe's own [inference] section with a warning naming the key when it does not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import compute_placement

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
KEY = "deployment.inference_pool"


@pytest.fixture
def plan_cli(monkeypatch):
    """`rlctl plan ARGS...` in-process, 80 columns: (exit code, output)."""
    import typer
    from typer.testing import CliRunner

    from rlctl.cli import plan as plan_cli_module

    monkeypatch.setenv("COLUMNS", "80")
    app = typer.Typer()
    plan_cli_module.register(app)
    app.command("noop")(lambda: None)  # two commands: `plan` stays a subcommand, as in rlctl
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, ["plan", *map(str, args)])
        return result.exit_code, result.output

    return run


@pytest.fixture
def pools(tmp_path, monkeypatch):
    """make_pool(recipe, *overrides, runs=(), state="running"): a pool `p` under the output root
    tmp_path, its run.json written as `rlctl pool launch` writes it and its front announced."""
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    states = {}
    from rlctl.launchers import status

    monkeypatch.setattr(status, "run_state", lambda root, _manifest=None: type("S", (), {
        "state": states.get(Path(root).name, "unknown"), "scheduler": "local", "job_id": None})())

    def make_pool(recipe: str, *overrides: str, runs=(), state: str = "running") -> RunDir:
        rec = load_recipe([str(RECIPES / recipe)], list(overrides))
        pool = RunDir(tmp_path / "pools" / "p")
        pool.root.mkdir(parents=True, exist_ok=True)
        pool.create()
        placement = compute_placement(rec)
        pool.manifest.write_text(json.dumps({
            "name": "p", "scheduler": "local", "recipe": rec.model_dump(mode="json"),
            "plan": {"inference_nodes": placement.inference_nodes, "inference_servers": placement.inference_servers},
            "placement": placement.to_dict()}))
        pool.announce("pool", "0", {"url": "http://127.0.0.1:1", "mode": "full", "model": rec.model.name,
                                    "build_seed": rec.model.build_seed, "lora_rank": 0,
                                    "max_model_len": rec.inference.max_model_len,
                                    "stats": {"runs": {name: {"requests": 0} for name in runs}}})
        states["p"] = state
        return pool

    return make_pool


def _plan(plan_cli, *args) -> dict:
    code, out = plan_cli(*args, "--json")
    assert code == 0, out
    return json.loads(out)


def _group(j: dict, name: str) -> dict:
    return next(g for g in j["groups"] if g["name"] == name)


def test_tiny_cpu_attached_holds_no_inference_and_names_the_pool(plan_cli, pools):
    pools("tiny-cpu.toml", "inference.dp=2", runs=("left", "right"))
    attached = ["recipes/tiny-cpu.toml", "-o", f"{KEY}=p"]
    j = _plan(plan_cli, *attached)
    assert j["placement"]["inference_nodes"] == 0 and j["placement"]["inference_servers"] == 0
    assert _group(j, "inference") == {"name": "inference", "nodes": 0, "pool": "p", "pool_servers": 2}
    assert j["inference"]["pool"] == "p" and j["cost"]["nodes"] == 1
    pool = j["pool"]
    assert pool["name"] == "p" and pool["state"] == "running" and pool["planned_with"] == "pool"
    assert pool["servers"] == 2 and pool["attached_runs"] == 2 and pool["runs"] == ["left", "right"]
    assert not any(w.startswith(KEY) for w in j["warnings"]), j["warnings"]
    code, text = plan_cli(*attached)
    assert code == 0 and all(len(line) <= 80 for line in text.splitlines()), text
    flat = " ".join(text.split())
    assert "served by pool p (0 nodes of this run)" in flat, text
    assert "attached now 2 run(s): left, right" in flat and "with the pool to itself" in flat, text
    own = _plan(plan_cli, "recipes/tiny-cpu.toml")
    assert own["pool"] is None and _group(own, "inference")["nodes"] == 1


def test_the_pool_servers_set_the_rollout_step(plan_cli, pools):
    attached = ["recipes/tiny-cpu.toml", "-o", f"{KEY}=p"]
    pools("tiny-cpu.toml")  # the same one server the recipe would have
    one = _plan(plan_cli, *attached)
    pools("tiny-cpu.toml", "inference.dp=2")
    two = _plan(plan_cli, *attached)
    own = _plan(plan_cli, "recipes/tiny-cpu.toml")
    assert one["pool"]["servers"] == 1 and two["pool"]["servers"] == 2
    assert one["orchestrator"]["rollout_step_time_s"] == pytest.approx(own["orchestrator"]["rollout_step_time_s"])
    assert two["orchestrator"]["rollout_step_time_s"] < one["orchestrator"]["rollout_step_time_s"]
    assert two["pool"]["rollout_step_alone_s"] == two["orchestrator"]["rollout_step_time_s"]


def test_gpu_run_counts_only_its_own_nodes(plan_cli, pools):
    """qwen3-4b on h200-28: 1 trainer + 1 inference node by itself; attached, only the trainer's GPUs
    and nodes (plus the orchestrator's own node: the profile has no CPU partition) are the run's."""
    pools("qwen3-4b.toml", "deployment.inference_nodes=2")
    own = _plan(plan_cli, "recipes/qwen3-4b.toml")
    j = _plan(plan_cli, "recipes/qwen3-4b.toml", "-o", f"{KEY}=p")
    assert own["cost"]["gpus"] == 16 and j["cost"]["gpus"] == 8
    assert [g["nodes"] for g in j["groups"]] == [1, 0, 1]  # orchestrator (gpu partition, no GPU), pool, trainer
    assert _group(j, "orchestrator")["where"] == "gpu_partition"
    assert j["pool"]["nodes"] == 2 and j["pool"]["servers"] == 16 and j["pool"]["gpus"] == 16
    # twice the pool's servers: a shorter rollout step than the run's own node of servers
    assert j["orchestrator"]["rollout_step_time_s"] < own["orchestrator"]["rollout_step_time_s"]
    assert j["cost"]["gpu_hours_per_run"] < own["cost"]["gpu_hours_per_run"]
    code, text = plan_cli("recipes/qwen3-4b.toml", "-o", f"{KEY}=p")
    assert code == 0 and all(len(line) <= 80 for line in text.splitlines()), text
    assert "16 server(s) × 1 GPU(s) on 2 node(s) · 16 GPUs" in " ".join(text.split()), text


def test_a_pool_that_would_refuse_the_run_is_still_planned_on(plan_cli, pools):
    pools("tiny-cpu.toml", "inference.dp=2")  # serves sequences up to 64 tokens
    j = _plan(plan_cli, "recipes/tiny-cpu.toml", "-o", f"{KEY}=p", "-o", "inference.max_model_len=128")
    refused = [w for w in j["warnings"] if w.startswith("inference.max_model_len: ")]
    assert len(refused) == 1 and refused[0].endswith("(launch would refuse)"), j["warnings"]
    assert j["pool"]["planned_with"] == "pool" and j["pool"]["servers"] == 2


def test_auto_trainer_takes_what_keeps_up_with_the_pool(plan_cli, pools):
    """With trainer_nodes = "auto" the trainer may take the nodes its own servers would have had: as many
    as keep up with the pool, within the nodes the pool leaves free."""
    run = ["recipes/qwen3-4b.toml", "-o", f"{KEY}=p", "-o", 'deployment.trainer_nodes="auto"',
           "-o", "orchestrator.rollouts_per_step=2048", "-o", "orchestrator.max_in_flight=4096"]
    pools("qwen3-4b.toml", "deployment.inference_nodes=1")
    small = _plan(plan_cli, *run)
    pools("qwen3-4b.toml", "deployment.inference_nodes=8")
    big = _plan(plan_cli, *run)
    t_small, t_big = _group(small, "trainer")["nodes"], _group(big, "trainer")["nodes"]
    assert 1 < t_small < t_big and t_big + 8 + 1 <= 28, (t_small, t_big)
    for j in (small, big):
        o = j["orchestrator"]
        assert j["fits"] and o["trainer_step_time_s"] + o["weight_sync_trainer_s"] <= o["step_time_s"]
    capped = _plan(plan_cli, *run, "-o", "deployment.total_nodes=2")
    assert _group(capped, "trainer")["nodes"] == 2


@pytest.mark.parametrize("state", ["missing", "failed"])
def test_pool_not_running_warns_naming_the_key(plan_cli, pools, state):
    if state != "missing":
        pools("tiny-cpu.toml", "inference.dp=2", state=state)
    j = _plan(plan_cli, "recipes/tiny-cpu.toml", "-o", f"{KEY}=p")
    warned = [w for w in j["warnings"] if w.startswith(f"{KEY}: ")]
    assert len(warned) == 1 and "launch would refuse" in warned[0], j["warnings"]
    assert ("no pool 'p'" if state == "missing" else "is failed") in warned[0], warned
    assert j["pool"]["planned_with"] == "recipe" and j["pool"]["state"] == state
    assert j["pool"]["servers"] == 1 and _group(j, "inference")["nodes"] == 0  # the recipe's one server
    code, text = plan_cli("recipes/tiny-cpu.toml", "-o", f"{KEY}=p")
    assert code == 0 and "warning: deployment.inference_pool:" in text, text


def test_launch_placement_of_an_attached_gpu_run_has_no_inference_nodes():
    """launch sizes the job with compute_placement: the trainer only (the pool is not looked up there:
    its rollouts are the recipe's [inference] section's)."""
    rec = load_recipe([str(RECIPES / "qwen3-4b.toml")], [f"{KEY}=p"])
    placement = compute_placement(rec)
    assert placement.inference_nodes == 0 and placement.trainer_nodes == 1


def test_bad_pool_name_is_one_line(plan_cli):
    code, out = plan_cli("recipes/tiny-cpu.toml", "-o", f"{KEY}=../x")
    assert code == 2 and KEY in out and "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def test_a_pool_named_like_a_number_is_the_name_pool_launch_printed():
    """`rlctl pool launch ... --name 5` says to attach with `-o deployment.inference_pool=5`, which the
    override parser reads as the integer 5: it was refused as "not a valid string"."""
    rec = load_recipe([str(RECIPES / "tiny-cpu.toml")], [f"{KEY}=5"])
    assert rec.deployment.inference_pool == "5"
    assert load_recipe([str(RECIPES / "tiny-cpu.toml")], [f"{KEY}=007"]).deployment.inference_pool == "007"
