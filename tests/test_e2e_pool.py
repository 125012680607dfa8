"""A shared inference pool end to end: `rlctl pool launch` one vLLM CPU server for full-weight runs of
tiny-qwen3, two tiny-cpu runs attached to it (`deployment.inference_pool`) take turns on it with
residency switches and both learn, a third run cancelled midway leaves them and the pool running, and
`rlctl pool stop` leaves nothing behind. One pool and one pair of runs, shared by every check."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from e2e_checks import RLCTL, learning_report, leftover_processes, metrics, wait_for

pytestmark = pytest.mark.slow
RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.toml")
POOL = "shared"
PAIR = ("left", "right")


def rlctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=timeout)


def pool_show(root: Path) -> dict:
    out = rlctl("pool", "show", POOL, "--root", str(root), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def launch_attached(root: Path, name: str, *overrides: str, wait: bool = True) -> subprocess.Popen:
    extra = [arg for o in overrides for arg in ("-o", o)]
    return subprocess.Popen([*RLCTL, "launch", RECIPE, "--name", name, "-o", f"deployment.output_dir={root}",
                             "-o", f"deployment.inference_pool={POOL}", *extra, *(["--wait"] if wait else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def pool_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    # with a host-RAM cache: a run's step is read when it publishes, its next switch reads no file
    started = rlctl("pool", "launch", RECIPE, "--name", POOL, "-o", f"deployment.output_dir={root}",
                    "-o", "inference.pool_host_cache_gib=1", "--json")
    assert started.returncode == 0, started.stderr
    try:
        wait_for(lambda: pool_show(root)["url"], 600, "the pool's front", 1.0)
        t0 = time.monotonic()
        pair = {name: launch_attached(root, name) for name in PAIR}
        # a third run, cancelled once it is served: the pair and the pool go on
        doomed = launch_attached(root, "doomed", "orchestrator.max_steps=500", wait=False)
        assert doomed.wait(timeout=120) == 0, doomed.stdout.read()
        wait_for(lambda: len(metrics(root / "doomed")[1]) >= 2, 600, "the cancelled run's first steps", 0.5)
        cancelled = rlctl("cancel", str(root / "doomed"))
        after_cancel = pool_show(root)
        monitored = rlctl("monitor", POOL, "--root", str(root), "--once")
        outs = {name: proc.communicate(timeout=1500)[0] for name, proc in pair.items()}
        took = time.monotonic() - t0
        finished = pool_show(root)
    finally:
        stopped = rlctl("pool", "stop", POOL, "--root", str(root))
    return SimpleNamespace(root=root, pair=pair, outs=outs, took=took, cancelled=cancelled,
                           after_cancel=after_cancel, monitored=monitored, finished=finished, stopped=stopped)


def test_both_runs_learn_on_the_shared_server(pool_runs):
    """Each run learns (from < 0.2 to a last-5 mean >= 0.7) and the pair ends >= 0.8 on average.

    Not each run >= 0.8: of 18 runs of this pair measured in a row, 17 ended (last 5 steps) at 0.98-0.99
    and one at 0.89, and one run of 12 in earlier suites ended at 0.78, with entropy left at 0.2-0.4: a
    prompt or two settled on a wrong digit, all 16 samples of its group scored the same, and the reward
    plateaued. A run alone (test_e2e_local.py, lag 1 step) has kept its 0.8 bar, and pure-torch replays
    of the recipe (bench/replay_tiny_recipe.py) end >= 0.86 in 100 of 100 seeds; with the pair's lag
    (half of every other batch from the current policy) one of 100 fell to 0.74 at the end. So the
    pool's timing may make a bad ending likelier; the plateaued runs' mismatch_kl stayed at one step's
    size (no sign of wrong weights served). A pool that broke learning (another run's weights served, a
    switch losing an update) fails both bars."""
    endings, reports = {}, {}
    for name in PAIR:
        assert pool_runs.pair[name].returncode == 0, pool_runs.outs[name]
        trainer, orch = metrics(pool_runs.root / name)
        rewards = [r["reward_mean"] for r in orch]
        assert len(rewards) == 80 and rewards[0] < 0.2, rewards[:5]
        endings[name], reports[name] = sum(rewards[-5:]) / 5, learning_report(trainer, orch)
        assert endings[name] >= 0.7, f"{name} did not end >= 0.7:\n{reports[name]}"
    why = "\n".join(f"{n}:\n{r}" for n, r in reports.items())
    assert sum(endings.values()) / len(PAIR) >= 0.8, f"the pair did not end >= 0.8 on average {endings}:\n{why}"
    stats = pool_runs.finished["stats"]
    print(f"pool pair: {pool_runs.took:.0f}s wall for both, {stats['switches']} residency switches "
          f"({stats['switch_s']:.1f}s, {stats['switches_from_host']} from host RAM), pool idle "
          f"{stats['idle_fraction']:.0%}")


def test_they_took_turns_with_residency_switches(pool_runs):
    stats = pool_runs.finished["stats"]
    assert stats["mode"] == "full" and stats["switches"] >= 2, stats
    assert stats["switches_from_host"] >= 1, stats  # staged when the other run held the server
    assert not stats["runs"], "finished runs detach from the pool"


def test_monitor_shows_each_runs_share_and_queue(pool_runs):
    out = pool_runs.monitored
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert f"pool {POOL} running full runs of tiny-qwen3" in text and "residency switches" in text, text
    for name in PAIR:  # one row each: share, requests, queued, waited, the weights it is served with
        assert re.search(rf"{name} \d+% \d+ \d+ [\d.]+ s (step_\d+|base model)", text), text


def test_cancelling_one_run_leaves_the_others_and_the_pool(pool_runs):
    assert pool_runs.cancelled.returncode == 0, pool_runs.cancelled.stderr
    assert pool_runs.after_cancel["state"] == "running"
    assert pool_runs.finished["state"] == "running" and pool_runs.finished["url"]


def test_stop_leaves_nothing_behind(pool_runs):
    assert pool_runs.stopped.returncode == 0, pool_runs.stopped.stderr
    assert f"cancelled local pool {POOL} " in pool_runs.stopped.stdout, pool_runs.stopped.stdout
    assert pool_show(pool_runs.root)["state"] == "cancelled"
    pool_dir = pool_runs.root / "pools" / POOL
    for run in (pool_dir, *(pool_runs.root / n for n in (*PAIR, "doomed"))):
        assert not leftover_processes(run), leftover_processes(run)
