"""Context parallelism (`trainer.cp`): each rank of a `cp` group holds a contiguous slice of the sequence.

Long rollouts (64k-131k tokens) are the reason: at that length the activations, not the weights,
fill the device, and splitting the sequence splits them. Everything in a transformer is per token
except attention, so only attention needs the other ranks:

* **Ulysses** (the implementation here): an all-to-all turns the sequence-sharded q, k, v
  `[B, heads, T/cp, D]` into head-sharded `[B, heads/cp, T, D]`, each rank runs ordinary causal SDPA
  over the whole sequence for its heads, and a second all-to-all brings the output back to sequence
  sharding. Each rank sends and receives ~ (cp-1)/cp of its q, k, v and output, so the volume per
  rank does not grow with cp, and any SDPA kernel works (the CPU one included).
* **Ring attention** passes k/v blocks round the ring and merges partial softmaxes; that needs
  attention kernels that return the log-sum-exp (flash / efficient / cuDNN on GPUs). torch 2.13's
  `torch.distributed.tensor.experimental.context_parallel` is such a ring implementation, but it
  only dispatches the GPU SDPA ops (`aten._scaled_dot_product_{flash,efficient,cudnn}_attention`);
  the CPU kernel is not among them: on CPU/gloo it fails with "Operator
  aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
  registered". Ring attention is therefore not offered (no `trainer.cp_impl` key); Ulysses is the
  one context-parallel attention, on every device.

The data side: `next_token_targets` shifts the per-token targets on the *full* sequence (labels
`input_ids[t+1]`), so that after `shard_sequence` every rank scores its own positions with
`rlctl.trainer.loss.logprobs_of_labels` without needing its neighbour's first token.

GQA: query heads must be divisible by cp (else `trainer.cp` is refused); key/value heads that are not
are repeated by the smallest factor that makes them divisible (at most up to the query heads) before
the exchange, which costs some all-to-all volume but no accuracy. MLA (DeepSeek-V3) works as is: its
expanded q, k, v reach the attention function as ordinary heads (v with its own head size).
Refused with cp > 1: sliding-window layers, and DeepSeek sparse attention (GLM-5, DeepSeek-V3.2):
its indexer scores every query against all keys of the layer *before* the attention function and
builds a dense [B, T, T] top-k mask, so it would need the indexer's keys gathered and the mask
exchanged; transformers' DSA path materialises that T x T mask anyway, which long sequences cannot
afford (a sparse-indexer kernel is the way there).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Iterable

import torch

from rlctl.recipes.errors import RecipeError

TARGET_KEYS = ("loss_mask", "inference_logprobs")
"""Per-token tensors that score `input_ids[t]` and so move with the labels."""


def next_token_targets(tensors: dict, shift: Iterable[str] = TARGET_KEYS) -> dict:
    """A copy of `tensors` plus `labels` [B, T] = `input_ids[t+1]`, with the `shift` tensors moved
    one position left the same way, so position t holds what the prediction made *at* t is scored
    against. The last position has no next token: label 0 and 0 / False in every shifted tensor
    (so a shifted `loss_mask` excludes it). Other tensors (model inputs, per-row values, payloads
    aligned with input positions such as routed experts) are passed through unchanged.
    """
    out = dict(tensors)
    for key in ("input_ids", *shift):
        t = tensors[key]
        shifted = torch.zeros_like(t)
        shifted[:, :-1] = t[:, 1:]
        out["labels" if key == "input_ids" else key] = shifted
    return out


def shard_sequence(tensors: dict, cp_rank: int, cp: int) -> dict:
    """This rank's contiguous slice of every sequence tensor, plus the global `position_ids`.

    The sequence length T is `input_ids.shape[1]`; every tensor of shape [B, T, ...] is padded at the
    end to a multiple of cp (with zeros: pad token 0, False, mask 0; the padding is causal-attention
    invisible to the real tokens and is never scored) and cut to `[B, T_pad/cp, ...]`. Tensors of
    any other shape (advantages [B], ...) are passed through. `position_ids` [B, T_pad/cp] are the
    positions in the whole sequence, which the model's RoPE needs.

    Contiguous slices suit Ulysses: every rank runs attention over the whole sequence for its heads,
    so the causal mask's triangle costs each rank the same. Ring attention computes only its own
    queries' rows of the triangle, so contiguous slices leave the last rank with most of the work;
    that is why ring implementations use load-balanced (zig-zag / head-tail) sharding.
    """
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside 0..{cp - 1}")
    batch, length = tensors["input_ids"].shape[:2]
    padded = math.ceil(length / cp) * cp
    chunk = padded // cp
    lo, hi = cp_rank * chunk, (cp_rank + 1) * chunk
    out = {}
    for key, t in tensors.items():
        if t.dim() >= 2 and t.shape[0] == batch and t.shape[1] == length:
            if padded > length:
                t = torch.cat([t, t.new_zeros(t.shape[0], padded - length, *t.shape[2:])], dim=1)
            t = t[:, lo:hi]
        out[key] = t
    device = tensors["input_ids"].device
    out["position_ids"] = torch.arange(lo, hi, device=device).unsqueeze(0).expand(batch, -1).contiguous()
    return out


# ---- Ulysses attention ------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all on dim 0 with a backward (the reverse all-to-all of the gradient)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def _sequence_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[B, H, T/cp, D] (this rank's positions, all heads) -> [B, H/cp, T, D] (all positions, its heads)."""
    b, h, s, d = x.shape
    x = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # [cp (head chunk -> destination), B, H/cp, s, D]
    x = _all_to_all(x, group)  # [cp (sequence chunk <- source), B, H/cp, s, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse: [B, H/cp, T, D] -> [B, H, T/cp, D]."""
    b, hc, t, d = x.shape
    x = x.reshape(b, hc, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # [cp (sequence chunk -> dest), B, H/cp, s, D]
    x = _all_to_all(x, group)  # [cp (head chunk <- source), B, H/cp, s, D]
    return x.transpose(0, 1).reshape(b, cp * hc, t // cp, d)


def _repeat_kv(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Repeat each key/value head `factor` times in place (head j -> j*factor .. j*factor+factor-1),
    which keeps query head h on its kv head h // (groups / factor)."""
    return x if factor == 1 else x.repeat_interleave(factor, dim=1)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    *,
    cp: int,
    group,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (`AttentionInterface` signature) on sequence-sharded q, k, v.

    Causal over the whole (right-padded) row: no mask is built for this implementation (transformers
    skips mask creation for attention functions it has no mask function for), so `attention_mask`
    must be None. Returns `[B, T/cp, H, D]` like transformers' SDPA function.
    """
    if attention_mask is not None or sliding_window is not None:
        raise RuntimeError("Ulysses attention runs plain causal attention: no attention mask or sliding window")
    # smallest repeat that makes the kv heads divisible by cp (it always divides the GQA group size)
    factor = cp // math.gcd(key.shape[1], cp)
    key, value = _repeat_kv(key, factor), _repeat_kv(value, factor)
    q = _sequence_to_heads(query, cp, group)
    k = _sequence_to_heads(key, cp, group)
    v = _sequence_to_heads(value, cp, group)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling
    )
    return _heads_to_sequence(out, cp, group).transpose(1, 2).contiguous(), None


def check_context_parallel(config, cp: int) -> None:
    """Refuse (RecipeError, `trainer.cp`) a cp > 1 this implementation cannot run for a transformers
    config: needs no weights or process group, so start-up validation can run it on the meta device."""
    if cp == 1:
        return
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    if heads % cp:
        raise RecipeError(f"cp={cp} must divide the model's {heads} attention heads (Ulysses splits heads)", "trainer.cp")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise RecipeError("context parallelism supports full causal attention only; the model has sliding-window "
                          "layers (allowed: cp = 1)", "trainer.cp")
    if getattr(config, "index_topk", None) is not None:
        raise RecipeError(f"context parallelism does not support DeepSeek sparse attention ({config.model_type}: its "
                          "indexer needs every key of the sequence; allowed: cp = 1)", "trainer.cp")


def enable_ulysses(model, cp_mesh) -> str | None:
    """Switch `model`'s attention to Ulysses over the 1-D `cp_mesh` (e.g. `mesh["cp"]`).

    Registers an attention function bound to the mesh's process group with transformers'
    `AttentionInterface` and selects it with `model.set_attn_implementation`. From then on the model
    must be called on `shard_sequence` output: this rank's `input_ids` slice *and* its global
    `position_ids`, with no attention mask. Returns the implementation's name; with cp = 1 the model
    is left as it is and None is returned. RecipeError (`trainer.cp`) when cp does not divide the
    query heads or the model's attention cannot be split (see `check_context_parallel`).
    """
    from transformers import AttentionInterface

    cp = cp_mesh.size()
    if cp == 1:
        return None
    check_context_parallel(model.config, cp)
    group = cp_mesh.get_group()
    name = f"rlctl_ulysses_{group.group_name}"
    AttentionInterface.register(name, partial(ulysses_attention, cp=cp, group=group))
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # transformers only warns when it cannot switch
        raise RuntimeError(f"{type(model).__name__}: could not switch attention to {name!r} for context parallelism")
    return name
