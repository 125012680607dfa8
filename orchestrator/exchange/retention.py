"""Retention: what may be deleted from a run directory, by whom and when — every rule in one place.

Weights (`weights/step_N`), deleted by the trainer (rank 0) right after each publish (`retain_weights`):
  kept are the `weights.keep_last` newest complete steps and every step a server may still be loading,
  which is every step newer than the version the servers serve. The orchestrator's weight watcher
  records that version in `services/weights/serving.json` (`record_serving`): once when it starts,
  before it looks for weights, and after each reload has finished, before it bumps the policy.
  Why a floor and not "the step being loaded": the watcher picks the newest complete step before it
  could write down its choice, so a record naming that step could come too late; a floor that only
  rises after a load is complete is never too late. The trainer reads the record *before* it lists
  the steps: any step the watcher picked after that read was the newest complete one at the time and
  is still among the newest the trainer sees, any step picked before it is above the floor read.
  Without a record of this attempt (the watcher has not started yet) every complete step is kept.
  The floor costs nothing in the steady state: the trainer cannot train batch N before the servers
  serve version >= N - max_off_policy_steps, so at most max(keep_last, max_off_policy_steps + 1)
  complete steps remain, plus the one being published.

Rollouts (`rollouts/step_N`), deleted by the trainer after each step (`release_rollouts`): once
  checkpoint K is complete, batches < K are trained and covered by it. A resume rewinds to a complete
  checkpoint J (K or an older one) and the orchestrator regenerates batches >= J, so no batch < K is
  read again. The newest complete checkpoint <= the trained steps decides, so an incomplete one frees
  nothing. Without periodic checkpoints (interval 0) a restart begins at step 0 (or at a preemption
  checkpoint) and regenerates every batch, so each batch goes as soon as it is trained.

Checkpoints (`checkpoints/step_N`), by the trainer after sealing one (`prune_checkpoints`): all but
  the `checkpoint.keep_last` newest complete ones; never the newest complete one nor anything newer.

Staging leftovers of killed writers (hidden `*.tmp`), swept by the only writer of each folder at its
  start (`sweep_trainer_staging`, `sweep_orchestrator_staging`) and by the rewind before a resumed
  attempt starts (`sweep_for_rewind`, which also drops the serving record of the previous attempt).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from rlctl.orchestrator.exchange.checkpoints import (ORCHESTRATOR, TRAINER, all_steps, complete_checkpoints,
                                                     remove_checkpoint, step_entries, step_path)
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.steps import STAGING_SUFFIX, complete_steps, sweep_staging

SERVING_KIND, SERVING_ID = "weights", "serving"  # services/weights/serving.json


def _attempt() -> str:
    return os.environ.get("RLCTL_ATTEMPT", "")


def serving_path(run: RunDir) -> Path:
    return run.services / SERVING_KIND / f"{SERVING_ID}.json"


# ---- weights ----------------------------------------------------------------------------------


def record_serving(run: RunDir, version: int) -> None:
    """The weight watcher: every server serves `version` (completely loaded) or newer is being loaded."""
    run.announce(SERVING_KIND, SERVING_ID, {"served": int(version), "attempt": _attempt(), "time": time.time()})


def served_floor(run: RunDir) -> int | None:
    """The version this attempt's servers serve, or None when no watcher of this attempt recorded one."""
    try:
        record = json.loads(serving_path(run).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("attempt") != _attempt():
        return None  # a previous attempt's record says nothing about this attempt's servers
    served = record.get("served")
    return served if isinstance(served, int) and not isinstance(served, bool) else None


def weights_in_use(run: RunDir) -> set[int]:
    """Complete steps a server may still be loading. Reads the record first, then lists (see above)."""
    floor = served_floor(run)
    steps = complete_steps(run.weights)
    return {s for s in steps if floor is None or s > floor}


def retain_weights(run: RunDir, store, keep_last: int) -> list[int]:
    """Delete published weights nobody needs any more; returns the deleted steps. `store` is the
    run's WeightStore (its `retain` deletes, marker first)."""
    return store.retain(keep_last, weights_in_use(run))


# ---- rollouts and checkpoints ------------------------------------------------------------------


def release_rollouts(run: RunDir, reader, trained: int, checkpoint_interval: int) -> list[int]:
    """Batches < `trained` are trained: delete those no resume will read; returns them. `reader` is
    the run's BatchReader."""
    if not checkpoint_interval:
        return reader.release(trained)
    covered = [s for s in complete_checkpoints(run.checkpoints) if s <= trained]
    return reader.release(covered[-1]) if covered else []


def prune_checkpoints(checkpoints: Path, keep_last: int) -> list[int]:
    """Delete step directories older than the `keep_last` newest complete ones; returns deleted steps.

    The newest complete checkpoint is always kept (keep_last < 1 counts as 1), and nothing newer than
    the oldest kept one is touched (a checkpoint in progress stays). Every part's marker goes before
    any file (`remove_checkpoint`), so no reader takes a half-deleted step for complete.
    """
    complete = complete_checkpoints(checkpoints)
    if not complete:
        return []
    oldest_kept = complete[-max(keep_last, 1):][0]
    deleted = [s for s in all_steps(checkpoints) if s < oldest_kept]
    for step in deleted:
        remove_checkpoint(step_path(checkpoints, step))
    return deleted


# ---- staging leftovers -------------------------------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sweep_parts(checkpoints: Path, part: str | None) -> list[str]:
    """Staging leftovers inside `checkpoints/step_*/`: of one component's part, or of all (None)."""
    swept = []
    for step in all_steps(checkpoints):
        folder = step_path(checkpoints, step)
        for child in step_entries(folder):
            name = child.name
            if not (name.startswith(".") and name.endswith(STAGING_SUFFIX)):
                continue
            if part is None or name == f".{part}{STAGING_SUFFIX}" or name.startswith(f".{part}."):
                _remove(child)
                swept.append(f"{folder.name}/{name}")
    return swept


def sweep_trainer_staging(run: RunDir) -> list[str]:
    """At trainer start (rank 0, before any write): staged weights and staged trainer checkpoint parts.
    The orchestrator's staged parts are left alone: it may be writing one right now."""
    return [f"weights/{n}" for n in sweep_staging(run.weights)] + _sweep_parts(run.checkpoints, TRAINER)


def sweep_orchestrator_staging(run: RunDir) -> list[str]:
    """At orchestrator start, before its first batch: staged rollout batches and progress parts."""
    return [f"rollouts/{n}" for n in sweep_staging(run.rollouts)] + _sweep_parts(run.checkpoints, ORCHESTRATOR)


def sweep_for_rewind(run: RunDir) -> list[str]:
    """On rewind, while no component runs: every staging leftover (any hidden entry of checkpoints/,
    e.g. an interrupted import) and the previous attempt's serving record."""
    swept = [f"weights/{n}" for n in sweep_staging(run.weights)]
    swept += [f"rollouts/{n}" for n in sweep_staging(run.rollouts)]
    for child in run.checkpoints.iterdir() if run.checkpoints.is_dir() else ():
        if child.name.startswith("."):
            _remove(child)
            swept.append(child.name)
    swept += _sweep_parts(run.checkpoints, None)
    if serving_path(run).exists():
        serving_path(run).unlink(missing_ok=True)
        swept.append(f"services/{SERVING_KIND}/{SERVING_ID}.json")
    return swept
