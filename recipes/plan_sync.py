"""Weight sync per step in `rlctl plan`: how long moving the new policy from the trainer to every
inference server takes, for each transport, and which part of it sits on which side of the async step.

filesystem: every trainer rank of one data-parallel replica writes its part of the model (sharded
  safetensors in the serving dtype) in parallel, bounded by the per-node and the aggregate filesystem
  bandwidth; then every inference node reads what its ranks serve (the whole model for a replica on
  one node, the dense part plus its share of the experts for an expert-parallel replica over several
  nodes; ranks on one node share the page cache), bounded the same way; plus a fixed pause/reload/
  resume cost per server.
broadcast: trainer rank 0 sends the whole model, bucket by bucket, to every inference worker through a
  process group formed for the step (every worker receives every bucket); a pipelined broadcast runs at
  one NIC's bandwidth whatever the number of receivers, plus a small latency per bucket, the group's
  set-up, and the same fixed pause/reload cost on the servers. Gathering each bucket to rank 0 from
  the other trainer ranks is not modelled (it spreads over all their links).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rlctl.recipes import calibration as C

TRANSPORTS = ("filesystem", "broadcast")
DEFAULT_TRANSPORT = "filesystem"
DEFAULT_BUCKET_MB = 256  # weights.bucket_mb's default, for recipes validated without the key
SYNC_WARN_FRACTION = 0.10
"""Warn when the chosen transport's weight sync takes more than this fraction of the async step."""


@dataclass(frozen=True)
class ReplicaGroup:
    """Inference replicas of one kind (all of them, or the prefill or decode ones under P/D)."""

    count: int
    nodes_per_replica: int
    ep: bool
    """Experts split over the replica's ranks (expert parallelism), so a node reads only its share."""


@dataclass(frozen=True)
class SyncShape:
    """Where the weights come from and go to."""

    trainer_nodes: int
    senders: int
    """Trainer ranks holding disjoint parts of the model (one data-parallel replica): they write or send."""
    groups: tuple[ReplicaGroup, ...]
    gpu_kind: str


def chosen_transport(recipe) -> str:
    """`weights.transport` of the recipe (filesystem where the recipe schema has no such key)."""
    transport = getattr(getattr(recipe, "weights", None), "transport", DEFAULT_TRANSPORT)
    return transport if transport in TRANSPORTS else DEFAULT_TRANSPORT


def model_bytes(recipe, spec, on_gpu: bool) -> tuple[float, float, str]:
    """(non-expert bytes, expert bytes, dtype) of what one sync moves: the model in the serving dtype
    (FP8 matmul weights when the servers run FP8), or only the adapter when the trainer trains LoRA."""
    from rlctl.inference.plan import weight_bytes
    from rlctl.trainer.plan import lora_params, lora_rank

    rank = lora_rank(recipe.trainer)
    if rank:
        targets = tuple(recipe.trainer.lora.target_modules)
        return 2.0 * lora_params(spec, rank, targets), 0.0, "bf16 (LoRA adapter)"
    fp8 = bool(on_gpu and recipe.inference.fp8)
    dense, expert = weight_bytes(spec, fp8)
    if fp8:
        return dense, expert, "fp8"
    name = serving_dtype_name(recipe)
    scale = DTYPE_BYTES[name] / 2.0  # weight_bytes counts 2 bytes a parameter
    return dense * scale, expert * scale, SHORT_NAMES.get(name, name)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def serving_dtype_name(recipe) -> str:
    """`inference.dtype`, 'auto' meaning `trainer.dtype`: the dtype weights are published in."""
    name = recipe.inference.dtype
    return recipe.trainer.dtype if name == "auto" else name


def gpu_shape(recipe, profile, trainer, inference, trainer_nodes: int, inference_nodes: int) -> SyncShape:
    """The shape of a GPU plan: `trainer` is the TrainerPlan (None when it does not fit), `inference`
    the InferencePlan."""
    gpn = max(1, profile.gpus_per_node)
    if trainer is not None:
        senders = max(1, trainer.fsdp * trainer.cp * trainer.tp)
    else:
        senders = trainer_nodes * gpn
    dis, ep = recipe.inference.disaggregation, bool(inference.ep)
    if dis.enabled:
        groups = (ReplicaGroup(dis.prefill_replicas, dis.prefill_nodes_per_replica, ep),
                  ReplicaGroup(dis.decode_replicas, dis.decode_nodes_per_replica, ep))
    else:  # replicas that share a node share its page cache: each of those nodes reads the model once
        nodes_per_replica = max(1, math.ceil(inference.dp_per_replica * max(1, inference.tp) / gpn))
        nodes = min(inference_nodes, max(1, inference.replicas) * nodes_per_replica)
        groups = (ReplicaGroup(max(1, nodes // nodes_per_replica), nodes_per_replica, ep),)
    return SyncShape(trainer_nodes, senders, groups, profile.gpu)


def cpu_shape(placement) -> SyncShape:
    """A CPU run: every server is one process serving the whole model; the servers of a node share its
    page cache, so each inference node reads the model once."""
    nodes = max(1, placement.inference_nodes)
    return SyncShape(max(1, placement.trainer_nodes), max(1, placement.trainer_ranks_per_node * placement.trainer_nodes),
                     (ReplicaGroup(nodes, 1, False),), "cpu")


def _node_reads(shape: SyncShape, dense: float, expert: float) -> list[float]:
    """Bytes each inference node reads from the filesystem."""
    reads = []
    for g in shape.groups:
        share = expert / g.nodes_per_replica if g.ep else expert
        reads += [dense + share] * (g.count * g.nodes_per_replica)
    return reads


def sync_times(shape: SyncShape, profile, dense: float, expert: float, bucket_bytes: int) -> dict:
    """Seconds per step of each transport: its total, and its parts on the trainer's and the rollout
    side of the async step."""
    total = dense + expert
    fs_node, fs_all = profile.fs_node_gbs * 1e9, profile.fs_aggregate_gbs * 1e9
    fixed = C.per_kind(C.WEIGHT_RELOAD_FIXED_S, shape.gpu_kind)
    writers = max(1, min(shape.trainer_nodes, shape.senders))
    write_s = total / min(writers * fs_node, fs_all)
    reads = _node_reads(shape, dense, expert)
    read_s = max(max(reads) / fs_node, sum(reads) / fs_all)
    nic = profile.interconnect_gbps / 8 * 1e9 * C.WEIGHT_SYNC_NET_EFF
    buckets = max(1, math.ceil(total / bucket_bytes))
    transfer_s = (C.per_kind(C.WEIGHT_BROADCAST_GROUP_S, shape.gpu_kind) + total / nic
                  + buckets * C.WEIGHT_SYNC_BUCKET_LATENCY_S)
    return {
        "filesystem": {"sync_time_s": write_s + read_s + fixed, "trainer_s": write_s, "rollout_s": read_s + fixed,
                       "write_s": write_s, "read_s": read_s, "read_bytes": sum(reads), "reload_fixed_s": fixed},
        # both ends are held for the whole transfer: rank 0 sends (the others gather to it), the servers receive
        "broadcast": {"sync_time_s": transfer_s + fixed, "trainer_s": transfer_s, "rollout_s": transfer_s + fixed,
                      "transfer_s": transfer_s, "buckets": buckets, "reload_fixed_s": fixed},
    }


def weight_sync(recipe, spec, profile, shape: SyncShape, on_gpu: bool) -> dict:
    """The plan's `weights` section."""
    dense, expert, dtype = model_bytes(recipe, spec, on_gpu)
    bucket_mb = getattr(getattr(recipe, "weights", None), "bucket_mb", DEFAULT_BUCKET_MB)
    times = sync_times(shape, profile, dense, expert, bucket_mb << 20)
    transport = chosen_transport(recipe)
    return {"transport": transport, "bytes": dense + expert, "dtype": dtype,
            "sync_time_s": {t: times[t]["sync_time_s"] for t in TRANSPORTS},
            "trainer_side_s": times[transport]["trainer_s"], "rollout_side_s": times[transport]["rollout_s"],
            **{t: {k: v for k, v in times[t].items() if k not in ("sync_time_s", "trainer_s", "rollout_s")}
               for t in TRANSPORTS}}


def sync_warning(weights: dict, step_s) -> str | None:
    """One warning when the chosen transport's sync takes more than SYNC_WARN_FRACTION of the step."""
    if not weights or not isinstance(step_s, (int, float)) or not math.isfinite(step_s) or step_s <= 0:
        return None
    transport = weights["transport"]
    sync = weights["sync_time_s"][transport]
    if sync <= SYNC_WARN_FRACTION * step_s:
        return None
    other = next(t for t in TRANSPORTS if t != transport)
    if weights["sync_time_s"][other] < sync:
        hint = f"weights.transport=\"{other}\" would take {sync_fmt(weights['sync_time_s'][other])}"
    elif weights[transport]["reload_fixed_s"] >= sync / 2:
        hint = "most of it is the servers' fixed pause/reload cost"
    else:
        hint = "a faster filesystem or network would shorten it (cluster profile: fs_node_gbs, fs_aggregate_gbs, " \
               "interconnect_gbps)"
    return (f"weights: the {transport} weight sync takes {sync_fmt(sync)} per step, "
            f"{100 * sync / step_s:.0f}% of the {sync_fmt(step_s)} step (> {100 * SYNC_WARN_FRACTION:.0f}%); {hint}")


def sync_fmt(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.3g} s"
