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
        return max(0, self.budget.max_tokens - self.tokens_used)

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
                 timeout_s: float, request_id: str, cache_salt, token_cache: dict[str, list[int]] | None = None,
                 first_turns: "SharedFirstTurns | None" = None):
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
        self.first_turns = first_turns  # the group's trajectories share their first turn's request
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
                "logprobs": 0, "return_token_ids": True, "stream": True,
                "cache_salt": self.cache_salt(self.policy.version)}
        if stop:
            body["stop"] = stop
        if first and self.first_turns is not None:
            prompt_ids, seg = await self.first_turns.generate(self, body)
        else:
            [(prompt_ids, seg)] = await self.stream_turns(body, 1)
        if first:
            traj.prompt_ids = prompt_ids
        elif prompt_ids != traj.context_ids():
            raise ValueError("the server's prompt token ids differ from the trajectory's context")
        traj.add_turn(seg)
        return seg

    async def stream_turns(self, body: dict, n: int) -> list[tuple[list[int], Segment]]:
        """`n` samples of one turn in one streamed request: (the server's prompt ids, the turn) each."""
        turns: list[tuple[list[int], Segment]] = [([], Segment([], [], [], True)) for _ in range(n)]
        async with self._post({**body, "n": n}) as resp:
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
        """The server's token ids of `text` alone (no special tokens), e.g. a tool's output."""
        if text not in self._tokens:
            body = {"model": self.model, "prompt": text, "max_tokens": 0, "echo": True,
                    "return_token_ids": True, "add_special_tokens": False}
            async with self._post(body) as resp:
                await raise_for_status(resp)
                choices = (await resp.json()).get("choices") or []
            if not choices or choices[0].get("prompt_token_ids") is None:
                raise ValueError("the server returned no prompt_token_ids for a tokenisation request")
            ids = list(choices[0]["prompt_token_ids"])
            if len(text) <= CACHED_TEXT_CHARS:
                if len(self._tokens) >= CACHED_TEXTS:
                    self._tokens.clear()
                self._tokens[text] = ids
            return ids
        return list(self._tokens[text])


class SharedFirstTurns:
    """The first turns of one group's trajectories, sent as one request with n = their number.

    A group's trajectories all start from the same prompt: one request with n = k costs the server one
    HTTP exchange and one prompt instead of k (the tool recipe's step sends 544 requests instead of 1024,
    and on a small model the per-request cost is the step). The first trajectory to ask yields once to
    the event loop, so the group's other trajectories, started with it, join its request; any that ask
    later (an environment that awaited something first) form the next one. The samples stay independent:
    vLLM draws each of the n with its own random state, as for k requests."""

    def __init__(self) -> None:
        self._open: dict[str, list[asyncio.Future]] = {}

    async def generate(self, client: TokenClient, body: dict) -> tuple[list[int], Segment]:
        key = json.dumps({k: v for k, v in body.items() if k != "cache_salt"}, sort_keys=True)
        if key in self._open:  # a request is forming: join it
            joined = asyncio.get_running_loop().create_future()
            self._open[key].append(joined)
            return await joined
        followers = self._open[key] = []
        try:
            await asyncio.sleep(0)  # the trajectories started with this one reach their first turn
        finally:
            del self._open[key]
        try:
            first, *rest = await client.stream_turns(body, 1 + len(followers))
        except BaseException as exc:  # cancelled or failed: every joined trajectory learns it
            error = exc if isinstance(exc, Exception) else RuntimeError("the group's first-turn request was cancelled")
            for joined in followers:
                if not joined.done():
                    joined.set_exception(error)
            raise
        for joined, turn in zip(followers, rest):
            if not joined.done():
                joined.set_result(turn)
        return first
