"""Which prompts the inference servers can take: vLLM refuses a prompt of `inference.max_model_len`
tokens or more, and the retries of that one group then fail the run. Environments with prompts of
their own (a dataset, a verifiers task set) skip such a prompt, naming it once in the log."""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from rlctl.recipes.errors import RecipeError

if TYPE_CHECKING:
    from rlctl.orchestrator.environments import Prompt

log = logging.getLogger(__name__)
KEY = "inference.max_model_len"


def load_tokenizer(model: str):
    """The model's tokenizer from local files, or None (with a warning) when it has none: prompts are
    then sent unchecked."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer at %s (%s): prompts are not checked against %s", model, str(exc)[:200], KEY)
        return None


def prompt_limit(template, directory: str, max_model_len: int) -> "PromptLimit":
    """The check for prompts rendered by `template` (a ChatTemplate: its tokenizer) or sent as raw text
    (the model's own tokenizer in `directory`); one that takes every prompt when there is no tokenizer."""
    tokenizer = template.tokenizer if template is not None else load_tokenizer(directory)
    return PromptLimit(tokenizer, max_model_len)


class PromptLimit:
    """`fitting(where, render, name)`: the prompt `render()` gives, or None when it leaves no token of the
    servers' context. `where` keys the prompt (a row, a task) and `name` says it in the log; a prompt
    never changes, so one found too long is named once and neither rendered nor tokenized again. Without a
    tokenizer (the default) nothing can be counted, and every prompt is taken."""

    def __init__(self, tokenizer: Any = None, limit: int = 0):
        self.tokenizer, self.limit = tokenizer, limit
        self.too_long: set[Hashable] = set()

    def fitting(self, where: Hashable, render: Callable[[], "Prompt"], name: str) -> "Prompt | None":
        if where in self.too_long:
            return None
        prompt = render()
        if self.tokenizer is None:
            return prompt
        tokens = len(self.tokenizer(prompt.text)["input_ids"])  # as vLLM tokenizes a completion's prompt
        if tokens < self.limit:
            return prompt
        self.too_long.add(where)
        log.warning("%s skipped: its prompt is %d tokens, and the servers' context (%s) is %d",
                    name, tokens, KEY, self.limit)
        return None

    def none_fit(self, what: str) -> RecipeError:
        return RecipeError(f"no {what} prompt fits the servers' context ({self.limit} tokens): raise it or "
                           "shorten the prompts", key=KEY)
