"""InferenceClient and a server that closes a kept-alive connection as a request arrives on it (vLLM's
uvicorn closes idle ones after its keep-alive timeout, and after an HTTP 500): an admin call goes out once more on a fresh
connection; a completion is not repeated."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from rlctl.inference.client import KEEPALIVE_S, InferenceClient, InferenceError


class DroppingServer:
    """Drops the connection, unanswered, of every request number listed in `drop` (1-based)."""

    def __init__(self, drop: set[int]):
        self.drop, self.seen = drop, 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen += 1
        if self.seen in self.drop:
            request.transport.close()
            await asyncio.sleep(0.05)
        return web.json_response({"ok": True, "results": [{"total_s": 0.0}]})


async def serve(server: DroppingServer):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_an_admin_call_on_a_dropped_connection_is_sent_again():
    async def main():
        server = DroppingServer({1, 3})
        runner, url = await serve(server)
        try:
            async with InferenceClient(url, "token") as client:
                await client.pause()  # dropped once, answered the second time
                await client.resume()
                await client.collective_rpc("rlctl_reload", ["/w/step_1"])  # dropped once too
            assert server.seen == 5
        finally:
            await runner.cleanup()
    asyncio.run(main())


def test_a_completion_is_not_repeated_and_two_drops_fail():
    async def main():
        server = DroppingServer({1, 2, 3})
        runner, url = await serve(server)
        try:
            async with InferenceClient(url, "key") as client:
                with pytest.raises(InferenceError, match="/v1/completions"):
                    await client.complete("hi", max_tokens=1)
                assert server.seen == 1
                with pytest.raises(InferenceError, match="/pause"):
                    await client.pause()  # dropped twice: an error, not a loop
                assert server.seen == 3
        finally:
            await runner.cleanup()
    asyncio.run(main())


def test_idle_connections_expire_at_every_client_before_the_servers_do(tmp_path):
    from rlctl.inference.router import POOL_IDLE_S
    from rlctl.inference.server import server_env
    from rlctl.recipes.load import load_recipe

    recipe = load_recipe(["tiny-cpu"])
    server_keepalive = int(server_env(recipe, "cpu", tmp_path, "admin", "key")["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"])
    assert KEEPALIVE_S < server_keepalive and POOL_IDLE_S < server_keepalive
