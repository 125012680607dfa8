"""LoRA adapters on the trainer's model: W x + (alpha / rank) · B A x, only A and B trained.

Each targeted `nn.Linear` is replaced (on the meta device, before FSDP shards anything) by a
`LoRALinear` that keeps the same `weight`/`bias` parameters — so the base still loads from the HF
files under its own name — and adds `lora_A` [rank, in] and `lora_B` [out, rank]. Their parameter
names are PEFT's (`<module path>.lora_A.weight`), so `adapter_state` written with the
`base_model.model.` prefix is an adapter vLLM (and PEFT) load as is. B starts at zero: the adapted
model is the base model until the first step, so step 0's logprobs are the base model's.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from rlctl.trainer.parallel import gather_full

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ADAPTER_KEYS = (".lora_A.", ".lora_B.")


class LoRALinear(nn.Linear):
    """An `nn.Linear` plus a low-rank update; the base weight and bias are frozen."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rank: int, alpha: float,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scaling = rank, alpha / rank
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, alpha: float) -> "LoRALinear":
        """A LoRALinear sharing `base`'s parameters (frozen), with fresh adapters (see `init_adapters`)."""
        out = cls(base.in_features, base.out_features, base.bias is not None, rank, alpha,
                  device=base.weight.device, dtype=base.weight.dtype)
        out.weight = base.weight
        out.bias = base.bias
        for p in (out.weight, out.bias):
            if p is not None:
                p.requires_grad_(False)
        out.reset_adapters()
        return out

    def reset_adapters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default: A Kaiming-uniform, B zero (the update starts at exactly zero)."""
        if self.lora_A.weight.is_meta:
            return
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
            full = torch.empty(self.lora_A.weight.shape, dtype=torch.float32).uniform_(-bound, bound,
                                                                                        generator=generator)
            _copy_block(self.lora_A.weight, full)
            _local(self.lora_B.weight).zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _copy_block(param, full: torch.Tensor) -> None:
    """This rank's block of `full` into (possibly sharded) `param`: every rank draws the same full tensor."""
    from rlctl.trainer.sharded_load import owned_block

    local = _local(param)
    if local.numel():
        local.copy_(full[owned_block(param)].to(local.dtype))


def is_adapter_name(name: str) -> bool:
    return any(k in name for k in _ADAPTER_KEYS)


def apply_lora(model: nn.Module, lora) -> list[str]:
    """Freeze every parameter of `model` and replace the targeted Linear layers (`lora.target_modules`,
    matched on the module name's last part) by LoRALinear; returns the wrapped module paths."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = set(lora.target_modules)
    wrapped = []
    for path, module in list(model.named_modules()):
        if type(module) is nn.Linear and path.rsplit(".", 1)[-1] in targets:
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, child, LoRALinear.wrap(module, lora.rank, lora.alpha))
            wrapped.append(path)
    if not wrapped:
        raise ValueError(f"trainer.lora.target_modules {list(targets)} match no nn.Linear layer of the model")
    return wrapped


def init_adapters(model: nn.Module, seed: int) -> None:
    """(Re)initialise every adapter after the model was materialised: the same draws on every rank."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.reset_adapters(gen)


def adapter_state(model: nn.Module, dtype=None) -> dict[str, torch.Tensor]:
    """The full adapter tensors under PEFT names (collective under FSDP: every rank must call it)."""
    from rlctl.trainer.sharded_load import checkpoint_name

    out = {}
    for name, p in model.named_parameters():
        if not is_adapter_name(name):
            continue
        full = gather_full(p).to("cpu", dtype or p.dtype).contiguous()
        out[PEFT_PREFIX + checkpoint_name(name)] = full
    return out


def adapter_config(lora, base_model: str, targets: list[str] | None = None) -> dict:
    """The `adapter_config.json` PEFT and vLLM read."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(targets or lora.target_modules), "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "inference_mode": True, "modules_to_save": None,
    }


def write_adapter(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """Write `adapter_model.safetensors` + `adapter_config.json` into `directory`; returns the bytes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_lora_supported(hf_config, trainer_cfg) -> None:
    """Dense models only: grouped experts keep no per-expert Linear an adapter could wrap."""
    from rlctl.recipes.errors import RecipeError

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0):
        raise RecipeError(f"rank={trainer_cfg.lora.rank}: LoRA adapters are trained on dense models only "
                          f"({hf_config.model_type} routes to experts; allowed here: 0)", key="trainer.lora.rank")
    if getattr(trainer_cfg, "fp8", False):
        raise RecipeError("fp8=true with LoRA (allowed with LoRA: false)", key="trainer.fp8")
