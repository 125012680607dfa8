"""Resume semantics without starting a run: which checkpoints are complete, how a run dir is rewound,
orchestrator state round trip, requeue bookkeeping, the sbatch script's requeue path, CLI refusals."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.orchestrator.exchange.checkpoints import (complete_checkpoints, fallback_rng, is_complete, load_orchestrator_state,
                                         newest_complete, save_orchestrator_state)
from rlctl.launchers.resume import rewind
from rlctl.orchestrator.exchange.steps import MARKER
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.metrics import append_record, read_records
from rlctl.recipes.errors import RecipeError
from rlctl.trainer.checkpoint import prune

REPO = Path(__file__).resolve().parents[1]
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]


def trainer_part(run: RunDir, step: int, complete: bool = True) -> None:
    part = run.checkpoints / f"step_{step}" / "trainer"
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (part / MARKER).write_text("{}")


def step_dirs(parent: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in parent.glob("step_*"))


def test_a_step_is_complete_only_with_every_present_part_marked(tmp_path):
    run = RunDir(tmp_path)
    run.create()
    trainer_part(run, 2)                                   # trainer only (trainer-only runs): complete
    trainer_part(run, 4)
    (run.checkpoints / "step_4" / "orchestrator").mkdir()  # renamed but no marker yet: incomplete
    save_orchestrator_state(run.checkpoints, 6, {"rng": random.Random(1).getstate(), "environment": {}, "counters": {}})
    trainer_part(run, 8, complete=False)                    # torn trainer part
    trainer_part(run, 10)
    save_orchestrator_state(run.checkpoints, 10, {"rng": random.Random(1).getstate(), "environment": {}, "counters": {}})
    assert complete_checkpoints(run.checkpoints) == [2, 10]
    assert newest_complete(run.checkpoints) == 10 and not is_complete(run.checkpoints, 6)
    assert prune(run.checkpoints, keep_last=1) == [2, 4, 6, 8]
    assert step_dirs(run.checkpoints) == [10]


def test_orchestrator_state_round_trip_replays_the_prompt_stream(tmp_path):
    rng = random.Random(7)
    rng.random()
    saved = rng.getstate()
    expected = [rng.random() for _ in range(5)]
    save_orchestrator_state(tmp_path, 3, {"rng": saved, "environment": {"cursor": 9}, "counters": {"groups_started": 4}})
    state = load_orchestrator_state(tmp_path, 3)
    restored = random.Random()
    restored.setstate(state["rng"])
    assert [restored.random() for _ in range(5)] == expected
    assert state["environment"] == {"cursor": 9} and state["counters"] == {"groups_started": 4}
    assert load_orchestrator_state(tmp_path, 4) is None
    assert fallback_rng(0, 5).random() == fallback_rng(0, 5).random()


def make_history(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    for step in range(8):
        (run.rollouts / f"step_{step}").mkdir()
        (run.rollouts / f"step_{step}" / MARKER).write_text("{}")
        append_record(run, "orchestrator", {"component": "orchestrator", "step": step, "reward_mean": step / 10})
        append_record(run, "trainer", {"component": "trainer", "step": step, "loss": 0.0})
    for step in range(9):
        (run.weights / f"step_{step}").mkdir()
        (run.weights / f"step_{step}" / MARKER).write_text("{}")
    with open(run.metrics / "trainer.jsonl", "a") as f:
        f.write('{"component": "trainer", "st')  # a writer killed mid-line
    trainer_part(run, 3)
    trainer_part(run, 6)
    trainer_part(run, 7, complete=False)
    (run.root / "DONE").write_text("{}")
    (run.root / "PREEMPT").write_text("{}")
    return run


def test_rewind_to_the_newest_complete_checkpoint(tmp_path):
    run = make_history(tmp_path)
    plan = rewind(run)
    assert (plan.step, plan.from_checkpoint) == (6, True)
    assert step_dirs(run.rollouts) == list(range(6))
    assert step_dirs(run.weights) == list(range(7))
    assert step_dirs(run.checkpoints) == [3, 6]
    lines = read_records(run)
    assert sorted({r["step"] for r in lines}) == list(range(6)) and len(lines) == 12
    assert not (run.root / "DONE").exists() and not (run.root / "PREEMPT").exists()
    assert "resuming from checkpoint step_6" in plan.describe()


def test_rewind_to_an_older_step_drops_the_abandoned_future(tmp_path):
    run = make_history(tmp_path)
    plan = rewind(run, step=3)
    assert plan.step == 3 and step_dirs(run.checkpoints) == [3] and step_dirs(run.weights) == [0, 1, 2, 3]
    with pytest.raises(RecipeError, match="step_5 .* is not complete .*complete: 3"):
        rewind(run, step=5)


def test_without_a_checkpoint_the_run_restarts_from_step_0(tmp_path):
    run = make_history(tmp_path)
    for step in (3, 6, 7):
        (run.checkpoints / f"step_{step}" / "trainer" / MARKER).unlink(missing_ok=True)
    plan = rewind(run)
    assert (plan.step, plan.from_checkpoint) == (0, False)
    assert "no complete checkpoint: restarting from step 0" in plan.describe()
    assert step_dirs(run.rollouts) == [] and step_dirs(run.weights) == [0] and step_dirs(run.checkpoints) == []
    assert read_records(run) == []


def test_resume_from_another_runs_checkpoint_takes_its_history(tmp_path):
    source = make_history(tmp_path / "a")
    target = RunDir(tmp_path / "b")
    target.create()
    plan = rewind(target, source=source.checkpoints / "step_3")
    assert plan.step == 3 and is_complete(target.checkpoints, 3)
    assert sorted({r["step"] for r in read_records(target)}) == [0, 1, 2]
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        rewind(target, source=source.checkpoints / "step_7")


def test_requeued_job_records_the_next_attempt(tmp_path):
    run = make_history(tmp_path)
    atomic_write_json(run.manifest, {"name": "run", "attempt": 0, "job_id": "42", "attempts": [{"attempt": 0}]})
    requeue = [sys.executable, "-m", "rlctl.launchers.resume", "--run-dir", str(run.root), "--requeued", "1"]
    finished = subprocess.run(requeue, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 3 and "already finished" in finished.stderr  # DONE: never rewound
    assert run.done.exists() and (run.weights / "step_8").exists()
    run.done.unlink()  # a preempted run has no DONE
    out = subprocess.run(requeue, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "6" and "resuming from checkpoint step_6" in out.stderr
    manifest = run.read_manifest()
    assert manifest["attempt"] == 1
    assert manifest["attempts"][-1] == {"attempt": 1, "job_id": "42", "requeued": True, "resume_step": 6}
    assert (run.logs / "latest").resolve().name == "attempt_1"


def test_sbatch_script_requeues_and_resumes(tmp_path):
    out = subprocess.run([*RLCTL, "launch", str(REPO / "recipes" / "smoke.toml"), "--cluster", "vslurm", "--dry-run",
                          "-o", f"deployment.output_dir={tmp_path}", "-o", "deployment.max_restarts=2",
                          "-o", "deployment.preempt_signal_s=90", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    script = Path(json.loads(out.stdout)["script"]).read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR2@90", "MAX_RESTARTS=2", "trap 'preempt usr2' USR2",
                 "-m rlctl.launchers.resume", 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script, line
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    none = subprocess.run([*RLCTL, "launch", str(REPO / "recipes" / "smoke.toml"), "--cluster", "vslurm", "--dry-run",
                           "-o", f"deployment.output_dir={tmp_path}", "-o", "deployment.max_restarts=0", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert "#SBATCH --requeue" not in Path(json.loads(none.stdout)["script"]).read_text()


def test_resume_refuses_a_running_run_and_bad_input(tmp_path):
    run = make_history(tmp_path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        atomic_write_json(run.manifest, {"name": "run", "scheduler": "local", "attempt": 0, "recipe": {}})
        run.status.mkdir(exist_ok=True)
        atomic_write_json(run.root / "status" / "supervisor.json",
                          {"pid": sleeper.pid, "state": "running", "returncode": None, "time": time.time()})
        out = subprocess.run([*RLCTL, "resume", str(run.root)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "is still" in out.stderr and "rlctl cancel" in out.stderr, out.stderr
        assert step_dirs(run.rollouts) == list(range(8))  # nothing was touched
    finally:
        sleeper.kill()
        sleeper.wait()
    out = subprocess.run([*RLCTL, "resume", str(run.root), "--step", "3", "--from", "x"], capture_output=True, text=True)
    assert out.returncode == 2 and "exclude each other" in out.stderr and "Traceback" not in out.stderr


def test_a_dry_run_of_a_resume_leaves_the_run_as_it_was(tmp_path):
    launch = [*RLCTL, "launch", str(REPO / "recipes" / "tiny-cpu.toml"), "--dry-run", "--name", "dr",
              "-o", f"deployment.output_dir={tmp_path}"]
    assert subprocess.run(launch, capture_output=True, text=True, timeout=60).returncode == 0
    run = tmp_path / "dr"

    def files() -> dict:
        return {str(p.relative_to(run)): p.read_bytes() if p.is_file() else None for p in sorted(run.rglob("*"))}

    before = files()
    out = subprocess.run([*launch, "--resume", "-o", "trainer.optimizer.lr=1e-3"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "nothing written or started; attempt 1: no complete checkpoint" in out.stdout, out.stdout
    assert files() == before  # not the manifest, the configs, nor a log folder of an attempt that never ran


def test_a_finished_run_is_resumed_only_to_train_further(tmp_path):
    from rlctl.launchers.resume import refuse_if_finished

    run = make_history(tmp_path)  # has DONE
    previous = {"recipe": {"orchestrator": {"max_steps": 8}}}
    with pytest.raises(RecipeError, match="already finished its 8 steps.*orchestrator.max_steps=N"):
        refuse_if_finished(run, previous, 8)
    refuse_if_finished(run, previous, 12)  # more steps: continues from the newest checkpoint
    run.done.unlink()
    refuse_if_finished(run, previous, 8)  # preempted after its last step: nothing finished


def test_a_resume_onto_a_changed_dataset_is_refused_before_anything_is_pruned(tmp_path, monkeypatch):
    """The orchestrator refused the saved cursor at start, after the rewind had removed weights,
    checkpoints and metrics lines of the steps after the checkpoint."""
    from typer.testing import CliRunner

    import rlctl.launchers.local as local
    from rlctl.cli.main import app
    from rlctl.launchers.launch import load_for_launch
    from rlctl.orchestrator.datasets import Cursor
    from rlctl.orchestrator.dataset_environment import train_split

    data = tmp_path / "rows.jsonl"
    rows = (REPO / "recipes" / "data" / "tiny-sequences.jsonl").read_text()
    data.write_text(rows)
    runner = CliRunner()
    r = runner.invoke(app, ["launch", str(REPO / "recipes" / "tiny-dataset-cpu.toml"), "--dry-run", "--name", "ds",
                            "-o", f"deployment.output_dir={tmp_path}", "-o", f"orchestrator.dataset.path={data}"])
    assert r.exit_code == 0, r.output
    run = RunDir(tmp_path / "ds")
    recipe = load_for_launch([str(run.recipe_toml)])[0]
    seed, train, _ = train_split(recipe.orchestrator.dataset, recipe.orchestrator.seed)
    cursor = Cursor(len(train), seed)
    for step in range(5):
        (run.weights / f"step_{step}").mkdir(parents=True)
        (run.weights / f"step_{step}" / MARKER).write_text("{}")
        append_record(run, "orchestrator", {"component": "orchestrator", "step": step, "reward_mean": 0.1})
        cursor.next()
        if step in (2, 4):
            trainer_part(run, step)
            save_orchestrator_state(run.checkpoints, step, {"rng": random.Random(step).getstate(),
                                                            "environment": {"cursor": cursor.state_dict()},
                                                            "counters": {}})
    started = []
    monkeypatch.setattr(local, "start_supervisor", lambda *a, **k: started.append(a) or 999_999)
    data.write_text(rows + '{"prompt": "abc", "answer": "de"}\n' * 3)

    def snapshot() -> dict:
        return {str(p.relative_to(run.root)): p.read_bytes() for p in sorted(run.root.rglob("*")) if p.is_file()}

    before = snapshot()
    r = runner.invoke(app, ["resume", str(run.root), "--step", "2"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert f"orchestrator.dataset.path: the saved dataset cursor is for {len(train)} rows" in lines[0], lines[0]
    assert snapshot() == before and not started  # nothing pruned, nothing started
    data.write_text(rows)  # the data it was trained on: resumed (the check refuses only what changed)
    r = runner.invoke(app, ["resume", str(run.root), "--step", "2"])
    assert r.exit_code == 0 and len(started) == 1, r.output
    assert step_dirs(run.checkpoints) == [2] and step_dirs(run.weights) == [0, 1, 2]
