"""Published config.json facts of the built-in models (only the fields the planner reads)."""
from __future__ import annotations

_QWEN3 = dict(vocab_size=151936, head_dim=128)
_MLA_V3 = dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)

CATALOG: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288),
    "qwen3-32b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600),
    "qwen3-30b-a3b": dict(_QWEN3, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8),
    "qwen3-235b-a22b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536,
                            num_experts=128, num_experts_per_tok=8),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, attention_bias=True),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256),
    "llama-3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          intermediate_size=28672, vocab_size=128256),
    "deepseek-v3": dict(_MLA_V3, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        first_k_dense_replace=3, vocab_size=129280),
    "kimi-k2": dict(_MLA_V3, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
                    num_key_value_heads=64, intermediate_size=18432, moe_intermediate_size=2048,
                    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
                    first_k_dense_replace=1, vocab_size=163840),
    # GLM-5 (GlmMoeDsaForCausalLM): MLA + DeepSeek sparse attention indexer, 3 dense + 75 MoE layers.
    "glm-5": dict(hidden_size=6144, num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
                  intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
                  n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=154880,
                  q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                  v_head_dim=256, index_topk=2048, index_n_heads=32, index_head_dim=128),
}

# Published (total, active) parameter counts, for the catalog test.
PUBLISHED_PARAMS: dict[str, tuple[float, float]] = {
    "qwen3-0.6b": (0.6e9, 0.6e9), "qwen3-4b": (4.0e9, 4.0e9), "qwen3-8b": (8.2e9, 8.2e9),
    "qwen3-32b": (32.8e9, 32.8e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9),
    "qwen2.5-7b": (7.61e9, 7.61e9), "llama-3.1-8b": (8.03e9, 8.03e9), "llama-3.1-70b": (70.6e9, 70.6e9),
    "deepseek-v3": (671e9, 37e9), "kimi-k2": (1.04e12, 32.6e9), "glm-5": (744e9, 40e9),
}

try:  # the tiny demo models live with the trainer; register them once that module exists
    from rlctl.trainer.tiny_model import TINY_MODELS as _TINY
except ImportError:  # pragma: no cover - only while the trainer package is incomplete
    _TINY = {}
for _name, _config in _TINY.items():  # tiny-qwen3, tiny-qwen3-moe
    CATALOG[_name] = dict(_config)
