"""The shared pool's dispatcher: which attached run's request each server slot serves next, and making
that run's policy resident first.

Every server has `slots` requests in flight at most (vLLM batches them). When one is free, the run
picked by HRRS (`pool_scheduler`) sends its oldest queued request there. LoRA runs are served as
concurrent adapters of one base (an adapter per run, all resident up to `inference.max_loras`), so a
run's weight update is an in-place adapter load under the run's name. Full-weight runs share a server
by turns: before another run's request goes to a server, the server drains its in-flight requests and
reloads that run's newest published weights in place (the residency switch whose cost HRRS weighs);
an update of the run a server holds is reloaded at once (pause keep / reload / resume, as in one run),
an update of a run not resident is only noted and loaded at its next switch. Every weight change waits
for the previous one (`_weights_lock`), so pauses of different runs never interleave.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from rlctl.inference.client import InferenceClient, reload_all
from rlctl.inference.pool_scheduler import HRRSScheduler, Request, Residency
from rlctl.inference.server import SERVED_MODEL_NAME

log = logging.getLogger("rlctl.pool")
MODES = ("lora", "full")
FIRST_SERVICE_S = 1.0  # a run's expected service before its first request was measured
FIRST_SWITCH_S = 1.0   # a reload's expected seconds before the first was measured
EMA = 0.2              # weight of the newest measurement in the running estimates


@dataclass
class PoolRun:
    name: str
    run_dir: str
    adapter: str = SERVED_MODEL_NAME
    """LoRA: the adapter its requests name (the zero adapter until its first publish)."""
    weights: str | None = None
    """Its newest published weights (None: the base model); LoRA: the adapter step its requests name."""
    requests: int = 0
    service_s: float = 0.0
    wait_s: float = 0.0
    expected_s: float = FIRST_SERVICE_S
    attached: float = field(default_factory=time.time)

    def summary(self, queued: int) -> dict:
        return {"run_dir": self.run_dir, "requests": self.requests, "queued": queued,
                "service_s": round(self.service_s, 3), "wait_s": round(self.wait_s, 3),
                "adapter": self.adapter, "weights": self.weights}


@dataclass
class Replica:
    index: int
    client: InferenceClient
    """The server's own URL with the admin token (completions go there with the api key)."""
    slots: int
    inflight: int = 0
    loaded: str | None = None
    """Full-weight: the weights it holds (None: the base it started with)."""
    holder: str | None = None
    """Full-weight: the run those weights are (None: no run yet)."""
    busy: bool = False
    """A residency switch or reload is in progress: nothing new is sent to it."""


class PoolFull(RuntimeError):
    """A LoRA pool already serves `inference.max_loras` runs (message: one line)."""


class PoolDispatcher:
    def __init__(self, clients: list[InferenceClient], mode: str, slots: int, max_loras: int = 1,
                 base_dir: str = "", host_cache_bytes: int = 0):
        """`base_dir`: the model the servers started with, served to a full-weight run that has not
        published yet. `host_cache_bytes`: host RAM per server worker for runs' newest steps (full
        weights; 0: every switch reads the files)."""
        if mode not in MODES:
            raise ValueError(f"pool mode {mode!r}: allowed {', '.join(MODES)}")
        self.mode, self.base_dir, self.max_loras = mode, base_dir, max_loras
        self.replicas = [Replica(i, c, slots) for i, c in enumerate(clients)]
        # LoRA: every adapter up to max_loras resident at once; full weight: one run's weights per server
        capacity = float(max_loras) if mode == "lora" else 1.0
        self.scheduler = HRRSScheduler([Residency(capacity, 0.0, 1 / FIRST_SWITCH_S, 1 / FIRST_SWITCH_S)
                                        for _ in clients])
        self.runs: dict[str, PoolRun] = {}
        self._weights_lock = asyncio.Lock()
        self.started: float | None = None  # the first attach: the pool's idle time counts from there
        self._busy_since: float | None = None
        self.busy_s = 0.0
        self.switches = 0
        self.switch_s = 0.0
        self.host_cache_bytes = host_cache_bytes if mode == "full" else 0
        self.switches_from_host = 0
        self._staging: set[asyncio.Task] = set()

    # -- runs ---------------------------------------------------------------------------------------
    def attach(self, name: str, run_dir: str) -> PoolRun:
        if name not in self.runs and self.mode == "lora" and len(self.runs) >= self.max_loras:
            raise PoolFull(f"the pool serves {len(self.runs)} LoRA runs already, as many as its servers hold "
                           f"adapters (inference.max_loras={self.max_loras}); relaunch it with more")
        if name not in self.runs:
            if self.started is None:
                self.started = time.monotonic()
            # a newcomer's expected service: what the runs already here take (they share one model),
            # not a fixed guess that would make it look long, and wait, next to measured short ones
            known = [r.expected_s for r in self.runs.values() if r.requests]
            self.runs[name] = PoolRun(name, run_dir, expected_s=sum(known) / len(known) if known else FIRST_SERVICE_S)
            for res in self.scheduler.replicas:
                res.register(name, 1.0)
                if self.mode == "lora":  # its adapter is loaded on every server with the first publish
                    res.make_resident(name)
            log.info("run %s attached (%s)", name, run_dir)
        return self.runs[name]

    async def detach(self, name: str) -> None:
        run = self.runs.pop(name, None)
        if run is None:
            return
        for req in self.scheduler.queues.pop(name, ()):
            if not req.tag.done():
                req.tag.cancel()
        for res in self.scheduler.replicas:
            res.hbm.pop(name, None)
        if self.mode == "lora" and run.adapter != SERVED_MODEL_NAME:
            for rep in self.replicas:  # frees its adapter slot; a failure only costs the slot
                try:
                    await rep.client.unload_adapter(run.adapter)
                except Exception as exc:  # noqa: BLE001 - logged, the pool goes on
                    log.warning("unloading %s from server %d: %s", run.adapter, rep.index, exc)
        log.info("run %s detached after %d requests", name, run.requests)

    # -- requests -----------------------------------------------------------------------------------
    async def acquire(self, name: str) -> Replica:
        """Wait until the pool gives run `name` a server slot (call `release` after the request)."""
        run = self.runs[name]
        future = asyncio.get_running_loop().create_future()
        request = Request(name, time.monotonic(), run.expected_s, tag=future)
        self.scheduler.submit(request)
        self._pump()
        try:
            replica = await future
        except asyncio.CancelledError:
            queue = self.scheduler.queues.get(name)
            if queue and request in queue:
                queue.remove(request)
            elif future.done() and not future.cancelled():
                self.release(future.result(), name, time.monotonic())
            raise
        run.wait_s += time.monotonic() - request.arrival
        return replica

    def release(self, replica: Replica, name: str, dispatched: float) -> None:
        took = time.monotonic() - dispatched
        replica.inflight -= 1
        run = self.runs.get(name)
        if run is not None:
            run.requests += 1
            run.service_s += took
            run.expected_s = max(1e-3, (1 - EMA) * run.expected_s + EMA * took)
        self._account()
        self._pump()

    def _account(self) -> None:
        """Busy time: some request is in flight or a server reloads (the pool's idle fraction)."""
        busy = any(r.inflight or r.busy for r in self.replicas)
        now = time.monotonic()
        if busy and self._busy_since is None:
            self._busy_since = now
        elif not busy and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def _pump(self) -> None:
        """Give every free slot the request HRRS picks; start a switch where that needs one."""
        now = time.monotonic()
        while self.scheduler.queued():
            placed = False
            for rep in self.replicas:
                if rep.busy or rep.inflight >= rep.slots or not self.scheduler.queued():
                    continue
                if self.mode == "full":
                    pending = self.scheduler.pending_runs()
                    best = max(pending, key=lambda r: self.scheduler.priority(r, rep.index, now))
                    if best != rep.holder and rep.inflight:
                        continue  # drain it first: one run's weights at a time
                dispatch = self.scheduler.dispatch(rep.index, now)
                future = dispatch.request.tag
                placed = True
                if future.done():  # its caller went away meanwhile
                    continue
                if self.mode == "full" and dispatch.request.run != rep.holder:
                    rep.busy = True
                    asyncio.get_running_loop().create_task(self._switch(rep, dispatch.request.run, future))
                else:
                    rep.inflight += 1
                    future.set_result(rep)
            if not placed:
                break
        self._account()

    # -- weights ------------------------------------------------------------------------------------
    async def _switch(self, rep: Replica, name: str, future: asyncio.Future) -> None:
        """Make run `name` resident on `rep` (drained), then hand it the waiting request."""
        try:
            async with self._weights_lock:
                run = self.runs.get(name)
                while run is not None and rep.loaded != run.weights:
                    target = run.weights
                    start = time.monotonic()
                    timings = await reload_all([rep.client], target or self.base_dir, "keep")
                    took = time.monotonic() - start
                    rep.loaded = target
                    self.switches += 1
                    self.switches_from_host += timings.get("from_host", 0)
                    self.switch_s += took
                    self._estimate_switch(took)
                rep.holder = name
            log.info("server %d now holds run %s", rep.index, name)
        except Exception as exc:  # noqa: BLE001 - the waiting request fails, the pool goes on
            log.error("switching server %d to run %s failed: %s", rep.index, name, exc)
            rep.holder = rep.loaded = None
            if not future.done():
                future.set_exception(exc)
        else:
            if not future.done():
                rep.inflight += 1
                future.set_result(rep)
        finally:
            rep.busy = False
            self._pump()

    def _estimate_switch(self, took: float) -> None:
        for res in self.scheduler.replicas:
            old = 1 / res.cold_load_bytes_per_s
            rate = 1 / max(1e-3, (1 - EMA) * old + EMA * took)
            res.host_load_bytes_per_s = res.cold_load_bytes_per_s = rate

    async def publish(self, name: str, step_dir: str) -> dict:
        """Run `name` published `step_dir`: returns when every request sent from now on is served by it."""
        run = self.runs[name]
        start = time.monotonic()
        async with self._weights_lock:
            if self.mode == "lora":
                timings = await reload_all([r.client for r in self.replicas], step_dir, "keep", "lora", adapter=name)
                run.adapter, run.weights = name, step_dir  # what `rlctl monitor POOL` shows it served with
                return timings
            previous, run.weights = run.weights, step_dir
            self._stage(step_dir, previous)
            holders = [r for r in self.replicas if r.holder == name and not r.busy]
            if not holders:
                return {"total_s": time.monotonic() - start, "servers": 0, "resident": False}
            for rep in holders:
                rep.busy = True
            try:
                timings = await reload_all([r.client for r in holders], step_dir, "keep")
                for rep in holders:
                    rep.loaded = step_dir
            finally:
                for rep in holders:
                    rep.busy = False
        self._pump()
        return {**timings, "resident": True}

    def _stage(self, step_dir: str, previous: str | None) -> None:
        """Every server reads a run's new step into host RAM in the background, so a switch to the run
        reads no file (the one holding it too: it may switch away and back); its older step goes."""
        if not self.host_cache_bytes:
            return

        async def stage(rep: Replica) -> None:
            try:
                await rep.client.stage(step_dir, self.host_cache_bytes, previous)
            except Exception as exc:  # noqa: BLE001 - the switch then reads the files
                log.warning("staging %s on server %d: %s", step_dir, rep.index, exc)

        for rep in self.replicas:
            task = asyncio.get_running_loop().create_task(stage(rep))
            self._staging.add(task)
            task.add_done_callback(self._staging.discard)

    # -- reporting ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        uptime = time.monotonic() - self.started if self.started is not None else 0.0
        busy = self.busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
        queues = self.scheduler.queues
        served = sum(r.service_s for r in self.runs.values()) or 1.0  # shares of the attached runs' service
        return {"mode": self.mode, "servers": len(self.replicas), "uptime_s": round(uptime, 2),
                "busy_s": round(busy, 2), "idle_fraction": round(1 - busy / uptime, 4) if uptime > 0 else None,
                "switches": self.switches, "switch_s": round(self.switch_s, 3),
                "switches_from_host": self.switches_from_host, "host_cache_bytes": self.host_cache_bytes,
                "inflight": sum(r.inflight for r in self.replicas),
                "holders": [r.holder for r in self.replicas] if self.mode == "full" else None,
                "runs": {n: {**r.summary(len(queues.get(n, ()))), "share": round(r.service_s / served, 4)}
                         for n, r in self.runs.items()}}
