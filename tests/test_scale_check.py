"""Scale check without GPUs: one rank's shard of the mesh the planner chose, built on the meta device
with the trainer's own code (`build_parallel_model`), against `rlctl plan`'s memory breakdown.

The cases run in one subprocess, each with a fake process group of the planned world size (as torchtitan's
dry runs do): no memory, no communication, the real shapes and FSDP2 placements of rank 0 — the
fullest rank, since FSDP2 gives the first ranks whole dim-0 chunks.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]

# Catalog name -> transformers model_type (the catalog holds the published config.json fields).
MODEL_TYPES = {
    "qwen3-8b": "qwen3", "qwen3-32b": "qwen3", "qwen3-30b-a3b": "qwen3_moe", "qwen3-235b-a22b": "qwen3_moe",
    "llama-3.1-70b": "llama", "deepseek-v3": "deepseek_v3", "kimi-k2": "deepseek_v3", "glm-5": "glm_moe_dsa",
}
# (recipe, overrides): the two MoE recipes as written, the other catalog models planned on the GLM-5
# cluster (12 trainer nodes of 8 H200) or the qwen3-4b one (dense: ep 1).
CASES = [("qwen3-30b-a3b", ()), ("glm5-swe", ()), ("glm5-swe", ('model.name="deepseek-v3"',)),
         ("glm5-swe", ('model.name="kimi-k2"', "trainer.cp=2")), ("glm5-swe", ('model.name="qwen3-235b-a22b"',)),
         ("glm5-swe", ('model.name="llama-3.1-70b"', "trainer.ep=1")), ("qwen3-4b", ('model.name="qwen3-32b"',))]
TOLERANCE = 0.10


def hf_config(name: str):
    from transformers import AutoConfig

    from rlctl.recipes.model_catalog import CATALOG

    return AutoConfig.for_model(MODEL_TYPES[name], **CATALOG[name])


def planned(recipe: str, overrides) -> tuple[dict, dict]:
    """(the plan's trainer degrees, its per-GPU memory breakdown in GiB) as `rlctl plan --json` gives them."""
    from rlctl.recipes.load import load_recipe
    from rlctl.recipes.plan import plan

    report = plan(load_recipe([recipe], list(overrides))).to_json()
    assert report["fits"], report["errors"]
    return report["placement"]["trainer_degrees"], report["trainer"]["memory_gib"]


def shard_bytes(model_name: str, degrees: dict, trainer_cfg: dict, fold: bool = True) -> dict:
    """Run in the child: fake process group, world mesh, `build_parallel_model` without loading;
    this rank's parameter, gradient and AdamW bytes (gradients and both moments take the parameters'
    dtype). `fold`: when the model's attention cannot be split (CP), build cp into dp_shard — the same
    fsdp mesh, so the same parameter bytes; without it, the trainer's start-up validation of exactly the planned degrees."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlctl.recipes.errors import RecipeError
    from rlctl.trainer.build import build_parallel_model
    from rlctl.trainer.context_parallel import check_context_parallel
    from rlctl.trainer.degrees import ParallelDims
    from rlctl.trainer.parallel import build_mesh

    config = hf_config(model_name)
    built = dict(degrees)
    notes = []
    try:
        if fold:
            check_context_parallel(config, built["cp"])
    except RecipeError as e:  # same fsdp mesh (dp_shard × cp), so the same parameter bytes
        notes.append(f"cp folded into dp_shard: {e}")
        built["dp_shard"], built["cp"] = built["dp_shard"] * built["cp"], 1
    world = built["dp_replicate"] * built["dp_shard"] * built["cp"] * built["tp"]
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    dims = ParallelDims(**built, world_size=world).validate("cuda")
    mesh = build_mesh(dims, torch.device("cpu"))
    cfg = type("TrainerCfg", (), {**trainer_cfg, "fp8": False})  # FP8 keeps high-precision master weights
    model = build_parallel_model(config, dims, mesh, "cpu", cfg)
    local = full = 0
    for p in model.parameters():
        shard = p.to_local() if hasattr(p, "to_local") else p
        assert shard.is_meta
        local += shard.numel() * shard.element_size()
        full += p.numel()
    return {"params": local, "grads": local, "optimizer": 2 * local, "full_params": full, "notes": notes}


def _trainer_cfg(tr) -> dict:
    return {"dtype": tr.dtype, "activation_checkpointing": tr.activation_checkpointing,
            "optimizer_dtype": tr.optimizer_dtype}


def shard_bytes_each(jobs: list) -> list:
    """Run in the child: `shard_bytes` for each (model, degrees, trainer_cfg, fold); a failing case
    reports its traceback instead of failing the others."""
    import traceback

    import torch.distributed as dist

    out = []
    for job in jobs:
        try:
            out.append(shard_bytes(*job))
        except Exception:  # noqa: BLE001 - handed back to the case's own test
            out.append({"error": traceback.format_exc()})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    return out


def _run_children(jobs: list) -> list:
    """One child for every case of the module: torch and transformers are imported once, not per case."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_scale_check import shard_bytes_each; "
            f"print('RESULT ' + json.dumps(shard_bytes_each({jobs!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


STARTUP_RECIPES = ["qwen3-30b-a3b", "glm5-swe"]


@pytest.fixture(scope="module")
def built():
    """Every case, keyed by ("startup", recipe) or ("shard", recipe, overrides): its loaded recipe, the
    plan's degrees and memory, and what the child built (the rank-0 shard, or the case's error)."""
    from rlctl.recipes.load import load_recipe

    cases = {("startup", recipe): (recipe, (), False) for recipe in STARTUP_RECIPES}
    cases.update({("shard", recipe, overrides): (recipe, overrides, True) for recipe, overrides in CASES})
    found, jobs = {}, []
    for key, (recipe, overrides, fold) in cases.items():
        loaded = load_recipe([recipe], list(overrides))
        degrees, memory = planned(recipe, overrides)
        found[key] = SimpleNamespace(loaded=loaded, degrees=degrees, memory=memory)
        jobs.append((loaded.model.name, degrees, _trainer_cfg(loaded.trainer), fold))
    for case, shard in zip(found.values(), _run_children(jobs)):
        case.shard = shard
    return found


def _case(built: dict, key) -> SimpleNamespace:
    case = built[key]
    assert "error" not in case.shard, case.shard.get("error")
    return case


@pytest.mark.parametrize("recipe", STARTUP_RECIPES)
def test_startup_validation_accepts_the_planned_degrees(built, recipe):
    """The trainer's own checks and construction, exactly the planned degrees (resolved as the trainer
    resolves them from the placement), on the real config, meta device, fake process group."""
    from rlctl.trainer.degrees import resolve_dims

    case = _case(built, ("startup", recipe))
    degrees = case.degrees
    world = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    dims = resolve_dims(case.loaded.trainer, world, "cuda", planned=degrees)
    assert {k: getattr(dims, k) for k in degrees} == degrees
    assert case.shard["notes"] == []


@pytest.mark.parametrize("recipe,overrides", CASES, ids=[f"{r}{'+' if o else ''}{'+'.join(o)}" for r, o in CASES])
def test_rank_shard_matches_the_plan(built, recipe, overrides):
    from rlctl.recipes.models import get_model_spec

    case = _case(built, ("shard", recipe, overrides))
    name, degrees, memory, got = case.loaded.model.name, case.degrees, case.memory, case.shard
    # the model transformers builds is the one the planner counts
    assert got["full_params"] == pytest.approx(get_model_spec(name).total_params, rel=0.01)
    gib = 2**30
    measured = sum(got[k] for k in ("params", "grads", "optimizer")) / gib
    plan = sum(memory[k] for k in ("params", "grads", "optimizer"))
    print(f"{name} {degrees}: shard {measured:.2f} GiB vs plan {plan:.2f} GiB {got['notes']}")
    assert measured == pytest.approx(plan, rel=TOLERANCE), (measured, plan, got["notes"])
