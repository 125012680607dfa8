"""Shared fixtures: the virtual Slurm cluster (tests/slurm/cluster.sh) for `@pytest.mark.slurm` tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

CLUSTER_SCRIPT = Path(__file__).parent / "slurm" / "cluster.sh"


@pytest.fixture(scope="session")
def vslurm():
    """Start (or reuse) the virtual cluster; yields its profile name. Skips only without root or
    apt-get, and never in CI (CI=true), where those tests must run. While Slurm tests run, a background
    thread keeps the scheduler awake (see _cluster_activity). A cluster this session started is stopped
    at its end (no daemon outlives the test run); one that was already running is left running."""
    reason = None
    if os.geteuid() != 0:
        reason = "the virtual Slurm cluster needs root (tests/slurm/cluster.sh installs packages, starts daemons)"
    elif shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        reason = "no apt-get to install Slurm for the virtual cluster"
    if reason:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the Slurm tests, but {reason}")
        pytest.skip(reason)
    out = subprocess.run(["bash", str(CLUSTER_SCRIPT)], capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh failed:\n{out.stdout}\n{out.stderr}")
    stop = threading.Event()
    ticker = threading.Thread(target=_cluster_activity, args=(stop,), daemon=True, name="vslurm-activity")
    ticker.start()
    yield "vslurm"
    stop.set()
    ticker.join(timeout=10)
    if "reusing the running cluster" not in out.stdout:
        subprocess.run(["bash", str(CLUSTER_SCRIPT.with_name("stop.sh"))], capture_output=True, timeout=120)


def _cluster_activity(stop: threading.Event, every_s: float = 2.0) -> None:
    """Stand in for a busy cluster's steady stream of state changes. Slurm's backfill scheduler (the
    only one that starts heterogeneous jobs) runs only after some job, node or partition changed; a
    requeued job whose BeginTime passes changes nothing, so on the otherwise idle virtual cluster it
    sat PENDING for 80-170 s after every requeue. A no-op partition update every few seconds is such
    a change (the node-down drill: 195 s -> 36 s)."""
    while not stop.wait(every_s):
        subprocess.run(["scontrol", "update", "PartitionName=urgent", "State=UP"], capture_output=True, timeout=30)


@pytest.fixture
def slurm_jobs() -> list[str]:
    """Job ids a test submitted; whatever a failing test leaves running is cancelled."""
    jobs: list[str] = []
    yield jobs
    for job in jobs:
        subprocess.run(["scancel", job], capture_output=True)


@pytest.fixture
def cli():
    """`rlctl monitor`/`runs`/`logs` invoked in-process: cli("monitor", RUN, "--once") -> click Result."""
    import typer
    from typer.testing import CliRunner

    from rlctl.cli import monitor as monitor_cli

    app = typer.Typer()
    monitor_cli.register(app)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def tiny_cpu_run(tmp_path_factory):
    """One `rlctl launch recipes/tiny-cpu.toml --wait` on this machine, shared by the slow tests that
    need a finished tiny run (its end-to-end check, the planner's calibration): run, out, took."""
    from types import SimpleNamespace

    from e2e_checks import TINY, launch_waiting

    run, out, took = launch_waiting(tmp_path_factory.mktemp("tiny-cpu"), TINY, "e2e")
    return SimpleNamespace(run=run, out=out, took=took)


@pytest.fixture
def gc_threshold():
    """This test process's GC threshold, restored afterwards."""
    import gc

    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
