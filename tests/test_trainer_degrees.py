"""One set of degrees: the plan's, written with the placement, shown by `launch --dry-run`, read by the
trainer; FP8 refused in one line where it cannot run."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.placement import Placement, read_trainer_degrees
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import compute_placement, plan
from rlctl.trainer.degrees import resolve_dims

runner = CliRunner()
PLANNED = {"glm5-swe": {"dp_replicate": 1, "dp_shard": 96, "cp": 1, "tp": 1, "ep": 8},
           "qwen3-30b-a3b": {"dp_replicate": 1, "dp_shard": 16, "cp": 1, "tp": 1, "ep": 8}}


@pytest.mark.parametrize("recipe", sorted(PLANNED))
def test_the_plan_writes_its_degrees_with_the_placement(recipe):
    report = plan(load_recipe([recipe]))
    tr = report.trainer
    degrees = report.placement.trainer_degrees
    assert degrees == PLANNED[recipe]
    assert degrees == {"dp_replicate": tr["dp_replicate"], "dp_shard": tr["fsdp"], "cp": tr["cp"], "tp": tr["tp"],
                       "ep": tr["ep"]}
    world = report.placement.trainer_world_size
    cfg = load_recipe([recipe]).trainer
    dims = resolve_dims(cfg, world, "cuda", planned=degrees)
    assert (dims.dp_shard, dims.cp, dims.ep) == (degrees["dp_shard"], degrees["cp"], degrees["ep"])


def test_auto_does_not_become_1_where_the_plan_chose_more():
    # qwen3-30b-a3b: ep = "auto"; the recipe alone resolves it to 1, the plan chose 8
    cfg = load_recipe(["qwen3-30b-a3b"]).trainer
    assert cfg.ep == "auto" and resolve_dims(cfg, 16, "cuda").ep == 1
    assert resolve_dims(cfg, 16, "cuda", planned=compute_placement(load_recipe(["qwen3-30b-a3b"])).trainer_degrees).ep == 8


def test_cpu_runs_get_their_degrees():
    tiny = compute_placement(load_recipe(["tiny-cpu"]))
    assert tiny.trainer_degrees == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    # fsdp 'auto' with ep 2: two shard ranks (ep borrows from them), not one rank the trainer refuses
    moe = compute_placement(load_recipe(["tiny-cpu"], ["trainer.fsdp=auto", "trainer.ep=2"]))
    assert moe.trainer_world_size == 2 and moe.trainer_degrees["dp_shard"] == 2 and moe.trainer_degrees["ep"] == 2
    two_nodes = compute_placement(load_recipe(["tiny-cpu"], ["deployment.trainer_nodes=2", "trainer.fsdp=2"]))
    assert two_nodes.trainer_degrees == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    cp = compute_placement(load_recipe(["tiny-cpu"], ["trainer.fsdp=auto", "trainer.cp=2"]))
    assert cp.trainer_degrees == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "ep": 1}


def test_placement_round_trip_and_old_placements():
    p = compute_placement(load_recipe(["glm5-swe"]))
    assert Placement.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    old = {k: v for k, v in p.to_dict().items() if k != "trainer_degrees"}
    assert Placement.from_dict(old).trainer_degrees is None
    with pytest.raises(ValueError, match="ep"):
        Placement.from_dict({**old, "trainer_degrees": {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}})
    with pytest.raises(ValueError, match="positive"):
        Placement.from_dict({**old, "trainer_degrees": {"dp_replicate": 1, "dp_shard": 2.5, "cp": 1, "tp": 1, "ep": 1}})


@pytest.mark.parametrize("recipe", sorted(PLANNED))
def test_dry_run_shows_and_writes_the_plans_degrees(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    r = runner.invoke(app, ["launch", recipe, "--dry-run", "--name", "d"])
    assert r.exit_code == 0, r.output
    d = PLANNED[recipe]
    assert (f"fsdp {d['dp_shard']} × cp {d['cp']} × tp 1 = {d['dp_shard'] * d['cp']} ranks; ep {d['ep']}"
            in r.output), r.output
    run = RunDir(tmp_path / "d")
    assert read_trainer_degrees(run) == d
    assert json.loads(run.manifest.read_text())["plan"]["trainer_degrees"] == d
    r = runner.invoke(app, ["launch", recipe, "--dry-run", "--name", "j", "--json"])
    assert json.loads(r.output)["trainer_degrees"] == d


def test_a_run_without_placement_has_no_planned_degrees(tmp_path):
    assert read_trainer_degrees(RunDir(tmp_path / "bare")) is None


def test_tensor_parallelism_is_refused_by_the_plan_like_by_the_trainer():
    r = runner.invoke(app, ["plan", "glm5-swe", "-o", "trainer.tp=2"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "trainer.tp:" in r.output, r.output


# ---- FP8 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["plan", "tiny-cpu", "-o", "trainer.fp8=true"],
                                  ["launch", "tiny-cpu", "--dry-run", "-o", "trainer.fp8=true"]])
def test_fp8_on_cpu_is_one_line_naming_the_key(argv, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    r = runner.invoke(app, argv)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "trainer.fp8:" in lines[0] and "Traceback" not in r.output
    assert not any(tmp_path.iterdir())  # refused before any run directory


def test_fp8_on_a_gpu_profile_is_still_planned():
    report = plan(load_recipe(["glm5-swe"]))
    assert report.fits and load_recipe(["glm5-swe"]).trainer.fp8


def test_apply_fp8_refuses_on_cpu_and_is_a_no_op_when_off():
    import torch

    from rlctl.trainer.fp8 import apply_fp8

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))
    with pytest.raises(RecipeError, match=r"^trainer\.fp8: .*cpu"):
        apply_fp8(model, type("Cfg", (), {"fp8": True}), torch.device("cpu"))
    assert apply_fp8(model, type("Cfg", (), {"fp8": False}), torch.device("cpu")) == []
    assert type(model[0]) is torch.nn.Linear


def test_fp8_filter_keeps_head_router_and_small_layers_in_high_precision():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlctl.trainer.fp8 import fp8_module_filter

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256,
                               num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                               num_experts=4, num_experts_per_tok=2, vocab_size=4096, mlp_only_layers=[])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    chosen = {name for name, mod in model.named_modules() if fp8_module_filter(mod, name)}
    assert chosen == {f"model.layers.0.self_attn.{p}_proj" for p in "qo"}  # k/v: 512 < 1024 outputs
    dense = torch.nn.ModuleDict({"gate_proj": torch.nn.Linear(1024, 2048), "lm_head": torch.nn.Linear(1024, 4096),
                                 "odd": torch.nn.Linear(1024, 1032)})
    assert {n for n, m in dense.named_modules() if fp8_module_filter(m, n)} == {"gate_proj"}


def test_build_refuses_fp8_on_cpu_before_building():
    import torch

    from rlctl.trainer.build import build_parallel_model
    from rlctl.trainer.degrees import ParallelDims

    cfg = type("Cfg", (), {"fp8": True, "dtype": "float32", "activation_checkpointing": False,
                           "optimizer_dtype": "float32"})
    with pytest.raises(RecipeError, match=r"trainer\.fp8"):
        build_parallel_model(object(), ParallelDims(1, 1, 1, 1, 1, 1), None, torch.device("cpu"), cfg)
