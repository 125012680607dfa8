"""Mixture-of-experts compute for transformers MoE models: routing, grouped experts, router replay, load.

The transformers model classes and parameter names stay (checkpoints, DCP and publishing depend on
them); only the forward of each MoE block and of its experts module is replaced:

- routing reproduces transformers' routers: softmax top-k (Qwen2/Qwen3-MoE, `norm_topk_prob`) and
  sigmoid scores + `e_score_correction_bias` with grouped top-k and `routed_scaling_factor`
  (DeepSeek-V3, GLM-4.5/GLM-5 MoE), with an optional replayed top-k (router replay, R3);
- experts run on tokens sorted by expert with grouped matmuls (`torch.nn.functional.grouped_mm`, or
  a padded `torch.bmm` where its alignment rules are not met): no per-expert Python loop. With expert
  parallelism (`expert_parallel.py`) the same forward dispatches the sorted tokens to the ranks that
  own their experts and combines them back.

The experts module is still called as a module (`block.experts(x, index, weights)`) so FSDP's
hooks that gather its parameters run around it.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

_REPLAY = "_rlctl_replay"  # per-block attribute: the [tokens, K] replayed experts, or None
_LOAD = "_rlctl_load"  # per-block attribute: tokens routed to each expert since the last reset
_ROUTED = "_rlctl_routed"  # per-block attribute: the experts of the last forward that built a graph
_REPLAY_COUNTS = "_rlctl_replay_counts"  # per-block: [token rows replayed, of those routed differently]


def _unwrapped(layer):
    """A decoder layer without the activation-checkpoint wrapper."""
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _is_moe_block(mlp) -> bool:
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    return (
        experts is not None and gate is not None
        and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")
        and hasattr(gate, "weight") and hasattr(gate, "top_k")
    )


def moe_blocks(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, MoE block) for every MoE layer, in layer order (dense layers are skipped).

    Only attributes are inspected, so it works on meta-device models. An MoE layout rlctl cannot run
    (biased or transposed expert weights, experts without a gate projection) is refused by name.
    """
    from rlctl.trainer.layers import decoder_layers

    found = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(_unwrapped(layer), "mlp", None)
        if mlp is None or not _is_moe_block(mlp):
            continue
        ex = mlp.experts
        if getattr(ex, "has_bias", False) or getattr(ex, "is_transposed", False) or not getattr(ex, "has_gate", True) \
                or not getattr(ex, "is_concatenated", True) or ex.gate_up_proj.dim() != 3:
            raise RuntimeError(f"{type(ex).__name__}: expert layout not supported (expected gate_up_proj "
                               "[E, 2I, H] and down_proj [E, H, I] without bias)")
        found.append((i, mlp))
    return found


# ---- routing ----------------------------------------------------------------------------------------
def _grouped_topk_choice(gate, scores: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 / GLM expert choice: bias-corrected scores, best `topk_group` of `n_group` groups
    (a group scores by its two best experts), top-k inside them. Indices only (no gradient)."""
    n_experts = scores.shape[-1]
    choice = scores + gate.e_score_correction_bias
    groups = choice.view(-1, gate.num_group, n_experts // gate.num_group)
    group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand(-1, gate.num_group, n_experts // gate.num_group)
    choice = choice.masked_fill(~expert_mask.reshape(-1, n_experts), float("-inf"))
    return torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]


def _replayed(index: torch.Tensor, replay: torch.Tensor | None, counts_on=None) -> torch.Tensor:
    """The replayed experts where a token's row is fully known (no -1), the router's own elsewhere.
    With `counts_on` (a block), adds to its replay counts (see `replay_counts`)."""
    if replay is None:
        return index
    if replay.shape != index.shape:
        raise ValueError(f"router replay: {tuple(replay.shape)} experts given for a block that routes "
                         f"{tuple(index.shape)} (tokens, top_k); the replay tensor must be aligned with the "
                         "input_ids this rank feeds the model")
    replay = replay.to(device=index.device, dtype=index.dtype)
    known = (replay >= 0).all(dim=-1, keepdim=True)
    if counts_on is not None:
        differs = (replay.sort(-1).values != index.sort(-1).values).any(-1, keepdim=True) & known
        counts = torch.stack([known.sum(), differs.sum()])
        previous = getattr(counts_on, _REPLAY_COUNTS, None)
        setattr(counts_on, _REPLAY_COUNTS, counts if previous is None else previous + counts)
    return torch.where(known, replay, index)


def route(block, x: torch.Tensor, replay: torch.Tensor | None = None,
          count: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k expert index [N, K], routing weight [N, K]) of tokens `x` [N, H], as the block's
    transformers router computes them; the experts of `replay` [N, K] where its row has no -1.
    `count`: add to the block's replay counts (not for a recomputed forward)."""
    counts_on = block if count else None
    gate = block.gate
    if hasattr(gate, "e_score_correction_bias"):  # sigmoid scores, grouped top-k (DeepSeek-V3 / GLM)
        logits = F.linear(x.float(), gate.weight.float())
        scores = logits.sigmoid()
        with torch.no_grad():
            index = _replayed(_grouped_topk_choice(gate, scores.detach()), replay, counts_on)
        weights = scores.gather(1, index)
        if gate.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return index, weights * gate.routed_scaling_factor
    logits = F.linear(x, gate.weight)  # softmax top-k (Qwen2/Qwen3-MoE)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    with torch.no_grad():
        index = _replayed(torch.topk(probs.detach(), gate.top_k, dim=-1)[1], replay, counts_on)
    weights = probs.gather(1, index)
    if gate.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights.to(logits.dtype)


# ---- grouped expert compute ---------------------------------------------------------------------------
def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`grouped_mm`'s rules: 16-byte aligned rows and pointers; on CUDA bf16 only."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    if x.device.type not in ("cpu", "cuda"):
        return False
    per16 = 16 // x.element_size()
    return x.shape[-1] % per16 == 0 and weight.shape[-1] % per16 == 0 and \
        x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # grouped_mm's backward rejects broadcast (stride 0) gradients, e.g. the one of a plain .sum()
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [S, in] grouped by expert (`counts` [E] rows each, in order) times each expert's
    `weight` [E, out, in] transposed: [S, out]."""
    w = weight.transpose(-2, -1)
    if x.shape[0] == 0:
        return x.new_zeros(0, weight.shape[1]) + 0 * w.sum()  # keeps the graph (and FSDP's grad hooks)
    if _grouped_mm_fits(x, w):
        return _contiguous_grad(F.grouped_mm(x.to(w.dtype), w, offs=torch.cumsum(counts, 0, dtype=torch.int32)))
    # padded batch over [E, capacity, in]: one bmm, no per-expert loop
    n_exp = weight.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(n_exp, device=x.device), counts, output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    capacity = int(counts.max())
    padded = x.new_zeros(n_exp, capacity, x.shape[-1]).index_put((expert, slot), x)
    return torch.bmm(padded.to(w.dtype), w)[expert, slot]


def expert_mlp(experts, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor):
    """SwiGLU experts (transformers' layout: gate_up [E, 2I, H], down [E, H, I]) on grouped rows."""
    gate, up = grouped_linear(x, gate_up, counts).chunk(2, dim=-1)
    return grouped_linear(experts.act_fn(gate) * up, down, counts)


def _local(param: torch.Tensor) -> torch.Tensor:
    """The rank's shard of an expert-parallel (DTensor) parameter; a plain tensor as is."""
    return param.to_local() if hasattr(param, "to_local") else param


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Replacement forward of a transformers experts module: same arguments and result."""
    n_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=self.num_experts)
    routed = hidden_states[order // top_k]
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    ep_group = getattr(self, "_rlctl_ep_group", None)
    if ep_group is None:
        out = expert_mlp(self, routed, counts, gate_up, down)
    else:
        # set by expert_parallel.apply_expert_parallel (which imports this module, not the reverse)
        out = self._rlctl_ep_dispatch(self, routed, counts, gate_up, down, ep_group)
    weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
    return unsorted.view(n_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _in_backward() -> bool:
    # activation checkpointing re-runs the forward inside backward: that pass routes no new tokens
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def moe_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Replacement forward of a transformers MoE block ([B, T, H] in and out)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    recompute = _in_backward()
    replay = getattr(self, _REPLAY, None)
    stashed = getattr(self, _ROUTED, None)
    if recompute and stashed is not None and stashed.shape[0] == x.shape[0]:
        replay = stashed  # the routing of the forward being recomputed, even outside `routing_replay`
    index, weights = route(self, x, replay, count=not recompute)
    if not recompute and torch.is_grad_enabled():
        setattr(self, _ROUTED, index.detach())
    if not recompute:
        with torch.no_grad():
            load = torch.bincount(index.reshape(-1), minlength=self.gate.weight.shape[0])
            setattr(self, _LOAD, load if getattr(self, _LOAD, None) is None else getattr(self, _LOAD) + load)
    out = self.experts(x, index, weights)
    if getattr(self, "shared_experts", None) is not None:  # DeepSeek-V3 / GLM
        out = out + self.shared_experts(x)
    elif getattr(self, "shared_expert", None) is not None:  # Qwen2-MoE style, gated
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out.reshape(shape)


def enable_grouped_experts(model) -> int:
    """Route and run every MoE block of `model` with rlctl's grouped implementation (works on meta
    models; idempotent). Returns the number of MoE blocks."""
    blocks = moe_blocks(model)
    for _, block in blocks:
        # Never traced by torch.compile (trainer.compile): the block keeps state between its forward and
        # the recompute of activation checkpointing (`_in_backward`), which a traced graph would bake in.
        block.forward = types.MethodType(torch.compiler.disable(moe_block_forward), block)
        block.experts.forward = types.MethodType(grouped_experts_forward, block.experts)
    return len(blocks)


@contextlib.contextmanager
def routing_replay(model, routed: torch.Tensor | None):
    """Within the block, MoE routers use the experts in `routed` ([B, T, L, K] integers aligned with
    the input_ids fed to the model, L = the blocks of `moe_blocks` in order, -1 where unknown: a token
    whose row holds a -1 is routed by the router). Routing weights still come from the router's
    scores for those experts, so the router gets gradients. None: no replay.

    With activation checkpointing the backward recomputes the forward: each block then reuses the
    experts its last forward chose, so the backward may run after the block (micro-batch by
    micro-batch: forward, then its backward).
    """
    if routed is None:
        yield
        return
    blocks = [b for _, b in moe_blocks(model)]
    if routed.dim() != 4 or routed.shape[2] != len(blocks) or (blocks and routed.shape[3] != blocks[0].gate.top_k):
        expected = f"[B, T, {len(blocks)}, {blocks[0].gate.top_k if blocks else 'K'}]"
        raise ValueError(f"router replay: routed experts of shape {tuple(routed.shape)}, expected {expected}")
    n_experts = blocks[0].gate.weight.shape[0] if blocks else 0
    if routed.numel() and (int(routed.min()) < -1 or int(routed.max()) >= n_experts):
        raise ValueError(f"router replay: expert ids must lie in [-1, {n_experts}), got "
                         f"[{int(routed.min())}, {int(routed.max())}]")
    try:
        for layer, block in enumerate(blocks):
            setattr(block, _REPLAY, routed[:, :, layer, :].reshape(-1, routed.shape[3]))
        yield
    finally:
        for block in blocks:
            setattr(block, _REPLAY, None)


def expert_load(model, reset: bool = True) -> torch.Tensor:
    """Tokens this rank routed to each expert since the last reset: [L, E] (int64; zeros before any
    forward). Recomputed forwards (activation checkpointing) are not counted twice."""
    blocks = [b for _, b in moe_blocks(model)]
    if not blocks:
        return torch.zeros(0, 0, dtype=torch.long)
    n_experts = blocks[0].gate.weight.shape[0]
    rows = []
    for block in blocks:
        load = getattr(block, _LOAD, None)
        rows.append(torch.zeros(n_experts, dtype=torch.long) if load is None else load.detach().cpu())
        if reset:
            setattr(block, _LOAD, None)
    return torch.stack(rows)


def replay_counts(model, reset: bool = True) -> torch.Tensor:
    """Router replay since the last reset, summed over MoE blocks: [rows routed by the replayed experts,
    of those the rows whose experts the router would have chosen differently] (int64). A row is one
    token in one block; recomputed forwards are not counted."""
    total = torch.zeros(2, dtype=torch.long)
    for _, block in moe_blocks(model):
        counts = getattr(block, _REPLAY_COUNTS, None)
        if counts is not None:
            total += counts.detach().cpu()
        if reset:
            setattr(block, _REPLAY_COUNTS, None)
    return total
