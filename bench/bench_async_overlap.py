"""Async overlap: steady-state step time of the real loop + gate + weight watcher vs the ideal.

Inference is the simulated streaming server (tests/sim_inference.py) with a capacity limit so one
batch takes `gen` seconds; the trainer is simulated by a thread that waits for `rollouts/step_N`
(the real `wait_for_batch` / `read_batch`), "trains" for `train` seconds and publishes
`weights/step_{N+1}` with its marker; the real WeightWatcher reloads the server in flight
(pause → reload → resume). With max_off_policy_steps = 1 batch N+1 is generated while batch N trains,
so the ideal period is max(gen, train); a synchronous loop would take gen + train. `gen` is measured
on the simulator itself (plain concurrent requests, no loop) because its sleeps drift slightly.

    python bench/bench_async_overlap.py [--gen 2.0 --train 2.0 --steps 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sim_inference import sim_server  # noqa: E402

from rlctl.orchestrator.exchange.steps import MARKER  # noqa: E402
from rlctl.orchestrator.environments import load_environment  # noqa: E402
from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop  # noqa: E402
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter, read_batch, wait_for_batch  # noqa: E402
from rlctl.orchestrator.weight_watcher import WeightWatcher, inference_reloader  # noqa: E402

TOKEN = "bench"


def publish(weights: Path, step: int) -> None:
    d = weights / f"step_{step}"
    d.mkdir(parents=True)
    (d / MARKER).write_text("{}")


def simulated_trainer(rollouts: Path, weights: Path, steps: int, train_s: float, stamps: list[float]) -> None:
    for step in range(steps):
        read_batch(wait_for_batch(rollouts, step, timeout=600))
        time.sleep(train_s)
        publish(weights, step + 1)
        stamps.append(time.monotonic())


async def measure_gen(url: str, groups: int, group_size: int, tokens: int) -> float:
    """The simulator's real time for one batch (its sleeps drift a little): median of 3 plain rounds."""
    import aiohttp

    body = {"model": "policy", "prompt": "abc", "n": group_size, "max_tokens": tokens, "stream": True}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    times = []
    async with aiohttp.ClientSession() as session:
        async def one():
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                async for _ in resp.content:
                    pass

        for _ in range(3):
            start = time.monotonic()
            await asyncio.gather(*(one() for _ in range(groups)))
            times.append(time.monotonic() - start)
    return statistics.median(times)


async def run_once(gen_s: float, train_s: float, steps: int, groups: int, group_size: int, tokens: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="rlctl-overlap-"))
    weights, rollouts = root / "weights", root / "rollouts"
    publish(weights, 0)
    stamps: list[float] = []
    settings = LoopSettings(rollouts_per_step=groups * group_size, group_size=group_size, max_tokens=tokens,
                            max_off_policy_steps=1, max_in_flight=2 * groups * group_size, max_steps=steps)
    with sim_server(token_delay=gen_s / tokens, token=TOKEN, max_concurrent=groups) as url:
        gen_actual = await measure_gen(url, groups, group_size, tokens)
        policy = PolicyVersion(0)
        loop = RolloutLoop(settings, load_environment("sequence"), url, TOKEN, policy, FilesystemBatchWriter(rollouts), rng=random.Random(0))
        reload, close = inference_reloader([url], TOKEN)
        watcher = WeightWatcher(weights, policy, reload)
        trainer = threading.Thread(target=simulated_trainer, args=(rollouts, weights, steps, train_s, stamps))
        trainer.start()
        watch = asyncio.create_task(watcher.run())
        try:
            await loop.run()
            await asyncio.to_thread(trainer.join)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await close()
    periods = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # skip the pipeline fill
    step = statistics.median(periods)
    ideal, sync = max(gen_actual, train_s), gen_actual + train_s
    return {"gen_s": gen_s, "gen_measured_s": round(gen_actual, 3), "train_s": train_s, "steady_step_s": round(step, 3), "ideal_s": round(ideal, 3), "sync_s": round(sync, 3),
            "ratio_vs_ideal": round(step / ideal, 3), "speedup_vs_sync": round(sync / step, 3),
            "reload_s_mean": round(statistics.mean(r["reload_s"] for r in watcher.reloads), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gen", type=float, nargs="*", default=[2.0, 1.0, 2.0])
    parser.add_argument("--train", type=float, nargs="*", default=[2.0, 2.0, 1.0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    results = [asyncio.run(run_once(g, t, args.steps, groups=16, group_size=8, tokens=20))
               for g, t in zip(args.gen, args.train)]
    for r in results:
        print(json.dumps(r))
    worst = max(r["ratio_vs_ideal"] for r in results)
    print(f"worst steady-state step / ideal max(gen, train): {worst:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
