"""Inference sizing for `rlctl plan`: per-replica TP/DP/EP, weights and KV cache per GPU, concurrency,
prefill (compute-bound) and decode (bandwidth vs compute roofline) throughput, rollout step time."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from rlctl.recipes import calibration as C

GIB = 2**30


@dataclass
class InferencePlan:
    gpus: int
    tp: int
    dp_per_replica: int
    ep: bool
    replicas: int
    prefill_gpus: int
    decode_gpus: int
    weights_gib_per_gpu: float
    kv_cache_gib_per_gpu: float
    kv_bytes_per_token: float
    kv_tokens_per_gpu: int
    max_concurrent_rollouts: int
    concurrency: int
    decode_batch_per_rank: float
    decode_step_s: float
    decode_bound: str
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    prompt_tokens: int
    completion_tokens: int
    rollout_step_time_s: float | None
    """None when no rollout can run (no KV cache for one): `notes` says why."""
    fits: bool
    usable_gib_per_gpu: float = 0.0
    """vLLM's budget on one GPU: gpu_memory_utilization × the memory CUDA reports."""
    replica_memory_gib: dict = field(default_factory=dict)
    """Per replica kind (`decode`, and `prefill` in a P/D deployment), GiB on one of its GPUs: weights,
    activations (vLLM's profiling peak, sampler, CUDA graphs, adapters), the KV cache the rest leaves,
    and kv_needed, the least KV it must hold (decode: one rollout; prefill: one prompt chunk)."""
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def weight_bytes(spec, fp8: bool) -> tuple[float, float]:
    """(non-expert, expert) weight bytes of the whole model; FP8 stores matmul weights in 1 byte."""
    embed = spec.embedding_params()
    expert = spec.expert_params_total
    other = spec.total_params - expert - embed
    mm = 1.0 if fp8 else 2.0
    return other * mm + embed * 2.0, expert * mm


def weights_per_gpu(spec, fp8: bool, tp: int, ep_group: int) -> tuple[float, float]:
    """(non-expert, expert) bytes on one GPU: dense weights split over TP, experts over the EP group."""
    other, expert = weight_bytes(spec, fp8)
    return other / tp, expert / max(ep_group, tp)


def kv_bytes_per_token_per_gpu(spec, tp: int) -> float:
    """GQA: each TP rank holds n_kv/tp heads (at least one: heads are replicated when tp > n_kv).
    MLA: the compressed latent is not split by heads, so every TP rank stores it whole."""
    full = spec.kv_bytes_per_token(C.KV_BYTES)
    if spec.is_mla:
        return full
    return full / min(tp, spec.num_key_value_heads)


def gpu_max_num_seqs(inf) -> int:
    """Sequences one GPU engine (DP rank) runs at once: the recipe's, else vLLM's default."""
    return inf.engine_max_num_seqs(C.VLLM_MAX_NUM_SEQS)


def activation_reserve_bytes(spec, tp: int, max_num_seqs: int, lora_bytes: float = 0.0) -> float:
    """What vLLM keeps outside the KV cache besides the weights: the activation peak of its profiling
    forward pass (VLLM_MAX_NUM_BATCHED_TOKENS tokens through the widest layer, split over tp), the
    sampler's fp32 logits for max_num_seqs sequences, non-torch memory and CUDA graphs, and the LoRA
    adapters it holds. Llama-3.1-8B on one H100: ≈ 1.2 GiB + 0.5 GiB, as vLLM logs it."""
    tokens = C.VLLM_MAX_NUM_BATCHED_TOKENS
    inter = spec.intermediate_size
    if spec.is_moe:
        inter = max(inter if spec.dense_layers else 0, spec.num_experts_per_tok * spec.moe_intermediate_size)
    width = 2 * inter + 4 * spec.hidden_size  # gate/up output + residual, normed input, attention output
    act = tokens * width * 2 / tp
    sampler = max_num_seqs * spec.vocab_size * 4 / tp
    return act + sampler + C.VLLM_NON_TORCH_GIB * GIB + lora_bytes


def lora_adapter_bytes(lora_params: int, tp: int) -> float:
    """Bytes of the bf16 LoRA adapters one engine GPU holds (vLLM's max_loras slots, split over tp)."""
    return C.LORA_MAX_LORAS * lora_params * 2.0 / tp


def choose_tp(spec, inf, gpu, gpus_per_node: int, lora_params: int = 0) -> int:
    """Smallest power-of-two TP (≤ a node) whose weights leave at least half the budget for KV cache.
    The budget is the one the plan reports for that TP (`_kv_budget`), so the two cannot disagree:
    weights ≤ half of (budget − reserve) is weights ≤ the KV cache left after them."""
    tp = 1
    while tp < max(1, gpus_per_node):
        kv, other, expert, _ = _kv_budget(spec, inf, gpu, tp, gpus_per_node if inf.ep else tp,
                                          lora_adapter_bytes(lora_params, tp))
        if other + expert <= kv and spec.num_attention_heads % tp == 0:
            break
        tp *= 2
    return min(tp, max(1, gpus_per_node))


def decode_step(spec, *, batch: float, ctx: float, tp: int, ep_group: int, ep_inter_node: bool, fp8: bool,
                gpu, weights_other: float, weights_expert: float, kv_per_tok_gpu: float,
                eager: bool = False) -> tuple[float, str]:
    """Seconds per decode step of one DP rank holding `batch` sequences, and what bounds it."""
    # Experts touched this step: with T routed tokens in the EP group, each expert is hit with
    # probability 1 - (1 - k/E)^T; untouched experts are not read.
    touched = 1.0
    if spec.is_moe:
        tokens = batch * max(1, ep_group // tp)
        touched = 1 - (1 - spec.num_experts_per_tok / spec.n_routed_experts) ** tokens
    if spec.index_topk:  # DSA: latent KV of the top-k tokens + the indexer keys of the whole context
        latent = (spec.kv_lora_rank + spec.qk_rope_head_dim) * C.KV_BYTES * spec.num_hidden_layers
        kv_read = min(ctx, spec.index_topk) * latent + ctx * (kv_per_tok_gpu - latent)
    else:
        kv_read = ctx * kv_per_tok_gpu
    hbm = gpu.hbm_tbps * 1e12 * C.per_kind(C.DECODE_HBM_EFF, gpu.name)
    mem_s = (weights_other + weights_expert * touched + batch * kv_read) / hbm
    peak = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
    attn_flops = 4 * spec.num_hidden_layers * spec.num_attention_heads * (spec.qk_dim + spec.v_dim) / 2 * min(
        ctx, spec.index_topk or ctx)
    compute_s = batch * (2 * spec.active_params + attn_flops) / tp / (peak * C.DECODE_COMPUTE_EFF)
    comm_s = 0.0
    if tp > 1:
        comm_s += 2 * spec.num_hidden_layers * C.TP_ALLREDUCE_LATENCY_S
    if spec.is_moe and ep_group > tp:
        lat = C.EP_A2A_LATENCY_INTER_S if ep_inter_node else C.EP_A2A_LATENCY_INTRA_S
        comm_s += 2 * spec.moe_layers * lat
    if eager:  # no CUDA graphs: each layer's kernels are launched one by one from Python
        comm_s += spec.num_hidden_layers * C.DECODE_EAGER_STEP_OVERHEAD_PER_LAYER_S
    bound = "memory-bandwidth" if mem_s >= compute_s else "compute"
    return max(mem_s, compute_s) + comm_s + C.DECODE_STEP_OVERHEAD_S, bound


def prefill_tokens_per_s(spec, gpus: int, gpu, fp8: bool, mean_ctx: float) -> float:
    """Compute-bound prefill: matmuls at PREFILL_GEMM_EFF of the (fp8 or bf16) peak, causal attention
    over `mean_ctx` earlier tokens at the efficiency of vLLM's attention kernel on this GPU (bf16)."""
    peak = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
    ctx = min(mean_ctx, spec.index_topk) if spec.index_topk else mean_ctx
    attn = 4 * spec.num_hidden_layers * spec.num_attention_heads * (spec.qk_dim + spec.v_dim) / 2 * ctx
    kernel = C.per_kind(C.INFER_ATTENTION_KERNEL, gpu.name)
    s_per_token = (2 * spec.active_params / (peak * C.PREFILL_GEMM_EFF)
                   + attn / (gpu.bf16_tflops * 1e12 * C.per_kind(C.PREFILL_ATTN_EFF, kernel)))
    return gpus / s_per_token


def _kv_budget(spec, inf, gpu, tp: int, ep_group: int, lora_bytes: float) -> tuple[float, float, float, float]:
    """(KV-cache bytes per GPU, non-expert weight bytes, expert weight bytes, activation reserve) of one
    replica's GPU: gpu_memory_utilization × the device total, less weights, the reserve and adapters."""
    w_other, w_expert = weights_per_gpu(spec, inf.fp8, tp, ep_group)
    reserve = activation_reserve_bytes(spec, tp, gpu_max_num_seqs(inf), lora_bytes)
    budget = inf.gpu_memory_utilization * gpu.hbm_bytes - reserve - w_other - w_expert
    return budget, w_other, w_expert, reserve


def _replica_memory(weights: float, reserve: float, budget: float, kv_needed: float) -> dict:
    return {"weights": round(weights / GIB, 3), "activations": round(reserve / GIB, 3),
            "kv_cache": round(max(0.0, budget) / GIB, 3), "kv_needed": round(kv_needed / GIB, 3)}


def plan_inference(spec, inf, *, nodes: int, gpus_per_node: int, gpu, rollouts: int, mean_tokens: int,
                   completion_tokens: int, max_in_flight: int, tp: int, dp: int | None,
                   lora_params: int = 0) -> InferencePlan:
    """Size inference on `nodes` nodes for one batch of `rollouts` rollouts (degrees already validated).
    `lora_params` > 0: every engine serves the policy's current adapter (bf16) beside the frozen base."""
    gpus = nodes * gpus_per_node
    notes: list[str] = []
    dis = inf.disaggregation
    if dis.enabled:
        prefill_gpus = dis.prefill_replicas * dis.prefill_nodes_per_replica * gpus_per_node
        decode_gpus = dis.decode_replicas * dis.decode_nodes_per_replica * gpus_per_node
        replica_gpus = dis.decode_nodes_per_replica * gpus_per_node
        replicas = dis.decode_replicas
    else:
        prefill_gpus, decode_gpus = 0, gpus
        replica_gpus = dp * tp if dp else tp
        replicas = max(1, gpus // replica_gpus)
    moe_ep = bool(inf.ep and spec.is_moe)
    ep_group = replica_gpus if moe_ep else tp
    lora_bytes = lora_adapter_bytes(lora_params, tp)
    budget, w_other, w_expert, reserve = _kv_budget(spec, inf, gpu, tp, ep_group, lora_bytes)
    kv_tok_gpu = kv_bytes_per_token_per_gpu(spec, tp)
    memory = {"decode": _replica_memory(w_other + w_expert, reserve, budget, kv_tok_gpu * mean_tokens)}
    kv_tokens = max(0, int(budget // kv_tok_gpu))
    fits = budget > 0
    if not fits:
        notes.append(f"weights need {(w_other + w_expert) / GIB:.1f} GiB/GPU, more than the "
                     f"{inf.gpu_memory_utilization:.2f} × {gpu.hbm_gib:.1f} GiB budget less activations")
    if dis.enabled:  # prefill replicas hold the same weights over their own EP group and need KV for a prompt
        p_group = dis.prefill_nodes_per_replica * gpus_per_node if moe_ep else tp
        p_budget, p_other, p_expert, p_reserve = _kv_budget(spec, inf, gpu, tp, p_group, lora_bytes)
        p_needed = kv_tok_gpu * min(inf.max_model_len, C.VLLM_MAX_NUM_BATCHED_TOKENS)
        memory["prefill"] = _replica_memory(p_other + p_expert, p_reserve, p_budget, p_needed)
        if p_budget < p_needed:
            fits = False
            notes.append(f"prefill replicas ({dis.prefill_nodes_per_replica} node(s) each) need "
                         f"{(p_other + p_expert) / GIB:.1f} GiB/GPU of weights and leave no KV cache for a "
                         f"prompt in {inf.gpu_memory_utilization:.2f} × {gpu.hbm_gib:.1f} GiB — raise "
                         "inference.disaggregation.prefill_nodes_per_replica")
    ranks = max(1, decode_gpus // tp)
    prompt = max(0, mean_tokens - completion_tokens)
    # Each DP rank (tp GPUs) holds its own sequences; its KV capacity is what one GPU holds.
    per_rank_at_max = kv_tokens // max(1, inf.max_model_len)
    max_seqs = gpu_max_num_seqs(inf)
    max_concurrent = ranks * min(per_rank_at_max, max_seqs)
    per_rank_at_mean = min(kv_tokens // max(1, mean_tokens), max_seqs)
    concurrency = max(0, min(max_in_flight, ranks * per_rank_at_mean))
    if fits and concurrency < max_in_flight:
        notes.append(f"KV cache holds only {concurrency} rollouts of {mean_tokens} tokens at once "
                     f"(orchestrator wants {max_in_flight} in flight)")
    batch = max(concurrency / ranks, 1e-9)
    ctx = prompt + completion_tokens / 2
    step_s, bound = decode_step(spec, batch=max(batch, 1.0), ctx=ctx, tp=tp, ep_group=ep_group,
                                ep_inter_node=ep_group > gpus_per_node, fp8=inf.fp8, gpu=gpu,
                                weights_other=w_other, weights_expert=w_expert, kv_per_tok_gpu=kv_tok_gpu,
                                eager=getattr(inf, "enforce_eager", False))
    decode_tps = ranks * batch / step_s if concurrency else 0.0
    prefill_tps = prefill_tokens_per_s(spec, prefill_gpus or decode_gpus, gpu, inf.fp8, prompt / 2)
    decode_time = rollouts * completion_tokens / decode_tps if decode_tps else math.inf
    prefill_time = rollouts * prompt / prefill_tps if prefill_tps else math.inf
    # Disaggregated prefill runs beside decode; otherwise both share the same GPUs.
    rollout_s = max(decode_time, prefill_time) if dis.enabled else decode_time + prefill_time
    if not math.isfinite(rollout_s):  # a figure, not Infinity: the plan says why instead
        rollout_s = None
        notes.append(f"no rollout of {mean_tokens} tokens fits in a GPU's KV cache, so none is decoded and "
                     "the rollout step time is unknown")
    return InferencePlan(
        gpus=gpus, tp=tp, dp_per_replica=max(1, replica_gpus // tp), ep=moe_ep,
        replicas=replicas, prefill_gpus=prefill_gpus, decode_gpus=decode_gpus,
        weights_gib_per_gpu=round((w_other + w_expert) / GIB, 2),
        kv_cache_gib_per_gpu=round(max(0.0, budget) / GIB, 2), kv_bytes_per_token=kv_tok_gpu,
        kv_tokens_per_gpu=kv_tokens, max_concurrent_rollouts=int(max_concurrent), concurrency=int(concurrency),
        decode_batch_per_rank=round(batch, 2), decode_step_s=step_s, decode_bound=bound,
        decode_tokens_per_s=decode_tps, prefill_tokens_per_s=prefill_tps, prompt_tokens=prompt,
        completion_tokens=completion_tokens, rollout_step_time_s=rollout_s, fits=fits and concurrency > 0,
        usable_gib_per_gpu=round(inf.gpu_memory_utilization * gpu.hbm_bytes / GIB, 3), replica_memory_gib=memory,
        notes=notes,
    )
