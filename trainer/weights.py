"""The trainer's side of weight publishing: which rank writes which tensors, and producing them.

Every rank owns a disjoint set of whole model tensors, balanced by bytes (`assign`). Publishing walks
the tensors in one order on every rank: each rank casts its shard of a tensor to the serving dtype and
sends it to the tensor's owner alone (point to point; one sender per distinct block), which assembles
it and renames it to checkpoint names (`hf_names.to_checkpoint_names`: MoE experts one tensor per
expert, as vLLM's reload expects). An all-gather would hand every rank every tensor: N times the bytes
at world N. The owner hands each full bucket to the `WeightStore` and drops it, so a rank's peak is its
FSDP shard plus one bucket (plus the one tensor being assembled, in the serving dtype). Where and how
weights travel is the exchange's business (`rlctl.orchestrator.exchange.weights`).
"""
from __future__ import annotations

import heapq
import json
import os
import weakref
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
        filled = 0
        for name in sorted(names, key=order.__getitem__):
            if not buckets or filled + size_of[name] > bucket_bytes:
                buckets.append([])
                filled = 0
            buckets[-1].append(name)
            filled += size_of[name]
        plan.append(buckets)
    return plan


Block = tuple[tuple[int, int], ...]  # (start, stop) per dim of a global tensor; () for nothing held
_ROUTES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _routes(model, state: dict) -> dict[str, dict[Block, list[int]] | None]:
    """For each DTensor in `state`: its distinct blocks and the global ranks holding each, or None
    where the blocks do not form a grid (that tensor is all-gathered). One object all-gather per model,
    the first time it is published (layouts do not change while training)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlctl.trainer.sharded_load import owned_block

    if model in _ROUTES:
        return _ROUTES[model]
    mine = {}
    for name, t in state.items():
        if isinstance(t, DTensor):
            block = tuple((s.start, s.stop) for s in owned_block(t))
            mine[name] = block if len(block) == t.dim() and all(b > a for a, b in block) else ()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    routes = {}
    for name in mine:
        holders: dict[Block, list[int]] = {}
        for rank, ranks_blocks in enumerate(every):
            if ranks_blocks[name]:
                holders.setdefault(ranks_blocks[name], []).append(rank)
        routes[name] = holders if _tiles(list(holders), tuple(state[name].shape)) else None
    _ROUTES[model] = routes
    return routes


def _tiles(blocks: list[Block], shape) -> bool:
    """Whether the distinct non-empty blocks partition a tensor of `shape`: along each dim their ranges
    chain from 0 to the size, and every combination of those ranges is a block (a grid)."""
    distinct = {b for b in blocks if b}
    if not distinct:  # an empty tensor (or one nobody holds a block of): the all-gather handles it
        return False
    grid = 1
    for dim, size in enumerate(shape):
        ranges = sorted({b[dim] for b in distinct})
        if [a for a, _ in ranges] != [0] + [b for _, b in ranges[:-1]] or ranges[-1][1] != size:
            return False
        grid *= len(ranges)
    return len(distinct) == grid


def _gather_to_owner(t, owner: int, rank: int, holders: dict[Block, list[int]], dtype):
    """The full tensor of DTensor `t`, in `dtype`, on global rank `owner` (None elsewhere): each block
    sent point to point by one of the ranks holding it (the owner copies a block it holds itself). Every
    rank receives only the tensors it owns, where an all-gather would hand every rank every tensor."""
    import torch
    import torch.distributed as dist

    senders = {block: owner if owner in ranks else ranks[0] for block, ranks in holders.items()}
    # batched point-to-point: NCCL then uses the group's communicator, where single send/recv calls
    # would create a two-rank communicator for every pair of ranks
    if rank != owner:
        if rank in senders.values():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t.to_local().to(dtype).contiguous(), owner)]):
                work.wait()
        return None
    local = t.to_local()
    full = torch.empty(t.shape, dtype=dtype, device=local.device)  # copy_ casts the block it holds
    receives = []
    for block, src in senders.items():
        view = full[tuple(slice(a, b) for a, b in block)]
        if src == rank:
            view.copy_(local)
            continue
        buf = view if view.is_contiguous() else torch.empty(view.shape, dtype=full.dtype, device=full.device)
        receives.append((dist.P2POp(dist.irecv, buf, src), buf, view))
    for work in dist.batch_isend_irecv([op for op, _, _ in receives]) if receives else ():
        work.wait()
    for _, buf, view in receives:
        if buf is not view:
            view.copy_(buf)
    return full


def publish_buckets(model, config: dict, dtype, rank: int, world: int,
                    bucket_bytes: int = BUCKET_BYTES) -> Iterator[dict]:
    """Collective generator (every rank drains it): this rank's buckets of full checkpoint-named CPU
    tensors in `dtype`. Round k sends bucket k of every rank to its owner, so all ranks write at the
    same time. `rank`/`world` are the ranks of the plan (world 1: rank 0 owns everything)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from rlctl.trainer.hf_names import to_checkpoint_names

    state = get_model_state_dict(model)  # sharded as trained (DTensors), clean names; nothing gathered
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # it aliases the embedding; loaders re-tie it
    routes = _routes(model, state) if any(isinstance(t, DTensor) for t in state.values()) else {}
    me = dist.get_rank() if routes else rank  # the sends run over the default group's global ranks
    itemsize = dtype.itemsize
    plan = assign([(name, t.numel() * itemsize) for name, t in state.items()], world, bucket_bytes)
    for k in range(max(len(buckets) for buckets in plan)):
        mine = {}
        for owner, buckets in enumerate(plan):
            for name in buckets[k] if k < len(buckets) else ():
                # each block is cast where it is sent from: the owner receives (and holds) the tensor in
                # the serving dtype, half the bytes of fp32 master weights; a rank sending nothing casts nothing
                t = state[name].detach()
                if not isinstance(t, DTensor):
                    full = t.to(dtype) if owner == rank else None
                elif t.numel() == 0:  # nothing to move: no collective (DTensor's all-gather is unsafe on gloo)
                    full = torch.empty(t.shape, dtype=dtype) if owner == rank else None
                elif routes[name] is not None:
                    full = _gather_to_owner(t, owner, me, routes[name], dtype)
                else:  # a layout whose blocks are not a grid (FSDP, EP and HSDP make none): DTensor's all-gather
                    full = t.to(dtype).full_tensor()
                if owner == rank:
                    mine[name] = full.cpu().contiguous()
                del full, t
        if mine:
            yield to_checkpoint_names(mine, config)
