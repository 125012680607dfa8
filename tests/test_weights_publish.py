"""Atomic weight publication: a reader racing the writer only ever sees whole, correct steps."""
from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch
from safetensors.torch import load_file

from rlctl.orchestrator.exchange.steps import MARKER, complete_steps
from rlctl.orchestrator.exchange.weights_fs import (CONFIG_FILE, INDEX_FILE, FilesystemWeightStore, hf_state_dict,
                                                    read_weights)

SHARD = "model-00001-of-00001.safetensors"  # one process, one bucket: one shard


def publish_weights(folder, step, state, config):
    return FilesystemWeightStore(folder).publish_state(step, state, config)


def latest_complete(folder):
    return FilesystemWeightStore(folder).latest()


def discard_after(folder, step):
    return FilesystemWeightStore(folder).discard_after(step)

CONFIG = {"model_type": "qwen3", "tie_word_embeddings": True}


def _state(step: int, numel: int = 1 << 20) -> dict:
    # each step's tensors are filled with the step number, so a reader can check it got that step's bytes
    return {
        "model.embed_tokens.weight": torch.full((numel // 256, 256), float(step)),
        "model.norm.weight": torch.full((256,), float(step)),
        "lm_head.weight": torch.full((numel // 256, 256), float(step)),
    }


def test_publish_layout_drops_tied_head_and_keeps_it_untied(tmp_path):
    final = publish_weights(tmp_path, 3, _state(3, 1024), CONFIG)
    assert final == tmp_path / "step_3"
    assert sorted(os.listdir(final)) == sorted([SHARD, INDEX_FILE, CONFIG_FILE, MARKER])
    loaded = load_file(final / SHARD)
    assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert (loaded["model.norm.weight"] == 3).all()
    untied = hf_state_dict(_state(1, 1024), {"tie_word_embeddings": False})
    assert "lm_head.weight" in untied
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]  # no staging leftovers


def test_republishing_a_complete_step_is_a_noop_and_leftovers_are_replaced(tmp_path):
    publish_weights(tmp_path, 1, _state(1, 1024), CONFIG)
    publish_weights(tmp_path, 1, _state(9, 1024), CONFIG)
    assert (read_weights(tmp_path / "step_1")["model.norm.weight"] == 1).all()
    crashed = tmp_path / "step_2"
    crashed.mkdir()
    (crashed / SHARD).write_bytes(b"torn")
    assert latest_complete(tmp_path) == 1
    publish_weights(tmp_path, 2, _state(2, 1024), CONFIG)
    assert latest_complete(tmp_path) == 2
    assert (load_file(crashed / SHARD)["model.norm.weight"] == 2).all()


def test_discard_after_removes_only_newer_steps(tmp_path):
    for step in range(4):
        publish_weights(tmp_path, step, _state(step, 1024), CONFIG)
    assert discard_after(tmp_path, 1) == [2, 3]
    assert complete_steps(tmp_path) == [0, 1] and sorted(p.name for p in tmp_path.iterdir()) == ["step_0", "step_1"]
    assert discard_after(tmp_path / "missing", 0) == []


def test_latest_complete_of_missing_or_empty_dir(tmp_path):
    assert latest_complete(tmp_path / "nope") is None
    assert latest_complete(tmp_path) is None


def _writer(folder: str, steps: int) -> None:
    for step in range(steps):
        publish_weights(folder, step, _state(step), CONFIG)


def test_reader_racing_the_writer_never_sees_a_partial_step(tmp_path):
    steps = 12
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_writer, args=(str(tmp_path), steps))
    proc.start()
    checked: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while len(checked) < steps and time.monotonic() < deadline:
            for step in complete_steps(tmp_path):
                if step in checked:
                    continue
                loaded = read_weights(tmp_path / f"step_{step}")
                assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight"}
                for tensor in loaded.values():
                    assert (tensor == step).all(), f"step {step} holds another step's bytes"
                assert (tmp_path / f"step_{step}" / CONFIG_FILE).stat().st_size > 0
                checked.add(step)
            # every step directory that is visible under its final name has all its files already
            for child in tmp_path.glob("step_*"):
                names = {n for n in os.listdir(child) if n != MARKER and not n.startswith(f".{MARKER}.")}
                assert names == {SHARD, INDEX_FILE, CONFIG_FILE}, f"{child.name} visible while partial: {names}"
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert checked == set(range(steps))
