"""One rank's shard of the trainer's model: built on the meta device, parallelised, then loaded.

The order is torchtitan's, and each step needs the one before it:

1. **meta build** — no rank ever holds the whole model (GLM-5 is ≈ 3 TB in fp32); modules and shapes
   exist, storage does not.
2. **grouped experts, then expert parallelism** — grouped experts replace transformers' per-expert
   modules by 3-D weights; expert parallelism then keeps this rank's slice of them (dim 0 over the
   `ep` mesh) and installs the all-to-all dispatch. Both rewrite modules, so they come before anything
   that wraps or shards modules.
3. **context parallelism** — switches attention to Ulysses over the `cp` mesh (and refuses models it
   cannot split) on the final module tree.
4. **FP8** — swaps the remaining Linear layers for Float8Linear; after grouped experts (which would
   otherwise discard converted per-expert layers) and before FSDP (which must shard the Float8Linear
   weights, not the modules they replaced).
5. **compile, activation checkpointing, FSDP2** — wraps the decoder layers (each compiled in place
   when `trainer.compile`, inside its checkpoint; compiled_layers.py) and shards every parameter: dense
   ones over `fsdp` (dp_shard × cp), expert ones over `efsdp` ((dp_shard / ep) × cp), plus
   replication over `dp_replicate`.
6. **load** (`load_from`) — materialises the local shards on the device and reads only this rank's
   bytes of the HF safetensors. Without it the model stays on the meta device: what start-up
   validation and the scale check need (shapes and placements, no memory).
"""
from __future__ import annotations

import importlib
from pathlib import Path


def _optional(module: str):
    """A trainer module that may not be installed in this tree yet; None when it is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # the module exists but something it imports is missing: a real error
            raise
        return None


def load_hf_config(config_or_dir):
    """A transformers config from a config object, a model directory or its config.json."""
    if not isinstance(config_or_dir, (str, Path)):
        return config_or_dir
    from transformers import AutoConfig

    path = Path(config_or_dir)
    return AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path))


def is_moe_config(config) -> bool:
    """Whether the model routes tokens to experts (Qwen3-MoE: num_experts; DeepSeek/GLM: n_routed_experts)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0))


def master_dtype(trainer_cfg):
    """Dtype of the sharded master weights; gradients and AdamW moments follow it (FSDP2 keeps
    gradients in the parameters' dtype, AdamW its moments): `trainer.optimizer_dtype`."""
    import torch

    return torch.bfloat16 if getattr(trainer_cfg, "optimizer_dtype", "float32") == "bfloat16" else torch.float32


def build_meta_model(config, dtype=None):
    """The causal LM of `config` on the meta device (SDPA attention), its parameters in `dtype`
    (default fp32). Converting meta tensors costs nothing."""
    import torch

    sharded = _optional("rlctl.trainer.sharded_load")
    if sharded is not None and hasattr(sharded, "build_meta_model"):
        model = sharded.build_meta_model(config)
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        model.config.use_cache = False
    return model.to(dtype or torch.float32)


def expert_fsdp_mesh(mesh, dims):
    """The mesh expert parameters (already split over `ep`) are sharded over: (dp_replicate, efsdp)
    for HSDP, else efsdp."""
    return mesh["dp_replicate", "efsdp"] if dims.dp_replicate > 1 else mesh["efsdp"]


def _shard(model, mesh, dims, trainer_cfg):
    from rlctl.trainer.parallel import apply_fsdp, fsdp_mesh

    apply_fsdp(model, fsdp_mesh(mesh, dims), expert_fsdp_mesh(mesh, dims), trainer_cfg.dtype,
               trainer_cfg.activation_checkpointing, compile_layers=getattr(trainer_cfg, "compile", False))


def build_parallel_model(config_or_dir, dims, mesh, device, trainer_cfg, *, load_from=None):
    """This rank's model for the degrees `dims` (a ParallelDims) on the world `mesh`
    (`parallel.build_mesh`): meta build → grouped experts + EP → CP → FP8 → compile + AC + FSDP2 → load.

    `trainer_cfg` is the recipe's `[trainer]` (dtype, activation_checkpointing, fp8). With `load_from`
    (an HF model directory) the local shards are materialised on `device` and loaded; without it the
    parameters stay on the meta device. Raises RecipeError (one line, naming the key) for what the
    trainer refuses: fp8 or compile where they cannot run, cp the model's attention cannot split."""
    from rlctl.trainer.compiled_layers import check_compile
    from rlctl.trainer.context_parallel import check_context_parallel, enable_ulysses
    from rlctl.trainer.fp8 import apply_fp8, check_fp8

    config = load_hf_config(config_or_dir)
    check_fp8(trainer_cfg, device)  # refusals before any module is built
    check_compile(trainer_cfg, device)
    check_context_parallel(config, dims.cp)
    model = build_meta_model(config, master_dtype(trainer_cfg))
    if is_moe_config(config):  # grouped experts always; split over `ep` when ep > 1
        from rlctl.trainer.expert_parallel import apply_expert_parallel

        from rlctl.trainer.parallel import own_group

        apply_expert_parallel(model, mesh["ep"], own_group(mesh, "ep") if dims.ep > 1 else None)
    elif dims.ep > 1:
        from rlctl.recipes.errors import RecipeError

        raise RecipeError(f"ep={dims.ep} but {config.model_type} is a dense model (no experts); use ep = 1", "trainer.ep")
    if dims.cp > 1:
        enable_ulysses(model, mesh["cp"])
    apply_fp8(model, trainer_cfg, device)
    lora = getattr(trainer_cfg, "lora", None)
    if lora is not None and lora.enabled:  # adapters exist before FSDP so it shards them with their layer
        from rlctl.trainer.lora import apply_lora, check_lora_supported

        check_lora_supported(config, trainer_cfg)
        apply_lora(model, lora)
    _shard(model, mesh, dims, trainer_cfg)
    if load_from is not None:
        sharded = _optional("rlctl.trainer.sharded_load")
        if sharded is None:
            raise RuntimeError("loading into a meta-device model needs rlctl.trainer.sharded_load")
        sharded.materialize_and_load(model, Path(load_from), device)
        if lora is not None and lora.enabled:
            from rlctl.trainer.lora import init_adapters

            init_adapters(model, seed=0)  # the same draws on every rank; B = 0 so the step-0 policy is the base
    return model.train()
