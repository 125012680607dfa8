"""Broadcast vs filesystem weight transport on this machine, raw transport time for a fake state dict.

    .venv/bin/python bench/bench_weight_broadcast.py [--sizes 100M,1B] [--workers 1] [--bucket-mb 256]

broadcast  = `BroadcastWeightStore.publish` from this process (rank 0: TCPStore, manifest, group of its
             own, buckets of `--bucket-mb`) until every receiving worker (a separate process each,
             `Receiver`, as in a vLLM worker) has every byte; the workers join as soon as the manifest is
             served, as the orchestrator's watcher makes them do.
filesystem = `FilesystemWeightStore.publish` (safetensors shards, fsync, marker) + every worker process
             reading the whole step back (`read_weights`), one after the other as the servers would
             load concurrently from a shared filesystem.
group      = forming the per-step group alone (an empty step: store, join, gloo rendezvous, teardown),
             the cost the transport pays for not keeping a group between steps.
Loading into a model is left out on both sides (the same `reload_weights` call follows either).
Prints one line per size and transport, and the ratio broadcast / filesystem.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from rlctl.orchestrator.exchange.weights_broadcast import BroadcastWeightStore, Receiver, is_served, read_manifest
from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, read_weights

CONFIG = {"model_type": "qwen3", "tie_word_embeddings": False}
ROWS = 4096


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def fake_state(params: int, dtype) -> dict:
    """Tensors of ROWS x ROWS (the last one shorter) holding `params` elements; values do not matter."""
    state, left, i = {}, params, 0
    while left > 0:
        rows = min(ROWS, -(-left // ROWS))
        state[f"model.layers.{i}.weight"] = torch.full((rows, ROWS), float(i % 7), dtype=dtype)
        left -= rows * ROWS
        i += 1
    return state


def buckets_of(state: dict, bucket_bytes: int):
    bucket, size = {}, 0
    for name, t in state.items():
        if bucket and size + t.numel() * t.element_size() > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def _receive(step_dir: str, workers: int, results) -> None:
    results.put("ready")  # imported: the timing starts only now
    while not is_served(Path(step_dir)):
        time.sleep(0.01)
    t0 = time.perf_counter()
    receiver = Receiver(read_manifest(Path(step_dir)), workers)
    joined = time.perf_counter()
    got = sum(t.numel() * t.element_size() for bucket in receiver.buckets() for _, t in bucket)
    results.put({"join_s": joined - t0, "receive_s": time.perf_counter() - joined, "bytes": got})


def _read(step_dir: str, results) -> None:
    t0 = time.perf_counter()
    state = read_weights(Path(step_dir))  # may map the files lazily: copy every byte out, as a load does
    got = sum(t.clone().numel() * t.element_size() for t in state.values())
    results.put({"read_s": time.perf_counter() - t0, "bytes": got})


def run_broadcast(folder: Path, step: int, state: dict, workers: int, bucket_bytes: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    step_dir = str(folder / f"step_{step}")
    procs = [ctx.Process(target=_receive, args=(step_dir, workers, results)) for _ in range(workers)]
    for p in procs:
        p.start()
    assert [results.get(timeout=120) for _ in procs] == ["ready"] * workers
    store = BroadcastWeightStore(folder, "127.0.0.1", timeout_s=600)
    t0 = time.perf_counter()
    store.publish(step, CONFIG, buckets_of(state, bucket_bytes))
    took = time.perf_counter() - t0
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(g["bytes"] == got[0]["bytes"] for g in got)
    return {"total_s": took, "join_s": max(g["join_s"] for g in got), "bytes": got[0]["bytes"],
            "send_s": store.last["send_s"]}


def run_filesystem(folder: Path, step: int, state: dict, workers: int, bucket_bytes: int) -> dict:
    t0 = time.perf_counter()
    FilesystemWeightStore(folder).publish(step, CONFIG, buckets_of(state, bucket_bytes))
    write_s = time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    read_s = 0.0
    for _ in range(workers):
        p = ctx.Process(target=_read, args=(str(folder / f"step_{step}"), results))
        p.start()
        read_s += results.get(timeout=600)["read_s"]
        p.join(60)
    return {"total_s": write_s + read_s, "write_s": write_s, "read_s": read_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100M,1B", help="parameter counts, comma separated (K, M, B suffixes)")
    parser.add_argument("--workers", type=int, default=1, help="receiving inference workers")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    bucket_bytes = args.bucket_mb << 20
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir=".") as tmp:
        root = Path(tmp)
        group = [run_broadcast(root / "group", i + 1, {}, args.workers, bucket_bytes)["total_s"] for i in range(3)]
        print(f"per-step group (empty step, {args.workers} worker(s)): {min(group) * 1e3:.0f} ms "
              f"(best of 3; {', '.join(f'{g * 1e3:.0f}' for g in group)} ms)", flush=True)
        for text in args.sizes.split(","):
            state = fake_state(parse_size(text), getattr(torch, args.dtype))
            gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
            fs = run_filesystem(root / f"fs-{text}", 1, state, args.workers, bucket_bytes)
            bc = run_broadcast(root / f"bc-{text}", 1, state, args.workers, bucket_bytes)
            print(f"{text} params ({gb:.2f} GB {args.dtype}, {args.workers} worker(s)): "
                  f"filesystem {fs['total_s']:.2f}s (write {fs['write_s']:.2f} + read {fs['read_s']:.2f}) | "
                  f"broadcast {bc['total_s']:.2f}s (join {bc['join_s']:.3f}, send {bc['send_s']:.2f}; "
                  f"{gb / bc['total_s']:.2f} GB/s) | broadcast/filesystem {bc['total_s'] / fs['total_s']:.2f}x",
                  flush=True)
            del state
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
