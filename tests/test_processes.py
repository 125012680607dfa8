"""Stopping process groups and sessions (rlctl.inference.processes) and starting Python without the cwd.

The children here play the parts seen with vLLM: a server that ignores SIGTERM (vLLM swallows it during
start-up and ignores repeats while shutting down), a helper that ignores it by design (multiprocessing's
resource_tracker), and a server in a process group of its own inside its component's session.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlctl.inference.processes import exit_status, has_exited, members, python_module_argv, stop_process_group
from e2e_checks import running, wait_for

# A component: starts a "server" in its own process group (in the component's session) whose child ignores
# SIGTERM too, ignores SIGTERM itself, then prints the three pids. Each process prints only after its handler
# is set, so the test's SIGTERM can never arrive before it (it once did, and the component died of it).
COMPONENT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = subprocess.Popen([sys.executable, "-c", '''
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    helper = subprocess.Popen([sys.executable, "-c", "import os, signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print(os.getpid(), flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    print(int(helper.stdout.readline()), flush=True)
    time.sleep(600)
    '''], stdout=subprocess.PIPE, text=True, process_group=0)
    helper = int(server.stdout.readline())
    print(os.getpid(), server.pid, helper, flush=True)
    time.sleep(600)
""")


def start_component() -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", COMPONENT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3 and all(running(p) for p in pids)
    return proc, pids


def test_a_session_that_ignores_sigterm_is_killed_after_the_bound_with_every_group_in_it():
    proc, pids = start_component()
    started = time.monotonic()
    rc = stop_process_group(proc, 1.0)
    took = time.monotonic() - started
    assert rc == -signal.SIGKILL
    assert 1.0 <= took < 5.0, took
    assert not any(running(p) for p in pids)  # the server's own group and its helper too
    assert not members([proc.pid])[proc.pid]


def test_leftovers_of_an_exited_leader_are_killed_at_once():
    """A component SIGKILLed (the fault drills do it) leaves its server running: the session goes at once."""
    proc, (_, server, helper) = start_component()
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: has_exited(proc), 10, "the component to exit")
    assert exit_status(proc) == -signal.SIGKILL and proc.returncode is None  # seen, not reaped
    assert running(server) and running(helper)
    started = time.monotonic()
    assert stop_process_group(proc, 60.0) == -signal.SIGKILL
    assert time.monotonic() - started < 5.0  # no TERM phase for a leader that is gone
    assert not running(server) and not running(helper)


def test_a_child_that_stops_on_sigterm_is_not_killed():
    proc = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    proc.stdout.readline()
    assert stop_process_group(proc, 30.0) == -signal.SIGTERM


def test_a_reaped_leader_s_group_is_left_alone():
    """Once a leader is reaped its number may be a stranger's: nothing is signalled any more."""
    proc, (_, server, helper) = start_component()
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # reaped: the session number is no longer ours to use
        assert stop_process_group(proc, 0.1) == -signal.SIGKILL
        assert running(server) and running(helper)
    finally:
        for pid in (server, helper):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("version", [(3, 11), (3, 10)])
def test_module_runs_never_import_from_the_current_directory(tmp_path, version):
    """A planted `argparse.py` in the cwd is not what `python -m` imports, with -P or its stand-in."""
    marker = tmp_path / "imported"
    (tmp_path / "argparse.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    argv = python_module_argv("json.tool", sys.executable, version=version)
    out = subprocess.run([*argv, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr
    assert not marker.exists()
    # the plain form does import it: the check above can fail
    subprocess.run([sys.executable, "-m", "json.tool", "--help"], cwd=tmp_path, capture_output=True, timeout=60)
    assert marker.exists()


def test_has_exited_does_not_reap():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    wait_for(lambda: has_exited(proc), 30, "the child to exit")
    assert Path(f"/proc/{proc.pid}").exists()  # still a zombie: its pid is reserved
    assert exit_status(proc) == 3 and proc.wait() == 3


REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "recipes" / "smoke.toml")
# As the `rlctl` console script runs it: the CLI's own imports never come from the current directory.
RLCTL = [sys.executable, "-P", "-m", "rlctl.cli.main"]
LOCAL = ("--cluster", "local", "-o", "deployment.trainer_nodes=1", "-o", "trainer.fsdp=2")


def _plant_argparse(where: Path) -> Path:
    marker = where / "argparse-was-imported"
    (where / "argparse.py").write_text(f"import os\nopen({str(marker)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
                                       "raise ImportError('planted argparse.py')\n")
    return marker


@pytest.mark.slow
def test_local_run_under_umask_002_is_private_and_never_imports_from_the_launch_directory(tmp_path):
    launch_dir, out_dir = tmp_path / "cwd", tmp_path / "runs"
    launch_dir.mkdir()
    marker = _plant_argparse(launch_dir)
    out = subprocess.run([*RLCTL, "launch", SMOKE, *LOCAL, "-o", f"deployment.output_dir={out_dir}", "--json",
                          "--wait"], cwd=launch_dir, umask=0o002, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not marker.exists(), f"imported by pids {marker.read_text().split()}"
    run = next(out_dir.iterdir())
    assert (run / "smoke" / "trainer.1.json").exists()  # the components did run
    shared = []
    for folder, dirs, files in os.walk(run):
        for path in [Path(folder)] + [Path(folder) / f for f in files]:
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                shared.append(f"{oct(mode & 0o777)} {path.relative_to(run.parent)}")
    assert not shared, shared


def test_batch_script_runs_in_the_run_dir_with_python_minus_p(tmp_path):
    out = subprocess.run([*RLCTL, "launch", SMOKE, "--dry-run", "--json", "-o", f"deployment.output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    run = next(tmp_path.iterdir())
    script = next((run / "sbatch").iterdir()).read_text()
    assert f"#SBATCH --chdir={run}" in script
    assert all(" -P -u -m submitit.core._submit " in ln for ln in script.splitlines() if ln.startswith("srun "))
