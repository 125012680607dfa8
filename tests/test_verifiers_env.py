"""The `verifiers` environment: a task set written with the verifiers package's classes
(tests/verifiers_tasks.py) gives the prompts, its tasks' `@vf.reward`s score the completions.

Fast tests load it, render its prompts and score through it; one drives the real rollout loop against an
in-process fake completions server with the rewards in the worker pool; the slow one is a real
`rlctl launch` of the tiny model for a few steps with the rubric logging what it scored."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="the optional extra 'verifiers' is not installed")

from rlctl.orchestrator.environments import load_environment  # noqa: E402
from rlctl.orchestrator.verifiers_environment import VerifiersEnvironment  # noqa: E402
from rlctl.recipes.errors import RecipeError  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SEQUENCE = "verifiers_tasks:SequenceTaskset"


def rubric(prompt: str, reply: str) -> float:
    """What verifiers_tasks.SequenceTask's rewards sum to (weights 0.25 and 0.75)."""
    answer = "".join(str((int(prompt[-1]) + i) % 10) for i in (1, 2))
    return 0.25 * (reply[:1] == answer[:1]) + 0.75 * (reply[:2] == answer)


def test_loaded_by_name_prompts_come_from_the_taskset_and_rewards_from_its_rubric():
    env = load_environment("verifiers", {"taskset": SEQUENCE, "config": {"size": 4}, "chat_template": False})
    assert isinstance(env, VerifiersEnvironment) and len(env.tasks) == 4
    prompts = env.sample_prompts(random.Random(0), 20)
    assert {p.text for p in prompts} <= {"012", "123", "234", "345"}
    p = next(p for p in prompts if p.text == "345")
    assert env.reward(p, "67") == 1.0 and env.reward(p, "6x") == 0.25 and env.reward(p, "x7") == 0.0
    # the loop's sampler decides: the same seed draws the same tasks (resume restores the sampler)
    assert [q.text for q in env.sample_prompts(random.Random(0), 20)] == [q.text for q in prompts]


@pytest.mark.parametrize("ref, config", [
    ("verifiers_tasks:make_taskset", {"size": 2}),  # a function returning a Taskset
    ("verifiers_tasks:EndlessTaskset", {}),  # infinite: limit keeps the first tasks
])
def test_a_factory_and_an_infinite_taskset_with_limit(ref, config):
    env = VerifiersEnvironment(ref, config, limit=2, chat_template=False)
    assert [t.data.prompt for t in env.tasks] == ["012", "123"]


def test_prompts_use_the_models_chat_template_with_the_system_prompt(tmp_path):
    from rlctl.orchestrator.chat_template import ChatTemplate
    from rlctl.trainer.tiny_model import _build_tokenizer

    _build_tokenizer().save_pretrained(str(tmp_path / "model"))
    env = VerifiersEnvironment(SEQUENCE, {"size": 1, "system_prompt_text": "go:"})
    env.template = ChatTemplate(str(tmp_path / "model"), "orchestrator.environment.args.chat_template")
    assert env.sample_prompts(random.Random(0), 1)[0].text == "go:012"  # the tiny template joins the contents


@pytest.mark.parametrize("args, key, words", [
    ({"taskset": "verifiers_tasks:Nope"}, "args.taskset", "has no attribute 'Nope'"),
    ({"taskset": "no_such_taskset_pkg"}, "args.taskset", "cannot load the verifiers task set"),
    ({"taskset": "verifiers_tasks:DIGITS"}, "args.taskset", "is not a verifiers Taskset"),
    ({"taskset": SEQUENCE, "config": {"size": "many"}}, "args.config", "(size)"),
    ({"taskset": SEQUENCE, "config": {"sizes": 3}}, "args.config", "sizes"),
    ({"taskset": "verifiers_tasks:EndlessTaskset"}, "args.limit", "infinite task set"),
    ({"taskset": SEQUENCE, "limit": 0}, "args.limit", "positive integer"),
    ({"taskset": "verifiers_tasks:SandboxTaskset"}, "args.taskset", "without a task runtime"),
    ({"taskset": "verifiers_tasks:ToolTaskset"}, "args.taskset", "tool servers (Lookup)"),
    ({"taskset": SEQUENCE, "config": {"system_prompt_text": "s"}, "chat_template": False},
     "args.chat_template", "need the chat template"),
])
def test_bad_args_are_one_line_naming_the_key(args, key, words):
    with pytest.raises(RecipeError) as err:
        load_environment("verifiers", args)
    msg = str(err.value)
    assert msg.startswith(f"orchestrator.environment.{key}:") and words in msg and "\n" not in msg, msg


def test_tasks_whose_prompt_fills_the_servers_context_are_skipped_and_named_once(tmp_path, caplog):
    """As a dataset's rows: vLLM refuses a prompt of max_model_len tokens or more, and one such task failed
    the run. Built as the orchestrator builds it (the model's tokenizer, the recipe's max_model_len)."""
    from types import SimpleNamespace

    from rlctl.trainer.tiny_model import _build_tokenizer

    _build_tokenizer().save_pretrained(str(tmp_path / "model"))
    args = {"taskset": SEQUENCE, "config": {"size": 6, "long_tasks": [2, 4]}, "chat_template": False}

    def build(max_model_len):
        recipe = SimpleNamespace(model=SimpleNamespace(name=str(tmp_path / "model")),
                                 inference=SimpleNamespace(max_model_len=max_model_len),
                                 orchestrator=SimpleNamespace(environment=SimpleNamespace(args=args)))
        return VerifiersEnvironment.from_recipe(recipe, None)

    env, rendered = build(32), []
    render = env.render
    env.render = lambda task: (rendered.append(task.data.idx), render(task))[1]
    with caplog.at_level("WARNING"):
        drawn = env.sample_prompts(random.Random(0), 60)
    assert len(drawn) == 60 and {p.text for p in drawn} == {"012", "123", "345", "567"}
    assert rendered.count(2) == rendered.count(4) == 1  # a task known too long is not rendered again
    named = sorted(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert len(named) == 2 and named[0].startswith("task 2 of the task set skipped: its prompt is ")
    assert named[1].startswith("task 4 of the task set") and named[0].endswith("(inference.max_model_len) is 32")
    none_fit = build(2)
    for _ in range(2):  # and again when asked again, not a loop over tasks known too long
        with pytest.raises(RecipeError) as err:
            none_fit.sample_prompts(random.Random(0), 1)
        assert err.value.key == "inference.max_model_len" and "no task's prompt fits" in str(err.value)


def test_without_the_package_the_refusal_names_the_environment_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # import verifiers.v1 now raises ImportError
    with pytest.raises(RecipeError) as err:
        load_environment("verifiers", {"taskset": SEQUENCE})
    assert str(err.value).startswith("orchestrator.environment.name:") and "rlctl[verifiers]" in str(err.value)


def test_rlctl_imports_nothing_of_verifiers_until_the_environment_is_named():
    code = ("import sys; import rlctl.orchestrator.environments, rlctl.orchestrator.dataset_environment, "
            "rlctl.orchestrator.verifiers_environment; print(any(m.startswith('verifiers') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_the_rollout_loop_scores_through_the_rubric_in_reward_workers(tmp_path):
    """The real loop against a fake completions server: every other completion is the right answer, so
    the step's reward mean is what the rubric gives (0.5); each scored reply was logged by the rubric,
    which ran in the reward worker processes (the environment rebuilt there by name)."""
    pytest.importorskip("aiohttp")
    from aiohttp import web
    from sim_inference import MemoryBatchWriter, completions_endpoint

    from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop
    from rlctl.orchestrator.reward_config import RewardConfig
    from rlctl.orchestrator.rewards import RewardScorer

    log = tmp_path / "scored.tsv"
    args = {"taskset": SEQUENCE, "config": {"task": {"log_path": str(log)}}, "chat_template": False}

    async def completions(request):
        body = await request.json()
        answer = "".join(str((int(body["prompt"][-1]) + i) % 10) for i in (1, 2))
        prompt = [1] + [4 + (ord(c) % 30) for c in body["prompt"]]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["n"]):  # the loop streams: one event per choice, then [DONE]
            choice = {"index": i, "text": answer if i % 2 == 0 else "xx", "finish_reason": "length",
                      "prompt_token_ids": prompt, "token_ids": [7, 7], "logprobs": {"token_logprobs": [-1.0, -1.0]}}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    steps = {}

    async def main():
        settings = LoopSettings(rollouts_per_step=8, group_size=4, max_tokens=2, max_off_policy_steps=1,
                                max_in_flight=8, max_steps=2)
        env = load_environment("verifiers", args)
        scorer = RewardScorer.build(RewardConfig(workers=2), env, "verifiers", args)
        assert scorer.mode == "pool"
        await scorer.start()
        writer = MemoryBatchWriter()
        async with completions_endpoint(completions) as url:
            loop = RolloutLoop(settings, env, url, None, PolicyVersion(0), writer, rng=random.Random(0),
                               scorer=scorer, on_batch=lambda step, groups, metrics: steps.update({step: metrics}))
            await asyncio.wait_for(loop.run(), 120)
        return writer.batches

    batches = asyncio.run(main())
    assert sorted(batches) == [0, 1] and sorted(steps) == [0, 1]
    assert all(m["reward_mean"] == pytest.approx(0.5) for m in steps.values()), steps
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert len(lines) >= 16
    assert all(float(total) == rubric(prompt, reply) for prompt, reply, total in lines)
    assert {reply for _, reply, _ in lines} >= {"xx"} and any(float(t) == 1.0 for *_, t in lines)


@pytest.mark.slow
def test_rlctl_launch_runs_a_verifiers_taskset_on_the_tiny_model(tmp_path):
    """`rlctl launch` of the tiny recipe with the verifiers environment for 4 steps: it finishes, and the
    rewards are the rubric's (logged by it, consistent with it, on its 0/0.25/0.75/1 grid)."""
    from e2e_checks import leftover_processes, metrics

    log = tmp_path / "scored.tsv"
    recipe = (REPO / "recipes" / "tiny-cpu.toml").read_text()
    head, _, _ = recipe.partition("[orchestrator.environment]")
    head = (head.replace("rollouts_per_step = 512", "rollouts_per_step = 64")
            .replace("max_in_flight = 1024", "max_in_flight = 128").replace("max_steps = 80", "max_steps = 4"))
    (tmp_path / "v.toml").write_text(
        head.replace('name = "tiny-cpu"', 'name = "tiny-verifiers"')
        + "[orchestrator.environment]\nname = \"verifiers\"\n"
        + f"args = {{ taskset = {json.dumps(SEQUENCE)}, config = {{ size = 10, task = {{ log_path = "
        + f"{json.dumps(str(log))} }} }} }}\n\n[orchestrator.reward]\nworkers = 2\n\n[checkpoint]\ninterval = 5\n")
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "rlctl.cli.main", "launch", str(tmp_path / "v.toml"), "--name", "vf",
                          "-o", f"deployment.output_dir={tmp_path}", "--wait"],
                         capture_output=True, text=True, timeout=900, env=environ)
    run = tmp_path / "vf"
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    _, orch = metrics(run)
    assert [r["step"] for r in orch] == [0, 1, 2, 3]
    for r in orch:  # a mean of 64 rewards from {0, 0.25, 0.75, 1}: 4 x 64 x mean is an integer
        assert r["reward_mean"] * 256 == pytest.approx(round(r["reward_mean"] * 256), abs=1e-6), r["reward_mean"]
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert len(lines) >= 4 * 64, len(lines)
    assert all(float(total) == rubric(prompt, reply) for prompt, reply, total in lines)
    assert leftover_processes(run) == []
    print(f"verifiers tiny run: rewards {[round(r['reward_mean'], 3) for r in orch]}, {len(lines)} scored")
