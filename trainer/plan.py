"""Trainer sizing for `rlctl plan`: FSDP × EP × CP (× TP × PP) degrees, per-GPU memory, step time.

Memory follows the FSDP2 accounting of the reference notes; time is a roofline per micro-batch:
matmul and attention FLOPs over the calibrated achieved peak of the GPU kind, elementwise traffic over
its HBM bandwidth, a fixed launch cost per layer, FSDP all-gather/reduce-scatter overlapped with
compute, expert-parallel all-to-all and tensor-parallel collectives exposed, the pipeline bubble.
LoRA freezes the base: bf16 weights only, no base gradients or optimizer state, no base weight-grad
GEMMs. All efficiencies live in `rlctl.recipes.calibration` and are read at call time.
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
    pp: int = 1
    tp_comm_s: float = 0.0
    lora_params: int = 0
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _bytes_per_param(optimizer_dtype: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per parameter of the sharded state."""
    return (4.0, 4.0, 8.0) if optimizer_dtype == "float32" else (2.0, 2.0, 4.0)


def lora_rank(tr) -> int:
    lora = getattr(tr, "lora", None)
    return int(lora.rank) if lora is not None and lora.rank > 0 else 0


def lora_params(spec, rank: int, targets) -> int:
    """Adapter parameters: rank·(in + out) per targeted linear layer of every layer (routed and shared
    experts each get their own MLP adapters, as PEFT does when the expert linears are targeted)."""
    if rank <= 0:
        return 0
    h, a, kv = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads
    attn = {"q_proj": (h, a * spec.qk_dim), "k_proj": (h, kv * spec.qk_dim), "v_proj": (h, kv * spec.v_dim),
            "o_proj": (a * spec.v_dim, h)}
    per_attn = sum(i + o for t, (i, o) in attn.items() if t in targets)
    mlp_names = sum(1 for t in ("gate_proj", "up_proj", "down_proj") if t in targets)
    dense_layers = spec.num_hidden_layers - spec.moe_layers
    mlp = dense_layers * mlp_names * (h + spec.intermediate_size)
    if spec.is_moe:
        copies = spec.n_routed_experts + spec.n_shared_experts
        mlp += spec.moe_layers * copies * mlp_names * (h + spec.moe_intermediate_size)
    return int(rank * (spec.num_hidden_layers * per_attn + mlp))


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
                     activation_checkpointing: bool, optimizer_dtype: str, pp: int = 1,
                     lora_rank: int = 0, lora_targets=()) -> tuple[dict, float]:
    """Per-GPU memory in GiB and the activation GiB without checkpointing (for advice). `shard` is the
    FSDP group of one pipeline stage (fsdp × cp × tp ranks); a stage holds 1/pp of the layers."""
    local = params_on_fullest_rank(spec, shard, ep) / pp
    pb, gb, ob = _bytes_per_param(optimizer_dtype)
    adapters = lora_params(spec, lora_rank, lora_targets)
    if adapters:  # frozen base in bf16 (no grads, no optimizer); the adapters train in fp32 with AdamW
        adapter_local = adapters / shard / pp
        params_b, grads_b, opt_b = local * 2.0 + adapter_local * 4.0, adapter_local * 4.0, adapter_local * 8.0
    else:
        params_b, grads_b, opt_b = local * pb, local * gb, local * ob
    s = max(1, seq_len // cp) * micro_batch  # tokens of one micro-batch on this GPU
    h = spec.hidden_size
    layers = max(1, math.ceil(spec.num_hidden_layers / pp))
    # Per-layer activation bytes (bf16, flash attention, so no s² scores): attention + norms ≈ 15·s·h,
    # gated MLP 2·s·h + 6·s·I where I counts every routed copy of a token (top_k experts + shared).
    # Everything is split over tp: tensor parallelism shards the projections and sequence parallelism
    # the norms, residuals and the checkpointed layer inputs.
    inter = spec.intermediate_size
    if spec.is_moe:
        inter = (spec.num_experts_per_tok + spec.n_shared_experts) * spec.moe_intermediate_size
    attn_width = spec.num_attention_heads * (2 * spec.qk_dim + spec.v_dim) / 3
    per_layer = (11 * s * max(h, attn_width) + 4 * s * h + 2 * s * h + 6 * s * inter) / tp
    # 1F1B keeps up to pp micro-batches in flight on the first stage: pp × (layers / pp) ≈ one model's worth.
    in_flight = pp
    full = per_layer * layers * in_flight
    kept = (2 * s * h * layers * in_flight) / tp + per_layer if activation_checkpointing else full
    # LM head: fp32 logits and their gradient for one chunk of tokens, vocab split over tp (last stage).
    logits = 2 * 4 * min(s, C.LOGITS_CHUNK_TOKENS) * spec.vocab_size / tp
    # Largest layer gathered in bf16 for compute + the prefetched one; its fp32 unsharded grads (none
    # for a frozen base).
    experts_local = spec.n_routed_experts * spec.expert_params() / ep if spec.is_moe else 0
    layer = spec.layer_params(moe=False, active=False)
    if spec.is_moe:
        layer = max(layer, spec.attention_params() + experts_local
                    + spec.n_shared_experts * spec.expert_params())
    all_gather = (2 * 2 * layer + (0 if adapters else 4 * layer)) / tp
    mem = {
        "params": params_b / GIB,
        "grads": grads_b / GIB,
        "optimizer": opt_b / GIB,
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


def per_layer_cost(spec, costs: dict, compiled: bool, compiled_moe: bool) -> float:
    """The mean over the decoder layers of a per-layer {"eager", "compiled"} cost. rlctl's trainer never
    traces the MoE block (trainer/compiled_layers.py): under `trainer.compile` an MoE layer's attention,
    norms and residuals are compiled and its MoE block's share runs eager. `compiled_moe`: a published run
    whose MoE block is fused too."""
    if not compiled:
        return costs["eager"]
    eager_moe = 0 if compiled_moe else spec.moe_layers
    share = C.TRAIN_ELEMENTWISE_MLP_SHARE
    moe_layer = (1 - share) * costs["compiled"] + share * costs["eager"]
    return ((spec.num_hidden_layers - eager_moe) * costs["compiled"] + eager_moe * moe_layer) / spec.num_hidden_layers


def _seconds_per_token(spec, tr, gpu, kind: str, mean_seq: float, cp: int, tp: int, compiled: bool,
                       compiled_moe: bool, attention_kernel: str, lora: int, lora_targets, imbalance: float) -> float:
    """Compute seconds per token on one GPU (all of the model's work split over tp)."""
    dense_f, expert_f, attn_f = flops_per_token(spec, mean_seq)
    peak = gpu.bf16_tflops * 1e12
    gemm = peak * C.per_kind(C.TRAIN_GEMM_EFF, kind) * (C.per_kind(C.TRAIN_FP8_GEMM_SPEEDUP, kind) if tr.fp8 else 1.0)
    cp_pen = 1 + C.CP_ATTN_PENALTY_PER_DOUBLING * math.log2(cp)
    attn_eff = C.per_kind(C.TRAIN_ATTN_EFF, attention_kernel)
    # Forward is 1/3 of the 6·N matmul FLOPs. A frozen base skips its weight gradients (the last 1/3);
    # the adapters add 6·r·(in+out) per token, negligible next to it but counted.
    if lora:
        dense_f, expert_f = dense_f * 2 / 3, expert_f * 2 / 3
        dense_f += 6.0 * lora_params(spec, lora, lora_targets) * (
            (spec.num_experts_per_tok + spec.n_shared_experts) / max(1, spec.n_routed_experts + spec.n_shared_experts)
            if spec.is_moe else 1.0)
    matmul_s = dense_f / gemm + expert_f * imbalance / (gemm * C.TRAIN_MOE_GEMM_EFF)
    attn_s = attn_f * cp_pen / (peak * attn_eff)
    elem_bytes = (per_layer_cost(spec, C.TRAIN_ELEMENTWISE_BYTES_PER_HIDDEN, compiled, compiled_moe)
                  * spec.hidden_size * spec.num_hidden_layers)
    elem_s = elem_bytes / (gpu.hbm_tbps * 1e12 * C.TRAIN_HBM_EFF)
    # A full recompute re-runs the forward: +1/3 of the work, +1/2 under LoRA (its backward is smaller).
    recompute = 1.0
    if tr.activation_checkpointing:
        recompute = 1 + (C.RECOMPUTE_FACTOR_FULL_AC - 1) * (1.5 if lora else 1.0)
    return recompute * (matmul_s + attn_s + elem_s) / tp


def plan_trainer(spec, tr, *, gpus: int, gpus_per_node: int, gpu, seq_len: int, tokens_per_step: int,
                 mean_seq: float, inter_gbps: float, intra_gbps: float, ep: int, cp: int, tp: int,
                 fsdp: int | None, pp: int = 1, pp_virtual_stages: int = 1, compiled: bool = False,
                 attention_kernel: str | None = None, gpu_kind: str | None = None,
                 balanced_routing: bool = False, compiled_moe: bool = False) -> TrainerPlan:
    """Size the trainer for fixed degrees (validated by the caller). fsdp None = all remaining GPUs.
    `compiled`: decoder layers through torch.compile (a recipe's `trainer.compile`; MoE blocks stay
    eager). `pp` (with its interleaving), `attention_kernel`, `balanced_routing` and `compiled_moe` (fused
    MoE blocks) describe published runs the trainer itself does not run (it has no pipeline stages);
    recipes plan with the defaults."""
    kind = gpu_kind or gpu.name
    kernel = attention_kernel or C.TRAINER_ATTENTION_KERNEL
    if spec.index_n_heads and not attention_kernel:  # DSA: dense attention under an explicit mask (no flash)
        kernel = "sdpa-masked"
    lora = lora_rank(tr)
    targets = tuple(tr.lora.target_modules) if lora else ()
    model_ranks = cp * tp * pp
    fsdp = fsdp or max(1, gpus // model_ranks)
    dp_rep = max(1, gpus // (fsdp * model_ranks))
    shard = fsdp * cp * tp
    mem, no_ac = memory_breakdown(spec, shard=shard, ep=ep, cp=cp, tp=tp, seq_len=seq_len,
                                  micro_batch=tr.micro_batch_size,
                                  activation_checkpointing=tr.activation_checkpointing,
                                  optimizer_dtype=getattr(tr, "optimizer_dtype", "float32"), pp=pp,
                                  lora_rank=lora, lora_targets=targets)
    # ---- compute: every GPU of a (tp × pp) group shares its micro-batches' work
    # A learned router sends more tokens to some EP ranks than others; the busiest sets the pace of the
    # expert GEMMs and the all-to-all (benchmarks with a forced balanced gate do not pay it).
    imbalance = 1.0 if balanced_routing or ep <= 1 else C.MOE_ROUTING_IMBALANCE
    sec_per_token = _seconds_per_token(spec, tr, gpu, kind, mean_seq, cp, tp, compiled, compiled_moe, kernel, lora,
                                       targets, imbalance)
    tokens_gpu = tokens_per_step / gpus
    dp_ranks = max(1, gpus // model_ranks)
    micro = max(1, math.ceil(tokens_per_step / dp_ranks / (seq_len * tr.micro_batch_size)))
    layers_here = math.ceil(spec.num_hidden_layers / pp)
    launch = micro * layers_here * per_layer_cost(spec, C.TRAIN_LAYER_LAUNCH_S, compiled, compiled_moe)
    compute_s = tokens_gpu * sec_per_token * tp + launch
    bubble = (pp - 1) / (micro * pp_virtual_stages) if pp > 1 else 0.0  # 1F1B, interleaved
    compute_s *= 1 + bubble
    # ---- FSDP traffic: per micro-batch, all-gather bf16 params twice (forward, backward) and
    # reduce-scatter fp32 grads once (a frozen base: no gradients); experts only within their EP shard.
    non_expert = spec.total_params - spec.expert_params_total
    gathered = (non_expert + spec.expert_params_total / ep) / tp / pp
    group_spans_nodes = shard > gpus_per_node
    link = (inter_gbps if group_spans_nodes else intra_gbps) / 8 * 1e9 * C.NET_EFF
    frac = (shard - 1) / shard
    bytes_per_param = 2 * 2 + (0 if lora else 4)
    fsdp_comm_s = micro * gathered * bytes_per_param * frac / link if link > 0 else math.inf
    # ---- tensor parallelism with sequence parallelism: 2 all-gathers + 2 reduce-scatters of the
    # micro-batch's [s, h] activations per layer and pass, exposed (no async TP in this model).
    tp_comm_s = 0.0
    if tp > 1:
        passes = 3 if tr.activation_checkpointing else 2
        s_mb = seq_len // cp * tr.micro_batch_size
        tp_link = intra_gbps / 8 * 1e9 * C.NET_EFF
        per_layer = 4 * s_mb * spec.hidden_size * 2 * (tp - 1) / tp
        tp_comm_s = micro * layers_here * passes * per_layer / tp_link if tp_link > 0 else math.inf
    # ---- EP all-to-all: dispatch + combine of top_k hidden vectors per token per MoE layer, per pass.
    ep_comm_s = 0.0
    if spec.is_moe and ep > 1:
        passes = 3 if tr.activation_checkpointing else 2
        elem = 1.5 if tr.fp8 else 2.0  # fp8 dispatch + bf16 combine
        per_token = 2 * spec.num_experts_per_tok * spec.hidden_size * elem * spec.moe_layers * passes
        ep_link = (intra_gbps if ep <= gpus_per_node else inter_gbps) / 8 * 1e9 * C.NET_EFF
        ep_comm_s = tokens_gpu * per_token * imbalance * (ep - 1) / ep / ep_link if ep_link > 0 else math.inf
    trained = lora_params(spec, lora, targets) if lora else spec.total_params
    optimizer_s = trained / shard / pp * 28 / (gpu.hbm_tbps * 1e12 * C.TRAIN_HBM_EFF)
    step = max(compute_s + ep_comm_s + tp_comm_s, fsdp_comm_s) + optimizer_s
    tps = tokens_per_step / step if step > 0 else 0.0
    dense_f, expert_f, attn_f = flops_per_token(spec, mean_seq)
    useful = (dense_f + expert_f + attn_f) * tps / gpus
    peak = gpu.bf16_tflops * 1e12
    notes = []
    if fsdp_comm_s > compute_s + ep_comm_s + tp_comm_s:
        notes.append("FSDP all-gather/reduce-scatter is the bottleneck (network-bound); more tokens per step or fewer nodes amortise it")
    return TrainerPlan(
        gpus=gpus, fsdp=fsdp, ep=ep, cp=cp, tp=tp, dp_replicate=dp_rep, memory_gib=mem,
        activations_no_ac_gib=no_ac, memory_gib_per_gpu=mem["total"], hbm_gib=round(gpu.hbm_gib, 1),
        fits=mem["total"] <= gpu.hbm_gib, tokens_per_step=int(tokens_per_step), micro_batches=micro,
        flops_per_token=dense_f + expert_f + attn_f, compute_s=compute_s, fsdp_comm_s=fsdp_comm_s,
        ep_comm_s=ep_comm_s, step_time_s=step, tokens_per_s=tps, mfu=useful / peak, pp=pp, tp_comm_s=tp_comm_s,
        lora_params=lora_params(spec, lora, targets), notes=notes,
    )
