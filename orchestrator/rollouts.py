"""Rollout batches on the shared filesystem: `rollouts/step_N/batch.safetensors` + `COMPLETE`.

Format `rlctl-rollouts-v1`: one safetensors file whose tensors are the training batch (see the
contract in the README: input_ids, attention_mask, loss_mask, inference_logprobs, advantages,
policy_version, rewards, plus opaque `payload.<name>` tensors) and whose string metadata holds
`format`, `step`, `policy_version_max`, `meta_json` (the whole meta dict as JSON) and `checksum`
(CRC-32 over every tensor's name, dtype, shape and bytes, in name order).

Publication is atomic: the file is written and fsynced in a hidden staging directory, the directory
is renamed to `step_N`, and the `COMPLETE` marker (JSON: size of the file) is written last. Readers
only look at directories holding the marker, and `read_batch` re-verifies size and checksum, so a
torn or bit-flipped file raises `CorruptRolloutError` instead of training on garbage.

torch/safetensors are imported inside the functions so importing this module stays cheap.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

FORMAT = "rlctl-rollouts-v1"
BATCH_FILE = "batch.safetensors"
MARKER = "COMPLETE"
PAYLOAD_PREFIX = "payload."


class CorruptRolloutError(RuntimeError):
    """A rollout batch is partial, truncated, or fails its checksum."""


def step_dir(rollouts_dir: Path, step: int) -> Path:
    return Path(rollouts_dir) / f"step_{step}"


def tensors_checksum(tensors: dict) -> str:
    """CRC-32 over (name, dtype, shape, raw bytes) of each tensor, in sorted name order, without copies."""
    import torch

    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)};".encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return f"crc32:{crc:08x}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_batch(rollouts_dir: Path, step: int, tensors: dict, meta: dict[str, Any]) -> Path:
    """Publish one batch atomically as `rollouts_dir/step_N`; returns that directory.

    A leftover `step_N` without marker (a crash between rename and marker) is replaced; a complete
    one is never overwritten (FileExistsError) so a batch cannot be published twice.
    """
    from safetensors.torch import save

    rollouts_dir = Path(rollouts_dir)
    rollouts_dir.mkdir(parents=True, exist_ok=True)
    final = step_dir(rollouts_dir, step)
    if (final / MARKER).exists():
        raise FileExistsError(f"rollout batch {final} is already complete")
    cpu = {}
    for name, t in tensors.items():
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            raise TypeError(f"rollout tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        cpu[name] = t.detach().cpu().contiguous()
    meta = {**meta, "step": step, "format": FORMAT}
    versions = cpu.get("policy_version")
    if "policy_version_max" not in meta and versions is not None and versions.numel():
        meta["policy_version_max"] = int(versions.max())
    metadata = {
        "format": FORMAT,
        "step": str(step),
        "policy_version_max": str(meta.get("policy_version_max", -1)),
        "meta_json": json.dumps(meta, default=str),
        "checksum": tensors_checksum(cpu),
    }
    data = save(cpu, metadata=metadata)

    staging = Path(tempfile.mkdtemp(prefix=f".step_{step}.", suffix=".tmp", dir=rollouts_dir))
    try:
        with open(staging / BATCH_FILE, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staging, 0o755)
        if final.exists():  # incomplete leftover of a crashed writer
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(rollouts_dir)
    marker = {"format": FORMAT, "step": step, "file": BATCH_FILE, "bytes": len(data), "checksum": metadata["checksum"]}
    tmp = final / f".{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final / MARKER)
    _fsync_dir(final)
    return final


def read_batch(path: Path) -> tuple[dict, dict[str, Any]]:
    """Load and verify a batch; `path` is a `step_N` directory or its `batch.safetensors` file.

    Returns (tensors, meta). Raises CorruptRolloutError when the marker is missing, the size does
    not match, the file does not parse, or the checksum differs.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    folder, file = (path, path / BATCH_FILE) if path.is_dir() else (path.parent, path)
    marker_path = folder / MARKER
    if not marker_path.exists():
        raise CorruptRolloutError(f"rollout batch {folder} has no {MARKER} marker (partial or still being written)")
    try:
        marker = json.loads(marker_path.read_text())
        data = file.read_bytes()
    except (OSError, ValueError) as exc:
        raise CorruptRolloutError(f"rollout batch {folder} is unreadable: {exc}") from exc
    if marker.get("bytes") != len(data):
        raise CorruptRolloutError(
            f"rollout batch {file} has {len(data)} bytes but its marker says {marker.get('bytes')} (truncated or replaced)"
        )
    try:
        tensors = load(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    except (SafetensorError, ValueError, OverflowError) as exc:
        raise CorruptRolloutError(f"rollout batch {file} does not parse as safetensors: {exc}") from exc
    if metadata.get("format") != FORMAT:
        raise CorruptRolloutError(f"rollout batch {file} has format {metadata.get('format')!r}, expected {FORMAT!r}")
    expected = metadata.get("checksum")
    actual = tensors_checksum(tensors)
    if expected != actual:
        raise CorruptRolloutError(f"rollout batch {file} fails its checksum ({actual} != {expected}): corrupted on disk")
    return tensors, json.loads(metadata["meta_json"])


def wait_for_batch(
    rollouts_dir: Path, step: int, timeout: float, poll: float = 0.02, stop_file: Path | None = None
) -> Path | None:
    """Block until `rollouts_dir/step_N` is complete; return its directory.

    Returns None if `stop_file` appears first (e.g. the run's DONE file); raises TimeoutError after
    `timeout` seconds. Polling one stat() every 20 ms is cheap even on a parallel filesystem and keeps the
    hand-off latency (part of every step in a balanced pipeline) small.
    """
    marker = step_dir(rollouts_dir, step) / MARKER
    deadline = time.monotonic() + timeout
    while True:
        if marker.exists():
            return marker.parent
        if stop_file is not None and Path(stop_file).exists():
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rollout batch step_{step} did not appear in {rollouts_dir} within {timeout:.0f}s")
        time.sleep(poll)
