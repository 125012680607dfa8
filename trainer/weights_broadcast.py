"""The trainer's side of the broadcast weight transport (`weights.transport = "broadcast"`).

Rank 0 sends every tensor (`exchange/weights_broadcast.py`); it assembles them bucket by bucket as the
filesystem publish does (`weights.publish_buckets`), but owning every tensor, so the other ranks'
iterators only send their shards to it and rank 0 never holds more than one bucket beyond its shard.
"""
from __future__ import annotations

import os
import socket


def rendezvous_host() -> str:
    """An address of rank 0's node that the inference nodes reach: the one the trainer's own ranks use
    (MASTER_ADDR, set by the launchers), else this host's name."""
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


def broadcast_store(run, recipe, device, term):
    """The run's `BroadcastWeightStore` for this trainer process. Waiting for the servers ends early when
    the run is DONE or a preemption is requested (`term`: the trainer's SIGTERM flag): the step is then
    left unserved and the trainer's loop stops as it would without the broadcast."""
    import torch.distributed as dist

    from rlctl.orchestrator.exchange.weights_broadcast import BroadcastWeightStore

    cfg = recipe.weights
    coordination = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    return BroadcastWeightStore(run.weights, rendezvous_host(), cfg.broadcast_timeout_s,
                                backend="nccl" if device.type == "cuda" else "gloo", device=device,
                                coordination=coordination, stop=lambda: _stop_reason(run, term))


def _stop_reason(run, term) -> str | None:
    if run.done.exists():
        return f"{run.done.name} appeared: the orchestrator finished"
    if term.raised or run.preempt.exists():
        return "a preemption was requested"
    return None


def broadcast_buckets(model, config: dict, dtype, rank: int, bucket_bytes: int):
    """Collective generator (every rank drains it): rank 0 gets every tensor of the model, bucket by
    bucket, in `dtype` under checkpoint names; the other ranks get nothing but send rank 0 their shards."""
    from rlctl.trainer.weights import publish_buckets

    return publish_buckets(model, config, dtype, rank, 1, bucket_bytes)


def publish_broadcast(trainer, step: int) -> float:
    """`Trainer.publish` for the broadcast transport: announce `weights/step_N`, send it to every
    inference worker once they joined, then apply retention. Returns the seconds it took."""
    import time

    from rlctl.orchestrator.exchange.retention import retain_weights
    from rlctl.trainer.weights import ProcessGroupRanks, serving_dtype

    t0 = time.perf_counter()
    group = ProcessGroupRanks()
    store = trainer.weight_store
    buckets = broadcast_buckets(trainer.model, trainer.hf_config, serving_dtype(trainer.recipe), group.rank,
                                trainer.recipe.weights.bucket_mb << 20)
    store.publish(step, trainer.hf_config, buckets, group)
    elapsed = time.perf_counter() - t0
    if group.rank == 0:
        done = store.last
        if done.get("served"):
            trainer.log(f"weights step_{step} broadcast to {done['workers']} worker(s): {done['bytes'] / 1e6:.1f} MB "
                        f"in {done['send_s']:.3f}s ({elapsed:.3f}s with the wait for the servers)")
        elif done.get("why"):
            trainer.log(f"weights step_{step} not broadcast: {done['why']}")
        retain_weights(trainer.run, store, trainer.recipe.weights.keep_last)
    return elapsed
