"""Periodic evaluation of the current policy on the dataset's eval split, beside training.

An `Evaluator` is one asyncio task next to the rollout loop: it waits until the served policy reaches
the next multiple of `orchestrator.eval.interval`, sends every eval prompt through the router (at most
`eval.max_in_flight` requests at once, so rollouts keep most of the servers), scores the completions
with the environment's reward off the event loop, and appends an `EvalRecord`. Training never waits
for it. When the policy moved past several due versions during one evaluation, only the newest is
evaluated next. Weights may change while an evaluation runs (they are applied in flight): the record
names the version at the start (`step`) and at the end (`policy_version_end`).
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

import aiohttp

from rlctl.inference.client import policy_cache_salt
from rlctl.inference.server import SERVED_MODEL_NAME
from rlctl.orchestrator.completion_stream import streamed_choices
from rlctl.orchestrator.environments import Prompt
from rlctl.orchestrator.exchange.metrics import EvalRecord

REQUEST_RETRIES = 3


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples, `correct` of them
    correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def first_due(start_version: int, interval: int) -> int:
    """The first version >= `start_version` that is a multiple of `interval`."""
    return -(-start_version // interval) * interval


class Evaluator:
    def __init__(self, cfg, env, url: str, api_key: str | None, policy, max_tokens: int,
                 record: Callable[[EvalRecord], None], log: Callable[[str], None] = print,
                 start_version: int = 0, request_timeout_s: float = 3600.0, scorer=None):
        self.cfg = cfg
        self.env = env
        self.prompts: list[Prompt] = env.eval_prompts(cfg.max_prompts)
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.policy = policy
        self.max_tokens = cfg.max_tokens or max_tokens
        self.record = record
        self.log = log
        self.start_version = start_version
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.scorer = scorer  # a RewardScorer when `[orchestrator.reward] function` is set, else env.reward
        self.last_version: int | None = None  # newest version evaluated (or attempted)
        self._lock = asyncio.Lock()  # one evaluation at a time (the periodic one, or the final one)

    async def run(self) -> None:
        """Evaluate each due version until cancelled; a failed evaluation is logged, never raised."""
        due = first_due(self.start_version, self.cfg.interval)
        while True:
            await self.policy.wait_for(due)
            version = self.policy.version
            await self.evaluate_once(version)
            due = (version // self.cfg.interval + 1) * self.cfg.interval

    async def finish(self, final_version: int) -> None:
        """After training: let a running evaluation end, then evaluate the final policy (eval.at_end)."""
        if not self.cfg.at_end:
            async with self._lock:
                return
        await self.evaluate_once(final_version)

    async def evaluate_once(self, version: int) -> EvalRecord | None:
        async with self._lock:
            if self.last_version is not None and version <= self.last_version:
                return None
            self.last_version = version
            try:
                rec = await self.evaluate(version)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RuntimeError) as exc:
                self.log(f"eval of policy v{version} failed (training goes on): {type(exc).__name__}: {exc}")
                return None
            self.record(rec)
            self.log(f"eval policy v{version}: reward {rec.reward_mean:.3f}  pass@{rec.k} {rec.pass_at_k:.3f}  "
                     f"({rec.prompts} prompts x {rec.samples_per_prompt}, {rec.eval_time_s:.1f}s)")
            return rec

    async def evaluate(self, version: int) -> EvalRecord:
        start = time.monotonic()
        slots = asyncio.Semaphore(self.cfg.max_in_flight)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int, prompt: Prompt):
                async with slots:
                    return await self._complete(session, i, prompt, version)

            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(self.prompts)))
        items = [(p, texts) for p, (texts, _) in zip(self.prompts, results)]
        scores, errors = await (self._score_pooled(items) if self.scorer else asyncio.to_thread(self._score, items))
        n, k = self.cfg.samples_per_prompt, self.cfg.pass_k
        passes = [pass_at_k(n, sum(1 for s in per if s >= self.cfg.correct_threshold), k) for per in scores]
        flat = [s for per in scores for s in per]
        tokens = [t for _, counts in results for t in counts]
        return EvalRecord(step=version, reward_mean=sum(flat) / max(1, len(flat)),
                          pass_at_k=sum(passes) / max(1, len(passes)), k=k, prompts=len(self.prompts),
                          samples_per_prompt=n, temperature=self.cfg.temperature,
                          completion_tokens_mean=sum(tokens) / max(1, len(tokens)), reward_errors=errors,
                          eval_time_s=time.monotonic() - start, policy_version_end=self.policy.version)

    async def _score_pooled(self, items: list[tuple[Prompt, list[str]]]) -> tuple[list[list[float]], int]:
        """Through the reward scorer (process pool, timeouts); a failed call (None) scores 0 and is counted."""
        values = await asyncio.gather(*(self.scorer.score(p, t) for p, texts in items for t in texts))
        flat = iter(values)
        out = [[next(flat) for _ in texts] for _, texts in items]
        errors = sum(1 for per in out for v in per if v is None)
        return [[0.0 if v is None else float(v) for v in per] for per in out], errors

    def _score(self, items: list[tuple[Prompt, list[str]]]) -> tuple[list[list[float]], int]:
        """Rewards per prompt; one that raises scores 0 and is counted (it must not end the run)."""
        errors, out = 0, []
        for prompt, texts in items:
            row = []
            for text in texts:
                try:
                    value = float(self.env.reward(prompt, text))
                    row.append(value if math.isfinite(value) else 0.0)
                except Exception:  # noqa: BLE001 - a user's reward function may raise anything
                    errors += 1
                    row.append(0.0)
            out.append(row)
        return out, errors

    async def _complete(self, session: aiohttp.ClientSession, i: int, prompt: Prompt,
                        version: int) -> tuple[list[str], list[int]]:
        """(texts, completion token counts) of one prompt's samples, retried as a whole on errors."""
        for attempt in range(REQUEST_RETRIES + 1):
            try:
                return await self._stream(session, i, prompt, version)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                if attempt == REQUEST_RETRIES:
                    raise RuntimeError(f"eval prompt {i}: {type(exc).__name__}: {exc}") from exc
                await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt))
        raise AssertionError("unreachable")

    async def _stream(self, session, i: int, prompt: Prompt, version: int) -> tuple[list[str], list[int]]:
        n = self.cfg.samples_per_prompt
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt.text, "n": n, "max_tokens": self.max_tokens,
                "temperature": self.cfg.temperature, "top_p": 1.0, "return_token_ids": True, "stream": True,
                "cache_salt": policy_cache_salt(self.policy.version)}
        texts, counts, finished = [""] * n, [0] * n, [False] * n
        headers = {**self.headers, "X-Request-Id": f"rlctl-eval-v{version}-p{i}"}
        async with session.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=self.timeout) as resp:
            async for choice, _version, ids, _lps in streamed_choices(resp, None, logprobs=False):
                j = choice["index"]
                texts[j] += choice.get("text") or ""
                counts[j] += len(ids)
                finished[j] = finished[j] or bool(choice.get("finish_reason"))
        if not all(finished):
            raise ValueError("stream ended before every completion finished")
        return texts, counts
