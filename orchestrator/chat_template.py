"""The policy's chat template, from its own tokenizer files: what the dataset and verifiers environments
render chat prompts with (so the orchestrator sees the prompt exactly as the model was trained to)."""
from __future__ import annotations

from pathlib import Path

from rlctl.recipes.errors import RecipeError


class ChatTemplate:
    """The model's chat template, rendered by its own tokenizer (read from local files only)."""

    def __init__(self, model_dir: str, key: str):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RecipeError(f"cannot load the tokenizer of {model_dir} for its chat template: {str(exc)[:200]}",
                              key="model.name") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise RecipeError(f"the model's tokenizer ({model_dir}) has no chat_template: turn the chat template off "
                              "and give plain prompts", key=key)

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def model_dir(recipe, run) -> str:
    """Where the policy's tokenizer lives: the built tiny model, a local directory, or a hub id (read
    from the local cache only)."""
    from rlctl.trainer.tiny_model import is_tiny_model

    name = recipe.model.name
    if is_tiny_model(name):
        return str(run.model)
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        return str(path.parent)
    return str(path) if path.is_dir() else name
