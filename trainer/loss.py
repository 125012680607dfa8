"""The policy-gradient loss and how a recipe picks another one (`trainer.loss.path`).

Default: the token-level importance-ratio loss of asynchronous GRPO-style training.

For every completion token t of a sequence with group-relative advantage A:

    r_t  = exp(logp_trainer(t) - logp_inference(t))        # importance ratio, trainer vs. sampler
    loss = -(1/N) * sum_{t kept} r_t * A                    # the importance-weighted surrogate
           -(c/N) * sum_{t completion} H_t                  # an entropy bonus, when c > 0

Its gradient is `-(1/N) * sum r_t * A * grad logp_trainer(t)`: the policy gradient corrected for
the rollout having been sampled by a different (older, differently-computed) policy. The same
gradient comes from a detached ratio used as a weight; the surrogate form is used because its value
tracks improvement on the batch (it falls as the policy moves towards high-advantage tokens).

A token is *kept* when it is a completion token (`loss_mask`) and its ratio lies inside
`[mask_low, mask_high]`: where the two probabilities disagree that much the sample carries no
trustworthy signal (a different policy version, a numerics mismatch), so it is dropped rather than
clipped. `H_t` is the entropy of the trainer's distribution at t (every completion position: it
needs no sampled ratio) and `c` is `entropy_coef` (0 by default): a group whose samples all agree
ties its rewards and gives no gradient, so without it a prompt locked onto a wrong answer stays
locked. N is the number of completion tokens (masked ones included), i.e. each term is normalised
by the token count; pass `num_tokens` to normalise by the count of the whole step when the batch is
split across ranks and micro-batches, so the gradient does not depend on how it was split.

A custom loss is any callable `fn(trainer_logprobs, inference_logprobs, advantages, loss_mask,
config, *, num_tokens=None, entropy=None) -> (loss, metrics)` named as `package.module:function`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def importance_ratio_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: Any,
    *,
    num_tokens: float | torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The default loss (see the module docstring). Shapes: logprobs/mask [B, T], advantages [B].

    `config` needs `mask_low` and `mask_high` (and `entropy_coef`, 0 when absent); `entropy` is the
    per-token entropy [B, T] of the trainer's distribution: reported, and the bonus's term when
    `entropy_coef` > 0 (it must then carry gradients: `entropy_grad=True` below). Metrics are *sums* over this call's completion tokens
    (`tokens`, `mismatch_kl_sum`, `entropy_sum`, `masked_tokens`, `ratio_sum`) so callers can add
    them across micro-batches and ranks before dividing by the token total.
    """
    mask = loss_mask.bool()
    log_ratio = (trainer_logprobs - inference_logprobs).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    out_of_range = (ratio < config.mask_low) | (ratio > config.mask_high)
    keep = mask & ~out_of_range
    count = mask.sum()
    denom = torch.as_tensor(num_tokens if num_tokens is not None else count, dtype=ratio.dtype).clamp_min(1)
    per_token = -ratio * advantages.to(ratio.dtype).unsqueeze(-1)
    loss = (per_token * keep).sum() / denom
    entropy_coef = getattr(config, "entropy_coef", 0.0)
    if entropy_coef and entropy is not None:
        loss = loss - entropy_coef * (entropy * mask).sum() / denom

    with torch.no_grad():
        lr = log_ratio.detach()
        r = ratio.detach()
        # k3 estimator of KL(inference || trainer) on tokens sampled by inference: r - 1 - log r >= 0
        kl = (r - 1 - lr) * mask
        metrics = {
            "tokens": count.to(torch.float64),
            "mismatch_kl_sum": kl.sum().to(torch.float64),
            "masked_tokens": (mask & out_of_range).sum().to(torch.float64),
            "ratio_sum": (r * mask).sum().to(torch.float64),
        }
        if entropy is not None:
            metrics["entropy_sum"] = (entropy.detach() * mask).sum().to(torch.float64)
    return loss, metrics


def summarize(metric_sums: dict[str, float]) -> dict[str, float]:
    """Per-token means from summed metrics: mismatch_kl, entropy, masked_fraction, ratio_mean."""
    n = max(metric_sums.get("tokens", 0.0), 1.0)
    out = {
        "mismatch_kl": metric_sums.get("mismatch_kl_sum", 0.0) / n,
        "masked_fraction": metric_sums.get("masked_tokens", 0.0) / n,
        "ratio_mean": metric_sums.get("ratio_sum", 0.0) / n,
    }
    if "entropy_sum" in metric_sums:
        out["entropy"] = metric_sums["entropy_sum"] / n
    return out


def load_loss(path: str) -> LossFn:
    """Resolve `package.module:function` (or `package.module.function`); RecipeError if it isn't callable."""
    from rlctl.recipes.errors import RecipeError

    key = "trainer.loss.path"
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RecipeError(f"expected 'package.module:function', got {path!r}", key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"cannot import module {module_name!r} ({exc})", key) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"{module_name!r} has no callable {attr!r}", key)
    return fn


def _entropy(logp: torch.Tensor, with_grad: bool) -> torch.Tensor:
    # without gradients unless the loss has an entropy bonus: the graph would keep another [B, T, V]
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        return -(logp.exp() * logp).sum(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the *actual* token and the entropy of the predicting distribution.

    Position t of the result scores `input_ids[:, t]` from the logits at t-1 (position 0 gets 0), so
    the outputs align with `input_ids`, `loss_mask` and `inference_logprobs` of the rollout format.
    The entropy carries gradients only with `entropy_grad` (an entropy bonus in the loss).
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ent = _entropy(logp, entropy_grad)
    pad = chosen.new_zeros(chosen.shape[0], 1)
    return torch.cat([pad, chosen], dim=1), torch.cat([pad, ent], dim=1)


def logprobs_of_labels(
    logits: torch.Tensor, labels: torch.Tensor, *, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position fp32 log-prob of `labels[:, t]` under the logits at t, and that distribution's entropy.

    No shift inside: pair it with `context_parallel.next_token_targets` (labels[t] = input_ids[t+1],
    targets shifted alike), which is what lets a rank holding only a slice of the sequence score its
    own positions. Equals `token_logprobs_and_entropy` moved one position left.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return chosen, _entropy(logp, entropy_grad)
