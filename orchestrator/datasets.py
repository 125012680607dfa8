"""Local datasets for the `dataset` environment: read rows, render prompts, visit them in a seeded order.

Formats: JSONL, Parquet (needs pyarrow) and a directory written by `datasets.Dataset.save_to_disk`
(needs the `datasets` package, the `workloads` extra). Nothing is fetched from a hub: a run reads the
files the recipe names. Every problem with the data (missing file, missing column, a row of the wrong
type) is a RecipeError naming the `orchestrator.dataset` key, found when the run is launched.

The order is a pure function of (seed, epoch): epoch e visits the rows in the permutation
`shuffled(seed, e)`, so a cursor (epoch, index) is all a resumed run needs to draw exactly the
prompts an uninterrupted run would have drawn.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from rlctl.recipes.errors import RecipeError

KEY = "orchestrator.dataset"


@dataclass(frozen=True)
class Row:
    """One example: `prompt` is text or a chat (list of {role, content}); `answer` is text."""

    prompt: str | list[dict[str, str]]
    answer: str
    index: int  # row number in its file, for messages and the prompt's info


def resolve_path(path: str, key: str = f"{KEY}.path") -> Path:
    """An existing file or directory: as given (absolute or relative to the current directory), else
    relative to the data shipped with rlctl (the recipes package, e.g. `data/tiny-sequences.jsonl`)."""
    given = Path(path).expanduser()
    if given.exists():
        return given.resolve()
    if not given.is_absolute():
        shipped = Path(str(resources.files("rlctl.recipes").joinpath(path)))
        if shipped.exists():
            return shipped
    raise RecipeError(f"dataset not found: {path}", key=key)


def detect_format(path: Path, fmt: str, key: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "arrow"
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise RecipeError(f"cannot tell the format of {path.name} (use .jsonl, .parquet, a save_to_disk "
                      f"directory, or set orchestrator.dataset.format)", key=key)


class MissingColumn(Exception):
    """A reader's finding that a column is absent; `load_rows` names the option that names the column."""

    def __init__(self, column: str, message: str):
        self.column = column
        super().__init__(message)


def _read_jsonl(path: Path, columns: list[str], key: str) -> dict[str, list]:
    out: dict[str, list] = {c: [] for c in columns}
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark (Windows editors) is not JSON
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise RecipeError(f"{path.name} line {number} is not JSON", key=key) from None
                if not isinstance(row, dict):
                    raise RecipeError(f"{path.name} line {number} is not a JSON object", key=key)
                for c in columns:
                    if c not in row:
                        raise MissingColumn(c, f"{path.name} line {number} has no column {c!r} "
                                               f"(columns: {', '.join(sorted(row)) or 'none'})")
                    out[c].append(row[c])
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read {path}: {exc}", key=key) from None
    return out


def _from_table(table, path: Path, columns: list[str], key: str) -> dict[str, list]:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise MissingColumn(missing[0], f"{path.name} has no column {missing[0]!r} "
                                        f"(columns: {', '.join(table.column_names)})")
    return {c: table.column(c).to_pylist() for c in columns}


def _read_parquet(path: Path, columns: list[str], key: str) -> dict[str, list]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecipeError("reading Parquet needs pyarrow (pip install 'rlctl[workloads]')", key=key) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own error types for corrupt files
        raise RecipeError(f"cannot read Parquet file {path}: {str(exc)[:200]}", key=key) from None
    return _from_table(table, path, columns, key)


def _read_arrow_dir(path: Path, columns: list[str], key: str) -> dict[str, list]:
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise RecipeError(f"{path} holds several splits ({', '.join(splits)}): point at one split's "
                          f"directory, e.g. {path / (splits[0] if splits else 'train')}", key=key)
    if not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        raise RecipeError(f"{path} is a directory but not one written by datasets' save_to_disk", key=key)
    try:
        import datasets
    except ImportError:
        raise RecipeError("a save_to_disk directory needs the `datasets` package (pip install 'rlctl[workloads]')",
                          key=key) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged directory
        raise RecipeError(f"cannot load {path}: {str(exc)[:200]}", key=key) from None
    return _from_table(ds.data.table if hasattr(ds.data, "table") else ds.data, path, columns, key)


READERS = {"jsonl": _read_jsonl, "parquet": _read_parquet, "arrow": _read_arrow_dir}


def load_rows(cfg, which: str = "path") -> list[Row]:
    """The rows of `cfg.path` (or `cfg.eval_path` with which="eval_path"), checked column by column."""
    key = f"{KEY}.{which}"
    path = resolve_path(getattr(cfg, which), key)
    fmt = detect_format(path, cfg.format, f"{KEY}.format")
    prompt_col = cfg.messages_column or cfg.prompt_column
    prompt_key = f"{KEY}.{'messages_column' if cfg.messages_column else 'prompt_column'}"
    columns = [prompt_col, cfg.answer_column]
    try:
        data = READERS[fmt](path, columns, key)
    except MissingColumn as exc:  # name the option that names the column
        raise RecipeError(str(exc), key=prompt_key if exc.column == prompt_col else f"{KEY}.answer_column") from None
    rows = []
    for i, (prompt, answer) in enumerate(zip(data[prompt_col], data[cfg.answer_column])):
        rows.append(Row(_check_prompt(prompt, i, cfg.messages_column is not None, prompt_key, path),
                        _as_text(answer, i, f"{KEY}.answer_column", path), i))
    if not rows:
        raise RecipeError(f"{path} has no rows", key=key)
    return rows


def _check_prompt(value: Any, i: int, chat: bool, key: str, path: Path):
    if not chat:
        if not isinstance(value, str):
            raise RecipeError(f"row {i} of {path.name}: the prompt is {type(value).__name__}, not text", key=key)
        if not value.strip():  # the server refuses an empty prompt: the run failed at its first batch
            raise RecipeError(f"row {i} of {path.name}: the prompt is empty", key=key)
        return value
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise RecipeError(f"row {i} of {path.name}: messages must be a non-empty list of {{role, content}} "
                          f"with text values", key=key)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _as_text(value: Any, i: int, key: str, path: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)  # a NaN or inf (JSON allows NaN) would be the answer "nan"
    raise RecipeError(f"row {i} of {path.name}: the answer is {type(value).__name__}, not text or a number", key=key)


def split_rows(rows: list[Row], eval_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, eval): a seeded, order-independent hold-out of `eval_fraction` of the rows (>= 1 row)."""
    if eval_fraction <= 0:
        return rows, []
    n_eval = max(1, round(len(rows) * eval_fraction))
    if n_eval >= len(rows):
        raise RecipeError(f"eval_fraction {eval_fraction} leaves no training rows of {len(rows)}",
                          key=f"{KEY}.eval_fraction")
    order = list(range(len(rows)))
    random.Random(f"rlctl-eval-split:{seed}").shuffle(order)
    held = set(order[:n_eval])
    return [r for r in rows if r.index not in held], [r for r in rows if r.index in held]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The visiting order of `n` rows in `epoch`: a permutation that depends only on (seed, epoch)."""
    order = list(range(n))
    if shuffle:
        random.Random(f"rlctl-dataset:{seed}:{epoch}").shuffle(order)
    return order


class Cursor:
    """Position (epoch, index) in the endless stream of epochs over `n` rows."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = epoch_order(n, seed, 0, shuffle)

    def next(self) -> int:
        """The row number to use next; advances (a new order at each epoch boundary)."""
        if self.index >= self.n:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = epoch_order(self.n, self.seed, self.epoch, self.shuffle)
        row = self._order[self.index]
        self.index += 1
        return row

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "rows": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if state.get("rows") != self.n or state.get("seed") != self.seed:
            raise RecipeError(f"the saved dataset cursor is for {state.get('rows')} rows with seed {state.get('seed')}, "
                              f"this dataset has {self.n} rows with seed {self.seed}: the data or its seed changed "
                              f"since the checkpoint", key=f"{KEY}.path")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = epoch_order(self.n, self.seed, self.epoch, self.shuffle)


def check_dataset(orch_cfg) -> None:
    """Launch-time check: the files exist and hold the columns (so a bad recipe fails before any job
    starts); relative paths are made absolute because components run in the run directory."""
    cfg = orch_cfg.dataset
    if cfg is None:
        return
    cfg.path = str(resolve_path(cfg.path))
    if cfg.eval_path is not None:
        cfg.eval_path = str(resolve_path(cfg.eval_path, f"{KEY}.eval_path"))
    rows = load_rows(cfg)
    if cfg.eval_path is not None:
        load_rows(cfg, "eval_path")
    split_rows(rows, cfg.eval_fraction, orch_cfg.seed if cfg.seed is None else cfg.seed)
