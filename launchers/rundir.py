"""The run directory on the shared filesystem — the one place every component meets.

Layout (documented in the README):
    <root>/<run>/
      run.json                      manifest (name, job ids, attempt, resolved recipe, plan summary, ...)
      configs/recipe.json           the resolved recipe every component reads
      configs/recipe.toml           the same, as TOML, for humans and `rlctl resume`
      secrets/admin_token           per-run token for inference admin routes (mode 0600; never logged)
      services/<kind>/<id>.json     endpoints components announce once ready (e.g. inference servers)
      logs/attempt_N/<group>/<component>.log, logs/latest -> attempt_N
      checkpoints/step_N/           complete only when its marker file exists
      weights/step_N/               published policy weights (safetensors, HF names) + marker
      rollouts/step_N/              training batches written by the orchestrator
      metrics.jsonl                 one JSON record per component step
      model/                        the built tiny model (CPU recipes only)

Component entry points (`python -m rlctl.<component> --run-dir DIR`) read everything they need from
here plus the process environment set by the launcher (see `launchers/env.py`).
"""
from __future__ import annotations

import json
import os
import secrets as _secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MARKER = "COMPLETE"  # written last into a step directory; readers ignore directories without it


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write to a temp file in the same directory, fsync, then rename: readers see old or new, never partial."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=str) + "\n").encode(), mode)


def append_jsonl(path: Path, record: dict) -> None:
    """Append one line with a single write (O_APPEND keeps concurrent writers' lines whole)."""
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


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


def remove_steps(parent: Path, keep: Callable[[int], bool]) -> list[int]:
    """Delete the step directories under `parent` whose step fails `keep`; returns them ascending.
    The marker goes first, so no reader picks a step up while its files are deleted."""
    removed = []
    for child in parent.iterdir() if parent.is_dir() else ():
        step = parse_step(child.name)
        if step is not None and not keep(step):
            (child / MARKER).unlink(missing_ok=True)
            shutil.rmtree(child, ignore_errors=True)
            removed.append(step)
    return sorted(removed)


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "run.json"

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    @property
    def recipe_json(self) -> Path:
        return self.configs / "recipe.json"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def services(self) -> Path:
        return self.root / "services"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def model(self) -> Path:
        return self.root / "model"

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"attempt_{attempt}"

    def log_path(self, attempt: int, group: str, component: str) -> Path:
        return self.attempt_logs(attempt) / group / f"{component}.log"

    def create(self) -> None:
        """Create the layout; owner-writable only, since submitit pickles in here execute code."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        os.chmod(self.root, 0o755)
        for sub in (self.configs, self.logs, self.checkpoints, self.weights, self.rollouts, self.services):
            sub.mkdir(exist_ok=True, mode=0o755)
        self.secrets.mkdir(exist_ok=True, mode=0o700)
        os.chmod(self.secrets, 0o700)

    def admin_token(self, create: bool = False) -> str:
        """The per-run admin token (created once, mode 0600)."""
        path = self.secrets / "admin_token"
        if not path.exists():
            if not create:
                raise FileNotFoundError(f"no admin token in {self.secrets}")
            self.secrets.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write_bytes(path, _secrets.token_urlsafe(32).encode(), mode=0o600)
        return path.read_text().strip()

    def read_manifest(self) -> dict:
        return json.loads(self.manifest.read_text())

    def load_recipe(self):
        from rlctl.recipes.load import validate

        return validate(json.loads(self.recipe_json.read_text()))

    def announce(self, kind: str, ident: str, info: dict) -> None:
        atomic_write_json(self.services / kind / f"{ident}.json", info)

    def announced(self, kind: str) -> list[dict]:
        folder = self.services / kind
        if not folder.is_dir():
            return []
        return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
