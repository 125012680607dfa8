"""A tiny Qwen3 (dense, and a Qwen3-MoE variant) with a character-level tokenizer, built offline and
deterministically from a seed.

The CPU recipes use them so that the whole stack (vLLM, router, FSDP2 trainer) runs on a laptop with no
model hub. `TINY_QWEN3` / `TINY_QWEN3_MOE` are the config.json of the models as pure dicts (the model
catalog reads them without importing torch); `build_tiny_model` writes a Hugging Face directory that
both transformers and vLLM load: config.json, model.safetensors (checkpoint names, e.g. one tensor per
expert), tokenizer files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# Token ids 0..3 are the specials; rollouts are right-padded with 0, so 0 must be the pad token.
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARSET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?-+=*/()[]<>'\"#_|\n"
"""Every character the tokenizer knows; anything else maps to <unk>."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
# A trivial chat template (the messages' contents joined): dataset recipes render prompts through the
# model's template, and the tiny model's prompts must stay plain characters of CHARSET.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)

TINY_QWEN3: dict = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention kernels support head sizes 32, 64, 80, ... (not 16)
    "hidden_act": "silu",
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
}

# The MoE variant: every layer sparse, 8 experts, top-2 (what vLLM's fused-MoE CPU path serves and the
# trainer's expert parallelism shards). Router weights are drawn with the same std as the others.
TINY_QWEN3_MOE: dict = {
    **{k: v for k, v in TINY_QWEN3.items() if k not in ("max_window_layers",)},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
}

# The LoRA demo's base: tiny-qwen3 drawn with a 5x larger std. Why: with frozen (tied) embeddings and
# final norm the logits are bounded by the embeddings' norm, and at std 0.02 no adapter can make the
# policy confident (a replay of the task stays at reward ~0.03); a pretrained base has no such cap.
TINY_QWEN3_LORA: dict = {**TINY_QWEN3, "initializer_range": 0.2}

TINY_MODELS: dict[str, dict] = {"tiny-qwen3": TINY_QWEN3, "tiny-qwen3-moe": TINY_QWEN3_MOE,
                                "tiny-qwen3-lora": TINY_QWEN3_LORA}
"""`model.name` of each built-in tiny model -> its config.json."""

BUILD_MARKER = "BUILT.json"  # written last: its presence means the directory is whole


def vocab() -> dict[str, int]:
    """Token string -> id: specials first, then one id per character of CHARSET."""
    tokens = list(SPECIAL_TOKENS) + list(CHARSET)
    assert len(set(tokens)) == len(tokens), "duplicate character in CHARSET"
    return {tok: i for i, tok in enumerate(tokens)}


def _build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    # Isolate every character (including whitespace) as its own pre-token; Fuse joins them back.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=TINY_QWEN3["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _write_weights(out: Path, seed: int, cfg: dict) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    # Seeded CPU init on a fresh generator state: the same seed gives bit-identical weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    # transformers keeps MoE experts fused in memory; the file holds the checkpoint names vLLM loads
    # (`mlp.experts.{e}.gate_proj.weight`, ...), as `save_pretrained` writes them (no-op for dense).
    state = {k: v.contiguous() for k, v in revert_weight_conversion(model, state).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _identity(seed: int, cfg: dict) -> dict:
    """What decides a build's bytes (besides the code and the libraries): its marker's content."""
    return {"seed": seed, "config": cfg, "charset": CHARSET, "chat_template": CHAT_TEMPLATE}


def _is_built(out: Path, seed: int, cfg: dict) -> bool:
    marker = out / BUILD_MARKER
    if not marker.exists():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    want = _identity(seed, cfg)
    return {k: info.get(k) for k in want} == want


def is_tiny_model(name: str) -> bool:
    """Whether `model.name` names a built-in tiny model (built into the run dir, not read from disk)."""
    return name in TINY_MODELS


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, overrides: dict | None = None,
                     name: str = "tiny-qwen3", cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the tiny model `name` (a key of TINY_MODELS) into `out_dir` (idempotent; rebuilt if the
    seed or the config changed).

    `overrides` replaces config fields (e.g. a wider/deeper variant for benchmarks; the vocabulary
    stays the character set's). With `cache_dir` the model is built once there (keyed by name, seed,
    config, this module's code and the torch/transformers versions that decide the weights) and
    copied: a launch then imports neither torch nor transformers for it (≈ 8 s on 2 CPU cores).

    The directory is staged beside `out_dir` and renamed into place, then the build marker is written
    last, so a concurrent reader never loads a half-written model.
    """
    out = Path(out_dir)
    cfg = {**TINY_MODELS[name], **(overrides or {})}
    if _is_built(out, seed, cfg):
        return out
    if cache_dir is not None:
        cached = build_tiny_model(Path(cache_dir) / _cache_key(name, seed, cfg), seed, overrides, name)
        return _install(out, seed, cfg, lambda stage: _copy_model_files(cached, stage))
    return _install(out, seed, cfg, lambda stage: _write_model(stage, seed, cfg))


def _write_model(stage: Path, seed: int, cfg: dict) -> None:
    (stage / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _write_weights(stage, seed, cfg)
    _build_tokenizer().save_pretrained(str(stage))
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (stage / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _copy_model_files(src: Path, stage: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and f.name != BUILD_MARKER:
            shutil.copyfile(f, stage / f.name)


def _cache_key(name: str, seed: int, cfg: dict) -> str:
    from importlib.metadata import PackageNotFoundError, version

    def installed(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "?"

    key = json.dumps({**_identity(seed, cfg), "torch": installed("torch"), "transformers": installed("transformers"),
                      "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}, sort_keys=True)
    return f"{name}-{seed}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _install(out: Path, seed: int, cfg: dict, fill) -> Path:
    """Fill a stage directory beside `out` with `fill(stage)`, rename it into place, write the marker."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        fill(stage)
        for f in stage.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            if _is_built(out, seed, cfg):  # another process finished the same build first
                return out
            shutil.rmtree(out)
        os.replace(stage, out)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    tmp = out / f".{BUILD_MARKER}.tmp"
    tmp.write_text(json.dumps(_identity(seed, cfg), indent=2) + "\n")
    os.replace(tmp, out / BUILD_MARKER)
    return out


def parameter_count(config: dict | None = None) -> int:
    """Number of parameters of the tiny model (tied lm_head counted once), computed from the config."""
    c = config or TINY_QWEN3
    h, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    attn = h * q + 2 * h * kv + q * h + 2 * d  # q, k, v, o projections + q_norm/k_norm
    mlp = 3 * h * i  # gate/up/down
    if c.get("num_experts"):  # every layer sparse (decoder_sparse_step 1): router + per-expert MLPs
        mlp = c["num_experts"] * (h + 3 * h * c["moe_intermediate_size"])
    layer = attn + mlp + 2 * h  # + two RMSNorms
    return v * h + c["num_hidden_layers"] * layer + h
