"""Multi-turn trajectories: token ids from the server across turns, loss masks, budgets, the off-policy
bound on the oldest generated token, and zero gradient for environment tokens."""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
import torch

from rlctl.orchestrator.advantages import is_stale
from rlctl.orchestrator.batch import Group, Rollout, build_batch_tensors
from rlctl.orchestrator.environments import Prompt, load_environment
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter, read_batch, step_dir
from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop
from rlctl.orchestrator.trajectory import ENV_VERSION, Budget, Segment, TokenClient, Trajectory


class FakeServer:
    """vLLM's /v1/completions for token-id and text prompts: a character is its own token id (ord), the
    "policy" repeats the last context token, every token has logprob -0.5. Records each request."""

    def __init__(self, policy: PolicyVersion, bump_on_request: int | None = None):
        self.policy = policy
        self.bump_on_request = bump_on_request  # the n-th generation request first bumps the policy version
        self.requests: list[tuple[str, dict]] = []
        self.generations = 0

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append((request.headers.get("X-Request-Id", ""), body))
        prompt = body["prompt"]
        if body.get("echo") and body["max_tokens"] == 0:  # tokenisation
            ids = [ord(c) for c in prompt]
            return web.json_response({"choices": [{"index": 0, "text": prompt, "prompt_token_ids": ids}]})
        self.generations += 1
        if self.generations == self.bump_on_request:
            await self.policy.set(self.policy.version + 1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        n = body.get("n", 1)
        for number, one in enumerate(prompt if batch else [prompt]):  # choices numbered as vLLM does
            ids = [ord(c) for c in one] if isinstance(one, str) else list(one)
            for sample in range(n):  # vLLM interleaves the samples; here one after the other
                context = list(ids)
                for step in range(body["max_tokens"]):
                    tok = context[-1]
                    context.append(tok)
                    choice = {"index": number * n + sample, "text": chr(tok), "token_ids": [tok],
                              "logprobs": {"token_logprobs": [-0.5]},
                              "finish_reason": "length" if step == body["max_tokens"] - 1 else None}
                    if step == 0:
                        choice["prompt_token_ids"] = ids
                    await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _serve(server: FakeServer):
    from aiohttp import web

    app = web.Application()
    app.add_routes([web.post("/v1/completions", server.completions)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _client(session, url, policy, name="t"):
    return TokenClient(session, url, {}, policy, model="policy", temperature=1.0, timeout_s=30,
                       request_id=name, cache_salt=lambda v: f"salt-{v}")


def _prompt(key="3", value="7"):
    table = "0123456789".replace(key, "x")
    return Prompt(f"k{key}", value, {"key": key, "table": table.replace("x", value)})


def test_tool_trajectory_sends_token_ids_and_masks_the_tool_reply():
    import aiohttp

    async def main():
        policy = PolicyVersion(2)
        server = FakeServer(policy, bump_on_request=2)  # the weights change between the two turns
        runner, url = await _serve(server)
        try:
            async with aiohttp.ClientSession() as session:
                env = load_environment("tool_lookup")
                traj = await env.rollout(_client(session, url, policy), _prompt(), Budget(2, 1, 4))
        finally:
            await runner.cleanup()
        return server, traj, env

    server, traj, env = asyncio.run(main())
    (id1, first), (_, tok), (id2, second) = server.requests
    assert first["prompt"] == "k3" and first["max_tokens"] == 1 and first["cache_salt"] == "salt-2"
    assert tok == {**tok, "prompt": "=7", "echo": True, "max_tokens": 0, "add_special_tokens": False}
    # Turn 2's prompt: the server's prompt ids + the generated id + the server's ids of the tool reply.
    assert second["prompt"] == [ord("k"), ord("3"), ord("3"), ord("="), ord("7")]
    assert second["cache_salt"] == "salt-2" and id1 != id2  # sent before the new weights; its tokens came after
    assert traj.prompt_ids == [ord("k"), ord("3")] and traj.turns == 2
    assert traj.completion_ids == [ord("3"), ord("="), ord("7"), ord("7")]
    assert traj.loss_mask == [True, False, False, True]
    assert traj.versions == [2, ENV_VERSION, ENV_VERSION, 3] and traj.logprobs == [-0.5, 0.0, 0.0, -0.5]
    assert traj.text == "3=77" and env.reward(_prompt(), traj.reward_text) == pytest.approx(1.0)


def test_reward_credits_call_and_answer_separately():
    env = load_environment("tool_lookup", {"call_suffix": "?", "call_format_credit": 0.1, "call_key_credit": 0.2})
    p = _prompt()
    score = lambda call, answer: env.reward(p, json.dumps({"call": call, "answer": answer}))  # noqa: E731
    assert score("3?", "7") == pytest.approx(1.0)
    assert score("3?", "5") == pytest.approx(0.3)
    assert score("4?", "5") == pytest.approx(0.1)
    assert score("3", "7") == pytest.approx(0.9)  # the answer counts even after a malformed call
    assert env.reply(p, "3?") == "=7" and env.reply(p, "3") == "=?" and env.reply(p, "") == "=?"
    assert env.reward(p, "not a transcript") == 0.0


def test_trajectory_budgets():
    traj = Trajectory("p", Budget(max_turns=3, max_tokens_per_turn=4, max_tokens=7), prompt_ids=[1])
    assert traj.next_turn_tokens() == 4
    traj.add_turn(Segment([5, 6, 7], [-1.0] * 3, [0] * 3, True))
    assert traj.next_turn_tokens() == 4
    assert traj.add_environment([8, 9]) and traj.remaining_tokens == 2 and traj.next_turn_tokens() == 2
    with pytest.raises(ValueError, match="budget"):
        traj.add_turn(Segment([1, 2, 3], [-1.0] * 3, [0] * 3, True))  # 3 tokens, 2 left
    assert not traj.add_environment([10, 11, 12])  # cut to the 2 tokens left: the trajectory ends
    assert traj.truncated and traj.completion_ids == [5, 6, 7, 8, 9, 10, 11] and not traj.can_generate()
    assert traj.finish_reason == "budget" and traj.loss_mask == [True] * 3 + [False] * 4

    turns = Trajectory("p", Budget(max_turns=1, max_tokens_per_turn=2, max_tokens=10), prompt_ids=[1])
    turns.add_turn(Segment([5], [-1.0], [0], True))
    assert not turns.can_generate()  # max_turns reached although tokens are left
    with pytest.raises(ValueError):
        turns.add_turn(Segment([6], [-1.0], [0], True))


def test_a_trajectory_ends_where_the_servers_context_does():
    """A tool's long replies grew the context past max_model_len: the server refused the next turn (400)
    and the run failed, although the budget (max_trajectory_tokens) still had room."""
    traj = Trajectory("p", Budget(max_turns=9, max_tokens_per_turn=4, max_tokens=100, context_tokens=12),
                      prompt_ids=[1, 2, 3])
    assert traj.remaining_tokens == 9 and traj.next_turn_tokens() == 4
    traj.add_turn(Segment([5, 6, 7, 8], [-1.0] * 4, [0] * 4, True))
    assert not traj.add_environment(list(range(20, 30)))  # cut to the 5 tokens the context has left
    assert len(traj.context_ids()) == 12 and not traj.can_generate() and traj.finish_reason == "budget"
    # before the first turn the prompt's length is unknown: the server clamps that turn itself
    assert Trajectory("p", Budget(1, 4, 100, context_tokens=2)).next_turn_tokens() == 4


def test_an_empty_text_is_no_tokens_without_asking_the_server():
    """The server refuses an empty prompt (400): a tool that replied nothing failed the run."""
    client = TokenClient(None, "http://unused", {}, PolicyVersion(0), model="policy", temperature=1.0,
                         timeout_s=1, request_id="t", cache_salt=str)
    assert asyncio.run(client.tokenize("")) == []


def _rollout(versions, mask, start_version=0, group_id=0):
    n = len(versions)
    return Rollout(group_id, 0, [1, 2], list(range(10, 10 + n)), [-0.5 if m else 0.0 for m in mask], versions,
                   start_version=start_version, loss_mask=mask, turns=2)


def test_off_policy_bound_applies_to_the_oldest_generated_token():
    # turn 1 at v3, tool reply, turn 2 at v5
    r = _rollout([3, 3, ENV_VERSION, 5], [True, True, False, True])
    assert r.oldest_version == 3 and r.trained_versions == [3, 3, 5]
    group = Group(0, _prompt(), [r])
    assert group.newest_version == 5
    assert is_stale(group, step=5, max_off_policy_steps=1)  # needs >= 4: its oldest token is too old
    assert not is_stale(group, step=4, max_off_policy_steps=1)
    # environment tokens carry no version: they never make a fresh trajectory look stale
    fresh = Group(1, _prompt(), [_rollout([5, ENV_VERSION, 5], [True, False, True])])
    assert fresh.oldest_version == 5 and not is_stale(fresh, step=5, max_off_policy_steps=0)


def test_batch_tensors_carry_per_token_masks():
    r = _rollout([3, ENV_VERSION, ENV_VERSION, 4], [True, False, False, True])
    single = Rollout(1, 0, [1, 2, 3], [20], [-0.25], [4])  # a single-turn rollout in the same batch
    g = Group(0, _prompt(), [r, single], advantages=[0.5, -0.5])
    t = build_batch_tensors([g], step=4)
    assert t["loss_mask"][0].tolist() == [False, False, True, False, False, True]
    assert t["loss_mask"][1].tolist() == [False, False, False, True, False, False]
    assert t["policy_version"][0].tolist() == [-1, -1, 3, -1, -1, 4]
    assert t["inference_logprobs"][0].tolist() == [0.0, 0.0, -0.5, 0.0, 0.0, -0.5]
    assert t["attention_mask"][0].all() and t["input_ids"][0].tolist() == [1, 2, 10, 11, 12, 13]


def _gradients(model, rows: list[tuple[list[int], list[bool], list[float]]], advantages: list[float]):
    """Parameter gradients of one trainer step's loss (the trainer's target shift, log-probs and loss)."""
    from rlctl.trainer.context_parallel import next_token_targets
    from rlctl.trainer.loss import importance_ratio_loss, logprobs_of_labels

    groups = [Group(i, _prompt(), [Rollout(i, 0, ids[:2], ids[2:], lps, [0 if m else ENV_VERSION for m in mask],
                                           loss_mask=mask)], advantages=[a])
              for i, ((ids, mask, lps), a) in enumerate(zip(rows, advantages))]
    batch = next_token_targets(build_batch_tensors(groups, step=0))
    model.zero_grad()
    logprobs, _ = logprobs_of_labels(model(input_ids=batch["input_ids"]).logits, batch["labels"])
    loss, _ = importance_ratio_loss(logprobs, batch["inference_logprobs"], batch["advantages"], batch["loss_mask"],
                                    SimpleNamespace(mask_low=0.0, mask_high=1e9))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_environment_tokens_get_zero_gradient(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlctl.trainer.tiny_model import build_tiny_model, vocab

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_model(tmp_path / "m")), dtype=torch.float64)
    v = vocab()
    ids = lambda text: [v[c] for c in text]  # noqa: E731
    call, reply = ids("k3") + ids("3"), ids("=7")
    # The same trajectory with the tool's reply appended (loss mask 0), and without it.
    with_env = _gradients(model, [(call + reply, [True, False, False], [-0.5, -3.0, -9.0])], [1.0])
    without = _gradients(model, [(call, [True], [-0.5])], [1.0])
    assert without.abs().sum() > 0
    assert torch.allclose(with_env, without, rtol=0, atol=1e-12)
    # Whatever the environment tokens' logprobs say, they do not move the gradient ...
    garbage = _gradients(model, [(call + reply, [True, False, False], [-0.5, 5.0, -50.0])], [1.0])
    assert torch.allclose(garbage, without, rtol=0, atol=1e-12)
    # ... and a multi-turn row (turn 2 after the reply) trains only the generated tokens: trained, the
    # reply would change the gradient (so this test can tell a mask that is ignored).
    two_turns = (call + reply + ids("7"), [True, False, False, True], [-0.5, -3.0, -3.0, -0.5])
    masked = _gradients(model, [two_turns], [1.0])
    trained = _gradients(model, [(two_turns[0], [True] * 4, two_turns[2])], [1.0])
    assert (masked - trained).abs().max() > 1e-4


def test_rollout_loop_runs_multi_turn_groups(tmp_path):
    """The loop with a multi-turn environment: group_size trajectories per prompt through a server, the
    masks into the batch, unique request ids, the turns metric, lag measured on generated tokens only."""

    async def main():
        policy = PolicyVersion(0)
        server = FakeServer(policy)
        runner, url = await _serve(server)
        writer, records = FilesystemBatchWriter(tmp_path), []
        settings = LoopSettings(rollouts_per_step=4, group_size=2, max_tokens=1, max_off_policy_steps=0,
                                max_in_flight=0, max_steps=2, max_turns=2, max_trajectory_tokens=4)
        loop = RolloutLoop(settings, load_environment("tool_lookup"), url, None, policy, writer, rng=random.Random(0),
                           on_batch=lambda step, groups, metrics: records.append(metrics))
        try:
            run = asyncio.create_task(loop.run())
            while not (tmp_path / "step_0" / "COMPLETE").exists():
                await asyncio.sleep(0.01)
            await policy.set(1)  # batch 1 needs version 1: groups generated before are dropped
            await run
        finally:
            await runner.cleanup()
        return records, server

    records, server = asyncio.run(main())
    ids = [rid for rid, _ in server.requests]
    assert len(ids) == len(set(ids))  # one request id per request, never reused
    for step in (0, 1):  # the rollout files as the trainer reads them
        t, _ = read_batch(step_dir(tmp_path, step))
        mask, versions = t["loss_mask"], t["policy_version"]
        assert mask.shape == (4, 6) and mask.sum(dim=1).tolist() == [2] * 4
        assert mask[:, 2].all() and not mask[:, 3:5].any() and mask[:, 5].all()  # call, reply, answer
        assert (versions[:, 3:5] == -1).all() and (versions[mask] == step).all()
        assert t["rewards"].eq(1.0).all()  # the fake policy repeats the key, then the value
    assert [r["turns_mean"] for r in records] == [2.0, 2.0]
    assert records[1]["off_policy_lag_max"] == 0
    turns = [body for _, body in server.requests if body["max_tokens"] > 0]
    first = [body["n"] for body in turns if isinstance(body["prompt"], str)]
    assert first and set(first) == {2}  # a group's first turns: one request with n = group_size
    # its second turns (the same context: the fake policy is deterministic) in one request too
    assert {body["n"] for body in turns if not isinstance(body["prompt"], str)} == {2}


def test_turns_reached_together_share_one_request_and_late_ones_form_the_next():
    import aiohttp

    from rlctl.orchestrator.trajectory import SharedTurns

    async def main():
        policy = PolicyVersion(0)
        server = FakeServer(policy)
        runner, url = await _serve(server)
        shared = SharedTurns()
        try:
            async with aiohttp.ClientSession() as session:
                async def one(name: str, prompt: str, delay: float) -> Trajectory:
                    if delay:
                        await asyncio.sleep(delay)
                    client = TokenClient(session, url, {}, policy, model="policy", temperature=1.0, timeout_s=30,
                                         request_id=name, cache_salt=str, shared_turns=shared)
                    traj = client.new_trajectory(prompt, Budget(2, 2, 8))
                    await client.generate(traj)
                    await client.generate(traj)
                    return traj

                trajs = await asyncio.gather(one("a", "k3", 0), one("b", "k3", 0), one("c", "k4", 0),
                                             one("late", "k3", 0.05))
        finally:
            await runner.cleanup()
        return server, trajs

    server, trajs = asyncio.run(main())
    sent = [(body["prompt"], body["n"]) for _, body in server.requests]
    k3, k4 = [ord("k"), ord("3")], [ord("k"), ord("4")]
    assert sent == [(["k3", "k3", "k4"], 1), ([k3 + [ord("3")] * 2] * 2 + [k4 + [ord("4")] * 2], 1),  # together
                    ("k3", 1), (k3 + [ord("3")] * 2, 1)]  # the late one's turns, on their own
    for traj, prompt in zip(trajs, ("k3", "k3", "k4", "k3")):
        assert traj.prompt_ids == [ord(c) for c in prompt] and traj.completion_ids == [ord(prompt[1])] * 4
        assert traj.turns == 2 and traj.logprobs == [-0.5] * 4


def test_a_failed_shared_first_turn_fails_every_trajectory_that_joined_it():
    import aiohttp
    from aiohttp import web

    from rlctl.orchestrator.trajectory import SharedTurns

    class Busy:  # every request answered 503, as an overloaded router does
        async def completions(self, request):
            return web.Response(status=503, text="busy")

    async def main():
        runner, url = await _serve(Busy())
        shared, policy = SharedTurns(), PolicyVersion(0)
        try:
            async with aiohttp.ClientSession() as session:
                async def one(name: str):
                    client = TokenClient(session, url, {}, policy, model="policy", temperature=1.0, timeout_s=30,
                                         request_id=name, cache_salt=str, shared_turns=shared)
                    await client.generate(client.new_trajectory("k3", Budget(1, 1, 1)))

                return await asyncio.gather(*(one(n) for n in "abc"), return_exceptions=True)
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    assert [type(r).__name__ for r in results] == ["ClientResponseError"] * 3, results


def test_a_shared_turn_cancelled_while_it_forms_fails_its_joiners_instead_of_leaving_them_waiting():
    from rlctl.orchestrator.trajectory import SharedTurns

    class NeverAsked:
        async def stream_turns(self, request, count):
            raise AssertionError("a cancelled request must not be sent")

    async def main():
        shared, body = SharedTurns(), {"prompt": "k3", "max_tokens": 1, "n": 1}
        leader = asyncio.create_task(shared.generate(NeverAsked(), body))
        await asyncio.sleep(0)  # the leader opens the request and yields for others to join
        joiner = asyncio.create_task(shared.generate(NeverAsked(), body))
        await asyncio.sleep(0)  # the joiner has joined; the request is still forming
        leader.cancel()
        results = await asyncio.wait_for(asyncio.gather(leader, joiner, return_exceptions=True), 5)
        late = asyncio.create_task(shared.generate(NeverAsked(), body))  # opens a new request
        await asyncio.sleep(0)
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        return results

    leader, joiner = asyncio.run(main())
    assert isinstance(leader, asyncio.CancelledError)
    assert isinstance(joiner, RuntimeError) and "cancelled" in str(joiner)


def test_tokenisations_of_short_texts_are_shared_between_clients():
    import aiohttp

    async def main():
        policy = PolicyVersion(0)
        server = FakeServer(policy)
        runner, url = await _serve(server)
        cache: dict = {}
        try:
            async with aiohttp.ClientSession() as session:
                a, b = (TokenClient(session, url, {}, policy, model="policy", temperature=1.0, timeout_s=30,
                                    request_id=n, cache_salt=str, token_cache=cache) for n in "ab")
                assert await a.tokenize("=7") == await b.tokenize("=7") == [ord("="), ord("7")]
                # asked at once by several clients: one request, every one gets the ids
                together = await asyncio.gather(a.tokenize("=8"), b.tokenize("=8"), a.tokenize("=8"))
                assert together == [[ord("="), ord("8")]] * 3
                long = "x" * 100
                assert await a.tokenize(long) == await b.tokenize(long) == [ord("x")] * 100
        finally:
            await runner.cleanup()
        return server, cache

    server, cache = asyncio.run(main())
    assert [body["prompt"] for _, body in server.requests] == ["=7", "=8", "x" * 100, "x" * 100]  # long: not kept
    assert list(cache) == ["=7", "=8"]
