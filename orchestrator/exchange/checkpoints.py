"""Which checkpoints are usable, for everyone (trainer, orchestrator, `rlctl resume`, requeued jobs).

`checkpoints/step_N/` holds one part per component: `trainer/` (DCP shards, see trainer/checkpoint.py)
and `orchestrator/` (its progress: `state.json`). Each part is staged under a temporary name, renamed,
and gets its `COMPLETE` marker last. Step N is *complete* when the trainer part has its marker and
every other part present has its marker too.

Why an absent orchestrator part is not a blocker: the orchestrator writes its part N (state after
batch N-1) *before* it writes rollout batch N-1, and the trainer cannot save step N before it has
trained batch N-1. So a complete trainer part N without an orchestrator part means the run has no
orchestrator that records progress (trainer-only runs and tests) — never a torn checkpoint. A part
directory without its marker (a crash between rename and marker) makes the step incomplete.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rlctl.orchestrator.exchange.steps import MARKER, parse_step, publish_step, remove_step, seal, step_dir_name

TRAINER, ORCHESTRATOR = "trainer", "orchestrator"
STATE_FILE = "state.json"


def step_path(checkpoints: Path, step: int) -> Path:
    return Path(checkpoints) / step_dir_name(step)


def step_entries(folder: Path) -> list[Path]:
    """What a step directory holds, [] when the step is gone. The trainer prunes old checkpoints and
    the orchestrator its old progress parts while the other lists them: a step may vanish at any moment."""
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _parts(folder: Path) -> list[Path]:
    return [p for p in step_entries(folder) if p.is_dir()]


def is_complete(checkpoints: Path, step: int) -> bool:
    folder = step_path(checkpoints, step)
    if not (folder / TRAINER / MARKER).exists():
        return False
    others = [p for p in _parts(folder) if p.name != TRAINER and not p.name.startswith(".")]
    # a step being removed reads as incomplete: every marker goes before any file, in any order
    return all((p / MARKER).exists() for p in others) and (folder / TRAINER / MARKER).exists()


def all_steps(checkpoints: Path) -> list[int]:
    """Every step directory, complete or not, ascending."""
    checkpoints = Path(checkpoints)
    if not checkpoints.is_dir():
        return []
    return sorted(s for s in (parse_step(p.name) for p in checkpoints.iterdir()) if s is not None)


def complete_checkpoints(checkpoints: Path) -> list[int]:
    """Complete steps, ascending."""
    return [s for s in all_steps(checkpoints) if is_complete(checkpoints, s)]


def remove_checkpoint(folder: Path) -> None:
    """Every part's marker first (then the step is incomplete for every reader), then the files."""
    for part in _parts(folder):
        (part / MARKER).unlink(missing_ok=True)
    remove_step(folder)


def newest_complete(checkpoints: Path) -> int | None:
    done = complete_checkpoints(checkpoints)
    return done[-1] if done else None


def write_part(checkpoints: Path, step: int, part: str, files: dict[str, bytes]) -> Path:
    """Write a small part (whole files in memory) with the one publishing protocol."""
    def write(stage: Path) -> None:
        for name, data in files.items():
            (stage / name).write_bytes(data)

    return publish_step(step_path(checkpoints, step), part, write, {"step": step})


def seal_part(stage: Path, final: Path, step: int) -> None:
    """Make a part written collectively into `stage` (DCP, every rank) visible: rename, marker last."""
    seal(stage, final, {"step": step})


# ---- the orchestrator's part --------------------------------------------------------------------


def rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def rng_from_json(data: list) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


def save_orchestrator_state(checkpoints: Path, step: int, state: dict[str, Any]) -> Path:
    """`state` = {"rng": random state, "environment": {...}, "counters": {...}} after batch `step - 1`."""
    body = {"step": step, **state, "rng": rng_to_json(state["rng"])}
    return write_part(checkpoints, step, ORCHESTRATOR, {STATE_FILE: (json.dumps(body) + "\n").encode()})


def load_orchestrator_state(checkpoints: Path, step: int) -> dict[str, Any] | None:
    """The orchestrator's state saved for `step`, or None when that part is absent or incomplete."""
    part = step_path(checkpoints, step) / ORCHESTRATOR
    if not (part / MARKER).exists():
        return None
    body = json.loads((part / STATE_FILE).read_text())
    body["rng"] = rng_from_json(body["rng"])
    return body


def fallback_rng(seed: int, step: int) -> random.Random:
    """The sampler of a run (re)started at `step` without a saved state: deterministic per step."""
    return random.Random(seed * 1_000_003 + step)


def prune_progress(checkpoints: Path, keep_from: int) -> None:
    """Orchestrator-only progress parts older than `keep_from` (never a trainer checkpoint)."""
    for step in all_steps(checkpoints):
        folder = step_path(checkpoints, step)
        if step < keep_from and not (folder / TRAINER).exists():
            remove_checkpoint(folder)
