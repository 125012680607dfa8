"""Parameter counts computed from the architecture match the published totals."""
import json

import pytest

from rlctl.recipes.errors import RecipeError
from rlctl.recipes.model_catalog import PUBLISHED_PARAMS
from rlctl.recipes.models import get_model_spec

# GLM-5's "40B active" is published to one significant figure; everything else to three.
ACTIVE_TOL = {"glm-5": 0.05}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_param_counts_match_published(name):
    total, active = PUBLISHED_PARAMS[name]
    spec = get_model_spec(name)
    assert spec.total_params == pytest.approx(total, rel=0.02)
    assert spec.active_params == pytest.approx(active, rel=ACTIVE_TOL.get(name, 0.02))


def test_mla_kv_bytes_deepseek_v3():
    # 61 layers × (512 latent + 64 rope) × 2 bytes ≈ 70 KB per token.
    assert get_model_spec("deepseek-v3").kv_bytes_per_token(2) == 61 * 576 * 2


def test_local_config_json(tmp_path):
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = get_model_spec(str(tmp_path))
    per_layer = 64 * 16 * (4 + 4) + 4 * 16 * 64 + 2 * 16 + 3 * 64 * 128 + 2 * 64
    assert spec.total_params == 2 * per_layer + 100 * 64 + 64


def test_tiny_qwen3_registered():
    assert get_model_spec("tiny-qwen3").num_hidden_layers >= 1


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"hidden_size": 64}',
                                     '{"hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10}'])
def test_bad_config_json(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(RecipeError) as e:
        get_model_spec(str(tmp_path / "config.json"))
    assert str(e.value).startswith("model.name:")


def test_unknown_model():
    with pytest.raises(RecipeError, match="unknown model"):
        get_model_spec("no-such-model")
