"""The asynchronous rollout loop: dispatch groups through the router, collect, filter, write batches.

One request per group (`n = group_size`, streamed), so a group's completions share a prompt prefix on
one server. Three cooperating pieces run on one asyncio loop:

- the *dispatcher* starts groups as long as (a) fewer than `max_in_flight` rollouts are in flight and
  (b) the policy gate allows the batch the group would fill: batch N may start only once the served
  policy version is >= N - max_off_policy_steps ("time waiting for the policy"). Because of (b) at most
  `max_off_policy_steps + 1` batches of finished groups can wait in the queue: memory stays bounded
  however slow the trainer or the backend is;
- each *group task* streams its completions and tags every received token with the policy version
  current when it arrived. The weight watcher bumps the version only after all servers reloaded, so a
  token generated just after a reload may be tagged one version too old (safe for the off-policy bound);
  tagging one too new would need a chunk generated before the reload to reach us after the reload and
  the bump, i.e. to stay in transit longer than a whole reload round — we accept that. With chunks of
  several tokens (`stream_interval` > 1) a chunk sent after a reload can hold tokens generated before
  it, so its tokens take the version current when the choice's previous chunk arrived (the version at
  send time for the first): every token of it was generated after that chunk left the server;
- the *collector* takes finished groups in completion order, drops those whose oldest token is older
  than N - max_off_policy_steps (the dispatcher replaces each dropped group), computes group-relative
  advantages and writes `rollouts/step_N` atomically.

Multi-turn environments (`MultiTurnEnvironment`) run `group_size` trajectories per group instead: their
first turns in one request with n = group_size, each later turn one request with the token ids so far
(trajectory.py); environment tokens get loss mask 0 and no
policy version, so the off-policy bound and the lag metrics see the trajectory's oldest *generated* token.

Every group is either written exactly once or counted as dropped; failed requests are retried as a
whole group (partial streams are discarded), so no rollout is lost or duplicated.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from rlctl.orchestrator.advantages import group_advantages, is_stale, min_policy_version
from rlctl.orchestrator.batch import Group, Rollout, build_batch_tensors
from rlctl.orchestrator.environments import Environment, MultiTurnEnvironment, Prompt
from rlctl.orchestrator.trajectory import Budget, SharedTurns, TokenClient
from rlctl.orchestrator.completion_stream import raise_for_status, streamed_choices
from rlctl.orchestrator.rewards import RewardScorer
from rlctl.inference.client import SAMPLED_LOGPROBS, policy_cache_salt
from rlctl.inference.server import SERVED_MODEL_NAME
from rlctl.orchestrator.exchange.batches import BatchWriter


class PolicyVersion:
    """The policy version the inference servers currently serve, with a waiter for "at least v"."""

    def __init__(self, version: int = 0):
        self.version = version
        self.changed_at = time.monotonic()
        self._cond = asyncio.Condition()

    async def set(self, version: int) -> None:
        async with self._cond:
            self.version = version
            self.changed_at = time.monotonic()
            self._cond.notify_all()

    async def wait_for(self, version: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.version >= version)


@dataclass
class LoopSettings:
    rollouts_per_step: int
    group_size: int
    max_tokens: int
    max_off_policy_steps: int
    max_in_flight: int  # rollouts; 0 = 2 × rollouts_per_step
    temperature: float = 1.0
    start_step: int = 0
    max_steps: int = 1
    normalize_std: bool = False
    request_retries: int = 3
    request_timeout_s: float = 3600.0
    stream_interval: int = 1  # tokens per streamed chunk (orchestrator.stream_interval)
    routed_experts: bool = False  # router replay: keep the experts inference routed each token to
    max_turns: int = 1  # multi-turn environments: generated turns per trajectory
    max_trajectory_tokens: int | None = None  # tokens after the prompt; None = max_turns × max_tokens
    context_tokens: int | None = None  # the servers' max_model_len: multi-turn contexts end there

    @classmethod
    def from_config(cls, cfg, start_step: int = 0, context_tokens: int | None = None) -> "LoopSettings":
        return cls(cfg.rollouts_per_step, cfg.group_size, cfg.max_tokens, cfg.max_off_policy_steps, cfg.max_in_flight,
                   cfg.temperature, start_step, cfg.max_steps, cfg.normalize_advantages,
                   request_timeout_s=cfg.request_timeout_s, stream_interval=cfg.stream_interval, max_turns=cfg.max_turns,
                   max_trajectory_tokens=cfg.max_trajectory_tokens, context_tokens=context_tokens)

    @property
    def budget(self) -> Budget:
        return Budget(self.max_turns, self.max_tokens, self.max_trajectory_tokens or self.max_turns * self.max_tokens,
                      self.context_tokens)

    @property
    def groups_per_step(self) -> int:
        return self.rollouts_per_step // self.group_size

    @property
    def max_groups_in_flight(self) -> int:
        cap = self.max_in_flight or 2 * self.rollouts_per_step
        return max(1, cap // self.group_size)


@dataclass
class StepStats:
    """What the collector measured for one batch (becomes the orchestrator's metrics line)."""

    step: int
    start: float = 0.0
    gate_open: float | None = None
    dropped_groups: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutLoop:
    def __init__(self, settings: LoopSettings, env: Environment, url: str, api_key: str | None,
                 policy: PolicyVersion, batches: BatchWriter, rng: random.Random | None = None,
                 on_batch: Callable[[int, list[Group], dict], None] | None = None,
                 before_write: Callable[[int, dict[str, Any]], None] | None = None,
                 scorer: RewardScorer | None = None):
        self.s = settings
        self.env = env
        self.url = url.rstrip("/")
        # Only the api key travels through the router: it opens /v1 on the servers and nothing else.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.policy = policy
        self.batches = batches
        self.rng = rng or random.Random(0)
        self.on_batch = on_batch
        self.before_write = before_write  # (step, progress_state(step + 1)) before batch `step` is written
        self.scorer = scorer or RewardScorer.build(None, env)  # default: the environment's reward, inline
        self._rng_at: dict[int, tuple] = {}  # sampler state before the first group of each batch
        self._env_at: dict[int, dict] = {}  # environment state at the same point
        self.end_step = settings.start_step + settings.max_steps
        self.started = 0  # groups dispatched
        self.dropped = 0  # groups dropped as stale (each one is replaced)
        self.dropped_ids: list[int] = []
        self.in_flight = 0  # rollouts currently streaming
        self.peak_in_flight = 0
        self.peak_queued = 0
        self.completed_tokens = 0
        self.retries = 0
        self._queue: asyncio.Queue[Group] = asyncio.Queue()
        self._wake = asyncio.Event()  # dispatcher re-checks its budget (a drop or a finished group)
        self._gate_open: dict[int, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._token_cache: dict[str, list[int]] = {}  # environment text -> the server's token ids

    # ---- dispatcher ------------------------------------------------------------------------------
    def _target_batch(self) -> int:
        """The batch the next dispatched group is expected to fill (dropped groups are replaced)."""
        return self.s.start_step + (self.started - self.dropped) // self.s.groups_per_step

    async def _dispatch(self, session: aiohttp.ClientSession) -> None:
        G = self.s.group_size
        while True:
            self._wake.clear()  # cleared before the checks below, so no wake-up is lost
            batch = self._target_batch()
            if batch >= self.end_step or self.in_flight + G > self.s.max_groups_in_flight * G:
                await self._wake.wait()
                continue
            need = min_policy_version(batch, self.s.max_off_policy_steps)
            if self.policy.version < need:
                # Also wake on a drop: its replacement belongs to an earlier, already allowed batch.
                waiters = {asyncio.ensure_future(self.policy.wait_for(need)), asyncio.ensure_future(self._wake.wait())}
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
                continue
            self._gate_open.setdefault(batch, time.monotonic())
            if batch not in self._rng_at:  # the prompt stream's position where this batch begins
                self._rng_at[batch] = self.rng.getstate()
                self._env_at[batch] = self.env.state_dict()  # e.g. a dataset cursor, taken at the same point
            prompt = self.env.sample_prompts(self.rng, 1)[0]
            group_id = self.started
            self.started += 1
            self.in_flight += G
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            task = asyncio.create_task(self._run_group(session, group_id, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self._queue.put_nowait(None)  # wake the collector so it can raise

    # ---- one group -------------------------------------------------------------------------------
    async def _run_group(self, session: aiohttp.ClientSession, group_id: int, prompt: Prompt) -> None:
        try:
            for attempt in range(self.s.request_retries + 1):
                try:
                    if isinstance(self.env, MultiTurnEnvironment):
                        rollouts = await self._trajectories(session, group_id, prompt)
                    else:
                        rollouts = await self._stream(session, group_id, prompt)
                    break
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    if attempt == self.s.request_retries:
                        raise RuntimeError(f"group {group_id}: request to {self.url} failed "
                                           f"{attempt + 1} times, last: {type(exc).__name__}: {exc}") from exc
                    self.retries += 1
                    await asyncio.sleep(min(5.0, 0.2 * 2 ** attempt))
            self.completed_tokens += sum(len(r.completion_ids) for r in rollouts)
            rewards = await self.scorer.score_group(prompt, [r.text for r in rollouts])
            if rewards is None:  # a reward failed, on_failure = "drop_group": replaced like a stale group
                self.dropped += 1
                return
            for r, reward in zip(rollouts, rewards):
                r.reward = reward
            self._queue.put_nowait(Group(group_id, prompt, rollouts))
            self.peak_queued = max(self.peak_queued, self._queue.qsize())
        finally:
            self.in_flight -= self.s.group_size
            self._wake.set()

    def _post_completions(self, session: aiohttp.ClientSession, body: dict, group_id: int):
        timeout = aiohttp.ClientTimeout(total=self.s.request_timeout_s)
        headers = {**self.headers, "X-Request-Id": f"rlctl-g{group_id}"}
        return session.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=timeout)

    async def _stream(self, session: aiohttp.ClientSession, group_id: int, prompt: Prompt) -> list[Rollout]:
        if self.s.routed_experts:
            return await self._whole(session, group_id, prompt)
        version = self.policy.version
        G = self.s.group_size
        rollouts = [Rollout(group_id, i, start_version=version) for i in range(G)]
        body = {
            "model": SERVED_MODEL_NAME, "prompt": prompt.text, "n": G, "max_tokens": self.s.max_tokens,
            "temperature": self.s.temperature, "top_p": 1.0, **SAMPLED_LOGPROBS,
            "stream": True, "cache_salt": policy_cache_salt(version), "stream_interval": self.s.stream_interval,
        }
        seen_before = [version] * G  # per choice: the version when its previous chunk arrived
        async with self._post_completions(session, body, group_id) as resp:
            async for choice, now_version, ids, lps in streamed_choices(resp, self.policy):
                r = rollouts[choice["index"]]
                tag = now_version if self.s.stream_interval == 1 else seen_before[r.index]
                seen_before[r.index] = now_version
                if choice.get("prompt_token_ids"):
                    r.prompt_ids = list(choice["prompt_token_ids"])
                r.completion_ids.extend(ids)
                r.logprobs.extend(lps)
                r.versions.extend([tag] * len(ids))
                r.text += choice.get("text") or ""
                if choice.get("finish_reason"):
                    r.finish_reason = choice["finish_reason"]
        if any(r.finish_reason is None or not r.prompt_ids for r in rollouts):
            raise ValueError("stream ended before every completion finished")
        return rollouts

    async def _trajectories(self, session: aiohttp.ClientSession, group_id: int, prompt: Prompt) -> list[Rollout]:
        """`group_size` trajectories of a multi-turn environment, run concurrently: their first turns in
        one request with n = group_size, and each later turn they reach together in one request too."""

        shared_turns = SharedTurns()

        async def one(index: int) -> Rollout:
            client = TokenClient(session, self.url, self.headers, self.policy, model=SERVED_MODEL_NAME,
                                 temperature=self.s.temperature, timeout_s=self.s.request_timeout_s,
                                 request_id=f"rlctl-g{group_id}-{index}", cache_salt=policy_cache_salt,
                                 token_cache=self._token_cache, shared_turns=shared_turns,
                                 context_tokens=self.s.context_tokens)
            return Rollout.from_trajectory(group_id, index, await self.env.rollout(client, prompt, self.s.budget))

        tasks = [asyncio.create_task(one(i)) for i in range(self.s.group_size)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # on a failure the group is retried as a whole: stop its other trajectories
            for task in tasks:
                task.cancel()

    async def _whole(self, session: aiohttp.ClientSession, group_id: int, prompt: Prompt) -> list[Rollout]:
        """One non-streamed request: vLLM returns `routed_experts` only on whole completions. Every token
        is tagged with the version current when the request was sent (never newer than the truth,
        so the off-policy bound still holds; a streamed rollout's oldest tag is the same version)."""
        version = self.policy.version
        body = {
            "model": SERVED_MODEL_NAME, "prompt": prompt.text, "n": self.s.group_size, "max_tokens": self.s.max_tokens,
            "temperature": self.s.temperature, "top_p": 1.0, **SAMPLED_LOGPROBS,
            "cache_salt": policy_cache_salt(version), "routed_experts_prompt_start": 0,
        }
        async with self._post_completions(session, body, group_id) as resp:
            await raise_for_status(resp)
            response = await resp.json()
        choices = sorted(response.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != self.s.group_size:
            raise ValueError(f"response has {len(choices)} choices for n = {self.s.group_size}")
        return [Rollout.from_routed_choice(group_id, choice, version) for choice in choices]

    # ---- collector -------------------------------------------------------------------------------
    async def _collect(self, step: int) -> tuple[list[Group], StepStats]:
        stats = StepStats(step, start=time.monotonic())
        kept: list[Group] = []
        while len(kept) < self.s.groups_per_step:
            group = await self._queue.get()
            if group is None:
                raise self._error
            if is_stale(group, step, self.s.max_off_policy_steps):
                self.dropped += 1
                self.dropped_ids.append(group.group_id)
                stats.dropped_groups += 1
                self._wake.set()
                continue
            kept.append(group)
        stats.gate_open = self._gate_open.pop(step, stats.start)
        stats.extra.update(self.scorer.take_step_counts())  # reward failures since the previous batch
        for g in kept:
            g.advantages = group_advantages([r.reward for r in g.rollouts], self.s.normalize_std)
        return kept, stats

    def _build(self, step: int, groups: list[Group], stats: StepStats) -> tuple[dict, dict, dict]:
        """(tensors, meta, metrics) of batch `step`."""
        tensors = build_batch_tensors(groups, step)
        versions = [v for g in groups for r in g.rollouts for v in r.trained_versions]  # not the environment's
        lags = [step - v for v in versions] or [0]
        meta = {"policy_version_max": max(versions, default=self.policy.version),
                "group_ids": [g.group_id for g in groups], "dropped_groups": stats.dropped_groups}
        elapsed = max(time.monotonic() - stats.start, 1e-9)
        n_rollouts = len(groups) * self.s.group_size
        tokens = int(tensors["loss_mask"].sum())
        return tensors, meta, {
            "reward_mean": float(tensors["rewards"].mean()) if n_rollouts else 0.0,
            "orchestrator_step_time_s": elapsed,
            "wait_policy_s": max(0.0, (stats.gate_open or stats.start) - stats.start),
            "rollouts_per_s": n_rollouts / elapsed,
            "tokens_per_s": tokens / elapsed,
            "off_policy_lag_mean": sum(lags) / len(lags),
            "off_policy_lag_max": max(lags),
            "dropped_groups": stats.dropped_groups,
            "policy_version": self.policy.version,
            "tokens": tokens,
            "turns_mean": sum(r.turns for g in groups for r in g.rollouts) / max(n_rollouts, 1),
            **stats.extra,
        }

    def heartbeat_state(self) -> tuple[int, str | None]:
        """(progress counter, what the loop waits on): groups started + tokens received grow while
        it works; with nothing in flight and the gate closed it waits for the trainer's policy."""
        need = min_policy_version(self._target_batch(), self.s.max_off_policy_steps)
        gated = self.in_flight == 0 and self._target_batch() < self.end_step and self.policy.version < need
        return self.started + self.completed_tokens, f"trainer (policy v{need})" if gated else None

    def progress_state(self, next_step: int) -> dict[str, Any]:
        """What a resumed loop needs to continue at batch `next_step` with the same prompt stream."""
        rng = self._rng_at.get(next_step) or self.rng.getstate()
        env_state = self._env_at[next_step] if next_step in self._env_at else self.env.state_dict()
        for old in [b for b in self._rng_at if b < next_step]:
            del self._rng_at[old]
            self._env_at.pop(old, None)
        return {"rng": rng, "environment": env_state,
                "counters": {"groups_started": self.started, "groups_dropped": self.dropped,
                             "completed_tokens": self.completed_tokens, "request_retries": self.retries}}

    async def run(self) -> None:
        """Produce batches start_step .. start_step + max_steps - 1, then cancel what is still in flight."""
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            dispatcher = asyncio.create_task(self._dispatch(session))
            dispatcher.add_done_callback(self._task_done)  # an environment that raises sampling fails the loop
            try:
                for step in range(self.s.start_step, self.end_step):
                    groups, stats = await self._collect(step)
                    if self.before_write is not None:  # state taken here, between dispatches
                        await asyncio.to_thread(self.before_write, step, self.progress_state(step + 1))
                    tensors, meta, metrics = await asyncio.to_thread(self._build, step, groups, stats)
                    # The batch's record goes before the batch: a batch the trainer can train (and a
                    # later checkpoint then covers) always has its record. A crash in between leaves a
                    # record without a batch, which the rewind to a checkpoint <= step drops.
                    if self.on_batch is not None:
                        self.on_batch(step, groups, metrics)
                    await asyncio.to_thread(self.batches.write, step, tensors, meta)
            finally:
                dispatcher.cancel()
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(dispatcher, *self._tasks, return_exceptions=True)
                await self.scorer.close()

