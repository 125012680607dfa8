"""`rlctl plan --calibrate RUN` and what the plan reports beyond step times: cost, implied off-policy lag,
idle GPUs, time limits, a CPU path that scales with the model, and output that reads in 80 columns."""
from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.orchestrator.exchange.files import append_jsonl, atomic_write_json
from rlctl.recipes import calibration as C
from rlctl.recipes.clusters import load_profile
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import plan

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny-cpu.toml")
PROFILES = REPO / "recipes" / "profiles"


def rlctl(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def synthetic_run(root: Path, trainer_s: float, orch_s: float, wait_s: float = 0.0, steps: int = 12,
                  recipe=TINY) -> Path:
    """A finished run directory as `rlctl launch` leaves it, with known step times (a slower first step,
    as server start-up makes it)."""
    run = root / "run"
    rec = load_recipe([recipe])
    atomic_write_json(run / "run.json", {"name": "run", "recipe": rec.model_dump(mode="json"),
                                         "placement": {"trainer_nodes": 1, "inference_nodes": 1}})
    for step in range(steps):
        warm = 10.0 if step == 0 else 1.0
        jitter = 1 + 0.02 * ((step % 3) - 1)
        append_jsonl(run / "metrics" / "trainer.jsonl", {
            "component": "trainer", "step": step, "time": 1000.0 + step, "trainer_step_time_s": trainer_s * warm * jitter,
            "wait_batch_s": 0.0, "weight_publish_s": 0.01, "loss": 0.1, "grad_norm": 1.0, "tokens": 100, "lr": 1e-3,
            "mismatch_kl": 0.0, "masked_fraction": 0.0, "ratio_mean": 1.0})
        append_jsonl(run / "metrics" / "orchestrator.jsonl", {
            "component": "orchestrator", "step": step, "time": 1000.0 + step, "reward_mean": 0.5,
            "orchestrator_step_time_s": orch_s * warm * jitter, "wait_policy_s": wait_s, "rollouts_per_s": 1.0,
            "tokens_per_s": 1.0, "off_policy_lag_mean": 1.0, "off_policy_lag_max": 1, "dropped_groups": 0,
            "policy_version": step, "tokens": 100})
    return run


def profile_with(tmp_path: Path, calibration: Path, base: str = "local") -> Path:
    data = yaml.safe_load((PROFILES / f"{base}.yaml").read_text())
    data.update(name=f"{base}-calibrated", calibration=str(calibration))
    path = tmp_path / f"{base}-calibrated.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def planned(*args) -> dict:
    out = rlctl("plan", *args, "--json")
    assert out.exit_code in (0, 1), out.output
    plan = json.loads(out.output)
    assert out.exit_code == (0 if plan["fits"] else 1), plan["errors"]
    return plan


@pytest.mark.parametrize("trainer_s,orch_s,wait_s", [(2.0, 3.0, 0.0), (0.05, 0.9, 0.0), (4.0, 4.2, 3.5)])
def test_calibrate_then_plan_reproduces_the_run(tmp_path, trainer_s, orch_s, wait_s):
    run = synthetic_run(tmp_path, trainer_s, orch_s, wait_s)
    cal = tmp_path / "cal.toml"
    out = rlctl("plan", TINY, "--calibrate", run, "--calibration-out", cal)
    assert out.exit_code == 0, out.output
    assert "trainer step" in out.output and str(cal) in out.output.replace("\n", "")
    text = cal.read_text()
    assert "[constants]" in text and "date = " in text and str(run.resolve()) in text
    j = planned(TINY, "--cluster", profile_with(tmp_path, cal))
    assert j["calibration"] == str(cal)
    o = j["orchestrator"]
    assert o["trainer_step_time_s"] == pytest.approx(trainer_s, rel=0.02)
    # the plan's step is the run's orchestrator step either way: rollout-bound, the rollout side is fitted
    # to it; trainer-bound (the off-policy gate held the orchestrator, generating took orch_s - wait_s),
    # the rest beyond the trainer step is the weight hand-off, ASYNC_STEP_SYNC_S
    assert o["step_time_s"] == pytest.approx(orch_s, rel=0.03)
    trainer_bound = orch_s - wait_s <= trainer_s
    assert ("ASYNC_STEP_SYNC_S" in text) == trainer_bound
    # the built-in profile is untouched: without the file the constants are the built-in ones again
    assert planned(TINY)["orchestrator"]["trainer_step_time_s"] != pytest.approx(trainer_s, rel=0.02)


def test_calibrate_finds_a_run_by_name_like_every_command(tmp_path, monkeypatch):
    synthetic_run(tmp_path, 2.0, 3.0)  # <output root>/run
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    cal = tmp_path / "cal.toml"
    out = rlctl("plan", TINY, "--calibrate", "run", "--calibration-out", cal)
    assert out.exit_code == 0, out.output
    assert str((tmp_path / "run").resolve()) in cal.read_text()


def test_calibrate_a_gpu_run(tmp_path):
    """The same fit on the GPU path: per-GPU-kind tables get an entry for the profile's GPU kind."""
    run = synthetic_run(tmp_path, 20.0, 30.0, recipe="qwen3-4b")
    cal = tmp_path / "cal.toml"
    assert rlctl("plan", "qwen3-4b", "--calibrate", run, "--calibration-out", cal).exit_code == 0
    o = planned("qwen3-4b", "--cluster", profile_with(tmp_path, cal, base="h200-28"))["orchestrator"]
    assert o["trainer_step_time_s"] == pytest.approx(20.0, rel=0.02)
    assert o["step_time_s"] == pytest.approx(30.0, rel=0.03)


def test_calibration_is_undone_after_the_plan(tmp_path):
    run = synthetic_run(tmp_path, 2.0, 3.0)
    before = {k: getattr(C, k) for k in dir(C) if k.isupper()}
    assert rlctl("plan", TINY, "--calibrate", run, "--json").exit_code == 0
    assert (run / "calibration.toml").is_file()  # the default place
    assert {k: getattr(C, k) for k in dir(C) if k.isupper()} == before


@pytest.mark.parametrize("body,key", [
    ("[constants]\nNOT_A_CONSTANT = 1.0\n", "constants.NOT_A_CONSTANT"),
    ("[constants]\nCPU_TRAIN_FLOPS_PER_CORE = -1.0\n", "constants.CPU_TRAIN_FLOPS_PER_CORE"),
    ("[constants]\nCPU_TRAIN_FLOPS_PER_CORE = \"fast\"\n", "constants.CPU_TRAIN_FLOPS_PER_CORE"),
    ("[source]\nrun = \"x\"\n", "calibration"),
])
def test_bad_calibration_file_is_one_line_exit_2(tmp_path, body, key):
    cal = tmp_path / "cal.toml"
    cal.write_text(body)
    for args in (["--cluster", profile_with(tmp_path, cal)], ["--calibration", cal]):
        out = rlctl("plan", TINY, *args)
        assert out.exit_code == 2, out.output
        assert key in out.output and len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output


@pytest.mark.parametrize("where", ["profile", "--calibration", "--calibrate"])
@pytest.mark.parametrize("path", ["missing", "directory", "too-long", "nul"])
def test_calibration_paths_that_cannot_be_used_name_their_key(tmp_path, where, path):
    """A calibration file or run that is not there, a directory, a name longer than the filesystem
    allows or (in a profile's YAML) one with a NUL byte: one line naming where the path came from, exit 2."""
    bad = {"missing": tmp_path / "nothere.toml", "directory": tmp_path, "too-long": tmp_path / ("c" * 300),
           "nul": f"{tmp_path}/a\0b"}[path]
    if where == "--calibrate" and path == "directory":
        bad = tmp_path / "empty"  # a directory that is not a run
        bad.mkdir()
    if where == "profile":
        out = rlctl("plan", TINY, "--cluster", profile_with(tmp_path, bad))
        key = "cluster profile 'local-calibrated': calibration: "
    elif path == "nul":
        return  # a command line cannot hold a NUL byte (argv is C strings); a YAML profile can
    else:
        out = rlctl("plan", TINY, where, bad)
        key = f"{where}: "
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rlctl: error: {key}"), out.output


def test_calibrate_needs_a_run_with_metrics(tmp_path):
    out = rlctl("plan", TINY, "--calibrate", tmp_path)
    assert out.exit_code == 2 and "--calibrate" in out.output
    run = synthetic_run(tmp_path, 1.0, 1.0, steps=0)
    out = rlctl("plan", TINY, "--calibrate", run)
    assert out.exit_code == 2 and "no trainer and orchestrator step metrics" in out.output


# ---- the CPU path scales with the model --------------------------------------------------------

def cpu_times(*overrides: str) -> tuple[float, float]:
    o = plan(load_recipe([TINY], list(overrides))).orchestrator
    return o["trainer_step_time_s"], o["rollout_step_time_s"]


def test_cpu_plan_scales_with_model_size_and_batch():
    tiny_t, tiny_r = cpu_times()
    big_t, big_r = cpu_times('model.name="qwen3-4b"', "orchestrator.expected_mean_tokens=64")
    # 4B parameters vs 0.1M: the FLOP and weight-streaming terms dominate, not the fixed overheads
    assert big_t > 100 * tiny_t and big_r > 10 * tiny_r
    twice_t, twice_r = cpu_times('model.name="qwen3-4b"', "orchestrator.expected_mean_tokens=64",
                                 "orchestrator.rollouts_per_step=1024", "orchestrator.max_in_flight=2048")
    assert twice_t == pytest.approx(2 * big_t, rel=0.1) and twice_r > 1.5 * big_r


# vLLM alone (offline, the server's settings) on a 2-core host, the tiny model: (sequences, tokens each,
# seconds per batch). The built-in constants once charged 0.3 ms per sequence per decode step, fitted to
# tiny-cpu's 2-token step: the plan then put 256 x 32 tokens at 2.9 s.
VLLM_ALONE_TINY = [(64, 32, 0.126), (256, 8, 0.094), (256, 32, 0.340), (512, 32, 0.723)]


@pytest.mark.parametrize("seqs,tokens,measured", VLLM_ALONE_TINY)
def test_cpu_plan_decodes_like_vllm_alone(seqs, tokens, measured):
    inf = plan(load_recipe([TINY], [f"orchestrator.rollouts_per_step={seqs}", f"orchestrator.max_tokens={tokens}",
                                    f"orchestrator.max_in_flight={seqs}",
                                    f"orchestrator.expected_mean_tokens={tokens + 3}"])).inference
    assert inf["concurrency"] == seqs
    assert tokens * inf["decode_step_s"] == pytest.approx(measured, rel=0.2)


def test_cpu_trainer_gets_the_cores_the_local_servers_leave():
    """On a 2-core local host one server keeps a core: a one-rank trainer computes on the other, two ranks
    on one core each (the local launcher's OMP_NUM_THREADS)."""
    one = plan(load_recipe([TINY], ["trainer.fsdp=1"])).trainer
    two = plan(load_recipe([TINY])).trainer
    assert one["compute_s"] == pytest.approx(2 * two["compute_s"])


# Median trainer steps of real runs on a 2-core host (last 40 steps, `rlctl monitor`): recipe, overrides,
# seconds. The constants before these were fitted to tiny-cpu alone and planned tiny-moe-cpu at 0.088 s
# (measured 0.139), tiny-cpu at one rank at 0.145 (0.068) and the compute-bound peer variant at 9.4 (5.31).
MOE = str(REPO / "recipes" / "tiny-moe-cpu.toml")
EP1_NO_REPLAY = ("trainer.ep=1", "trainer.router_replay=false")
TRAINER_RUNS = [(TINY, (), 0.10), (TINY, ("trainer.micro_batch_size=64",), 0.14), (TINY, ("trainer.fsdp=1",), 0.068),
                (MOE, (), 0.139), (MOE, EP1_NO_REPLAY, 0.132), (MOE, ("trainer.micro_batch_size=64",), 0.277),
                (MOE, ("trainer.micro_batch_size=128",), 0.202), (MOE, ("trainer.fsdp=1", *EP1_NO_REPLAY), 0.087),
                (str(REPO / "recipes" / "tiny-dataset-cpu.toml"), (), 0.091)]


@pytest.mark.parametrize("recipe,overrides,measured", TRAINER_RUNS)
def test_cpu_trainer_plan_matches_measured_steps(recipe, overrides, measured):
    """Dense and MoE, one and two ranks, one to four micro-batches: each MoE layer costs its routing, and
    several ranks their collectives, per micro-batch."""
    assert plan(load_recipe([recipe], list(overrides))).trainer["step_time_s"] == pytest.approx(measured, rel=0.15)


def test_cpu_trainer_plan_counts_compiled_layers():
    """trainer.compile fuses the small ops a tiny model's step is made of: the generation-heavy peer
    variant's batch (256 rows x 35 tokens, one rank) trained in 127 ms compiled against 161-166 ms eager."""
    shape = ["orchestrator.environment.name=count_a", "orchestrator.environment.args={length=32}",
             "orchestrator.max_tokens=32", "orchestrator.rollouts_per_step=256", "orchestrator.max_in_flight=768",
             "orchestrator.expected_mean_tokens=35", "trainer.micro_batch_size=256", "trainer.fsdp=1",
             "inference.max_model_len=64"]
    eager, compiled = (plan(load_recipe([TINY], [*shape, f"trainer.compile={c}"])).trainer["step_time_s"]
                       for c in ("false", "true"))
    assert compiled / eager == pytest.approx(0.127 / 0.1635, rel=0.06)


def test_cpu_compile_credit_skips_the_moe_blocks_the_trainer_leaves_eager():
    """Compile's credit to the small ops goes to an MoE layer's attention part only (its MoE block is
    never traced): the MoE recipe gains less from trainer.compile than the dense one."""
    def saved(recipe):  # the share of the step's compute (FLOPs and small ops) that compiling saves
        eager, compiled = (plan(load_recipe([recipe], [f"trainer.compile={c}"])).trainer["compute_s"]
                           for c in ("false", "true"))
        return 1 - compiled / eager

    dense, moe = saved(TINY), saved("recipes/tiny-moe-cpu.toml")  # the same batch, 2 of 2 layers MoE
    assert 0 < moe < 0.6 * dense


def test_cpu_trainer_plan_of_a_compute_bound_model(tmp_path):
    """bench/bench_peer_trl.py's compute variant (a 25M-parameter tiny Qwen3, 2 ranks, 64 x 67 tokens):
    5.31 s a step, where the FLOPs dominate."""
    from rlctl.trainer.tiny_model import TINY_MODELS

    config = {**TINY_MODELS["tiny-qwen3"], "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
              "max_window_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    counts = ["orchestrator.environment.name=count_a", "orchestrator.environment.args={length=64}",
              "orchestrator.max_tokens=64", "orchestrator.rollouts_per_step=64", "orchestrator.max_in_flight=128",
              "orchestrator.expected_mean_tokens=67", "trainer.micro_batch_size=32", "inference.max_model_len=128"]
    step = plan(load_recipe([TINY], [*counts, f"model.name={tmp_path}"])).trainer["step_time_s"]
    assert step == pytest.approx(5.31, rel=0.15)


def test_each_turn_of_a_multi_turn_rollout_is_decoded_and_served():
    """tiny-tools-cpu: one token in each of 2 turns. Planned as one turn it was 0.175 s a step against
    0.30 measured; the second turn adds its decode step, its request, and its length to the lag."""
    tools = str(REPO / "recipes" / "tiny-tools-cpu.toml")
    one, two = (plan(load_recipe([tools], [f"orchestrator.max_turns={t}"])) for t in (1, 2))
    a, b = one.inference, two.inference
    assert (a["completion_tokens"], b["completion_tokens"]) == (1, 2)
    assert b["rollout_serving_s"] == pytest.approx(2 * a["rollout_serving_s"])
    assert b["rollout_step_time_s"] - a["rollout_step_time_s"] == pytest.approx(
        a["rollout_serving_s"] + b["decode_step_s"] * math.ceil(512 / b["concurrency"])
        + b["prefill_s"] - a["prefill_s"])  # the mean length is the same: one prompt token fewer
    assert two.to_json()["off_policy"]["rollout_max_s"] == pytest.approx(2 * one.to_json()["off_policy"]["rollout_max_s"])
    # the trajectory's budget caps what the turns may generate
    capped = plan(load_recipe([tools], ["orchestrator.max_turns=4", "orchestrator.max_trajectory_tokens=2"]))
    assert capped.inference["completion_tokens"] == 2


# ---- cost, lag, storage, warnings --------------------------------------------------------------

def test_plan_reports_cost_lag_and_storage():
    j = planned("qwen3-4b")
    cost, lag, o = j["cost"], j["off_policy"], j["orchestrator"]
    gpus = (j["placement"]["trainer_nodes"] + j["placement"]["inference_nodes"]) * 8
    assert cost["gpus"] == gpus
    assert cost["gpu_hours_per_step"] == pytest.approx(gpus * o["step_time_s"] / 3600)
    assert cost["wall_time_s"] >= cost["max_steps"] * o["step_time_s"]
    assert cost["gpu_hours_per_run"] == pytest.approx(gpus * cost["wall_time_s"] / 3600)
    assert lag["max_off_policy_steps"] == 2 and lag["lag_max_steps"] >= lag["lag_mean_steps"] > 0
    assert j["disk"]["checkpoint_bytes"] > 0 and cost["checkpoint_write_s"] > 0
    # qwen3-4b: a rollout of max_tokens lives through more trainer steps than the bound allows
    assert lag["lag_max_steps"] > 2 and any(w.startswith("off-policy") for w in j["warnings"])
    # raise the bound and the warning goes
    j = planned("qwen3-4b", "-o", "orchestrator.max_off_policy_steps=8")
    assert not any(w.startswith("off-policy") for w in j["warnings"])


def test_synchronous_plan_implies_no_lag():
    lag = planned("qwen3-4b", "-o", "orchestrator.max_off_policy_steps=0")["off_policy"]
    assert lag["lag_mean_steps"] == 0 and lag["lag_max_steps"] == 0


def test_idle_gpus_are_warned():
    j = planned("qwen3-4b", "-o", "inference.tp=2", "-o", "inference.dp=3")
    assert any("inference: 2 of 8 GPUs idle" in w for w in j["warnings"]), j["warnings"]
    j = planned("glm5-swe", "-o", "deployment.inference_nodes=24", "-o", "deployment.trainer_nodes=4")
    assert any("inference: 64 of 192 GPUs idle" in w for w in j["warnings"]), j["warnings"]
    assert not any("idle (" in w for w in planned("qwen3-4b")["warnings"])


def test_a_cpu_run_on_a_gpu_cluster_holds_no_gpus():
    """Both groups at `gpus_per_node = 0` on a gres cluster: the job asks for no GPU, so none is counted
    in its cost or warned about as idle."""
    j = planned(TINY, str(REPO / "recipes" / "tiny-vslurm.toml"))
    assert j["cost"]["gpus"] == 0 and j["cost"]["gpu_hours_per_run"] == 0 and j["cost"]["node_hours_per_run"] > 0
    assert not any("idle (" in w for w in j["warnings"]), j["warnings"]


def test_time_limit_shorter_than_a_step_and_a_checkpoint_is_warned():
    j = planned("qwen3-4b", "-o", 'deployment.time_limit="00:00:15"')
    assert any(w.startswith("deployment.time_limit=00:00:15 is shorter") for w in j["warnings"]), j["warnings"]
    j = planned("qwen3-4b", "-o", 'deployment.time_limit="1-00:00:00"')
    assert not any("time_limit" in w for w in j["warnings"])


def test_slurm_time_formats():
    from rlctl.recipes.plan_extras import slurm_seconds

    assert [slurm_seconds(t) for t in ("30", "30:15", "01:00:00", "2-00", "2-01:30", "1-00:00:01", "UNLIMITED")] == \
        [1800, 1815, 3600, 172800, 178200, 86401, None]


# ---- 80 columns --------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["qwen3-4b", "glm5-swe", "qwen3-30b-a3b", TINY])
def test_human_plan_reads_in_80_columns(recipe):
    from rlctl.cli.plan_view import render

    j = plan(load_recipe([recipe])).to_json()
    buf = io.StringIO()
    render(j, file=buf, width=80, color=False)
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text  # rich truncates with an ellipsis
    joined = " ".join(text.split())
    tr = j["trainer"]
    assert f"{tr['tokens_per_s']:,.0f} tokens/s" in joined
    if tr.get("mfu"):
        assert f"MFU {100 * tr['mfu']:.1f}%" in joined and "communication" in joined
    assert f"{j['inference']['decode_tokens_per_s']:,.0f} tok/s" in joined
    assert "GPU-h" in joined or "node-h" in joined


# ---- the acceptance check on a real finished tiny run -----------------------------------------

@pytest.mark.slow
def test_calibrated_plan_predicts_the_tiny_run(tmp_path, tiny_cpu_run):
    """`rlctl plan --calibrate` on the finished tiny CPU run, then `rlctl plan` of the same recipe on a
    profile pointing at the file: the run's median trainer and orchestrator steps within ±25%."""
    run = tiny_cpu_run.run
    cal = tmp_path / "tiny.toml"
    out = rlctl("plan", TINY, "--calibrate", run, "--calibration-out", cal)
    assert out.exit_code == 0, out.output
    o = planned(TINY, "--cluster", profile_with(tmp_path, cal))["orchestrator"]
    from rlctl.launchers.run_summary import by_step
    from rlctl.orchestrator.exchange.metrics import read_records

    records = read_records(run)
    trainer = [r["trainer_step_time_s"] for r in by_step(records, "trainer")]
    orch = [r["orchestrator_step_time_s"] for r in by_step(records, "orchestrator")]
    assert o["trainer_step_time_s"] == pytest.approx(statistics.median(trainer), rel=0.25)
    assert o["step_time_s"] == pytest.approx(statistics.median(orch), rel=0.25)
    # and monitor shows plan next to measured for this CPU run
    mon = json.loads(rlctl("monitor", run, "--json").output)
    assert mon["predicted"]["trainer_step_time_s"] > 0 and mon["predicted"]["orchestrator_step_time_s"] > 0
    assert load_profile(str(profile_with(tmp_path, cal))).calibration == str(cal)
