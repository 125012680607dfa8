"""Shared pieces of the recipe schema: the strict base model and the `auto` degree type."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

AUTO = "auto"
# Run names become directory names, Slurm job names and lines of the batch script: a safe alphabet only.
RUN_NAME_ALLOWED = "letters, digits, '.', '_' and '-' (not starting with '.'), at most 100 characters"
RunName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$", max_length=100)]
# A duration that bounds a wait: finite and > 0 (nan never times out and spins, inf never ends, 0 or
# less fails at once). Every timeout of the recipe has this type.
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# A delay that may be zero (smoke test pacing), but never nan, inf or negative.
Delay = Annotated[float, Field(ge=0, allow_inf_nan=False)]
# A parallel degree or node count the planner may choose: a positive int or the literal "auto".
Degree = Union[Literal["auto"], int]


class StrictModel(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def positive_degree(value: Degree, name: str) -> Degree:
    """Validate an int-or-auto degree; used by field validators of the sections."""
    if value != AUTO and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or 'auto'")
    return value


__all__ = ["AUTO", "Degree", "Delay", "RUN_NAME_ALLOWED", "RunName", "Seconds", "StrictModel", "Field", "positive_degree"]
