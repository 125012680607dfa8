"""The streamed-completion parser against a real aiohttp server: connections are reused, events split
anywhere across reads (LF or CRLF, with comments) are parsed whole, and a partial or failed stream raises."""
from __future__ import annotations

import asyncio
import json
import re

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


def _serve_pieces(body: bytes, size: int):
    """A /v1/completions handler writing `body` `size` bytes at a time, each write after the last was sent."""

    async def completions(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for start in range(0, len(body), size):
            await resp.write(body[start:start + size])
            await asyncio.sleep(0.001)
        return resp

    return completions


def _collect(body: bytes, size: int):
    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", _serve_pieces(body, size))
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            async with session.post(server.make_url("/v1/completions"), json={}) as resp:
                return [(c["index"], ids, lps) async for c, _v, ids, lps in streamed_choices(resp, None)]

    return asyncio.run(main())


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_events_split_anywhere_across_reads_are_parsed_whole(size, newline):
    """The body is read as its bytes arrive: an event may span reads, a read may hold many events or
    end inside a line; comments and other fields are skipped, as they were a line at a time."""
    events = [{"choices": [{"index": i % 2, "token_ids": [i, i + 1], "logprobs": {"token_logprobs": [-0.5, -i]}}]}
              for i in range(5)]
    nl = newline
    body = (f": a comment{nl}{nl}" + "".join(f"event: x{nl}data: {json.dumps(e)}{nl}{nl}" for e in events)
            + f"data: [DONE]{nl}{nl}").encode()
    assert _collect(body, size) == [(i % 2, [i, i + 1], [-0.5, float(-i)]) for i in range(5)]


@pytest.mark.parametrize("tail, message", [(b"", "stream ended before [DONE]"),
                                           (b'data: {"error": {"message": "boom"}}\n\n', "server error in stream"),
                                           (b'data: {"choices": [{"index": 0, "token_ids": [1]}]}\n\n',
                                            "1 token ids but 0 logprobs")])
def test_a_partial_or_failed_stream_raises(tail, message):
    first = b'data: {"choices": [{"index": 0, "token_ids": [3], "logprobs": {"token_logprobs": [-1.0]}}]}\n\n'
    with pytest.raises(ValueError, match=re.escape(message)):
        _collect(first + tail, 5)
