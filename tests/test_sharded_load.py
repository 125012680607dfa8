"""Sharded loading from HF safetensors (trainer/sharded_load.py) and checkpoint names (trainer/hf_names.py).

Multi-rank cases run real processes on gloo (1 thread each): meta build → shard → materialize_and_load
must give exactly what `from_pretrained` loads, and the same logits."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from trainer_fixtures import join_gloo, spawn_ranks
import torch

from rlctl.trainer.hf_names import CheckpointRead, checkpoint_reads, to_checkpoint_names
from rlctl.trainer.tiny_model import TINY_QWEN3, TINY_QWEN3_MOE

SMALL_MOE = {**TINY_QWEN3_MOE, "vocab_size": 64}
TWO_EXPERTS = {**SMALL_MOE, "num_experts": 2}  # 1 local expert per ep rank: FSDP splits expert rows
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=128,
                   moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                   num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=2, topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None,
                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, tie_word_embeddings=False)
GLM4_MOE = dict(model_type="glm4_moe", vocab_size=64, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                topk_group=1, n_shared_experts=1)


def _config(cfg: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})


def _random_model(cfg: dict, seed: int = 0):
    """A transformers model with random weights, router and correction biases included."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(cfg), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make the test see it loaded
                buf.normal_(0, 0.1)
    return model


def _save_checkpoint(model, cfg: dict, out: Path, shard_files: int = 1) -> Path:
    """The model as a HF checkpoint: config.json + safetensors with checkpoint names (one file, or
    `shard_files` files + model.safetensors.index.json); a tied lm_head is left out as HF does."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {k: v.detach() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    state = to_checkpoint_names(state, cfg)
    if shard_files == 1:
        save_file(state, str(out / "model.safetensors"))
        return out
    names = sorted(state)
    weight_map = {}
    for i in range(shard_files):
        file = f"model-{i + 1:05d}-of-{shard_files:05d}.safetensors"
        part = {k: state[k] for k in names[i::shard_files]}
        save_file(part, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# ---- names (one process) ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [SMALL_MOE, DEEPSEEK_V3, GLM4_MOE], ids=["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_checkpoint_names_round_trip_through_from_pretrained(tmp_path, cfg):
    """Fused experts published per expert (what vLLM and save_pretrained use) load back identical."""
    from transformers import AutoModelForCausalLM

    model = _random_model(cfg)
    state = to_checkpoint_names({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in state
    out = _save_checkpoint(model, cfg, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_dense_names_are_unchanged():
    state = {"model.layers.0.mlp.gate_proj.weight": torch.ones(2, 2), "lm_head.weight": torch.zeros(2, 2)}
    assert to_checkpoint_names(state, TINY_QWEN3) == state


@pytest.mark.parametrize("kind", ["gate_up_proj", "down_proj"])
@pytest.mark.parametrize("block", [(slice(0, 5), slice(0, 16), slice(0, 8)),  # experts 0-4, whole rows
                                   (slice(3, 4), slice(3, 13), slice(2, 7)),  # rows across gate | up
                                   (slice(2, 5), slice(10, 16), slice(0, 8))])  # up rows only
def test_checkpoint_reads_assemble_a_fused_block_from_per_expert_tensors(kind, block):
    """Any owned block of a fused expert tensor is assembled from the per-expert tensors it needs."""
    torch.manual_seed(0)
    fused = torch.randn(5, 16, 8)  # [E, 2I, H] (gate_up) or [E, H, I] (down)
    name = f"model.layers.0.mlp.experts.{kind}"
    per_expert = to_checkpoint_names({name: fused}, SMALL_MOE)
    reads = checkpoint_reads(name, fused.shape, block, per_expert.__contains__)
    local = torch.full([s.stop - s.start for s in block], float("nan"))
    for read in reads:
        local[read.target_index] = per_expert[read.name][read.source_index]
    assert torch.equal(local, fused[block])
    needed = {r.name.split(".experts.")[1].split(".")[0] for r in reads}
    assert needed == {str(e) for e in range(block[0].start, block[0].stop)}  # only the owned experts


def test_checkpoint_reads_prefer_a_name_the_checkpoint_holds():
    block = (slice(0, 2), slice(0, 4), slice(0, 4))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert checkpoint_reads(name, (2, 4, 4), block, {name}.__contains__) == [
        CheckpointRead(name, block, block)]
    with pytest.raises(KeyError, match=r"experts\.0\.up_proj\.weight"):
        checkpoint_reads(name, (2, 4, 4), block, {f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
                                                  for e in range(2)}.__contains__)


def test_one_process_load_matches_from_pretrained_and_reties_embeddings(tmp_path):
    """Without sharding (plain tensors): bitwise the weights, buffers and logits from_pretrained gives;
    the tied lm_head (absent from the file) is the input embedding again after `to_empty`."""
    from transformers import AutoModelForCausalLM

    from rlctl.trainer.sharded_load import build_meta_model, materialize_and_load

    cfg = {**SMALL_MOE, "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}
    out = _save_checkpoint(_random_model(cfg), cfg, tmp_path / "ckpt")
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model = build_meta_model(out)
    assert model.training and not model.config.use_cache and model.config._attn_implementation == "sdpa"
    materialize_and_load(model, out, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, tensor in [*ref.named_parameters(), *ref.named_buffers()]:
        assert torch.equal(dict([*model.named_parameters(), *model.named_buffers()])[name], tensor), name
    ids = torch.randint(0, 64, (2, 12))
    assert torch.equal(model.eval()(ids).logits, ref.eval()(ids).logits)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from rlctl.trainer.sharded_load import build_meta_model, materialize_and_load

    out = _save_checkpoint(_random_model(SMALL_MOE), SMALL_MOE, tmp_path / "ckpt")
    state = load_file(str(out / "model.safetensors"))
    del state["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(KeyError, match=r"experts\.down_proj \(model\.layers\.1\.mlp\.experts\.3\.down_proj"):
        materialize_and_load(build_meta_model(out), out, torch.device("cpu"))


def test_fp8_checkpoint_is_refused_and_an_uncovered_buffer_is_caught(tmp_path, monkeypatch):
    """Block-scaled FP8 weights would need their scales: refused, not silently cast. A non-persistent
    buffer the model's init does not recompute would stay garbage: refused, naming it."""
    from safetensors.torch import load_file, save_file

    from rlctl.trainer.sharded_load import build_meta_model, materialize_and_load

    out = _save_checkpoint(_random_model(TINY_QWEN3), TINY_QWEN3, tmp_path / "ckpt")
    model = build_meta_model(out)
    monkeypatch.setattr(model, "_init_weights", lambda module: None)
    with pytest.raises(RuntimeError, match="RotaryEmbedding.inv_freq: non-persistent buffer not recomputed"):
        materialize_and_load(model, out, torch.device("cpu"))
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight in FP8"):
        materialize_and_load(build_meta_model(out), out, torch.device("cpu"))


# ---- several ranks (gloo) ---------------------------------------------------------------------------
def _shard(model, layout: str, world: int):
    """`fsdp`: fully_shard per layer + root over a 1-D mesh; `hsdp`: the trainer's FSDP over a 2-D
    (dp_replicate, fsdp) mesh; `ep`: the trainer's composition (experts DTensors Shard(0) over `ep`, FSDP
    over `efsdp`, dense params over `fsdp`) with activation checkpointing (wrapped module names)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    from rlctl.trainer.degrees import ParallelDims
    from rlctl.trainer.expert_parallel import apply_expert_parallel
    from rlctl.trainer.parallel import apply_fsdp, build_mesh, fsdp_mesh

    if layout == "hsdp":  # 2 replicas × 2 shards: every block held by two ranks, one of them sends it
        dims = ParallelDims(2, world // 2, 1, 1, 1, world)
        apply_fsdp(model, fsdp_mesh(build_mesh(dims, torch.device("cpu")), dims), None, "float32", False)
        return
    mesh = build_mesh(ParallelDims(1, world, 1, 1, 2, world), torch.device("cpu"))
    apply_expert_parallel(model, mesh["ep"])
    apply_fsdp(model, mesh["fsdp"], mesh["efsdp"], "float32", True)


def _checkpoint_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _equivalence_rank(rank, world, port, model_dir, layout):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, read_weights, shard_files
    from rlctl.trainer.parallel import gather_full
    from rlctl.trainer.sharded_load import build_meta_model, checkpoint_name, materialize_and_load
    from rlctl.trainer.weights import _ROUTES, ProcessGroupRanks, publish_buckets

    join_gloo(rank, world, port)
    try:
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = build_meta_model(model_dir)
        _shard(model, layout, world)
        materialize_and_load(model, model_dir, torch.device("cpu"))
        expected = dict([*ref.named_parameters(), *ref.named_buffers()])
        got = {checkpoint_name(n): t for n, t in [*model.named_parameters(), *model.named_buffers()]}
        assert got.keys() == expected.keys(), got.keys() ^ expected.keys()
        assert any(isinstance(t, DTensor) for t in got.values())
        for name, tensor in got.items():
            full = gather_full(tensor)
            assert torch.equal(full, expected[name]), name
        torch.manual_seed(0)
        ids = torch.randint(0, ref.config.vocab_size, (2, 10))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)
        # the publish path, back to the checkpoint's names: every rank writes whole tensors of its own
        # (small buckets: several shards per rank), rank 0 seals; nothing is gathered on one rank. In
        # bf16 too: each rank casts its shard (any placement) before sending it to the owner
        store = FilesystemWeightStore(Path(model_dir).parent / "published")
        group = ProcessGroupRanks()
        stored = _checkpoint_tensors(Path(model_dir)) if rank == 0 else {}
        for step, dtype in enumerate((torch.float32, torch.bfloat16), 1):
            step_dir = store.publish(step, model.config.to_dict(), publish_buckets(
                model, model.config.to_dict(), dtype, group.rank, group.world, bucket_bytes=4096), group)
            dist.barrier()  # rank 0 has sealed
            if rank == 0:
                published = read_weights(step_dir)
                assert len(shard_files(step_dir)) >= world
                assert published.keys() == stored.keys(), published.keys() ^ stored.keys()
                for name, tensor in stored.items():
                    assert published[name].dtype == dtype and torch.equal(published[name], tensor.to(dtype)), name
        # every placement here is a grid of blocks: each tensor went to its owner alone, no all-gather
        routes = _ROUTES[model]
        assert routes and all(route is not None for route in routes.values()), routes
        if layout == "hsdp":  # every block held by one rank of each replica
            assert all(len(ranks) == 2 for route in routes.values() for ranks in route.values()), routes
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["dense-index", "qwen3_moe", "qwen3_moe-ep2", "deepseek_v3-ep2"])
def test_two_ranks_load_exactly_what_from_pretrained_loads(tmp_path, case):
    """dense Qwen3 from a sharded checkpoint (index.json); Qwen3-MoE fused experts FSDP-sharded by
    expert; Qwen3-MoE and DeepSeek-V3 (shared experts, a dense first layer, the router's persistent
    correction bias, an untied lm_head) with experts Shard(0) over a 2-rank `ep` mesh first (2-D
    placements). Publishing (each rank its share of whole tensors, `publish_buckets`) gives back the
    checkpoint's tensors under its names."""
    cfg = {"dense": TINY_QWEN3, "qwen3_moe": SMALL_MOE, "deepseek_v3": DEEPSEEK_V3}[case.split("-")[0]]
    out = _save_checkpoint(_random_model(cfg, seed=1), cfg, tmp_path / "ckpt", 3 if case == "dense-index" else 1)
    spawn_ranks(_equivalence_rank, 2, str(out), "ep" if case.endswith("ep2") else "fsdp")


@pytest.mark.parametrize("cfg, layout", [(SMALL_MOE, "ep"), (TWO_EXPERTS, "ep"), (SMALL_MOE, "hsdp")],
                         ids=["strided-experts", "expert-rows", "hsdp"])
def test_four_ranks_load_exactly_what_from_pretrained_loads(tmp_path, cfg, layout):
    """dp_shard 4 × ep 2: 8 experts → 2 per rank (experts split by ep, then by efsdp: _StridedShard);
    2 experts → each rank holds half the rows of one expert (the gate or the up half of gate_up);
    HSDP 2 × 2: each shard held by two ranks (Replicate over dp_replicate)."""
    out = _save_checkpoint(_random_model(cfg, seed=2), cfg, tmp_path / "ckpt")
    spawn_ranks(_equivalence_rank, 4, str(out), layout)


# ---- host memory -----------------------------------------------------------------------------------
BIG_DENSE = {**TINY_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32768,
             "max_window_layers": 16}


def _write_random_checkpoint(cfg: dict, out: Path, shard_files: int = 4) -> int:
    """Random weights of `cfg` in HF sharded safetensors, written one file at a time (never the whole
    model in memory); returns the number of parameters."""
    from safetensors.torch import save_file

    from rlctl.trainer.sharded_load import build_meta_model

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    shapes = {k: v.shape for k, v in build_meta_model(cfg).state_dict().items() if k != "lm_head.weight"}
    names, weight_map = sorted(shapes), {}
    gen = torch.Generator().manual_seed(0)
    for i in range(shard_files):
        file = f"model-{i + 1:05d}-of-{shard_files:05d}.safetensors"
        part = {k: torch.randn(shapes[k], generator=gen) * 0.02 for k in names[i::shard_files]}
        save_file(part, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
        del part
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(torch.Size(s).numel() for s in shapes.values())


def _status_mib(*keys) -> dict:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            values[key] = int(rest.split()[0]) / 1024
    return values


def _memory_rank(rank, world, port, model_dir, report):
    import gc

    import torch.distributed as dist
    from safetensors import safe_open

    from rlctl.trainer.sharded_load import build_meta_model, materialize_and_load, owned_block

    join_gloo(rank, world, port)
    try:
        model = build_meta_model(model_dir)
        _shard(model, "fsdp", world)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak below is the load's own
        before = _status_mib("VmRSS")["VmRSS"]
        start = time.monotonic()
        materialize_and_load(model, model_dir, torch.device("cpu"))
        seconds = time.monotonic() - start
        for param in model.parameters():  # memory-mapped weights count only once touched: touch them
            (param.to_local() if hasattr(param, "to_local") else param).sum()
        after = _status_mib("VmRSS", "VmHWM")
        q = model.model.layers[3].self_attn.q_proj.weight  # the load really happened: this rank's rows
        name = "model.layers.3.self_attn.q_proj.weight"
        files = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(Path(model_dir) / files[name]), framework="pt") as f:
            assert torch.equal(q.to_local(), f.get_slice(name)[owned_block(q)])
        Path(report, f"rank{rank}.json").write_text(json.dumps(
            {"rss_before_mib": before, "peak_mib": after["VmHWM"], "rss_after_mib": after["VmRSS"],
             "load_s": seconds}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_rank_load_peaks_below_three_quarters_of_the_fp32_model(tmp_path, capsys):
    """A 235M-parameter dense model (0.94 GB fp32) loaded on 2 ranks: each rank's peak RSS growth during
    the load (weights touched) stays below 0.75 × the full fp32 bytes; loading the whole model with
    from_pretrained grows it by ≈ 1.2×."""
    params = _write_random_checkpoint(BIG_DENSE, tmp_path / "ckpt")
    assert params >= 200_000_000
    full_mib = params * 4 / 2**20
    report = tmp_path / "report"
    report.mkdir()
    spawn_ranks(_memory_rank, 2, str(tmp_path / "ckpt"), str(report), timeout=300)
    for rank in range(2):
        r = json.loads((report / f"rank{rank}.json").read_text())
        growth = r["peak_mib"] - r["rss_before_mib"]
        with capsys.disabled():
            print(f"\nrank {rank}: model {full_mib:.0f} MiB fp32; RSS before load {r['rss_before_mib']:.0f} MiB, "
                  f"peak {r['peak_mib']:.0f} MiB (growth {growth:.0f} MiB = {growth / full_mib:.2f}× model), "
                  f"after {r['rss_after_mib']:.0f} MiB; load {r['load_s']:.1f}s")
        assert growth < 0.75 * full_mib
