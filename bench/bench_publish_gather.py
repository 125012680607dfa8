"""Publish: each tensor sent to its owner alone vs all-gathered to every rank, at several world sizes.

    .venv/bin/python bench/bench_publish_gather.py [--worlds 2,4] [--repeats 3]

A 235M-parameter dense Qwen3 (random weights, fp32 master weights) is sharded with FSDP2 over a 1-D
mesh of `world` gloo ranks (one thread each; the tests' `fsdp_random_model`); every round drains `weights.publish_buckets` in bf16
with 32 MiB buckets (the cast and the collectives; no files) twice, alternating the order:
owner = the publish as it runs (each rank's blocks sent point to point to the tensor's owner);
gather = the same walk with every tensor all-gathered (`full_tensor()`, what the publish did before).
Prints, per world size, the median seconds of each, their ratio, and the bytes each rank receives
(the most over the ranks, from the plan and the blocks): the all-gather hands every rank the whole
model, the owner path only the tensors it writes.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

BIG_DENSE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32768, "max_position_embeddings": 256,
             "max_window_layers": 16, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
BUCKET = 32 << 20
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _received_bytes(model, rank: int, world: int, itemsize: int) -> tuple[int, int]:
    """(owner path, all-gather) bytes this rank receives in one publish."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from rlctl.trainer.weights import _ROUTES, assign

    state = get_model_state_dict(model)
    state.pop("lm_head.weight", None)
    routes = _ROUTES[model]
    plan = assign([(n, t.numel() * itemsize) for n, t in state.items()], world, BUCKET)
    mine = {n for bucket in plan[rank] for n in bucket}

    def missing(name: str) -> int:
        held = 0
        for block, ranks in routes[name].items():
            if rank in ranks:
                held = 1
                for a, b in block:
                    held *= b - a
        return (state[name].numel() - held) * itemsize

    return sum(missing(n) for n in mine if n in routes), sum(missing(n) for n in routes)


def _rank(rank: int, world: int, port: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    import rlctl.trainer.weights as weights

    sys.path.insert(0, str(REPO / "tests"))
    from trainer_fixtures import fsdp_random_model

    model = fsdp_random_model(BIG_DENSE, rank, world, port)

    def drain(all_gather: bool) -> float:
        if model in weights._ROUTES:  # no route: every tensor takes the all-gather path
            weights._ROUTES[model] = {n: None for n in routes} if all_gather else routes
        dist.barrier()
        t0 = time.perf_counter()
        for _ in weights.publish_buckets(model, BIG_DENSE, torch.bfloat16, rank, world, BUCKET):
            pass
        dist.barrier()
        return time.perf_counter() - t0

    drain(False)  # the first publish learns the blocks and warms the paths
    routes = weights._ROUTES[model]
    times: dict[str, list[float]] = {"owner": [], "gather": []}
    for i in range(repeats):
        for name in (("owner", "gather") if i % 2 == 0 else ("gather", "owner")):
            times[name].append(drain(name == "gather"))
    weights._ROUTES[model] = routes
    received = torch.tensor(_received_bytes(model, rank, world, 2), dtype=torch.int64)
    dist.all_reduce(received, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put({"times": times, "received": received.tolist(),
                     "params": sum(p.numel() for p in model.parameters())})
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'world':>5}  {'owner s':>8}  {'gather s':>8}  {'ratio':>6}  {'recv/rank owner':>15}  {'recv/rank gather':>16}")
    for world in (int(w) for w in args.worlds.split(",")):
        results, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args.repeats, results)) for r in range(world)]
        for proc in procs:
            proc.start()
        out = results.get(timeout=900)
        for proc in procs:
            proc.join(120)
        owner, gather = (statistics.median(out["times"][k]) for k in ("owner", "gather"))
        mib = [b / 2**20 for b in out["received"]]
        print(f"{world:>5}  {owner:>8.2f}  {gather:>8.2f}  {owner / gather:>5.2f}x  {mib[0]:>11.0f} MiB  "
              f"{mib[1]:>12.0f} MiB", flush=True)
    print(f"({out['params'] / 1e6:.0f}M parameters, bf16, {BUCKET >> 20} MiB buckets, medians of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
