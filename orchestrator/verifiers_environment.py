"""The `verifiers` environment: a task set written for the `verifiers` package, run as an rlctl environment.

    [orchestrator.environment]
    name = "verifiers"
    args = { taskset = "my-taskset", config = { ... }, limit = 1000, chat_template = true }

`taskset` names what verifiers calls an environment's task set: an installed taskset package id (what
`vf-eval <id>` takes: a package exporting its `vf.Taskset` subclass in `__all__`), or `module:attr` where
attr is a `vf.Taskset` subclass (built with its own config class from `config`), a `vf.Taskset` instance,
or a function returning one (called with `config` as keyword arguments). `limit` keeps the first tasks
(required for an infinite task set). Needs the optional extra: `pip install 'rlctl[verifiers]'`.

Prompts: each task's `prompt` (text or messages) and `system_prompt`, rendered with the model's chat
template (`chat_template = true`, the default), or the raw prompt text (`false`: plain-text prompts
without a system prompt only). Tasks are drawn with the loop's seeded sampler, so resume is exact; a task
whose rendered prompt fills the servers' context (`inference.max_model_len` tokens or more) is skipped
with a warning naming it, as a dataset's row is.

Rewards: the completion becomes the assistant turn of a `vf.Trace` and the task's own scoring runs
(`Task.score`: its `@vf.reward` functions, awaited, and plugged judges), the reward being the trace's
weighted sum. It runs in the reward worker pool (`[orchestrator.reward]`: timeout, memory limit, failure
policy), each worker rebuilding this environment by name, since verifiers rewards may block or be
CPU-heavy. Signals that need a task runtime (a sandbox) are skipped, as verifiers does offline; a task
set whose rewards all need one is refused.

What is not run: the verifiers `Env`/harness machinery (agent programs launched in runtimes, model
calls through its interception server) and task sets with tool servers (`toolsets`): these are refused
with one line naming the key.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import random
from typing import Any

from rlctl.orchestrator.environments import Environment, Prompt
from rlctl.orchestrator.prompt_limit import PromptLimit, prompt_limit
from rlctl.recipes.errors import RecipeError

KEY = "orchestrator.environment.args"


def import_verifiers():
    """`verifiers.v1`, or a one-line refusal naming the key that asked for it."""
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise RecipeError(f"'verifiers' needs the verifiers package, which is not importable ({exc}); "
                          "install it with pip install 'rlctl[verifiers]'",
                          key="orchestrator.environment.name") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def load_taskset(vf, ref: str, config: dict[str, Any]):
    """The `vf.Taskset` that `ref` (an id or `module:attr`) names, built with `config`."""
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    try:
        if ":" not in ref:
            cfg_type = vf.taskset_config_type(ref)
            return vf.load_taskset(cfg_type.model_validate({**config, "id": ref}))
        module_name, _, attr = ref.partition(":")
        obj = getattr(importlib.import_module(module_name), attr, None)
        if obj is None:
            raise RecipeError(f"module {module_name!r} has no attribute {attr!r}", key=f"{KEY}.taskset")
        if isinstance(obj, type) and issubclass(obj, vf.Taskset):
            cfg_type = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
            return obj(cfg_type.model_validate(config))
        if isinstance(obj, vf.Taskset):
            if config:
                raise RecipeError(f"{ref!r} is a built task set: it takes no config", key=f"{KEY}.config")
            return obj
        if callable(obj):
            taskset = obj(**config)
            if isinstance(taskset, vf.Taskset):
                return taskset
        raise RecipeError(f"{ref!r} is not a verifiers Taskset (a subclass, an instance or a function "
                          "returning one)", key=f"{KEY}.taskset")
    except RecipeError:
        raise
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise RecipeError(f"{first.get('msg', 'invalid value')}" + (f" ({where})" if where else ""),
                          key=f"{KEY}.config") from None
    except (ImportError, TypeError, ValueError, AttributeError) as exc:
        raise RecipeError(f"cannot load the verifiers task set {ref!r}: {_one_line(exc)}",
                          key=f"{KEY}.taskset") from None


class VerifiersEnvironment(Environment):
    """Prompts from a verifiers task set; rewards from its tasks' own scoring (see the module docstring)."""

    def __init__(self, taskset: str, config: dict[str, Any] | None = None, limit: int | None = None,
                 chat_template: bool = True):
        if not isinstance(taskset, str) or not taskset.strip():
            raise RecipeError(f"must name a task set: an installed id or 'module:attr' (got {taskset!r})",
                              key=f"{KEY}.taskset")
        if config is not None and not isinstance(config, dict):
            raise RecipeError(f"must be a table of the task set's config fields (got {config!r})",
                              key=f"{KEY}.config")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise RecipeError(f"must be a positive integer (got {limit!r})", key=f"{KEY}.limit")
        self.vf = import_verifiers()
        self.taskset = load_taskset(self.vf, taskset, dict(config or {}))
        if not self.taskset.bounded and limit is None:
            raise RecipeError(f"{taskset!r} is an infinite task set: set limit", key=f"{KEY}.limit")
        view = self.taskset.take(limit) if limit is not None else self.taskset
        try:
            self.tasks = list(view)
        except Exception as exc:  # noqa: BLE001 - the task set's own loading code; one line, no traceback
            raise RecipeError(f"loading the tasks of {taskset!r} failed: {_one_line(exc)}",
                              key=f"{KEY}.taskset") from None
        if not self.tasks:
            raise RecipeError(f"the task set {taskset!r} has no tasks", key=f"{KEY}.taskset")
        self.task_type = type(self.tasks[0])
        self.chat_template = bool(chat_template)
        self.template = None  # the model's chat template, set by from_recipe (reward workers need none)
        self.limit = PromptLimit()  # the servers' context, set by from_recipe
        self._check_runnable(taskset)

    def _check_runnable(self, ref: str) -> None:
        tools = [*self.taskset.toolsets(self.taskset.config), *self.task_type.toolsets(self.tasks[0].config)]
        if tools:
            raise RecipeError(f"{ref!r} has tool servers ({', '.join(type(t).__name__ for t in tools)}), "
                              "which the verifiers environment does not run", key=f"{KEY}.taskset")
        task = self.tasks[0]
        offline = [fn for fn in task.hooks("reward") if not _needs_runtime(fn)]
        offline += [j for j in task.plugged_judges() if not _needs_runtime(j.score)]
        if not offline:
            raise RecipeError(f"the tasks of {ref!r} have no reward that runs without a task runtime "
                              "(a sandbox), so every completion would score 0", key=f"{KEY}.taskset")
        if not self.chat_template:
            bad = next((t for t in self.tasks if not isinstance(t.data.prompt, str) or t.data.system_prompt), None)
            if bad is not None:
                raise RecipeError(f"task {bad.data.idx} has a messages prompt or a system prompt, which need "
                                  "the chat template (chat_template = true)", key=f"{KEY}.chat_template")

    @classmethod
    def from_recipe(cls, recipe, run) -> "VerifiersEnvironment":
        """Built by name, with the policy's chat template when `chat_template` is on, and the servers'
        context its prompts are checked against."""
        from rlctl.orchestrator.chat_template import ChatTemplate, model_dir

        env = cls(**recipe.orchestrator.environment.args)
        directory = model_dir(recipe, run)
        if env.chat_template:
            env.template = ChatTemplate(directory, f"{KEY}.chat_template")
        env.limit = prompt_limit(env.template, directory, recipe.inference.max_model_len)
        return env

    # ---- prompts -----------------------------------------------------------------------------------
    def messages(self, data) -> list[dict[str, str]]:
        from verifiers.v1.types import content_text

        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return [*system, {"role": "user", "content": data.prompt}]
        return [*system, *({"role": m.role, "content": content_text(m.content)} for m in data.prompt or [])]

    def render(self, task) -> Prompt:
        if self.chat_template:
            if self.template is None:
                raise RecipeError("rendering the prompts needs the model's chat template (none was loaded)",
                                  key=f"{KEY}.chat_template")
            text = self.template.render(self.messages(task.data))
        else:
            text = task.data.prompt
        return Prompt(text, "", {"task": task.data.model_dump(mode="json")})

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` tasks drawn by the loop's sampler; one whose prompt fills the servers' context is skipped and
        another drawn (the same seed still draws the same tasks)."""
        prompts: list[Prompt] = []
        while len(prompts) < n:
            if len(self.limit.too_long) == len(self.tasks):
                raise self.limit.none_fit("task's")
            index = rng.randrange(len(self.tasks))
            task = self.tasks[index]
            prompt = self.limit.fitting(index, lambda: self.render(task), f"task {task.data.idx} of the task set")
            if prompt is not None:
                prompts.append(prompt)
        return prompts

    # ---- rewards -----------------------------------------------------------------------------------
    def trace(self, task, completion_text: str):
        """A `vf.Trace` of one turn: the task's prompt messages, then the completion as the reply."""
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        vf = self.vf
        roles = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        nodes = [MessageNode(parent=i - 1 if i else None, message=roles.get(m["role"], vf.UserMessage)(
            content=m["content"])) for i, m in enumerate(self.messages(task.data))]
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None,
                                 message=vf.AssistantMessage(content=completion_text), sampled=True))
        return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """The task's weighted reward sum; runs in a reward worker (its own event loop per call)."""
        data = self.task_type.data_type().model_validate(prompt.info["task"])
        task = self.task_type(data, self.tasks[0].config)
        trace = self.trace(task, completion_text)
        asyncio.run(task.score(trace))
        return float(trace.reward)


def _needs_runtime(fn) -> bool:
    """verifiers' own rule: a signal with a required `runtime` parameter is skipped without a runtime."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty
