"""Environment plugins: built-ins depend on the prompt, dotted-path loading, one-line errors."""
from __future__ import annotations

import random

import pytest

from rlctl.orchestrator.environments import (Environment, Prompt, SequenceEnvironment, bad_environment_args,
                                             load_environment)
from rlctl.recipes.errors import RecipeError
from rlctl.trainer.tiny_model import CHARSET


class Echo(Environment):
    def __init__(self, word: str = "hi"):
        self.word = word
        self.calls = 0

    def sample_prompts(self, rng, n):
        self.calls += n
        return [Prompt(self.word, self.word)] * n

    def reward(self, prompt, completion_text):
        return float(completion_text == prompt.target)

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_sequence_prompts_vary_and_reward_needs_the_prompt():
    env = load_environment("sequence", {"alphabets": ["letters", "digits"], "strides": [1, 2]})
    prompts = env.sample_prompts(random.Random(0), 200)
    assert len({p.text for p in prompts}) > 20
    for p in prompts:
        assert set(p.text + p.target) <= set(CHARSET)
        assert env.reward(p, p.target) == 1.0
    a, b = next((a, b) for a in prompts for b in prompts if a.target[0] != b.target[0])
    assert env.reward(a, b.target) < 1.0  # one fixed answer cannot fit every prompt
    p = Prompt("abc", "defg")
    assert env.reward(p, "dexg") == 0.75 and env.reward(p, "") == 0.0 and env.reward(p, "defgzzz") == 1.0


def test_sequence_is_deterministic_given_rng():
    env = SequenceEnvironment()
    assert env.sample_prompts(random.Random(7), 5) == env.sample_prompts(random.Random(7), 5)


def test_count_a():
    env = load_environment("count_a", {"length": 4})
    p = env.sample_prompts(random.Random(0), 1)[0]
    assert env.reward(p, "aaaa") == 1.0 and env.reward(p, "ab") == 0.25 and env.reward(p, "") == 0.0


def test_dotted_path_and_state_dict():
    env = load_environment("test_environments:Echo", {"word": "yo"})
    env.sample_prompts(random.Random(0), 3)
    fresh = load_environment("test_environments:Echo", {"word": "yo"})
    fresh.load_state_dict(env.state_dict())
    assert fresh.calls == 3


@pytest.mark.parametrize("name,args,match", [
    ("nope", {}, "unknown environment 'nope'"),
    ("no_such_module_x:Env", {}, "cannot import module"),
    ("random:Random", {}, "not a subclass"),
    ("sequence", {"alphabets": ["greek"]}, "unknown alphabet"),
    ("sequence", {"strides": [0]}, "strides"),
    ("sequence", {"bogus": 1}, "bad arguments"),
])
def test_bad_input_is_one_line_recipe_error(name, args, match):
    with pytest.raises(RecipeError, match=match) as info:
        load_environment(name, args)
    assert "\n" not in str(info.value) and str(info.value).startswith("orchestrator.environment")


class NoArgs(Echo):
    def __init__(self):
        super().__init__()


class AnyArgs(Echo):
    def __init__(self, *args, **kwargs):
        super().__init__()


@pytest.mark.parametrize("cls,ends", [
    (Echo, "; 'env' takes word"),
    (NoArgs, "; 'env' takes no arguments"),
    (AnyArgs, "boom"),  # nothing named to list: the constructor's own message is the whole line
])
def test_bad_args_line_says_what_the_environment_takes(cls, ends):
    err = bad_environment_args("env", cls, TypeError("boom"))
    assert err.key == "orchestrator.environment.args" and str(err).endswith(ends)
    assert "bad arguments for environment 'env': boom" in str(err)
