"""One real vLLM CPU server on the tiny model, started by `python -m rlctl.inference` like the launchers do:
admin routes need the run token, weights reload in place with requests in flight and then match a
transformers forward pass of the new weights (tied LM head included), and a router in front works.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from rlctl.inference.client import (  # noqa: E402
    SAMPLED_LOGPROBS,
    SERVED_MODEL_NAME,
    InferenceClient,
    InferenceError,
    parse_samples,
    policy_cache_salt,
    prompt_logprobs_of,
    reload_all,
)
from rlctl.inference.processes import has_exited, stop_process_group  # noqa: E402
from rlctl.inference.router import start_router  # noqa: E402
from rlctl.launchers.local import KILL_AFTER_S  # noqa: E402
from e2e_checks import leftover_processes, running, wait_for  # noqa: E402
from rlctl.orchestrator.exchange.layout import RunDir  # noqa: E402
from rlctl.orchestrator.exchange.files import atomic_write_json  # noqa: E402
from rlctl.recipes.load import load_recipe  # noqa: E402
from inference_fixtures import HOST, START_TIMEOUT_S, served, start_inference  # noqa: E402

PROMPT = [1] + list(range(4, 40))  # <bos> then 36 characters of the tiny vocabulary


def make_run(root: Path, *overrides: str) -> RunDir:
    run = RunDir(root)
    run.create()
    # engine stats on: the tests read vLLM's preemption counter from /metrics
    recipe = load_recipe(["tiny-cpu"], ["trainer.dtype=float32", "inference.engine_stats=true", *overrides])
    atomic_write_json(run.recipe_json, recipe.model_dump(mode="json"))
    run.admin_token(create=True)
    run.api_key(create=True)
    return run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference-run")
    run = make_run(root / "run")
    with served(run, root / "inference.log") as (info, proc):
        yield run, info, run.admin_token(), proc


def transformers_prompt_logprobs(model_dir: Path, state: dict | None = None) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)  # copies in place: the tied head follows the embedding
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)
    return [logp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]


def served_prompt_logprobs(client: InferenceClient, version: int) -> list[float]:
    resp = asyncio.run(_complete(client, version))
    return prompt_logprobs_of(resp)[1:]


async def _complete(client, version):
    async with client:
        return await client.complete(PROMPT, max_tokens=1, prompt_logprobs=0, cache_salt=policy_cache_salt(version))


def lm_head_tied(url: str, token: str) -> bool:
    """Whether the served LM head still shares the embedding's storage (after a reload re-tied it)."""
    async def ask():
        async with InferenceClient(url, token) as c:
            return await c.collective_rpc("rlctl_lm_head_tied")

    answers = asyncio.run(ask())  # one per worker
    return bool(answers) and all(a == "True" for a in answers)


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_announcement_names_a_node_address(server):
    run, info, token, proc = server
    assert info["url"].startswith(f"http://{HOST}:") and info["index"] == 0 and info["pid"] > 0


@pytest.mark.parametrize("method, route", [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                                           ("POST", "/collective_rpc"), ("GET", "/v1/models")])
def test_admin_and_api_routes_refuse_missing_or_wrong_token(server, method, route):
    import httpx

    run, info, token, proc = server
    url = info["url"] + route
    assert httpx.request(method, url, timeout=30).status_code == 401
    assert httpx.request(method, url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert httpx.request(method, url, headers={"Authorization": f"Token {token}"}, timeout=30).status_code == 401
    assert httpx.get(info["url"] + "/health", timeout=30).status_code == 200
    ok = httpx.get(info["url"] + "/is_paused", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert ok.status_code == 200 and ok.json() == {"is_paused": False}
    # The api key (the one sent through the router) opens /v1 and nothing else.
    api = httpx.request(method, url, headers={"Authorization": f"Bearer {run.api_key()}"}, timeout=30)
    assert api.status_code == (200 if route.startswith("/v1/") else 401)


def preemptions(url: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_preemptions_total"))


def publish_perturbed(run: RunDir) -> tuple[Path, dict]:
    """A new policy published as `weights/step_1`: every tensor perturbed, the embedding strongly (a
    stale tied LM head would show), written as two ranks would (two shards + the index)."""
    from safetensors.torch import load_file

    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, hf_state_dict, shard_files
    from rlctl.trainer.weights import load_config

    state = load_file(str(run.model / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    new = {k: v + (0.5 if "embed_tokens" in k else 0.05) * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    config = load_config(run.model)
    names = sorted(hf_state_dict(new, config))
    halves = [{k: new[k].contiguous() for k in names[i::2]} for i in range(2)]
    step_dir = FilesystemWeightStore(run.weights).publish(1, config, halves)
    assert len(shard_files(step_dir)) == 2
    return step_dir, new


def test_reload_in_flight_matches_transformers_with_new_weights(server):
    from rlctl.inference.mapped_shards import MappedShards
    from rlctl.orchestrator.exchange.weights_fs import shard_files

    run, info, token, proc = server
    before = served_prompt_logprobs(InferenceClient(info["url"], token), 0)
    assert max_diff(before, transformers_prompt_logprobs(run.model)) < 1e-3
    step_dir, new = publish_perturbed(run)
    expected = transformers_prompt_logprobs(run.model, new)
    assert max_diff(expected, before) > 0.1  # the check below can tell old weights from new ones

    async def reload_with_requests_in_flight(n: int):
        server_client = InferenceClient(info["url"], token)
        async with server_client:
            tasks = [asyncio.create_task(server_client.complete("abc", max_tokens=32, cache_salt=policy_cache_salt(0),
                                                              extra={"ignore_eos": True}))
                     for _ in range(n)]
            await asyncio.sleep(0.5)
            timing = await reload_all([server_client], str(step_dir))
            results = await asyncio.gather(*tasks)
            return timing, results

    preempted = preemptions(info["url"])
    timing, results = asyncio.run(reload_with_requests_in_flight(64))
    print(f"\n[measure] pause→reload→resume with 64 requests in flight: {timing}")
    assert all(len(parse_samples(r)[0].token_ids) == 32 for r in results)  # none lost to the pause
    # TP = 1: the server needs every tensor, so it reads every tensor's bytes, once
    assert timing["bytes_read_max"] == MappedShards(shard_files(step_dir)).data_bytes()
    # kept, not preempted: the frozen requests continued from their KV instead of re-prefilling it
    assert preemptions(info["url"]) == preempted
    after = served_prompt_logprobs(InferenceClient(info["url"], token), 1)
    assert max_diff(after, expected) < 1e-3
    assert lm_head_tied(info["url"], token)


def test_tensor_parallel_workers_reload_their_slices_and_serve_the_new_weights(tmp_path, monkeypatch):
    """TP 2: each worker's loader narrows the memory-mapped shards to its slice (it reports the pages it
    touched, here every page: the tiny model's rows are smaller than a page) and the server then
    serves exactly the published weights, tied head included."""
    from rlctl.orchestrator.exchange.weights_fs import shard_files

    # the server wrapper binds each CPU worker's threads to its share of the cores (vLLM's default, a NUMA
    # node per worker, would not start on a one-node host)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    run = make_run(tmp_path / "run", "inference.tp=2")
    with served(run, tmp_path / "inference.log") as (info, proc):
        token = run.admin_token()
        step_dir, new = publish_perturbed(run)

        async def reload():
            async with InferenceClient(info["url"], token) as client:
                return await reload_all([client], str(step_dir))

        timing = asyncio.run(reload())
        assert 0 < timing["bytes_read_max"] <= sum(f.stat().st_size for f in shard_files(step_dir)) + (4 << 20)
        after = served_prompt_logprobs(InferenceClient(info["url"], token), 1)
        assert max_diff(after, transformers_prompt_logprobs(run.model, new)) < 1e-3
        assert lm_head_tied(info["url"], token)


def test_switches_between_steps_staged_in_host_ram_serve_each_steps_weights(server):
    """A shared pool's switch loads a step its workers read into host RAM ahead (rlctl_stage): the
    served model then matches transformers with that step's weights, also when switching back to a
    step loaded before (a loader that kept the staged tensors as parameters would have overwritten it)."""
    from safetensors.torch import load_file

    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, hf_state_dict
    from rlctl.trainer.weights import load_config

    run, info, token, proc = server
    state = load_file(str(run.model / "model.safetensors"))
    config = load_config(run.model)
    steps, expected = {}, {}
    for step, seed in ((20, 11), (21, 12)):
        gen = torch.Generator().manual_seed(seed)
        new = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        steps[step] = FilesystemWeightStore(run.weights).publish(step, config, [hf_state_dict(new, config)])
        expected[step] = transformers_prompt_logprobs(run.model, new)
    assert max_diff(expected[20], expected[21]) > 0.1

    async def stage_then_switch(order):
        async with InferenceClient(info["url"], token) as c:
            for step in steps:
                await c.stage(str(steps[step]), 2**30)
            served = []
            for step in order:
                timing = await reload_all([c], str(steps[step]))
                served.append((step, timing["from_host"], timing["bytes_read_max"]))
            return served

    for step, from_host, bytes_read in asyncio.run(stage_then_switch([20, 21])):
        assert (from_host, bytes_read) == (1, 0), (step, from_host, bytes_read)
    assert max_diff(served_prompt_logprobs(InferenceClient(info["url"], token), 21), expected[21]) < 1e-3
    asyncio.run(stage_then_switch([20]))  # back to the first step, from RAM again
    assert max_diff(served_prompt_logprobs(InferenceClient(info["url"], token), 20), expected[20]) < 1e-3
    assert lm_head_tied(info["url"], token)


def test_reload_refuses_a_step_without_marker(server, tmp_path):
    run, info, token, proc = server
    partial = tmp_path / "step_9"
    partial.mkdir()

    async def go():
        async with InferenceClient(info["url"], token) as c:
            await c.reload(str(partial))

    with pytest.raises(InferenceError):
        asyncio.run(go())
    assert proc.poll() is None  # a refused reload does not take the server down


async def stream_as_the_rollout_loop_does(url: str, api_key: str) -> dict[int, tuple[list, list]]:
    """A streamed completion read by the orchestrator's own parser (aiohttp, completion_stream):
    {choice index: (token ids, logprobs)}."""
    import aiohttp

    from rlctl.orchestrator.completion_stream import streamed_choices

    body = {"model": SERVED_MODEL_NAME, "prompt": "abc", "n": 2, "max_tokens": 12, "ignore_eos": True,
            "stream": True, **SAMPLED_LOGPROBS}
    streamed = {0: ([], []), 1: ([], [])}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            async for choice, _version, ids, lps in streamed_choices(resp, None):
                streamed[choice["index"]][0].extend(ids)
                streamed[choice["index"]][1].extend(lps)
    return streamed


def test_completions_through_router(server, tmp_path):
    run, info, token, proc = server
    started = time.monotonic()
    router = start_router([info["url"]], "round_robin", api_key=run.api_key(), log_path=tmp_path / "router.log")
    print(f"\n[measure] router ready in {time.monotonic() - started:.2f} s")
    try:
        async def go():
            async with InferenceClient(router.url, run.api_key()) as via, InferenceClient(router.url, "wrong") as bad:
                resp = await via.complete("abc", max_tokens=6, n=4, temperature=1.0, cache_salt=policy_cache_salt(1),
                                          extra={"ignore_eos": True})
                # without rlctl's xarg vLLM answers as it does: token ids in place of the logprobs' strings
                plain = await via.complete("abc", max_tokens=3, extra={"ignore_eos": True, "vllm_xargs": {}})
                assert [t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"]] == [True] * 3
                with pytest.raises(InferenceError, match="401"):
                    await bad.complete("abc", max_tokens=2)
                # the router forwards `vllm_xargs` (the token-id logprobs xarg rides on it): vLLM refuses this one
                with pytest.raises(InferenceError, match="400"):
                    await via.complete("abc", max_tokens=1, extra={"vllm_xargs": {"nested": {"not": "allowed"}}})
                return resp, await stream_as_the_rollout_loop_does(router.url, run.api_key())

        resp, streamed = asyncio.run(go())
        assert all(len(ids) == len(lps) == 12 for ids, lps in streamed.values())
        # rlctl's requests get the sampled tokens' logprobs alone; the text is still detokenised
        # (a whole response also names vLLM's other fields, empty)
        assert all(not c["logprobs"].get(k) for c in resp["choices"] for k in ("tokens", "top_logprobs", "text_offset"))
        assert any(c["text"] for c in resp["choices"])
        samples = parse_samples(resp)
        assert len(samples) == 4
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) == 6 and all(lp <= 0.0 for lp in s.logprobs)
    finally:
        assert router.stop() is not None
    assert not router.alive()


def test_router_dies_with_the_process_that_started_it(server, tmp_path):
    """The router runs in its own session, so a killpg of its parent's group misses it: a SIGKILLed
    orchestrator (a fault, a teardown that escalates) must not leave it behind holding its ports."""
    run, info, _, _ = server
    start = (f"import time; from pathlib import Path; from rlctl.inference.router import start_router; "
             f"from rlctl.orchestrator.exchange.layout import RunDir; "
             f"r = start_router([{info['url']!r}], 'round_robin', api_key=RunDir({str(run.root)!r}).api_key(), "
             f"log_path=Path({str(tmp_path / 'r.log')!r})); "
             f"print(r.proc.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.PIPE, text=True)
    router_pid = None
    try:
        router_pid = int(parent.stdout.readline())
        assert running(router_pid)
        parent.kill()
        parent.wait()
        wait_for(lambda: not running(router_pid), 10, "the router to exit after its parent was SIGKILLed")
    finally:
        parent.kill()
        if router_pid is not None and running(router_pid):
            os.kill(router_pid, signal.SIGKILL)


def test_server_that_dies_at_start_reports_its_log_tail(tmp_path):
    bad_model = tmp_path / "broken-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text('{"model_type": "no-such-architecture", "head_dim": 32}')
    run = make_run(tmp_path / "run", f"model.name={json.dumps(str(bad_model))}")
    proc = start_inference(run, tmp_path / "log")
    try:
        assert proc.wait(300) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    assert "exited with code" in text and "last" in text and "lines of the server log" in text
    assert "no-such-architecture" in text.split("lines of the server log")[-1]
    assert run.admin_token() not in text and run.api_key() not in text


def _engine_started(run: RunDir) -> bool:
    """vLLM's engine core of this run exists: the server is in its engine handshake, where vLLM swallows a
    SIGTERM (it becomes a KeyboardInterrupt that its ZMQ socket context catches)."""
    needle = f"RLCTL_RUN_DIR={run.root}\0".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"EngineCore" in (proc / "cmdline").read_bytes() \
                    and needle in (proc / "environ").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_server_stopped_during_its_start_leaves_nothing(tmp_path, how):
    """SIGTERM to the wrapper mid start-up: it stops the server within its bound. SIGKILL: the wrapper can do
    nothing, so its launcher (here the test, as launchers/local.py does) stops the wrapper's session — which
    holds the server, its engine core and resource_tracker, none of them in a session of their own."""
    run = make_run(tmp_path / "run")
    proc = start_inference(run, tmp_path / "log")
    try:
        wait_for(lambda: _engine_started(run), START_TIMEOUT_S, "vLLM's engine core to start", poll=0.05)
        started = time.monotonic()
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 143
        else:
            proc.kill()
            wait_for(lambda: has_exited(proc), 30, "the wrapper to die")  # not reaped: its session is still ours
            stop_process_group(proc, 0)
        took = time.monotonic() - started
        wait_for(lambda: not leftover_processes(run.root), 5, f"no leftovers: {leftover_processes(run.root)}")
        print(f"\n[measure] {how} during start-up: wrapper and server gone in {took:.1f} s")
        assert took < KILL_AFTER_S  # the wrapper is done before its launcher would SIGKILL it
    finally:
        if proc.returncode is None:
            stop_process_group(proc, 0)
