"""The tiny model builds offline, deterministically, idempotently, and loads with transformers."""
from __future__ import annotations

import hashlib
import json

import pytest

from rlctl.trainer import tiny_model
from rlctl.trainer.tiny_model import BUILD_MARKER, CHARSET, TINY_QWEN3, build_tiny_model


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_config_dict_is_pure_and_consistent():
    json.dumps(TINY_QWEN3)  # plain JSON, no torch objects
    assert TINY_QWEN3["vocab_size"] == len(CHARSET) + len(tiny_model.SPECIAL_TOKENS)
    assert TINY_QWEN3["num_attention_heads"] % TINY_QWEN3["num_key_value_heads"] == 0
    assert TINY_QWEN3["tie_word_embeddings"] is True


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=0)
    c = build_tiny_model(tmp_path / "c", seed=1)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


def test_idempotent_and_rebuilds_on_seed_change(tmp_path):
    out = build_tiny_model(tmp_path / "m", seed=0)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(out, seed=0)
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    build_tiny_model(out, seed=3)
    assert json.loads((out / BUILD_MARKER).read_text())["seed"] == 3
    assert _digest(out) == _digest(build_tiny_model(tmp_path / "m3", seed=3))


def test_incomplete_directory_is_rebuilt(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a crashed earlier build: no marker
    build_tiny_model(out, seed=0)
    assert json.loads((out / "config.json").read_text()) == TINY_QWEN3


def test_loads_with_transformers_and_tokenizer_roundtrips(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = build_tiny_model(tmp_path / "m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == tiny_model.parameter_count()
    # tied: the lm_head is the embedding, and the file holds it once
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    text = "seq: a b c 1 2 3\nnext?"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), TINY_QWEN3["vocab_size"])
    assert torch.isfinite(logits).all()


def test_overrides_make_a_variant_with_its_own_marker(tmp_path):
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    small = {"num_hidden_layers": 1, "max_window_layers": 1}
    out = build_tiny_model(tmp_path / "m", seed=0, overrides=small)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["vocab_size"] == TINY_QWEN3["vocab_size"]
    numel = sum(t.numel() for t in load_file(out / "model.safetensors").values())
    assert numel == tiny_model.parameter_count(config)
    build_tiny_model(out, seed=0)  # the default config differs: rebuilt
    assert json.loads((out / "config.json").read_text()) == TINY_QWEN3


def test_a_cached_build_is_copied_without_building_again(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = build_tiny_model(tmp_path / "a", seed=3, cache_dir=cache)
    monkeypatch.setattr(tiny_model, "_write_weights", lambda *a: pytest.fail("built again"))
    second = build_tiny_model(tmp_path / "b", seed=3, cache_dir=cache)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and BUILD_MARKER in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert len(list(cache.iterdir())) == 1
    with pytest.raises(pytest.fail.Exception, match="built again"):  # another seed is another entry
        build_tiny_model(tmp_path / "c", seed=4, cache_dir=cache)
    assert not (tmp_path / "c").exists()
