"""Retention of the run directory: published weights (keep_last + whatever a server may be loading),
rollouts covered by a complete checkpoint, checkpoint pruning order, staging leftovers of killed writers."""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from rlctl.launchers.resume import rewind
from rlctl.orchestrator.exchange import steps as steps_module
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchReader
from rlctl.orchestrator.exchange.checkpoints import (ORCHESTRATOR, TRAINER, complete_checkpoints, newest_complete,
                                                     prune_progress, write_part)
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.retention import (prune_checkpoints, record_serving, release_rollouts,
                                                   retain_weights, serving_path, sweep_for_rewind,
                                                   sweep_orchestrator_staging, sweep_trainer_staging)
from rlctl.orchestrator.exchange.steps import MARKER, complete_steps, publish_step
from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, shard_files
from rlctl.orchestrator.loop import PolicyVersion
from rlctl.orchestrator.weight_watcher import WeightWatcher


@pytest.fixture
def run(tmp_path, monkeypatch) -> RunDir:
    monkeypatch.setenv("RLCTL_ATTEMPT", "2")
    run = RunDir(tmp_path / "run")
    run.create()
    return run


def publish(store: FilesystemWeightStore, step: int) -> None:
    store.publish_state(step, {"w": torch.full((4,), float(step))}, {"test": True})


def on_disk(folder: Path) -> list[str]:
    """Every step directory or staging directory in `folder`, complete or not."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("step_", ".step_")))


# ---- weights ------------------------------------------------------------------------------------


def test_weights_keep_the_newest_and_every_step_above_the_served_version(run):
    store = FilesystemWeightStore(run.weights)
    for step in range(6):
        publish(store, step)
    record_serving(run, 2)  # servers serve step_2; 3, 4 or 5 may be loading right now
    assert retain_weights(run, store, keep_last=2) == [0, 1, 2]
    assert complete_steps(run.weights) == [3, 4, 5]
    record_serving(run, 5)
    assert retain_weights(run, store, keep_last=2) == [3]
    assert complete_steps(run.weights) == [4, 5]


def test_without_a_record_of_this_attempt_nothing_is_deleted(run, monkeypatch):
    store = FilesystemWeightStore(run.weights)
    for step in range(5):
        publish(store, step)
    assert retain_weights(run, store, keep_last=1) == []  # no watcher yet: it may pick any step
    record_serving(run, 4)
    monkeypatch.setenv("RLCTL_ATTEMPT", "3")  # the record is the previous attempt's
    assert retain_weights(run, store, keep_last=1) == []
    serving_path(run).write_text("{torn")
    assert retain_weights(run, store, keep_last=1) == []
    record_serving(run, 4)
    assert retain_weights(run, store, keep_last=1) == [0, 1, 2, 3]


@pytest.mark.parametrize("keep_last", [1, 2])
def test_a_loading_server_never_loses_its_step_and_the_disk_stays_bounded(run, keep_last):
    """Trainer, weight watcher and a disk sampler in threads over real files, with random delays.
    The trainer trains batch N only once version N - max_off_policy is served (what the orchestrator's
    off-policy bound imposes); the watcher holds a step's file open while it "loads" it."""
    store, off_policy, steps = FilesystemWeightStore(run.weights), 1, 120
    served, failures, counts, done = [0], [], [], threading.Event()
    rng = random.Random(keep_last)

    def watcher():
        record_serving(run, 0)
        while not done.is_set():
            newest = store.latest()
            if newest is None or newest <= served[0]:
                time.sleep(0.0005)
                continue
            try:
                with open(shard_files(store.location(newest))[0], "rb") as f:
                    time.sleep(rng.random() * 0.004)  # a slow load, files open
                    f.read()
                assert (store.location(newest) / MARKER).exists()
                record_serving(run, newest)  # recorded before the policy moves on, as the real watcher does
                served[0] = newest
            except (OSError, AssertionError) as exc:
                failures.append(f"step_{newest}: {exc!r}")
                return

    def sampler():
        while not done.is_set():
            counts.append(len(on_disk(run.weights)))
            time.sleep(0.0002)

    threads = [threading.Thread(target=watcher), threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    try:
        publish(store, 0)
        retain_weights(run, store, keep_last)
        for step in range(steps):
            deadline = time.monotonic() + 30
            while served[0] < step - off_policy and not failures:
                assert time.monotonic() < deadline, "the watcher stopped serving"
                time.sleep(0.0002)
            publish(store, step + 1)
            retain_weights(run, store, keep_last)
            counts.append(len(on_disk(run.weights)))
    finally:
        done.set()
        for t in threads:
            t.join()
    assert failures == []
    # kept: max(keep_last, off_policy + 1) complete steps, plus the one being published
    assert max(counts) <= max(keep_last, off_policy + 1) + 1, max(counts)
    assert complete_steps(run.weights)[-1] == steps


def test_the_weight_watcher_records_the_served_version_before_bumping_the_policy(run):
    store = FilesystemWeightStore(run.weights)
    seen = []
    policy = PolicyVersion(0)

    async def reload(step_dir: Path) -> dict:
        return {}

    def serving(version: int) -> None:
        seen.append((version, policy.version))
        record_serving(run, version)

    async def scenario():
        watcher = WeightWatcher(run.weights, policy, reload, poll_s=0.001, serving=serving)
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(0.05)
        publish(store, 1)
        await asyncio.wait_for(policy.wait_for(1), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert seen == [(0, 0), (1, 0)]  # at start, then step 1 recorded while the policy was still 0
    assert json.loads(serving_path(run).read_text())["served"] == 1


# ---- rollouts and checkpoints -------------------------------------------------------------------


def fake_batch(run: RunDir, step: int) -> None:
    publish_step(run.rollouts, f"step_{step}", lambda d: (d / "batch.safetensors").write_bytes(b"x"), {"step": step})


def test_rollouts_go_once_a_complete_checkpoint_covers_them(run):
    for step in range(10):
        fake_batch(run, step)
    reader = FilesystemBatchReader(run.rollouts)
    assert release_rollouts(run, reader, 4, checkpoint_interval=4) == []  # no checkpoint yet
    write_part(run.checkpoints, 4, TRAINER, {"state": b"4"})
    write_part(run.checkpoints, 8, TRAINER, {"state": b"8"})
    (run.checkpoints / "step_8" / ORCHESTRATOR).mkdir()  # a part without marker: step 8 is incomplete
    assert release_rollouts(run, reader, 8, checkpoint_interval=4) == [0, 1, 2, 3]
    shutil.rmtree(run.checkpoints / "step_8" / ORCHESTRATOR)
    assert release_rollouts(run, reader, 6, checkpoint_interval=4) == []  # 8 is complete, 6 and 7 untrained
    assert release_rollouts(run, reader, 8, checkpoint_interval=4) == [4, 5, 6, 7]
    assert complete_steps(run.rollouts) == [8, 9]
    # what a resume needs is still there: it rewinds to 8 and regenerates batches >= 8
    plan = rewind(run)
    assert plan.step == 8 and complete_steps(run.rollouts) == []


def test_without_periodic_checkpoints_a_batch_goes_once_trained(run):
    for step in range(4):
        fake_batch(run, step)
    reader = FilesystemBatchReader(run.rollouts)
    assert release_rollouts(run, reader, 1, checkpoint_interval=0) == [0]
    assert release_rollouts(run, reader, 3, checkpoint_interval=0) == [1, 2]
    assert complete_steps(run.rollouts) == [3]


def test_pruning_removes_every_marker_before_any_file(run, monkeypatch):
    for step in (2, 4, 6):
        write_part(run.checkpoints, step, TRAINER, {"state": b"x"})
        write_part(run.checkpoints, step, ORCHESTRATOR, {"state.json": b"{}"})
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        left = [str(p) for p in Path(path).rglob(MARKER)]
        assert left == [], f"deleting {path} while {left} still mark it complete"
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(steps_module.shutil, "rmtree", rmtree)
    assert prune_checkpoints(run.checkpoints, keep_last=1) == [2, 4]
    assert complete_checkpoints(run.checkpoints) == [6]


def test_readers_and_pruners_of_checkpoints_tolerate_a_step_vanishing_under_them(run):
    """The trainer prunes old checkpoints while the orchestrator lists them and prunes its progress
    parts (a benchmark run once died of FileNotFoundError on a step the trainer had just removed)."""
    stop, errors = threading.Event(), []

    def trainer() -> None:  # saves a checkpoint per step and keeps only the newest, as fast as it can
        step = 0
        try:
            while not stop.is_set():
                step += 1
                write_part(run.checkpoints, step, ORCHESTRATOR, {"state.json": b"{}"})
                write_part(run.checkpoints, step, TRAINER, {"state": b"x"})
                prune_checkpoints(run.checkpoints, keep_last=1)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    checks = 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not errors:
            newest = newest_complete(run.checkpoints) or 0  # what the orchestrator does after each batch
            prune_progress(run.checkpoints, newest)
            checks += 1
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert checks > 50 and len(complete_checkpoints(run.checkpoints)) == 1


# ---- staging leftovers --------------------------------------------------------------------------


def plant_leftovers(run: RunDir) -> None:
    for folder in (run.weights / ".step_3.k1x.tmp", run.rollouts / ".step_5.q9.tmp",
                   run.checkpoints / "step_4" / ".trainer.tmp", run.checkpoints / "step_4" / ".orchestrator.a7.tmp",
                   run.checkpoints / ".step_6.import"):
        folder.mkdir(parents=True)
        (folder / "data").write_bytes(b"partial")


def test_each_component_sweeps_only_its_own_staging(run):
    plant_leftovers(run)
    assert sorted(sweep_trainer_staging(run)) == ["step_4/.trainer.tmp", "weights/.step_3.k1x.tmp"]
    assert (run.checkpoints / "step_4" / ".orchestrator.a7.tmp").exists()  # it may be being written
    assert sorted(sweep_orchestrator_staging(run)) == ["rollouts/.step_5.q9.tmp", "step_4/.orchestrator.a7.tmp"]
    assert (run.checkpoints / ".step_6.import").exists()


def test_rewind_sweeps_every_leftover_and_the_previous_serving_record(run):
    plant_leftovers(run)
    record_serving(run, 3)
    assert sorted(sweep_for_rewind(run)) == [".step_6.import", "rollouts/.step_5.q9.tmp",
                                             "services/weights/serving.json", "step_4/.orchestrator.a7.tmp",
                                             "step_4/.trainer.tmp", "weights/.step_3.k1x.tmp"]
    plant_leftovers(run)
    record_serving(run, 3)
    rewind(run)  # `rlctl resume` and requeued jobs
    assert not serving_path(run).exists()
    assert [p for p in run.root.rglob("*") if p.name.startswith(".")] == []


# ---- a whole run ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_of_100_tiny_steps_keeps_at_most_keep_last_plus_one_weight_steps(tmp_path):
    """The smoke recipe on the local launcher: its trainer publishes real (1 MiB) weights every step
    through the weight store with the run's retention, its orchestrator plays the weight watcher.
    The weights folder is sampled throughout the run; every sample must hold <= keep_last + 1 steps."""
    import subprocess
    import sys

    from rlctl.orchestrator.exchange.metrics import read_records

    repo, keep_last, steps = Path(__file__).resolve().parents[1], 2, 100
    cmd = [sys.executable, "-m", "rlctl.cli.main", "launch", str(repo / "recipes" / "smoke.toml"), "--cluster", "local",
           "--name", "retention", "--wait", "-o", f"deployment.output_dir={tmp_path}",
           "-o", "deployment.trainer_nodes=1", "-o", "trainer.fsdp=2", "-o", f"deployment.smoke.steps={steps}",
           "-o", "deployment.smoke.step_s=0.01", "-o", "checkpoint.interval=10", "-o", f"weights.keep_last={keep_last}"]
    weights = tmp_path / "retention" / "weights"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, seen = [], set()
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            names = on_disk(weights)
        except FileNotFoundError:
            names = []
        samples.append(len(names))
        seen.update(names)
        time.sleep(0.001)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert [r["step"] for r in read_records(tmp_path / "retention") if r.get("component") == "trainer"] == list(range(steps))
    assert len({n for n in seen if n.startswith("step_")}) > steps // 2, sorted(seen)  # the samples covered the run
    assert max(samples) <= keep_last + 1, (max(samples), len(samples))
    assert complete_steps(weights) == [steps - 1, steps]
    assert complete_checkpoints(tmp_path / "retention" / "checkpoints") == [90, 100]  # checkpoint.keep_last=2
