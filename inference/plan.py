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
    rollout_step_time_s: float
    fits: bool
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


def choose_tp(spec, fp8: bool, gpu, util: float, gpus_per_node: int, ep: bool) -> int:
    """Smallest power-of-two TP (≤ a node) whose weights leave at least half the budget for KV cache."""
    budget = util * gpu.hbm_bytes - C.INFER_ACTIVATION_GIB * GIB
    tp = 1
    while tp < max(1, gpus_per_node):
        other, expert = weights_per_gpu(spec, fp8, tp, gpus_per_node if ep else tp)
        if other + expert <= 0.5 * budget and spec.num_attention_heads % tp == 0:
            break
        tp *= 2
    return min(tp, max(1, gpus_per_node))


def decode_step(spec, *, batch: float, ctx: float, tp: int, ep_group: int, ep_inter_node: bool, fp8: bool,
                gpu, weights_other: float, weights_expert: float, kv_per_tok_gpu: float) -> tuple[float, str]:
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
    mem_s = (weights_other + weights_expert * touched + batch * kv_read) / (gpu.hbm_tbps * 1e12 * C.DECODE_HBM_EFF)
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
    bound = "memory-bandwidth" if mem_s >= compute_s else "compute"
    return max(mem_s, compute_s) + comm_s + C.DECODE_STEP_OVERHEAD_S, bound


def prefill_tokens_per_s(spec, gpus: int, gpu, fp8: bool, mean_ctx: float) -> float:
    peak = (gpu.fp8_tflops if fp8 else gpu.bf16_tflops) * 1e12
    ctx = min(mean_ctx, spec.index_topk) if spec.index_topk else mean_ctx
    flops = 2 * spec.active_params + 4 * spec.num_hidden_layers * spec.num_attention_heads * (
        spec.qk_dim + spec.v_dim) / 2 * ctx
    return gpus * peak * C.PREFILL_MFU / flops


def plan_inference(spec, inf, *, nodes: int, gpus_per_node: int, gpu, rollouts: int, mean_tokens: int,
                   completion_tokens: int, max_in_flight: int, tp: int, dp: int | None) -> InferencePlan:
    """Size inference on `nodes` nodes for one batch of `rollouts` rollouts (degrees already validated)."""
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
    ep_group = replica_gpus if (inf.ep and spec.is_moe) else tp
    w_other, w_expert = weights_per_gpu(spec, inf.fp8, tp, ep_group)
    budget = inf.gpu_memory_utilization * gpu.hbm_bytes - C.INFER_ACTIVATION_GIB * GIB - w_other - w_expert
    kv_tok_gpu = kv_bytes_per_token_per_gpu(spec, tp)
    kv_tokens = max(0, int(budget // kv_tok_gpu))
    fits = budget > 0
    ranks = max(1, decode_gpus // tp)
    prompt = max(0, mean_tokens - completion_tokens)
    # Each DP rank (tp GPUs) holds its own sequences; its KV capacity is what one GPU holds.
    per_rank_at_max = kv_tokens // max(1, inf.max_model_len)
    max_concurrent = ranks * min(per_rank_at_max, C.VLLM_MAX_NUM_SEQS)
    per_rank_at_mean = min(kv_tokens // max(1, mean_tokens), C.VLLM_MAX_NUM_SEQS)
    concurrency = max(0, min(max_in_flight, ranks * per_rank_at_mean))
    if not fits:
        notes.append(f"weights need {(w_other + w_expert) / GIB:.1f} GiB/GPU, more than the "
                     f"{inf.gpu_memory_utilization:.2f} × {gpu.hbm_gib:.0f} GiB budget")
    elif concurrency < max_in_flight:
        notes.append(f"KV cache holds only {concurrency} rollouts of {mean_tokens} tokens at once "
                     f"(orchestrator wants {max_in_flight} in flight)")
    batch = max(concurrency / ranks, 1e-9)
    ctx = prompt + completion_tokens / 2
    step_s, bound = decode_step(spec, batch=max(batch, 1.0), ctx=ctx, tp=tp, ep_group=ep_group,
                                ep_inter_node=ep_group > gpus_per_node, fp8=inf.fp8, gpu=gpu,
                                weights_other=w_other, weights_expert=w_expert, kv_per_tok_gpu=kv_tok_gpu)
    decode_tps = ranks * batch / step_s if concurrency else 0.0
    prefill_tps = prefill_tokens_per_s(spec, prefill_gpus or decode_gpus, gpu, inf.fp8, prompt / 2)
    decode_time = rollouts * completion_tokens / decode_tps if decode_tps else math.inf
    prefill_time = rollouts * prompt / prefill_tps if prefill_tps else math.inf
    # Disaggregated prefill runs beside decode; otherwise both share the same GPUs.
    rollout_s = max(decode_time, prefill_time) if dis.enabled else decode_time + prefill_time
    return InferencePlan(
        gpus=gpus, tp=tp, dp_per_replica=max(1, replica_gpus // tp), ep=bool(inf.ep and spec.is_moe),
        replicas=replicas, prefill_gpus=prefill_gpus, decode_gpus=decode_gpus,
        weights_gib_per_gpu=round((w_other + w_expert) / GIB, 2),
        kv_cache_gib_per_gpu=round(max(0.0, budget) / GIB, 2), kv_bytes_per_token=kv_tok_gpu,
        kv_tokens_per_gpu=kv_tokens, max_concurrent_rollouts=int(max_concurrent), concurrency=int(concurrency),
        decode_batch_per_rank=round(batch, 2), decode_step_s=step_s, decode_bound=bound,
        decode_tokens_per_s=decode_tps, prefill_tokens_per_s=prefill_tps, prompt_tokens=prompt,
        completion_tokens=completion_tokens, rollout_step_time_s=rollout_s, fits=fits and concurrency > 0,
        notes=notes,
    )
