"""MoE in the trainer: grouped experts vs transformers' eager loop, expert parallelism and FSDP on gloo
vs one rank, router replay, expert load. Tiny fp32 models built here (Qwen3-MoE and DeepSeek-V3)."""
from __future__ import annotations

import copy

import pytest
from trainer_fixtures import join_gloo, spawn_ranks
import torch

from rlctl.trainer.moe import (enable_grouped_experts, expert_load, grouped_linear, moe_blocks, replay_counts,
                               routing_replay)
from rlctl.trainer.parallel import gather_full

VOCAB = 64


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2,
                            num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                            topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=16,
                            q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)


def qwen3_two_experts_config():
    """One expert per ep rank: fewer local experts than FSDP ranks, so FSDP shards within experts."""
    config = qwen3_moe_config()
    config.num_experts = 2
    return config


CONFIGS = {"qwen3_moe": qwen3_moe_config, "deepseek_v3": deepseek_v3_config}
MULTI_RANK_ONLY = {"qwen3_two_experts": qwen3_two_experts_config}


def eager_model(family: str, seed: int = 0):
    """transformers' own MoE forward (per-expert loop); routers scaled so routing is far from uniform."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = {**CONFIGS, **MULTI_RANK_ONLY}[family]()
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager", attn_implementation="eager",
                                             dtype=torch.float32)
    with torch.no_grad():
        for _, block in moe_blocks(model):
            block.gate.weight.normal_(0, 0.5)
            if hasattr(block.gate, "e_score_correction_bias"):
                block.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def batch(rows: int = 4, length: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length - 1)
    mask[1, 7:] = 0  # ragged: tokens without loss
    return ids, mask


def token_logprobs(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def loss_of(logprobs, mask, n_tokens):
    """Each rank's loss normalised by the global token count (as the trainer's loss is)."""
    return -(logprobs * mask).sum() / n_tokens


def captured_routing(model, ids) -> torch.Tensor:
    """The experts transformers' routers pick for `ids`: [B, T, L, K] (from the routers' outputs)."""
    picked, hooks = [], []
    for _, block in moe_blocks(model):
        hooks.append(block.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2].detach())))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return torch.stack([p.view(*ids.shape, -1) for p in picked], dim=2)


def assert_close(actual, expected, what, rtol=1e-5):
    actual, expected = actual.detach(), expected.detach()
    err = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        plain = name.replace("._checkpoint_wrapped_module", "")  # as the unwrapped model names it
        out[plain] = gather_full(g).clone()  # not full_tensor(): see gather_full
    return out


# ---- one rank ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_grouped_experts_match_transformers_eager(family):
    ref = eager_model(family)
    model = copy.deepcopy(ref)
    assert enable_grouped_experts(model) == len(moe_blocks(ref)) == 2
    ids, mask = batch()
    for m in (ref, model):
        lp = token_logprobs(m, ids)
        loss_of(lp, mask, mask.sum()).backward()
        m.lp, m.loss = lp.detach(), loss_of(lp, mask, mask.sum()).detach()
    assert_close(model.lp, ref.lp, "logprobs")
    assert_close(model.loss, ref.loss, "loss")
    ref_grads = grads(ref)
    for name, g in grads(model).items():
        assert_close(g, ref_grads[name], name)


def test_grouped_linear_padded_path_and_empty_groups():
    """Dimensions grouped_mm cannot take (rows of 6 floats) use the padded bmm; same result, same
    gradients as one matmul per expert; an expert without tokens and a rank without rows work."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 5, 6, generator=g, requires_grad=True)
    x = torch.randn(7, 6, generator=g, requires_grad=True)
    counts = torch.tensor([4, 0, 3])
    out = grouped_linear(x, weight, counts)
    ref = torch.cat([x[:4] @ weight[0].T, x[4:] @ weight[2].T])
    assert_close(out, ref, "padded output")
    (gx, gw) = torch.autograd.grad(out.square().sum(), (x, weight))
    (rx, rw) = torch.autograd.grad(ref.square().sum(), (x, weight))
    assert_close(gx, rx, "input grad")
    assert_close(gw, rw, "weight grad")
    empty = grouped_linear(x[:0], weight, torch.zeros(3, dtype=torch.long))
    assert empty.shape == (0, 5)
    assert torch.autograd.grad(empty.sum(), weight)[0].abs().sum() == 0


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_router_replay_own_routing_is_identity_and_forced_routing_matches_reference(family):
    ref = eager_model(family)
    model = copy.deepcopy(ref)
    enable_grouped_experts(model)
    ids, mask = batch()
    own = captured_routing(ref, ids)

    def run(m, routed=None):
        m.zero_grad(set_to_none=True)
        with routing_replay(m, routed):
            lp = token_logprobs(m, ids)
            loss = loss_of(lp, mask, mask.sum())
            loss.backward()
        return lp.detach(), loss.detach(), grads(m)

    base = run(model)
    assert replay_counts(model).tolist() == [0, 0]  # no replay, nothing counted
    replayed = run(model, own)
    rows = own.shape[0] * own.shape[1] * own.shape[2]  # tokens x MoE blocks
    assert replay_counts(model).tolist() == [rows, 0]  # all replayed, none overridden
    for a, b, what in ((replayed[0], base[0], "logprobs"), (replayed[1], base[1], "loss")):
        assert torch.equal(a, b), what
    for name in base[2]:
        assert torch.equal(replayed[2][name], base[2][name]), name

    # a different routing: shift every expert; unknown (-1) rows keep the router's own choice
    n_experts = moe_blocks(model)[0][1].gate.weight.shape[0]
    forced = (own + 3) % n_experts
    forced[:, -1] = -1  # the last sampled token: inference never routed it
    forced[2, :4, 0, 1] = -1
    expected = torch.where((forced >= 0).all(dim=-1, keepdim=True), forced, own)
    other = run(model, forced)
    assert not torch.allclose(other[0], base[0], rtol=1e-3)
    known = int((forced >= 0).all(-1).sum())
    overridden = int(((forced.sort(-1).values != own.sort(-1).values).any(-1) & (forced >= 0).all(-1)).sum())
    assert replay_counts(model).tolist() == [known, overridden] and 0 < overridden <= known < rows
    # reference: transformers' eager model whose routers are made to pick `expected`
    hooks = []
    for layer, (_, block) in enumerate(moe_blocks(ref)):
        want = expected[:, :, layer].reshape(-1, expected.shape[-1])
        hooks.append(block.gate.register_forward_hook(_forcing_hook(want)))
    reference = run(ref)
    for h in hooks:
        h.remove()
    assert_close(other[0], reference[0], "logprobs")
    assert_close(other[1], reference[1], "loss")
    for name, g in reference[2].items():
        assert_close(other[2][name], g, name)


def test_router_replay_holds_when_checkpointing_recomputes_after_the_block():
    """The backward of a checkpointed layer re-runs its forward after `routing_replay` has exited:
    it must route as the forward did, not as the router would."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = eager_model("deepseek_v3")
    ids, mask = batch()
    forced = (captured_routing(ref, ids) + 1) % 8
    enable_grouped_experts(ref)
    model = copy.deepcopy(ref)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
    with routing_replay(ref, forced):
        loss_of(token_logprobs(ref, ids), mask, mask.sum()).backward()
    with routing_replay(model, forced):
        loss = loss_of(token_logprobs(model, ids), mask, mask.sum())
    loss.backward()
    expected = grads(ref)
    for name, g in grads(model).items():
        assert_close(g, expected[name], name)


def _forcing_hook(index):
    """Router output with `index` as the top-k and weights computed the transformers way from it."""
    def hook(gate, inputs, out):
        logits = out[0]
        if hasattr(gate, "e_score_correction_bias"):
            w = logits.sigmoid().gather(1, index)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) if gate.norm_topk_prob else w
            return logits, w * gate.routed_scaling_factor, index
        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
        w = w / w.sum(-1, keepdim=True) if gate.norm_topk_prob else w
        return logits, w.to(logits.dtype), index
    return hook


def test_router_replay_refuses_misaligned_routing():
    model = eager_model("qwen3_moe")
    enable_grouped_experts(model)
    ids, _ = batch()
    with pytest.raises(ValueError, match=r"expected \[B, T, 2, 2\]"):
        with routing_replay(model, torch.zeros(4, 12, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="aligned with the input_ids"):
        with routing_replay(model, torch.zeros(4, 11, 2, 2, dtype=torch.long)):
            model(input_ids=ids)
    with pytest.raises(ValueError, match=r"\[-1, 8\)"):
        with routing_replay(model, torch.full((4, 12, 2, 2), 8)):
            pass


def test_expert_load_counts_routed_tokens_once_even_with_activation_checkpointing():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = eager_model("qwen3_moe")
    model = copy.deepcopy(ref)
    enable_grouped_experts(model)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
    ids, mask = batch()
    own = captured_routing(ref, ids)
    assert expert_load(model).sum() == 0
    loss_of(token_logprobs(model, ids), mask, mask.sum()).backward()  # the backward re-runs the forward
    token_logprobs(model, ids[:2])
    load = expert_load(model)
    expected = torch.stack([torch.bincount(own[:, :, layer].reshape(-1), minlength=8)
                            + torch.bincount(own[:2, :, layer].reshape(-1), minlength=8) for layer in range(2)])
    assert torch.equal(load, expected)
    assert load.sum() == 2 * 2 * (4 + 2) * 12  # layers × top_k × tokens
    assert expert_load(model).sum() == 0  # reset by the previous call


# ---- several ranks (gloo) ----------------------------------------------------------------------------
def _rank_main(rank, world, port, family, dims_kw, replay, activation_checkpointing, compile_layers=False):
    import torch.distributed as dist

    from rlctl.trainer.degrees import ParallelDims
    from rlctl.trainer.expert_parallel import apply_expert_parallel, clip_grad_norm_
    from rlctl.trainer.parallel import apply_fsdp, build_mesh, fsdp_mesh

    join_gloo(rank, world, port)
    try:
        dims = ParallelDims(world_size=world, **dims_kw).validate("cpu")
        ref = eager_model(family)
        ids, mask = batch(rows=4)
        n_tokens = mask.sum()
        routed = None
        if replay:
            routed = (captured_routing(ref, ids) + 5) % moe_blocks(ref)[0][1].gate.weight.shape[0]
            routed[:, -1] = -1
        enable_grouped_experts(ref)  # one rank, same routing code: the reference for the sharded run
        model = copy.deepcopy(ref)
        with routing_replay(ref, routed):
            ref_lp = token_logprobs(ref, ids)
            ref_loss = loss_of(ref_lp, mask, n_tokens)
            ref_loss.backward()
        ref_grads = grads(ref)

        mesh = build_mesh(dims, torch.device("cpu"))
        apply_expert_parallel(model, mesh["ep"])
        apply_fsdp(model, fsdp_mesh(mesh, dims), mesh["efsdp"], "float32", activation_checkpointing,
                   compile_layers=compile_layers)
        dp_rank = mesh["dp"].get_local_rank()
        rows = torch.arange(dp_rank, ids.shape[0], dims.dp)
        with routing_replay(model, None if routed is None else routed[rows]):
            lp = token_logprobs(model, ids[rows])
            loss = loss_of(lp, mask[rows], n_tokens)
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert_close(total, ref_loss.detach(), "loss")
        assert_close(lp.detach(), ref_lp.detach()[rows], "logprobs")
        sharded = grads(model)
        assert sharded.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert_close(sharded[name], g, name)
        # one norm over parameters on different meshes (torch's clip_grad_norm_ cannot stack them)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        norm = clip_grad_norm_(model.parameters(), 0.05)
        assert_close(norm, ref_norm, "grad norm")
        clipped, ref_clipped = grads(model), grads(ref)  # grads() names without the checkpoint wrapper
        for name, g in ref_clipped.items():
            assert_close(clipped[name], g, f"clipped {name}")
        if compile_layers:  # the layers ran compiled graphs
            from torch._dynamo.utils import counters

            from rlctl.trainer.compiled_layers import is_compiled

            assert all(is_compiled(layer) for layer in model.model.layers)
            assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
        experts = moe_blocks(model)[0][1].experts.gate_up_proj
        n_experts, rows = experts.shape[:2]
        local = experts.to_local().shape
        if n_experts // dims.ep >= dims.efsdp:  # this rank's slice only: whole experts, or rows of them
            assert local[:2] == (n_experts // (dims.ep * dims.efsdp), rows)
        else:
            assert local[:2] == (n_experts // dims.ep, rows // dims.efsdp)
    finally:
        dist.destroy_process_group()


def _launch(world, *args, timeout=240):
    spawn_ranks(_rank_main, world, *args, timeout=timeout)


def test_expert_parallel_two_ranks_matches_one_rank():
    """(a) ep = 2 on a world of 2: the two ranks hold 4 experts each and read different rows."""
    _launch(2, "qwen3_moe", dict(dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2), False, False)


def test_fsdp4_ep2_with_router_replay_and_checkpointing_matches_one_rank():
    """(c)+(d) dp_shard 4 × ep 2: experts split 2× by EP and 2× by FSDP, shared experts and the dense
    layer 4× by FSDP; a replayed routing; activation checkpointing re-runs the all-to-alls."""
    _launch(4, "deepseek_v3", dict(dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=2), True, True)


def test_compiled_layers_with_ep2_router_replay_and_checkpointing_match_one_eager_rank():
    """trainer.compile: each decoder layer compiled inside its activation checkpoint, then FSDP, on
    ep = 2 with a replayed routing; the MoE block (all-to-alls, token counts, replay) runs eagerly
    between the compiled pieces, and the result is the eager rank's."""
    _launch(2, "qwen3_moe", dict(dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2), True, True, True, timeout=300)


def test_fsdp4_ep2_with_fewer_local_experts_than_shard_ranks_matches_one_rank():
    """One expert per ep rank over 2 FSDP ranks: each expert's rows are sharded (Shard(1))."""
    _launch(4, "qwen3_two_experts", dict(dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=2), False, False)
