"""Serving a LoRA run: the base model stays loaded, the policy is an adapter swapped in place.

Requests keep naming `SERVED_MODEL_NAME`: with LoRA that is the adapter's name and the base is served
as `BASE_MODEL_NAME`, so no request path (streamed, token-in/token-out, evaluation) changes. Before the
trainer's first publish the adapter is a zero one (A = B = 0: exactly the base, which the trainer's
step 0 — B = 0 — also is); each new `weights/step_N/` (PEFT files) is then loaded under the same name
with `load_inplace` through the admin-only `/v1/load_lora_adapter`. A new path per step, and the
KV-cache salt per policy version, keep prefix blocks of an older adapter from being reused.
"""
from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_SUFFIX = "-base"
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `--max-lora-rank` choices
LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"



def is_adapter_step(step_dir: str | Path) -> bool:
    return (Path(step_dir) / ADAPTER_CONFIG).is_file()


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds `rank`."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    from rlctl.recipes.errors import RecipeError

    raise RecipeError(f"rank={rank}: vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}", key="trainer.lora.rank")


def lora_server_args(lora, adapter_name: str, initial_adapter: str | Path, max_loras: int = 1) -> list[str]:
    """vLLM flags for `max_loras` adapter slots, with the initial (zero) adapter loaded under `adapter_name`."""
    return ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora.rank)), "--max-loras", str(max_loras),
            "--lora-modules", f"{adapter_name}={Path(initial_adapter)}"]


def write_zero_adapter(model_dir: str | Path, lora, out_dir: str | Path) -> Path:
    """A PEFT adapter for `model_dir` whose update is zero, in `out_dir` (shapes from a meta build)."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = set(lora.target_modules)
    tensors = {}
    for path, m in model.named_modules():
        if type(m) is nn.Linear and path.rsplit(".", 1)[-1] in targets:
            tensors[f"base_model.model.{path}.lora_A.weight"] = torch.zeros(lora.rank, m.in_features)
            tensors[f"base_model.model.{path}.lora_B.weight"] = torch.zeros(m.out_features, lora.rank)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(targets), "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}))
    return out
