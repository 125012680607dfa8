"""One optimizer step over this rank's share of a rollout batch.

Rows of the batch are split over the data-parallel ranks (`dp` = dp_replicate × dp_shard, experts'
ranks included: ep borrows from dp_shard); the ranks of one context-parallel group read the same rows
and each takes a contiguous chunk of the sequence. Targets are shifted to "the token predicted at
position t" on the full rows *before* the sequence is split, so every rank scores its chunk locally.
The loss is normalised by the whole batch's completion-token count and the reduced gradients are sums
(see `parallel.apply_fsdp`), so the update does not depend on how the batch was split.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

ROW_KEYS = ("input_ids", "attention_mask", "loss_mask", "inference_logprobs")
ROUTED = "payload.routed_experts"
METRIC_SUMS = ("tokens", "mismatch_kl_sum", "entropy_sum", "masked_tokens", "ratio_sum")


@dataclass
class StepContext:
    """What a step needs besides the batch; built once by the trainer."""

    model: object
    optimizer: object
    scheduler: object
    loss_fn: object
    cfg: object  # the recipe's [trainer] section
    dims: object  # ParallelDims
    mesh: object  # world DeviceMesh (see parallel.build_mesh)
    device: object
    moe: bool = False
    router_replay: bool = False

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank()


def micro_batches(ctx: StepContext, batch: dict):
    """Yield this rank's micro-batches (sequence-sharded under cp); the same count on every rank."""
    import torch

    from rlctl.trainer.context_parallel import next_token_targets, shard_sequence

    n_rows = batch["input_ids"].shape[0]
    dp = ctx.dims.dp
    rows = torch.arange(ctx.dp_rank, n_rows, dp)
    per_rank = math.ceil(n_rows / dp)
    mbs = ctx.cfg.micro_batch_size
    keys = ROW_KEYS + ((ROUTED,) if ctx.router_replay and ROUTED in batch else ())
    for i in range(max(1, math.ceil(per_rank / mbs))):
        idx = rows[i * mbs : (i + 1) * mbs]
        # a rank with fewer rows still runs forward/backward (collectives must match) on a row whose
        # loss mask is cleared, so it contributes nothing
        padding = len(idx) == 0
        if padding:
            idx = torch.tensor([0])
        sub = {k: batch[k][idx] for k in keys}
        length = max(2, int(sub["attention_mask"].sum(dim=1).max()))
        sub = {k: v[:, :length] for k, v in sub.items()}
        if padding:
            sub["loss_mask"] = torch.zeros_like(sub["loss_mask"])
        sub = next_token_targets(sub)
        if ctx.dims.cp > 1:
            sub = shard_sequence(sub, ctx.cp_rank, ctx.dims.cp)
        sub["advantages"] = batch["advantages"][idx]
        yield {k: v.to(ctx.device) for k, v in sub.items()}


def _forward_logprobs(ctx: StepContext, mb: dict):
    from rlctl.trainer.loss import logprobs_of_labels

    replay = nullcontext()
    if ctx.router_replay and ROUTED in mb:
        from rlctl.trainer.moe import routing_replay

        replay = routing_replay(ctx.model, mb[ROUTED])
    kwargs = {"position_ids": mb["position_ids"]} if "position_ids" in mb else {}
    with replay:
        logits = ctx.model(input_ids=mb["input_ids"], **kwargs).logits
    return logprobs_of_labels(logits, mb["labels"], entropy_grad=ctx.cfg.loss.entropy_coef > 0)


def train_step(ctx: StepContext, batch: dict) -> dict:
    """Forward/backward over the micro-batches, clip, optimizer step; metrics summed over all ranks."""
    import torch
    import torch.distributed as dist

    from rlctl.trainer.loss import summarize

    total_tokens = float(batch["loss_mask"].sum())
    micro = list(micro_batches(ctx, batch))
    sums = torch.zeros(1 + len(METRIC_SUMS), dtype=torch.float64)
    positions = 0  # real (unpadded) token positions this rank ran, for the router replay coverage
    for i, mb in enumerate(micro):
        if ctx.router_replay:
            positions = positions + mb["attention_mask"].sum()  # a device tensor: no sync per micro-batch
        ctx.model.set_requires_gradient_sync(i == len(micro) - 1)  # reduce grads once per step
        logprobs, entropy = _forward_logprobs(ctx, mb)
        loss, m = ctx.loss_fn(
            logprobs, mb["inference_logprobs"], mb["advantages"], mb["loss_mask"], ctx.cfg.loss,
            num_tokens=total_tokens, entropy=entropy,
        )
        loss.backward()
        sums += torch.tensor([loss.item(), *(float(m.get(k, 0.0)) for k in METRIC_SUMS)], dtype=torch.float64)
    from rlctl.trainer.expert_parallel import clip_grad_norm_  # one norm over dense and expert meshes

    max_norm = ctx.cfg.optimizer.max_grad_norm
    grad_norm = clip_grad_norm_(ctx.model.parameters(), max_norm if max_norm > 0 else float("inf"))
    lr = ctx.scheduler.get_last_lr()[0]
    ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    sums = sums.to(ctx.device)  # NCCL reduces device tensors only
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    loss_sum, *metric_sums = sums.tolist()
    out = summarize(dict(zip(METRIC_SUMS, metric_sums)))
    out.update(loss=loss_sum, grad_norm=float(grad_norm), tokens=int(metric_sums[0]), lr=lr)
    if ctx.moe:
        out.update(expert_load_metrics(ctx))
    if ctx.moe and ctx.router_replay:
        out.update(replay_metrics(ctx, positions))
    return out


def expert_load_metrics(ctx: StepContext) -> dict:
    """Tokens routed to each expert in this step (all ranks), and max/mean averaged over MoE layers."""
    import torch.distributed as dist

    from rlctl.trainer.moe import expert_load

    load = expert_load(ctx.model, reset=True).to(ctx.device).double()
    dist.all_reduce(load, op=dist.ReduceOp.SUM)
    mean = load.mean(dim=1).clamp_min(1e-9)
    imbalance = float((load.max(dim=1).values / mean).mean())
    return {"tokens_per_expert": load.long().tolist(), "expert_load_imbalance": imbalance}


def replay_metrics(ctx: StepContext, positions) -> dict:
    """Router replay in this step (all ranks): the share of the real tokens' token-layers routed by the
    experts inference used (padding is routed by the router and not counted), and the share of those
    where the trainer's router would have chosen other experts."""
    import torch
    import torch.distributed as dist

    from rlctl.trainer.moe import moe_blocks, replay_counts

    real = int(positions) * len(moe_blocks(ctx.model))  # token-layers of real tokens (padding left out)
    counts = torch.tensor([real, *replay_counts(ctx.model, reset=True).tolist()], dtype=torch.float64,
                          device=ctx.device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    real, replayed, differing = counts.tolist()
    return {"router_replay_coverage": replayed / max(real, 1.0),
            "router_replay_overrides": differing / max(replayed, 1.0)}


def warm_up_compile(ctx: StepContext, length: int) -> None:
    """trainer.compile: compile the layers before the first batch, while inference starts and generates
    it. One forward and backward through the step's own path (micro-batch split, sequence sharding,
    logprobs) over `micro_batch_size` rows per data-parallel rank of `length` dummy tokens; the
    gradients are dropped, the RNG streams restored and MoE's expert-load counts reset: weights,
    optimizer and sampling are left as they were. `length` near the real rows' keeps the size hints
    inductor guards on close to the batches', so they do not recompile."""
    import torch

    rows = ctx.cfg.micro_batch_size * ctx.dims.dp
    ids = torch.arange(rows * length).reshape(rows, length) % ctx.model.config.get_text_config().vocab_size
    ones = torch.ones(rows, length)
    batch = {"input_ids": ids, "attention_mask": ones.long(), "loss_mask": ones, "inference_logprobs": 0 * ones,
             "advantages": torch.zeros(rows)}
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        for mb in micro_batches(ctx, batch):
            logprobs, _ = _forward_logprobs(ctx, mb)
            (logprobs * mb["loss_mask"]).sum().backward()
    ctx.model.zero_grad(set_to_none=True)
    if ctx.moe:
        from rlctl.trainer.moe import expert_load

        expert_load(ctx.model, reset=True)
