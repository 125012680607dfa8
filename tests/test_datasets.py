"""`[orchestrator.dataset]`: formats, chat template, per-epoch order, eval split, bad input, and resume
exactness through the loop's progress state and the orchestrator's checkpoint path."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from sim_inference import sim_server

from rlctl.orchestrator.dataset_config import DatasetConfig
from rlctl.orchestrator.chat_template import ChatTemplate
from rlctl.orchestrator.dataset_environment import DatasetEnvironment
from rlctl.orchestrator.datasets import epoch_order, load_rows
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter
from rlctl.orchestrator.exchange.checkpoints import load_orchestrator_state, save_orchestrator_state
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop
from rlctl.orchestrator.prompt_limit import PromptLimit
from rlctl.recipes.errors import RecipeError

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"p{i:02d}", "answer": str(i)} for i in range(20)]


def write_jsonl(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(path: Path, **kw) -> DatasetConfig:
    return DatasetConfig(path=str(path), apply_chat_template=False, **kw)


def env_of(path: Path, seed: int = 0, **kw) -> DatasetEnvironment:
    return DatasetEnvironment(dataset(path, **kw), seed)


def test_jsonl_parquet_and_save_to_disk_load_the_same_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "abc", "answer": 7}, {"prompt": "de", "answer": 12}]  # numbers become text
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = [[(r.prompt, r.answer) for r in load_rows(dataset(p))]
              for p in (jsonl, tmp_path / "d.parquet", tmp_path / "saved")]
    assert loaded == [[("abc", "7"), ("de", "12")]] * 3


def test_messages_column_is_rendered_with_the_models_chat_template(tmp_path):
    from rlctl.trainer.tiny_model import _build_tokenizer

    model = tmp_path / "model"
    _build_tokenizer().save_pretrained(str(model))
    rows = [{"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
                          {"role": "user", "content": "d"}], "answer": "e"}]
    cfg = DatasetConfig(path=str(write_jsonl(tmp_path / "chat.jsonl", rows)), prompt_column=None,
                        messages_column="messages", system_prompt="s: ")
    env = DatasetEnvironment(cfg, 0, ChatTemplate(str(model), "orchestrator.dataset.apply_chat_template"))
    prompt = env.sample_prompts(random.Random(0), 1)[0]
    assert (prompt.text, prompt.target) == ("s: abcd", "e")  # the tiny model's template joins the contents


def test_each_epoch_is_a_seeded_permutation_different_from_the_last(tmp_path):
    env = env_of(write_jsonl(tmp_path / "d.jsonl"), seed=3)
    drawn = [p.info["row"] for p in env.sample_prompts(random.Random(0), 60)]
    epochs = [drawn[i:i + 20] for i in (0, 20, 40)]
    assert all(sorted(e) == list(range(20)) for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(20))
    again = env_of(write_jsonl(tmp_path / "d.jsonl"), seed=3)
    assert [p.info["row"] for p in again.sample_prompts(random.Random(99), 60)] == drawn  # the loop's rng plays no part
    assert epoch_order(20, 4, 0) != epochs[0]  # another seed, another order
    assert [p.info["row"] for p in env_of(tmp_path / "d.jsonl", shuffle=False).sample_prompts(None, 3)] == [0, 1, 2]


def test_held_out_eval_split_is_seeded_and_never_trained_on(tmp_path):
    env = env_of(write_jsonl(tmp_path / "d.jsonl"), eval_fraction=0.25)
    eval_rows = {p.info["row"] for p in env.eval_prompts()}
    train_rows = {p.info["row"] for p in env.sample_prompts(random.Random(0), 45)}
    assert len(eval_rows) == 5 and not eval_rows & train_rows and len(train_rows) == 15
    assert {p.info["row"] for p in env_of(tmp_path / "d.jsonl", eval_fraction=0.25).eval_prompts()} == eval_rows
    separate = env_of(tmp_path / "d.jsonl", eval_path=str(write_jsonl(tmp_path / "e.jsonl", ROWS[:3])))
    assert [p.target for p in separate.eval_prompts(limit=2)] == ["0", "1"]


@pytest.mark.parametrize("kw,rows,key", [
    ({"path": "missing.jsonl"}, None, "orchestrator.dataset.path"),
    ({"prompt_column": "question"}, ROWS, "orchestrator.dataset.prompt_column"),
    ({"answer_column": "solution"}, ROWS, "orchestrator.dataset.answer_column"),
    ({}, [{"prompt": ["not", "text"], "answer": "1"}], "orchestrator.dataset.prompt_column"),
    ({"format": "parquet"}, ROWS, "orchestrator.dataset.path"),
    ({"eval_fraction": 0.5}, ROWS[:1], "orchestrator.dataset.eval_fraction"),
    # the server refuses an empty prompt: the run failed at its first batch, naming no row
    ({}, ROWS[:3] + [{"prompt": " ", "answer": "1"}], "orchestrator.dataset.prompt_column"),
    ({}, ROWS[:3] + [{"prompt": "p", "answer": float("nan")}], "orchestrator.dataset.answer_column"),
])
def test_bad_paths_and_columns_name_the_key(tmp_path, kw, rows, key):
    path = write_jsonl(tmp_path / "d.jsonl", rows) if rows is not None else tmp_path / "d.jsonl"
    cfg = {"path": str(path), "apply_chat_template": False, **kw}
    with pytest.raises(RecipeError) as err:
        DatasetEnvironment(DatasetConfig(**cfg), 0)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


def test_launch_with_a_bad_dataset_is_one_line_exit_2(tmp_path):
    bad = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}])
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli.main", "launch", str(REPO / "recipes" / "tiny-dataset-cpu.toml"),
                           "-o", f"orchestrator.dataset.path={json.dumps(str(bad))}", "--dry-run"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "orchestrator.dataset.prompt_column" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_cursor_saved_with_other_data_is_refused(tmp_path):
    env = env_of(write_jsonl(tmp_path / "d.jsonl"))
    env.sample_prompts(None, 3)
    other = env_of(write_jsonl(tmp_path / "e.jsonl", ROWS[:7]))
    with pytest.raises(RecipeError, match="orchestrator.dataset.path"):
        other.load_state_dict(env.state_dict())


def _run_loop(url: str, path: Path, checkpoints: Path, start: int, steps: int, env_state: dict | None):
    """Batches start..start+steps-1 with max_off_policy_steps = 1 (the next batch's groups are dispatched
    before the current one is written); returns the rows drawn, in order."""
    from rlctl.orchestrator.__main__ import restore_progress

    env = env_of(path)
    drawn: list[int] = []
    sample = env.sample_prompts
    env.sample_prompts = lambda rng, n: [drawn.append(p.info["row"]) or p for p in sample(rng, n)]
    rng = random.Random(0)
    if env_state is not None:  # the orchestrator's own restore (checkpoints/step_<start>/orchestrator)
        rng, _ = restore_progress(RunDir(checkpoints.parent), 0, env, start)
    settings = LoopSettings(rollouts_per_step=8, group_size=2, max_tokens=2, max_off_policy_steps=1,
                            max_in_flight=64, start_step=start, max_steps=steps)
    policy = PolicyVersion(start)

    def on_batch(step, groups, metrics):  # a trainer that publishes at once
        asyncio.get_running_loop().create_task(policy.set(step + 1))

    def save(step, state):  # as orchestrate() does: state after batch `step` = checkpoint part step + 1
        save_orchestrator_state(checkpoints, step + 1, state)

    loop = RolloutLoop(settings, env, url, None, policy, FilesystemBatchWriter(checkpoints.parent / f"rollouts{start}"),
                       rng=rng, on_batch=on_batch, before_write=save)
    asyncio.run(asyncio.wait_for(loop.run(), 60))
    return drawn


def test_resume_at_step_k_draws_the_prompts_of_the_uninterrupted_run(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl")  # 20 rows, 4 groups a batch: epochs end mid-run
    run = RunDir(tmp_path / "run")
    run.create()
    k, total, per_batch = 3, 8, 4
    with sim_server(token_delay=0.002) as url:
        full = _run_loop(url, path, run.checkpoints, 0, total, None)
        saved = load_orchestrator_state(run.checkpoints, k)
        assert saved["environment"]["cursor"]["index"] == (k * per_batch) % 20
        resumed = _run_loop(url, path, run.checkpoints, k, total - k, saved)
    assert len(full) >= total * per_batch and len(resumed) >= (total - k) * per_batch
    assert resumed == full[k * per_batch:k * per_batch + len(resumed)]


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "d.jsonl", ROWS[:3]).read_bytes())
    assert [r.answer for r in load_rows(dataset(path))] == ["0", "1", "2"]


def test_rows_whose_prompt_fills_the_servers_context_are_skipped_and_named_once(tmp_path, caplog):
    """vLLM refuses a prompt of max_model_len tokens or more, and the retries of that one group then failed
    the run: such a row is skipped (named once in the log), in training and in evaluation."""
    from rlctl.trainer.tiny_model import _build_tokenizer

    tokenizer = _build_tokenizer()
    rows = [{"prompt": "ab" * (40 if i in (3, 7) else 1), "answer": str(i)} for i in range(10)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    limit = len(tokenizer("ab" * 40)["input_ids"])  # rows 3 and 7 fill it exactly
    assert len(tokenizer("ab")["input_ids"]) < limit
    long_calls = []

    def counting(text):
        long_calls.extend([text] if text == "ab" * 40 else [])
        return tokenizer(text)

    env = DatasetEnvironment(dataset(path, eval_path=str(path)), 0, limit=PromptLimit(counting, limit))
    rendered, render = [], env.render
    env.render = lambda row, split: rendered.append((split, row.index)) or render(row, split)
    with caplog.at_level("WARNING"):
        drawn = [env.sample_prompts(random.Random(0), 1)[0] for _ in range(25)]  # 2.5 epochs of 10 rows
        evaluated = env.eval_prompts()
    assert {p.info["row"] for p in drawn} == set(range(10)) - {3, 7}
    assert [p.info["row"] for p in evaluated] == [i for i in range(10) if i not in (3, 7)]
    named = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert sorted(named) == sorted(f"{split} row {i} of the dataset skipped: its prompt is {limit} tokens, and the "
                                   f"servers' context (inference.max_model_len) is {limit}"
                                   for split in ("train", "eval") for i in (3, 7))
    assert len(long_calls) == 4  # a skipped row is tokenized once per split, not again each epoch
    assert sorted(r for r in rendered if r[1] in (3, 7)) == [("eval", 3), ("eval", 7), ("train", 3), ("train", 7)]
    never = DatasetEnvironment(dataset(path), 0, limit=PromptLimit(tokenizer, 1))
    with pytest.raises(RecipeError) as err:
        never.sample_prompts(random.Random(0), 1)
    assert err.value.key == "inference.max_model_len"


def test_without_a_tokenizer_every_prompt_is_sent_and_the_log_says_so(tmp_path, caplog):
    from rlctl.orchestrator.prompt_limit import prompt_limit

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab" * 400, "answer": "0"}])
    (tmp_path / "model").mkdir()
    with caplog.at_level("WARNING"):
        env = DatasetEnvironment(dataset(path), 0, limit=prompt_limit(None, str(tmp_path / "model"), 8))
    assert any("prompts are not checked against inference.max_model_len" in r.getMessage() for r in caplog.records)
    assert [p.text for p in env.sample_prompts(random.Random(0), 2)] == ["ab" * 400] * 2
