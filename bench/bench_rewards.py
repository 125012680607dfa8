"""Rewards must not serialise the rollout loop: throughput with a 50 ms-per-call reward vs an instant one.

The real RolloutLoop runs against a fake OpenAI-compatible `/v1/completions` server in the same
process (streamed, vLLM's fields) with a capacity model: at most `--slots` requests generate at once,
each streaming `--max-tokens` tokens `--token-delay` s apart, so a 512-rollout step takes a few seconds
of "inference". The trainer is absent (no off-policy gate: max_off_policy_steps = steps). Rewards:

- instant: the environment's inline reward (what the built-in environments use);
- pool: a synchronous reward that takes `--reward-ms` (it waits, like a judge or a program under
  test), run in the reward worker pool (`--workers` processes);
- async: the same delay as an `async def` reward, awaited on the event loop;
- inline (the old behaviour, `--inline-steps`, 0 to skip): the synchronous reward called on the loop,
  which serialises everything behind it.

Throughput = rollouts / wall time of the steps (pool start-up excluded). Acceptance: pool and async ≥ 0.8×.

    python bench/bench_rewards.py [--rollouts 512 --group 16 --steps 3 --workers 16 --reward-ms 50]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # reward workers import this module by name


def reward_wait(prompt, text: str, *, ms: float = 50.0) -> float:
    time.sleep(ms / 1000)
    return float(text.count("a")) / max(1, len(text))


def reward_wait_inline(prompt, text: str, *, ms: float = 50.0) -> float:
    return reward_wait(prompt, text, ms=ms)


reward_wait_inline.reward_inline = True  # the old behaviour: called on the event loop


async def reward_wait_async(prompt, text: str, *, ms: float = 50.0) -> float:
    await asyncio.sleep(ms / 1000)
    return float(text.count("a")) / max(1, len(text))


def fake_server(slots: int, token_delay: float):
    """aiohttp app: streamed completions, `n` choices per request, at most `slots` requests at once."""
    from aiohttp import web

    gate = asyncio.Semaphore(slots)

    async def completions(request):
        body = await request.json()
        n, max_tokens = int(body.get("n", 1)), int(body["max_tokens"])
        prompt_ids = [5 + ord(c) % 40 for c in str(body["prompt"])] or [1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async with gate:
            for step in range(max_tokens):
                await asyncio.sleep(token_delay)
                events = []
                for i in range(n):
                    choice = {"index": i, "text": "ab"[(i + step) % 2], "token_ids": [7 + (i + step) % 2],
                              "logprobs": {"token_logprobs": [-0.5]},
                              "finish_reason": "length" if step == max_tokens - 1 else None}
                    if step == 0:
                        choice["prompt_token_ids"] = prompt_ids
                    events.append(f"data: {json.dumps({'choices': [choice]})}\n\n")
                await resp.write("".join(events).encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


class NullWriter:
    def write(self, step, tensors, meta):
        pass


async def measure(args, steps: int, scorer) -> float:
    """Rollouts per second of `steps` batches with `scorer` (None: the environment's inline reward)."""
    import random

    from aiohttp import web

    from rlctl.orchestrator.environments import load_environment
    from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop

    runner = web.AppRunner(fake_server(args.slots, args.token_delay))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    settings = LoopSettings(rollouts_per_step=args.rollouts, group_size=args.group, max_tokens=args.max_tokens,
                            max_off_policy_steps=steps, max_in_flight=0, max_steps=steps)
    env = load_environment("count_a")
    if scorer is not None:
        await scorer.start()
    loop = RolloutLoop(settings, env, f"http://127.0.0.1:{port}", None, PolicyVersion(0), NullWriter(),
                       rng=random.Random(0), scorer=scorer)
    try:
        t0 = time.perf_counter()
        await loop.run()
        return steps * args.rollouts / (time.perf_counter() - t0)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    from rlctl.orchestrator.reward_config import RewardConfig
    from rlctl.orchestrator.rewards import RewardScorer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument("--slots", type=int, default=8, help="requests generating at once")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--reward-ms", type=float, default=50.0)
    parser.add_argument("--inline-steps", type=int, default=1, help="steps of the old inline path (0: skip)")
    args = parser.parse_args(argv)

    def scorer(function: str):
        cfg = RewardConfig(function=f"bench_rewards:{function}", args={"ms": args.reward_ms}, workers=args.workers)
        return RewardScorer.build(cfg, env=None)

    results = {"instant": asyncio.run(measure(args, args.steps, None))}
    results["pool"] = asyncio.run(measure(args, args.steps, scorer("reward_wait")))
    results["async"] = asyncio.run(measure(args, args.steps, scorer("reward_wait_async")))
    if args.inline_steps:
        results["inline (old)"] = asyncio.run(measure(args, args.inline_steps, scorer("reward_wait_inline")))
    print(f"{args.rollouts} rollouts/step (groups of {args.group}), {args.steps} steps, reward {args.reward_ms:g} ms/call, "
          f"{args.workers} reward workers; inference: {args.slots} requests at once x {args.max_tokens} tokens "
          f"x {args.token_delay * 1000:g} ms")
    for name, value in results.items():
        print(f"  {name:13s} {value:8.1f} rollouts/s   ratio to instant {value / results['instant']:.2f}")
    ok = min(results["pool"], results["async"]) >= 0.8 * results["instant"]
    print("PASS" if ok else "FAIL", "(pool and async >= 0.8x instant)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
