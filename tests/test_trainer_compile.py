"""`trainer.compile`: where the compile wrapper goes, what is refused, what the plan makes of it.

The compiled trainer itself is checked against the textbook step in test_trainer_fsdp.py (2 ranks,
activation checkpointing) and against one eager rank with experts over ep = 2 in test_moe.py.
"""
from __future__ import annotations

import getpass
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import plan
from rlctl.trainer.compiled_layers import (check_compile, compile_unavailable_reason, is_compiled,
                                           use_user_compile_cache, wrap_layers)


def _layers(n: int = 3) -> torch.nn.ModuleList:
    return torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))


def _names(layers) -> list[str]:
    return [name.replace("_checkpoint_wrapped_module.", "") for name, _ in layers.named_parameters()]


@pytest.mark.parametrize(("checkpoint", "compile"), [(True, True), (False, True), (True, False)])
def test_each_layer_is_compiled_in_place_inside_its_checkpoint(checkpoint, compile):
    """The compile adds no module (no `_orig_mod.` in the names that checkpoints and publishing use)."""
    layers = _layers()
    originals, names = list(layers), _names(layers)
    wrap_layers(layers, checkpoint=checkpoint, compile=compile)
    inner = [layer._checkpoint_wrapped_module if checkpoint else layer for layer in layers]
    assert all(isinstance(layer, CheckpointWrapper) == checkpoint for layer in layers)
    assert inner == originals and all(is_compiled(layer) == compile for layer in layers)
    assert _names(layers) == names


def test_a_compiled_layer_computes_what_the_eager_one_does():
    layers = _layers(1)
    x = torch.randn(5, 4)
    expected = layers[0](x)
    wrap_layers(layers, checkpoint=False, compile=True)
    torch.testing.assert_close(layers[0](x), expected)
    torch.testing.assert_close(layers[0](torch.cat([x, x])), torch.cat([expected, expected]))  # dynamic rows


def test_refused_with_the_key_when_no_compiler_can_build_kernels(monkeypatch):
    cfg = load_recipe(["recipes/tiny-cpu.toml"], ["trainer.compile=true"]).trainer
    monkeypatch.setenv("CXX", "no-such-cxx-compiler")
    with pytest.raises(RecipeError) as err:
        check_compile(cfg, torch.device("cpu"))
    assert str(err.value).startswith("trainer.compile: ") and "no-such-cxx-compiler" in str(err.value)
    assert str(err.value).endswith("set trainer.compile = false") and "\n" not in str(err.value)
    check_compile(load_recipe(["recipes/tiny-cpu.toml"]).trainer, torch.device("cpu"))  # off: nothing checked

    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "")
    assert "none is on PATH" in compile_unavailable_reason("cpu")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert "triton" in compile_unavailable_reason("cuda")


def test_the_plan_counts_a_compiled_step():
    eager = plan(load_recipe(["recipes/qwen3-4b.toml"])).to_json()["trainer"]
    compiled = plan(load_recipe(["recipes/qwen3-4b.toml"], ["trainer.compile=true"])).to_json()["trainer"]
    assert compiled["compute_s"] < 0.95 * eager["compute_s"]
    assert compiled["memory_gib_per_gpu"] == eager["memory_gib_per_gpu"]


def _warm_up_leaves_no_trace(rank, world, port, run_root):
    """One rank of a tiny MoE trainer with trainer.compile: the warm-up compiles and changes nothing."""
    import os

    # the environment torchrun gives a rank on one node; the Trainer joins the group from it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # as a launched trainer starts: no cache dir set (pytest's own compiles set torch's default in the
    # environment this process inherited), the user's cache under XDG_CACHE_HOME
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    os.environ["XDG_CACHE_HOME"] = str(Path(run_root).parent / "xdg")
    from torch._dynamo.utils import counters

    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.load import validate
    from rlctl.trainer.moe import expert_load
    from rlctl.trainer.step import warm_up_compile
    from rlctl.trainer.train import Trainer

    run = RunDir(run_root)
    trainer = Trainer(run, validate(run.recipe_data()))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    rng = torch.get_rng_state()
    warm_up_compile(trainer.step_ctx, 6)
    assert counters["stats"]["unique_graphs"] > 0 and all(is_compiled(layer) for layer in trainer.model.model.layers)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    assert expert_load(trainer.model).sum() == 0
    assert not trainer.optimizer.state  # no optimizer step
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    shared = Path(run_root).parent / "xdg" / "rlctl" / "torchinductor"  # where the user's next job looks
    assert cache_dir() == str(shared) and any(shared.iterdir())


def test_the_compile_warm_up_leaves_weights_gradients_rng_and_expert_counts_as_they_were(tmp_path):
    from trainer_fixtures import make_run, spawn_ranks

    run = make_run(tmp_path / "run", ["model.name=tiny-qwen3-moe", "trainer.fsdp=1", "trainer.ep=1",
                                      "trainer.compile=true", "trainer.activation_checkpointing=true"])
    spawn_ranks(_warm_up_leaves_no_trace, 1, str(run.root), timeout=240)


def test_plan_and_launch_refuse_a_local_compile_this_host_cannot_build(monkeypatch, tmp_path):
    """On the local scheduler the host that plans is the one that trains: no compiler is one line, exit 2,
    before any process starts."""
    from typer.testing import CliRunner

    from rlctl.cli.main import app

    monkeypatch.setenv("CXX", "no-such-cxx-compiler")
    launch = ["launch", "recipes/tiny-cpu.toml", "-o", f"deployment.output_dir={tmp_path}"]
    for args in (["plan", "recipes/tiny-cpu.toml"], launch):
        result = CliRunner().invoke(app, [*args, "-o", "trainer.compile=true"])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "trainer.compile" in lines[0] and "no-such-cxx-compiler" in lines[0], result.output
    assert not any(tmp_path.iterdir())  # no run directory
    assert CliRunner().invoke(app, ["plan", "recipes/tiny-cpu.toml"]).exit_code == 0  # off: nothing checked


def test_compiled_kernels_go_to_the_cache_the_users_jobs_share_unless_the_user_says_where(tmp_path, monkeypatch):
    """A private /tmp per job would otherwise make every job, a resumed one too, compile again."""
    job_tmp = tmp_path / "job-tmp"
    job_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(job_tmp))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir() == default_cache_dir()  # torch's first look puts its default in the environment
    shared = tmp_path / "xdg" / "rlctl" / "torchinductor"
    assert use_user_compile_cache() == str(shared)
    assert cache_dir() == str(shared)
    # torch's precompiled header goes under default_cache_dir() (<tmp>/torchinductor_<user>): into the cache
    assert Path(default_cache_dir()) == job_tmp / f"torchinductor_{getpass.getuser()}"
    assert Path(default_cache_dir()).resolve() == shared.resolve()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_user_compile_cache() == str(tmp_path / "mine") and cache_dir() == str(tmp_path / "mine")
