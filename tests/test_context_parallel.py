"""Context parallelism: target shifting, sequence sharding, and Ulysses (cp = 2 on gloo) against one rank.

The equivalence test runs two real ranks (spawned processes), each holding half of every
sequence, and compares with the same model on one rank computed the way the trainer did before
(`token_logprobs_and_entropy` on the whole row): loss, per-token logprobs and gradients.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlctl.recipes.errors import RecipeError
from rlctl.trainer.context_parallel import (
    check_context_parallel, enable_ulysses, next_token_targets, shard_sequence,
)
from rlctl.trainer.loss import importance_ratio_loss, logprobs_of_labels, token_logprobs_and_entropy
from trainer_fixtures import spawn_ranks

LOSS_CFG = SimpleNamespace(mask_low=0.125, mask_high=8.0)
# qwen3-kv2: kv heads divisible by cp; qwen3-kv1: the kv head is repeated before the exchange;
# deepseek-v3: MLA (q/k and v head sizes differ) and MoE layers; qwen3-kv2+fsdp: FSDP2-sharded over the
# trainer's `fsdp` mesh (dp_shard × cp) as the trainer does, Ulysses switched on after sharding
MODELS = ("qwen3-kv2", "qwen3-kv1", "deepseek-v3", "qwen3-kv2+fsdp")
REL_TOL = 1e-5


def tiny_config(name: str):
    from transformers import DeepseekV3Config, Qwen3Config

    from rlctl.trainer.tiny_model import TINY_QWEN3

    if name.startswith("qwen3"):
        cfg = {k: v for k, v in TINY_QWEN3.items() if k not in ("architectures", "model_type", "torch_dtype")}
        kv = int(name.removesuffix("+fsdp")[-1])
        return Qwen3Config(**{**cfg, "num_key_value_heads": kv}, attn_implementation="sdpa")
    return DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, attn_implementation="sdpa",
    )


def tiny_model(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name)).float().train()


def ragged_batch(vocab: int, lengths=(11, 7, 4), prompt: int = 3, seed: int = 1) -> dict:
    """Right-padded rows of different lengths; T = 11 is not a multiple of cp = 2."""
    g = torch.Generator().manual_seed(seed)
    rows, total = len(lengths), max(lengths)
    ids = torch.zeros(rows, total, dtype=torch.long)
    attn = torch.zeros(rows, total, dtype=torch.bool)
    loss_mask = torch.zeros(rows, total, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(4, vocab, (n,), generator=g)
        attn[r, :n] = True
        loss_mask[r, prompt:n] = True
    return {
        "input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.25])[:rows],
        "noise": 0.1 * torch.randn(rows, total, generator=g),
    }


def with_inference_logprobs(batch: dict, logprobs: torch.Tensor) -> dict:
    """What a sampler would have reported: the trainer's logprobs plus noise, on completion tokens."""
    return {**batch, "inference_logprobs": ((logprobs.detach() + batch["noise"]) * batch["loss_mask"]).float()}


def reference(name: str) -> dict:
    """One rank, the whole row, the shift inside `token_logprobs_and_entropy` (the pre-CP trainer path)."""
    model = tiny_model(name)
    batch = ragged_batch(model.config.vocab_size)
    logprobs, entropy = token_logprobs_and_entropy(model(input_ids=batch["input_ids"]).logits, batch["input_ids"])
    batch = with_inference_logprobs(batch, logprobs)
    num_tokens = float(batch["loss_mask"].sum())
    loss, _ = importance_ratio_loss(logprobs, batch["inference_logprobs"], batch["advantages"], batch["loss_mask"],
                                    LOSS_CFG, num_tokens=num_tokens, entropy=entropy)
    loss.backward()
    return {"loss": loss.detach(), "logprobs": logprobs.detach(), "entropy": entropy,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


# ---- unit tests -----------------------------------------------------------------------------------


def test_next_token_targets_shifts_labels_and_targets_left():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0]]),
        "attention_mask": torch.tensor([[True, True, True, False]]),
        "loss_mask": torch.tensor([[False, True, True, False]]),
        "inference_logprobs": torch.tensor([[0.0, -1.0, -2.0, 0.0]]),
        "policy_version": torch.tensor([[-1, 3, 3, -1]]),
        "advantages": torch.tensor([0.5]),
    }
    out = next_token_targets(batch, shift=("loss_mask", "inference_logprobs", "policy_version"))
    assert out["labels"].tolist() == [[6, 7, 0, 0]]
    assert out["loss_mask"].tolist() == [[True, True, False, False]]
    assert out["inference_logprobs"].tolist() == [[-1.0, -2.0, 0.0, 0.0]]
    assert out["policy_version"].tolist() == [[3, 3, -1, 0]]
    # model inputs and per-row values untouched; the caller's dict is not modified
    assert out["input_ids"] is batch["input_ids"] and out["advantages"] is batch["advantages"]
    assert batch["loss_mask"].tolist() == [[False, True, True, False]]
    # last position is never scored, even when the row fills the whole width
    full = next_token_targets({"input_ids": torch.tensor([[1, 2]]), "loss_mask": torch.tensor([[True, True]]),
                               "inference_logprobs": torch.zeros(1, 2)})
    assert full["loss_mask"].tolist() == [[True, False]]


def test_shard_sequence_pads_to_multiple_and_gives_global_positions():
    batch = {
        "input_ids": torch.arange(1, 8).view(1, 7),
        "loss_mask": torch.ones(1, 7, dtype=torch.bool),
        "payload.routed_experts": torch.arange(7 * 2 * 2).view(1, 7, 2, 2),
        "advantages": torch.tensor([2.0]),
    }
    shards = [shard_sequence(batch, r, 3) for r in range(3)]
    assert [s["input_ids"].tolist() for s in shards] == [[[1, 2, 3]], [[4, 5, 6]], [[7, 0, 0]]]
    assert shards[2]["loss_mask"].tolist() == [[True, False, False]]
    assert [s["position_ids"].tolist() for s in shards] == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]]]
    assert shards[1]["payload.routed_experts"].shape == (1, 3, 2, 2)
    assert torch.equal(torch.cat([s["payload.routed_experts"] for s in shards], 1)[:, :7], batch["payload.routed_experts"])
    assert shards[2]["payload.routed_experts"][0, 1:].eq(0).all()
    assert all(s["advantages"] is batch["advantages"] for s in shards)
    with pytest.raises(ValueError):
        shard_sequence(batch, 3, 3)


def test_logprobs_of_labels_equals_shift_inside_version():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 17, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ids = torch.randint(0, 17, (3, 9), generator=g)
    old_lp, old_ent = token_logprobs_and_entropy(logits, ids)
    labels = next_token_targets({"input_ids": ids}, shift=())["labels"]
    lp, ent = logprobs_of_labels(logits, labels)
    assert lp.dtype == ent.dtype == torch.float32
    assert torch.equal(lp[:, :-1], old_lp[:, 1:]) and torch.equal(ent[:, :-1], old_ent[:, 1:])


def test_enable_ulysses_refuses_heads_not_divisible_by_cp_and_leaves_cp1_alone():
    model = tiny_model("qwen3-kv2")
    three = SimpleNamespace(size=lambda: 3, get_group=lambda: pytest.fail("refused before using the group"))
    with pytest.raises(RecipeError, match=r"^trainer\.cp: cp=3 must divide the model's 4 attention heads"):
        enable_ulysses(model, three)
    assert enable_ulysses(model, SimpleNamespace(size=lambda: 1)) is None
    assert model.config._attn_implementation == "sdpa"


def test_check_context_parallel_refuses_sliding_window_and_sparse_attention():
    from transformers import GlmMoeDsaConfig, Qwen3Config

    check_context_parallel(tiny_config("deepseek-v3"), 4)  # MLA: accepted
    check_context_parallel(GlmMoeDsaConfig(num_attention_heads=4), 1)  # anything goes without cp
    with pytest.raises(RecipeError, match=r"^trainer\.cp: .*DeepSeek sparse attention \(glm_moe_dsa"):
        check_context_parallel(GlmMoeDsaConfig(num_attention_heads=4), 2)
    sliding = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, use_sliding_window=True,
                          sliding_window=8, max_window_layers=0)
    with pytest.raises(RecipeError, match=r"^trainer\.cp: .*sliding-window"):
        check_context_parallel(sliding, 2)


# ---- cp = 2 on gloo vs one rank -------------------------------------------------------------------


def cp_rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One cp rank: shard, forward with Ulysses, loss over the global token count, backward; rank 0
    saves the summed loss, the gathered logprobs/entropy and the SUM-reduced gradients."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rlctl.trainer.degrees import ParallelDims
    from rlctl.trainer.parallel import build_mesh, gather_full

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = build_mesh(ParallelDims(1, 1, world, 1, 1, world), torch.device("cpu"))
    results = {}
    for name in MODELS:
        model = tiny_model(name)
        fsdp = name.endswith("+fsdp")
        if fsdp:
            fully_shard(model, mesh=mesh["fsdp"])
        impl = enable_ulysses(model, mesh["cp"])
        assert model.config._attn_implementation == impl
        ref_batch = ragged_batch(model.config.vocab_size)
        length = ref_batch["input_ids"].shape[1]
        # the sampler's logprobs are data: take them from a one-rank forward, as the reference does
        with torch.no_grad():
            plain = tiny_model(name)
            lp_full, _ = token_logprobs_and_entropy(plain(input_ids=ref_batch["input_ids"]).logits, ref_batch["input_ids"])
        batch = next_token_targets(with_inference_logprobs(ref_batch, lp_full))
        num_tokens = float(batch["loss_mask"].sum())
        local = shard_sequence(batch, mesh["cp"].get_local_rank(), world)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        logprobs, entropy = logprobs_of_labels(logits, local["labels"])
        loss, _ = importance_ratio_loss(logprobs, local["inference_logprobs"], local["advantages"], local["loss_mask"],
                                        LOSS_CFG, num_tokens=num_tokens, entropy=entropy)
        # FSDP averages gradients over its ranks: scale so the cp ranks' partial gradients add up
        (loss * world if fsdp else loss).backward()
        group = mesh["cp"].get_group()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        gathered = []
        for t in (logprobs.detach(), entropy):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=group)
            full = torch.cat(parts, dim=1)[:, :length]
            # back to the input-aligned convention of the reference: position t scores input_ids[t]
            gathered.append(torch.cat([full.new_zeros(full.shape[0], 1), full[:, :-1]], dim=1))
        grads = {}
        for n, p in model.named_parameters():
            if fsdp:
                grads[n] = gather_full(p.grad)
            else:
                dist.all_reduce(p.grad, group=group)
                grads[n] = p.grad
        results[name] = {"loss": total, "logprobs": gathered[0], "entropy": gathered[1], "grads": grads}
    if rank == 0:
        torch.save(results, Path(out_dir) / "cp.pt")
    dist.barrier()
    dist.destroy_process_group()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest deviation relative to the reference tensor's scale."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_ulysses_cp2_matches_one_rank(tmp_path):
    spawn_ranks(cp_rank_main, 2, str(tmp_path))
    got = torch.load(tmp_path / "cp.pt")
    for name in MODELS:
        ref, cp = reference(name.removesuffix("+fsdp")), got[name]
        figures = {  # every position, padding included: causal attention over the whole padded row
            "loss": _rel(cp["loss"], ref["loss"]),
            "logprobs": _rel(cp["logprobs"], ref["logprobs"]),
            "entropy": _rel(cp["entropy"], ref["entropy"]),
            "grads": max(_rel(cp["grads"][n], g) for n, g in ref["grads"].items()),
        }
        print(f"{name} cp=2 vs 1 rank, max relative deviation: {figures}")
        assert all(v <= REL_TOL for v in figures.values()), figures
        assert float(ref["loss"]) != 0.0 and all(g.abs().max() > 0 for g in ref["grads"].values())

