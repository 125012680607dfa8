"""Rewards off the event loop: timeouts, exceptions and memory kills are counted and never stop the run;
the built-in exact-match, math and sandboxed code rewards."""
from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.orchestrator.environments import Environment, Prompt, load_environment
from rlctl.orchestrator.reward_config import RewardConfig
from rlctl.orchestrator.rewards import RewardScorer, RewardsFailing
from rlctl.recipes.errors import RecipeError

HERE = __name__  # how worker processes import the rewards below (module-level, by reference)


def behave(prompt, text):
    """A reward that does what the prompt's target says."""
    kind = prompt.target
    if kind == "sleep":
        time.sleep(60)
    elif kind == "raise":
        raise ValueError("reward bug")
    elif kind == "alloc":
        return float(len(bytearray(8 << 30)))  # 8 GiB, past memory_mb
    elif kind == "die":
        os._exit(3)
    elif kind == "orphan":  # a subprocess that would outlive its worker if only the worker were killed
        child = subprocess.Popen(["sleep", "300"])
        Path(prompt.info["pidfile"]).write_text(str(child.pid))
        time.sleep(60)
    return 1.0 if text != "half" else 0.5


def good_or_bad(prompt, text):
    return 1.0 if text == "good" else 1 / 0


good_or_bad.reward_inline = True


async def async_behave(prompt, text):
    await asyncio.sleep(60 if prompt.target == "sleep" else 0.2)
    return 1.0


class ScriptedEnvironment(Environment):
    """Prompts whose targets follow `script` (then "ok"); the reward runs `behave`."""

    def __init__(self, script: list[str]):
        self.script = script
        self.drawn = 0

    def sample_prompts(self, rng, n):
        out = []
        for _ in range(n):
            kind = self.script[self.drawn] if self.drawn < len(self.script) else "ok"
            out.append(Prompt(f"p{self.drawn}", kind))
            self.drawn += 1
        return out

    def reward(self, prompt, completion_text):
        return behave(prompt, completion_text)


class AsyncEnvironment(ScriptedEnvironment):
    async def reward(self, prompt, completion_text):
        return await async_behave(prompt, completion_text)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie nobody reaped yet is dead too


def test_pool_counts_timeouts_errors_memory_kills_and_keeps_serving(tmp_path):
    cfg = RewardConfig(function=f"{HERE}:behave", timeout_s=1.5, memory_mb=1024, workers=2)
    scorer = RewardScorer.build(cfg, env=None)
    assert scorer.mode == "pool"
    pidfile = tmp_path / "orphan.pid"

    async def main():
        gaps, stop = [], asyncio.Event()

        async def ticker():  # the event loop must stay responsive while rewards sleep or blow up
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        tick = asyncio.create_task(ticker())
        try:
            await scorer.start()
            kinds = ["sleep", "raise", "alloc", "die", "orphan", "ok"]
            results = await asyncio.gather(*(scorer.score(Prompt("q", k, {"pidfile": str(pidfile)}), "x")
                                             for k in kinds))
            after = await asyncio.gather(*(scorer.score(Prompt("q", "ok"), "half") for _ in range(6)))
            return results, after
        finally:
            stop.set()
            await tick
            await scorer.close()
            assert max(gaps) < 0.5, f"event loop blocked for {max(gaps):.2f} s"

    t0 = time.monotonic()
    results, after = asyncio.run(main())
    assert results == [None, None, None, None, None, 1.0]
    assert after == [0.5] * 6  # replaced workers serve again
    assert scorer.take_step_counts() == {"reward_timeouts": 2, "reward_errors": 2, "reward_memory_kills": 1,
                                         "reward_dropped_groups": 0}
    assert scorer.take_step_counts()["reward_timeouts"] == 0  # counts are per step: taken once
    assert time.monotonic() - t0 < 30
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the timed-out worker's subprocess survived it"


def test_score_group_applies_on_failure():
    async def group(on_failure):
        scorer = RewardScorer.build(RewardConfig(function=f"{HERE}:good_or_bad", on_failure=on_failure), env=None)
        assert scorer.mode == "inline"
        values = await scorer.score_group(Prompt("q", "ok"), ["good", "bad", "good"])
        return values, scorer.take_step_counts()

    values, counts = asyncio.run(group("zero"))
    assert values == [1.0, 0.0, 1.0] and counts["reward_errors"] == 1 and counts["reward_dropped_groups"] == 0
    values, counts = asyncio.run(group("drop_group"))
    assert values is None and counts["reward_errors"] == 1 and counts["reward_dropped_groups"] == 1


def test_a_reward_that_always_fails_stops_the_run_with_an_explanation():
    scorer = RewardScorer.build(RewardConfig(max_consecutive_failures=3), ScriptedEnvironment(["raise"]))
    assert scorer.mode == "inline"  # not loaded by name: nothing to rebuild it from in a worker

    async def main():
        for _ in range(2):
            assert await scorer.score(Prompt("q", "raise"), "x") is None
        assert await scorer.score(Prompt("q", "ok"), "x") == 1.0  # a success resets the streak
        for _ in range(2):
            await scorer.score(Prompt("q", "raise"), "x")
        await scorer.score(Prompt("q", "raise"), "x")

    with pytest.raises(RewardsFailing, match="3 reward calls in a row failed.*ValueError: reward bug"):
        asyncio.run(main())


def test_async_rewards_are_awaited_concurrently_with_a_timeout():
    env = load_environment(f"{HERE}:AsyncEnvironment", {"script": []})
    scorer = RewardScorer.build(RewardConfig(timeout_s=1.0), env, f"{HERE}:AsyncEnvironment", {"script": []})
    assert scorer.mode == "async"

    async def main():
        t0 = time.monotonic()
        values = await asyncio.gather(*(scorer.score(Prompt("q", "ok"), "x") for _ in range(50)),
                                      scorer.score(Prompt("q", "sleep"), "x"))
        return values, time.monotonic() - t0

    values, elapsed = asyncio.run(main())
    assert values == [1.0] * 50 + [None] and elapsed < 5  # 50 × 0.2 s serialised would take 10 s
    assert scorer.take_step_counts()["reward_timeouts"] == 1


def test_where_rewards_run_and_bad_references():
    sequence = load_environment("sequence")
    assert RewardScorer.build(None, sequence, "sequence", {}).mode == "inline"
    scripted = load_environment(f"{HERE}:ScriptedEnvironment", {"script": []})
    assert RewardScorer.build(None, scripted, f"{HERE}:ScriptedEnvironment", {"script": []}).mode == "pool"
    assert RewardScorer.build(RewardConfig(function="exact_match"), sequence).mode == "inline"
    assert RewardScorer.build(RewardConfig(function="code"), sequence).mode == "pool"
    assert RewardScorer.build(RewardConfig(function=f"{HERE}:async_behave"), sequence).mode == "async"
    for cfg, key in [(RewardConfig(function="nosuch"), "orchestrator.reward.function"),
                     (RewardConfig(function=f"{HERE}:missing"), "orchestrator.reward.function"),
                     (RewardConfig(function="exact_match", args={"case": True}), "orchestrator.reward.args")]:
        with pytest.raises(RecipeError) as err:
            RewardScorer.build(cfg, sequence)
        assert err.value.key == key and "\n" not in str(err.value)


def test_a_reward_that_cannot_load_in_a_worker_is_one_line_naming_the_key():
    scorer = RewardScorer.build(RewardConfig(function=f"{HERE}:behave", memory_mb=64, workers=1), env=None)
    with pytest.raises(RecipeError) as err:
        asyncio.run(scorer.start())
    assert err.value.key == "orchestrator.reward.memory_mb" and "MiB" in str(err.value)


def test_math_reward_refused_in_one_line_when_math_verify_is_missing(monkeypatch):
    from rlctl.orchestrator.reward_builtins import math_answer

    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RecipeError, match=r"^orchestrator\.reward\.function: .*math-verify"):
        RewardScorer.build(RewardConfig(function="math"), env=None)
    with pytest.raises(RecipeError, match="math-verify"):
        math_answer(Prompt("q", "1"), "1")


def test_recipe_reward_section_bounds():
    from rlctl.orchestrator.config import OrchestratorConfig
    from pydantic import ValidationError

    assert OrchestratorConfig().reward.on_failure == "zero"
    for bad in ({"on_failure": "skip"}, {"workers": 0}, {"timeout_s": float("nan")}, {"memory_mb": 1},
                {"timeout_s": 0.0}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            OrchestratorConfig(reward=bad)


# ---- the loop ---------------------------------------------------------------------------------------
class _Writer:
    def __init__(self):
        self.steps = []

    def write(self, step, tensors, meta):
        self.steps.append(step)


@pytest.mark.parametrize("on_failure", ["drop_group", "zero"])
def test_the_loop_survives_rewards_that_time_out_raise_or_exhaust_memory(on_failure):
    """Groups 1, 3 and 5 have rewards that sleep past the timeout, raise and allocate past the memory
    limit: the run writes every batch, the failures are in the step records, and the failed groups are
    dropped (and replaced) or kept with reward 0."""
    from sim_inference import sim_server

    from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop

    script = ["ok", "sleep", "ok", "raise", "ok", "alloc"]
    name, args = f"{HERE}:ScriptedEnvironment", {"script": script}
    env = load_environment(name, args)
    scorer = RewardScorer.build(RewardConfig(timeout_s=1.5, memory_mb=1024, workers=2, on_failure=on_failure),
                                env, name, args)
    assert scorer.mode == "pool"
    settings = LoopSettings(rollouts_per_step=8, group_size=2, max_tokens=2, max_off_policy_steps=1,
                            max_in_flight=0, max_steps=2)
    records, kept = [], []

    def on_batch(step, groups, metrics):
        records.append(metrics)
        kept.extend((g.prompt.target, [r.reward for r in g.rollouts]) for g in groups)

    writer = _Writer()
    with sim_server(token_delay=0.0, token="secret") as url:
        loop = RolloutLoop(settings, env, url, "secret", PolicyVersion(0), writer, rng=random.Random(0),
                           on_batch=on_batch, scorer=scorer)
        asyncio.run(asyncio.wait_for(loop.run(), 120))
    assert writer.steps == [0, 1]
    total = {k: sum(r[k] for r in records) for k in ("reward_timeouts", "reward_errors", "reward_memory_kills",
                                                     "reward_dropped_groups")}
    failed = {"sleep", "raise", "alloc"}
    assert total["reward_timeouts"] == 2 and total["reward_errors"] == 2 and total["reward_memory_kills"] == 2
    assert len(kept) == 8
    if on_failure == "drop_group":
        assert total["reward_dropped_groups"] == 3 and loop.started == 8 + 3
        assert all(target == "ok" and rewards == [1.0, 1.0] for target, rewards in kept)
    else:
        assert total["reward_dropped_groups"] == 0 and loop.started == 8
        assert sorted(t for t, _ in kept if t in failed) == sorted(failed)
        assert all(rewards == ([0.0, 0.0] if target in failed else [1.0, 1.0]) for target, rewards in kept)
    assert scorer._pool._workers == set()  # run() closed the pool


# ---- built-in rewards -------------------------------------------------------------------------------
def test_exact_match():
    from rlctl.orchestrator.reward_builtins import exact_match

    assert exact_match(Prompt("q", "Paris"), " Paris\n") == 1.0
    assert exact_match(Prompt("q", "Paris"), "paris") == 0.0
    assert exact_match(Prompt("q", "Paris"), "paris", ignore_case=True) == 1.0


def test_math_reward_accepts_equivalent_forms():
    pytest.importorskip("math_verify")
    from rlctl.orchestrator.reward_builtins import math_answer

    for target, completion in [("\\frac{1}{2}", "The answer is $0.5$."), ("0.5", "so \\boxed{\\frac{1}{2}}"),
                               ("2\\sqrt{2}", "$\\sqrt{8}$"), ("3", "x = 3")]:
        assert math_answer(Prompt("q", target), completion) == 1.0, (target, completion)
    for target, completion in [("1/3", "\\boxed{0.5}"), ("3", "no idea"), ("\\frac{1}{2}", "")]:
        assert math_answer(Prompt("q", target), completion) == 0.0, (target, completion)


def test_code_reward_in_the_pool_right_wrong_and_endless_programs():
    scorer = RewardScorer.build(RewardConfig(function="code", args={"time_limit_s": 1.0}, workers=2, timeout_s=20),
                                env=None)
    double = Prompt("Double the number.", "42", {"input": "21"})
    tests = Prompt("Add one.", "", {"tests": [{"input": "1", "output": "2"}, {"input": "9", "output": "10"}]})

    async def main():
        try:
            return await asyncio.gather(
                scorer.score(double, "Here you go:\n```python\nprint(int(input()) * 2)\n```"),
                scorer.score(double, "print(int(input()) + 2)"),
                scorer.score(double, "while True:\n    pass"),
                scorer.score(tests, "print(int(input()) + 1)"),
                scorer.score(tests, "print(2)"))
        finally:
            await scorer.close()

    t0 = time.monotonic()
    assert asyncio.run(main()) == [1.0, 0.0, 0.0, 1.0, 0.5]
    assert time.monotonic() - t0 < 15
    # An endless program fails its test; it is not a failure of the reward.
    assert set(scorer.take_step_counts().values()) == {0}


@pytest.fixture
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server.getsockname()[1]
    server.close()


CONNECT = """
try:
    import socket
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("open")
except Exception:
    print("blocked")
"""


def test_code_sandbox_blocks_the_network_in_each_layer(listening_port):
    from rlctl.orchestrator.reward_builtins import code_tests, network_namespace_available, run_program

    program = CONNECT.format(port=listening_port)
    # The control: without either layer the program reaches the listening socket.
    assert run_program(program, network_namespace=False, audit_hook=False).stdout.strip() == "open"
    assert run_program(program, network_namespace=False, audit_hook=True).stdout.strip() == "blocked"
    if network_namespace_available():
        assert run_program(program, network_namespace=True, audit_hook=False).stdout.strip() == "blocked"
    assert code_tests(Prompt("q", "blocked"), program) == 1.0  # the reward's defaults


def test_code_sandbox_limits_memory_processes_and_writes(tmp_path):
    from rlctl.orchestrator.reward_builtins import run_program

    assert run_program("x = bytearray(2 * 10**9)", memory_mb=256).returncode != 0
    assert "PermissionError" in run_program("import subprocess; subprocess.run(['true'])").stderr_tail
    outside = tmp_path / "escaped"
    result = run_program(f"open({str(outside)!r}, 'w').write('x')")
    assert "PermissionError" in result.stderr_tail and not outside.exists()
    assert run_program("open('inside', 'w').write('ok'); print(open('inside').read())").stdout == "ok\n"
