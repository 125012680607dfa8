"""Resume a run in place: `rlctl resume` (a new attempt, same launcher) and requeued Slurm jobs.

Rewinding to checkpoint step K (the state after K trained steps; the next batch is K) makes the run
directory look as if the run had just saved K:
  * rollouts/step_N for N >= K are removed (the orchestrator regenerates batch K onwards),
  * weights/step_N for N > K are removed (the trainer republishes step_K if missing; the
    orchestrator's weight watcher applies the newest published step to the fresh servers at start),
  * checkpoints/step_N for N > K are removed (an abandoned future, or torn ones),
  * metrics.jsonl keeps only lines of steps < K (rewritten atomically), so after the resumed attempt
    the step numbers are contiguous — no lost and no duplicated step,
  * DONE and PREEMPT are removed.
Without any complete checkpoint the run restarts from step 0 (K = 0, weights/step_0 kept).
"""
from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.orchestrator.exchange.checkpoints import complete_checkpoints, is_complete, newest_complete, remove_checkpoint
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json, fsync_path
from rlctl.orchestrator.exchange.lock import RunLocked
from rlctl.orchestrator.exchange.metrics import keep_before
from rlctl.orchestrator.exchange.retention import sweep_for_rewind
from rlctl.orchestrator.exchange.steps import parse_step, remove_steps, stage_dir
from rlctl.recipes.errors import RecipeError

ACTIVE = ("pending", "running")
REQUEUE_LOCK_WAIT_S = 120.0  # a requeued job waits this long for another holder (e.g. `rlctl cancel`)


@dataclass
class Rewind:
    step: int
    from_checkpoint: bool
    """False: no complete checkpoint, the run restarts from step 0."""
    removed: dict[str, list[int]] = field(default_factory=dict)
    metrics_dropped: int = 0
    source: str | None = None

    def describe(self) -> str:
        head = (f"resuming from checkpoint step_{self.step}" if self.from_checkpoint
                else "no complete checkpoint: restarting from step 0")
        if self.source:
            head += f" (imported from {self.source})"
        gone = [f"{kind} {steps}" for kind, steps in self.removed.items() if steps]
        tail = f"; removed {', '.join(gone)}" if gone else ""
        return head + tail + (f"; dropped {self.metrics_dropped} metrics lines of steps >= {self.step}"
                              if self.metrics_dropped else "")

    def to_dict(self) -> dict:
        return {"step": self.step, "from_checkpoint": self.from_checkpoint, "removed": self.removed,
                "metrics_dropped": self.metrics_dropped, "source": self.source}


def choose_step(run: RunDir, step: int | None) -> tuple[int, bool]:
    """(step, from_checkpoint): `step` if it is complete, else the newest complete one, else 0."""
    if step is not None:
        if not is_complete(run.checkpoints, step):
            have = complete_checkpoints(run.checkpoints)
            raise RecipeError(f"checkpoint step_{step} of {run.root} is not complete "
                              f"(complete: {', '.join(map(str, have)) or 'none'})", key="--step")
        return step, True
    newest = newest_complete(run.checkpoints)
    return (newest, True) if newest is not None else (0, False)


def check_private_source(source: Path) -> None:
    """`--from` loads what it copies into this run: refuse anything another user owns or could have
    altered (owned by someone else, or writable by group/others), incl. the run and checkpoints dirs."""
    me = os.getuid()
    run_root = source.parent.parent
    paths = [run_root, source.parent, run_root / "metrics", *sorted((run_root / "metrics").glob("*.jsonl"))]
    for folder, dirs, files in os.walk(source):
        paths += [Path(folder)] + [Path(folder) / n for n in dirs + files]
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise RecipeError(f"{path} is a symbolic link; refusing to import it", key="--from")
        if st.st_uid != me:
            raise RecipeError(f"{path} belongs to another user (uid {st.st_uid}); refusing to import it", key="--from")
        if st.st_mode & 0o022:
            raise RecipeError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              "refusing to import it", key="--from")


def stage_import(run: RunDir, source: Path) -> tuple[int, RunDir, Path | None]:
    """Check `OTHER_RUN/checkpoints/step_N` and copy it under a hidden staging name in this run
    (nothing of the run changes); returns N, the source run and the staged copy (None when the source
    already is this run's own step N). `install_import` makes the copy visible."""
    source = Path(source).expanduser().absolute()
    step = parse_step(source.name)
    if step is None or source.parent.name != "checkpoints":
        raise RecipeError(f"{source} is not a checkpoint directory (expected RUN/checkpoints/step_N)", key="--from")
    if not is_complete(source.parent, step):
        raise RecipeError(f"{source} is not a complete checkpoint", key="--from")
    check_private_source(source)
    target = run.checkpoints / source.name
    if target.exists() and target.resolve() == source.resolve():
        return step, RunDir(source.parent.parent), None
    staged = stage_dir(run.checkpoints, source.name)
    try:
        shutil.copytree(source, staged, dirs_exist_ok=True)
        for folder, _, files in os.walk(staged):
            for name in files:
                fsync_path(Path(folder) / name)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return step, RunDir(source.parent.parent), staged


def install_import(run: RunDir, staged: Path, step: int) -> None:
    """Replace checkpoints/step_N by the staged copy: the old one's markers go first, then a rename."""
    target = run.checkpoints / f"step_{step}"
    if target.exists():
        remove_checkpoint(target)
    os.rename(staged, target)
    fsync_path(run.checkpoints)


def apply_rewind(run: RunDir, plan: Rewind, other_run: RunDir | None = None) -> Rewind:
    """Delete what lies after `plan.step` (see the module docstring) and fill in what was removed."""
    k = plan.step
    plan.removed["rollouts"] = remove_steps(run.rollouts, lambda s: s < k)
    plan.removed["weights"] = remove_steps(run.weights, lambda s: s <= k)
    plan.removed["checkpoints"] = remove_steps(run.checkpoints, lambda s: s <= k if plan.from_checkpoint else False)
    sweep_for_rewind(run)  # staging leftovers of killed writers; after install_import, which is one
    plan.metrics_dropped = keep_before(run, k, other_run)
    for marker in (run.done, run.preempt):
        marker.unlink(missing_ok=True)
    return plan


def rewind(run: RunDir, step: int | None = None, source: Path | None = None) -> Rewind:
    """Make `run` look as if it had just saved the chosen checkpoint, at once (the requeue path and
    tests; `resume` stages the same steps around the submission)."""
    other_run = None
    if source is not None:
        step, other_run, staged = stage_import(run, source)
        if staged is not None:
            install_import(run, staged, step)
    k, from_ckpt = choose_step(run, step)
    return apply_rewind(run, Rewind(k, from_ckpt, source=str(source) if source else None), other_run)


def check_saved_progress(recipe, checkpoints: Path, step: int) -> None:
    """What the orchestrator restores from checkpoint `step` fits the recipe now (a dataset that grew
    since failed the new attempt at start, after the rewind had pruned the later steps)."""
    from rlctl.orchestrator.dataset_environment import check_saved_state
    from rlctl.orchestrator.exchange.checkpoints import load_orchestrator_state

    try:
        state = load_orchestrator_state(checkpoints, step)
    except (OSError, ValueError, KeyError, TypeError):
        return  # unreadable: the orchestrator reports it when it starts, as before this check
    check_saved_state(recipe, (state or {}).get("environment"))


def refuse_if_active(run: RunDir) -> None:
    """Call with the run's lock held: then a run that names no job and no supervisor anywhere was
    never started (a dry run, or a refused submission) and is not active."""
    from rlctl.launchers.status import run_state

    info = run.read_manifest()
    if not info.get("job_id") and not info.get("supervisor_pid") and not (run.status / "supervisor.json").exists():
        return
    status = run_state(run.root)
    if status.state in ACTIVE:
        where = f"job {status.job_id}" if status.job_id else "its local supervisor"
        raise RecipeError(f"run {run.root.name} is still {status.state} ({where}); "
                          f"stop it first with `rlctl cancel {run.root}` or wait for it to end")
    if status.state == "unknown":
        raise RecipeError(f"cannot tell whether run {run.root.name} is still running ({status.reason}); "
                          "not resuming")


def refuse_if_finished(run: RunDir, previous: dict, max_steps: int) -> None:
    """A run that finished (DONE) is resumed only to train further (a larger `orchestrator.max_steps`)
    or from a checkpoint named with --step / --from: else the rewind would delete its final weights and
    train its last steps again for nothing."""
    if not run.done.exists():
        return
    trained = ((previous.get("recipe") or {}).get("orchestrator") or {}).get("max_steps")
    if isinstance(trained, int) and max_steps > trained:
        return
    raise RecipeError(f"run {run.root.name} already finished its {trained} steps ({run.done.name} exists): nothing to "
                      f"resume. To train further: `rlctl launch RECIPE --name {run.root.name} --resume -o "
                      "orchestrator.max_steps=N`; to train again from a checkpoint: `rlctl resume RUN --step K`")


def resume(run: RunDir, step: int | None = None, source: Path | None = None, *, refs=None, overrides=(),
           cluster: str | None = None, dry_run: bool = False, command: str | None = None):
    """The next attempt of `run`, under its lock: refuse an active run, validate everything (recipe,
    step, `--from` staged as a hidden copy), submit held (Slurm) or get ready to spawn (local), and only
    then rewind, release and record. A refusal anywhere before leaves the run as it was.
    `refs`/`overrides` replace the run's own recipe (`launch --resume`). Returns (LaunchResult, Rewind)."""
    from rlctl.launchers.launch import check_submitter, load_for_launch, start_attempt
    from rlctl.launchers.run_dirs import run_lock
    from rlctl.launchers.status import usable_run

    usable_run(run.root, run.root.name)  # before the lock: nothing is written into a directory that is not a run's
    from rlctl.launchers.pool import is_pool

    if is_pool(run.root):  # its advice ("launch RECIPE --name X --resume") would start a run, not the pool
        raise RecipeError(f"{run.root} is a shared pool, not a run: start it again with "
                          f"`rlctl pool launch RECIPE --name {run.root.name}`")
    with run_lock(run, command or f"rlctl resume {run.root.name}"):
        refuse_if_active(run)
        previous = run.read_manifest()
        refs = list(refs) if refs else [str(run.recipe_toml)]
        loaded = load_for_launch(refs, overrides, cluster)
        if step is None and source is None:
            refuse_if_finished(run, previous, loaded[0].orchestrator.max_steps)
        check_submitter(loaded[1], dry_run)
        staged = other_run = None
        try:
            if source is not None:
                step, other_run, staged = stage_import(run, source)
                plan = Rewind(step, True, source=str(source))
            else:
                plan = Rewind(*choose_step(run, step))
            if plan.from_checkpoint:
                check_saved_progress(loaded[0], (other_run or run).checkpoints, plan.step)

            def prepare() -> None:
                if staged is not None:
                    install_import(run, staged, plan.step)
                apply_rewind(run, plan, other_run)

            env = {"RLCTL_RESUME_STEP": str(plan.step) if plan.from_checkpoint else ""}
            result = start_attempt(run, loaded, refs, int(previous.get("attempt", 0)) + 1, dry_run=dry_run,
                                   extra_env=env, prepare=prepare, previous=previous,
                                   history={"resume_step": plan.step if plan.from_checkpoint else None})
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)  # gone already once installed
    return result, plan


class RunFinished(RuntimeError):
    """A requeued job of a run that has DONE (a late preemption or requeue): nothing to resume."""


def prepare_requeued(run: RunDir, attempt: int) -> Rewind:
    """In a requeued Slurm job's batch script: rewind to the newest complete checkpoint and record
    the attempt in run.json (the job id stays the same), under the run's lock. A finished run is left
    as it is (RunFinished): the rewind would delete its DONE and train again."""
    from rlctl.launchers.launch import _link_latest_logs
    from rlctl.launchers.run_dirs import run_lock

    job = os.environ.get("SLURM_JOB_ID", "?")
    with run_lock(run, f"requeue of Slurm job {job} as attempt {attempt}", wait_s=REQUEUE_LOCK_WAIT_S):
        if run.done.exists():
            raise RunFinished(f"run {run.root.name} already finished ({run.done.name} exists): not resuming")
        plan = rewind(run)
        manifest = run.read_manifest()
        manifest["attempt"] = attempt
        manifest.setdefault("attempts", []).append({
            "attempt": attempt, "job_id": manifest.get("job_id"), "requeued": True,
            "resume_step": plan.step if plan.from_checkpoint else None})
        atomic_write_json(run.manifest, manifest)
        _link_latest_logs(run, attempt)
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rewind a requeued run (called by the sbatch script)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--requeued", type=int, required=True, metavar="ATTEMPT")
    args = parser.parse_args(argv)
    try:
        plan = prepare_requeued(RunDir(Path(args.run_dir)), args.requeued)
    except RunLocked as e:
        print(f"[rlctl] not resuming: {e}", file=sys.stderr, flush=True)
        return 1
    except RunFinished as e:
        from rlctl.launchers.het_script import RUN_FINISHED_EXIT

        print(f"[rlctl] {e}", file=sys.stderr, flush=True)
        return RUN_FINISHED_EXIT
    print(f"[rlctl] {plan.describe()}", file=sys.stderr, flush=True)
    print(plan.step if plan.from_checkpoint else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
