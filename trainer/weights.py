"""The trainer's side of weight publishing: which rank writes which tensors, and producing them.

Every rank owns a disjoint set of whole model tensors, balanced by bytes (`assign`). Publishing walks
the tensors in one order on every rank: each rank casts its shard of a tensor to the serving dtype, the
tensor is gathered (a collective, so every rank takes part), kept only by its owner and renamed to
checkpoint names (`hf_names.to_checkpoint_names`: MoE experts one tensor per expert, as vLLM's reload
expects). The owner hands each full bucket to the `WeightStore` and drops it, so a rank's peak is its
FSDP shard plus one bucket (plus the one tensor being gathered, in the serving dtype). Where and how
weights travel is the exchange's business (`rlctl.orchestrator.exchange.weights`).
"""
from __future__ import annotations

import heapq
import json
import os
from pathlib import Path
from typing import Iterator

CONFIG_FILE = "config.json"
# Bytes of serving-dtype tensors a rank holds before writing them out as one shard file: large enough
# that per-file costs vanish, small beside a node's memory (a tensor larger than this is a bucket alone).
BUCKET_BYTES = 1 << 30


def load_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / CONFIG_FILE).read_text())


def serving_dtype(recipe):
    """The torch dtype the inference servers run in: `inference.dtype`, 'auto' meaning `trainer.dtype`
    (the rule `rlctl.inference.server.serving_dtype` passes to vLLM)."""
    import torch

    name = recipe.trainer.dtype if recipe.inference.dtype == "auto" else recipe.inference.dtype
    return getattr(torch, name)


class ProcessGroupRanks:
    """The default torch.distributed group as the exchange's `RankGroup` (a group of one without it)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self._dist.get_rank() if self._dist else 0
        self.world = self._dist.get_world_size() if self._dist else 1

    def barrier(self) -> None:
        if self._dist is not None and self.world > 1:
            self._dist.barrier()


def assign(sizes: list[tuple[str, int]], world: int, bucket_bytes: int) -> list[list[list[str]]]:
    """Owner and bucket of every tensor: `[rank][bucket] -> names`. Largest tensors first, each to the
    rank with the fewest bytes so far (ties: lowest rank), so every rank computes the same answer;
    within a rank the tensors keep their order in `sizes` and are packed into buckets of at most
    `bucket_bytes` (a larger tensor forms a bucket of its own)."""
    order = {name: i for i, (name, _) in enumerate(sizes)}
    load = [(0, rank) for rank in range(world)]
    owned: list[list[str]] = [[] for _ in range(world)]
    for name, size in sorted(sizes, key=lambda item: (-item[1], order[item[0]])):
        total, rank = heapq.heappop(load)
        owned[rank].append(name)
        heapq.heappush(load, (total + size, rank))
    size_of = dict(sizes)
    plan = []
    for names in owned:
        buckets: list[list[str]] = []
        filled = bucket_bytes
        for name in sorted(names, key=order.__getitem__):
            if filled + size_of[name] > bucket_bytes and (not buckets or buckets[-1]):
                buckets.append([])
                filled = 0
            buckets[-1].append(name)
            filled += size_of[name]
        plan.append(buckets)
    return plan


def publish_buckets(model, config: dict, dtype, rank: int, world: int,
                    bucket_bytes: int = BUCKET_BYTES) -> Iterator[dict]:
    """Collective generator (every rank drains it): this rank's buckets of full checkpoint-named CPU
    tensors in `dtype`. Round k gathers bucket k of every rank, so all ranks write at the same time."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from rlctl.trainer.hf_names import to_checkpoint_names

    state = get_model_state_dict(model)  # sharded as trained (DTensors), clean names; nothing gathered
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # it aliases the embedding; loaders re-tie it
    itemsize = dtype.itemsize
    plan = assign([(name, t.numel() * itemsize) for name, t in state.items()], world, bucket_bytes)
    for k in range(max(len(buckets) for buckets in plan)):
        mine = {}
        for owner, buckets in enumerate(plan):
            for name in buckets[k] if k < len(buckets) else ():
                # cast each rank's shard before the gather: the gather then moves (and every rank
                # briefly holds) the tensor in the serving dtype, half the bytes of fp32 master weights
                t = state[name].detach().to(dtype)
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if owner == rank:
                    mine[name] = full.cpu().contiguous()
                del full, t
        if mine:
            yield to_checkpoint_names(mine, config)
