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
