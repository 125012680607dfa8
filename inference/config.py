"""The `[inference]` and `[router]` sections: vLLM servers and the router in front of them."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlctl.recipes.base import MAX_TOKENS, Degree, NodeCount, NonNegative, Seconds, StrictModel


class DisaggregationConfig(StrictModel):
    """Prefill/decode disaggregation: prompts go to `kv_producer` replicas, decoding to `kv_consumer` ones."""

    enabled: bool = False
    """Split inference into prefill and decode replicas."""
    prefill_replicas: NodeCount = 1
    """Number of prefill (kv_producer) replicas."""
    prefill_nodes_per_replica: NodeCount = 1
    """Nodes per prefill replica."""
    decode_replicas: NodeCount = 1
    """Number of decode (kv_consumer) replicas."""
    decode_nodes_per_replica: NodeCount = 1
    """Nodes per decode replica."""
    kv_connector: Literal["nixl", "mooncake"] = "nixl"
    """KV transfer connector between prefill and decode workers (GPU only)."""


class KVOffloadConfig(StrictModel):
    """Tiered KV-cache offload below GPU memory."""

    tier: Literal["none", "cpu", "mooncake"] = "none"
    """'cpu' uses vLLM's native CPU offload, 'mooncake' the Mooncake store (GPU only)."""
    cpu_gib: NonNegative = 0.0
    """Host memory per GPU given to the offloaded KV cache."""


class InferenceConfig(StrictModel):
    """vLLM servers that generate rollouts."""

    tp: Degree = "auto"
    """Tensor-parallel degree per replica, or 'auto'."""
    dp: Degree = "auto"
    """Data-parallel ranks per replica (one API server each), or 'auto'."""
    ep: bool = False
    """Expert parallelism for MoE layers across the replica's TP×DP GPUs."""
    all2all_backend: Literal["auto", "deepep_low_latency", "deepep_high_throughput", "naive"] = "auto"
    """All-to-all backend for expert parallelism (DeepEP kernels need the `deep_ep` extra)."""
    fp8: bool = False
    """Serve with FP8 weights (quantization='fp8')."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of the servers; 'auto' uses the trainer's compute dtype (trainer.dtype), so that the
    importance ratio compares probabilities computed at the same precision."""
    max_model_len: Annotated[int, Field(ge=16, le=MAX_TOKENS)] = 4096
    """Maximum tokens per sequence (prompt + completion); also the trainer's sequence length."""
    gpu_memory_utilization: Annotated[float, Field(ge=0.05, le=0.99)] = 0.9
    """Fraction of GPU memory vLLM may use (weights + KV cache + activations)."""
    kv_cache_gib_cpu: Annotated[float, Field(gt=0, le=65536)] = 1.0
    """On CPU: GiB of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE), at most 65536 (64 TiB, more
    than any node holds; a larger figure overflowed the plan's token count)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / torch.compile (faster start-up, slower decode)."""
    engine_stats: bool = True
    """vLLM's engine statistics: the `vllm:` Prometheus series on each server's `/metrics` and its
    periodic throughput log line. Off (`--disable-log-stats`) spares the API server their per-token
    bookkeeping: on 2 CPU cores ≈ 15% of its CPU in a generation-heavy batch."""
    max_num_seqs: Literal["auto"] | Annotated[int, Field(ge=1, le=65536)] = "auto"
    """Sequences one server (DP rank) decodes at once (vLLM's `--max-num-seqs`); the rest of the
    orchestrator's `max_in_flight` wait in the server's queue. 'auto': vLLM's default for its API server,
    1024 on >= 70 GB GPUs, 256 on smaller ones and 128 on CPU, where a 256-rollout batch then decodes in
    two waves and every decode step's fixed cost is paid twice (the tiny recipe sets 1024)."""
    startup_timeout_s: Seconds = 900.0
    """Seconds a server may take to become healthy before the run fails with its log tail."""
    max_loras: Annotated[int, Field(ge=1, le=256)] = 1
    """LoRA adapters a server holds at once; a shared pool of LoRA runs needs one per attached run
    (`rlctl pool launch`), one run needs 1."""
    pool_host_cache_gib: Annotated[float, Field(ge=0, le=65536)] = 0.0
    """A shared pool of full-weight runs: host RAM per server worker that keeps the newest published
    weights of runs not resident, read when they publish, so a residency switch loads from RAM instead
    of the filesystem (0: off; a step larger than this is not kept)."""
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    """Prefill/decode disaggregation."""
    kv_offload: KVOffloadConfig = KVOffloadConfig()
    """KV-cache offload tier."""

    def engine_max_num_seqs(self, vllm_default: int) -> int:
        """`max_num_seqs`, with 'auto' resolved to vLLM's default where the server runs."""
        return vllm_default if self.max_num_seqs == "auto" else self.max_num_seqs


class RouterConfig(StrictModel):
    """vllm-router in front of all inference servers."""

    policy: Literal[
        "cache_aware", "round_robin", "random", "power_of_two", "consistent_hash", "kv_aware", "sticky_least_loaded"
    ] = "cache_aware"
    """Routing policy (cache_aware keeps a group's shared prompt on one server)."""
