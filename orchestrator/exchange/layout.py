"""Where everything of a run lives: one class naming every path of the run directory.

    <root>/<run>/                   0700, every file 0600 (see files.py)
      run.json                      manifest (name, job ids, attempt, resolved recipe, plan summary, ...)
      LOCK                          held by launch / resume / requeue / cancel (see lock.py)
      configs/recipe.json           the resolved recipe every component reads
      configs/recipe.toml           the same, as TOML, for humans and `rlctl resume`
      secrets/admin_token           token for the inference servers' admin routes (never leaves the run)
      secrets/api_key               token for the OpenAI routes (/v1), the only one sent through the router
      services/<kind>/<id>.json     endpoints components announce once ready (cleared per attempt)
      status/<component>.json       local process records (pid, state, exit code)
      heartbeats/<component>.json   last progress of each component (see heartbeat.py)
      metrics/<writer>.jsonl        typed metric records, one file per writer (see metrics.py)
      monitoring/<backend>/         W&B (offline) / TensorBoard files fed from the metric records
      logs/attempt_N/<group>/<component>.log, logs/latest -> attempt_N
      sbatch/attempt_N.sh           the generated batch script of each Slurm attempt
      checkpoints/step_N/<part>/    complete only when every part has its marker (see checkpoints.py)
      weights/step_N/               published policy weights (safetensors, HF names) + marker
      rollouts/step_N/              training batches written by the orchestrator + marker
      model/                        the built tiny model (CPU recipes only)
      DONE                          written once by whoever finishes the run (the orchestrator)
      PREEMPT                       written by the batch script on a preemption / time-limit signal
"""
from __future__ import annotations

import json
import secrets as _secrets
from dataclasses import dataclass
from pathlib import Path

from rlctl.orchestrator.exchange.files import atomic_write_bytes, atomic_write_json, private_dir

ADMIN_TOKEN, API_KEY = "admin_token", "api_key"
POOLS_DIR = "pools"  # shared inference pools live in <output root>/pools/<name>, beside the runs


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    manifest = property(lambda self: self.root / "run.json")
    lock = property(lambda self: self.root / "LOCK")
    configs = property(lambda self: self.root / "configs")
    recipe_json = property(lambda self: self.root / "configs" / "recipe.json")
    recipe_toml = property(lambda self: self.root / "configs" / "recipe.toml")
    secrets = property(lambda self: self.root / "secrets")
    services = property(lambda self: self.root / "services")
    status = property(lambda self: self.root / "status")
    heartbeats = property(lambda self: self.root / "heartbeats")
    metrics = property(lambda self: self.root / "metrics")
    monitoring = property(lambda self: self.root / "monitoring")
    logs = property(lambda self: self.root / "logs")
    sbatch = property(lambda self: self.root / "sbatch")
    checkpoints = property(lambda self: self.root / "checkpoints")
    weights = property(lambda self: self.root / "weights")
    rollouts = property(lambda self: self.root / "rollouts")
    model = property(lambda self: self.root / "model")
    done = property(lambda self: self.root / "DONE")
    preempt = property(lambda self: self.root / "PREEMPT")

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"attempt_{attempt}"

    def log_path(self, attempt: int, group: str, component: str) -> Path:
        return self.attempt_logs(attempt) / group / f"{component}.log"

    def sbatch_script(self, attempt: int) -> Path:
        return self.sbatch / f"attempt_{attempt}.sh"

    def create(self) -> None:
        """Create the layout under an existing (exclusively created) root, owner-only throughout."""
        for sub in (self.configs, self.logs, self.checkpoints, self.weights, self.rollouts, self.services,
                    self.secrets, self.status, self.heartbeats, self.metrics):
            private_dir(sub)

    def _token(self, name: str, create: bool) -> str:
        path = self.secrets / name
        if not path.exists():
            if not create:
                raise FileNotFoundError(f"no {name.replace('_', ' ')} in {self.secrets}")
            atomic_write_bytes(path, _secrets.token_urlsafe(32).encode())
        return path.read_text().strip()

    def admin_token(self, create: bool = False) -> str:
        """The token of the inference servers' admin routes (reload, pause); never sent to the router."""
        return self._token(ADMIN_TOKEN, create)

    def api_key(self, create: bool = False) -> str:
        """The key of the OpenAI routes (/v1); the orchestrator sends it through the router."""
        return self._token(API_KEY, create)

    def read_manifest(self) -> dict:
        return json.loads(self.manifest.read_text())

    def recipe_data(self) -> dict:
        """The resolved recipe as plain data (validate it with `rlctl.recipes.load.validate`)."""
        return json.loads(self.recipe_json.read_text())

    def announce(self, kind: str, ident: str, info: dict) -> None:
        atomic_write_json(self.services / kind / f"{ident}.json", info)

    def announced(self, kind: str) -> list[dict]:
        folder = self.services / kind
        if not folder.is_dir():
            return []
        return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
