"""The planner's model against published runs it was (mostly) not fitted to.

Each row: what ran, the planner's inputs for it, the published figure and where it is printed.
Tolerance ±25% (±35% for MoE and LoRA). Rows marked `fitted` set a constant of
recipes/calibration.py (its docstring names the row); the others are predictions.

Sources
  TT   pytorch/torchtitan docs/performance.md (torch/torchao/torchtitan of 2024-12-26): Llama 3.1 on
       H100 96 GB HBM2e at 500 W (Grand Teton), 400 Gb/s RDMA per GPU; TPS/GPU at the 90th iteration.
  AM   NVIDIA-NeMo/Automodel docs/performance-summary.md (2025-10-02), DGX-H100 (H100 SXM 80 GB), PyTorch
       FSDP2 backend with Transformer Engine kernels (fused norms, cuDNN attention), mock data, a forced
       balanced MoE gate; configs examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml (activation
       checkpointing on) and the Llama-3.3-70B LoRA row (rank 16, alpha 32, all linear layers; the
       linked config file has since changed its TP/PP — the table row's TP 2, PP 4, VP 10 is used).
  Not in the table: AM's Llama-3.3-70B LoRA row (8 GPUs, TP 2, PP 4, VP 10, 608 tok/s/GPU) — the planner
  predicts ≈ 890 (+46%); the row reports 18% MFU and no kernel optimisations, and the linked config has
  changed since (TP 4, PP 2), so what ran is unclear. GS's ShareGPT row (178 s) — the planner predicts
  ≈ 113 s (−37%): ShareGPT's long-tailed lengths hold the KV cache with a few long requests, which a
  model of mean lengths cannot see; the random-length rows of the same page are used instead.
  GS   gpustack/gpustack docs/performance-lab/qwen3-32b/h100.md: `vllm serve Qwen/Qwen3-32B` (vLLM 0.11,
       one H100, bf16, defaults), `vllm bench serve` ShareGPT 1,000 prompts (217,393 input, 201,422
       output tokens): 178.01 s; and `--dataset-name random` rows with fixed lengths: 100 × (32,000 in,
       ≤ 100 out; 7,681 generated) in 1,157.25 s, 500 × (≈ 1,996 in, 100 out) in 328.04 s, 500 ×
       (≈ 3,996 in, 200 out) in 976.29 s.
  PR   prime-rl GLM-5 SWE run (the reference notes): 28 H200 nodes, median trainer step 3.7 min,
       orchestrator step 5.0 min (recipes/glm5-swe.toml).
  V7   vLLM decoding a 7B model (Qwen2.5-7B class) on one H100 at 64 concurrent sequences, ≈6,300 tok/s
       (the planner's first inference calibration; kept as a regression row).
"""
from types import SimpleNamespace as NS

import pytest

from rlctl.inference.config import InferenceConfig
from rlctl.inference.plan import plan_inference
from rlctl.recipes.hardware import gpu_spec
from rlctl.recipes.load import load_recipe
from rlctl.recipes.models import get_model_spec
from rlctl.recipes.plan import plan
from rlctl.trainer.plan import plan_trainer

DENSE, SPARSE = 0.25, 0.35  # ±25% dense; ±35% MoE and LoRA


def _train(model, kind, gpus, seq, mbs, *, ac, fp8, compiled, cp=1, tp=1, pp=1, vp=1, ep=1, tokens=None,
           lora=None, kernel=None, balanced=False, compiled_moe=False):
    spec = get_model_spec(model)
    tr = NS(micro_batch_size=mbs, activation_checkpointing=ac, fp8=fp8, optimizer_dtype="float32", lora=lora)
    dp = gpus // (cp * tp * pp)
    return plan_trainer(spec, tr, gpus=gpus, gpus_per_node=8, gpu=gpu_spec(kind), seq_len=seq,
                        tokens_per_step=tokens or dp * mbs * seq, mean_seq=seq, inter_gbps=400, intra_gbps=7200,
                        ep=ep, cp=cp, tp=tp, fsdp=1 if pp > 1 else None, pp=pp, pp_virtual_stages=vp,
                        compiled=compiled, attention_kernel=kernel, balanced_routing=balanced,
                        compiled_moe=compiled_moe)


# (case, source + figure, planner inputs, published tok/s/GPU, tolerance)
TRAINING = [
    ("llama8b-fsdp-8k", "TT Table 1 FSDP, 8 GPUs, seq 8192, local batch 2, selective AC (fitted)",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=8192, mbs=2, ac=False, fp8=False, compiled=False),
     5762, DENSE),
    ("llama8b-compile-8k", "TT Table 1 FSDP + torch.compile (fitted: compile's fusion)",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=8192, mbs=2, ac=False, fp8=False, compiled=True),
     6667, DENSE),
    ("llama8b-compile-fp8-8k", "TT Table 1 FSDP + torch.compile + Float8 (fitted: FP8 GEMM speed-up)",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=8192, mbs=2, ac=False, fp8=True, compiled=True),
     8532, DENSE),
    ("llama8b-128gpu-8k", "TT Table 3 FSDP, 128 GPUs (16 nodes), local batch 2",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=128, seq=8192, mbs=2, ac=False, fp8=False, compiled=False),
     5605, DENSE),
    ("llama8b-32k", "TT Table 2 FSDP 8 CP 1, seq 32768, compile + Float8, full AC",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=32768, mbs=1, ac=True, fp8=True, compiled=True),
     3890, DENSE),
    ("llama8b-65k-cp2", "TT Table 2 FSDP 4 CP 2, seq 65536",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=65536, mbs=1, ac=True, fp8=True, compiled=True, cp=2),
     2540, DENSE),
    ("llama8b-131k-cp4", "TT Table 2 FSDP 2 CP 4, seq 131072",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=131072, mbs=1, ac=True, fp8=True, compiled=True, cp=4),
     1071, DENSE),
    ("llama8b-262k-cp8", "TT Table 2 FSDP 1 CP 8, seq 262144",
     dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=262144, mbs=1, ac=True, fp8=True, compiled=True, cp=8),
     548, DENSE),
    ("llama70b-fsdp32-tp8", "TT Table 4 2D FSDP 32 × TP 8, 256 GPUs, local batch 16, compile + Float8, full AC",
     dict(model="llama-3.1-70b", kind="h100-96gb", gpus=256, seq=8192, mbs=16, ac=True, fp8=True, compiled=True, tp=8),
     829, DENSE),
    ("qwen3-30b-a3b-ep8", "AM Qwen3 MoE 30B, 8 GPUs, seq 4096, MBS 4, EP 8, TE + DeepEP, AC (fitted: MoE GEMMs)",
     dict(model="qwen3-30b-a3b", kind="h100-sxm", gpus=8, seq=4096, mbs=4, ac=True, fp8=False, compiled=True,
          ep=8, tokens=512 * 4096, kernel="fa3", balanced=True, compiled_moe=True),
     11842, SPARSE),
]


@pytest.mark.parametrize("case,source,inputs,published,tol", TRAINING, ids=[r[0] for r in TRAINING])
def test_trainer_throughput_matches_published(case, source, inputs, published, tol):
    p = _train(**inputs)
    if inputs["ac"]:  # selective AC (TT Table 1/3) keeps more than full AC, less than none
        assert p.fits, (case, p.memory_gib)
    assert p.tokens_per_s / p.gpus == pytest.approx(published, rel=tol), source


def test_70b_tp8_fits_in_the_memory_it_ran_in():
    # TT Table 4 ran in 71.9 GiB/GPU; activations kept under full AC are sharded by sequence parallelism.
    p = _train("llama-3.1-70b", "h100-96gb", 256, 8192, 16, ac=True, fp8=True, compiled=True, tp=8)
    assert p.fits and p.memory_gib_per_gpu <= 71.9 * 1.25


def test_published_throughput_nearly_flat_with_sequence_length():
    # Equal tokens per step, seq 16k vs 64k (compile + Float8, full AC, 8 GPUs): the fixed cost per
    # micro-batch and attention keep the short sequences from being much faster per token.
    short = _train("llama-3.1-8b", "h100-96gb", 8, 16384, 1, ac=True, fp8=True, compiled=True, tokens=8 * 65536)
    long_ = _train("llama-3.1-8b", "h100-96gb", 8, 65536, 1, ac=True, fp8=True, compiled=True, tokens=8 * 65536)
    assert 1.0 < short.tokens_per_s / long_.tokens_per_s < 2.0


def test_compile_credits_an_moe_layer_only_for_what_the_trainer_compiles():
    # rlctl's trainer leaves the MoE block eager under trainer.compile: a recipe's compiled MoE model
    # plans between eager and a run whose MoE blocks are fused too; a dense model is not affected.
    moe = dict(model="qwen3-30b-a3b", kind="h100-sxm", gpus=8, seq=4096, mbs=4, ac=True, fp8=False, ep=8)
    eager, recipe, fused = (_train(**moe, compiled=c, compiled_moe=f).tokens_per_s
                            for c, f in ((False, False), (True, False), (True, True)))
    assert eager < recipe < fused
    dense = dict(model="llama-3.1-8b", kind="h100-96gb", gpus=8, seq=8192, mbs=2, ac=False, fp8=False, compiled=True)
    assert _train(**dense).tokens_per_s == _train(**dense, compiled_moe=True).tokens_per_s


def test_h200_is_faster_than_h100_at_equal_flops():
    a = _train("llama-3.1-8b", "h100-sxm", 8, 8192, 1, ac=True, fp8=False, compiled=False)
    b = _train("llama-3.1-8b", "h200", 8, 8192, 1, ac=True, fp8=False, compiled=False)
    assert b.tokens_per_s > a.tokens_per_s * 1.02


def _serve(model, kind, rollouts, prompt, completion, in_flight, max_len):
    inf = InferenceConfig(tp=1, dp=1, max_model_len=max_len)
    return plan_inference(get_model_spec(model), inf, nodes=1, gpus_per_node=1, gpu=gpu_spec(kind),
                          rollouts=rollouts, mean_tokens=prompt + completion, completion_tokens=completion,
                          max_in_flight=in_flight, tp=1, dp=1)


def test_vllm_7b_decode_one_h100():
    p = _serve("qwen2.5-7b", "h100-sxm", 64, 512, 1024, 64, 4096)  # V7
    assert p.decode_tokens_per_s == pytest.approx(6300, rel=DENSE)
    assert p.decode_bound == "memory-bandwidth"


# (case, rollouts, prompt, completion, published seconds for the whole batch); GS, vLLM defaults
SERVING = [
    ("qwen3-32b-32k-prompts (fitted: prefill)", 100, 32000, 77, 1157.25),
    ("qwen3-32b-2k-prompts", 500, 1996, 100, 328.04),
    ("qwen3-32b-4k-prompts", 500, 3996, 200, 976.29),
]


@pytest.mark.parametrize("case,rollouts,prompt,completion,published", SERVING, ids=[r[0].split()[0] for r in SERVING])
def test_vllm_qwen3_32b_one_h100(case, rollouts, prompt, completion, published):
    p = _serve("qwen3-32b", "h100-sxm", rollouts, prompt, completion, rollouts, 40960)
    assert p.fits
    # 0.9 × 79.2 GiB − 61 GiB of bf16 weights − ≈ 2 GiB of activations, sampler, graphs: ≈ 8 GiB of KV
    assert 6 < p.kv_cache_gib_per_gpu < 10
    assert p.rollout_step_time_s == pytest.approx(published, rel=DENSE), case


def test_glm5_headline_run():
    # the published run's degrees (CP 2); rlctl's trainer cannot split DSA that way, which is the plan's only error
    j = plan(load_recipe(["recipes/glm5-swe.toml"], ["trainer.cp=2"])).to_json()  # PR
    assert [e.split(":")[0] for e in j["errors"]] == ["trainer.cp"], j["errors"]
    assert j["trainer"]["step_time_s"] / 60 == pytest.approx(3.7, rel=SPARSE)
    assert j["orchestrator"]["step_time_s"] / 60 == pytest.approx(5.0, rel=SPARSE)


def test_table_covers_the_acceptance():
    seqs = {r[2]["seq"] for r in TRAINING}
    kinds = {r[2]["kind"] for r in TRAINING}
    assert len(TRAINING) + len(SERVING) + 3 >= 12 and len(seqs) >= 3 and len(kinds) >= 2
