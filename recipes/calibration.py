"""Every efficiency factor of `rlctl plan`, in one place, with the published run it was fitted to.

The planner is a roofline model: time = work / (peak × efficiency). The peaks come from the GPU
catalog (recipes/hardware.py); the efficiencies below are the only tuned numbers. Each is a
physical quantity (a fraction of a datasheet peak, a latency, a byte count), not a correction
applied to a final result. Dicts are keyed by GPU kind (a key of hardware.GPUS) or attention kernel;
the planner reads every name at call time as `C.NAME`, so a calibration file may replace them.
`tests/test_plan_published.py` checks the planner against published runs (its table names each source).
"""
from __future__ import annotations

# ---- trainer (FSDP2): matmuls ------------------------------------------------------------------
TRAIN_GEMM_EFF = {"h100-96gb": 0.42, "h100-sxm": 0.52, "h200": 0.52, "b200": 0.52, "a100-80gb": 0.60,
                  "cpu": 0.5}
"""Achieved fraction of the dense BF16 peak in the trainer's large matmuls (bf16 in, fp32 accumulate).
h100-96gb: fitted to torchtitan Llama-3.1-8B on 8 power-capped (500 W) H100s, 5,762 tok/s/GPU
(pytorch/torchtitan docs/performance.md Table 1), with the attention, elementwise and launch terms below.
h100-sxm (700 W): fitted to NeMo AutoModel Qwen3-30B-A3B on a DGX-H100, 11,842 tok/s/GPU
(NVIDIA-NeMo/Automodel docs/performance-summary.md). h200 has the H100's tensor cores and clocks:
the same fraction (its faster HBM enters through TRAIN_ELEMENTWISE_BYTES_PER_HIDDEN). b200: no FSDP2
figure found; assumed the H100 SXM fraction. a100-80gb: torchtitan's A100 Llama-3 8B run reports
56.8% MFU (selective AC, torch.compile) — the matmul fraction lies above that."""
TRAIN_FP8_GEMM_SPEEDUP = {"h100-96gb": 1.5, "h100-sxm": 1.5, "h200": 1.5, "b200": 1.5, "a100-80gb": 1.0,
                          "cpu": 1.0}
"""Speed-up of the linear layers with FP8 rowwise/tensorwise training (torchao float8), relative to bf16.
The tensor cores are 2× faster but the casts and amax reductions are not free: torchtitan 8B goes
6,667 → 8,532 tok/s/GPU with Float8 (Table 1); with attention and elementwise time unchanged this is
≈1.5× on the matmuls. No FP8 units on A100 (the trainer refuses fp8 there)."""
TRAIN_MOE_GEMM_EFF = 0.55
"""Grouped expert GEMMs relative to dense GEMMs: few tokens per expert per micro-batch, token
permutation, padding to the GEMM tile. Fitted with the GLM-5 trainer step (3.7 min on 12 H200 nodes,
prime-rl) and NeMo AutoModel Qwen3-30B-A3B (DeepEP, balanced gate) on DGX-H100."""
MOE_ROUTING_IMBALANCE = 1.6
"""Tokens on the busiest expert-parallel rank over the mean, with a learned router in RL (no auxiliary
balancing at this point of training): it scales the expert GEMM time and the all-to-all. Fitted with
the GLM-5 trainer step (3.7 min, prime-rl) after TRAIN_MOE_GEMM_EFF was fitted on a benchmark with a
forced balanced gate (NeMo AutoModel's `fake_balanced_gate: true`, imbalance 1)."""

# ---- trainer: attention -------------------------------------------------------------------------
TRAIN_ATTN_EFF = {"fa2": 0.33, "fa3": 0.50, "sdpa-masked": 0.15, "cpu": 0.5}
"""Achieved fraction of the bf16 peak in causal flash attention forward + backward, by kernel.
FlashAttention-2 on H100 reaches ≈35% of peak forward and less backward; FlashAttention-3 (Hopper
warp-specialised) 1.5–2× that (Shah et al. 2024, arXiv:2407.08608, Figs. 5–7: FA2 ≈ 330–370, FA3
≈ 500–660 TFLOP/s forward bf16 at 8k–16k heads-dim 128). The trainer calls torch SDPA, which runs
FA2 kernels on Hopper. Fitted with torchtitan Table 2 (8B at 32k–262k) together with the CP penalty.
sdpa-masked: SDPA given an explicit mask (DSA models such as GLM-5 train dense attention under the
indexer's mask, as the HF reference does) cannot use the flash kernel and falls back to the
memory-efficient one, about half as fast as FA2 (FlashAttention-2 paper, arXiv:2307.08691, Fig. 4:
xformers/cutlass vs FA2); with the GLM-5 trainer step."""
TRAINER_ATTENTION_KERNEL = "fa2"
"""The kernel the trainer runs (torch SDPA's flash backend = FlashAttention-2)."""
CP_ATTN_PENALTY_PER_DOUBLING = 0.35
"""Ring/Ulysses context parallelism: extra attention time per doubling of cp (load imbalance of the
causal mask, exposed KV exchange, smaller attention blocks). Fitted to torchtitan 8B Table 2
(FSDP × CP at 65k–262k: 2,540 / 1,071 / 548 tok/s/GPU)."""

# ---- trainer: memory-bound work and fixed costs -------------------------------------------------
TRAIN_ELEMENTWISE_BYTES_PER_HIDDEN = {"eager": 420.0, "compiled": 150.0}
"""HBM bytes moved per token, per layer, per unit of hidden size by the non-matmul kernels of one
forward + backward (RMSNorm, RoPE, SwiGLU, residual adds, dtype casts, FSDP copy-in/out). Eager
PyTorch reads and writes each intermediate in its own kernel; torch.compile fuses them (fewer passes).
Fitted to torchtitan 8B Table 1: FSDP 5,762 → FSDP + torch.compile 6,667 tok/s/GPU, with the
matmul time unchanged. This is the term that makes H200 (4.8 TB/s) faster than H100 at equal FLOP/s."""
TRAIN_HBM_EFF = 0.8
"""Achieved fraction of HBM bandwidth in streaming elementwise kernels."""
TRAIN_LAYER_LAUNCH_S = {"eager": 1.2e-3, "compiled": 0.6e-3}
"""Fixed cost per layer per micro-batch (forward + backward): kernel launches, FSDP2 pre/post hooks,
stream waits, the CPU side of autograd. It does not shrink with the tokens of the micro-batch, which is
why trainer throughput stays nearly flat between short and long sequences at equal tokens per step."""
TRAIN_ELEMENTWISE_MLP_SHARE = 0.55
"""The MLP block's share of a layer's elementwise bytes and launches, the part `trainer.compile` leaves
eager in an MoE layer. Counted, not fitted, from one Llama-3 8B layer's forward kernels in units of the
hidden size: the MLP's norm, SwiGLU over its 3.5x-wide intermediate and residual add move about 26, the
attention block's norm, RoPE on q and k and residual add about 19 (0.58); an MoE block's top-k
intermediates, router and token copies come to about as much, so one share serves both."""
RECOMPUTE_FACTOR_FULL_AC = 4.0 / 3.0
"""Full activation checkpointing re-runs the forward pass: 3 units of compute become 4 (LoRA: its
backward has no weight gradients of the base, so the forward is 1/2 of the rest, see trainer/plan.py)."""

# ---- trainer: network and memory ----------------------------------------------------------------
NET_EFF = 0.7
"""Achieved fraction of link bandwidth for NCCL all-gather/reduce-scatter and all-to-all."""
TRAIN_RESERVED_GIB = 5.0
"""CUDA context, NCCL buffers and allocator fragmentation per trainer GPU."""
LOGITS_CHUNK_TOKENS = 4096
"""The trainer computes the LM head and its loss in chunks of this many tokens (fp32 logits + grad)."""

# ---- inference (vLLM) ---------------------------------------------------------------------------
DECODE_HBM_EFF = {"h100-sxm": 0.75, "h100-96gb": 0.75, "h200": 0.75, "b200": 0.7, "a100-80gb": 0.75,
                  "cpu": 0.5}
"""Achieved fraction of HBM bandwidth while streaming weights and KV cache in decode. Fitted to vLLM
decoding a 7B model on one H100 at 64 concurrent sequences: ≈6,300 tok/s (the original calibration);
H200 shares the H100's memory system design (HBM3e at 4.8 TB/s); B200 assumed slightly lower."""
DECODE_COMPUTE_EFF = 0.45
"""Achieved fraction of the tensor-core peak for decode GEMMs at large batch."""
DECODE_STEP_OVERHEAD_S = 0.003
"""Per decode step: scheduling, sampling, detokenization (vLLM V1 with CUDA graphs)."""
DECODE_EAGER_STEP_OVERHEAD_PER_LAYER_S = 60e-6
"""Extra per decode step and layer with `enforce_eager` (no CUDA graphs: every kernel is launched
from Python; vLLM's docs warn of markedly lower decode throughput)."""
PREFILL_GEMM_EFF = 0.45
"""Achieved fraction of peak in the matmuls of compute-bound prefill (chunked, ≤ 8192-token batches,
mixed with decode). Fitted to vLLM 0.11 serving Qwen3-32B on one H100, 100 random prompts of 32,000
tokens (gpustack docs/performance-lab/qwen3-32b/h100.md: 1,157 s)."""
INFER_ATTENTION_KERNEL = {"h100-sxm": "fa3", "h100-96gb": "fa3", "h200": "fa3", "b200": "fa3",
                          "a100-80gb": "fa2", "cpu": "cpu"}
"""vLLM's attention backend by GPU: FlashAttention-3 on Hopper/Blackwell, FA2 on Ampere."""
PREFILL_ATTN_EFF = {"fa2": 0.30, "fa3": 0.35, "cpu": 0.5}
"""Forward-only causal flash attention over a paged KV cache in chunked prefill, fraction of peak:
below the kernels' dense benchmarks (FA3 paper, arXiv:2407.08608: ≈ 50–60% forward causal bf16)
because each chunk attends to a paged prefix in blocks; with the 32k-prompt row above."""
EP_A2A_LATENCY_INTRA_S = 30e-6
"""One expert-parallel dispatch or combine inside a node (NVLink, DeepEP low-latency kernels)."""
EP_A2A_LATENCY_INTER_S = 120e-6
"""One expert-parallel dispatch or combine across nodes (RDMA; DeepEP low-latency kernels)."""
TP_ALLREDUCE_LATENCY_S = 12e-6
"""One tensor-parallel all-reduce of a decode step's activations over NVLink."""
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's default token budget per scheduler step for serving on ≥ 70 GB GPUs; its memory profiling
runs one forward pass of this many tokens, which sets the activation peak kept out of the KV cache."""
VLLM_NON_TORCH_GIB = 0.5
"""Memory vLLM counts outside PyTorch's allocator (NCCL, cuBLAS workspaces) plus CUDA graphs: vLLM
logs `non_torch_memory takes 0.1–0.4GiB` on one H100, CUDA graphs ≈ 0.1–0.5 GiB."""
VLLM_MAX_NUM_SEQS = 1024
"""vLLM's default cap on running sequences per engine (DP rank) on ≥ 70 GB GPUs
(`inference.max_num_seqs` overrides it)."""
VLLM_CPU_MAX_NUM_SEQS = 128
"""vLLM's default cap on running sequences of a CPU API server (`inference.max_num_seqs` overrides it)."""
KV_BYTES = 2.0
"""KV-cache element size (bf16; vLLM keeps the model dtype unless kv_cache_dtype is set)."""
LORA_MAX_LORAS = 1
"""Adapters each vLLM engine keeps on the GPU for RL (the policy's current one)."""

# ---- the async step and the weight sync (the model is recipes/plan_sync.py) ----------------------
ASYNC_STEP_SYNC_S = 0.0
"""Seconds per step on the trainer's side of the async loop that the model does not explain: what a
run spends between trainer steps beyond the trainer step and the modelled weight sync (the off-policy
gate handing over, HTTP round trips, marker polling). 0 by default; `rlctl plan --calibrate` sets it
from a trainer-bound run (its median orchestrator step minus its planned trainer step and the planned
trainer-side sync). Before the sync was modelled, the tiny-cpu runs gave 0.06-0.10 s on 0.23-0.30 s
trainer steps, publish and reload included."""
WEIGHT_RELOAD_FIXED_S = {"h100-sxm": 2.0, "h100-96gb": 2.0, "h200": 2.0, "b200": 2.0, "a100-80gb": 2.0,
                         "cpu": 0.05}
"""Fixed part of one weight sync on the servers, whatever the bytes: pause (in-flight requests kept),
vLLM's weight loader and post-load processing (FP8 scales, MoE weight layout), prefix-cache reset,
resume. GPU: assumed, about half of the pause/drain share (≈ 5 s) of prime-rl's 8.6 s median GLM-5
sync, since rlctl keeps in-flight requests instead of draining them. CPU: the tiny-cpu run's
publish + in-place reload (≈ 0.05 s)."""
WEIGHT_SYNC_NET_EFF = 0.7
"""Achieved fraction of a NIC's bandwidth in the bucketed trainer → inference weight broadcast (large
buckets: the fraction NCCL collectives reach, NET_EFF)."""
WEIGHT_SYNC_BUCKET_LATENCY_S = 2e-3
"""Per bucket of the broadcast (`weights.bucket_mb`): the collective's launch and handshake and the
receiving worker's `load_weights` call on the bucket."""
WEIGHT_BROADCAST_GROUP_S = {"h100-sxm": 2.0, "h100-96gb": 2.0, "h200": 2.0, "b200": 2.0, "a100-80gb": 2.0,
                            "cpu": 0.1}
"""Forming the broadcast transport's process group for a step (a TCPStore rendezvous, then the
communicator). CPU: ≈ 0.1 s with gloo (bench/bench_weight_broadcast.py). GPU: assumed; NCCL
communicator set-up over a hundred-odd ranks takes seconds."""

# ---- CPU path (vLLM CPU build, FSDP2 on gloo; the model is recipes/plan_report.py) ---------------
# Measured on a 2-core box. The engine terms come from vLLM alone (offline, the server's settings, the
# tiny Qwen3 of 0.1M parameters) over 16-512 sequences x 2-32 tokens: a batch took decode steps x
# (1.2 ms + 39.5 us per sequence) + 45 us per sequence, within 15% from 64 sequences up. The trainer terms
# and the per-rollout serving cost come from runs: tiny-cpu (2 ranks, 512 rollouts x 2 tokens) median
# trainer step 0.084-0.093 s, orchestrator step 0.185 s; its generation-heavy variant (1 rank, 256 x 32
# tokens, bench/bench_peer_trl.py) trainer step 0.23 s, step interval 0.37 s; the trainer terms were refitted
# to runs at 1 and 2 ranks, 1-4 micro-batches, dense and MoE (the figures in their docstrings). Tiny models are
# overhead-bound; the FLOP and byte terms take over for real models. `rlctl plan --calibrate RUN` refits
# these to a finished run.
CPU_TRAIN_FLOPS_PER_CORE = 62e9
"""Achieved fp32 FLOP/s per core in FSDP2 forward + backward on CPU (AVX2/AVX-512 GEMMs, autograd): the
peer benchmark's compute-bound variant (a 25M-parameter model, 2 ranks, 4288 tokens) took 5.31 s a step."""
CPU_TRAIN_TOKEN_OVERHEAD_S = 13e-6
"""Per token per core on CPU, beyond its FLOPs: the small ops (norms, activations, softmax, the loss) that
run far below the GEMM rate; what a tiny model's step is made of (one rank: tiny-cpu 0.068 s for 3072
tokens, the generation-heavy variant 0.22 s for 8960) and negligible for a real one."""
CPU_TRAIN_COMPILED_TOKEN_SHARE = 0.65
"""What remains of CPU_TRAIN_TOKEN_OVERHEAD_S with `trainer.compile`: inductor fuses those small ops. The
generation-heavy batch shape (256 rows x 35 tokens, one rank, one thread) trained in 127 ms compiled against
161-166 ms eager (0.78x), and a run's trainer used 0.83x the CPU per step; 0.65 of the token cost plans
0.8x."""
CPU_TRAIN_STEP_OVERHEAD_S = 0.05
"""Per trainer step on CPU with several ranks: the gloo gradient reduce-scatter and the ranks waiting on
each other on shared cores (tiny-cpu, 2 ranks: 0.094-0.113 s against one rank's 0.068 for twice the rows)."""
CPU_TRAIN_MICROBATCH_OVERHEAD_S = 0.013
"""Per micro-batch on CPU with several ranks: FSDP's all-gathers for its forward and backward (tiny-cpu,
2 ranks: 0.138-0.142 s at 4 micro-batches, 0.094-0.113 at 1)."""
CPU_TRAIN_MOE_LAYER_OVERHEAD_S = 0.005
"""Per MoE layer per micro-batch on CPU, beyond a dense layer: routing (top-k, sort, the gather and
scatter of the token copies) and the grouped experts' ops, forward and backward (tiny-moe-cpu at one rank,
2 micro-batches: 0.087 s against the dense model's 0.068)."""
CPU_TRAIN_MOE_LAYER_SHARDED_S = 0.014
"""Per MoE layer per micro-batch on CPU with several ranks, on top: the experts' gathers (ep 1) or
all-to-alls (ep 2), which cost about the same on one host (tiny-moe-cpu, 2 ranks: 0.139 s at ep 2, 0.132
at ep 1; 0.202 at 2 micro-batches, 0.274-0.28 at 4)."""
CPU_INFER_FLOPS_PER_CORE = 10e9
"""Achieved FLOP/s per core of the vLLM CPU build in prefill and decode GEMMs."""
CPU_MEM_BYTES_PER_S = 20e9
"""Memory bandwidth a CPU decode step streams the weights at (one socket, DDR4/DDR5)."""
CPU_DECODE_STEP_OVERHEAD_S = 1.2e-3
"""Per decode step of the vLLM CPU build: scheduler, input preparation."""
CPU_DECODE_TOKEN_OVERHEAD_S = 3e-5
"""Per sequence in a CPU decode step, beyond its FLOPs: sampling, the sampled token's logprob, output
processing."""
CPU_ROLLOUT_OVERHEAD_S = 1.4e-4
"""Per rollout on CPU, once: its request's set-up and prefill in the engine (45 us in vLLM alone), its
stream through the API server and the router, the orchestrator's parse and reward (the rest of tiny-cpu's
orchestrator step, 512 rollouts, beyond decoding and the weight reload)."""


def per_kind(table: dict, kind: str):
    """A per-GPU-kind (or per-kernel) constant; an unknown key falls back to the H100 SXM value."""
    return table.get(kind, table.get("h100-sxm", next(iter(table.values()))))
