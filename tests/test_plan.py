"""The planner's report contract, its refusals and what each model term must respond to.
Published figures (torchtitan, NeMo AutoModel, vLLM serving, the GLM-5 run): tests/test_plan_published.py."""
import dataclasses

import pytest

from rlctl.recipes.clusters import load_profile
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.hardware import gpu_spec
from rlctl.recipes.load import load_recipe
from rlctl.recipes.models import get_model_spec
from rlctl.recipes.plan import compute_placement, plan

TOL = 0.25


def test_glm5_headline_run():
    j = plan(load_recipe(["recipes/glm5-swe.toml"])).to_json()
    assert j["fits"], j["errors"]
    assert (j["placement"]["trainer_nodes"], j["placement"]["inference_nodes"]) == (12, 16)
    # the published step times (CP 2) are checked in test_plan_published.py; rlctl runs it at cp 1
    assert j["trainer"]["memory_gib_per_gpu"] <= 139.8
    assert j["orchestrator"]["step_time_s"] / 60 == pytest.approx(5.0, rel=TOL)
    assert j["bottleneck"] == "inference"
    assert (j["trainer"]["ep"], j["trainer"]["cp"]) == (8, 1)


def test_cp_the_trainer_cannot_split_is_a_plan_error():
    """GLM-5's DeepSeek sparse attention cannot be split by Ulysses CP (the trainer refuses it at start-up):
    the plan says so under the key and `auto` never picks it."""
    pinned = plan(load_recipe(["recipes/glm5-swe.toml"], ["trainer.cp=2"]))
    assert not pinned.fits and any(e.startswith("trainer.cp:") and "sparse attention" in e for e in pinned.errors)
    auto = plan(load_recipe(["recipes/glm5-swe.toml"], ["trainer.cp=\"auto\""])).to_json()
    assert auto["trainer"]["cp"] == 1


def test_json_keys():
    j = plan(load_recipe(["recipes/glm5-swe.toml"])).to_json()
    for path in ["fits", "placement.trainer_nodes", "placement.inference_nodes", "trainer.step_time_s",
                 "trainer.tokens_per_s", "trainer.memory_gib_per_gpu", "inference.decode_tokens_per_s",
                 "inference.rollout_step_time_s", "inference.max_concurrent_rollouts", "orchestrator.step_time_s",
                 "bottleneck", "errors", "warnings", "disk.weights_step_bytes", "disk.rollout_batch_bytes",
                 "disk.checkpoint_bytes", "disk.written_per_step_bytes", "disk.peak_bytes"]:
        node = j
        for part in path.split("."):
            node = node[part]


def test_auto_split_balances_the_two_sides():
    rec = load_recipe(["recipes/qwen3-30b-a3b.toml"], ["deployment.total_nodes=16"])
    rep = plan(rec)
    t, i = rep.placement.trainer_nodes, rep.placement.inference_nodes
    assert t + i == 16
    best = rep.orchestrator["step_time_s"]
    for other in (max(1, t - 2), min(15, t + 2)):
        if other == t:
            continue
        pinned = load_recipe(["recipes/qwen3-30b-a3b.toml"],
                             [f"deployment.trainer_nodes={other}", f"deployment.inference_nodes={16 - other}"])
        alt = plan(pinned).orchestrator["step_time_s"]
        assert alt is None or alt >= best * 0.999


def test_memory_advice_names_the_fix():
    rec = load_recipe(["recipes/glm5-swe.toml"], ['model.name="deepseek-v3"', "trainer.cp=1",
                                                  "inference.max_model_len=131072"])
    rep = plan(rec)
    assert not rep.fits
    msg = " ".join(rep.errors)
    assert "at cp=1" in msg and "set trainer.cp=" in msg


def test_compute_placement_cpu_and_gpu():
    tiny = compute_placement(load_recipe(["recipes/tiny-cpu.toml"]))
    assert (tiny.trainer_ranks_per_node, tiny.inference_gpus_per_server) == (2, 0)
    glm = compute_placement(load_recipe(["recipes/glm5-swe.toml"]), load_profile("h200-28"))
    assert (glm.trainer_ranks_per_node, glm.inference_servers_per_node, glm.orchestrator) == (8, 8, "inference_node")
    h100 = compute_placement(load_recipe(["recipes/qwen3-30b-a3b.toml"]))
    assert h100.orchestrator == "cpu_partition"


def test_disk_per_step_and_peak_from_the_model_spec():
    # Qwen3-30B-A3B by hand: 48 MoE layers of GQA attention (32 heads, 4 KV heads, head_dim 128, q/k
    # norms) + 128 experts of 3·2048·768 + a 2048×128 router + 2 norms; untied embedding and LM head.
    h, layers, vocab, d = 2048, 48, 151936, 128
    attention = h * d * (32 + 2 * 4) + 32 * d * h + 2 * d
    layer = attention + 128 * 3 * h * 768 + h * 128 + 2 * h
    params = layers * layer + 2 * vocab * h + h
    assert params == pytest.approx(30.5e9, rel=0.01)  # the published size
    disk = plan(load_recipe(["recipes/qwen3-30b-a3b.toml"])).to_json()["disk"]
    assert disk["weights_step_bytes"] == 2 * params  # published in the serving dtype (bf16): ≈ 61 GB
    assert disk["checkpoint_bytes"] == (4 + 8) * params  # + AdamW's two fp32 moments
    seq, rollouts = 16384, 512  # inference.max_model_len, orchestrator.rollouts_per_step
    assert disk["rollout_batch_bytes"] == rollouts * (seq * (8 + 1 + 1 + 4 + 4) + 4 + 4)
    assert disk["router_replay_bytes_per_batch"] == rollouts * seq * layers * 8 * 2  # int16 [layers, top_k, T]
    # max_off_policy_steps = 2, weights.keep_last = 2, checkpoint interval 50 / keep_last 2 (defaults)
    assert disk["kept"] == {"weights": 3 + 1, "rollouts": 50 + 3, "checkpoints": 2 + 1}
    assert disk["peak_bytes"] == 4 * 2 * params + 53 * disk["rollout_batch_bytes"] + 3 * 12 * params
    assert disk["written_per_step_bytes"] == 2 * params + disk["rollout_batch_bytes"] + 12 * params // 50
    assert disk["unpruned_run_bytes"] == 300 * (2 * params + disk["rollout_batch_bytes"]) + 6 * 12 * params


def test_disk_follows_the_retention_keys():
    base = ["weights.keep_last=5", "orchestrator.max_off_policy_steps=1", "checkpoint.interval=0",
            "trainer.optimizer_dtype=\"bfloat16\""]
    disk = plan(load_recipe(["recipes/qwen3-30b-a3b.toml"], base)).to_json()["disk"]
    params = get_model_spec("qwen3-30b-a3b").total_params
    assert (disk["weights_step_bytes"], disk["checkpoint_bytes"]) == (2 * params, (2 + 4) * params)
    # no periodic checkpoints: trained batches go at once, only a preemption checkpoint is written
    assert disk["kept"] == {"weights": 5 + 1, "rollouts": 1 + 2, "checkpoints": 1}
    dense = plan(load_recipe(["recipes/qwen3-4b.toml"])).to_json()["disk"]
    assert dense["router_replay_bytes_per_batch"] == 0


def test_rollout_bytes_per_token_match_the_batch_contract():
    from rlctl.orchestrator.batch import Group, Rollout, build_batch_tensors
    from rlctl.orchestrator.environments import Prompt
    from rlctl.recipes.plan_disk import rollout_batch_bytes

    rollouts = [Rollout(0, i, prompt_ids=[1, 2, 3], completion_ids=[4] * (i + 1), logprobs=[-0.5] * (i + 1),
                        versions=[0] * (i + 1)) for i in range(4)]
    group = Group(0, Prompt(text="p", target="t"), rollouts, advantages=[0.1, -0.1, 0.2, -0.2])
    tensors = build_batch_tensors([group], step=0)
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == rollout_batch_bytes(4, 3 + 4)


def test_plan_table_shows_the_disk(capsys):
    from rlctl.cli.plan_view import render

    render(plan(load_recipe(["recipes/qwen3-30b-a3b.toml"])).to_json())
    out = capsys.readouterr().out
    assert "disk (run directory)" in out and "56.9 GiB" in out  # one weights step in bf16: 61 GB
    assert "1.2 TiB" in out  # the peak


def test_gpu_memory_is_what_cuda_reports():
    # "80 GB" HBM is 5 × 16 GiB stacks; CUDA exposes ≈ 79.2 GiB (vLLM's total_gpu_memory), not 80e9 B = 74.5 GiB.
    assert 79 < gpu_spec("h100-sxm").hbm_gib < 80
    assert 139 < gpu_spec("h200").hbm_gib < 141


def test_lora_plans_a_frozen_base():
    full = plan(load_recipe(["recipes/qwen3-4b.toml"])).to_json()["trainer"]
    lora = plan(load_recipe(["recipes/qwen3-4b.toml"], ["trainer.lora.rank=16"])).to_json()["trainer"]
    assert 0 < lora["lora_params"] < 0.02 * get_model_spec("qwen3-4b").total_params
    assert lora["memory_gib"]["params"] == pytest.approx(full["memory_gib"]["params"] / 2, rel=0.05)  # bf16 base
    assert lora["memory_gib"]["optimizer"] < 0.05 * full["memory_gib"]["optimizer"]
    assert lora["step_time_s"] < full["step_time_s"]  # no weight-gradient GEMMs for the base


def test_prefill_replicas_must_fit_too():
    over = ["inference.fp8=false", "inference.disaggregation.prefill_replicas=8",
            "inference.disaggregation.prefill_nodes_per_replica=1"]
    rep = plan(load_recipe(["recipes/glm5-swe.toml"], over))
    assert not rep.fits and "prefill replicas" in " ".join(rep.errors)


def test_impossible_inference_dp_is_refused():
    with pytest.raises(RecipeError) as e:
        plan(load_recipe(["recipes/qwen3-4b.toml"], ["inference.dp=64"]))
    assert e.value.key == "inference.dp"


def test_missing_expected_mean_tokens_does_not_mean_empty_prompts():
    rec = load_recipe(["recipes/qwen3-4b.toml"])
    rec.orchestrator.expected_mean_tokens = None
    rep = plan(rec)
    assert rep.inference["prompt_tokens"] > 0 and rep.inference["completion_tokens"] == 2048
    assert any("expected_mean_tokens" in w for w in rep.warnings)


def test_more_dense_layers_than_layers_is_refused():
    from rlctl.recipes.plan_compose import check_static

    spec = dataclasses.replace(get_model_spec("qwen3-30b-a3b"), dense_layers=60)
    with pytest.raises(RecipeError) as e:
        check_static(load_recipe(["recipes/qwen3-30b-a3b.toml"]), spec, load_profile("h100-64"))
    assert e.value.key == "model.name"


def test_human_plan_prints_names_as_given(tmp_path):
    """A profile named `lab[gpu]` was printed as `lab` (rich read `[gpu]` as markup); the plain-text
    output prints it as written, and without colour codes when not on a terminal."""
    import io

    from rlctl.cli.plan_view import render
    from rlctl.recipes.clusters import ClusterProfile

    profile = ClusterProfile(name="lab[gpu]", nodes=4, gpus_per_node=8, gpu="h100-sxm")
    buf = io.StringIO()
    render(plan(load_recipe(["qwen3-4b"]), profile).to_json(), file=buf)
    assert buf.getvalue().startswith("plan: qwen3-4b on lab[gpu] (qwen3-4b): ")
    assert "\x1b[" not in buf.getvalue()


def test_no_kv_cache_means_no_rollout_time_and_the_plan_says_why():
    """The rollout step was `inf` in the report (Infinity in any JSON but the CLI's) when no rollout
    fits in the KV cache; it is None, and the error says why."""
    import math

    j = plan(load_recipe(["qwen3-4b"], ["inference.gpu_memory_utilization=0.065"])).to_json()
    assert not j["fits"]
    assert j["inference"]["rollout_step_time_s"] is None and j["orchestrator"]["rollout_step_time_s"] is None
    assert any("rollout step time is unknown" in e for e in j["errors"])

    def floats(o):
        if isinstance(o, dict):
            return [x for v in o.values() for x in floats(v)]
        if isinstance(o, (list, tuple)):
            return [x for v in o for x in floats(v)]
        return [o] if isinstance(o, float) else []

    assert all(math.isfinite(x) for x in floats(j))


def test_plan_json_shows_each_replica_kinds_memory():
    """P/D: prefill replicas hold the same weights over fewer GPUs than decode ones; the JSON shows
    both kinds' weights, activations and KV cache per GPU against the usable memory, and a prefill
    replica with no room for a prompt's KV makes the plan not fit."""
    j = plan(load_recipe(["glm5-swe"])).to_json()["inference"]
    usable = j["usable_gib_per_gpu"]
    assert usable == pytest.approx(0.9 * 139.8, abs=0.1)  # gpu_memory_utilization × H200 as CUDA reports it
    decode, prefill = j["replica_memory_gib"]["decode"], j["replica_memory_gib"]["prefill"]
    assert prefill["weights"] > 1.5 * decode["weights"]  # 2 prefill nodes vs 8 decode nodes of EP
    for m in (decode, prefill):
        assert m["weights"] + m["activations"] + m["kv_cache"] == pytest.approx(usable, abs=0.01)
        assert m["kv_cache"] >= m["kv_needed"]
    big = ["model.name=\"glm-5\"", "inference.fp8=false", "inference.disaggregation.prefill_nodes_per_replica=1"]
    k = plan(load_recipe(["glm5-swe"], big)).to_json()
    pre = k["inference"]["replica_memory_gib"]["prefill"]
    assert pre["kv_cache"] < pre["kv_needed"] and not k["fits"]
    assert any("prefill replicas" in e for e in k["errors"])


def test_auto_split_on_a_one_node_cluster_is_a_plan_that_says_so():
    """`auto` node counts on a 1-node GPU cluster had no split to choose from: ValueError from min()."""
    from rlctl.recipes.clusters import ClusterProfile

    profile = ClusterProfile(name="one", nodes=1, gpus_per_node=8, gpu="h100-sxm")
    rec = load_recipe(["qwen3-4b"], ['deployment.trainer_nodes="auto"', 'deployment.inference_nodes="auto"'])
    j = plan(rec, profile).to_json()
    assert not j["fits"] and any("needs 2 nodes but 'one' has 1" in e for e in j["errors"])


def test_max_num_seqs_caps_what_a_server_decodes_at_once():
    """A GPU server runs at most `inference.max_num_seqs` sequences (vLLM's 1024 by default); a CPU
    server's default is vLLM's 128, so the tiny recipe's 512 rollouts decode in waves without its 1024."""
    gpu = plan(load_recipe(["qwen3-4b"])).to_json()["inference"]
    low = plan(load_recipe(["qwen3-4b"], ["inference.max_num_seqs=16"])).to_json()["inference"]
    assert low["max_concurrent_rollouts"] < gpu["max_concurrent_rollouts"]
    assert low["rollout_step_time_s"] > gpu["rollout_step_time_s"]
    tiny = plan(load_recipe(["tiny-cpu"])).to_json()["inference"]
    default = plan(load_recipe(["tiny-cpu"], ["inference.max_num_seqs='auto'"])).to_json()["inference"]
    assert default["max_concurrent_rollouts"] == 128 < tiny["max_concurrent_rollouts"]
    assert default["rollout_step_time_s"] > tiny["rollout_step_time_s"]


def test_auto_tp_leaves_half_the_budget_after_the_whole_reserve():
    """`inference.tp = 'auto'` picks the smallest TP whose weights leave at least half of what the reserve
    (activations, the sampler's logits for max_num_seqs sequences, the LoRA adapters) leaves, counted as the
    KV budget of that TP counts it: rank-512 adapters on every expert push Qwen3-30B-A3B from tp 1 to tp 2."""
    over = ["inference.max_num_seqs=4096", "trainer.lora.rank=512"]
    auto = plan(load_recipe(["qwen3-30b-a3b"], over)).to_json()["inference"]
    mem = auto["replica_memory_gib"]["decode"]
    assert auto["tp"] == 2 and mem["weights"] <= mem["kv_cache"]
    half = plan(load_recipe(["qwen3-30b-a3b"], over + ["inference.tp=1"])).to_json()["inference"]
    assert half["replica_memory_gib"]["decode"]["weights"] > half["replica_memory_gib"]["decode"]["kv_cache"]


@pytest.mark.parametrize("recipe", ["recipes/glm5-swe.toml", "recipes/tiny-cpu.toml"])
def test_a_stall_timeout_shorter_than_a_trainer_step_is_warned(recipe):
    """The trainer beats once a step: a planned step (with its publish) longer than the stall timeout
    would have a healthy trainer reported stalled; the default timeout is longer than both recipes' steps."""
    rep = plan(load_recipe([recipe]))
    longest = rep.trainer["step_time_s"] + rep.weights["trainer_side_s"]
    assert not any("stall_timeout_s" in w for w in rep.warnings)
    short = plan(load_recipe([recipe], [f"monitoring.stall_timeout_s={longest * 0.9:g}"]))
    assert [w for w in short.warnings if w.startswith("monitoring.stall_timeout_s=")]
    enough = plan(load_recipe([recipe], [f"monitoring.stall_timeout_s={longest * 1.1 + rep.cost['checkpoint_write_s']:g}"]))
    assert not any("stall_timeout_s" in w for w in enough.warnings)
