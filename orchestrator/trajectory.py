"""Token-level trajectories of multi-turn rollouts, and the client their turns are generated with.

A trajectory is the prompt's token ids followed by segments: each generated turn (trained: loss mask 1,
with the inference logprob and the policy version of every token) and environment tokens (tool outputs,
user turns: loss mask 0, never trained on). Every token id comes from the server: turn k+1 is requested
with the token ids of everything so far as a token-id prompt, and environment text is tokenised by the
server too. Decoding a turn and tokenising the text again could merge or split tokens differently, and
the trainer would then score tokens the policy never sampled.

Budgets bound a trajectory: generated turns, tokens per turn, and tokens after the prompt (generated +
environment). Environment tokens past the budget are cut and end the trajectory.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from rlctl.inference.client import SAMPLED_LOGPROBS
from rlctl.orchestrator.completion_stream import raise_for_status, streamed_choices

ENV_VERSION = -1  # the policy version recorded for environment tokens (no policy produced them)
CACHED_TEXT_CHARS, CACHED_TEXTS = 64, 4096  # tokenisations kept: short texts only, a bounded number


@dataclass(frozen=True)
class Budget:
    max_turns: int
    """Generated turns at most."""
    max_tokens_per_turn: int
    """Generated tokens per turn at most."""
    max_tokens: int
    """Tokens after the prompt at most (generated and environment tokens together)."""
    context_tokens: int | None = None
    """The servers' `max_model_len`: the prompt and every token after it together at most (a longer
    context is refused by the server, so the trajectory ends there as at its budget)."""


@dataclass
class Segment:
    """A run of tokens after the prompt: one generated turn, or environment tokens (`trained` False)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    trained: bool
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Trajectory:
    prompt_text: str
    budget: Budget
    prompt_ids: list[int] = field(default_factory=list)  # filled from the server's answer to turn 1
    segments: list[Segment] = field(default_factory=list)
    start_version: int = 0  # policy version when the first turn was sent (stands in for no tokens)
    reward_text: str | None = None  # what the reward scores; None means the whole transcript
    truncated: bool = False  # the environment's tokens did not fit the budget
    info: dict[str, Any] = field(default_factory=dict)

    # ---- budget --------------------------------------------------------------------------------
    @property
    def turns(self) -> int:
        return sum(1 for s in self.segments if s.trained)

    @property
    def tokens_used(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def remaining_tokens(self) -> int:
        left = self.budget.max_tokens - self.tokens_used
        if self.budget.context_tokens is not None and self.prompt_ids:  # known from the first turn on
            left = min(left, self.budget.context_tokens - len(self.prompt_ids) - self.tokens_used)
        return max(0, left)

    def can_generate(self) -> bool:
        return not self.truncated and self.turns < self.budget.max_turns and self.remaining_tokens > 0

    def next_turn_tokens(self) -> int:
        return min(self.budget.max_tokens_per_turn, self.remaining_tokens)

    # ---- assembly ------------------------------------------------------------------------------
    def add_turn(self, segment: Segment) -> None:
        if not segment.trained or not self.can_generate() or len(segment.ids) > self.next_turn_tokens():
            raise ValueError(f"turn of {len(segment.ids)} tokens does not fit the budget {self.budget} "
                             f"(turns {self.turns}, tokens {self.tokens_used})")
        if not (len(segment.ids) == len(segment.logprobs) == len(segment.versions)):
            raise ValueError("a turn needs one logprob and one policy version per token")
        self.segments.append(segment)

    def add_environment(self, ids: list[int], text: str = "") -> bool:
        """Append environment tokens (loss mask 0); False when they were cut to the budget, which ends
        the trajectory."""
        keep = min(len(ids), self.remaining_tokens)
        if keep < len(ids):
            self.truncated = True
        if keep:
            self.segments.append(Segment(list(ids[:keep]), [0.0] * keep, [ENV_VERSION] * keep, False, text))
        return not self.truncated

    def context_ids(self) -> list[int]:
        """The next turn's prompt: prompt ids + every segment's ids, as the server returned them."""
        return self.prompt_ids + [t for s in self.segments for t in s.ids]

    # ---- flattened, per token after the prompt --------------------------------------------------
    @property
    def completion_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def logprobs(self) -> list[float]:
        return [x for s in self.segments for x in s.logprobs]

    @property
    def versions(self) -> list[int]:
        return [v for s in self.segments for v in s.versions]

    @property
    def loss_mask(self) -> list[bool]:
        return [s.trained for s in self.segments for _ in s.ids]

    @property
    def text(self) -> str:
        """The transcript after the prompt: generated and environment text interleaved."""
        return "".join(s.text for s in self.segments)

    @property
    def finish_reason(self) -> str:
        if self.truncated:
            return "budget"
        turns = [s for s in self.segments if s.trained]
        return (turns[-1].finish_reason if turns else None) or "stop"


class TokenClient:
    """An environment's view of the policy (the router): generate turns and tokenise text, in token ids.

    `policy` is the loop's PolicyVersion; each received token is tagged with the version current when
    it arrived (see loop.py for why that never overstates it)."""

    def __init__(self, session, url: str, headers: dict, policy, *, model: str, temperature: float,
                 timeout_s: float, request_id: str, cache_salt, token_cache: dict | None = None,
                 shared_turns: "SharedTurns | None" = None, context_tokens: int | None = None):
        self.session = session
        self.url = url
        self.headers = headers
        self.policy = policy
        self.model = model
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.request_id = request_id
        self.cache_salt = cache_salt  # version -> salt: each turn's KV belongs to the policy serving it
        # Short tool outputs repeat across trajectories: the loop shares one cache among its clients.
        self._tokens = token_cache if token_cache is not None else {}
        self.shared_turns = shared_turns  # the group's trajectories share requests for their turns
        self.context_tokens = context_tokens  # the servers' max_model_len, if known
        self._requests = 0

    def new_trajectory(self, prompt_text: str, budget: Budget) -> Trajectory:
        return Trajectory(prompt_text, budget, start_version=self.policy.version)

    def _post(self, body: dict):
        import aiohttp

        self._requests += 1  # a request id is unique among the requests in flight on a server
        headers = {**self.headers, "X-Request-Id": f"{self.request_id}-{self._requests}"}
        return self.session.post(f"{self.url}/v1/completions", json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def generate(self, traj: Trajectory, stop: list[str] | None = None) -> Segment:
        """Generate the next turn (streamed), append it to `traj` and return it."""
        if not traj.can_generate():
            raise ValueError("the trajectory's budget allows no further turn")
        first = not traj.prompt_ids
        body = {"model": self.model, "prompt": traj.prompt_text if first else traj.context_ids(),
                "max_tokens": traj.next_turn_tokens(), "temperature": self.temperature, "top_p": 1.0,
                **SAMPLED_LOGPROBS, "stream": True,
                "cache_salt": self.cache_salt(self.policy.version)}
        if stop:
            body["stop"] = stop
        if self.shared_turns is not None:
            prompt_ids, seg = await self.shared_turns.generate(self, body)
        else:
            [(prompt_ids, seg)] = await self.stream_turns(body, 1)
        if first:
            traj.prompt_ids = prompt_ids
        elif prompt_ids != traj.context_ids():
            raise ValueError("the server's prompt token ids differ from the trajectory's context")
        traj.add_turn(seg)
        return seg

    async def stream_turns(self, body: dict, count: int) -> list[tuple[list[int], Segment]]:
        """The `count` sequences of one streamed request (its prompts × its n), in the server's choice
        order: (the server's prompt ids, the turn) each."""
        turns: list[tuple[list[int], Segment]] = [([], Segment([], [], [], True)) for _ in range(count)]
        async with self._post(body) as resp:
            async for choice, now_version, ids, lps in streamed_choices(resp, self.policy):
                prompt_ids, seg = turns[choice.get("index", 0)]
                if choice.get("prompt_token_ids") and not prompt_ids:
                    prompt_ids.extend(choice["prompt_token_ids"])
                seg.ids.extend(ids)
                seg.logprobs.extend(lps)
                seg.versions.extend([now_version] * len(ids))
                seg.text += choice.get("text") or ""
                seg.finish_reason = choice.get("finish_reason") or seg.finish_reason
        if any(seg.finish_reason is None or not prompt_ids for prompt_ids, seg in turns):
            raise ValueError("stream ended before the turn finished")
        return turns

    async def tokenize(self, text: str) -> list[int]:
        """The server's token ids of `text` alone (no special tokens), e.g. a tool's output. A text
        being tokenised already is awaited, not asked again: the group's trajectories then continue
        together and share their next turn's request."""
        if not text:
            return []  # the server refuses an empty prompt
        cached = self._tokens.get(text)
        if isinstance(cached, asyncio.Future):
            return list(await asyncio.shield(cached))
        if cached is not None:
            return list(cached)
        pending = self._tokens[text] = asyncio.get_running_loop().create_future()
        try:
            ids = await self._tokenize_request(text)
        except BaseException as exc:
            if self._tokens.get(text) is pending:
                del self._tokens[text]
            pending.set_exception(exc if isinstance(exc, Exception) else RuntimeError("tokenisation cancelled"))
            pending.exception()  # the waiters (if any) get it; no "never retrieved" warning otherwise
            raise
        if self._tokens.get(text) is pending:
            del self._tokens[text]
        if len(text) <= CACHED_TEXT_CHARS:
            if len(self._tokens) >= CACHED_TEXTS:
                self._tokens.clear()
            self._tokens[text] = ids
        pending.set_result(ids)
        return list(ids)

    async def _tokenize_request(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "max_tokens": 0, "echo": True,
                "return_token_ids": True, "add_special_tokens": False}
        if self.context_tokens is not None:
            # the server refuses a text longer than its context, and no trajectory can hold more than
            # its first context - 1 tokens: those, which the trajectory then cuts to its budget
            body.update(truncate_prompt_tokens=self.context_tokens - 1, truncation_side="right")
        async with self._post(body) as resp:
            await raise_for_status(resp)
            choices = (await resp.json()).get("choices") or []
        if not choices or choices[0].get("prompt_token_ids") is None:
            raise ValueError("the server returned no prompt_token_ids for a tokenisation request")
        return list(choices[0]["prompt_token_ids"])


class SharedTurns:
    """The turns one group's trajectories ask for at the same moment, sent as one request.

    On a small model the per-request cost (an HTTP exchange through the router, a request for the
    server to parse and schedule) is most of a turn: the tool recipe's step sent 544 requests for
    512 trajectories of two turns and took 4x a single-turn step of the same size. So a group's
    trajectories share requests: first turns (one prompt) as one request with n = their number,
    later turns (each its own token-id context) as one request with a list of prompts. The first
    trajectory to ask yields to the event loop until no other joins, so the group's trajectories that
    reach the same turn together share it; any that ask later (an environment that awaited something
    first) form the next request. Only turns with the same sampling settings share. The samples stay
    independent: vLLM draws each sequence with its own random state, as for separate requests."""

    # How long a request waits to form, in event-loop passes: a trajectory woken by a shared result
    # (a tokenisation awaited through asyncio.shield) arrives two or three passes after the first.
    MIN_YIELDS, MAX_YIELDS = 3, 8

    def __init__(self) -> None:
        self._open: dict[str, list[tuple[Any, asyncio.Future | None]]] = {}

    async def generate(self, client: TokenClient, body: dict) -> tuple[list[int], Segment]:
        settings = {k: v for k, v in body.items() if k not in ("prompt", "cache_salt")}
        key = json.dumps({**settings, "text_prompt": isinstance(body["prompt"], str)}, sort_keys=True)
        if key in self._open:  # a request is forming: join it
            joined = asyncio.get_running_loop().create_future()
            self._open[key].append((body["prompt"], joined))
            return await joined
        members: list[tuple[Any, asyncio.Future | None]] = [(body["prompt"], None)]
        self._open[key] = members
        try:
            try:
                for passes in range(1, self.MAX_YIELDS + 1):  # let the others reach this turn
                    seen = len(members)
                    await asyncio.sleep(0)
                    if passes >= self.MIN_YIELDS and len(members) == seen:
                        break
            finally:
                del self._open[key]  # closed: later askers form the next request
            prompts = [prompt for prompt, _ in members]
            if all(prompt == prompts[0] for prompt in prompts):
                request = {**body, "prompt": prompts[0], "n": len(prompts)}
            else:
                request = {**body, "prompt": prompts, "n": 1}  # vLLM numbers the choices by prompt
            first, *rest = await client.stream_turns(request, len(prompts))
        except BaseException as exc:  # cancelled (also while forming) or failed: every joiner learns it
            error = exc if isinstance(exc, Exception) else RuntimeError("the group's shared turn request was cancelled")
            for _, joined in members[1:]:
                if not joined.done():
                    joined.set_exception(error)
            raise
        followers = [joined for _, joined in members[1:]]
        for joined, turn in zip(followers, rest):
            if not joined.done():
                joined.set_result(turn)
        return first
