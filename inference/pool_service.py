"""`python -m rlctl.inference.pool_service --run-dir POOL`: the front of a shared inference pool.

A pool (`rlctl pool launch`) is a run directory under `<output_root>/pools/<name>/` whose job holds the
inference servers and this front instead of a trainer and an orchestrator. The front waits for its
servers, announces itself (`services/pool/0.json`: URL, mode, model, and live statistics refreshed
every `STATS_EVERY_S`), and serves every attached run under `/runs/<run>/`:

    POST /runs/<run>/attach      {"run_dir": ...}        a run joins (its orchestrator, at start)
    POST /runs/<run>/detach                               it leaves (its orchestrator, at the end)
    POST /runs/<run>/weights     {"step_dir": ...}        it published a step (see pool_dispatch)
    POST /runs/<run>/v1/completions                       a completion, queued by HRRS, then proxied
    GET  /pool/stats, /health

So a run's orchestrator uses `<front>/runs/<run>` as its router URL: its requests, streamed or not,
are the ones it sends to a router; the front puts the run's adapter name in them. Every route needs
the pool's api key (its `secrets/api_key`, readable by its owner only); the servers' admin token
never leaves this process. The front exits 0 when the pool's DONE file appears or on SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

from rlctl.inference.client import InferenceClient
from rlctl.inference.pool_dispatch import PoolDispatcher, PoolFull
from rlctl.inference.server import free_port
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.heartbeat import Heartbeat
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.placement import Placement

log = logging.getLogger("rlctl.pool")
STATS_EVERY_S = 2.0
SLOTS_PER_SERVER = 256  # requests in flight per server: vLLM batches them; HRRS orders the rest


def pool_mode(recipe) -> str:
    """A pool built from a LoRA recipe serves LoRA runs (adapters); otherwise full-weight runs."""
    return "lora" if recipe.trainer.lora.enabled else "full"


class PoolFront:
    def __init__(self, dispatcher: PoolDispatcher, api_key: str, server_urls: list[str]):
        self.dispatcher = dispatcher
        self.api_key = api_key
        self.server_urls = server_urls
        self.http: ClientSession | None = None
        # Re-announces the pool's stats. Called before an attach or detach is answered, so whoever
        # reads the pool after that answer (`rlctl pool show`) sees the run joined or gone.
        self.on_change: Callable[[], None] = lambda: None

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if request.path != "/health" and not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return web.json_response({"error": "unauthorized"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=64 << 20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/pool/stats", self.stats)
        app.router.add_post("/runs/{run}/attach", self.attach)
        app.router.add_post("/runs/{run}/detach", self.detach)
        app.router.add_post("/runs/{run}/weights", self.weights)
        app.router.add_post("/runs/{run}/v1/completions", self.completions)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        from aiohttp import TCPConnector

        from rlctl.inference.client import KEEPALIVE_S

        # no request on a kept-alive connection the server is closing (see client.KEEPALIVE_S)
        self.http = ClientSession(timeout=ClientTimeout(total=None, sock_connect=30),
                                  connector=TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))

    async def _close(self, _app) -> None:
        if self.http is not None:
            await self.http.close()

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.dispatcher.stats())

    def _run(self, request: web.Request) -> str:
        name = request.match_info["run"]
        if name not in self.dispatcher.runs:
            raise web.HTTPNotFound(text=json.dumps({"error": f"run {name!r} is not attached to this pool"}),
                                   content_type="application/json")
        return name

    async def attach(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            run = self.dispatcher.attach(request.match_info["run"], str(body.get("run_dir", "")))
        except PoolFull as exc:
            return web.json_response({"error": str(exc)}, status=409)
        self.on_change()
        return web.json_response({"run": run.name, "mode": self.dispatcher.mode})

    async def detach(self, request: web.Request) -> web.Response:
        await self.dispatcher.detach(request.match_info["run"])
        self.on_change()
        return web.json_response({"ok": True})

    async def weights(self, request: web.Request) -> web.Response:
        name = self._run(request)
        step_dir = str((await request.json())["step_dir"])
        try:
            timings = await self.dispatcher.publish(name, step_dir)
        except Exception as exc:  # noqa: BLE001 - the run's orchestrator fails with it, the pool goes on
            log.error("run %s: loading %s failed: %s", name, step_dir, exc)
            return web.json_response({"error": str(exc)}, status=502)
        return web.json_response(timings)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        name = self._run(request)
        body = await request.json()
        body["model"] = self.dispatcher.runs[name].adapter
        replica = await self.dispatcher.acquire(name)
        dispatched = time.monotonic()
        try:
            return await self._forward(request, replica.index, body)
        finally:
            self.dispatcher.release(replica, name, dispatched)

    async def _forward(self, request: web.Request, index: int, body: dict) -> web.StreamResponse:
        url = self.server_urls[index].rstrip("/") + "/v1/completions"
        headers = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}
        async with self.http.post(url, json=body, headers=headers) as upstream:
            if not body.get("stream"):
                return web.Response(status=upstream.status, body=await upstream.read(),
                                    content_type=upstream.content_type)
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:  # the run stopped reading (it dropped the request): not an error
                log.debug("a client of %s went away mid-stream", request.path)
            return response


def ended_runs(dispatcher: PoolDispatcher) -> list[str]:
    """Attached runs that ended without detaching (killed): finished (DONE), or a local run whose
    supervisor has exited. A Slurm run detaches on its job's SIGTERM (orchestrator/__main__.py)."""
    ended = []
    for name, attached in dispatcher.runs.items():
        other = RunDir(Path(attached.run_dir))
        try:
            supervisor = json.loads((other.status / "supervisor.json").read_text())
        except (OSError, ValueError):
            supervisor = {}
        if other.done.exists() or supervisor.get("state") in ("exited", "cancelled"):
            ended.append(name)
    return ended


def base_weights_step(model_dir: str, folder: Path) -> str:
    """The base model as a published step (its weight files linked, the marker last): what a
    full-weight run that has not published yet is served from after another run held the server."""
    from rlctl.orchestrator.exchange.steps import MARKER

    folder.mkdir(parents=True, exist_ok=True)
    for src in Path(model_dir).iterdir():
        if src.suffix in (".safetensors", ".json") and not (folder / src.name).exists():
            (folder / src.name).symlink_to(src.resolve())
    atomic_write_json(folder / MARKER, {"base": str(model_dir)})
    return str(folder)


async def serve(run: RunDir, recipe, urls: list[str], host: str, stop: asyncio.Event) -> None:
    from rlctl.inference.__main__ import resolve_model_dir

    mode = pool_mode(recipe)
    clients = [InferenceClient(u, run.admin_token()) for u in urls]
    base = base_weights_step(resolve_model_dir(recipe, run), run.root / "cache" / "base_weights") if mode == "full" else ""
    dispatcher = PoolDispatcher(clients, mode, SLOTS_PER_SERVER, recipe.inference.max_loras, base_dir=base,
                                host_cache_bytes=int(recipe.inference.pool_host_cache_gib * 2**30))
    front = PoolFront(dispatcher, run.api_key(), urls)
    runner = web.AppRunner(front.app(), access_log=None)
    await runner.setup()
    port = free_port(host)
    await web.TCPSite(runner, host, port).start()
    url = f"http://{host}:{port}"
    info = {"url": url, "mode": mode, "model": recipe.model.name, "build_seed": recipe.model.build_seed,
            "max_loras": recipe.inference.max_loras, "max_model_len": recipe.inference.max_model_len, "lora_rank": recipe.trainer.lora.rank, "servers": urls}
    log.info("pool %s serving %s runs at %s in front of %d server(s)", run.root.name, mode, url, len(urls))
    heartbeat = Heartbeat(run, "orchestrator")

    def announce() -> dict:
        stats = dispatcher.stats()
        run.announce("pool", "0", {**info, "time": time.time(), "stats": stats})
        return stats

    front.on_change = announce
    try:
        while not stop.is_set() and not run.done.exists():
            for name in ended_runs(dispatcher):
                await dispatcher.detach(name)
            stats = announce()
            # an idle pool waits for its runs: not a stall (see exchange/heartbeat.py)
            heartbeat.beat(sum(r["requests"] for r in stats["runs"].values()),
                           waiting_for=None if stats["inflight"] else "runs' requests")
            try:
                await asyncio.wait_for(stop.wait(), STATS_EVERY_S)
            except asyncio.TimeoutError:
                pass
    finally:
        await runner.cleanup()
        await asyncio.gather(*(c.aclose() for c in clients))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.inference.pool_service", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=os.environ.get("RLCTL_RUN_DIR"), help="the pool's directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[pool %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per admin call otherwise
    from rlctl.inference.processes import private_umask
    from rlctl.recipes.errors import RecipeError
    from rlctl.recipes.load import validate

    private_umask()
    if not args.run_dir:
        print("pool: error: --run-dir (or RLCTL_RUN_DIR) is required", file=sys.stderr)
        return 2
    run = RunDir(Path(args.run_dir))
    host = os.environ.get("RLCTL_BIND_HOST", "127.0.0.1")
    try:
        recipe = validate(run.recipe_data())
        placement = Placement.from_dict(json.loads((run.configs / "placement.json").read_text()))
        # the orchestrator's wait: the same announcements, dead-server check and log tails on failure
        from rlctl.orchestrator.__main__ import wait_for_servers

        urls = wait_for_servers(run, placement.inference_servers, int(os.environ.get("RLCTL_ATTEMPT", "0")),
                                recipe.inference.startup_timeout_s)
    except RecipeError as exc:
        print(f"pool: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"pool: error: {exc}", file=sys.stderr)
        return 1

    async def run_front() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(run, recipe, urls, host, stop)

    asyncio.run(run_front())
    atomic_write_json(run.done, {"time": time.time(), "by": "pool"})  # its servers stop with it
    log.info("pool %s stopped", run.root.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
