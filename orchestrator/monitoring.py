"""Monitoring backends (`monitoring.backends`): W&B (offline) and TensorBoard, fed from the typed
metric records of every writer, by one process (the orchestrator), under `<run>/monitoring/`.

The orchestrator tails `metrics/*.jsonl` (its own records and the trainer's, written on another
host) and forwards each new record once; a resumed attempt forwards only steps from its start step
on, so nothing is sent twice. W&B runs offline: `wandb sync <run>/monitoring/wandb/wandb/offline-run-*`
uploads it later. TensorBoard writes event files: `tensorboard --logdir <run>/monitoring/tensorboard`.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import time
from pathlib import Path
from typing import Callable

from rlctl.orchestrator.exchange.heartbeat import Heartbeat, beat_interval
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.metrics import RECORDS, StepRecord, TrainerStepRecord, typed
from rlctl.recipes.errors import RecipeError

log = logging.getLogger(__name__)

BACKEND_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


class BackendMissing(RecipeError):
    """A chosen backend whose package is not installed."""


def missing_backends(backends: list[str]) -> list[str]:
    return [b for b in backends if importlib.util.find_spec(BACKEND_PACKAGES[b]) is None]


def check_backends(backends: list[str]) -> None:
    missing = missing_backends(backends)
    if missing:
        raise BackendMissing(f"{', '.join(missing)} chosen but not installed (pip install 'rlctl[monitoring]', "
                             f"or remove it from the list)", "monitoring.backends")


def scalars(record: StepRecord) -> dict[str, float]:
    """`component/field` → value for every finite numeric field but step and time."""
    out = {}
    for key, value in record.to_json().items():
        if key in ("component", "step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{record.component}/{key}"] = float(value)
    return out


class TensorBoardBackend:
    def __init__(self, folder: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: StepRecord) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record.step, walltime=record.time)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, folder: Path, name: str, config: dict):
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        # One W&B run per rlctl run (its attempts resume it); trainer and orchestrator records
        # arrive out of step order relative to each other, so each gets its own step axis.
        self.run = wandb.init(mode="offline", dir=str(folder), project="rlctl", name=name, id=_wandb_id(name),
                              resume="allow", config=config, settings=wandb.Settings(silent=True, console="off"))
        for component in RECORDS:
            self.run.define_metric(f"{component}/step")
            self.run.define_metric(f"{component}/*", step_metric=f"{component}/step")

    def write(self, record: StepRecord) -> None:
        self.run.log({**scalars(record), f"{record.component}/step": record.step})

    def flush(self) -> None:
        pass  # the offline writer streams to its file

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns once the W&B service acknowledged the exit; the service closes the run's
        # file on its own time. Tearing the service down waits for that, so the offline run is
        # complete on disk when close returns, even if this process is killed right after.
        try:
            wandb.teardown()
        except SystemExit as exc:  # wandb exits the caller when its service failed; metrics are a side channel
            log.warning("monitoring.backends: the W&B service ended with code %s", exc.code)


def _wandb_id(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name)[:64]


class MetricsForwarder:
    """Forward each new metric record of the run (any writer) to the chosen backends."""

    def __init__(self, run: RunDir, backends: list[str], name: str, config: dict, from_step: int = 0):
        check_backends(backends)
        self.run, self.from_step = run, from_step
        self.sent: dict[str, set[int]] = {component: set() for component in RECORDS}
        self.backends = []
        for backend in backends:
            folder = run.monitoring / backend
            self.backends.append(TensorBoardBackend(folder) if backend == "tensorboard"
                                 else WandbBackend(folder, name, config))

    def poll(self) -> int:
        """Forward the records not sent yet; returns how many were sent."""
        if not self.backends:
            return 0
        from rlctl.orchestrator.exchange.metrics import read_records

        records = read_records(self.run)
        count = 0
        for component, cls in RECORDS.items():
            for record in typed(records, cls):
                if record.step < self.from_step or record.step in self.sent[component]:
                    continue
                for backend in self.backends:
                    backend.write(record)
                self.sent[component].add(record.step)
                count += 1
        for backend in self.backends:
            backend.flush()
        return count

    def has(self, component: str, step: int) -> bool:
        return step in self.sent.get(component, ())

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []


class OrchestratorMonitor:
    """The orchestrator's heartbeat and metrics forwarding, run as one asyncio task beside the loop."""

    def __init__(self, run: RunDir, recipe, start_step: int):
        self.interval_s = beat_interval(recipe.monitoring.stall_timeout_s)
        self.heartbeat = Heartbeat(run, "orchestrator", self.interval_s)
        self.forwarder = MetricsForwarder(run, list(recipe.monitoring.backends), run.root.name,
                                          recipe.model_dump(mode="json"), start_step)

    async def run(self, state: Callable[[], tuple[int, str | None]]) -> None:
        """Beat with `state()` = (progress counter, what it waits on) and forward new records, until cancelled."""
        while True:
            self.heartbeat.beat(*state())
            await asyncio.to_thread(self.forwarder.poll)
            await asyncio.sleep(min(self.interval_s, 2.0))

    async def finish(self, last_step: int, grace_s: float = 10.0) -> None:
        """Forward what is left, waiting up to `grace_s` for the trainer's record of `last_step`
        (it is written just after the final weights the orchestrator waited for)."""
        deadline = time.monotonic() + grace_s
        while True:
            await asyncio.to_thread(self.forwarder.poll)
            if not self.forwarder.backends or self.forwarder.has(TrainerStepRecord.component, last_step) \
                    or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        self.forwarder.close()
