"""The `[trainer.lora]` section: low-rank adapters instead of full fine-tuning (planned by `rlctl plan`)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlctl.recipes.base import StrictModel

LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_LINEAR: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(StrictModel):
    """LoRA: W x + (alpha / rank) · B A x with A [rank, in] and B [out, rank] trained, W frozen."""

    rank: Annotated[int, Field(ge=0, le=4096)] = 0
    """Adapter rank; 0 trains every weight (full fine-tuning, no adapters)."""
    alpha: Annotated[float, Field(gt=0, le=1e6)] = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    target_modules: Annotated[list[LoRATarget], Field(min_length=1)] = list(ALL_LINEAR)
    """HF names of the linear layers that get adapters (MLP names also cover routed and shared experts)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def check_launchable(recipe) -> None:
    """Refuse at launch what the LoRA trainer does not do (one line naming the key): adapters travel as
    PEFT files, so not over the broadcast transport; no FP8 base layers; dense models only (grouped
    experts have no per-expert Linear to adapt)."""
    lora = recipe.trainer.lora
    if not lora.enabled:
        return
    from rlctl.recipes.errors import RecipeError

    if recipe.weights.transport == "broadcast":
        raise RecipeError("transport='broadcast' with trainer.lora.rank > 0: LoRA adapters are published as "
                          "files (allowed with LoRA: 'filesystem')", key="weights.transport")
    if recipe.trainer.fp8:
        raise RecipeError("fp8=true with trainer.lora.rank > 0: LoRA trains over bf16/fp32 base layers "
                          "(allowed with LoRA: false)", key="trainer.fp8")
