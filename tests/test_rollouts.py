"""Rollout batch files: round trip, opaque payloads stay tensors, corruption detected, no partial reads."""
from __future__ import annotations

import threading

import pytest
import torch

from rlctl.orchestrator.exchange.batches_fs import CorruptRolloutError, read_batch, step_dir, wait_for_batch, write_batch


def _batch(B=4, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 64, (B, T), generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "loss_mask": torch.rand(B, T, generator=g) > 0.5,
        "inference_logprobs": -torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "policy_version": torch.randint(0, 3, (B, T), generator=g, dtype=torch.int32),
        "rewards": torch.rand(B, generator=g),
        "payload.routed_experts": torch.randint(0, 128, (B, 2, 4, T), generator=g, dtype=torch.int16),
    }


def test_round_trip_keeps_dtypes_values_and_meta(tmp_path):
    tensors = _batch()
    path = write_batch(tmp_path, 3, tensors, {"note": "x"})
    assert path == step_dir(tmp_path, 3)
    got, meta = read_batch(path)
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert isinstance(got["payload.routed_experts"], torch.Tensor)
    assert meta["step"] == 3 and meta["note"] == "x" and meta["format"] == "rlctl-rollouts-v1"
    assert meta["policy_version_max"] == int(tensors["policy_version"].max())


def test_complete_batch_is_never_overwritten(tmp_path):
    write_batch(tmp_path, 0, _batch(), {})
    with pytest.raises(FileExistsError):
        write_batch(tmp_path, 0, _batch(seed=1), {})


def test_bit_flip_and_truncation_are_detected(tmp_path):
    path = write_batch(tmp_path, 0, _batch(), {})
    f = path / "batch.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptRolloutError, match="checksum"):
        read_batch(path)
    f.write_bytes(bytes(data[:-16]))
    with pytest.raises(CorruptRolloutError, match="truncated"):
        read_batch(path)


def test_directory_without_marker_is_rejected(tmp_path):
    path = write_batch(tmp_path, 0, _batch(), {})
    (path / "COMPLETE").unlink()
    with pytest.raises(CorruptRolloutError, match="marker"):
        read_batch(path)


def test_reader_racing_writer_never_sees_a_partial_batch(tmp_path):
    steps, big = 30, _batch(B=64, T=512)
    seen, errors = [], []

    def reader():
        for step in range(steps):
            try:
                path = wait_for_batch(tmp_path, step, timeout=60, poll=0.0005)
                tensors, meta = read_batch(path)
                seen.append((meta["step"], tensors["input_ids"].shape[0]))
            except Exception as exc:  # noqa: BLE001 - any failure is the test's result
                errors.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    for step in range(steps):
        write_batch(tmp_path, step, big, {})
    thread.join(120)
    assert errors == []
    assert seen == [(s, 64) for s in range(steps)]


def test_wait_stops_on_stop_file_and_times_out(tmp_path):
    stop = tmp_path / "DONE"
    stop.write_text("{}")
    assert wait_for_batch(tmp_path, 5, timeout=5, stop_file=stop) is None
    with pytest.raises(TimeoutError):
        wait_for_batch(tmp_path, 5, timeout=0.1)


def test_crc_fallback_without_xxhash_round_trips_and_detects_corruption(tmp_path, monkeypatch):
    from rlctl.orchestrator.exchange import batches_fs as rollouts

    monkeypatch.setattr(rollouts, "_have_xxhash", lambda: False)
    tensors = _batch(B=8, T=64)
    path = write_batch(tmp_path, 0, tensors, {})
    got, _ = read_batch(path)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    f = path / "batch.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptRolloutError, match="checksum"):
        read_batch(path)


def test_file_is_standard_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = _batch()
    got = load_file(str(write_batch(tmp_path, 0, tensors, {}) / "batch.safetensors"))
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_a_batch_file_swapped_after_publication_fails_its_marker_checksum(tmp_path):
    """Each file is self-consistent (its own checksum matches), but not the one its marker sealed."""
    import shutil

    from rlctl.orchestrator.exchange.steps import MARKER

    one = write_batch(tmp_path, 1, _batch(seed=1), {})
    two = write_batch(tmp_path, 2, _batch(seed=2), {})
    assert (one / "batch.safetensors").stat().st_size == (two / "batch.safetensors").stat().st_size
    shutil.copyfile(two / "batch.safetensors", one / "batch.safetensors")
    with pytest.raises(CorruptRolloutError, match="marker"):
        read_batch(one)
    assert (one / MARKER).exists() and read_batch(two)[1]["step"] == 2
