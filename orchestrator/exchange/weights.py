"""How policy weights travel from the trainer to the inference servers.

`WeightStore` is the small interface; `weights_fs.FilesystemWeightStore` is the portable transport
(sharded safetensors under `weights/step_N/` on the shared filesystem). A collective transport
implements the same methods in a file of its own.

Publishing is collective: every trainer rank calls `publish` with the part of the model it owns — full
tensors (never a rank's FSDP shard of one), under Hugging Face checkpoint names, already in the serving
dtype, disjoint across ranks and together the whole model — as an iterator of buckets, so no rank ever
holds more than its own part of one bucket at a time. Producing a bucket may itself run collectives
(gathering a sharded parameter), which is why every rank drains its iterator to the end.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Protocol

from rlctl.orchestrator.exchange.steps import complete_steps, remove_steps, step_dir_name


class RankGroup(Protocol):
    """The ranks that publish one version together (the trainer's process group)."""

    rank: int
    world: int

    def barrier(self) -> None:
        """Return once every rank of the group has called it."""


class SingleProcess:
    """A group of one: tests, benchmarks and tools that publish a whole state dict from one process."""

    rank, world = 0, 1

    def barrier(self) -> None:
        return None


def hf_state_dict(state: dict, config: dict) -> dict:
    """Contiguous CPU tensors under HF names, without the tied lm_head (it aliases the embedding)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        out[name] = t.contiguous()
    return out


class WeightStore(ABC):
    """Published policy versions, by step (the version is the number of trained steps)."""

    @abstractmethod
    def publish(self, step: int, config: dict, buckets: Iterable[dict], group: RankGroup = SingleProcess()) -> Path:
        """Collective over `group`: make version `step` visible once every rank has handed over its part.

        `buckets` yields this rank's tensors as dicts {checkpoint name: full contiguous CPU tensor in the
        serving dtype}; the ranks' names are disjoint and together form the model (the tied lm_head
        left out); `config` is the model's config.json. A version that is already complete is left as
        it is and no rank consumes its `buckets` (a restarted trainer republishing). Returns
        `location(step)`; readers see the version only once it is whole."""

    def publish_state(self, step: int, state: dict, config: dict) -> Path:
        """One process publishing a whole state dict (HF names): `publish` for a group of one."""
        return self.publish(step, config, [hf_state_dict(state, config)], SingleProcess())

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


class StepDirectoryStore(WeightStore):
    """Versions as `folder/step_N/` directories sealed by the `COMPLETE` marker (`steps.py`): what every
    transport shares — listing, rewinding and retention — whatever a step directory holds."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def location(self, step: int) -> Path:
        return self.folder / step_dir_name(step)

    def latest(self) -> int | None:
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def discard_after(self, step: int) -> list[int]:
        return remove_steps(self.folder, lambda s: s <= step)

    def retain(self, keep_last: int, in_use: set[int] = frozenset()) -> list[int]:
        """Complete steps beyond the newest `keep_last` go, unless a server may still be loading them;
        steps newer than the newest complete one (being written) are never touched."""
        done = complete_steps(self.folder)
        kept = set(done[-max(keep_last, 1):]) | set(in_use)
        newest = done[-1] if done else -1
        return remove_steps(self.folder, lambda s: s in kept or s > newest)
