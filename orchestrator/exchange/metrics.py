"""Metric records: typed per writer, one JSON-lines file per writer (`metrics/<writer>.jsonl`), one reader.

One file per writer because appends from several hosts to one file are not atomic on NFS; each
writer (trainer rank 0, the orchestrator, ...) appends whole lines to its own file only. Readers
merge the files; a line being appended right now is skipped.

Writers construct the record classes below (an unknown or missing field is a TypeError at the
writer, not a silently empty plot); readers name keys through `keys_of(...)`, which fails at import
when a key is renamed. On disk a record is its fields plus `component`, as plain JSON.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from rlctl.orchestrator.exchange.files import append_jsonl, atomic_write_bytes
from rlctl.orchestrator.exchange.layout import RunDir


@dataclass(kw_only=True)
class StepRecord:
    """What every metric record has: the step it describes and when it was written."""

    component: ClassVar[str] = ""
    """Who wrote it (`trainer`, `orchestrator`); readers group records by it."""
    step: int
    """The training step (0-based) this record describes."""
    time: float = field(default_factory=time.time)
    """Unix time the record was written."""

    def to_json(self) -> dict:
        return {"component": self.component, **dataclasses.asdict(self)}


@dataclass(kw_only=True)
class TrainerStepRecord(StepRecord):
    """One line of `metrics/trainer.jsonl`, written by trainer rank 0 after each training step."""

    component: ClassVar[str] = "trainer"
    trainer_step_time_s: float
    """Seconds of forward, backward and optimizer step (the batch already read)."""
    wait_batch_s: float
    """Seconds waiting for `rollouts/step_N` (the trainer idle because inference is behind)."""
    weight_publish_s: float
    """Seconds publishing the new weights (`weights/step_N+1`)."""
    attempt_start: bool = False
    """The first step of an attempt: its wait_batch_s includes the servers' start-up, not inference being behind."""
    loss: float
    """Sum of the per-token loss over the batch."""
    grad_norm: float
    """Gradient norm before clipping."""
    tokens: int
    """Trained (loss-masked) tokens in the batch."""
    lr: float
    """Learning rate used for this step."""
    mismatch_kl: float
    """Mean per-token KL between inference and trainer probabilities."""
    masked_fraction: float
    """Fraction of tokens masked because trainer and inference disagreed too much."""
    ratio_mean: float
    """Mean token importance ratio trainer / inference."""
    entropy: float | None = None
    """Mean per-token entropy of the trainer's distribution (None when the loss does not report it)."""
    reward_mean_batch: float | None = None
    """Mean reward of the trained batch."""
    policy_version_max: int | None = None
    """Newest policy version that generated a token of the batch."""
    expert_load_imbalance: float | None = None
    """MoE models: tokens of the busiest expert over the mean per expert, averaged over MoE layers (1 = balanced)."""
    tokens_per_expert: list[list[int]] | None = None
    """MoE models: tokens routed to each expert in this step, one list per MoE layer (all ranks)."""
    router_replay_coverage: float | None = None
    """Router replay: share of the step's token-layers (padding excluded) routed by the experts inference
    chose; the rest (each sample's last token, which inference never ran) by the trainer's router."""
    router_replay_overrides: float | None = None
    """Router replay: share of the replayed token-layers where the trainer's router would have chosen
    other experts (what replay corrected: numeric near-ties and the routing of an older policy)."""


@dataclass(kw_only=True)
class OrchestratorStepRecord(StepRecord):
    """One line of `metrics/orchestrator.jsonl`, written when batch `step` is complete."""

    component: ClassVar[str] = "orchestrator"
    reward_mean: float
    """Mean reward of the batch's rollouts."""
    orchestrator_step_time_s: float
    """Seconds from the start of collecting the batch to writing it."""
    wait_policy_s: float
    """Seconds the off-policy gate held the batch back (inference idle because the trainer is behind)."""
    rollouts_per_s: float
    """Rollouts of the batch per second of the step."""
    tokens_per_s: float
    """Trained tokens of the batch per second of the step."""
    off_policy_lag_mean: float
    """Mean over tokens of (step - policy version that generated the token)."""
    off_policy_lag_max: int
    """Largest such lag in the batch."""
    dropped_groups: int
    """Groups dropped as too off-policy while this batch was collected (each one replaced)."""
    policy_version: int
    """Policy version the servers served when the batch was written."""
    tokens: int
    """Trained (loss-masked) tokens in the batch."""
    weight_reload_s: float | None = None
    """Seconds the servers spent reloading weights since the previous batch."""
    weight_reload_bytes: int | None = None
    """Weight bytes the busiest server read for those reloads (its share of the shards; 0 by broadcast)."""
    turns_mean: float | None = None
    """Mean generated turns per rollout (1 for single-turn environments)."""
    reward_timeouts: int = 0
    """Reward calls past `orchestrator.reward.timeout_s` since the previous batch (each failed)."""
    reward_errors: int = 0
    """Reward calls that raised (or whose worker died) since the previous batch."""
    reward_memory_kills: int = 0
    """Reward calls that ran out of `orchestrator.reward.memory_mb` since the previous batch."""
    reward_dropped_groups: int = 0
    """Groups dropped for a failed reward (`on_failure = "drop_group"`) since the previous batch, each replaced."""


@dataclass(kw_only=True)
class EvalRecord(StepRecord):
    """One line of `metrics/eval.jsonl`, written by the orchestrator when an evaluation of the eval
    split finishes; `step` is the policy version evaluated (weights after `step` training steps)."""

    component: ClassVar[str] = "eval"
    reward_mean: float
    """Mean reward over every eval completion."""
    pass_at_k: float
    """Mean over prompts of the unbiased pass@k estimate (correct = reward >= eval.correct_threshold)."""
    k: int
    """The k of pass@k."""
    prompts: int
    """Eval prompts scored."""
    samples_per_prompt: int
    """Completions per prompt."""
    temperature: float
    """Sampling temperature (0 = greedy)."""
    completion_tokens_mean: float
    """Mean generated tokens per completion."""
    reward_errors: int
    """Completions whose reward raised (scored 0)."""
    eval_time_s: float
    """Seconds the evaluation took (it runs beside training)."""
    policy_version_end: int
    """Policy version served when the evaluation finished (weights may change while it runs)."""


RECORDS: dict[str, type[StepRecord]] = {cls.component: cls for cls in (TrainerStepRecord, OrchestratorStepRecord,
                                                                        EvalRecord)}


def keys_of(cls: type[StepRecord], *names: str) -> tuple[str, ...]:
    """`names`, each checked to be a field of `cls`: readers take their keys from here so that a
    renamed field fails at import instead of showing an empty series."""
    known = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in names if n not in known]
    if missing:
        raise KeyError(f"{cls.__name__} has no field {', '.join(missing)}")
    return names


def key_of(cls: type[StepRecord], name: str) -> str:
    return keys_of(cls, name)[0]


def writer_file(run: RunDir, writer: str) -> Path:
    return run.metrics / f"{writer}.jsonl"


def append_record(run: RunDir, writer: str, record: StepRecord | dict) -> None:
    """Append one record to `writer`'s file. A plain dict for a known writer may hold only that
    writer's fields (a misspelled key fails here)."""
    if isinstance(record, StepRecord):
        data = record.to_json()
    else:
        cls = RECORDS.get(writer)
        if cls is not None:
            keys_of(cls, *(k for k in record if k != "component"))
        data = {"component": writer, **record}
    append_jsonl(writer_file(run, writer), data)


def _read_lines(path: Path) -> list[tuple[str, dict]]:
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue  # a torn last line of a killed writer, or one being appended now
                if isinstance(record, dict):
                    out.append((raw.decode().rstrip("\n"), record))
    except FileNotFoundError:
        pass
    return out


def read_records(run_dir: Path | RunDir) -> list[dict]:
    """Every whole record of every writer, ordered by time (records without a time keep file order)."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    records = []
    for path in sorted(run.metrics.glob("*.jsonl")) if run.metrics.is_dir() else ():
        records += [record for _, record in _read_lines(path)]
    return sorted(records, key=lambda r: r.get("time") if isinstance(r.get("time"), (int, float)) else 0.0)


def typed(records: list[dict], cls: type[StepRecord]) -> list[StepRecord]:
    """The records of `cls`'s component as `cls`, one per step (the last one wins), ordered by step.
    Keys the class does not know (written by a newer version) are ignored; a record missing a
    required field is skipped."""
    names = {f.name for f in dataclasses.fields(cls)}
    latest: dict[int, StepRecord] = {}
    for record in records:
        if record.get("component") != cls.component or not isinstance(record.get("step"), int):
            continue
        try:
            latest[record["step"]] = cls(**{k: v for k, v in record.items() if k in names})
        except TypeError:
            continue
    return [latest[s] for s in sorted(latest)]


def keep_before(run: RunDir, step: int, source: RunDir | None = None) -> int:
    """Rewrite every writer's file to hold only records of steps < `step` (taken from `source`'s
    files when given, e.g. the run a checkpoint was imported from); returns the records dropped."""
    dropped = 0
    origin = source or run
    names = {p.name for folder in {run.metrics, origin.metrics} if folder.is_dir() for p in folder.glob("*.jsonl")}
    for name in sorted(names):
        mine = _read_lines(run.metrics / name)
        lines = _read_lines(origin.metrics / name) if source is not None else mine
        kept = [ln for ln, rec in lines if not isinstance(rec.get("step"), int) or rec["step"] < step]
        dropped += len(mine) - (len(kept) if source is None else 0)
        if source is not None or len(kept) != len(mine):
            atomic_write_bytes(run.metrics / name, "".join(f"{ln}\n" for ln in kept).encode())
    return dropped
