"""Weight sync in `rlctl plan`: the time of each transport, where it sits on the async step, the warning,
the profile's filesystem figures, and calibration attributing only what the model does not explain."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.recipes import calibration as C
from rlctl.recipes.clusters import load_profile
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import plan
from rlctl.recipes.plan_sync import SYNC_WARN_FRACTION, ReplicaGroup, SyncShape, sync_times

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "recipes" / "profiles"
TINY = str(REPO / "recipes" / "tiny-cpu.toml")


def planned(*args) -> dict:
    out = CliRunner().invoke(app, ["plan", *map(str, args), "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def profile_with(tmp_path: Path, base: str = "h200-28", **fields) -> Path:
    data = yaml.safe_load((PROFILES / f"{base}.yaml").read_text())
    data.update(name=f"{base}-x", **fields)
    path = tmp_path / f"{base}-x.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_glm5_plan_has_sync_time_for_each_transport_on_the_critical_path():
    j = planned("glm5-swe")
    w, o = j["weights"], j["orchestrator"]
    assert w["transport"] == "filesystem" and set(w["sync_time_s"]) == {"filesystem", "broadcast"}
    assert all(v > 0 for v in w["sync_time_s"].values())
    # GLM-5 (≈ 744B) served in FP8: matmul weights in 1 byte, embeddings in 2
    assert 0.7e12 < w["bytes"] < 0.8e12 and w["dtype"] == "fp8"
    # rollout-bound: the servers' reload pause is on the step, the trainer's write is hidden behind it
    assert j["bottleneck"] == "inference"
    assert o["step_time_s"] == pytest.approx(o["rollout_step_time_s"] + w["rollout_side_s"])
    assert w["sync_time_s"]["filesystem"] == pytest.approx(w["trainer_side_s"] + w["rollout_side_s"])
    fs = w["filesystem"]
    assert w["trainer_side_s"] == pytest.approx(fs["write_s"])
    assert w["rollout_side_s"] == pytest.approx(fs["read_s"] + fs["reload_fixed_s"])


def test_broadcast_holds_both_sides_for_the_transfer():
    w = planned("glm5-swe", "-o", "weights.transport=broadcast")["weights"]
    b = w["broadcast"]
    assert w["transport"] == "broadcast"
    assert w["trainer_side_s"] == pytest.approx(b["transfer_s"])
    assert w["rollout_side_s"] == pytest.approx(b["transfer_s"] + b["reload_fixed_s"])
    # rank 0 sends every bucket over one 400 Gb/s NIC: at least bytes / 50 GB/s
    assert b["transfer_s"] > w["bytes"] / 50e9 and b["buckets"] == -(-int(w["bytes"]) // (256 << 20))


def test_trainer_bound_plan_pays_the_publish_on_its_step():
    # one trainer node for Qwen3-30B: the trainer sets the pace; its write is on the step, the reload is not
    j = planned("qwen3-30b-a3b", "-o", "deployment.trainer_nodes=1", "-o", "deployment.inference_nodes=4")
    o, w = j["orchestrator"], j["weights"]
    assert j["bottleneck"] == "trainer"
    assert o["step_time_s"] == pytest.approx(o["trainer_step_time_s"] + w["trainer_side_s"] + C.ASYNC_STEP_SYNC_S)
    assert o["weight_sync_trainer_s"] == w["trainer_side_s"] > 0


def test_synchronous_rl_waits_for_the_whole_sync():
    j = planned("qwen3-4b", "-o", "orchestrator.max_off_policy_steps=0")
    o, w = j["orchestrator"], j["weights"]
    whole = w["sync_time_s"]["filesystem"]
    assert o["step_time_s"] == pytest.approx(o["trainer_step_time_s"] + o["rollout_step_time_s"] + whole)


def test_filesystem_bandwidth_bounds_the_sync(tmp_path):
    slow = planned("glm5-swe", "--cluster", profile_with(tmp_path, fs_aggregate_gbs=20, fs_node_gbs=2))
    fast = planned("glm5-swe", "--cluster", profile_with(tmp_path, fs_aggregate_gbs=1000, fs_node_gbs=100))
    s, f = slow["weights"], fast["weights"]
    assert s["sync_time_s"]["filesystem"] > 4 * f["sync_time_s"]["filesystem"]
    assert s["sync_time_s"]["broadcast"] == pytest.approx(f["sync_time_s"]["broadcast"])  # no filesystem in it
    # per node: 12 trainer nodes at 2 GB/s write 1/12 each, below the 20 GB/s aggregate
    assert s["filesystem"]["write_s"] == pytest.approx(s["bytes"] / 20e9)
    assert slow["orchestrator"]["step_time_s"] > fast["orchestrator"]["step_time_s"]


def test_sync_warning_past_the_fraction(tmp_path):
    slow = planned("glm5-swe", "--cluster", profile_with(tmp_path, fs_aggregate_gbs=5, fs_node_gbs=1))
    w = slow["weights"]
    assert w["sync_time_s"]["filesystem"] > SYNC_WARN_FRACTION * slow["orchestrator"]["step_time_s"]
    (warning,) = [x for x in slow["warnings"] if x.startswith("weights:")]
    assert "filesystem weight sync" in warning and 'weights.transport="broadcast"' in warning
    fast = planned("glm5-swe", "--cluster", profile_with(tmp_path, fs_aggregate_gbs=10000, fs_node_gbs=1000))
    assert fast["weights"]["sync_time_s"]["filesystem"] < SYNC_WARN_FRACTION * fast["orchestrator"]["step_time_s"]
    assert not any(x.startswith("weights:") for x in fast["warnings"])


def test_expert_parallel_replicas_over_nodes_read_only_their_share():
    profile = load_profile("h200-28")
    one_node = SyncShape(1, 8, (ReplicaGroup(2, 1, True),), "h200")
    two_nodes = SyncShape(1, 8, (ReplicaGroup(1, 2, True),), "h200")
    a = sync_times(one_node, profile, dense=10e9, expert=100e9, bucket_bytes=1 << 30)["filesystem"]
    b = sync_times(two_nodes, profile, dense=10e9, expert=100e9, bucket_bytes=1 << 30)["filesystem"]
    assert a["read_bytes"] == pytest.approx(2 * 110e9)  # two replicas, each on its own node: all of it
    assert b["read_bytes"] == pytest.approx(2 * (10e9 + 50e9))  # one replica over two nodes: half the experts each


def test_cpu_plan_models_the_sync_and_the_human_output_shows_it():
    j = planned(TINY)
    w = j["weights"]
    assert w["bytes"] > 0 and w["sync_time_s"]["filesystem"] > 0 and w["sync_time_s"]["broadcast"] > 0
    out = CliRunner().invoke(app, ["plan", TINY])
    assert out.exit_code == 0 and "weight sync" in out.output and "filesystem" in out.output


@pytest.mark.parametrize("field", ["fs_aggregate_gbs", "fs_node_gbs"])
@pytest.mark.parametrize("value", ["0", "-1", ".nan", ".inf"])
def test_bad_filesystem_bandwidth_is_one_line_exit_2(tmp_path, field, value):
    path = tmp_path / "p.yaml"
    path.write_text(f"nodes: 4\ngpus_per_node: 8\ngpu: h200\n{field}: {value}\n")
    out = CliRunner().invoke(app, ["plan", "qwen3-4b", "--cluster", str(path)])
    assert out.exit_code == 2, out.output
    assert field in out.output and len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output


def test_calibration_takes_the_modelled_sync_out_before_fitting(tmp_path):
    """A trainer-bound run: ASYNC_STEP_SYNC_S is the orchestrator step beyond the trainer step and the
    modelled publish, so the calibrated plan reproduces the run instead of counting the publish twice."""
    from rlctl.recipes.run_calibration import applied, fit

    rec = load_recipe(["qwen3-4b"], ["deployment.trainer_nodes=1", "deployment.inference_nodes=1"])
    profile = load_profile("h200-28")
    measured = {"trainer_step_time_s": 30.0, "orchestrator_step_time_s": 34.0, "generation_time_s": 10.0, "steps": 10}
    constants, _ = fit(rec, profile, measured)
    with applied(constants):
        j = plan(rec, profile).to_json()
    o, w = j["orchestrator"], j["weights"]
    assert o["trainer_step_time_s"] == pytest.approx(30.0, rel=0.01)
    assert w["trainer_side_s"] > 0.5  # an 8 GB bf16 model through one node's 10 GB/s
    assert constants["ASYNC_STEP_SYNC_S"] == pytest.approx(34.0 - o["trainer_step_time_s"] - w["trainer_side_s"], rel=1e-6)
    assert o["step_time_s"] == pytest.approx(34.0, rel=0.01)
