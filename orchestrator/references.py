"""Launch-time checks of the code a recipe names (its environment and its reward function), so that a
typo fails `rlctl launch` in one line (exit 2) instead of the orchestrator after the job has started.
A `module:attr` is *found*, not imported: user code runs in the orchestrator, not on the login node
(finding a dotted module imports its parent packages, as Python must to look inside them)."""
from __future__ import annotations

from rlctl.orchestrator.reward_config import module_found
from rlctl.recipes.errors import RecipeError


def check_code_references(orch) -> None:
    """`orchestrator.environment.name` and `orchestrator.reward.function`: a built-in or a `module:attr`
    whose module this Python finds. A built-in's args are checked by the orchestrator's own code: the
    cheap environments are built, `verifiers` (whose task set is user code) has them bound to its
    constructor, a built-in reward is loaded as the orchestrator loads it. The dataset itself is
    checked by `check_dataset`."""
    from rlctl.orchestrator.environments import (BUILTINS, MULTI_TURN_BUILTINS, check_environment_args,
                                                 load_environment, unknown_environment)
    from rlctl.orchestrator.reward_config import BUILTIN_REWARDS, unknown_reward

    name, args = orch.environment.name, orch.environment.args
    if name == "dataset":
        from rlctl.orchestrator.dataset_environment import check_dataset_environment_args

        check_dataset_environment_args(args)
    elif name == "verifiers":
        check_environment_args(name, args)
    elif name in BUILTINS or name in MULTI_TURN_BUILTINS:
        load_environment(name, args)
    else:
        _check_module_ref(name, unknown_environment(name))
    function = orch.reward.function
    if function in BUILTIN_REWARDS:
        from rlctl.orchestrator.rewards import load_reward  # asyncio and multiprocessing: only when needed

        load_reward(orch.reward)
    elif function is not None:  # user code is found, not imported (see the module docstring)
        _check_module_ref(function, unknown_reward(function))


def _check_module_ref(ref: str, unknown: RecipeError) -> None:
    module, sep, attr = ref.partition(":")
    if not (sep and module and attr):
        raise unknown
    if not module_found(module):
        raise RecipeError(f"cannot import module {module!r}: this Python does not find it (is it installed, or "
                          "on PYTHONPATH?)", key=unknown.key)
