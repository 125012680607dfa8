"""Metric records: one JSON-lines file per writer (`metrics/<writer>.jsonl`), one reader for all.

One file per writer because appends from several hosts to one file are not atomic on NFS; each
writer (trainer rank 0, the orchestrator, ...) appends whole lines to its own file only. Readers
merge the files; a line being appended right now is skipped.
"""
from __future__ import annotations

import json
from pathlib import Path

from rlctl.orchestrator.exchange.files import append_jsonl, atomic_write_bytes
from rlctl.orchestrator.exchange.layout import RunDir


def writer_file(run: RunDir, writer: str) -> Path:
    return run.metrics / f"{writer}.jsonl"


def append_record(run: RunDir, writer: str, record: dict) -> None:
    append_jsonl(writer_file(run, writer), record)


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
