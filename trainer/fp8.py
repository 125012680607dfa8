"""FP8 training of the trainer's Linear layers (`trainer.fp8 = true`).

On a GPU with compute capability ≥ 8.9 (Ada, Hopper, Blackwell) and torchao installed, the decoder's
Linear layers are swapped for torchao's `Float8Linear` (`torchao.float8.convert_to_float8_training`)
with its rowwise-scaled recipe: activations, weights and gradients are cast to e4m3 with one scale
per row, the matmuls run on the FP8 tensor cores and the master weights stay in high precision. The
swap happens on the meta-device model, before FSDP shards it, as torchtitan does (FSDP then shards the
Float8Linear weights like any other).

Not converted: the LM head and the embeddings (the logprobs the RL loss compares with the inference
engine's must not lose precision), MoE routers (a top-k choice flips on small errors), and Linear
layers whose dimensions are not multiples of 16 (FP8 GEMM alignment) or too small to gain from FP8.
Grouped expert weights (3-D parameters, not Linear modules) stay in the compute dtype.

This path is reachable but has not been run here (the development machines have no GPU); what is
tested is the refusal below and which layers the filter selects. Everywhere else — CPU, a GPU below
sm 8.9, no torchao — `trainer.fp8 = true` is refused with one line naming the key.
"""
from __future__ import annotations

import importlib.util

from rlctl.recipes.errors import RecipeError

KEY = "trainer.fp8"
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)."""
MIN_DIM = 1024
"""Linear layers with a smaller input or output dimension stay in the compute dtype: casting their
operands costs about as much as the FP8 matmul saves."""
SKIP_NAMES = ("lm_head", "embed_tokens", "gate", "router", "score", "indexer")
"""Last-name components never converted: the LM head, embeddings, MoE routers (`mlp.gate`), reward
heads, and the sparse-attention indexer of DSA models. `gate_proj` of a gated MLP is converted."""


def fp8_unavailable_reason(device) -> str | None:
    """Why FP8 training cannot run on `device` (a torch.device or its type string); None when it can."""
    dtype = device if isinstance(device, str) else device.type
    if dtype != "cuda":
        return f"FP8 training needs an NVIDIA GPU (compute capability ≥ 8.9); this trainer runs on {dtype}"
    import torch

    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        return f"FP8 training needs compute capability ≥ 8.9 (Ada/Hopper/Blackwell); this GPU has {cap[0]}.{cap[1]}"
    if importlib.util.find_spec("torchao") is None:
        return "FP8 training needs torchao (pip install torchao) and it is not installed"
    return None


def refuse_fp8(reason: str) -> RecipeError:
    return RecipeError(f"{reason}; set trainer.fp8 = false", KEY)


def check_fp8(cfg, device) -> None:
    """Raise the one-line RecipeError naming `trainer.fp8` when it is on and cannot run on `device`."""
    if getattr(cfg, "fp8", False):
        reason = fp8_unavailable_reason(device)
        if reason:
            raise refuse_fp8(reason)


def fp8_module_filter(module, fqn: str) -> bool:
    """torchao's `module_filter_fn`: True for the Linear layers converted to FP8."""
    import torch.nn as nn

    if not isinstance(module, nn.Linear):
        return False
    if fqn.rsplit(".", 1)[-1] in SKIP_NAMES or any(part in ("indexer", "router") for part in fqn.split(".")):
        return False
    dims = (module.in_features, module.out_features)
    return all(d % 16 == 0 and d >= MIN_DIM for d in dims)


def apply_fp8(model, cfg, device) -> list[str]:
    """Swap the selected Linear layers of `model` (meta or real, before FSDP) for torchao Float8Linear
    when `cfg.fp8`; the names of the converted layers ([] when fp8 is off). Raises RecipeError when
    fp8 is on and the device cannot run it."""
    if not getattr(cfg, "fp8", False):
        return []
    check_fp8(cfg, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = [name for name, mod in model.named_modules() if fp8_module_filter(mod, name)]
    config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_module_filter)
    return chosen
