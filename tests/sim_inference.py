"""A simulated inference server speaking vLLM's wire protocol, for orchestrator tests and benchmarks.

It is a real HTTP server (aiohttp, own process): streamed `/v1/completions` with `n`, `logprobs`,
`return_token_ids`, `stream_interval`, plus `/pause`, `/resume`, `/collective_rpc` (rlctl_reload), `/v1/models` and `/health`.
With `--token` the admin routes need it; `/v1` takes it or `--api-key` (as the real servers, see auth.py). Prompts starting with
`slow` stream 10x slower. Each generated token encodes the server's policy version at the moment it was generated (token id
`TOKEN_BASE + version`, logprob `-(version + 1) / 10`), so tests can check the orchestrator's
per-token version tags against the truth. Run: `python sim_inference.py --token-delay 0.01`; it
prints `PORT <n>` once listening.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TOKEN_BASE = 10


def token_for(version: int) -> int:
    return TOKEN_BASE + version


def _step_of(path: Path) -> int:
    """`.../step_N` -> N; any other weights (a pool's base model) -> 0."""
    name = path.name
    return int(name.split("_")[1]) if name.startswith("step_") else 0


class SimServer:
    def __init__(self, token_delay: float, token: str | None, request_overhead: float = 0.0,
                 reload_delay: float = 0.0, max_concurrent: int = 0, api_key: str | None = None):
        self.token_delay = token_delay
        self.request_overhead = request_overhead
        self.reload_delay = reload_delay
        self.token = token
        self.api_key = api_key
        self.version = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.completed = Counter()  # X-Request-Id -> finished streams
        self.salts = Counter()
        self.adapters: dict[str, int] = {}  # LoRA adapter name -> its version
        self.staged: set[str] = set()  # steps "read into host RAM" (rlctl_stage of a shared pool)
        self.active = 0
        self.peak_active = 0
        # A capacity model for benchmarks: at most this many requests generate at once (0 = unlimited).
        self.slots = asyncio.Semaphore(max_concurrent) if max_concurrent else contextlib.nullcontext()

    def _authorized(self, request, openai_route: bool = False) -> bool:
        given = request.headers.get("Authorization")
        return (self.token is None or given == f"Bearer {self.token}"
                or (openai_route and self.api_key is not None and given == f"Bearer {self.api_key}"))

    async def models(self, request):
        from aiohttp import web

        if not self._authorized(request, openai_route=True):
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model"}]})

    async def completions(self, request):
        from aiohttp import web

        if not self._authorized(request, openai_route=True):
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        n, max_tokens = int(body.get("n", 1)), int(body["max_tokens"])
        self.salts[body.get("cache_salt")] += 1
        prompt_ids = [TOKEN_BASE + (ord(c) % 40) for c in str(body["prompt"])]
        delay = self.token_delay * (10 if str(body["prompt"]).startswith("slow") else 1)  # deterministic stragglers
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            async with self.slots:
                if self.request_overhead:
                    await asyncio.sleep(self.request_overhead)
                interval, pending = int(body.get("stream_interval") or 1), []  # versions not yet sent
                for step in range(max_tokens):
                    await asyncio.sleep(delay)
                    await self.resumed.wait()  # pause(mode=keep): requests freeze, then continue
                    pending.append(self.adapters.get(body.get("model"), self.version))
                    # as vLLM's stream_interval: the first token at once, then every `interval`, the last
                    if not (step == 0 or len(pending) >= interval or step == max_tokens - 1):
                        continue
                    sent, pending = pending, []
                    events = []
                    for i in range(n):
                        choice = {"index": i, "text": "".join(chr(ord("a") + v % 26) for v in sent),
                                  "token_ids": [token_for(v) for v in sent],
                                  "logprobs": {"token_logprobs": [-(v + 1) / 10 for v in sent],
                                               "tokens": [f"token_id:{token_for(v)}" for v in sent]},
                                  "finish_reason": "length" if step == max_tokens - 1 else None}
                        if step == 0:
                            choice["prompt_token_ids"] = prompt_ids
                        events.append(f"data: {json.dumps({'choices': [choice]})}\n\n")
                    await resp.write("".join(events).encode())  # one write per step: cheaper, same bytes
                await resp.write(b"data: [DONE]\n\n")
                self.completed[request.headers.get("X-Request-Id", "")] += 1
        finally:
            self.active -= 1
        return resp

    async def pause(self, request):
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        self.resumed.clear()
        return web.json_response({})

    async def resume(self, request):
        from aiohttp import web

        self.resumed.set()
        return web.json_response({})

    async def rpc(self, request):
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        step_dir = Path(body["args"][0])
        if body["method"] == "rlctl_stage":  # kept "in host RAM": a later reload of it is from there
            self.staged.discard(body["args"][2])
            self.staged.add(str(step_dir))
            return web.json_response({"results": [{"staged": True, "entries": len(self.staged)}]})
        start = time.perf_counter()
        if self.reload_delay:
            await asyncio.sleep(self.reload_delay)
        self.version = _step_of(step_dir)
        source = "host" if str(step_dir) in self.staged else "files"
        return web.json_response({"results": [{"total_s": time.perf_counter() - start, "step_dir": str(step_dir),
                                               "source": source}]})

    async def load_lora(self, request):
        """`/v1/load_lora_adapter`: the adapter's version is its step (requests naming it generate it)."""
        from aiohttp import web

        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        self.adapters[body["lora_name"]] = _step_of(Path(body["lora_path"]))
        return web.json_response({})

    async def unload_lora(self, request):
        from aiohttp import web

        self.adapters.pop((await request.json())["lora_name"], None)
        return web.json_response({})

    async def stats(self, request):
        from aiohttp import web

        return web.json_response({"completed": dict(self.completed), "salts": dict(self.salts),
                                  "peak_active": self.peak_active, "version": self.version})

    async def health(self, request):
        from aiohttp import web

        return web.json_response({})


async def _main(args) -> None:
    from aiohttp import web

    sim = SimServer(args.token_delay, args.token, args.request_overhead, args.reload_delay, args.max_concurrent,
                    args.api_key)
    app = web.Application()
    app.add_routes([web.post("/v1/completions", sim.completions), web.post("/pause", sim.pause),
                    web.post("/resume", sim.resume), web.post("/collective_rpc", sim.rpc),
                    web.post("/v1/load_lora_adapter", sim.load_lora), web.post("/v1/unload_lora_adapter", sim.unload_lora),
                    web.get("/stats", sim.stats), web.get("/health", sim.health), web.get("/v1/models", sim.models)])
    runner = web.AppRunner(app, handle_signals=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    await asyncio.Event().wait()


@contextlib.contextmanager
def sim_server(token_delay: float = 0.01, token: str | None = None, request_overhead: float = 0.0,
               reload_delay: float = 0.0, max_concurrent: int = 0, api_key: str | None = None):
    """Start the simulated server in its own process; yields its base URL; stops it afterwards."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--token-delay", str(token_delay),
           "--request-overhead", str(request_overhead), "--reload-delay", str(reload_delay),
           "--max-concurrent", str(max_concurrent)]
    if token:
        cmd.append(f"--token={token}")  # "=" form: a secret may begin with "-"
    if api_key:
        cmd.append(f"--api-key={api_key}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"simulated server did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fetch_stats(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{url}/stats", timeout=30) as r:
        return json.loads(r.read())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-delay", type=float, default=0.01)
    parser.add_argument("--request-overhead", type=float, default=0.0)
    parser.add_argument("--reload-delay", type=float, default=0.0)
    parser.add_argument("--max-concurrent", type=int, default=0)
    parser.add_argument("--token", default=None)
    parser.add_argument("--api-key", default=None)
    try:
        import uvloop  # the real servers' event loop too; makes the simulator cheap enough for 10k streams
    except ImportError:
        uvloop = None
    if uvloop is not None:
        uvloop.install()
    asyncio.run(_main(parser.parse_args()))


@contextlib.asynccontextmanager
async def completions_endpoint(handler):
    """`/v1/completions` answered by `handler` in this process (a fake whose answers a test controls),
    on a free port; yields its base URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class MemoryBatchWriter:
    """The rollout loop's BatchWriter, keeping each step's tensors in memory."""

    def __init__(self):
        self.batches = {}

    def write(self, step, tensors, meta):
        self.batches[step] = tensors
