"""Apply newly published weights to every inference server in flight, then bump the policy version.

The trainer publishes `weights/step_N/` (marker last): the weights themselves, or with the broadcast
transport a manifest naming where trainer rank 0 waits to send them (`exchange/weights_broadcast.py`).
When a step newer than the served version is complete, the watcher reloads every server in place (or
has all of them receive it at once) — one call that each server's engine runs between two forward
passes, so running requests continue under the new weights without a pause (`client.reload_all`) —
and only then bumps the version, so a token is never tagged with a version newer than the weights
that produced it (see `loop.py`). If several steps landed meanwhile, it jumps straight to the newest.
Nothing is restarted.

`serving(version)` records what the servers serve (the trainer's retention keeps every newer step,
see `exchange/retention.py`): once at start, before the first look for weights, and after each
reload has finished, before the version is bumped.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from rlctl.orchestrator.exchange.steps import complete_steps
from rlctl.orchestrator.exchange.weights_broadcast import is_broadcast_step, is_served
from rlctl.orchestrator.loop import PolicyVersion

Reloader = Callable[[Path], Awaitable[dict[str, Any]]]


def inference_reloader(server_urls: list[str], admin_token: str, pause_mode: str | None = None) -> tuple[Reloader, Callable]:
    """A reload function over the inference servers' admin routes, and an async close for its clients.

    `server_urls` are the servers' own URLs as they announced them: the admin token goes there and
    never through the router (a worker slipped into the router would receive it)."""
    from rlctl.inference.client import InferenceClient, reload_all
    from rlctl.inference.lora_serving import is_adapter_step

    clients = [InferenceClient(u, admin_token) for u in server_urls]

    async def reload(step_dir: Path) -> dict[str, Any]:
        transport = ("broadcast" if is_broadcast_step(step_dir) else "lora" if is_adapter_step(step_dir)
                     else "filesystem")
        return await reload_all(clients, str(step_dir), pause_mode, transport)

    async def close() -> None:
        await asyncio.gather(*(c.aclose() for c in clients))

    return reload, close


class WeightWatcher:
    def __init__(self, weights_dir: Path, policy: PolicyVersion, reload: Reloader, poll_s: float = 0.02,
                 serving: Callable[[int], None] | None = None):
        self.weights_dir = Path(weights_dir)
        self.policy = policy
        self.reload = reload
        self.poll_s = poll_s
        self.serving = serving
        self.reloads: list[dict[str, Any]] = []  # one record per applied step: step, timings, when

    def newest_step(self) -> int | None:
        """The newest complete step; a newer broadcast step counts only while its sender waits for the
        servers (one left by a trainer that is gone is skipped until it is published again)."""
        steps = complete_steps(self.weights_dir)
        if not steps:
            return None
        newest = self.weights_dir / f"step_{steps[-1]}"
        if steps[-1] > self.policy.version and is_broadcast_step(newest) and not is_served(newest):
            return None
        return steps[-1]

    async def apply(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        timings = await self.reload(self.weights_dir / f"step_{step}")
        record = {"step": step, "reload_s": time.perf_counter() - start, **timings, "time": time.time()}
        self.reloads.append(record)
        await self._record_serving(step)
        await self.policy.set(step)
        return record

    def reloads_since(self, index: int) -> tuple[float, int, int]:
        """Total reload seconds and weight bytes read (the most one server read, summed over the
        reloads) of records from `index` on, and the new index (for per-batch metrics)."""
        records = self.reloads[index:]
        read = sum(int(r.get("bytes_read_max") or 0) for r in records)
        return sum(r["reload_s"] for r in records), read, len(self.reloads)

    async def run(self) -> None:
        """Poll forever (cancel to stop); reload errors propagate and fail the orchestrator."""
        await self._record_serving(self.policy.version)
        while True:
            newest = await asyncio.to_thread(self.newest_step)
            if newest is not None and newest > self.policy.version:
                await self.apply(newest)
            else:
                await asyncio.sleep(self.poll_s)

    async def _record_serving(self, version: int) -> None:
        if self.serving is not None:
            await asyncio.to_thread(self.serving, version)
