"""The default importance-ratio loss: value, gradient, masking, normalisation, metrics, plug-in path."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlctl.recipes.errors import RecipeError
from rlctl.trainer.loss import importance_ratio_loss, load_loss, summarize, token_logprobs_and_entropy

CFG = SimpleNamespace(mask_low=0.125, mask_high=8.0)


def _batch(seed=0, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    inf = -torch.rand(b, t, generator=g) * 3
    tr = (inf + torch.randn(b, t, generator=g) * 0.3).requires_grad_(True)
    mask = torch.rand(b, t, generator=g) > 0.3
    adv = torch.randn(b, generator=g)
    return tr, inf * mask, adv, mask


def test_value_and_gradient_match_the_formula():
    tr, inf, adv, mask = _batch()
    loss, _ = importance_ratio_loss(tr, inf, adv, mask, CFG)
    loss.backward()
    ratio = torch.exp(tr.detach() - inf)
    n = mask.sum()
    expected = -(ratio * adv[:, None] * mask).sum() / n
    assert torch.allclose(loss, expected)
    # d/dlogp of -r*A/N is -r*A/N: the importance-weighted policy gradient
    assert torch.allclose(tr.grad, -(ratio * adv[:, None] * mask) / n)


def test_equal_policies_reduce_to_plain_policy_gradient_and_zero_kl():
    _, inf, adv, mask = _batch(1)
    tr = inf.clone().requires_grad_(True)
    loss, m = importance_ratio_loss(tr, inf, adv, mask, CFG)
    loss.backward()
    assert torch.allclose(tr.grad, -(adv[:, None] * mask) / mask.sum())
    assert m["mismatch_kl_sum"].item() == pytest.approx(0.0, abs=1e-9)
    assert m["masked_tokens"].item() == 0


def test_tokens_outside_the_ratio_band_are_masked():
    inf = torch.zeros(1, 4)
    tr = torch.tensor([[0.0, math.log(10.0), math.log(0.1), math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0])
    loss, m = importance_ratio_loss(tr, inf, adv, mask, CFG)
    loss.backward()
    assert tr.grad[0, 1] == 0 and tr.grad[0, 2] == 0  # ratio 10 > 8 and 0.1 < 0.125
    assert tr.grad[0, 0] != 0 and tr.grad[0, 3] != 0
    assert m["masked_tokens"].item() == 2
    # masked tokens still count in the denominator: N = 4 completion tokens
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 4)
    assert summarize({k: v.item() for k, v in m.items()})["masked_fraction"] == 0.5


def test_prompt_and_padding_tokens_do_not_contribute():
    tr, inf, adv, mask = _batch(2)
    garbage = tr.detach().clone()
    garbage[~mask] = 100.0  # would be masked by the ratio band anyway; make sure it isn't even counted
    loss_a, m_a = importance_ratio_loss(tr, inf, adv, mask, CFG)
    loss_b, m_b = importance_ratio_loss(garbage, inf, adv, mask, CFG)
    assert torch.allclose(loss_a.detach(), loss_b)
    assert m_b["masked_tokens"] == m_a["masked_tokens"] and m_b["tokens"] == mask.sum()


def test_splitting_the_batch_with_a_global_token_count_gives_the_same_gradient():
    tr, inf, adv, mask = _batch(3, b=6)
    full, _ = importance_ratio_loss(tr, inf, adv, mask, CFG)
    (g_full,) = torch.autograd.grad(full, tr)
    n = mask.sum()
    parts = [importance_ratio_loss(tr[s], inf[s], adv[s], mask[s], CFG, num_tokens=n)[0] for s in (slice(0, 2), slice(2, 6))]
    (g_split,) = torch.autograd.grad(sum(parts), tr)
    assert torch.allclose(g_full, g_split, atol=1e-7)


def test_mismatch_kl_is_the_k3_estimate_and_entropy_is_averaged():
    inf = torch.log(torch.tensor([[0.5, 0.25]]))
    tr = torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    ent = torch.tensor([[1.0, 3.0]])
    _, m = importance_ratio_loss(tr, inf, torch.zeros(1), mask, CFG, entropy=ent)
    s = summarize({k: v.item() for k, v in m.items()})
    assert s["mismatch_kl"] == pytest.approx(((0.5 - 1 - math.log(0.5)) + 0.0) / 2)
    assert s["entropy"] == pytest.approx(2.0)
    assert s["ratio_mean"] == pytest.approx(0.75)


def test_token_logprobs_align_with_input_ids():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp, ent = token_logprobs_and_entropy(logits, ids)
    assert lp.shape == ids.shape and (lp[:, 0] == 0).all()
    ref = torch.log_softmax(logits, -1)
    assert lp[1, 3].item() == pytest.approx(ref[1, 2, ids[1, 3]].item(), rel=1e-5)
    p = ref[0, 1].exp()
    assert ent[0, 2].item() == pytest.approx(-(p * ref[0, 1]).sum().item(), rel=1e-5)


def test_load_loss_resolves_both_spellings_and_rejects_bad_paths():
    assert load_loss("rlctl.trainer.loss:importance_ratio_loss") is importance_ratio_loss
    assert load_loss("rlctl.trainer.loss.importance_ratio_loss") is importance_ratio_loss
    for bad in ("nonexistent_pkg_xyz:fn", "rlctl.trainer.loss:nope", "justaname"):
        with pytest.raises(RecipeError, match="trainer.loss.path"):
            load_loss(bad)


def test_entropy_bonus_subtracts_the_weighted_mean_entropy_and_raises_it():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 7) * 3).requires_grad_(True)
    ids = torch.randint(0, 7, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, 0] = False  # position 0 predicts nothing
    cfg = SimpleNamespace(mask_low=0.125, mask_high=8.0, entropy_coef=0.1)
    lp, ent = token_logprobs_and_entropy(logits, ids, entropy_grad=True)
    # zero advantages: the tied group of the docstring, only the bonus moves the policy
    loss, _ = importance_ratio_loss(lp, lp.detach(), torch.zeros(2), mask, cfg, entropy=ent)
    assert loss.item() == pytest.approx(-0.1 * ent[mask].mean().item(), rel=1e-5)
    loss.backward()
    after = token_logprobs_and_entropy(logits.detach() - 1.0 * logits.grad, ids)[1]
    assert after[mask].mean() > ent[mask].mean()
    # the default keeps no graph for the entropy, and a coefficient of 0 leaves the loss alone
    assert token_logprobs_and_entropy(logits, ids)[1].grad_fn is None
    plain, _ = importance_ratio_loss(lp, lp.detach(), torch.zeros(2), mask, CFG, entropy=ent)
    assert plain.item() == 0.0


def test_entropy_coef_is_bounded_in_the_schema():
    from rlctl.recipes.load import load_recipe

    assert load_recipe(["tiny-cpu"], ["trainer.loss.entropy_coef=0.01"]).trainer.loss.entropy_coef == 0.01
    for bad in ("-0.1", "2"):
        with pytest.raises(RecipeError, match="trainer.loss.entropy_coef"):
            load_recipe(["tiny-cpu"], [f"trainer.loss.entropy_coef={bad}"])
