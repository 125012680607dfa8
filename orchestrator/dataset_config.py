"""The `[orchestrator.dataset]` and `[orchestrator.eval]` recipe sections: prompts from a local dataset,
and a periodic evaluation of the current policy on its eval split."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlctl.recipes.base import Count, PositiveCount, StrictModel, Tokens

NonEmpty = Annotated[str, Field(min_length=1, max_length=4096)]


class DatasetConfig(StrictModel):
    """A local dataset (no hub access at run time) whose rows become prompts, scored against an answer."""

    path: NonEmpty
    """A JSONL file, a Parquet file, or a directory written by `datasets.Dataset.save_to_disk`. A
    relative path is looked up in the current directory, then among the data shipped with rlctl."""
    format: Literal["auto", "jsonl", "parquet", "arrow"] = "auto"
    """`auto` picks by suffix (`.jsonl`/`.json`, `.parquet`) or, for a directory, `arrow` (save_to_disk)."""
    prompt_column: NonEmpty | None = "prompt"
    """Column holding the prompt text (used when `messages_column` is not set)."""
    messages_column: NonEmpty | None = None
    """Column holding a chat (a list of {role, content}); takes the place of `prompt_column`."""
    answer_column: NonEmpty = "answer"
    """Column holding the target the reward compares against (numbers are turned into text)."""
    system_prompt: Annotated[str, Field(max_length=1 << 16)] | None = None
    """A system message put before every prompt (chat template only)."""
    apply_chat_template: bool = True
    """Render prompts with the model's chat template (`chat_template` of its tokenizer); a messages
    column always is. False sends the prompt column's text as it is."""
    reward: Literal["exact_match", "char_match"] = "exact_match"
    """The environment's own reward, cheap enough to run inline: `exact_match` (1 when the completion is
    the answer, whitespace around ignored) or `char_match` (fraction of the answer's characters at the
    same place). Costlier ones (math, code, your own) go in `[orchestrator.reward] function`, which
    replaces this one for training and evaluation."""
    shuffle: bool = True
    """Visit the rows in a new seeded order every epoch (else in file order)."""
    seed: Count | None = None
    """Seed of the per-epoch order and of the held-out split; default `orchestrator.seed`."""
    eval_path: NonEmpty | None = None
    """A separate eval split (same format and columns as `path`)."""
    eval_fraction: Annotated[float, Field(ge=0, le=0.5)] = 0.0
    """Or hold out this fraction of `path`'s rows as the eval split (seeded; never trained on)."""

    @model_validator(mode="after")
    def _one_of_each(self):
        if "prompt_column" in self.model_fields_set and self.prompt_column and self.messages_column:
            raise ValueError("set only one of orchestrator.dataset.prompt_column and messages_column")
        if self.messages_column is None and self.prompt_column is None:
            raise ValueError("orchestrator.dataset needs prompt_column or messages_column")
        if self.eval_path is not None and self.eval_fraction > 0:
            raise ValueError("set only one of orchestrator.dataset.eval_path and eval_fraction")
        return self

    @property
    def has_eval_split(self) -> bool:
        return self.eval_path is not None or self.eval_fraction > 0


class EvalConfig(StrictModel):
    """Evaluate the current policy on the dataset's eval split, in the background (training goes on)."""

    interval: PositiveCount = 10
    """Evaluate policy versions 0, interval, 2 × interval, ... (a version already passed while the
    previous evaluation ran is skipped: the newest one is evaluated)."""
    at_end: bool = True
    """Also evaluate the final policy before the run completes."""
    samples_per_prompt: Annotated[int, Field(ge=1, le=1024)] = 1
    """Completions per eval prompt."""
    pass_k: Annotated[int, Field(ge=1, le=1024)] = 1
    """k of pass@k (unbiased estimate from `samples_per_prompt` samples): the chance that at least one
    of k samples is correct."""
    temperature: Annotated[float, Field(ge=0, le=100)] = 0.0
    """Sampling temperature; 0 = greedy."""
    max_tokens: Tokens | None = None
    """Maximum generated tokens per completion; default `orchestrator.max_tokens`."""
    max_prompts: PositiveCount | None = None
    """Use only the first this many prompts of the eval split (all by default)."""
    correct_threshold: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    """A completion counts as correct for pass@k when its reward is at least this."""
    max_in_flight: Annotated[int, Field(ge=1, le=1 << 16)] = 32
    """Eval requests in flight at once (keeps evaluation from crowding out training rollouts)."""

    @model_validator(mode="after")
    def _k_fits(self):
        if self.pass_k > self.samples_per_prompt:
            raise ValueError(f"orchestrator.eval.pass_k ({self.pass_k}) must be <= samples_per_prompt "
                             f"({self.samples_per_prompt})")
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError("orchestrator.eval: greedy decoding (temperature 0) gives identical samples; "
                             "use samples_per_prompt = 1 or a temperature > 0")
        return self


def check_dataset_sections(orch) -> None:
    """Cross-section rules of the orchestrator config (called by its validator)."""
    if orch.environment.name == "dataset" and orch.dataset is None:
        raise ValueError("orchestrator.environment.name = 'dataset' needs an [orchestrator.dataset] section")
    if orch.eval is not None and (orch.dataset is None or not orch.dataset.has_eval_split):
        raise ValueError("orchestrator.eval needs an eval split: set orchestrator.dataset.eval_path or "
                         "orchestrator.dataset.eval_fraction")
