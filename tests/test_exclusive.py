"""Exclusive runs: one run lock (launch, resume, requeue, cancel), exclusive run directories, resume
that rewinds only once the new attempt is sure to start, `--from` checks, run names, one resolver."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_checks import running, wait_for
from rlctl.launchers.run_dirs import claim_run_dir
from rlctl.launchers.status import RunNotFound, resolve_run
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.lock import RunLock, RunLocked
from rlctl.orchestrator.exchange.steps import MARKER

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "recipes" / "smoke.toml")
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]
LOCAL = ("--cluster", "local", "-o", "deployment.trainer_nodes=1", "-o", "trainer.fsdp=2")
NOBODY = 65534
# Holds a run's lock as `rlctl resume` would, prints "held", then sleeps until killed.
HOLDER = ("import sys, time; from rlctl.orchestrator.exchange.lock import RunLock\n"
          "with RunLock(sys.argv[1], 'rlctl resume ' + sys.argv[2]):\n"
          "    print('held', flush=True); time.sleep(float(sys.argv[3]))\n")


def rlctl(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*RLCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def manifest(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def hold_lock(run: Path, seconds: float = 120) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run / "LOCK"), run.name, str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def local_run(tmp_path: Path, name: str, *extra: str) -> Path:
    """A local smoke run that runs until cancelled, then is cancelled: ended, ready to resume."""
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--name", name,
                "-o", "deployment.smoke.run_s=600", *extra)
    assert out.returncode == 0, out.stderr
    run = tmp_path / name
    wait_for(lambda: len(list((run / "smoke").glob("*.json"))) >= 4, 60, "the tasks to start")
    cancel = rlctl("cancel", str(run))
    assert cancel.returncode == 0 and "cancelled local run" in cancel.stdout, cancel.stderr
    return run


def supervisor_pid(run: Path) -> int | None:
    return json.loads((run / "status" / "supervisor.json").read_text()).get("pid")


def plant_history(run: RunDir, own_marker: str = "own") -> None:
    """Rollouts and weights of steps 0-4, a complete checkpoint 2 and a torn checkpoint 3."""
    for step in range(5):
        for parent in (run.rollouts, run.weights):
            (parent / f"step_{step}").mkdir(parents=True, exist_ok=True)
            (parent / f"step_{step}" / MARKER).write_text("{}")
    for step, complete in ((2, True), (3, False)):
        part = run.checkpoints / f"step_{step}" / "trainer"
        part.mkdir(parents=True, exist_ok=True)
        (part / "__0_0.distcp").write_text(own_marker)
        if complete:
            (part / MARKER).write_text("{}")
    run.done.write_text("{}")


def snapshot(run: RunDir) -> dict:
    """Every file under checkpoints/, weights/, rollouts/ with its content, plus DONE."""
    files = {str(p.relative_to(run.root)): p.read_text() for parent in (run.checkpoints, run.weights, run.rollouts)
             for p in sorted(parent.rglob("*")) if p.is_file()}
    return {**files, "DONE": run.done.exists(), "hidden": [p.name for p in run.checkpoints.glob(".*")]}


# ------------------------------------------------------------------------------------ the lock itself


def test_lock_is_exclusive_names_its_holder_and_is_released(tmp_path):
    path = tmp_path / "LOCK"
    with RunLock(path, "rlctl resume r1"):
        with pytest.raises(RunLocked) as err:
            RunLock(path, "rlctl cancel r1").acquire()
        line = str(err.value)
        assert "\n" not in line and "`rlctl resume r1`" in line and f"pid {os.getpid()}" in line
        assert f"host {socket.gethostname()}" in line and "since " in line
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp files left behind


def test_stale_lock_of_a_dead_pid_is_broken(tmp_path, capfd):
    path = tmp_path / "LOCK"
    dead = subprocess.Popen(["true"])
    dead.wait()
    record = {"host": socket.gethostname(), "pid": dead.pid, "start_ticks": 1, "command": "rlctl resume r1",
              "since": time.time(), "nonce": "abc"}
    path.write_text(json.dumps(record))
    with RunLock(path, "rlctl resume r1") as lock:
        assert json.loads(path.read_text())["nonce"] == lock.record["nonce"]
    assert f"broke the stale lock of `rlctl resume r1` (host {socket.gethostname()}, pid {dead.pid}" in capfd.readouterr().err


def test_lock_of_another_host_is_broken_only_when_old_and_the_run_is_not_active(tmp_path):
    path = tmp_path / "LOCK"
    record = {"host": "elsewhere", "pid": 1, "command": "rlctl launch", "nonce": "n1"}
    path.write_text(json.dumps({**record, "since": time.time() - 10}))
    with pytest.raises(RunLocked, match="host elsewhere"):
        RunLock(path, "x", active=lambda: False).acquire()  # young: its owner may be working
    path.write_text(json.dumps({**record, "since": time.time() - 7200}))
    with pytest.raises(RunLocked, match="host elsewhere"):
        RunLock(path, "x", active=lambda: True).acquire()  # old, but the run is active
    with RunLock(path, "x", active=lambda: False):
        pass
    assert not path.exists()


def test_a_requeued_job_breaks_the_lock_of_its_own_earlier_run(tmp_path, monkeypatch):
    path = tmp_path / "LOCK"
    path.write_text(json.dumps({"host": "dead-node", "pid": 7, "since": time.time(), "nonce": "n",
                                "slurm_job": "42", "slurm_restart": "0", "command": "requeue"}))
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunLocked):
        RunLock(path, "requeue").acquire()  # another job's lock
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with RunLock(path, "requeue"):
        pass


def test_release_never_removes_someone_elses_lock(tmp_path):
    path = tmp_path / "LOCK"
    lock = RunLock(path, "a").acquire()
    path.unlink()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": time.time(), "nonce": "theirs"}))
    lock.release()
    assert json.loads(path.read_text())["nonce"] == "theirs"


def test_the_requeue_path_waits_for_the_lock(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    (run.manifest).write_text(json.dumps({"name": "run", "attempt": 0, "job_id": "42", "attempts": []}))
    holder = hold_lock(run.root, seconds=3)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlctl.launchers.resume", "--run-dir", str(run.root),
                          "--requeued", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 > 2.0 and holder.wait(timeout=10) == 0
    assert manifest(run.root)["attempt"] == 1


# ------------------------------------------------------------------------------------ run names, run dirs


@pytest.mark.parametrize("bad", ["a\nb", "x%j", ".hidden", "a/b", "sp ace", "n" * 101])
def test_bad_run_names_exit_2_with_one_line(tmp_path, bad):
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--dry-run", "--name", bad)
    line = one_line(out.stderr)
    assert out.returncode == 2 and line.startswith("rlctl: error: --name: invalid run name")
    assert "letters, digits" in line and list(tmp_path.iterdir()) == []


def test_recipe_name_is_bounded_by_the_schema(tmp_path):
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--dry-run", "-o", "name=a%b")
    assert out.returncode == 2 and one_line(out.stderr).startswith("rlctl: error: name: ")


def test_run_dirs_are_created_exclusively(tmp_path):
    first, second = claim_run_dir(tmp_path, "smoke", None, "k"), claim_run_dir(tmp_path, "smoke", None, "k")
    assert first.root != second.root and first.root.parent == second.root.parent == tmp_path
    assert claim_run_dir(tmp_path, "smoke", "r1", "k") is not None
    assert claim_run_dir(tmp_path, "smoke", "r1", "k") is None
    assert oct(first.root.stat().st_mode & 0o777) == "0o700"


def test_two_launches_with_one_name_never_share_a_directory(tmp_path):
    args = ("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--dry-run", "--name", "same")
    procs = [start(*args) for _ in range(2)]
    outs = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in outs) == [0, 2], outs
    assert any("already exists" in err or "another launch is creating it" in err for _, err in outs)
    auto = [start("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path / 'auto'}", "--dry-run", "--json")
            for _ in range(3)]
    dirs = {json.loads(p.communicate(timeout=120)[0])["run_dir"] for p in auto}
    assert len(dirs) == 3


# ------------------------------------------------------------------------------------ one resolver


def fake_run(root: Path, name: str, owner: int | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"name": name, "scheduler": "local", "attempt": 0}))
    if owner is not None:
        os.chown(run, owner, owner)
    return run


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_resolver_never_picks_another_users_run_nor_guesses(tmp_path):
    mine = fake_run(tmp_path, "smoke-20250101-000000")
    fake_run(tmp_path, "smoke-20250102-000000", owner=NOBODY)  # newer, another user's
    assert resolve_run("smoke", tmp_path) == mine
    with pytest.raises(RunNotFound, match="belongs to another user"):
        resolve_run("smoke-20250102-000000", tmp_path)
    fake_run(tmp_path, "smoke-20250103-000000")
    with pytest.raises(RunNotFound, match="ambiguous .* 2 runs match"):
        resolve_run("smoke", tmp_path)
    out = rlctl("monitor", "smoke", "--once", "--json", env={"RLCTL_OUTPUT_DIR": str(tmp_path)})
    assert out.returncode == 2 and "ambiguous" in one_line(out.stderr)


def test_every_command_honours_rlctl_output_dir(tmp_path):
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    cwd.mkdir()
    env = {"RLCTL_OUTPUT_DIR": str(root)}
    out = rlctl("launch", SMOKE, *LOCAL, "--dry-run", "--name", "r1", env=env, cwd=cwd)
    assert out.returncode == 0 and (root / "r1" / "run.json").is_file() and not (cwd / "runs").exists(), out.stderr
    mon = rlctl("monitor", "r1", "--once", "--json", env=env, cwd=cwd)
    assert mon.returncode in (0, 1) and json.loads(mon.stdout)["run_dir"] == str(root / "r1"), mon.stderr
    logs = rlctl("logs", "r1", env=env, cwd=cwd)
    assert "no run.json" not in logs.stderr


# ------------------------------------------------------------------------------------ --from


def source_run(tmp_path: Path) -> RunDir:
    src = RunDir(tmp_path / "src")
    src.create()
    plant_history(src, own_marker="theirs")
    return src


def idle_target(tmp_path: Path) -> RunDir:
    """A run that was never started (dry run): resumable, nothing to stop."""
    out = rlctl("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--dry-run", "--name", "dst")
    assert out.returncode == 0, out.stderr
    target = RunDir(tmp_path / "dst")
    plant_history(target)
    return target


@pytest.mark.parametrize("how", ["group-writable", "other-user"])
def test_from_refuses_sources_others_could_have_altered(tmp_path, how):
    if how == "other-user" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    src, target = source_run(tmp_path), idle_target(tmp_path)
    shard = src.checkpoints / "step_2" / "trainer" / "__0_0.distcp"
    if how == "group-writable":
        shard.chmod(0o664)
    else:
        os.chown(shard, NOBODY, NOBODY)
    before = snapshot(target)
    out = rlctl("resume", str(target.root), "--from", str(src.checkpoints / "step_2"))
    line = one_line(out.stderr)
    assert out.returncode == 2 and line.startswith("rlctl: error: --from: ")
    assert ("writable by group or others" if how == "group-writable" else "belongs to another user") in line
    assert snapshot(target) == before


def test_from_finds_the_other_run_by_name_as_run_does(tmp_path):
    """`--from NAME/checkpoints/step_N` with no such path here: NAME is looked up under the output root."""
    src, target = source_run(tmp_path), idle_target(tmp_path)
    (src.checkpoints / "step_2" / "trainer" / "__0_0.distcp").chmod(0o664)  # refused once found: nothing starts
    (src.root / "run.json").write_text((target.root / "run.json").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"RLCTL_OUTPUT_DIR": str(tmp_path)}
    found = rlctl("resume", "dst", "--from", "src/checkpoints/step_2", env=env, cwd=elsewhere)
    assert found.returncode == 2 and "writable by group or others" in one_line(found.stderr), found.stderr
    unknown = rlctl("resume", "dst", "--from", "nope/checkpoints/step_2", env=env, cwd=elsewhere)
    assert unknown.returncode == 2 and "run 'nope'" in one_line(unknown.stderr), unknown.stderr


# ------------------------------------------------------------------------------------ local runs


@pytest.mark.slow
def test_two_concurrent_resumes_start_exactly_one_attempt(tmp_path):
    run = local_run(tmp_path, "r1")
    procs = [start("resume", str(run)) for _ in range(2)]
    outs = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    try:
        assert sorted(rc for rc, _, _ in outs) == [0, 1] or sorted(rc for rc, _, _ in outs) == [0, 2], outs
        loser = next(err for rc, _, err in outs if rc != 0)
        line = one_line(loser)
        assert ("is locked by `rlctl resume r1` (host" in line and "pid " in line) or "is still" in line, line
        assert [a["attempt"] for a in manifest(run)["attempts"]] == [0, 1]
        assert running(supervisor_pid(run))
    finally:
        rlctl("cancel", str(run))


@pytest.mark.slow
def test_a_held_lock_blocks_resume_launch_resume_and_cancel_until_its_holder_dies(tmp_path):
    run = local_run(tmp_path, "r1")
    before = manifest(run)
    holder = hold_lock(run)
    try:
        for args in (("resume", str(run)), ("cancel", str(run)),
                     ("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--name", "r1", "--resume")):
            out = rlctl(*args)
            line = one_line(out.stderr)
            assert out.returncode == 1 and f"is locked by `rlctl resume r1` (host {socket.gethostname()}, pid {holder.pid}" in line
            assert "not running" not in out.stdout
        assert manifest(run) == before
    finally:
        holder.kill()
        holder.wait()
    out = rlctl("resume", str(run))  # the holder died: its lock is stale and broken
    try:
        assert out.returncode == 0 and "broke the stale lock" in out.stderr, out.stderr
        assert manifest(run)["attempt"] == 1 and not (run / "LOCK").exists()
    finally:
        rlctl("cancel", str(run))


@pytest.mark.slow
def test_launch_resume_goes_through_the_checks_of_resume(tmp_path):
    run = local_run(tmp_path, "r1")
    args = ("launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={tmp_path}", "--name", "r1", "--resume",
            "-o", "deployment.smoke.run_s=600")
    first = rlctl(*args)
    try:
        assert first.returncode == 0, first.stderr
        pid = supervisor_pid(run)
        again = rlctl(*args)  # the run is active now: a second supervisor would write the same steps again
        assert again.returncode == 2 and "is still" in one_line(again.stderr)
        assert supervisor_pid(run) == pid and [a["attempt"] for a in manifest(run)["attempts"]] == [0, 1]
        assert "restarting from step 0" in first.stdout  # rewound like `rlctl resume`
        assert (run / "configs" / "recipe.toml").read_text().count("[deployment.smoke]") == 1  # composed once
    finally:
        rlctl("cancel", str(run))


# ------------------------------------------------------------------------------------ Slurm


@pytest.mark.slow
@pytest.mark.slurm
def test_a_refused_submission_during_resume_loses_nothing(vslurm, tmp_path, slurm_jobs):
    profile = tmp_path / "profile.yaml"
    profile.write_text((REPO / "recipes" / "profiles" / "vslurm.yaml").read_text())
    out = rlctl("launch", SMOKE, "-c", str(profile), "-o", f"deployment.output_dir={tmp_path}", "--name", "s1",
                "--wait", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    run = RunDir(tmp_path / "s1")
    first_job = manifest(run.root)["job_id"]
    slurm_jobs.append(first_job)
    plant_history(run)
    src = source_run(tmp_path)
    before = snapshot(run)
    profile.write_text(profile.read_text().replace("gpu: gpu", "gpu: nope"))  # sbatch refuses the next job
    finished = rlctl("resume", str(run.root))  # DONE: only an explicit checkpoint (or more steps) resumes it
    assert finished.returncode == 2 and "already finished" in one_line(finished.stderr)
    assert snapshot(run) == before
    for extra in (("--step", "2"), ("--from", str(src.checkpoints / "step_2"))):
        refused = rlctl("resume", str(run.root), *extra)
        assert refused.returncode == 2 and "sbatch refused the job: invalid partition" in one_line(refused.stderr)
        assert snapshot(run) == before  # checkpoints, weights, rollouts, DONE untouched; no staged copy left
        info = manifest(run.root)
        assert info["attempt"] == 0 and info["job_id"] == first_job and len(info["attempts"]) == 1
    profile.write_text(profile.read_text().replace("gpu: nope", "gpu: gpu"))
    ok = rlctl("resume", str(run.root), "--step", "2", "--wait", "--json", timeout=300)  # held, rewound, released
    assert ok.returncode == 0, ok.stderr
    slurm_jobs.append(manifest(run.root)["job_id"])
    assert sorted(p.name for p in run.rollouts.glob("step_*")) == ["step_0", "step_1"]
    assert sorted(p.name for p in run.checkpoints.glob("step_*")) == ["step_2"]
    assert manifest(run.root)["attempts"][-1]["resume_step"] == 2 and manifest(run.root)["attempt"] == 1
