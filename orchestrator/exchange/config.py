"""The `[weights]` section: how policy weights travel to the inference servers and how long they are kept."""
from __future__ import annotations

from typing import Annotated, Literal

from rlctl.recipes.base import Field, Seconds, StrictModel


class WeightsConfig(StrictModel):
    """Published policy weights (`weights/step_N`: one full copy of the model per step, or with the broadcast transport a manifest)."""

    keep_last: Annotated[int, Field(ge=1, le=1 << 20)] = 2
    """Newest published weight steps to keep; older ones are deleted unless an inference server may still be loading them (see `rlctl plan` for the disk this takes)."""

    transport: Literal["filesystem", "broadcast"] = "filesystem"
    """How new weights reach the servers: 'filesystem' writes safetensors under `weights/step_N` that every server reads; 'broadcast' sends them from trainer rank 0 straight to every inference worker through a torch.distributed group formed per step (gloo on CPU, NCCL on GPUs) and writes only a manifest under `weights/step_N` (checkpoints stay on the filesystem; the last step, the trained model, is written as files too)."""

    bucket_mb: Annotated[int, Field(ge=1, le=1 << 16)] = 256
    """Broadcast transport: MiB per broadcast bucket (tensors are gathered, sent and loaded one bucket at a time, so this bounds the extra memory on both sides)."""

    broadcast_timeout_s: Seconds = 1800.0
    """Broadcast transport: seconds trainer rank 0 waits for every inference worker to join a step's group (and each side waits on the other inside it) before failing with an error; covers the servers' start-up when a resumed trainer publishes first."""
