"""Async HTTP client for the vLLM servers (and the router): completions with logprobs, admin routes.

Every request carries `Authorization: Bearer <key>` (see `auth.py`): a client of the router holds the
run's api key, which opens `/v1` only; a client of one server's own URL holds the admin token, which
also opens the admin routes. Weight reloads (`/collective_rpc`, pause and resume) therefore go to every
server directly, never through the router — which would also forward an unknown route to one backend.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from rlctl.inference.server import SERVED_MODEL_NAME
from rlctl.inference.vllm_main import TOKEN_ID_LOGPROBS_XARG

RELOAD_METHOD = "rlctl_reload"  # ReloadExtension method run on every worker via /collective_rpc
RECEIVE_METHOD = "rlctl_receive"  # the same for the broadcast transport (weights_receiver.py)
STAGE_METHOD = "rlctl_stage"  # read a step into the workers' host RAM ahead of a pool's switch (host_cache.py)


# What a completion request asks for to get each sampled token's id and logprob: the ids stand in for
# the token strings, and the xarg spares the server decoding those strings at all (vllm_main.py).
SAMPLED_LOGPROBS = {"logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                    "vllm_xargs": {TOKEN_ID_LOGPROBS_XARG: 1}}

KEEPALIVE_S = 2.0  # below any server's keep-alive timeout (uvicorn's default is 5 s; ours, server.SERVER_KEEPALIVE_S)


class InferenceError(RuntimeError):
    """A server answered with an error (or not at all); the message names the server and route."""


def policy_cache_salt(version: int) -> str:
    """Prefix-cache salt for requests started under policy `version`: KV computed under another
    policy is never reused for them, while requests of the same version still share prefixes."""
    return f"rlctl-policy-{version}"


@dataclass
class Sample:
    """One sampled completion: its token ids with the sampler's log-probability of each."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None


def parse_samples(response: dict) -> list[Sample]:
    """Samples of a `/v1/completions` response made by `complete()` (which asks for token ids and
    `logprobs=0`, i.e. only the sampled token's logprob per position)."""
    out = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        lp = choice.get("logprobs") or {}
        out.append(Sample(list(choice.get("token_ids") or []), [float(x) for x in lp.get("token_logprobs") or []],
                          choice.get("text", ""), choice.get("finish_reason")))
    return out


def decode_routed_experts(encoded: str):
    """A choice's `routed_experts` (base64 of a `.npy` array `[rows, layers, top_k]`, uint8/uint16/int32
    expert ids) as an int16 torch tensor, without going through Python lists."""
    import base64
    import io

    import numpy as np
    import torch

    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected integer [rows, layers, top_k], got {array.dtype} {array.shape}")
    return torch.from_numpy(array.astype(np.int16))


def routed_experts_payload(routed, prompt_len: int, completion_len: int):
    """The rollout's `routed_experts` payload: int16 `[prompt_len + completion_len, layers, top_k]`
    aligned with its input_ids (row t = the experts token t was routed to, per layer), -1 where vLLM
    reported none. vLLM reports rows for tokens 0 .. P + C - 2 (request option routed_experts_prompt_start
    = 0): the last sampled token is never run through the model, so its row stays -1."""
    import torch

    total = prompt_len + completion_len
    if routed.shape[0] > max(total - 1, 0):
        raise ValueError(f"routed_experts has {routed.shape[0]} rows for {total} tokens (expected <= {total - 1})")
    payload = torch.full((total, *routed.shape[1:]), -1, dtype=torch.int16)
    payload[: routed.shape[0]] = routed
    return payload


def prompt_logprobs_of(response: dict, choice: int = 0) -> list[float | None]:
    """Per prompt token, the logprob of the actual prompt token (None for the first position)."""
    c = response["choices"][choice]
    ids, entries = c["prompt_token_ids"], c["prompt_logprobs"]
    return [None if e is None else float(e[str(tok)]["logprob"] if str(tok) in e else e[tok]["logprob"])
            for tok, e in zip(ids, entries)]


@dataclass
class InferenceClient:
    """One vLLM server with the admin token, or the router with the api key (completions only)."""

    url: str
    token: str
    timeout_s: float = 600.0
    _http: httpx.AsyncClient | None = field(default=None, repr=False)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url, timeout=self.timeout_s, headers={"Authorization": f"Bearer {self.token}"},
                # idle connections are dropped here before the server drops them, so a request never
                # goes out on one the server is closing
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, route: str, **kw) -> httpx.Response:
        """One call; an admin call is sent once more on a fresh connection when the server had just
        closed the kept-alive one it went out on (uvicorn closes idle ones after its keep-alive timeout,
        and after an HTTP 500): it was never read, and every admin route is idempotent. A completion is
        not repeated: its failure is the caller's to handle."""
        for attempt in (1, 2):
            try:
                resp = await self.http.request(method, route, **kw)
                break
            except httpx.RemoteProtocolError as e:
                if attempt == 2 or route.startswith("/v1/completions"):
                    raise InferenceError(f"{self.url}{route}: {type(e).__name__}: {e}") from e
            except httpx.HTTPError as e:
                raise InferenceError(f"{self.url}{route}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 400:
            raise InferenceError(f"{self.url}{route}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp

    async def health(self) -> bool:
        try:
            return (await self.http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_healthy(self, timeout_s: float, interval_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise InferenceError(f"{self.url}: not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)

    async def pause(self, mode: str = "keep") -> None:
        """'keep' freezes in-flight requests (they continue after `resume` under the new weights);
        'wait' drains them first; 'abort' drops them. On CPU avoid per-request seeds with 'keep'.

        With 'keep' the caches stay: vLLM's default clear would preempt every frozen request and
        re-prefill its whole context after the reload, and new requests cannot hit old-policy
        prefix blocks anyway (their KV-cache salt names the policy version)."""
        params = {"mode": mode, "clear_cache": "false"} if mode == "keep" else {"mode": mode}
        await self._request("POST", "/pause", params=params)

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused")).json()["is_paused"])

    async def collective_rpc(self, method: str, args: list[str] | None = None) -> list:
        resp = await self._request("POST", "/collective_rpc", json={"method": method, "args": args or []})
        return resp.json().get("results", []) if resp.content else []

    async def reload(self, step_dir: str) -> dict:
        """Reload weights in place on every worker of this server; returns the slowest worker's timing."""
        start = time.perf_counter()
        results = await self.collective_rpc(RELOAD_METHOD, [str(step_dir)])
        if not results or not all(isinstance(r, dict) for r in results):
            raise InferenceError(f"{self.url}/collective_rpc: unexpected reload result {results!r:.300}")
        slowest = max(results, key=lambda r: r["total_s"])
        return {**slowest, "workers": len(results), "rpc_s": time.perf_counter() - start}

    async def stage(self, step_dir: str, budget_bytes: int, replaces: str | None = None) -> None:
        """Have every worker read `step_dir` into host RAM in the background (a shared pool's switch to
        it then reads no file), within `budget_bytes` per worker, dropping `replaces` (the run's older
        step)."""
        await self.collective_rpc(STAGE_METHOD, [str(step_dir), int(budget_bytes), str(replaces or "")])

    async def receive(self, step_dir: str, servers: int) -> dict:
        """Receive version `step_dir` over the broadcast transport on every worker of this server, which
        joins the step's group with the workers of all `servers` servers (all called at once)."""
        start = time.perf_counter()
        results = await self.collective_rpc(RECEIVE_METHOD, [str(step_dir), int(servers)])
        if not results or not all(isinstance(r, dict) for r in results):
            raise InferenceError(f"{self.url}/collective_rpc: unexpected receive result {results!r:.300}")
        slowest = max(results, key=lambda r: r["total_s"])
        return {**slowest, "workers": len(results), "rpc_s": time.perf_counter() - start}

    async def swap_adapter(self, step_dir: str, adapter: str = SERVED_MODEL_NAME) -> dict:
        """A LoRA run's update: load the PEFT adapter in `step_dir` in place under the name `adapter`
        (the served name; in a shared pool, the run's own)."""
        from rlctl.inference.lora_serving import LOAD_ROUTE

        start = time.perf_counter()
        await self._request("POST", LOAD_ROUTE, json={"lora_name": adapter, "lora_path": str(step_dir),
                                                      "load_inplace": True})
        took = time.perf_counter() - start
        return {"total_s": took, "rpc_s": took, "workers": 1}

    async def unload_adapter(self, adapter: str) -> None:
        """Drop LoRA adapter `adapter` from the server (frees its slot)."""
        from rlctl.inference.lora_serving import UNLOAD_ROUTE

        await self._request("POST", UNLOAD_ROUTE, json={"lora_name": adapter})

    async def load(self, step_dir: str, transport: str, servers: int, adapter: str = SERVED_MODEL_NAME) -> dict:
        """Load version `step_dir` by its transport: read it ('filesystem'), receive it ('broadcast') or
        swap in its adapter ('lora', under the name `adapter`)."""
        if transport == "lora":
            return await self.swap_adapter(step_dir, adapter)
        if transport == "broadcast":
            return await self.receive(step_dir, servers)
        return await self.reload(step_dir)

    def _completion_body(self, prompt, max_tokens, temperature, top_p, n, cache_salt, prompt_logprobs, stop,
                         extra) -> dict:
        body = {
            "model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "n": n, **SAMPLED_LOGPROBS,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if stop:
            body["stop"] = stop
        body.update(extra or {})
        return body

    async def complete(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        n: int = 1,
        cache_salt: str | None = None,
        prompt_logprobs: int | None = None,
        stop: list[str] | None = None,
        extra: dict | None = None,
    ) -> dict:
        """POST /v1/completions asking for sampled-token logprobs and token ids (see `parse_samples`)."""
        body = self._completion_body(prompt, max_tokens, temperature, top_p, n, cache_salt, prompt_logprobs, stop, extra)
        return (await self._request("POST", "/v1/completions", json=body)).json()


def announced_servers(run) -> list[InferenceClient]:
    """Admin clients for the own URL of every inference server announced in run dir `run` (a RunDir)."""
    token = run.admin_token()
    return [InferenceClient(info["url"], token) for info in sorted(run.announced("inference"), key=lambda i: i["index"])]


async def reload_all(servers: list[InferenceClient], step_dir: str, pause_mode: str | None = None,
                     transport: str = "filesystem", adapter: str = SERVED_MODEL_NAME) -> dict:
    """Load `step_dir` into every server in place; with `pause_mode` ('keep', 'wait', 'abort') pause
    them all first and resume them all afterwards (even on failure). With the broadcast transport all
    servers receive at once: the sender waits for all of them.

    No pause is needed for the weights to change between two forward passes: a reload (or receive, or
    adapter swap) is one utility call that vLLM's engine core runs between two engine steps, and a
    worker takes its calls in order, so requests in flight simply continue under the new weights, as
    they would after a pause in mode 'keep'. The pause would add two HTTP round trips and the ~20 ms
    vLLM's `/pause` sleeps before it answers; a caller that wants requests drained or dropped first
    asks for it.

    Returns seconds per phase: {"pause_s", "reload_s", "resume_s", "total_s", "load_s_max", "servers"}, and
    `bytes_read_max`: the most weight bytes one server's worker read (`ReloadExtension.rlctl_reload`).
    """
    t0 = time.perf_counter()
    if pause_mode is not None:
        await asyncio.gather(*(s.pause(pause_mode) for s in servers))
    t1 = time.perf_counter()
    try:
        results = await asyncio.gather(*(s.load(step_dir, transport, len(servers), adapter) for s in servers))
        t2 = time.perf_counter()
    finally:
        resumed = ([] if pause_mode is None else
                   await asyncio.gather(*(s.resume() for s in servers), return_exceptions=True))
    t3 = time.perf_counter()
    failed = [f"{s.url}: {r}" for s, r in zip(servers, resumed) if isinstance(r, BaseException)]
    if failed:
        raise InferenceError("resume failed after reload: " + "; ".join(failed))
    return {"pause_s": t1 - t0, "reload_s": t2 - t1, "resume_s": t3 - t2, "total_s": t3 - t0,
            "load_s_max": max(r["total_s"] for r in results), "servers": len(servers),
            "bytes_read_max": max(r.get("bytes_read", 0) for r in results),
            "from_host": sum(r.get("source") == "host" for r in results)}
