"""Launch-time checks of the code a recipe names (its environment and its reward function), so that a
typo fails `rlctl launch` in one line (exit 2) instead of the orchestrator after the job has started.
A `module:attr` is *found*, not imported: user code runs in the orchestrator, not on the login node
(finding a dotted module imports its parent packages, as Python must to look inside them)."""
from __future__ import annotations

import importlib.util

from rlctl.recipes.errors import RecipeError


def module_found(name: str) -> bool:
    """Whether this Python can import `name` (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def check_reward_dependencies(function: str) -> None:
    """A built-in reward whose package is missing: one line naming what to install."""
    if function == "math" and not module_found("math_verify"):
        raise RecipeError("the `math` reward needs the math-verify package (pip install 'rlctl[workloads]')",
                          key="orchestrator.reward.function")


def check_code_references(orch) -> None:
    """`orchestrator.environment.name` and `orchestrator.reward.function`: a built-in (the cheap
    single-turn environments are built, which checks their args too) or a `module:attr` whose module
    this Python finds. The dataset environment is checked by `check_dataset`."""
    from rlctl.orchestrator.environments import BUILTINS, MULTI_TURN_BUILTINS, load_environment, unknown_environment
    from rlctl.orchestrator.reward_config import BUILTIN_REWARDS, unknown_reward

    name = orch.environment.name
    if name in BUILTINS:
        load_environment(name, orch.environment.args)
    elif name not in MULTI_TURN_BUILTINS and name != "dataset":
        _check_module_ref(name, unknown_environment(name))
    function = orch.reward.function
    if function in BUILTIN_REWARDS:
        check_reward_dependencies(function)
    elif function is not None:
        _check_module_ref(function, unknown_reward(function))


def _check_module_ref(ref: str, unknown: RecipeError) -> None:
    module, sep, attr = ref.partition(":")
    if not (sep and module and attr):
        raise unknown
    if not module_found(module):
        raise RecipeError(f"cannot import module {module!r}: this Python does not find it (is it installed, or "
                          "on PYTHONPATH?)", key=unknown.key)
