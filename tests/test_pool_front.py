"""The shared pool's front (inference/pool_service + pool_dispatch) against simulated vLLM servers whose
tokens say which weights generated them: each run is served by its own policy, full-weight runs take
turns on a server, LoRA runs share it at once, and only the pool's key opens it."""
from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from aiohttp import web
from sim_inference import fetch_stats, sim_server, token_for

from rlctl.inference.client import InferenceClient
from rlctl.inference.pool_dispatch import PoolDispatcher
from rlctl.inference.pool_service import PoolFront

ADMIN, KEY = "admin-token", "pool-key"


@contextlib.asynccontextmanager
async def front(urls: list[str], mode: str, slots: int = 64, host_cache_bytes: int = 0):
    clients = [InferenceClient(u, ADMIN) for u in urls]
    dispatcher = PoolDispatcher(clients, mode, slots, max_loras=2, base_dir="/pool/cache/base_weights",
                                host_cache_bytes=host_cache_bytes)
    runner = web.AppRunner(PoolFront(dispatcher, KEY, urls).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            yield http, dispatcher
    finally:
        await runner.cleanup()
        await asyncio.gather(*(c.aclose() for c in clients))


async def tokens(http: httpx.AsyncClient, run: str, stream: bool, max_tokens: int = 3) -> list[int]:
    body = {"model": "policy", "prompt": f"{run} asks", "max_tokens": max_tokens, "n": 2, "logprobs": 0,
            "return_token_ids": True, "stream": stream}
    resp = await http.post(f"/runs/{run}/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not stream:  # the simulator always streams: the front passes the bytes through either way
        lines = resp.text.splitlines()
    else:
        lines = [line async for line in resp.aiter_lines()]
    import json

    out = []
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                out += choice["token_ids"]
    assert out, resp.text
    return out


async def attach(http, *runs: str) -> None:
    for run in runs:
        assert (await http.post(f"/runs/{run}/attach", json={"run_dir": f"/runs/{run}"})).status_code == 200


def test_full_weight_runs_take_turns_each_with_its_own_weights():
    async def main():
        with sim_server(token_delay=0.005, token=ADMIN, api_key=KEY) as url:
            async with front([url], "full") as (http, dispatcher):
                await attach(http, "a", "b")
                # not resident yet: only noted, loaded when the server next switches to run a
                noted = (await http.post("/runs/a/weights", json={"step_dir": "/runs/a/weights/step_3"})).json()
                assert noted["resident"] is False
                results = await asyncio.gather(*(tokens(http, run, stream=i % 2 == 0)
                                                 for i in range(6) for run in ("a", "b")))
                for i, got in enumerate(results):
                    want = token_for(3) if i % 2 == 0 else token_for(0)  # b: the base, never a's weights
                    assert set(got) == {want}, (i, got)
                assert dispatcher.switches >= 1
                # the run the server holds is reloaded in place at once
                holder = dispatcher.replicas[0].holder
                step = 5 if holder == "a" else 0
                if holder == "a":
                    done = (await http.post("/runs/a/weights", json={"step_dir": "/runs/a/weights/step_5"})).json()
                    assert done["resident"] is True
                assert set(await tokens(http, holder, stream=True)) == {token_for(step if holder == "a" else 0)}
                stats = (await http.get("/pool/stats")).json()
                assert stats["runs"]["a"]["requests"] >= 6 and stats["runs"]["b"]["requests"] >= 6
                assert 0.0 <= stats["idle_fraction"] <= 1.0
    asyncio.run(main())


def test_a_switch_to_a_run_that_published_elsewhere_loads_from_host_ram():
    async def main():
        with sim_server(token_delay=0.005, token=ADMIN, api_key=KEY) as url:
            async with front([url], "full", host_cache_bytes=2**30) as (http, dispatcher):
                await attach(http, "a", "b")
                for step in (2, 3):  # staged on publish; step 2 is dropped when step 3 comes
                    await http.post("/runs/a/weights", json={"step_dir": f"/runs/a/weights/step_{step}"})
                await asyncio.sleep(0.2)  # staging goes on in the background
                results = await asyncio.gather(*(tokens(http, run, stream=True) for _ in range(4) for run in ("b", "a")))
                for i, got in enumerate(results):
                    assert set(got) == {token_for(0) if i % 2 == 0 else token_for(3)}, (i, got)
                stats = (await http.get("/pool/stats")).json()
                assert stats["switches_from_host"] >= 1 and stats["host_cache_bytes"] == 2**30, stats
    asyncio.run(main())


def test_lora_runs_share_a_server_at_once_each_with_its_adapter():
    async def main():
        with sim_server(token_delay=0.02, token=ADMIN, api_key=KEY) as url:
            async with front([url], "lora") as (http, dispatcher):
                await attach(http, "a", "b")
                for run, step in (("a", 2), ("b", 7)):
                    timings = (await http.post(f"/runs/{run}/weights", json={"step_dir": f"/w/{run}/step_{step}"})).json()
                    assert timings["servers"] == 1
                results = await asyncio.gather(*(tokens(http, run, stream=True) for _ in range(4) for run in ("a", "b")))
                for i, got in enumerate(results):
                    assert set(got) == {token_for(2 if i % 2 == 0 else 7)}, (i, got)
                assert dispatcher.switches == 0
                assert fetch_stats(url)["peak_active"] >= 2  # served together, not by turns
                runs = (await http.get("/pool/stats")).json()["runs"]  # `rlctl monitor POOL` shows the served step
                assert {n: r["weights"] for n, r in runs.items()} == {"a": "/w/a/step_2", "b": "/w/b/step_7"}, runs
                full = await http.post("/runs/c/attach", json={"run_dir": "/runs/c"})  # max_loras=2 here
                assert full.status_code == 409 and "inference.max_loras=2" in full.text
                await http.post("/runs/a/detach")
                assert "a" not in dispatcher.runs
                missing = await http.post("/runs/a/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert missing.status_code == 404 and "not attached" in missing.text
    asyncio.run(main())


def test_only_the_pool_key_opens_it():
    async def main():
        with sim_server(token_delay=0.005, token=ADMIN, api_key=KEY) as url:
            async with front([url], "lora") as (http, _dispatcher):
                assert (await http.get("/health", headers={"Authorization": ""})).status_code == 200
                for route in ("/pool/stats", "/runs/a/attach"):
                    for bad in ("", f"Bearer {ADMIN}", "Bearer nope"):
                        resp = await http.request("GET" if route.startswith("/pool") else "POST", route,
                                                  headers={"Authorization": bad}, json={})
                        assert resp.status_code == 401, (route, bad)
    asyncio.run(main())


@pytest.mark.parametrize("slots", [1])
def test_a_waiting_run_is_served_while_another_keeps_the_server_busy(slots):
    """One slot, run a floods it: HRRS still serves run b's request within a few of a's."""
    async def main():
        with sim_server(token_delay=0.01, token=ADMIN, api_key=KEY) as url:
            async with front([url], "lora", slots=slots) as (http, dispatcher):
                await attach(http, "a")
                await tokens(http, "a", stream=True)  # measured: a's requests are short
                await attach(http, "b")
                flood = [asyncio.create_task(tokens(http, "a", stream=True)) for _ in range(12)]
                await asyncio.sleep(0.05)
                await tokens(http, "b", stream=True)
                served_before_b = dispatcher.runs["a"].requests - 1
                await asyncio.gather(*flood)
                assert served_before_b < 12, "b waited for the whole flood: no response-ratio priority"
    asyncio.run(main())


def test_runs_that_ended_without_detaching_are_found(tmp_path):
    """A run killed before it could detach: finished (DONE) or its local supervisor gone."""
    from rlctl.inference.pool_service import ended_runs

    dispatcher = PoolDispatcher([InferenceClient("http://127.0.0.1:9", ADMIN)], "full", 4)
    for name, state, done in (("live", "running", False), ("cancelled", "cancelled", False),
                              ("finished", "running", True), ("slurm", None, False)):
        (tmp_path / name / "status").mkdir(parents=True)
        if state:
            (tmp_path / name / "status" / "supervisor.json").write_text(f'{{"state": "{state}"}}')
        if done:
            (tmp_path / name / "DONE").write_text("{}")
        dispatcher.attach(name, str(tmp_path / name))
    assert sorted(ended_runs(dispatcher)) == ["cancelled", "finished"]


def test_the_pool_is_re_announced_before_an_attach_or_detach_is_answered():
    """`rlctl pool show` reads the announcement: right after a run's detach it must not list the run."""
    async def main():
        server = InferenceClient("http://127.0.0.1:9", ADMIN)  # never asked: attaching a full run is bookkeeping
        dispatcher = PoolDispatcher([server], "full", 8, max_loras=2, base_dir="/pool/cache/base_weights")
        pool_front = PoolFront(dispatcher, KEY, [])
        seen: list[list[str]] = []
        pool_front.on_change = lambda: seen.append(sorted(dispatcher.stats()["runs"]))
        runner = web.AppRunner(pool_front.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as http:
                await attach(http, "a", "b")
                after_attach = list(seen)
                assert (await http.post("/runs/a/detach")).status_code == 200
                return after_attach, seen
        finally:
            await runner.cleanup()
            await server.aclose()

    after_attach, seen = asyncio.run(main())
    assert after_attach == [["a"], ["a", "b"]] and seen[-1] == ["b"]
