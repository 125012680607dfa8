"""The launch flow: recipe → placement → job groups → run directory → a het job on Slurm (or the
local supervisor). Shared by `rlctl launch` and `rlctl resume`."""
from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.launchers.groups import JobGroup, build_groups
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_bytes, atomic_write_json
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


def output_root(recipe, profile) -> Path:
    return Path(recipe.deployment.output_dir or profile.shared_fs or "runs").expanduser().absolute()


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
    from rlctl.launchers.cluster import load_profile
    from rlctl.recipes.load import compose, validate
    from rlctl.recipes.plan import compute_placement

    raw = compose(refs, overrides)
    if cluster:
        raw.setdefault("cluster", {})["profile"] = cluster
    recipe = validate(raw)
    profile = load_profile(recipe.cluster.profile)
    placement = compute_placement(recipe, profile)
    if profile.scheduler == "slurm" and placement.orchestrator == "cpu_partition" and not profile.partitions.cpu:
        raise RecipeError("orchestrator_placement is 'cpu_partition' but the profile has no cpu partition",
                          key="deployment.orchestrator_placement")
    return recipe, profile, placement, build_groups(recipe, profile, placement)


def _pick_run_dir(root: Path, recipe_name: str, name: str | None, resume: bool) -> tuple[Path, int]:
    """(run dir, attempt). An explicit existing name needs resume intent; auto names never collide."""
    if name:
        if "/" in name or name.startswith("."):
            raise RecipeError(f"invalid run name {name!r}: no '/' and no leading '.'", key="--name")
        path = root / name
        if (path / "run.json").exists():
            if not resume:
                raise RecipeError(f"run directory {path} already exists (pass --resume to start a new attempt in it)")
            return path, int(RunDir(path).read_manifest().get("attempt", 0)) + 1
        if path.exists() and any(path.iterdir()):
            raise RecipeError(f"{path} exists and is not a run directory")
        return path, 0
    if resume:
        raise RecipeError("--resume needs the run name (--name) of the run to continue")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / f"{recipe_name}-{stamp}", 1
    while path.exists():
        n += 1
        path = root / f"{recipe_name}-{stamp}-{n}"
    return path, 0


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
            "requeue": {"max_restarts": dep.max_restarts, "signal_s": dep.preempt_signal_s}}


def launch(refs, overrides=(), *, cluster: str | None = None, name: str | None = None,
           dry_run: bool = False, resume: bool = False, run_dir: Path | None = None,
           extra_env: dict | None = None) -> LaunchResult:
    """`run_dir` continues that existing run (next attempt, used by `rlctl resume`); `extra_env` is
    added to every task's environment (e.g. RLCTL_RESUME_STEP)."""
    recipe, profile, placement, groups = load_for_launch(refs, overrides, cluster)
    if profile.scheduler == "slurm" and not dry_run and shutil.which("sbatch") is None:
        raise RecipeError(f"profile {profile.name!r} submits to Slurm but sbatch is not on PATH "
                          "(use --cluster local to run on this machine)", key="cluster.profile")
    if run_dir is not None:
        root_dir = Path(run_dir)
        attempt = int(RunDir(root_dir).read_manifest().get("attempt", 0)) + 1
    else:
        root_dir, attempt = _pick_run_dir(output_root(recipe, profile), recipe.name, name, resume)
    run = RunDir(root_dir)
    previous = run.read_manifest() if attempt else None
    run.create()
    run.admin_token(create=True)
    run.api_key(create=True)  # the only key sent through the router (opens /v1 on the servers)
    _write_configs(run, recipe, placement, groups)
    _link_latest_logs(run, attempt)
    run_name = run.root.name
    result = LaunchResult(run, run_name, profile.scheduler, attempt, groups, dry_run=dry_run)
    info = manifest(run, run_name, profile.scheduler, attempt, recipe, placement, groups, refs, previous=previous)
    if profile.scheduler == "slurm":
        script = run.root / "sbatch" / f"attempt_{attempt}.sh"
        folder = run.root / "submitit" / f"attempt_{attempt}"
        options = _het_script_options(run, run_name, attempt, recipe, extra_env)
        if dry_run:  # rendered without the executor: it would create the submitit folder
            from rlctl.launchers.hetjob import render_het_script, shlex_python

            atomic_write_bytes(script, render_het_script(groups, folder, shlex_python(), **options).encode())
            result.script = script
            atomic_write_json(run.manifest, info)
            return result
        _maybe_build_model(run, recipe)
        from rlctl.launchers.env import ComponentTask
        from rlctl.launchers.hetjob import HetSlurmExecutor

        executor = HetSlurmExecutor(folder, groups, **options)
        atomic_write_bytes(script, executor.script_text().encode())
        from submitit.core.utils import FailedJobError

        import contextlib
        import io

        try:  # submitit echoes sbatch's stderr on failure; the error below says it in one line
            with contextlib.redirect_stderr(io.StringIO()):
                job = executor.submit_groups({g.name: ComponentTask(g, str(run.root), attempt) for g in groups})
        except FailedJobError as e:
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            info["submit_error"] = "\n".join(lines)
            atomic_write_json(run.manifest, info)
            first = lines[0].removeprefix("sbatch: error: ") if lines else str(e)
            raise RecipeError(f"sbatch refused the job: {first} (script: {script})") from None
        result.job_id, result.script = job.job_id, script
        info["job_id"] = job.job_id
    else:
        if dry_run:
            atomic_write_json(run.manifest, info)
            return result
        _maybe_build_model(run, recipe)
        from rlctl.launchers.local import start_supervisor

        result.supervisor_pid = start_supervisor(run, attempt, extra_env)
        info["supervisor_pid"] = result.supervisor_pid
    info["attempts"].append({"attempt": attempt, "job_id": result.job_id, "submit_time": info["submit_time"]})
    atomic_write_json(run.manifest, info)
    return result


def _maybe_build_model(run: RunDir, recipe) -> None:
    if recipe.model.name == "tiny-qwen3":
        from rlctl.trainer.tiny_model import build_tiny_model

        build_tiny_model(run.model, seed=recipe.model.build_seed)


def resolve_run(ref: str) -> RunDir:
    """A run directory path, or a run name under $RLCTL_OUTPUT_DIR (default ./runs)."""
    candidates = [Path(ref).expanduser(), Path(os.environ.get("RLCTL_OUTPUT_DIR", "runs")) / ref]
    for path in candidates:
        if (path / "run.json").is_file():
            return RunDir(path.absolute())
    raise RecipeError(f"no run directory {ref!r} (looked for run.json in: {', '.join(str(c) for c in candidates)})")
