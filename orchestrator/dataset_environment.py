"""The `dataset` environment: prompts drawn from `[orchestrator.dataset]`, scored by a named reward.

Prompts are drawn in the dataset's seeded per-epoch order (see datasets.py), not from the loop's
sampler, and the cursor is the environment's state: the orchestrator saves it with each checkpoint
and a resumed run continues the exact prompt stream. Prompts are rendered with the model's chat
template (its tokenizer's `chat_template`) unless `apply_chat_template = false`.

The environment's own reward (`orchestrator.dataset.reward`) is a cheap comparison with the row's
answer, run inline (`reward_inline`); math, code or custom rewards are set in `[orchestrator.reward]`,
which replaces it and runs in the reward process pool.

A row whose rendered prompt fills the servers' whole context (`inference.max_model_len` tokens or more)
is skipped with a warning naming it: vLLM refuses such a request, and one row would fail the run.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from rlctl.orchestrator.chat_template import ChatTemplate, model_dir
from rlctl.orchestrator.datasets import KEY, Cursor, Row, load_rows, split_rows
from rlctl.orchestrator.environments import Environment, Prompt, load_environment
from rlctl.orchestrator.prompt_limit import PromptLimit, prompt_limit
from rlctl.recipes.errors import RecipeError

RewardFn = Callable[[str, str], float]


def exact_match(completion: str, answer: str) -> float:
    """1 when the completion is the answer (surrounding whitespace ignored), else 0."""
    return float(completion.strip() == answer.strip())


def char_match(completion: str, answer: str) -> float:
    """Fraction of the answer's characters the completion has at the same position (partial credit)."""
    answer = answer.strip()
    if not answer:
        return float(not completion.strip())
    return sum(1 for a, b in zip(completion.lstrip(), answer) if a == b) / len(answer)


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "char_match": char_match}


def train_split(cfg, seed: int) -> tuple[int, list[Row], list[Row]]:
    """(the dataset's seed, its train rows, the rows `eval_fraction` holds out)."""
    seed = seed if cfg.seed is None else cfg.seed
    return (seed, *split_rows(load_rows(cfg), cfg.eval_fraction, seed))


class DatasetEnvironment(Environment):
    """Rows of a local dataset as prompts; `reward` compares a completion with the row's answer."""

    reward_inline = True  # a string comparison: cheaper inline than a round trip to a reward worker

    def __init__(self, cfg, seed: int, template: ChatTemplate | None = None, limit: PromptLimit | None = None):
        """`limit`: the servers' context; rows whose prompt fills it are skipped."""
        needs_template = cfg.messages_column is not None or cfg.apply_chat_template
        if needs_template and template is None:
            raise RecipeError("rendering prompts needs the model's chat template (none was loaded)",
                              key=f"{KEY}.apply_chat_template")
        if cfg.system_prompt is not None and not needs_template:
            raise RecipeError("a system prompt needs the chat template (apply_chat_template = true)",
                              key=f"{KEY}.system_prompt")
        self.cfg = cfg
        self.template = template if needs_template else None
        self.score = BUILTIN_REWARDS[cfg.reward]
        self.seed, self.train, self.eval = train_split(cfg, seed)
        if cfg.eval_path is not None:
            self.eval = load_rows(cfg, "eval_path")
        self.cursor = Cursor(len(self.train), self.seed, cfg.shuffle)
        self.limit = limit if limit is not None else PromptLimit()

    @classmethod
    def from_recipe(cls, recipe, run) -> "DatasetEnvironment":
        cfg = recipe.orchestrator.dataset
        needs_template = cfg.messages_column is not None or cfg.apply_chat_template
        directory = model_dir(recipe, run)
        template = ChatTemplate(directory, f"{KEY}.apply_chat_template") if needs_template else None
        return cls(cfg, recipe.orchestrator.seed, template,
                   prompt_limit(template, directory, recipe.inference.max_model_len))

    def render(self, row: Row, split: str) -> Prompt:
        if self.template is None:
            text = row.prompt
        else:
            messages = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
            if self.cfg.system_prompt is not None:
                messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
            text = self.template.render(messages)
        return Prompt(text, row.answer, {"row": row.index, "split": split})

    def _fitting(self, row: Row, split: str) -> Prompt | None:
        """`row` rendered, or None when its prompt leaves no token of the servers' context."""
        return self.limit.fitting((split, row.index), lambda: self.render(row, split),
                                  f"{split} row {row.index} of the dataset")

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """The next `n` rows that fit the servers' context, in the dataset's own seeded order (`rng` is not
        used: the cursor is the state)."""
        prompts: list[Prompt] = []
        skipped = 0
        while len(prompts) < n:
            prompt = self._fitting(self.train[self.cursor.next()], "train")
            if prompt is not None:
                prompts.append(prompt)
            elif (skipped := skipped + 1) >= len(self.train):  # a whole epoch of rows too long
                raise self.limit.none_fit("training row's")
        return prompts

    def eval_prompts(self, limit: int | None = None) -> list[Prompt]:
        """The eval split in file order (the first `limit` rows when given), less the rows too long."""
        return [p for p in (self._fitting(row, "eval") for row in self.eval[:limit]) if p is not None]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return float(self.score(completion_text, prompt.target))

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state.get("cursor") or {})


def build_environment(recipe, run) -> Environment:
    """The recipe's environment: `dataset` is built from `[orchestrator.dataset]`, others by name."""
    env_cfg = recipe.orchestrator.environment
    if env_cfg.name == "verifiers":  # needs the policy's chat template, like the dataset environment
        from rlctl.orchestrator.verifiers_environment import VerifiersEnvironment
        return VerifiersEnvironment.from_recipe(recipe, run)
    if env_cfg.name != "dataset":
        return load_environment(env_cfg.name, env_cfg.args)
    check_dataset_environment_args(env_cfg.args)
    return DatasetEnvironment.from_recipe(recipe, run)


def check_dataset_environment_args(args: dict[str, Any]) -> None:
    """The dataset environment is configured in `[orchestrator.dataset]` (launch checks this too)."""
    if args:
        raise RecipeError("the dataset environment takes no args: configure it in [orchestrator.dataset]",
                          key="orchestrator.environment.args")


def eval_environment(recipe, run, env: Environment) -> DatasetEnvironment | None:
    """What `[orchestrator.eval]` evaluates: the dataset environment's eval split (None when eval is off)."""
    if recipe.orchestrator.eval is None:
        return None
    return env if isinstance(env, DatasetEnvironment) else DatasetEnvironment.from_recipe(recipe, run)


def check_saved_state(recipe, state: dict[str, Any] | None) -> None:
    """Refuse a checkpoint's environment state that the orchestrator could not restore, before `rlctl
    resume` prunes anything: the dataset cursor of a dataset that has changed since, checked by the
    `Cursor.load_state_dict` the orchestrator calls at start (no model needed: no prompt is rendered)."""
    if recipe.orchestrator.environment.name != "dataset" or not state:
        return
    cfg = recipe.orchestrator.dataset
    seed, train, _ = train_split(cfg, recipe.orchestrator.seed)
    Cursor(len(train), seed, cfg.shuffle).load_state_dict(state.get("cursor") or {})
