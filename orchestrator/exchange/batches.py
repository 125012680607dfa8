"""How training batches travel from the orchestrator to the trainer.

`BatchWriter` / `BatchReader` are the interface; `batches_fs` is the filesystem transport
(`rollouts/step_N/batch.safetensors` + marker). A batch is a dict of tensors (opaque payloads
included, never converted to lists) plus a JSON-able meta dict.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


class BatchWriter(ABC):
    @abstractmethod
    def write(self, step: int, tensors: dict, meta: dict[str, Any]) -> None:
        """Publish batch `step` atomically; a complete batch is never overwritten."""

    @abstractmethod
    def written(self) -> list[int]:
        """Steps whose batch is complete, ascending."""


class BatchReader(ABC):
    @abstractmethod
    def wait(self, step: int, timeout: float, stop_file: Path | None = None) -> bool:
        """Block until batch `step` is complete (True) or `stop_file` appears (False); TimeoutError after `timeout`."""

    @abstractmethod
    def read(self, step: int) -> tuple[dict, dict[str, Any]]:
        """Load and verify batch `step`: (tensors, meta)."""

    @abstractmethod
    def release(self, before: int) -> list[int]:
        """Drop batches of steps < `before` (trained and covered by a checkpoint); returns them."""
