"""`[orchestrator.eval]`: evaluation runs beside training (never blocks it), skips versions it could not
keep up with, writes typed eval records, and they show in `rlctl monitor` and the plot."""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from sim_inference import sim_server

from rlctl.orchestrator.dataset_config import DatasetConfig, EvalConfig
from rlctl.orchestrator.dataset_environment import DatasetEnvironment
from rlctl.orchestrator.environments import load_environment
from rlctl.orchestrator.evaluation import Evaluator, first_due, pass_at_k
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.metrics import EvalRecord, append_record, read_records, typed
from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 4) == 1.0  # only 3 wrong samples: any 4 include a right one
    assert [first_due(v, 5) for v in (0, 1, 5, 6)] == [0, 5, 5, 10]


def eval_env(tmp_path: Path) -> DatasetEnvironment:
    # The sim server answers one letter per token: `chr(ord('a') + version)`, so at version 0 "aa" is right.
    rows = [{"prompt": "slow" + str(i), "answer": "aa" if i % 2 else "zz"} for i in range(4)]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DatasetEnvironment(DatasetConfig(path=str(path), apply_chat_template=False, eval_path=str(path)), 0)


def test_eval_runs_beside_training_and_writes_its_record(tmp_path):
    """Eval prompts start with `slow` (the sim server streams them 10x slower): every training batch is
    written while the first evaluation is still pending; then its record lands, and versions passed
    meanwhile are skipped for the newest one."""
    run = RunDir(tmp_path / "run")
    run.create()
    env = eval_env(tmp_path)
    steps = 4
    with sim_server(token_delay=0.02) as url:
        policy = PolicyVersion(0)
        cfg = EvalConfig(interval=1, max_in_flight=1)  # 4 prompts x 2 tokens x 0.2 s, one at a time
        evaluator = Evaluator(cfg, env, url, None, policy, 2, record=lambda rec: append_record(run, "eval", rec))
        batches_at: list[int] = []

        def on_batch(step, groups, metrics):
            batches_at.append(len(read_records(run)))  # eval records existing when this batch was written
            asyncio.get_running_loop().create_task(policy.set(step + 1))

        settings = LoopSettings(rollouts_per_step=8, group_size=4, max_tokens=2, max_off_policy_steps=0,
                                max_in_flight=16, start_step=0, max_steps=steps)
        loop = RolloutLoop(settings, load_environment("count_a"), url, None, policy,
                           FilesystemBatchWriter(run.rollouts), rng=random.Random(0), on_batch=on_batch)

        async def scenario():
            eval_task = asyncio.create_task(evaluator.run())
            await asyncio.wait_for(loop.run(), 60)
            assert not eval_task.done()
            pending_while_training = evaluator.last_version == 0 and not read_records(run)
            await evaluator.finish(steps)
            eval_task.cancel()
            await asyncio.gather(eval_task, return_exceptions=True)
            return pending_while_training

        assert asyncio.run(scenario()), "the first evaluation finished before training did: nothing was shown"
    assert batches_at == [0] * steps  # training never waited for the evaluation
    records = typed(read_records(run), EvalRecord)
    assert [r.step for r in records] == [0, steps]  # 1..3 passed during the first evaluation: skipped
    first = records[0]
    assert (first.prompts, first.samples_per_prompt, first.k, first.reward_errors) == (4, 1, 1, 0)
    assert first.reward_mean == pytest.approx(0.5) and first.pass_at_k == pytest.approx(0.5)
    assert first.completion_tokens_mean == 2 and first.eval_time_s > 0.3


def test_a_failing_evaluation_is_logged_and_training_goes_on(tmp_path):
    env = eval_env(tmp_path)
    logs: list[str] = []
    records: list[EvalRecord] = []
    evaluator = Evaluator(EvalConfig(interval=1), env, "http://127.0.0.1:9", None, PolicyVersion(0), 2,
                          record=records.append, log=logs.append)

    async def scenario():
        import rlctl.orchestrator.evaluation as evaluation

        evaluation.REQUEST_RETRIES = 0
        try:
            return await evaluator.evaluate_once(0)
        finally:
            evaluation.REQUEST_RETRIES = 3

    assert asyncio.run(scenario()) is None and records == []
    assert len(logs) == 1 and "eval of policy v0 failed (training goes on)" in logs[0]


def test_monitor_and_plot_show_eval(tmp_path):
    from rich.console import Console

    from rlctl.cli.monitor_view import render_summary

    run = RunDir(tmp_path / "run")
    run.create()
    for v, score in ((0, 0.1), (5, 0.6)):
        append_record(run, "eval", EvalRecord(step=v, reward_mean=score, pass_at_k=score / 2, k=1, prompts=4,
                                              samples_per_prompt=1, temperature=0.0, completion_tokens_mean=2,
                                              reward_errors=0, eval_time_s=1.0, policy_version_end=v))
    summary = {"name": "r", "state": "running", "scheduler": "local", "attempt": 1, "run_dir": str(run.root),
               "components": [], "steps_done": 5, "max_steps": 10, "eta_s": None, "step": 4, "measured": {},
               "predicted": {}, "idle": {}, "errors": []}
    console = Console(record=True, width=140)
    console.print(render_summary(summary, read_records(run)))
    text = console.export_text()
    assert "eval reward" in text and "0.6" in text and "eval pass@1" in text
    cells = [line.strip("│ ").split() for line in text.splitlines() if "eval " in line]
    rows = {" ".join(c[:2]): c for c in cells}
    # last and median of each row's own series (pass@1's median was '-': there is no such orchestrator key)
    assert rows["eval reward"][-2:] == ["0.6", "0.35"] and rows["eval pass@1"][-2:] == ["0.3", "0.175"], rows
    pytest.importorskip("matplotlib")
    from rlctl.cli.monitor import write_plot

    write_plot(run.root, tmp_path / "p.png")  # eval records alone are enough to plot
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.parametrize("function", [None, "exact_match"])
def test_the_recipes_reward_function_scores_eval_too(tmp_path, function):
    """`[orchestrator.reward] function` replaces the environment's reward for training and for eval alike."""
    from rlctl.orchestrator.__main__ import start_evaluation
    from rlctl.recipes.load import load_recipe

    over = ["orchestrator.dataset.apply_chat_template=false"] + (
        [f'orchestrator.reward.function="{function}"'] if function else [])
    recipe = load_recipe(["tiny-dataset-cpu"], over)
    run = RunDir(tmp_path / "run")
    run.create()

    async def built():
        evaluator, task = start_evaluation(run, recipe, None, "http://127.0.0.1:9", None, PolicyVersion(0), 0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if evaluator.scorer is not None:
            await evaluator.scorer.close()
        return evaluator

    evaluator = asyncio.run(built())
    assert (evaluator.scorer is not None) == bool(function)
