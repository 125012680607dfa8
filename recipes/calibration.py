"""Every efficiency factor of `rlctl plan`, in one place, with the published run it was fitted to.

The planner is a roofline model: time = work / (peak × efficiency). The peaks come from the GPU
catalog (recipes/hardware.py); the efficiencies below are the only tuned numbers. Each is a
physical quantity (a fraction of a datasheet peak, a latency, a byte count), not a correction
applied to a final result. `tests/test_plan.py` checks the calibration runs stay within ±25%.
"""
from __future__ import annotations

# ---- trainer (FSDP2) ----------------------------------------------------------------------------
TRAIN_MFU_DENSE = 0.30
"""Achieved fraction of the bf16 peak for dense matmuls in FSDP2 eager training (no torch.compile).
Fitted to torchtitan Llama-3.1-8B, 8×H100, seq 8192, selective AC: 5,762 tok/s/GPU."""
TRAIN_ATTN_EFF = 0.25
"""Achieved fraction of the bf16 peak in flash-attention forward/backward (lower than GEMMs)."""
TRAIN_MOE_GEMM_EFF = 0.25
"""Grouped expert GEMMs relative to dense GEMMs: few tokens per expert per micro-batch, token
permutation and load imbalance. Fitted to the prime-rl GLM-5 trainer step (3.7 min on 12 H200 nodes)."""
TRAIN_FP8_GEMM_SPEEDUP = 1.34
"""Speed-up of matmuls with FP8 block-scaled training (torchtitan 8B: compile 6,667 → Float8 8,532 tok/s/GPU,
attention unchanged, so the linear layers gained ≈1.34×)."""
RECOMPUTE_FACTOR_FULL_AC = 4.0 / 3.0
"""Full activation checkpointing re-runs the forward pass: 3 units of compute become 4."""
CP_ATTN_PENALTY_PER_DOUBLING = 0.2
"""Ring/Ulysses context parallelism: extra attention time per doubling of cp (load imbalance,
exposed KV exchange). torchtitan 8B Table 2 shows attention slowing ≈1.0–1.7× from cp 2 to 8."""
NET_EFF = 0.7
"""Achieved fraction of link bandwidth for NCCL all-gather/reduce-scatter and all-to-all."""
TRAIN_RESERVED_GIB = 5.0
"""CUDA context, NCCL buffers and allocator fragmentation per trainer GPU."""
LOGITS_CHUNK_TOKENS = 4096
"""The trainer computes the LM head and its loss in chunks of this many tokens (fp32 logits + grad)."""

# ---- inference (vLLM) ---------------------------------------------------------------------------
DECODE_HBM_EFF = 0.75
"""Achieved fraction of HBM bandwidth while streaming weights and KV cache in decode."""
DECODE_COMPUTE_EFF = 0.45
"""Achieved fraction of the tensor-core peak for decode GEMMs at large batch."""
DECODE_STEP_OVERHEAD_S = 0.003
"""Per decode step: scheduling, sampling, detokenization (vLLM V1 with CUDA graphs). With the two
above, fitted to vLLM decoding a 7B model on one H100 at 64 concurrent sequences: ≈6,300 tok/s."""
PREFILL_MFU = 0.5
"""Achieved fraction of peak in compute-bound prefill (chunked prefill, large token batches)."""
EP_A2A_LATENCY_INTRA_S = 30e-6
"""One expert-parallel dispatch or combine inside a node (NVLink, DeepEP low-latency kernels)."""
EP_A2A_LATENCY_INTER_S = 120e-6
"""One expert-parallel dispatch or combine across nodes (RDMA; DeepEP low-latency kernels)."""
TP_ALLREDUCE_LATENCY_S = 12e-6
"""One tensor-parallel all-reduce of a decode step's activations over NVLink."""
INFER_ACTIVATION_GIB = 4.0
"""Activation peak + CUDA graphs + sampler buffers that vLLM reserves outside the KV cache."""
VLLM_MAX_NUM_SEQS = 1024
"""vLLM's default cap on running sequences per engine (DP rank) on ≥ 70 GB GPUs."""
KV_BYTES = 2.0
"""KV-cache element size (bf16; vLLM keeps the model dtype unless kv_cache_dtype is set)."""
CPU_DECODE_TOKENS_PER_S = 3000.0
"""Measured: vLLM CPU build, tiny Qwen3, 256–512 concurrent short requests on a 2-core box."""
CPU_TRAIN_TOKENS_PER_S = 20000.0
"""Measured: FSDP2 on gloo, tiny Qwen3, 2 ranks (≈72 ms per 64×64-token step incl. optimizer)."""
