"""The launch flow: recipe → placement → job groups → run directory → a het job on Slurm (or the
local supervisor). Shared by `rlctl launch` and `rlctl resume`."""
from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rlctl.launchers.groups import JobGroup, build_groups, check_group_time_limits, check_preempt_signal
from rlctl.launchers.run_dirs import check_run_name, claim_run_dir, first_attempt
from rlctl.launchers.output_root import output_root, output_root_and_origin
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_bytes, atomic_write_json, private_dir
from rlctl.recipes.errors import RecipeError


@dataclass
class LaunchResult:
    run: RunDir
    name: str
    scheduler: str
    attempt: int
    groups: list[JobGroup]
    job_id: str | None = None
    script: Path | None = None
    dry_run: bool = False
    supervisor_pid: int | None = None
    extra: dict = field(default_factory=dict)


def _drop_none(obj):
    """TOML has no null: leave unset optional keys out."""
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj if v is not None]
    return obj


def _git_commit(paths: list[Path]) -> str | None:
    for p in paths:
        try:
            out = subprocess.run(["git", "-C", str(p.parent), "rev-parse", "HEAD"], capture_output=True,
                                 text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0:
            return out.stdout.strip()
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlctl")
    except PackageNotFoundError:
        return "unknown"


def load_for_launch(refs, overrides=(), cluster: str | None = None):
    """Resolved recipe, its cluster profile, placement and job groups (raises RecipeError on bad input)."""
    from rlctl.recipes.clusters import load_profile
    from rlctl.recipes.load import compose, validate
    from rlctl.recipes.plan import compute_placement

    raw = compose(refs, overrides)
    if cluster:
        raw.setdefault("cluster", {})["profile"] = cluster
    recipe = validate(raw)
    profile = load_profile(recipe.cluster.profile)
    # Components run in the run dir, not here: a model directory given relative to here must travel absolute.
    local_model = Path(recipe.model.name).expanduser()
    if not local_model.is_absolute() and local_model.exists():
        recipe.model.name = str(local_model.resolve())
    from rlctl.recipes.input_checks import check_inputs

    check_inputs(recipe)  # dataset, environment and reward code, LoRA limits: exit 2, as `rlctl plan`
    pool = None
    if recipe.deployment.inference_pool:  # `auto` nodes are sized against the pool's servers, as `rlctl plan` does
        from rlctl.launchers.pool_lookup import pool_for_plan

        pool = pool_for_plan(recipe, output_root(recipe, profile), strict=True)  # a pool that cannot serve it: exit 2
    placement = compute_placement(recipe, profile, pool=pool)
    if profile.scheduler == "slurm" and placement.orchestrator == "cpu_partition" and not profile.partitions.cpu:
        raise RecipeError("orchestrator_placement is 'cpu_partition' but the profile has no cpu partition",
                          key="deployment.orchestrator_placement")
    groups = build_groups(recipe, profile, placement)
    if profile.scheduler == "slurm":
        check_preempt_signal(recipe.deployment.preempt_signal_s, groups)  # the batch script's USR2
    if recipe.deployment.inference_pool:  # served by a shared pool: the job holds no servers
        from rlctl.launchers.attach import attached_groups

        groups = attached_groups(groups, profile.partitions.cpu)
    if profile.scheduler == "slurm":
        check_group_time_limits(recipe.deployment.preempt_signal_s, groups)
    return recipe, profile, placement, groups


def _write_configs(run: RunDir, recipe, placement, groups: list[JobGroup]) -> None:
    import json

    import tomli_w

    data = recipe.model_dump(mode="json")
    atomic_write_bytes(run.recipe_json, (json.dumps(data, indent=2) + "\n").encode())
    atomic_write_bytes(run.configs / "recipe.toml", tomli_w.dumps(_drop_none(data)).encode())
    atomic_write_json(run.configs / "placement.json", placement.to_dict())
    atomic_write_json(run.configs / "groups.json", [g.to_dict() for g in groups])


def _link_latest_logs(run: RunDir, attempt: int) -> None:
    run.attempt_logs(attempt).mkdir(parents=True, exist_ok=True)
    tmp = run.logs / f".latest.{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(f"attempt_{attempt}")
    os.replace(tmp, run.logs / "latest")


def manifest(run: RunDir, name: str, scheduler: str, attempt: int, recipe, placement, groups,
             refs, job_id: str | None = None, previous: dict | None = None) -> dict:
    history = list((previous or {}).get("attempts", []))
    return {
        "name": name, "run_dir": str(run.root), "scheduler": scheduler, "job_id": job_id,
        "attempt": attempt, "attempts": history,
        "groups": [g.manifest_entry() for g in groups],
        "recipe": recipe.model_dump(mode="json"),
        "plan": {"trainer_nodes": placement.trainer_nodes, "inference_nodes": placement.inference_nodes,
                 "trainer_world_size": placement.trainer_world_size,
                 "inference_servers": placement.inference_servers, "orchestrator": placement.orchestrator,
                 "trainer_degrees": placement.trainer_degrees,
                 "cluster": recipe.cluster.profile},
        "placement": placement.to_dict(),
        "rlctl_version": _version(),
        "git_commit": _git_commit([Path(r) for r in refs if Path(r).is_file()]),
        "submit_time": time.time(), "host": socket.gethostname(), "user": getpass.getuser(),
    }


def _het_script_options(run: RunDir, name: str, attempt: int, recipe, extra_env: dict | None) -> dict:
    """What the het script of this attempt is rendered from, besides groups, folder and python
    (the same for a dry run and a real submission)."""
    dep = recipe.deployment
    return {"job_name": f"rlctl-{name}", "batch_log": run.attempt_logs(attempt) / "slurm-%j.out",
            "grace_period_s": dep.grace_period_s,
            "env": {"RLCTL_RUN_DIR": str(run.root), "RLCTL_ATTEMPT": str(attempt), **(extra_env or {})},
            "requeue": {"max_restarts": dep.max_restarts, "signal_s": dep.preempt_signal_s,
                        "timeout_s": dep.preempt_timeout_s}}


class RunExists(RecipeError):
    """`--name` names an existing run (`rlctl launch --resume` continues it through `rlctl resume`)."""

    def __init__(self, run: RunDir):
        self.run = run
        super().__init__(f"run directory {run.root} already exists (pass --resume to start a new attempt in it)",
                         key="--name")


def launch(refs, overrides=(), *, cluster: str | None = None, name: str | None = None,
           dry_run: bool = False) -> LaunchResult:
    """A new run in a directory of its own (created exclusively, under its lock while it starts).
    Raises RunExists when `name` is an existing run."""
    if name is not None:
        check_run_name(name)
    loaded = load_for_launch(refs, overrides, cluster)
    recipe, profile = loaded[0], loaded[1]
    check_submitter(profile, dry_run)
    root, origin = output_root_and_origin(recipe, profile)
    run = claim_run_dir(root, recipe.name, name, origin)
    if run is None:
        existing = RunDir(root / name)
        if not existing.manifest.is_file():
            raise RecipeError(f"{existing.root} exists but holds no run.json "
                              "(another launch is creating it, or it is not a run directory)", key="--name")
        raise RunExists(existing)
    with first_attempt(run, f"rlctl launch --name {run.root.name}"):
        return start_attempt(run, loaded, refs, 0, dry_run=dry_run)


@contextlib.contextmanager
def deferred_interrupts():
    """SIGINT/SIGTERM arriving inside take effect at its end: between starting a job or supervisor and
    recording it in run.json, an interrupt left a run nothing could see or cancel. (Handlers, not a
    blocked signal mask: children inherit a mask across exec, and a supervisor deaf to SIGTERM could
    not be cancelled.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held:
            os.kill(os.getpid(), held[0])  # delivered again, now to the handlers the caller had


def check_submitter(profile, dry_run: bool) -> None:
    if profile.scheduler == "slurm" and not dry_run and shutil.which("sbatch") is None:
        raise RecipeError(f"profile {profile.name!r} submits to Slurm but sbatch is not on PATH "
                          "(use --cluster local to run on this machine)", key="cluster.profile")


def start_attempt(run: RunDir, loaded, refs, attempt: int, *, dry_run: bool = False,
                  extra_env: dict | None = None, prepare: Callable[[], None] | None = None,
                  previous: dict | None = None, history: dict | None = None) -> LaunchResult:
    """Start attempt `attempt` of `run` (the caller holds its lock). `prepare` (a resume's rewind) runs
    only once the attempt is sure to start: on Slurm after a held submission, which is released after
    it; locally right before the supervisor is spawned. A refused submission changes nothing of an
    earlier attempt. `extra_env` reaches every task; `history` goes into this attempt's record."""
    from rlctl.launchers.env import absolute_pythonpath

    recipe, profile, placement, groups = loaded
    extra_env = {**absolute_pythonpath(), **(extra_env or {})}  # relative entries meant here, not the run dir
    name = run.root.name
    result = LaunchResult(run, name, profile.scheduler, attempt, groups, dry_run=dry_run)
    result.extra["trainer_degrees"] = placement.trainer_degrees  # the plan's, the trainer builds its mesh from them
    if dry_run and previous is not None:
        # a dry run of a resume is checked (recipe, placement, step) and shown, and leaves the run as it
        # was: writing its configs and manifest would make an attempt that never ran the run's latest
        return result
    run.create()
    run.admin_token(create=True)
    run.api_key(create=True)  # the only key sent through the router (opens /v1 on the servers)
    private_dir(run.attempt_logs(attempt))
    info = manifest(run, name, profile.scheduler, attempt, recipe, placement, groups, refs, previous=previous)

    def commit(rewind: bool = True) -> None:  # from here on the run is the new attempt's
        if rewind and prepare is not None:
            prepare()
        _write_configs(run, recipe, placement, groups)
        _link_latest_logs(run, attempt)
        for stale in (run.services, run.heartbeats): shutil.rmtree(stale, ignore_errors=True)  # per attempt  # noqa: E701

    if dry_run:
        commit(rewind=False)
        if profile.scheduler == "slurm":  # rendered without the executor: it would create the submitit folder
            from rlctl.launchers.het_script import render_het_script, shlex_python

            result.script = run.sbatch_script(attempt)
            folder = run.root / "submitit" / f"attempt_{attempt}"
            atomic_write_bytes(result.script, render_het_script(
                groups, folder, shlex_python(), **_het_script_options(run, name, attempt, recipe, extra_env)).encode())
        atomic_write_json(run.manifest, {**info, "dry_run": True})  # `manifest` starts a real attempt without it
        return result
    _maybe_build_model(run, recipe)
    held = profile.scheduler == "slurm" and prepare is not None
    with deferred_interrupts():  # from the submission or spawn until run.json records it (and a held job is released)
        if profile.scheduler == "slurm":
            if not held:
                commit()
            result.job_id, result.script = _submit(run, attempt, recipe, groups, extra_env, held, previous)
            info["job_id"] = result.job_id
            if held:
                try:
                    commit()
                except BaseException:
                    _slurm(["scancel", result.job_id])
                    raise
        else:
            commit()
            from rlctl.launchers.local import start_supervisor

            result.supervisor_pid = start_supervisor(run, attempt, extra_env)
            info["supervisor_pid"] = result.supervisor_pid
        info["attempts"].append({"attempt": attempt, "job_id": result.job_id, "submit_time": info["submit_time"],
                                 **(history or {})})
        atomic_write_json(run.manifest, info)
        if held:
            released = _slurm(["scontrol", "release", result.job_id])
            if released:
                raise RecipeError(f"job {result.job_id} was submitted held and could not be released ({released}); "
                                  f"release it with `scontrol release {result.job_id}`")
    return result


def _submit(run: RunDir, attempt: int, recipe, groups, extra_env, hold: bool,
            previous: dict | None) -> tuple[str, Path]:
    """Submit the het job of this attempt; (job id, script). On a refusal the run keeps the manifest
    of its previous attempt (plus the error), so it still reads as that attempt; a new run gets none,
    so `launch` removes its directory (nothing ran: the name is free for the corrected launch)."""
    import io

    from submitit.core.utils import FailedJobError

    from rlctl.launchers.env import ComponentTask
    from rlctl.launchers.hetjob import HetSlurmExecutor

    name, script = run.root.name, run.sbatch_script(attempt)
    folder = run.root / "submitit" / f"attempt_{attempt}"
    executor = HetSlurmExecutor(folder, groups, hold=hold, **_het_script_options(run, name, attempt, recipe, extra_env))
    atomic_write_bytes(script, executor.script_text().encode())
    try:  # submitit echoes sbatch's stderr on failure; the error below says it in one line
        with contextlib.redirect_stderr(io.StringIO()):
            job = executor.submit_groups({g.name: ComponentTask(g, str(run.root), attempt) for g in groups})
    except FailedJobError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        first = lines[0].removeprefix("sbatch: error: ") if lines else str(e)
        if previous is None:
            raise RecipeError(f"sbatch refused the job: {first} (`--dry-run` writes the script it was given)") from None
        atomic_write_json(run.manifest, {**previous, "submit_error": "\n".join(lines)})
        raise RecipeError(f"sbatch refused the job: {first} (script: {script})") from None
    return job.job_id, script


def _slurm(cmd: list[str]) -> str:
    """Run a Slurm command outside any enclosing job's environment; "" on success, else why not."""
    from rlctl.launchers.het_script import strip_slurm_env

    env = {k: v for k, v in os.environ.items() if k not in strip_slurm_env(dict(os.environ))}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return "" if out.returncode == 0 else (out.stderr.strip() or f"exit code {out.returncode}")


def _maybe_build_model(run: RunDir, recipe) -> None:
    from rlctl.trainer.tiny_model import build_tiny_model, is_tiny_model

    if is_tiny_model(recipe.model.name):
        from rlctl.inference.processes import PRIVATE_UMASK
        from rlctl.inference.caches import user_cache_dir

        umask = os.umask(PRIVATE_UMASK)  # the run's files are the owner's only, as everything else in it
        try:
            build_tiny_model(run.model, seed=recipe.model.build_seed, name=recipe.model.name,
                             cache_dir=user_cache_dir("tiny-models", "RLCTL_TINY_MODEL_CACHE"))
        finally:
            os.umask(umask)
