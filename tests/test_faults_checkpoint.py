"""Checkpoint-level faults against the real trainer process (no vLLM: it plays no role here). Batches
are written the way the orchestrator writes them; after each fault the run dir is rewound exactly as
`rlctl resume` does (`launchers.resume.rewind`), the batches from the checkpoint on are regenerated,
and the resumed trainer must finish with contiguous steps.

(f) SIGKILL the trainer while it writes a checkpoint → that step stays incomplete, resume uses the
    previous complete one.
(g) a corrupt rollout file → detected by its checksum; the trainer stops with a clear error and does
    not train on it (we choose "error" over "skip": a skipped batch would be a lost step).
(h) the disk fills up during a checkpoint → a one-line error, nothing partial left, the previous
    checkpoint intact; after space is freed the run resumes from it.
"""
from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlctl.orchestrator.exchange.checkpoints import complete_checkpoints, is_complete
from rlctl.launchers.resume import rewind

from trainer_fixtures import launch_ranks, make_run, synthetic_batch, trainer_metrics, wait_all, write_batches

pytestmark = pytest.mark.slow

STEPS = 6
OVERRIDES = [f"orchestrator.max_steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep_last=2", "trainer.fsdp=1",
             "trainer.batch_timeout_s=120"]


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-model")


@pytest.fixture(scope="module")
def batches(tmp_path_factory, model_cache):
    run = make_run(tmp_path_factory.mktemp("batches"), OVERRIDES, model_cache)
    return [synthetic_batch(run.model, rows=8, seed=s) for s in range(STEPS)]


def log_of(run) -> str:
    return (run.root / "trainer_rank0.log").read_text()


def resume_and_finish(run, batches, expect_step: int) -> None:
    before = {m["step"]: m["loss"] for m in trainer_metrics(run)}
    plan = rewind(run)
    assert plan.from_checkpoint and plan.step == expect_step, plan.describe()
    for step in range(expect_step, STEPS):  # the orchestrator regenerates batches from the checkpoint on
        write_batches(run, batches[step], [step])
    codes = wait_all(launch_ranks(run, 1, {"RLCTL_RESUME_STEP": str(plan.step)}))
    assert codes == [0], log_of(run)[-3000:]
    assert [m["step"] for m in trainer_metrics(run)] == list(range(STEPS))  # contiguous
    # exact replay: steps trained before the fault and again after the resume give the same loss
    replayed = [(m["step"], m["loss"]) for m in trainer_metrics(run) if m["step"] >= expect_step and m["step"] in before]
    assert replayed and all(abs(loss - before[step]) < 1e-6 for step, loss in replayed), (replayed, before)
    assert f"start_step={expect_step}" in log_of(run)
    assert (run.weights / f"step_{STEPS}" / "COMPLETE").exists()


def _inotify_wait_create(folder: Path, name: str, timeout_s: float) -> bool:
    """Block until `name` is created in `folder` (Linux inotify; no polling gap to miss it in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    IN_CREATE, IN_MOVED_TO = 0x100, 0x80
    libc.inotify_add_watch(fd, str(folder).encode(), IN_CREATE | IN_MOVED_TO)
    try:
        if (folder / name).exists():
            return True
        while True:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                return False
            data = os.read(fd, 4096)
            if name.encode() in data:
                return True
    finally:
        os.close(fd)


def test_trainer_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, model_cache, batches):
    run = make_run(tmp_path / "run", OVERRIDES, model_cache)
    write_batches(run, batches[0], [0])
    for step in range(1, STEPS):
        write_batches(run, batches[step], [step])
    procs = launch_ranks(run, 1)
    assert _inotify_wait_create(run.checkpoints, "step_2", 120)
    assert _inotify_wait_create(run.checkpoints, "step_4", 120)  # the step dir appears with the stage
    procs[0].send_signal(signal.SIGKILL)
    assert wait_all(procs) == [-signal.SIGKILL]
    assert not is_complete(run.checkpoints, 4), "killed while writing step_4, yet it is complete"
    assert complete_checkpoints(run.checkpoints) == [2]
    resume_and_finish(run, batches, 2)


def test_corrupt_rollout_is_detected_and_not_trained_on(tmp_path, model_cache, batches):
    run = make_run(tmp_path / "run", OVERRIDES, model_cache)
    for step in range(4):
        write_batches(run, batches[step], [step])
    data = run.rollouts / "step_3" / "batch.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte inside the tensor data
    data.write_bytes(bytes(raw))
    codes = wait_all(launch_ranks(run, 1))
    log = log_of(run)
    assert codes == [1], log[-3000:]
    assert "step_3" in log.splitlines()[-1] and "Traceback" in log  # clear last line, full detail above
    assert [m["step"] for m in trainer_metrics(run)] == [0, 1, 2]  # batch 3 was not trained on
    assert not (run.weights / "step_4").exists()
    resume_and_finish(run, batches, 2)


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tmp_path, model_cache, batches):
    run = make_run(tmp_path / "run", OVERRIDES, model_cache)
    run.checkpoints.rmdir()
    run.checkpoints.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "rlctl-test", str(run.checkpoints)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the checkpoint dir: {mount.stderr.strip()}")
    try:
        write_batches(run, batches[0], [0])
        write_batches(run, batches[1], [1])
        procs = launch_ranks(run, 1)
        deadline = time.monotonic() + 120
        while not is_complete(run.checkpoints, 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_complete(run.checkpoints, 2)
        filler = run.checkpoints / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until ENOSPC
        for step in range(2, STEPS):
            write_batches(run, batches[step], [step])
        assert wait_all(procs) == [1]
        last = log_of(run).strip().splitlines()[-1]
        assert "checkpoint step_4 could not be written" in last and "No space left on device" in last, last
        assert "the previous complete checkpoint (step_2) is intact" in last
        assert complete_checkpoints(run.checkpoints) == [2]
        assert not any(p.name.startswith(".") for p in (run.checkpoints / "step_4").iterdir()) \
            if (run.checkpoints / "step_4").exists() else True  # no staged leftovers
        filler.unlink()
        resume_and_finish(run, batches, 2)
        assert complete_checkpoints(run.checkpoints) == [4, 6]
    finally:
        subprocess.run(["umount", "-l", str(run.checkpoints)], capture_output=True)
        shutil.rmtree(run.checkpoints, ignore_errors=True)
