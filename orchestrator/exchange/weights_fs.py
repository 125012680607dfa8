"""The filesystem weight transport: `weights/step_N/` as a Hugging Face sharded checkpoint.

`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` (its `weight_map`) + `config.json`,
full tensors under checkpoint names in the serving dtype (the tied `lm_head.weight` dropped because
loaders re-tie it to the embedding). Every trainer rank writes its own shards, one per bucket, into a
shared staging directory, so write bandwidth grows with the ranks and no rank holds the whole model.
After a barrier rank 0 names the shards, writes the index and the config, and seals the directory as
`steps.publish_step` does (rename, then the `COMPLETE` marker last): readers that only trust
directories with the marker never see a partial step (rename is atomic on POSIX filesystems, and
NFS/Lustre keep rename atomic within a directory).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterable

from rlctl.orchestrator.exchange.files import DIR_MODE, FILE_MODE, fsync_path, private_dir, write_durably
from rlctl.orchestrator.exchange.steps import MARKER, STAGING_SUFFIX, parse_step, seal
from rlctl.orchestrator.exchange.weights import RankGroup, SingleProcess, StepDirectoryStore, hf_state_dict

INDEX_FILE = "model.safetensors.index.json"  # name → shard file; what transformers and vLLM read first
CONFIG_FILE = "config.json"
SHARD_PATTERN = "model-{index:05d}-of-{count:05d}.safetensors"
_PART = "part-r{rank:05d}-{bucket:05d}.safetensors"  # a shard before rank 0 knows how many there are
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}

__all__ = ["CONFIG_FILE", "INDEX_FILE", "FilesystemWeightStore", "hf_state_dict", "read_weights", "shard_files",
           "step_of", "write_safetensors"]


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> int:
    """Write `tensors` (contiguous CPU) as a safetensors file straight from their memory, then fsync it;
    returns the bytes written. `safetensors.torch.save_file` first copies every tensor into a Python
    bytes object, which would double a bucket's memory."""
    import torch

    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")],
                        "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    data = (t.detach().reshape(-1).view(torch.uint8).numpy().data for t in tensors.values() if t.numel())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        return write_durably(fd, itertools.chain([struct.pack("<Q", len(blob)) + blob], data))
    finally:
        os.close(fd)


def _tensor_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header only."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [name for name in header if name != "__metadata__"]


def shard_files(step_dir: Path) -> list[Path]:
    """The weight files of a published step, from its index."""
    index = json.loads((Path(step_dir) / INDEX_FILE).read_text())
    return [Path(step_dir) / name for name in sorted(set(index["weight_map"].values()))]


def read_weights(step_dir: Path) -> dict:
    """Every tensor of a published step (tests and tools; servers load the shards themselves)."""
    from safetensors.torch import load_file

    out = {}
    for path in shard_files(step_dir):
        out.update(load_file(path))
    return out


class FilesystemWeightStore(StepDirectoryStore):
    def publish(self, step: int, config: dict, buckets: Iterable[dict], group: RankGroup = SingleProcess()) -> Path:
        """Each rank writes one shard per bucket into the shared staging directory (fsynced by the rank
        that wrote it: on NFS only the writing client can flush its pages); after a barrier rank 0 seals."""
        final = self.location(step)
        if (final / MARKER).exists():
            return final
        # one name every rank derives without talking: a leftover of a killed publish of this step is
        # replaced; `sweep_staging` recognises it (hidden, STAGING_SUFFIX) like every staging directory
        stage = self.folder / f".{final.name}.publish{STAGING_SUFFIX}"
        if group.rank == 0:
            private_dir(self.folder)
            shutil.rmtree(stage, ignore_errors=True)
            os.mkdir(stage, DIR_MODE)
            os.chmod(stage, DIR_MODE)
        group.barrier()  # the directory exists before anyone writes into it
        try:
            for k, bucket in enumerate(buckets):
                if bucket:
                    write_safetensors(stage / _PART.format(rank=group.rank, bucket=k), bucket,
                                      {"format": "pt", "step": str(step)})
                del bucket  # else it stays alive while the producer fills the next one: two buckets
            group.barrier()  # every shard is written and synced
            if group.rank == 0:
                self._seal(stage, final, step, config)
        except BaseException:
            if group.rank == 0:
                shutil.rmtree(stage, ignore_errors=True)
            raise
        return final

    def _seal(self, stage: Path, final: Path, step: int, config: dict) -> None:
        parts = sorted(p for p in stage.iterdir() if p.name.startswith("part-"))  # by rank, then bucket
        weight_map, total = {}, 0
        for i, part in enumerate(parts, start=1):
            name = SHARD_PATTERN.format(index=i, count=len(parts))
            total += part.stat().st_size
            for tensor in _tensor_names(part):
                if tensor in weight_map:
                    raise ValueError(f"weights step {step}: tensor {tensor} published by two ranks")
                weight_map[tensor] = name
            os.rename(part, stage / name)
        # total_size: bytes of the shard files (headers included), informational for HF readers
        for path, text in ((stage / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                             "weight_map": weight_map}, indent=1)),
                           (stage / CONFIG_FILE, json.dumps(config, indent=2))):
            path.write_text(text + "\n")
            os.chmod(path, FILE_MODE)
            fsync_path(path)
        # Only the data needs fsync before the marker exists: losing the rename or the marker in a
        # crash merely hides the step (it is republished), so those metadata writes are not synced.
        seal(stage, final, {"step": step, "files": len(parts), "bytes": total}, sync_metadata=False,
             fsync_files=False)


def step_of(path: Path) -> int | None:
    """The step of a `weights/step_N` directory (what a server reports it has loaded)."""
    return parse_step(Path(path).name)
