"""Step directories (`<parent>/step_N/`), the one way they are published, listed and removed.

A step directory is visible to readers only once its `COMPLETE` marker exists. `publish_step` is the
single writer protocol for weights, rollout batches and checkpoint parts: write into a hidden staging
directory, fsync the files, rename the directory to its final name, then write the marker last. A
crash at any point leaves either nothing visible or a directory without marker, which readers ignore
and `sweep_staging` / the next publish removes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from rlctl.orchestrator.exchange.files import DIR_MODE, atomic_write_json, fsync_path, private_dir

MARKER = "COMPLETE"  # written last into a step directory; readers ignore directories without it
STAGING_SUFFIX = ".tmp"


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def stage_dir(parent: Path, name: str) -> Path:
    """A fresh hidden directory beside `parent/name` to write into before `seal`."""
    private_dir(parent)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=STAGING_SUFFIX, dir=parent))
    os.chmod(stage, DIR_MODE)
    return stage


def seal(stage: Path, final: Path, marker: dict, sync_metadata: bool = True, fsync_files: bool = True) -> Path:
    """Make a fully written staging directory visible: fsync its files, rename it, marker last.

    `sync_metadata=False` skips syncing the rename and the marker: for data that is cheap to
    republish (weights), losing those in a crash merely hides the step. `fsync_files=False` is for
    writers that synced their own files (several processes writing one directory)."""
    for child in stage.iterdir() if fsync_files else ():
        if child.is_file():
            fsync_path(child)
    fsync_path(stage)
    if final.exists():  # a leftover without marker from a writer that crashed between rename and marker
        (final / MARKER).unlink(missing_ok=True)
        shutil.rmtree(final)
    os.rename(stage, final)
    if sync_metadata:
        fsync_path(final.parent)
    atomic_write_json(final / MARKER, {"time": time.time(), **marker})
    if sync_metadata:
        fsync_path(final)
    return final


def publish_step(parent: Path, name: str, write: Callable[[Path], None], marker: dict,
                 sync_metadata: bool = True) -> Path:
    """Stage → `write(stage)` → fsync → rename to `parent/name` → marker last; returns the final path.
    On any failure the staging directory is removed and nothing becomes visible."""
    parent = Path(parent)
    stage = stage_dir(parent, name)
    try:
        write(stage)
        return seal(stage, parent / name, marker, sync_metadata)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def complete_steps(parent: Path) -> list[int]:
    """Steps under `parent` whose directory holds the completion marker, ascending."""
    if not parent.is_dir():
        return []
    out = []
    for child in parent.iterdir():
        step = parse_step(child.name)
        if step is not None and (child / MARKER).exists():
            out.append(step)
    return sorted(out)


def remove_step(folder: Path) -> None:
    """The marker goes first, so no reader picks the step up while its files are deleted."""
    (folder / MARKER).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def remove_steps(parent: Path, keep: Callable[[int], bool]) -> list[int]:
    """Delete the step directories under `parent` whose step fails `keep`; returns them ascending."""
    removed = []
    for child in parent.iterdir() if parent.is_dir() else ():
        step = parse_step(child.name)
        if step is not None and not keep(step):
            remove_step(child)
            removed.append(step)
    return sorted(removed)


def sweep_staging(parent: Path) -> list[str]:
    """Remove staging directories left by killed writers (hidden `*.tmp` entries); returns their names.
    Call only while no writer of `parent` runs (at component start, on rewind)."""
    swept = []
    for child in parent.iterdir() if Path(parent).is_dir() else ():
        if child.name.startswith(".") and child.name.endswith(STAGING_SUFFIX):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            swept.append(child.name)
    return swept
