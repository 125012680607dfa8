"""Model architecture facts (as in a HF config.json) and parameter counts computed from them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field

from rlctl.recipes.errors import TOO_DEEP, RecipeError, path_kind, shown

# Bounds of a config.json: far above any published model, low enough that every count derived from
# them stays a finite float (a typo such as an extra zero in hidden_size is caught, not planned).
_Dim = Annotated[int, Field(strict=True, ge=1, le=1 << 20)]
_Layers = Annotated[int, Field(strict=True, ge=1, le=4096)]
_Heads = Annotated[int, Field(strict=True, ge=1, le=1 << 14)]
_Opt = Annotated[int, Field(strict=True, ge=0, le=1 << 20)]
"""An optional size: 0 means 'not this kind of model' (no experts, no MLA, ...)."""
_Flag = Annotated[bool, Field(strict=True)]


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers the planner needs; names follow HF config.json."""

    # Read by pydantic when a config.json is validated into a spec (`spec_from_hf_config`); each field
    # is strict (`true` is not a count, "4096" is not a number), the dataclass itself is built from a dict.
    __pydantic_config__ = ConfigDict(allow_inf_nan=False)

    name: str
    hidden_size: _Dim
    num_hidden_layers: _Layers
    num_attention_heads: _Heads
    num_key_value_heads: _Heads
    vocab_size: Annotated[int, Field(strict=True, ge=1, le=1 << 24)]
    intermediate_size: _Dim
    head_dim: _Opt = 0
    """Per-head dim of GQA/MHA attention; 0 means hidden_size // num_attention_heads."""
    tie_word_embeddings: _Flag = False
    attention_bias: _Flag = False
    # Mixture of experts (0 experts = dense model).
    n_routed_experts: _Opt = 0
    n_shared_experts: _Opt = 0
    num_experts_per_tok: _Opt = 0
    moe_intermediate_size: _Opt = 0
    dense_layers: Annotated[int, Field(strict=True, ge=0, le=4096)] = 0
    """Leading layers with a dense MLP (DeepSeek's `first_k_dense_replace`); the rest are MoE."""
    # Multi-head latent attention (DeepSeek-V3 family); kv_lora_rank > 0 switches MLA on.
    q_lora_rank: _Opt = 0
    kv_lora_rank: _Opt = 0
    qk_rope_head_dim: _Opt = 0
    qk_nope_head_dim: _Opt = 0
    v_head_dim: _Opt = 0
    # DeepSeek sparse attention (DSA) indexer: each query attends to index_topk selected tokens.
    index_topk: Annotated[int, Field(strict=True, ge=0, le=1 << 30)] = 0
    index_n_heads: _Opt = 0
    index_head_dim: _Opt = 0
    max_position_embeddings: Annotated[int, Field(strict=True, ge=0, le=1 << 30)] = 0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived facts -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_dim(self) -> int:
        """Per-head query/key width (MLA: nope + rope parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.attn_head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.attn_head_dim

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.dense_layers if self.is_moe else 0

    def attention_params(self) -> int:
        h, a = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            q_in = self.q_lora_rank or h
            q = (h * self.q_lora_rank + self.q_lora_rank if self.q_lora_rank else 0) + q_in * a * self.qk_dim
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)
            out = a * self.v_head_dim * h
            indexer = 0
            if self.index_n_heads:
                d = self.index_head_dim
                indexer = q_in * self.index_n_heads * d + h * d + 2 * d + h * self.index_n_heads
            return q + kv + out + indexer
        d, kv_heads = self.attn_head_dim, self.num_key_value_heads
        qkv = h * d * (a + 2 * kv_heads) + (d * (a + 2 * kv_heads) if self.attention_bias else 0)
        qk_norm = 2 * d  # Qwen3 q/k RMSNorm; negligible elsewhere
        return qkv + a * d * h + qk_norm

    def expert_params(self) -> int:
        """One routed expert (gated MLP)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def layer_params(self, moe: bool, active: bool) -> int:
        norms = 2 * self.hidden_size
        if not moe:
            return self.attention_params() + self.dense_mlp_params() + norms
        experts = self.num_experts_per_tok if active else self.n_routed_experts
        router = self.hidden_size * self.n_routed_experts
        mlp = (experts + self.n_shared_experts) * self.expert_params() + router
        return self.attention_params() + mlp + norms

    def embedding_params(self) -> int:
        """Input embedding plus the LM head when it is not tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def _count(self, active: bool) -> int:
        dense = self.num_hidden_layers - self.moe_layers
        body = dense * self.layer_params(False, active) + self.moe_layers * self.layer_params(True, active)
        return body + self.embedding_params() + self.hidden_size

    @property
    def total_params(self) -> int:
        return self._count(active=False)

    @property
    def active_params(self) -> int:
        """Parameters touched per token (top-k + shared experts; every non-expert weight)."""
        return self._count(active=True)

    @property
    def expert_params_total(self) -> int:
        return self.moe_layers * self.n_routed_experts * self.expert_params()

    @property
    def matmul_params_active(self) -> int:
        """Weights in matmuls per token: active params minus the input embedding lookup (the LM head stays)."""
        return self.active_params - self.vocab_size * self.hidden_size * (0 if self.tie_word_embeddings else 1)

    def kv_bytes_per_token(self, bytes_per_elem: float = 2.0) -> float:
        """KV-cache bytes one token occupies across all layers (MLA: latent + rope key; DSA adds indexer keys)."""
        if self.is_mla:
            per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_elem
            if self.index_n_heads:
                per_layer += self.index_head_dim + 4  # fp8 indexer key + fp32 scale (vLLM's layout)
            return self.num_hidden_layers * per_layer
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.attn_head_dim * bytes_per_elem


_ALIASES = {
    "first_k_dense_replace": "dense_layers",
    "num_local_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "shared_expert_intermediate_size": None,
}


@lru_cache(maxsize=1)
def _spec_adapter():
    from pydantic import TypeAdapter

    return TypeAdapter(ModelSpec)


def _config_error(name: str, err) -> RecipeError:
    from rlctl.recipes.errors import format_validation_error

    return RecipeError(f"config.json of {shown(name)}: {format_validation_error(err)}", key="model.name")


def _dense_layer_count(cfg: dict, name: str) -> int | None:
    """Dense (non-MoE) layers named by Qwen-MoE's `mlp_only_layers` (indices) or `mlp_layer_types`."""
    from pydantic import TypeAdapter, ValidationError

    layers = cfg.get("num_hidden_layers")
    try:
        if cfg.get("mlp_only_layers"):
            index = list[Annotated[int, Field(strict=True, ge=0, lt=layers if isinstance(layers, int) else 1)]]
            only = TypeAdapter(dict[str, index], config=ConfigDict(strict=True)).validate_python(
                {"mlp_only_layers": cfg["mlp_only_layers"]})["mlp_only_layers"]
            return len(set(only))  # indices outside the model are refused above: not a negative MoE count
        if cfg.get("mlp_layer_types") is not None:
            kinds = TypeAdapter(dict[str, list[str]], config=ConfigDict(strict=True)).validate_python(
                {"mlp_layer_types": cfg["mlp_layer_types"]})["mlp_layer_types"]
            return sum(1 for t in kinds if t == "dense")
    except ValidationError as e:
        raise _config_error(name, e) from None
    return None


def spec_from_hf_config(cfg: dict, name: str) -> ModelSpec:
    """Build a ModelSpec from a HF config.json dict (Llama, Qwen2/3, Qwen3-MoE, DeepSeek-V3, Kimi-K2, GLM-5)."""
    from pydantic import ValidationError

    if not isinstance(cfg, dict):
        raise RecipeError(f"model config {shown(name)} must be a JSON object", key="model.name")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise RecipeError(f"config.json of {shown(name)} lacks {', '.join(missing)}", key="model.name")
    kw: dict = {f: cfg[f] for f in ModelSpec.__dataclass_fields__
                if f not in ("name", "extra") and cfg.get(f) is not None}
    for src, dst in _ALIASES.items():
        if dst and cfg.get(src) is not None and dst not in kw:
            kw[dst] = cfg[src]
    kw.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if "intermediate_size" not in kw and isinstance(cfg["hidden_size"], int):
        kw["intermediate_size"] = 4 * cfg["hidden_size"]
    if kw.get("n_routed_experts") and not kw.get("moe_intermediate_size"):
        kw["moe_intermediate_size"] = kw.get("intermediate_size", 0)
    dense = _dense_layer_count(cfg, name)
    if dense is not None:
        kw["dense_layers"] = dense
    try:
        spec = _spec_adapter().validate_python({"name": name, **kw})
        shared = cfg.get("shared_expert_intermediate_size")
        if shared and spec.moe_intermediate_size:  # Qwen2-MoE: one wide shared expert, counted in experts
            if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
                raise ValueError(f"shared_expert_intermediate_size must be a non-negative integer, got {shared!r}")
            spec = _spec_adapter().validate_python(
                {**kw, "name": name, "n_shared_experts": max(1, shared // spec.moe_intermediate_size)})
        _validate(spec)
    except ValidationError as e:
        raise _config_error(name, e) from None
    except ValueError as e:
        raise RecipeError(f"config.json of {shown(name)} is not a supported decoder architecture ({e})",
                          key="model.name") from None
    return spec


def _validate(spec: ModelSpec) -> None:
    """What the bounds of single fields cannot say: how the fields must agree with each other."""
    if spec.is_moe and not (0 < spec.num_experts_per_tok <= spec.n_routed_experts):
        raise ValueError("num_experts_per_tok must be in 1..n_routed_experts")
    if spec.is_moe and spec.moe_intermediate_size < 1:
        raise ValueError("moe_intermediate_size must be >= 1 for a MoE model")
    if spec.dense_layers > spec.num_hidden_layers:
        raise ValueError(f"{spec.dense_layers} dense layers but num_hidden_layers is {spec.num_hidden_layers}")
    if spec.num_attention_heads % spec.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if spec.is_mla and min(spec.qk_rope_head_dim + spec.qk_nope_head_dim, spec.v_head_dim) < 1:
        raise ValueError("an MLA model (kv_lora_rank > 0) needs qk_rope/qk_nope head dims and v_head_dim")
    if not spec.is_mla and spec.attn_head_dim < 1:
        raise ValueError("head_dim is 0 and hidden_size < num_attention_heads")


def get_model_spec(name_or_path: str) -> ModelSpec:
    """A catalog name (see `catalog_names()`), a local HF directory, or a config.json path → ModelSpec."""
    from rlctl.recipes.model_catalog import CATALOG

    key = name_or_path.strip().lower()
    if key in CATALOG:
        return spec_from_hf_config(CATALOG[key], key)
    kind = path_kind(name_or_path)
    path = Path(name_or_path).expanduser() / ("config.json" if kind == "dir" else "")
    if kind is None or path_kind(path) != "file":
        raise RecipeError(
            f"unknown model {shown(name_or_path)!r}: not a catalog name ({', '.join(sorted(CATALOG))}) "
            "nor a local HF directory / config.json",
            key="model.name",
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"malformed config.json at {path}: {e}", key="model.name") from None
    except RecursionError:
        raise RecipeError(f"config.json at {path} is {TOO_DEEP}", key="model.name") from None
    except ValueError as e:  # an integer longer than Python converts (4300 digits)
        raise RecipeError(f"malformed config.json at {path}: {shown(str(e), 100)}", key="model.name") from None
    except OSError as e:
        raise RecipeError(f"cannot read {path}: {e.strerror}", key="model.name") from None
    return spec_from_hf_config(cfg, str(name_or_path))


def catalog_names() -> list[str]:
    from rlctl.recipes.model_catalog import CATALOG

    return sorted(CATALOG)
