"""Trainer sizing for `rlctl plan`: FSDP × EP × CP (× TP) degrees, per-GPU memory, step time.

Memory follows the FSDP2 accounting of the reference notes; time is a roofline: matmul and attention
FLOPs over the calibrated achieved peak, FSDP all-gather/reduce-scatter overlapped with compute,
expert-parallel all-to-all exposed. All efficiencies live in `rlctl.recipes.calibration`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from rlctl.recipes import calibration as C

GIB = 2**30


@dataclass
class TrainerPlan:
    gpus: int
    fsdp: int
    ep: int
    cp: int
    tp: int
    dp_replicate: int
    memory_gib: dict
    """Per-GPU breakdown: params, grads, optimizer, activations, logits, all_gather, reserved, total."""
    activations_no_ac_gib: float
    memory_gib_per_gpu: float
    hbm_gib: float
    fits: bool
    tokens_per_step: int
    micro_batches: int
    flops_per_token: float
    compute_s: float
    fsdp_comm_s: float
    ep_comm_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _bytes_per_param(optimizer_dtype: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter of the sharded state."""
    return (4.0, 4.0, 8.0) if optimizer_dtype == "float32" else (2.0, 2.0, 4.0)


def state_bytes(spec, optimizer_dtype: str) -> tuple[int, int]:
    """(one published weights step, one checkpoint) in bytes. Published weights are the full master
    parameters under HF names (a tied LM head once); a checkpoint holds the same parameters plus the
    two AdamW moments (gradients are not saved)."""
    pb, _, ob = _bytes_per_param(optimizer_dtype)
    n = spec.total_params
    return int(n * pb), int(n * (pb + ob))


def params_on_fullest_rank(spec, shard: int, ep: int) -> float:
    """Parameters held by the rank with the most. FSDP2 splits each tensor along dim 0 in chunks of
    ceil(dim0 / ranks), so an expert tensor [experts/ep, ...] sharded over its `shard/ep` ranks puts
    ceil(local experts / ranks) whole experts on the fullest rank (GLM-5: 3 of 32 local experts on 12
    ranks, 12.5% above the mean); when the ranks outnumber the local experts it is split along dim 1
    instead (torchtitan's rule) and comes out even. Dense tensors have dim 0 ≫ shard: the mean."""
    n = spec.total_params
    if not spec.is_moe:
        return n / shard
    local_experts = spec.n_routed_experts / ep
    ranks = max(1.0, shard / ep)
    per_rank = math.ceil(local_experts / ranks) if ranks <= local_experts else local_experts / ranks
    return (n - spec.expert_params_total) / shard + per_rank * spec.moe_layers * spec.expert_params()


def memory_breakdown(spec, *, shard: int, ep: int, cp: int, tp: int, seq_len: int, micro_batch: int,
                     activation_checkpointing: bool, optimizer_dtype: str) -> tuple[dict, float]:
    """Per-GPU memory in GiB and the activation GiB without checkpointing (for advice)."""
    local = params_on_fullest_rank(spec, shard, ep)
    pb, gb, ob = _bytes_per_param(optimizer_dtype)
    s = max(1, seq_len // cp) * micro_batch  # tokens of one micro-batch on this GPU
    h = spec.hidden_size
    # Per-layer activation bytes (bf16, flash attention, so no s² scores): attention + norms ≈ 15·s·h,
    # gated MLP 2·s·h + 6·s·I where I counts every routed copy of a token (top_k experts + shared).
    inter = spec.intermediate_size
    if spec.is_moe:
        inter = (spec.num_experts_per_tok + spec.n_shared_experts) * spec.moe_intermediate_size
    attn_width = spec.num_attention_heads * (2 * spec.qk_dim + spec.v_dim) / 3
    per_layer = (11 * s * max(h, attn_width) + 4 * s * h + 2 * s * h + 6 * s * inter) / tp
    full = per_layer * spec.num_hidden_layers
    kept = 2 * s * h * spec.num_hidden_layers + per_layer if activation_checkpointing else full
    # LM head: fp32 logits and their gradient for one chunk of tokens, vocab split over tp.
    logits = 2 * 4 * min(s, C.LOGITS_CHUNK_TOKENS) * spec.vocab_size / tp
    # Largest layer gathered in bf16 for compute + the prefetched one; its fp32 unsharded grads.
    experts_local = spec.n_routed_experts * spec.expert_params() / ep if spec.is_moe else 0
    layer = spec.layer_params(moe=False, active=False)
    if spec.is_moe:
        layer = max(layer, spec.attention_params() + experts_local
                    + spec.n_shared_experts * spec.expert_params())
    all_gather = (2 * 2 * layer + 4 * layer) / tp
    mem = {
        "params": local * pb / GIB,
        "grads": local * gb / GIB,
        "optimizer": local * ob / GIB,
        "activations": kept / GIB,
        "logits": logits / GIB,
        "all_gather": all_gather / GIB,
        "reserved": C.TRAIN_RESERVED_GIB,
    }
    mem["total"] = sum(mem.values())
    return {k: round(v, 2) for k, v in mem.items()}, round(full / GIB, 2)


def flops_per_token(spec, mean_seq: float) -> tuple[float, float, float]:
    """(dense matmul, expert matmul, attention) training FLOPs per token, forward + backward."""
    matmul = spec.matmul_params_active
    expert = 0
    if spec.is_moe:
        expert = spec.moe_layers * spec.num_experts_per_tok * spec.expert_params()
    # Causal: a token attends to half the sequence on average. DSA models are trained with dense
    # (masked) attention as in the HF reference implementation; top-k sparsity only pays off in decode.
    ctx = mean_seq / 2
    attn = 6 * spec.num_hidden_layers * spec.num_attention_heads * (spec.qk_dim + spec.v_dim) * ctx
    if spec.index_n_heads:  # DSA indexer scores every earlier token (forward only; frozen in RL)
        attn += 2 * spec.num_hidden_layers * spec.index_n_heads * spec.index_head_dim * ctx
    return 6.0 * (matmul - expert), 6.0 * expert, float(attn)


def plan_trainer(spec, tr, *, gpus: int, gpus_per_node: int, gpu, seq_len: int, tokens_per_step: int,
                 mean_seq: float, inter_gbps: float, intra_gbps: float, ep: int, cp: int, tp: int,
                 fsdp: int | None) -> TrainerPlan:
    """Size the trainer for fixed degrees (validated by the caller). fsdp None = all remaining GPUs."""
    model_ranks = cp * tp
    fsdp = fsdp or max(1, gpus // model_ranks)
    dp_rep = max(1, gpus // (fsdp * model_ranks))
    shard = fsdp * cp * tp
    mem, no_ac = memory_breakdown(spec, shard=shard, ep=ep, cp=cp, tp=tp, seq_len=seq_len,
                                  micro_batch=tr.micro_batch_size,
                                  activation_checkpointing=tr.activation_checkpointing,
                                  optimizer_dtype=getattr(tr, "optimizer_dtype", "float32"))
    # ---- compute
    dense_f, expert_f, attn_f = flops_per_token(spec, mean_seq)
    fp8 = C.TRAIN_FP8_GEMM_SPEEDUP if tr.fp8 else 1.0
    peak = gpu.bf16_tflops * 1e12
    cp_pen = 1 + C.CP_ATTN_PENALTY_PER_DOUBLING * math.log2(cp)
    recompute = C.RECOMPUTE_FACTOR_FULL_AC if tr.activation_checkpointing else 1.0
    sec_per_token = recompute * (
        dense_f / (peak * C.TRAIN_MFU_DENSE * fp8)
        + expert_f / (peak * C.TRAIN_MFU_DENSE * C.TRAIN_MOE_GEMM_EFF * fp8)
        + attn_f * cp_pen / (peak * C.TRAIN_ATTN_EFF)
    )
    tokens_gpu = tokens_per_step / gpus
    compute_s = tokens_gpu * sec_per_token
    # ---- FSDP traffic: per micro-batch, all-gather bf16 params twice (forward, backward) and
    # reduce-scatter fp32 grads once; experts are only gathered within their EP shard.
    dp_ranks = max(1, gpus // model_ranks)
    micro = max(1, math.ceil(tokens_per_step / dp_ranks / (seq_len * tr.micro_batch_size)))
    non_expert = spec.total_params - spec.expert_params_total
    gathered = (non_expert + spec.expert_params_total / ep) / tp
    group_spans_nodes = shard > gpus_per_node
    link = (inter_gbps if group_spans_nodes else intra_gbps) / 8 * 1e9 * C.NET_EFF
    frac = (shard - 1) / shard
    fsdp_comm_s = micro * gathered * (2 * 2 + 4) * frac / link if link > 0 else 0.0
    # ---- EP all-to-all: dispatch + combine of top_k hidden vectors per token per MoE layer, per pass.
    ep_comm_s = 0.0
    if spec.is_moe and ep > 1:
        passes = 3 if tr.activation_checkpointing else 2
        elem = 1.5 if tr.fp8 else 2.0  # fp8 dispatch + bf16 combine
        per_token = 2 * spec.num_experts_per_tok * spec.hidden_size * elem * spec.moe_layers * passes
        ep_link = (intra_gbps if ep <= gpus_per_node else inter_gbps) / 8 * 1e9 * C.NET_EFF
        ep_comm_s = tokens_gpu * per_token * (ep - 1) / ep / ep_link if ep_link > 0 else 0.0
    optimizer_s = spec.total_params / shard * 28 / (gpu.hbm_tbps * 1e12 * C.DECODE_HBM_EFF)
    step = max(compute_s + ep_comm_s, fsdp_comm_s) + optimizer_s
    tps = tokens_per_step / step if step > 0 else 0.0
    useful = (dense_f + expert_f + attn_f) * tps / gpus
    hbm = gpu.hbm_gib
    notes = []
    if fsdp_comm_s > compute_s + ep_comm_s:
        notes.append("FSDP all-gather/reduce-scatter is the bottleneck (network-bound); more tokens per step or fewer nodes amortise it")
    return TrainerPlan(
        gpus=gpus, fsdp=fsdp, ep=ep, cp=cp, tp=tp, dp_replicate=dp_rep, memory_gib=mem,
        activations_no_ac_gib=no_ac, memory_gib_per_gpu=mem["total"], hbm_gib=round(hbm, 1),
        fits=mem["total"] <= hbm, tokens_per_step=int(tokens_per_step), micro_batches=micro,
        flops_per_token=dense_f + expert_f + attn_f, compute_s=compute_s, fsdp_comm_s=fsdp_comm_s,
        ep_comm_s=ep_comm_s, step_time_s=step, tokens_per_s=tps, mfu=useful / peak, notes=notes,
    )
