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
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.orchestrator.exchange.checkpoints import complete_checkpoints, is_complete, newest_complete
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.metrics import keep_before
from rlctl.orchestrator.exchange.steps import parse_step, remove_steps
from rlctl.recipes.errors import RecipeError

ACTIVE = ("pending", "running")


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


def import_checkpoint(run: RunDir, source: Path) -> tuple[int, RunDir]:
    """Copy `OTHER_RUN/checkpoints/step_N` into this run; returns N and the source run."""
    source = Path(source).expanduser().absolute()
    step = parse_step(source.name)
    if step is None or source.parent.name != "checkpoints":
        raise RecipeError(f"{source} is not a checkpoint directory (expected RUN/checkpoints/step_N)", key="--from")
    if not is_complete(source.parent, step):
        raise RecipeError(f"{source} is not a complete checkpoint", key="--from")
    target = run.checkpoints / source.name
    if target.resolve() != source.resolve():
        if target.exists():
            shutil.rmtree(target)
        staged = run.checkpoints / f".{source.name}.import"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(source, staged)
        staged.rename(target)
    return step, RunDir(source.parent.parent)


def rewind(run: RunDir, step: int | None = None, source: Path | None = None) -> Rewind:
    """Make `run` look as if it had just saved the chosen checkpoint (see the module docstring)."""
    other_run = None
    if source is not None:
        step, other_run = import_checkpoint(run, source)
    k, from_ckpt = choose_step(run, step)
    plan = Rewind(k, from_ckpt, source=str(source) if source else None)
    plan.removed["rollouts"] = remove_steps(run.rollouts, lambda s: s < k)
    plan.removed["weights"] = remove_steps(run.weights, lambda s: s <= k)
    plan.removed["checkpoints"] = remove_steps(run.checkpoints, lambda s: s <= k if from_ckpt else False)
    for leftover in run.checkpoints.glob(".*") if run.checkpoints.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    plan.metrics_dropped = keep_before(run, k, other_run)
    for marker in (run.done, run.preempt):
        marker.unlink(missing_ok=True)
    return plan


def refuse_if_active(run: RunDir) -> None:
    from rlctl.launchers.status import run_state

    status = run_state(run.root)
    if status.state in ACTIVE:
        where = f"job {status.job_id}" if status.job_id else "its local supervisor"
        raise RecipeError(f"run {run.root.name} is still {status.state} ({where}); "
                          f"stop it first with `rlctl cancel {run.root}` or wait for it to end")
    if status.state == "unknown":
        raise RecipeError(f"cannot tell whether run {run.root.name} is still running ({status.reason}); "
                          "not resuming")


def resume(run: RunDir, step: int | None = None, source: Path | None = None):
    """Rewind and start the next attempt with the same launcher. Returns (LaunchResult, Rewind)."""
    from rlctl.launchers.launch import launch

    refuse_if_active(run)
    plan = rewind(run, step, source)
    env = {"RLCTL_RESUME_STEP": str(plan.step)} if plan.from_checkpoint else {"RLCTL_RESUME_STEP": ""}
    result = launch([str(run.configs / "recipe.toml")], run_dir=run.root, extra_env=env)
    manifest = run.read_manifest()
    manifest["attempts"][-1]["resume_step"] = plan.step if plan.from_checkpoint else None
    atomic_write_json(run.manifest, manifest)
    return result, plan


def prepare_requeued(run: RunDir, attempt: int) -> Rewind:
    """In a requeued Slurm job's batch script: rewind to the newest complete checkpoint and record
    the attempt in run.json (the job id stays the same)."""
    from rlctl.launchers.launch import _link_latest_logs

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
    plan = prepare_requeued(RunDir(Path(args.run_dir)), args.requeued)
    print(f"[rlctl] {plan.describe()}", file=sys.stderr, flush=True)
    print(plan.step if plan.from_checkpoint else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
