"""LoRA on the trainer: the wrapper starts as the identity, trains only its adapters, uses PEFT names,
and a 2-rank FSDP trainer publishes adapter-only step directories that vLLM can load."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from rlctl.orchestrator.exchange.steps import complete_steps
from rlctl.trainer.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoRALinear, adapter_state, apply_lora,
                                init_adapters)
from rlctl.trainer.lora_config import LoRAConfig
from trainer_fixtures import join_gloo, launch_ranks, make_run, spawn_ranks, synthetic_batch, wait_all, write_batches


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rlctl.trainer.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def test_wrapper_is_the_identity_at_init_and_trains_only_adapters(tiny_dir):
    base, model = _model(tiny_dir), _model(tiny_dir)
    wrapped = apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    init_adapters(model, seed=0)
    assert wrapped and all(isinstance(model.get_submodule(p), LoRALinear) for p in wrapped)
    assert {p.rsplit(".", 1)[-1] for p in wrapped} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"}
    ids = torch.randint(4, 20, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(wrapped)
    # A is drawn (non-zero), B is zero; the base weight is the very tensor the HF model loaded
    layer = model.get_submodule(wrapped[0])
    assert layer.lora_A.weight.abs().sum() > 0 and not layer.lora_B.weight.any()
    # a gradient step moves only adapters, and then the output changes
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_only_targeted_modules_are_wrapped_and_unknown_targets_fail(tiny_dir):
    model = _model(tiny_dir)
    wrapped = apply_lora(model, LoRAConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    assert {p.rsplit(".", 1)[-1] for p in wrapped} == {"q_proj", "v_proj"}
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert not isinstance(model.model.layers[0].mlp.down_proj, LoRALinear)


def test_adapter_state_has_peft_names_and_the_zero_adapter_matches_the_trained_shapes(tiny_dir):
    lora = LoRAConfig(rank=4)
    model = _model(tiny_dir)
    apply_lora(model, lora)
    state = adapter_state(model)
    assert all(k.startswith(PEFT_PREFIX + "model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in state)
    assert PEFT_PREFIX + "model.layers.0.self_attn.q_proj.lora_A.weight" in state
    from safetensors.torch import load_file

    from rlctl.inference.lora_serving import write_zero_adapter

    out = write_zero_adapter(tiny_dir, lora, tiny_dir.parent / "zero")
    zero = load_file(str(out / ADAPTER_WEIGHTS))
    assert {k: tuple(v.shape) for k, v in zero.items()} == {k: tuple(v.shape) for k, v in state.items()}
    assert not any(v.any() for v in zero.values())
    assert json.loads((out / ADAPTER_CONFIG).read_text())["r"] == 4


def test_fsdp_trainer_publishes_adapter_only_steps(tmp_path):
    """2 FSDP ranks, rank 8: every weights/step_N holds just the PEFT adapter (+ marker); step 0's B is
    zero, the trained steps' is not; the base is never published."""
    from safetensors.torch import load_file

    run = make_run(tmp_path / "run", ["trainer.lora.rank=8", "trainer.optimizer.lr=1e-2",
                                      "orchestrator.max_steps=2", "checkpoint.interval=0"])
    batch = synthetic_batch(run.model)
    write_batches(run, batch, range(2))
    procs = launch_ranks(run, 2)
    deadline = time.monotonic() + 240
    while len(complete_steps(run.weights)) < 3 and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    (run.root / "DONE").write_text("")
    codes = wait_all(procs, timeout=120)
    assert codes == [0, 0], (run.root / "trainer_rank0.log").read_text()[-3000:]
    steps = complete_steps(run.weights)
    assert steps[-1] == 2
    for step in steps:
        files = sorted(p.name for p in (run.weights / f"step_{step}").iterdir())
        assert files == sorted(["COMPLETE", ADAPTER_CONFIG, ADAPTER_WEIGHTS]), files
    first, last = (load_file(str(run.weights / f"step_{s}" / ADAPTER_WEIGHTS)) for s in (steps[0], steps[-1]))
    b_names = [k for k in last if k.endswith("lora_B.weight")]
    assert len(b_names) == 7 * 2  # 7 targets x 2 layers of the tiny model
    if steps[0] == 0:
        assert not any(first[k].any() for k in b_names)
    assert any(last[k].any() for k in b_names)
    config = json.loads((run.weights / "step_2" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 8 and len(config["target_modules"]) == 7


def _gather_rank(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlctl.trainer.parallel import gather_full

    join_gloo(rank, world, port)
    torch.manual_seed(0)  # the same full tensors on every rank
    # 5 rows over 3 ranks split 2/2/1, 2 rows 1/1/0: the uneven and the empty shard
    model = nn.Sequential(nn.Linear(3, 5, bias=False), nn.Linear(5, 2, bias=False))
    original = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    for _ in range(3):  # repeated, as every publish does
        for full, p in zip(original, model.parameters()):
            assert torch.equal(gather_full(p.detach()), full)
    dist.destroy_process_group()


def test_adapter_gather_rebuilds_uneven_and_empty_shards_on_every_rank():
    spawn_ranks(_gather_rank, 3, timeout=120)


def test_lora_server_serves_the_adapter_under_the_policy_name_and_only_admins_swap_it(monkeypatch):
    from rlctl.inference.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, AdminAuthMiddleware
    from rlctl.inference.server import SERVED_MODEL_NAME, render_server_command, server_env
    from rlctl.orchestrator.exchange.placement import Placement
    from rlctl.recipes.load import load_recipe
    from test_inference_entry import _ok_app, call

    recipe = load_recipe(["tiny-cpu"], ["trainer.lora.rank=12"])
    cmd = render_server_command(recipe, Placement(1, 1, 2, 1, 0, "inference_node"), "cpu", model_dir="/m",
                                host="127.0.0.1", port=1, has_module=lambda _: True, initial_adapter="/zero")
    assert cmd[cmd.index("--served-model-name") + 1] == SERVED_MODEL_NAME + "-base"
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"  # the smallest rank vLLM accepts that holds 12
    assert cmd[cmd.index("--lora-modules") + 1] == f"{SERVED_MODEL_NAME}=/zero" and "--enable-lora" in cmd
    assert server_env(recipe, "cpu", Path("/r"), "a", "b")["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain = render_server_command(load_recipe(["tiny-cpu"], []), Placement(1, 1, 2, 1, 0, "inference_node"), "cpu",
                                  model_dir="/m", host="127.0.0.1", port=1, has_module=lambda _: True)
    assert "--enable-lora" not in plain and plain[plain.index("--served-model-name") + 1] == SERVED_MODEL_NAME
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "admin-tok")
    monkeypatch.setenv(API_KEY_ENV, "api-key")
    guarded = AdminAuthMiddleware(_ok_app)
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert call(guarded, route, {"Authorization": "Bearer api-key"}) == 401
        assert call(guarded, route, {"Authorization": "Bearer admin-tok"}) == 200
    assert call(guarded, "/v1/completions", {"Authorization": "Bearer api-key"}) == 200


def test_moe_models_and_fp8_are_refused_naming_the_key():
    from transformers import AutoConfig

    from rlctl.recipes.errors import RecipeError
    from rlctl.recipes.load import load_recipe
    from rlctl.trainer.lora import check_lora_supported
    from rlctl.trainer.tiny_model import TINY_QWEN3, TINY_QWEN3_MOE

    def config(d):
        return AutoConfig.for_model(**{k: v for k, v in d.items() if k != "architectures"})

    trainer = load_recipe(["tiny-cpu"], ["trainer.lora.rank=8"]).trainer
    check_lora_supported(config(TINY_QWEN3), trainer)
    with pytest.raises(RecipeError) as err:
        check_lora_supported(config(TINY_QWEN3_MOE), trainer)
    assert err.value.key == "trainer.lora.rank"
