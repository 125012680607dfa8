"""The streamed-completion parser against a real aiohttp server: connections are reused."""
from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402

from rlctl.orchestrator.completion_stream import streamed_choices  # noqa: E402


def test_streamed_requests_reuse_one_connection():
    """The router sends the chunked body's last, empty chunk after `[DONE]`, often in a packet of its
    own; a response left unread there is not pooled and every request opened a new connection."""
    peers = []

    async def completions(request):
        peers.append(request.transport.get_extra_info("peername"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        choice = {"index": 0, "text": "a", "token_ids": [7], "logprobs": {"token_logprobs": [-0.5]},
                  "finish_reason": "length"}
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05)  # the body's end comes later than [DONE]
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            got = []
            for _ in range(3):
                async with session.post(server.make_url("/v1/completions"), json={}) as resp:
                    got += [(ids, lps) async for _c, _v, ids, lps in streamed_choices(resp, None)]
            return got

    assert asyncio.run(main()) == [([7], [-0.5])] * 3
    assert len(peers) == 3 and len(set(peers)) == 1, peers
