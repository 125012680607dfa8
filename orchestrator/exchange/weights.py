"""How policy weights travel from the trainer to the inference servers.

`WeightStore` is the small interface; `weights_fs.FilesystemWeightStore` is the portable transport
(safetensors under `weights/step_N/` on the shared filesystem). A collective transport (NCCL
broadcast) implements the same methods in a file of its own.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class WeightStore(ABC):
    """Published policy versions, by step (the version is the number of trained steps)."""

    @abstractmethod
    def publish(self, step: int, state: dict, config: dict) -> Path:
        """Make the full (unsharded, HF-named) `state` visible as version `step`; idempotent."""

    @abstractmethod
    def latest(self) -> int | None:
        """The newest complete version, or None."""

    @abstractmethod
    def location(self, step: int) -> Path:
        """Where a server loads version `step` from."""

    @abstractmethod
    def discard_after(self, step: int) -> list[int]:
        """Drop versions newer than `step` (a resumed run rewinds there); returns them."""

    @abstractmethod
    def retain(self, keep_last: int, in_use: set[int] = frozenset()) -> list[int]:
        """Drop all but the `keep_last` newest versions and those in `in_use`; returns the dropped."""
