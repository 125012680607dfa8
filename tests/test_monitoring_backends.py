"""`monitoring.backends`: TensorBoard event files and an offline W&B run under `<run>/monitoring/`,
fed from the typed metric records of every writer; a chosen backend that is not installed is one
line naming `monitoring.backends`."""
from __future__ import annotations

import importlib.util

import pytest

from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord, TrainerStepRecord, append_record
from rlctl.orchestrator.monitoring import MetricsForwarder
from rlctl.recipes.errors import RecipeError


def trainer_record(step: int) -> TrainerStepRecord:
    return TrainerStepRecord(step=step, trainer_step_time_s=1.0 + step, wait_batch_s=0.1, weight_publish_s=0.05,
                             loss=0.5 - 0.1 * step, grad_norm=0.3, tokens=512, lr=1e-6, mismatch_kl=1e-3,
                             masked_fraction=0.0, ratio_mean=1.0, entropy=1.2)


def orch_record(step: int) -> OrchestratorStepRecord:
    return OrchestratorStepRecord(step=step, reward_mean=0.1 * step, orchestrator_step_time_s=2.0, wait_policy_s=0.0,
                                  rollouts_per_s=40.0, tokens_per_s=300.0, off_policy_lag_mean=0.5,
                                  off_policy_lag_max=1, dropped_groups=0, policy_version=step, tokens=512)


def write_steps(run: RunDir, steps) -> None:
    for step in steps:
        append_record(run, "orchestrator", orch_record(step))  # the orchestrator runs ahead of the trainer
        append_record(run, "trainer", trainer_record(step))


def test_tensorboard_event_file_holds_the_records(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(tmp_path)
    forwarder = MetricsForwarder(run, ["tensorboard"], "tb-run", {}, from_step=1)
    write_steps(run, range(3))
    assert forwarder.poll() == 4  # steps 1 and 2 of both writers; step 0 belongs to an earlier attempt
    assert forwarder.poll() == 0  # nothing is sent twice
    write_steps(run, [3])
    assert forwarder.poll() == 2
    forwarder.close()
    (events,) = (run.monitoring / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"trainer/trainer_step_time_s", "trainer/loss", "orchestrator/reward_mean", "orchestrator/tokens"} <= tags
    assert "trainer/time" not in tags and "trainer/step" not in tags
    assert [(e.step, e.value) for e in acc.Scalars("trainer/trainer_step_time_s")] == [(1, 2.0), (2, 3.0), (3, 4.0)]
    assert [e.step for e in acc.Scalars("orchestrator/reward_mean")] == [1, 2, 3]
    assert acc.Scalars("orchestrator/reward_mean")[-1].value == pytest.approx(0.3)


def wandb_records(path) -> list[bytes]:
    """Payloads of a `.wandb` transaction log: a 7-byte header, then 32 KiB blocks of records
    (crc32c 4, length 2 little-endian, type 1: full / first / middle / last, payload)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            out.append(pending)
    return out


def test_wandb_offline_run_holds_the_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = RunDir(tmp_path)
    forwarder = MetricsForwarder(run, ["wandb"], "wb-run", {"orchestrator": {"max_steps": 3}})
    write_steps(run, range(3))
    assert forwarder.poll() == 6
    forwarder.close()
    (folder,) = (run.monitoring / "wandb" / "wandb").glob("offline-run-*")
    (log,) = folder.glob("run-*.wandb")
    history, kinds = [], []
    for data in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kinds.append(record.WhichOneof("record_type"))
        if kinds[-1] == "history":
            history.append({item.key or "/".join(item.nested_key): item.value_json for item in record.history.item})
    trainer = [h for h in history if "trainer/step" in h]
    orch = [h for h in history if "orchestrator/step" in h]
    assert [int(h["trainer/step"]) for h in trainer] == [0, 1, 2], (kinds, history, log.stat().st_size)
    assert [float(h["trainer/trainer_step_time_s"]) for h in trainer] == [1.0, 2.0, 3.0]
    assert [float(h["orchestrator/reward_mean"]) for h in orch] == pytest.approx([0.0, 0.1, 0.2])


def test_chosen_backend_without_its_package_is_one_line_naming_the_key(tmp_path, monkeypatch):
    from rlctl.recipes.load import load_recipe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError) as err:
        MetricsForwarder(RunDir(tmp_path), ["tensorboard", "wandb"], "x", {})
    assert str(err.value).startswith("monitoring.backends: wandb chosen but not installed") and "\n" not in str(err.value)
    with pytest.raises(RecipeError) as err:
        load_recipe(["tiny-cpu"], ['monitoring.backends=["wandb"]'])
    assert str(err.value).startswith("monitoring.backends: ") and "wandb chosen but not installed" in str(err.value)
    assert not (tmp_path / "monitoring").exists()


def test_no_backend_by_default_writes_nothing(tmp_path):
    from rlctl.recipes.load import load_recipe

    recipe = load_recipe(["tiny-cpu"])
    assert recipe.monitoring.backends == [] and recipe.monitoring.stall_timeout_s == 1800.0
    run = RunDir(tmp_path)
    forwarder = MetricsForwarder(run, recipe.monitoring.backends, "x", {})
    write_steps(run, range(2))
    assert forwarder.poll() == 0 and not run.monitoring.exists()
