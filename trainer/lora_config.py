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


def check_launchable(lora: LoRAConfig) -> None:
    """`rlctl plan` sizes LoRA runs, the trainer does not train adapters yet: refuse at launch rather than
    silently train every weight."""
    if lora.enabled:
        from rlctl.recipes.errors import RecipeError

        raise RecipeError(f"rank={lora.rank}: LoRA is planned by `rlctl plan` but the trainer does not train adapters "
                          "yet (allowed at launch: 0, full fine-tuning)", key="trainer.lora.rank")
