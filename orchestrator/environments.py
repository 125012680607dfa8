"""Environments: where prompts come from and how completions are scored.

An environment is a class implementing `Environment`; recipes pick one with
`orchestrator.environment.name` (a built-in name or a dotted path `package.module:Class`) and pass
constructor keyword arguments with `orchestrator.environment.args`.

Built-ins (tiny verifiable tasks for the CPU recipes; every character is in the tiny model's charset):
- `sequence` (default): the prompt is the start of a letter or digit sequence with a random start and
  stride, e.g. `cde` or `1357`; the policy must continue it (`fgh`, `9135`). Reward = fraction of
  correct characters, so the policy has to read its input — no constant answer scores well.
- `count_a`: reward = fraction of 'a' among the first `length` generated characters (a sanity task).
- `tool_lookup` (multi-turn, `tool_environments.py`): look a key up with a tool call, then answer.
- `verifiers` (`verifiers_environment.py`): a task set written for the `verifiers` package.

A multi-turn environment implements `MultiTurnEnvironment.rollout(client, prompt, budget)`: it drives
the turns itself through a `TokenClient` (generate a turn, tokenise a tool's output, append it with loss
mask 0) and returns the `Trajectory`; the loop runs `group_size` of them per prompt and scores each with
`reward(prompt, trajectory.reward_text or trajectory.text)`.
"""
from __future__ import annotations

import importlib
import inspect
import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlctl.recipes.errors import RecipeError

if TYPE_CHECKING:
    from rlctl.orchestrator.trajectory import Budget, TokenClient, Trajectory


@dataclass(frozen=True)
class Prompt:
    """One prompt; `target` and `info` are whatever the environment needs to score it later."""

    text: str
    target: str = ""
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """Prompt source + reward function. Implementations must be cheap: the loop scores inline."""

    @abstractmethod
    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """Draw `n` prompts using `rng` (owned and checkpointed by the orchestrator)."""

    @abstractmethod
    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Score one completion of `prompt`, in [0, 1] for the built-ins (any float is allowed)."""

    def state_dict(self) -> dict[str, Any]:
        """Extra state to restore on resume (e.g. a dataset cursor); JSON-serialisable."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""


class MultiTurnEnvironment(Environment):
    """An environment that runs whole trajectories (turns, tool calls) instead of one completion.

    `reward` receives `trajectory.reward_text` when the rollout set it (e.g. the parts the environment
    wants scored, in its own format), else the transcript after the prompt."""

    @abstractmethod
    async def rollout(self, client: "TokenClient", prompt: Prompt, budget: "Budget") -> "Trajectory":
        """Run one trajectory of `prompt`: `traj = client.new_trajectory(prompt.text, budget)`, then
        `await client.generate(traj)` per turn and `traj.add_environment(await client.tokenize(text), text)`
        for what the environment answers; return `traj`."""


ALPHABETS = {"letters": string.ascii_lowercase, "digits": string.digits}


class SequenceEnvironment(Environment):
    """Continue a cyclic letter/digit sequence: prompt `prompt_len` items, target the next `target_len`."""

    def __init__(
        self,
        alphabets: list[str] | tuple[str, ...] = ("letters",),
        strides: list[int] | tuple[int, ...] = (1,),
        prompt_len: int = 3,
        target_len: int = 4,
    ):
        unknown = [a for a in alphabets if a not in ALPHABETS]
        if not alphabets or unknown:
            raise RecipeError(
                f"unknown alphabet(s) {unknown or alphabets!r} (allowed: {', '.join(ALPHABETS)})",
                key="orchestrator.environment.args.alphabets",
            )
        if not strides or any(not isinstance(s, int) or s < 1 for s in strides):
            raise RecipeError(f"must be a non-empty list of positive integers (got {strides!r})",
                              key="orchestrator.environment.args.strides")
        if prompt_len < 1 or target_len < 1:
            raise RecipeError(f"prompt_len and target_len must be >= 1 (got {prompt_len}, {target_len})",
                              key="orchestrator.environment.args")
        self.alphabets = list(alphabets)
        self.strides = list(strides)
        self.prompt_len = prompt_len
        self.target_len = target_len

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            chars = ALPHABETS[rng.choice(self.alphabets)]
            start, stride = rng.randrange(len(chars)), rng.choice(self.strides)
            seq = [chars[(start + i * stride) % len(chars)] for i in range(self.prompt_len + self.target_len)]
            out.append(Prompt("".join(seq[: self.prompt_len]), "".join(seq[self.prompt_len :]),
                              {"start": start, "stride": stride}))
        return out

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        target = prompt.target
        hits = sum(1 for i, ch in enumerate(completion_text[: len(target)]) if ch == target[i])
        return hits / len(target)


class CountAEnvironment(Environment):
    """Fraction of 'a' in the first `length` generated characters (shorter completions score less)."""

    def __init__(self, length: int = 8, prompt_len: int = 2):
        if length < 1 or prompt_len < 1:
            raise RecipeError(f"length and prompt_len must be >= 1 (got {length}, {prompt_len})",
                              key="orchestrator.environment.args")
        self.length = length
        self.prompt_len = prompt_len

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        letters = string.ascii_lowercase
        return [Prompt("".join(rng.choice(letters) for _ in range(self.prompt_len))) for _ in range(n)]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return completion_text[: self.length].count("a") / self.length


BUILTINS: dict[str, type[Environment]] = {"sequence": SequenceEnvironment, "count_a": CountAEnvironment}
# Built in but defined in their own modules (which import this one), so imported when named.
MULTI_TURN_BUILTINS: dict[str, str] = {"tool_lookup": "rlctl.orchestrator.tool_environments:ToolLookupEnvironment",
                                         "verifiers": "rlctl.orchestrator.verifiers_environment:VerifiersEnvironment"}


def unknown_environment(name: str) -> RecipeError:
    allowed = ", ".join([*BUILTINS, *MULTI_TURN_BUILTINS, "dataset"])
    return RecipeError(f"unknown environment {name!r} (built-ins: {allowed}; or 'module:Class')",
                       key="orchestrator.environment.name")


def builtin_class(name: str) -> type[Environment]:
    """The class of a built-in environment (a multi-turn one's module is imported now)."""
    if name in MULTI_TURN_BUILTINS:
        module_name, _, attr = MULTI_TURN_BUILTINS[name].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    return BUILTINS[name]


def check_environment_args(name: str, args: dict[str, Any] | None) -> None:
    """`args` fit the constructor of built-in `name`, which is not built (for one whose building loads
    user code or data, e.g. `verifiers`' task set); `load_environment` checks them by building."""
    cls = builtin_class(name)
    try:
        inspect.signature(cls).bind(**(args or {}))
    except TypeError as exc:
        raise bad_environment_args(name, cls, exc) from None


def bad_environment_args(name: str, cls: type, exc: TypeError) -> RecipeError:
    """One line naming what `cls` takes: after `-o orchestrator.environment.name=...` the recipe's args
    are still the old environment's, and the constructor's message names only the first bad one."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read: the constructor's message alone
        params = None
    named = [p.name for p in params or () if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if named:
        takes = f"; {name!r} takes {', '.join(named)}"
    elif params == []:
        takes = f"; {name!r} takes no arguments"
    else:  # no signature, or only *args/**kwargs: nothing more to say than the constructor did
        takes = ""
    return RecipeError(f"bad arguments for environment {name!r}: {exc}{takes}", key="orchestrator.environment.args")


def load_environment(name: str, args: dict[str, Any] | None = None) -> Environment:
    """Instantiate a built-in environment or `module:Class`; bad names/args raise a one-line RecipeError."""
    key = "orchestrator.environment.name"
    if name in MULTI_TURN_BUILTINS or name in BUILTINS:
        cls = builtin_class(name)
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RecipeError(f"cannot import module {module_name!r} ({exc})", key=key) from exc
        cls = getattr(module, attr, None)
        if cls is None:
            raise RecipeError(f"module {module_name!r} has no attribute {attr!r}", key=key)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise RecipeError(f"{name!r} is not a subclass of rlctl.orchestrator.environments.Environment", key=key)
    else:
        raise unknown_environment(name)
    try:
        return cls(**(args or {}))
    except TypeError as exc:
        raise bad_environment_args(name, cls, exc) from exc
