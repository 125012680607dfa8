"""A run served by a shared inference pool (`deployment.inference_pool`): find the pool, attach, and
apply weight updates through it instead of through the run's own servers.

The pool is a run directory of its own beside the runs, `<output_root>/pools/<name>/`; its front
(`rlctl.inference.pool_service`) announces its URL in `services/pool/0.json` and takes the pool's api
key. The run's requests go to `<front>/runs/<run>` exactly as they would go to a router, and each
published step is posted to `<front>/runs/<run>/weights`: the front loads it (an adapter swap, or an
in-place reload when the run's weights are resident) and answers when requests sent from then on are
served by it — the moment the weight watcher may bump the policy version, as with the run's own servers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rlctl.orchestrator.exchange.layout import POOLS_DIR, RunDir

POOL_SERVICE = "pool"


class PoolUnavailable(RuntimeError):
    """The pool is not there, not ready, or refused the run (message: one line)."""


def pool_dir(run: RunDir, name: str) -> RunDir:
    """Pools live beside the runs of the same output root."""
    return RunDir(run.root.parent / POOLS_DIR / name)


def pool_endpoint(pool: RunDir) -> dict:
    """The front's announcement (url, mode, model, ...), or PoolUnavailable."""
    found = pool.announced(POOL_SERVICE)
    if not found:
        raise PoolUnavailable(f"pool {pool.root.name!r} has no front announced in {pool.services} "
                              "(not started, still starting, or stopped: see `rlctl pool list`)")
    return found[0]


@dataclass
class PoolSession:
    """One run's handle on the pool: its router URL, the pool's key, weight updates, detach."""

    front: str
    api_key: str
    run_name: str
    timeout_s: float = 600.0

    @property
    def url(self) -> str:
        return f"{self.front.rstrip('/')}/runs/{self.run_name}"

    def _post(self, route: str, body: dict | None = None) -> dict:
        try:
            resp = httpx.post(self.url + route, json=body or {}, timeout=self.timeout_s,
                              headers={"Authorization": f"Bearer {self.api_key}"})
        except httpx.HTTPError as exc:
            raise PoolUnavailable(f"pool front {self.front}: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            raise PoolUnavailable(f"pool front {self.url}{route}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def attach(self, run: RunDir) -> dict:
        return self._post("/attach", {"run_dir": str(run.root)})

    def detach(self) -> None:
        try:
            self._post("/detach")
        except PoolUnavailable:
            pass  # the pool is gone or restarted: nothing of this run is left in it

    async def reload(self, step_dir: Path) -> dict[str, Any]:
        """The weight watcher's reload: the pool loads `step_dir` for this run."""
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            try:
                resp = await http.post(self.url + "/weights", json={"step_dir": str(step_dir)},
                                       headers={"Authorization": f"Bearer {self.api_key}"})
            except httpx.HTTPError as exc:
                raise PoolUnavailable(f"pool front {self.front}: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            raise PoolUnavailable(f"pool could not load {step_dir}: HTTP {resp.status_code}: {resp.text[:300]}")
        return {**resp.json(), "pool_s": time.perf_counter() - start}


def pool_gone(run: RunDir, name: str, front: str, wait_s: float = 15.0) -> bool:
    """Whether the pool this run was attached to through `front` has ended (stopped or failed), so that
    a request or reload that failed against it is the pool's end, not the run's bug. A stopped
    front writes the pool's DONE; a killed one no longer answers. Asked for up to `wait_s`: a stop kills
    the servers (the run sees 502s) a moment before the front."""
    pool = pool_dir(run, name)
    deadline = time.monotonic() + wait_s
    while True:
        if pool.done.exists():
            return True
        try:
            httpx.get(f"{front.rstrip('/')}/health", timeout=2.0)
        except httpx.HTTPError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def open_session(run: RunDir, name: str) -> PoolSession:
    """Attach `run` to pool `name` (PoolUnavailable if it cannot)."""
    pool = pool_dir(run, name)
    endpoint = pool_endpoint(pool)
    try:
        key = pool.api_key()
    except (FileNotFoundError, PermissionError) as exc:
        raise PoolUnavailable(f"pool {name!r}: cannot read its api key ({exc})") from None
    session = PoolSession(endpoint["url"], key, run.root.name)
    session.attach(run)
    return session
