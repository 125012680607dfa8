"""Run directories claimed and locked: the run (or pool) name a user chose, its directory created
exclusively under the output root, the lock every command that changes a run takes, and the first
attempt's directory released again when nothing started in it."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from rlctl.orchestrator.exchange.files import DIR_MODE, private_dir
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.recipes.errors import UNUSABLE_PATH, RecipeError, shown


def check_run_name(name: str) -> str:
    """A run name the user chose (`--name`): the schema's RunName alphabet, one line otherwise."""
    from pydantic import TypeAdapter, ValidationError

    from rlctl.recipes.base import RUN_NAME_ALLOWED, RunName

    try:
        return TypeAdapter(RunName).validate_python(name)
    except ValidationError:
        raise RecipeError(f"invalid run name {name!r}: use {RUN_NAME_ALLOWED}", key="--name") from None


def claim_run_dir(root: Path, prefix: str, name: str | None, key: str) -> RunDir | None:
    """Create the run directory exclusively, so two launches never share one. An automatic name that
    is taken (same recipe, same second) gets the next free suffix; a chosen `name` that exists → None.
    A root that cannot hold it (not a folder, not allowed) is one line naming `key`, the setting it came from."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidates = [name] if name else [f"{prefix}-{stamp}"] + [f"{prefix}-{stamp}-{n}" for n in range(2, 1000)]
    for candidate in candidates:
        path = root / candidate
        try:
            private_dir(root)
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in UNUSABLE_PATH:
                raise  # disk full, I/O: a failure, not bad input
            raise RecipeError(f"cannot create a run directory in {shown(str(root))}: {e.strerror}", key=key) from None
        os.chmod(path, DIR_MODE)  # mkdir's mode is filtered by the umask
        return RunDir(path)
    if name:
        return None
    raise RecipeError(f"no free run directory name {prefix}-{stamp}-N under {root}")


def run_lock(run: RunDir, command: str, wait_s: float = 0.0):
    """The run's lock (see exchange/lock.py); a lock of another host is broken only when old and the
    run is not pending or running (an unknown state counts as active)."""
    from rlctl.orchestrator.exchange.lock import RunLock

    def active() -> bool:
        from rlctl.launchers.status import ENDED, run_state

        return run_state(run.root).state not in ENDED

    return RunLock(run.lock, command, active=active, wait_s=wait_s)


@contextlib.contextmanager
def first_attempt(run: RunDir, holder: str):
    """The lock of a run (or pool) directory just claimed for its first attempt; on Ctrl-C or a refusal
    before anything started, the directory goes, so its name is free again."""
    try:
        with run_lock(run, holder):
            yield
    except BaseException:
        if not run.manifest.exists():  # written as soon as a job or supervisor exists (start_attempt)
            shutil.rmtree(run.root, ignore_errors=True)
        raise
