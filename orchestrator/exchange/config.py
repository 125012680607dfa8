"""The `[weights]` section: how published policy weights are kept on the shared filesystem."""
from __future__ import annotations

from typing import Annotated

from rlctl.recipes.base import Field, StrictModel


class WeightsConfig(StrictModel):
    """Published policy weights (`weights/step_N`, one full copy of the model per step)."""

    keep_last: Annotated[int, Field(ge=1, le=1 << 20)] = 2
    """Newest published weight steps to keep; older ones are deleted unless an inference server may still be loading them (see `rlctl plan` for the disk this takes)."""
