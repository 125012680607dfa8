"""`python -m rlctl.orchestrator` end to end without vLLM: the real vllm-router in front of the simulated
streaming server, a simulated trainer publishing weights; checks DONE, metrics keys, batches, cleanup."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sim_inference import fetch_stats, sim_server

from rlctl.orchestrator.exchange.metrics import read_records
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.orchestrator.exchange.steps import MARKER
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.batches_fs import read_batch, wait_for_batch
from rlctl.recipes.load import load_recipe

ORCH_KEYS = {"component", "step", "time", "reward_mean", "orchestrator_step_time_s", "wait_policy_s", "rollouts_per_s",
             "tokens_per_s", "off_policy_lag_mean", "off_policy_lag_max", "dropped_groups", "weight_reload_s",
             "policy_version"}


def simulated_trainer(run: RunDir, steps: int, stop: threading.Event) -> None:
    for step in range(steps):
        folder = wait_for_batch(run.rollouts, step, timeout=120, stop_file=run.root / "DONE")
        if folder is None or stop.is_set():
            return
        read_batch(folder)
        out = run.weights / f"step_{step + 1}"
        out.mkdir(parents=True)
        (out / MARKER).write_text("{}")


@pytest.mark.skipif(shutil.which("vllm-router", path=os.path.dirname(sys.executable)) is None
                    and shutil.which("vllm-router") is None, reason="vllm-router is not installed")
def test_orchestrator_runs_to_done_through_the_real_router(tmp_path):
    steps = 4
    recipe = load_recipe([str(Path(__file__).parents[1] / "recipes" / "tiny-cpu.toml")],
                         [f"orchestrator.max_steps={steps}", "orchestrator.rollouts_per_step=32",
                          "orchestrator.group_size=8", "orchestrator.max_tokens=4"])
    run = RunDir(tmp_path / "run")
    run.create()
    (run.configs / "recipe.json").write_text(json.dumps(recipe.model_dump(mode="json")))
    placement = Placement(1, 1, 2, 1, 0, "inference_node")
    (run.configs / "placement.json").write_text(json.dumps(placement.to_dict()))
    token, api_key = run.admin_token(create=True), run.api_key(create=True)
    (run.weights / "step_0").mkdir(parents=True)
    (run.weights / "step_0" / MARKER).write_text("{}")
    with sim_server(token_delay=0.01, token=token, api_key=api_key) as url:
        run.announce("inference", "0", {"url": url, "index": 0, "pid": 0, "host": "127.0.0.1"})
        stop = threading.Event()
        trainer = threading.Thread(target=simulated_trainer, args=(run, steps, stop), daemon=True)
        trainer.start()
        env = {**os.environ, "RLCTL_ATTEMPT": "1", "RLCTL_BIND_HOST": "127.0.0.1"}
        proc = subprocess.run([sys.executable, "-m", "rlctl.orchestrator", "--run-dir", str(run.root)], env=env,
                              capture_output=True, text=True, timeout=180)
        stop.set()
        stats = fetch_stats(url)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (run.root / "DONE").exists()
    assert f"step {steps}/{steps}" in proc.stdout
    lines = read_records(run)
    assert [x["step"] for x in lines] == list(range(steps))
    for x in lines:
        assert ORCH_KEYS <= set(x), ORCH_KEYS - set(x)
    assert stats["version"] == steps  # every published step was reloaded in place on the server
    assert len(stats["completed"]) >= steps * 4  # 4 groups per batch went through the router
    for step in range(steps):
        tensors, meta = read_batch(run.rollouts / f"step_{step}")
        assert tensors["input_ids"].shape[0] == 32
    router = run.announced("router")[0]
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(router["pid"], 0)  # the router was stopped


def test_the_rollout_loop_runs_its_gc_at_the_larger_threshold(gc_threshold):
    import asyncio
    import gc

    from rlctl.inference.processes import GC_YOUNG_THRESHOLD
    from rlctl.orchestrator.__main__ import _run_loop

    async def threshold_inside():
        seen.append(gc.get_threshold()[0])

    seen, policy = [], asyncio.get_event_loop_policy()
    gc.set_threshold(700, 10, 10)
    try:
        _run_loop(threshold_inside())
    finally:
        asyncio.set_event_loop_policy(policy)  # _run_loop installs uvloop's
    assert seen == [GC_YOUNG_THRESHOLD]
