"""The `[orchestrator.reward]` section: which reward function scores rollouts and how it is contained."""
from __future__ import annotations

import importlib.util
import inspect
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from rlctl.recipes.base import StrictModel
from rlctl.recipes.errors import RecipeError

# The built-in reward functions (rlctl.orchestrator.reward_builtins), by the name a recipe uses.
BUILTIN_REWARDS = {
    "exact_match": "rlctl.orchestrator.reward_builtins:exact_match",
    "math": "rlctl.orchestrator.reward_builtins:math_answer",
    "code": "rlctl.orchestrator.reward_builtins:code_tests",
}


def unknown_reward(ref: str, key: str = "orchestrator.reward.function") -> RecipeError:
    return RecipeError(f"unknown reward {ref!r} (built-ins: {', '.join(BUILTIN_REWARDS)}; or 'module:function')",
                       key=key)


class RewardConfig(StrictModel):
    """How rollouts are scored: a process pool with a per-call timeout and memory limit, so a slow,
    raising or memory-hungry reward neither stalls nor kills the rollout loop."""

    function: str | None = None
    """Reward function: a built-in (`exact_match`, `math`, `code`) or `module:function` taking
    (prompt, completion_text, **args) and returning a float; unset = the environment's own `reward`."""
    args: dict[str, Any] = {}
    """Keyword arguments passed to `function` on every call (e.g. `time_limit_s` for `code`)."""
    timeout_s: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] = 30.0
    """Seconds one reward call may take; past it the call counts as a timeout and its worker is replaced."""
    memory_mb: Annotated[int, Field(ge=64, le=1 << 22)] = 4096
    """Address-space limit of each reward worker process (MiB); an allocation past it counts as a memory kill."""
    workers: Annotated[int, Field(ge=1, le=1024)] = 8
    """Reward worker processes (sync rewards that are not inline run there, one call per worker at a time)."""
    on_failure: Literal["drop_group", "zero"] = "zero"
    """What a failed reward call does to its group: `zero` scores that rollout 0, `drop_group` drops the
    whole group (replaced by a new one, like a too off-policy group)."""
    max_consecutive_failures: Annotated[int, Field(ge=1, le=1 << 30)] = 1000
    """The run stops with an error after this many reward calls in a row failed (a broken reward
    function would otherwise spin forever, or train on nothing but zeros)."""


SCALARS = (bool, int, float, str)


def check_reward_args(function: str, fn, args: dict[str, Any]) -> None:
    """`args` fit `fn(prompt, completion, **args)`: its parameters, and the type of each scalar one
    that is annotated (a quoted "2" for a float used to fail every call, each counted as a reward error)."""
    try:
        inspect.signature(fn).bind(None, "", **args)
    except TypeError as exc:
        raise RecipeError(f"does not fit {function!r}: {exc}", key="orchestrator.reward.args") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - annotations this Python cannot resolve: the parameters are checked
        return
    for name, value in args.items():
        hint = hints.get(name)
        # Only scalars: a TOML array or table is never a tuple or a model, which strict checking would refuse.
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        if not all(t in SCALARS or t is type(None) for t in (typing.get_args(hint) if union else (hint,))):
            continue
        try:
            TypeAdapter(hint).validate_python(value, strict=True)  # strict: "2" is not a float, 1 is not a bool
        except ValidationError as exc:
            raise RecipeError(f"does not fit {function!r}: {name} = {value!r} ({exc.errors()[0]['msg']})",
                              key=f"orchestrator.reward.args.{name}") from None
        except Exception:  # noqa: BLE001 - a hint pydantic cannot build a schema for: not checked
            continue


def module_found(name: str) -> bool:
    """Whether this Python can import `name` (without importing it): a reward's package, or the module
    a recipe's `module:attr` names (orchestrator/references.py)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def check_reward_dependencies(function: str) -> None:
    """A built-in reward whose package is missing: one line naming what to install."""
    if function == "math" and not module_found("math_verify"):
        raise RecipeError("the `math` reward needs the math-verify package (pip install 'rlctl[workloads]')",
                          key="orchestrator.reward.function")
