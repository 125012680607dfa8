"""Shared pieces of the recipe schema: the strict base model, bounded number types, the `auto` degree."""
from __future__ import annotations

import datetime
import functools
from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

AUTO = "auto"
# Run names become directory names, Slurm job names and lines of the batch script: a safe alphabet only.
RUN_NAME_ALLOWED = "letters, digits, '.', '_' and '-' (not starting with '.'), at most 100 characters"
RUN_NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$"


def _digits_as_name(value):
    """`-o deployment.inference_pool=5` reads as the integer 5, yet `5` is a name `--name 5` accepts."""
    return str(value) if type(value) is int else value


RunName = Annotated[str, BeforeValidator(_digits_as_name), Field(pattern=RUN_NAME_PATTERN, max_length=100)]
# A duration that bounds a wait: finite and > 0 (nan never times out and spins, inf never ends, 0 or
# less fails at once). Every timeout of the recipe has this type.
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


def _time_of_day_as_duration(value):
    """TOML reads a bare `01:30:00` (`-o deployment.time_limit=01:30:00`) as a time of day: the
    HH:MM:SS it was meant as."""
    return value.strftime("%H:%M:%S") if isinstance(value, datetime.time) else value


SLURM_TIME_ALLOWED = "a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"
# [D-]A[:B[:C]]: the parser (plan_extras.slurm_seconds) reads its groups with this same pattern
SLURM_DURATION = r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?"
SLURM_TIME_PATTERN = rf"^(?:{SLURM_DURATION}|UNLIMITED|INFINITE)$"
SlurmTime = Annotated[str, BeforeValidator(_time_of_day_as_duration),
                      Field(pattern=SLURM_TIME_PATTERN, max_length=40)]
# A delay that may be zero (smoke test pacing), but never nan, inf or negative.
Delay = Annotated[float, Field(ge=0, allow_inf_nan=False)]

# Upper bounds keep every figure the planner derives finite and its searches small: the largest
# Slurm clusters have ~10⁴ nodes, the longest contexts ~10⁷ tokens. A bound is far above any real
# value; past it the input is a typo (an extra zero) or a fuzzer, not a cluster.
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 64
MAX_TOKENS = 1 << 24
MAX_COUNT = 1 << 30
"""Steps, rollouts, restarts, seeds' range: anything counted that has no tighter natural bound."""

NodeCount = Annotated[int, Field(ge=1, le=MAX_NODES)]
Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
PositiveCount = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A count that may be zero (0 often means 'off' or 'default'; the field says which)."""
NonNegative = Annotated[float, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, lt=1)]
"""In [0, 1): AdamW betas and the like."""
# A parallel degree the planner may choose: a positive int (at most a whole max-size cluster's GPUs)
# or the literal "auto".
Degree = Union[Literal["auto"], Annotated[int, Field(ge=1, le=MAX_NODES * MAX_GPUS_PER_NODE)]]


class StrictModel(BaseModel):
    """Base of every recipe section and of the cluster profile. One policy for all of them:

    - unknown keys are errors, values are validated on assignment;
    - strict types: `true` is not a count and `1` is not a flag, "4" is not a number (TOML, YAML and
      `-o` overrides all give typed values, so a wrong type is a mistake, not a spelling);
    - no NaN or ±inf in any float: they make every figure derived from them meaningless.

    Fields are documented by the string under them; `field_docs` reads those only when asked
    (`recipes show --schema`): pydantic's `use_attribute_docstrings` parses every model's source at
    import, a third of the time `rlctl plan` spends building its models.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


@functools.cache
def field_docs(model: type) -> dict[str, str]:
    """{field name: the docstring written under it} for a model class and the classes it inherits
    from (nearest class wins), read from their source; {} where the source is not available."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if cls is object or cls.__module__.startswith("pydantic."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):  # built in a REPL, a frozen app, a class made at runtime
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


__all__ = ["AUTO", "Count", "Degree", "Delay", "Fraction", "MAX_COUNT", "MAX_GPUS_PER_NODE", "MAX_NODES",
           "MAX_TOKENS", "NodeCount", "NonNegative", "Positive", "PositiveCount", "RUN_NAME_ALLOWED",
           "RUN_NAME_PATTERN", "RunName", "SLURM_DURATION", "SLURM_TIME_ALLOWED", "SLURM_TIME_PATTERN", "Seconds",
           "SlurmTime", "StrictModel", "Tokens", "Field", "field_docs"]
