"""Rollout files: write_batch / read_batch throughput vs `dd` on the same disk.

The batch is a realistic one (token ids, masks, logprobs, versions) plus a large opaque MoE payload
(`payload.routed_experts`, int16 [B, layers, top_k, T]) so the file is a few hundred MB. `write_batch`
includes serialisation, checksum, fsync, rename and marker; `read_batch` includes the checksum check.
`dd` writes the same number of bytes with `conv=fsync` and reads them back (both reads hit the page
cache, as the trainer's read right after the orchestrator's write usually does).

    python bench/bench_rollout_files.py [--dir DIR] [--mb 256]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rlctl.orchestrator.exchange.batches_fs import read_batch, write_batch


def make_batch(target_mb: int, B: int = 256, T: int = 2048, layers: int = 24, top_k: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    base = {
        "input_ids": torch.randint(0, 150_000, (B, T), generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "loss_mask": torch.ones(B, T, dtype=torch.bool),
        "inference_logprobs": -torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "policy_version": torch.zeros(B, T, dtype=torch.int32),
        "rewards": torch.rand(B, generator=g),
    }
    used = sum(t.numel() * t.element_size() for t in base.values())
    per_layer = B * top_k * T * 2
    layers = max(1, (target_mb * 2**20 - used) // per_layer)
    base["payload.routed_experts"] = torch.randint(0, 256, (B, layers, top_k, T), generator=g, dtype=torch.int16)
    return base


def dd(folder: Path, nbytes: int) -> tuple[float, float]:
    path = folder / "dd.bin"
    count = max(1, nbytes // 2**20)
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fsync"], check=True,
                   capture_output=True)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    read_s = time.perf_counter() - start
    path.unlink()
    return count * 2**20 / write_s, count * 2**20 / read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rlctl-rollout-bench-", dir=args.dir))
    try:
        batch = make_batch(args.mb)
        writes, reads, dd_w, dd_r = [], [], [], []
        for i in range(args.repeats):
            start = time.perf_counter()
            path = write_batch(folder, i, batch, {})
            writes.append(time.perf_counter() - start)
            nbytes = (path / "batch.safetensors").stat().st_size
            start = time.perf_counter()
            tensors, _ = read_batch(path)
            reads.append(time.perf_counter() - start)
            assert torch.equal(tensors["payload.routed_experts"], batch["payload.routed_experts"])
            del tensors
            shutil.rmtree(path)
            w, r = dd(folder, nbytes)
            dd_w.append(w)
            dd_r.append(r)
        mb = nbytes / 2**20
        out = {
            "file_mb": round(mb, 1),
            "write_mb_s": round(mb / statistics.median(writes), 1),
            "dd_write_mb_s": round(statistics.median(dd_w) / 2**20, 1),
            "read_mb_s": round(mb / statistics.median(reads), 1),
            "dd_read_mb_s": round(statistics.median(dd_r) / 2**20, 1),
        }
        out["write_ratio"] = round(out["write_mb_s"] / out["dd_write_mb_s"], 3)
        out["read_ratio"] = round(out["read_mb_s"] / out["dd_read_mb_s"], 3)
        print(json.dumps(out))
        print(f"write {out['write_ratio']:.0%} of dd, read {out['read_ratio']:.0%} of dd (goal >= 50%)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
