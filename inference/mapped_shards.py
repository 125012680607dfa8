"""A published step's safetensors shards as tensors over memory maps: a worker reads only what it copies.

vLLM's default loader reads every tensor of every shard whole (`safe_open(...).get_tensor`) and a TP
rank narrows it to its slice afterwards, so every worker of a server reads the whole checkpoint from
the shared filesystem. Here each tensor is a view of a private (copy-on-write) memory map of its
shard: the loader's `narrow(...)` and `copy_` fault in only the pages of the slice a rank serves
(rows of a column-parallel weight, an expert-parallel rank's experts; a row-parallel weight's columns
are a strided piece of every row, so only rows of a few pages or more leave pages out), and the
pages it touched are this worker's read, counted from /proc/self/smaps (the mapping's resident
bytes, so a page the page cache already held still counts when this worker used it). Reading a whole
model this way costs what vLLM's loader does (the medium bench model's reload: 45-46 ms in the worker
vs 43-48 ms), and no map outlives the reload (nothing vLLM keeps is a view of one).

The format (safetensors): 8 bytes little-endian header length, a JSON header {name: {dtype, shape,
data_offsets: [start, end]}} (plus "__metadata__"), then the data; offsets are relative to the data.
"""
from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_header(file: Path) -> tuple[dict, int]:
    """The shard's tensor entries (no `__metadata__`) and where its data starts."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


class MappedShards:
    """Tensors of safetensors `files`, each a view of its shard's memory map, in file order. Keep the
    object until the tensors are copied; `touched_bytes()` says how much of the shards was read."""

    def __init__(self, files: list[Path]) -> None:
        self.files = [Path(f) for f in files]
        self._headers = [read_header(f) for f in self.files]
        self._maps: list[mmap.mmap] = []

    @property
    def mappable(self) -> bool:
        """Whether every tensor has a dtype this reader maps (else the caller's own loader runs)."""
        return all(meta["dtype"] in DTYPES for header, _ in self._headers for meta in header.values())

    def data_bytes(self) -> int:
        """Bytes of tensor data in the shards: what a worker serving the whole model reads."""
        return sum(m["data_offsets"][1] - m["data_offsets"][0] for header, _ in self._headers for m in header.values())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file, (header, data_start) in zip(self.files, self._headers):
            with open(file, "rb") as f:
                # ACCESS_COPY: a private mapping torch may view as writable; pages load on first touch
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps.append(mm)
            for name, meta in header.items():
                dtype, shape = DTYPES[meta["dtype"]], meta["shape"]
                start, end = meta["data_offsets"]
                if end == start:
                    yield name, torch.empty(shape, dtype=dtype)
                    continue
                flat = torch.frombuffer(mm, dtype=dtype, count=(end - start) // dtype.itemsize,
                                        offset=data_start + start)
                yield name, flat.view(shape)

    def touched_bytes(self) -> int | None:
        """Bytes of these shards resident in this process's mappings of them (what it has read), or
        None where /proc/self/smaps is not available. The kernel walks every mapping of the process
        for it: 15-20 ms in a vLLM CPU worker, so it is for workers that read part of the model."""
        names = {str(f.resolve()) for f in self.files}
        total, counting = 0, False
        try:
            with open("/proc/self/smaps") as smaps:
                for line in smaps:
                    if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                        parts = line.split(None, 5)
                        counting = len(parts) == 6 and parts[5].strip() in names
                    elif counting and line.startswith("Rss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            return None
        return total
