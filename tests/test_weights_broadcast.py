"""The broadcast weight transport: trainer rank 0 sends buckets straight to the inference workers through
a group of their own; the step directory holds only a manifest under the usual marker. Transport tests
run sender and receivers as processes; the slow one checks a real vLLM server against transformers."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest
import torch

from rlctl.orchestrator.exchange.steps import MARKER, complete_steps
from rlctl.orchestrator.exchange.weights_broadcast import (MANIFEST_FILE, BroadcastError, BroadcastWeightStore,
                                                           Receiver, decode_bucket, encode_bucket, is_served,
                                                           read_manifest)

CONFIG = {"model_type": "qwen3", "tie_word_embeddings": True}


def _buckets(step: int) -> list[dict]:
    gen = torch.Generator().manual_seed(step)
    return [{"a.weight": torch.randn(3, 5, generator=gen).to(torch.bfloat16), "b.bias": torch.arange(7.0)},
            {"c.weight": torch.randn(1000, 33, generator=gen)}]


def test_a_bucket_round_trips_through_its_bytes():
    bucket = {"x": torch.randn(2, 3).to(torch.bfloat16), "y": torch.arange(5, dtype=torch.int64), "z": torch.ones(1)}
    sizes, buffer = encode_bucket(bucket)
    assert int(sizes[1]) == buffer.numel()
    out = dict(decode_bucket(buffer, int(sizes[0])))
    assert list(out) == list(bucket)
    for k, v in bucket.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)


def _receive(step_dir: str, workers: int, out: str) -> None:
    receiver = Receiver(read_manifest(step_dir), workers)
    torch.save({name: t.clone() for bucket in receiver.buckets() for name, t in bucket}, out)


def test_two_workers_receive_exactly_what_rank_0_sent(tmp_path):
    store = BroadcastWeightStore(tmp_path, "127.0.0.1", timeout_s=60)
    published = threading.Thread(target=store.publish, args=(2, CONFIG, iter(_buckets(2))))
    published.start()
    step_dir = tmp_path / "step_2"
    deadline = time.monotonic() + 30
    while not is_served(step_dir):
        assert time.monotonic() < deadline, "the step was never announced"
        time.sleep(0.05)
    assert complete_steps(tmp_path) == [2] and (step_dir / MANIFEST_FILE).exists()
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"worker{i}.pt" for i in range(2)]
    procs = [ctx.Process(target=_receive, args=(str(step_dir), 2, str(out))) for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    got = [torch.load(out) for out in outs]
    published.join(30)
    expected = {k: v for bucket in _buckets(2) for k, v in bucket.items()}
    for received in got:
        assert list(received) == list(expected)
        assert all(received[k].dtype == v.dtype and torch.equal(received[k], v) for k, v in expected.items())
    assert store.last["served"] and store.last["workers"] == 2
    assert not is_served(step_dir)  # the sender is gone: a watcher skips the step until it is republished
    (step_dir / MARKER).unlink()
    with pytest.raises(FileNotFoundError):
        read_manifest(step_dir)


def test_step_0_is_announced_not_served(tmp_path):
    drained = []
    store = BroadcastWeightStore(tmp_path, "127.0.0.1", timeout_s=60)
    store.publish(0, CONFIG, (drained.append(b) or b for b in _buckets(0)))
    assert len(drained) == 2  # the gathers still run on every rank
    assert complete_steps(tmp_path) == [0] and not read_manifest(tmp_path / "step_0").serving


def test_sender_gives_up_with_a_clear_error_when_nobody_joins(tmp_path):
    store = BroadcastWeightStore(tmp_path, "127.0.0.1", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(BroadcastError, match="weights.broadcast_timeout_s"):
        store.publish(1, CONFIG, iter(_buckets(1)))
    assert time.monotonic() - started < 10


def test_sender_stops_waiting_when_the_run_ends(tmp_path):
    store = BroadcastWeightStore(tmp_path, "127.0.0.1", timeout_s=60, stop=lambda: "DONE appeared")
    assert store.publish(1, CONFIG, iter(_buckets(1))) == tmp_path / "step_1"
    assert store.last == {"step": 1, "served": False, "why": "DONE appeared"}
    assert not is_served(tmp_path / "step_1")


def test_republishing_a_step_replaces_its_rendezvous(tmp_path):
    first = BroadcastWeightStore(tmp_path, "127.0.0.1", timeout_s=60, stop=lambda: "stop")
    first.publish(3, CONFIG, iter(()))
    nonce = read_manifest(tmp_path / "step_3").nonce
    first.publish(3, CONFIG, iter(()))
    assert read_manifest(tmp_path / "step_3").nonce != nonce


@pytest.mark.slow
def test_served_weights_equal_the_trainers_after_a_broadcast(tmp_path):
    """A real vLLM CPU server receives perturbed weights over the broadcast transport (paused with requests
    in flight, as the watcher does) and then matches a transformers forward pass of them."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    from inference_fixtures import served
    from rlctl.inference.client import InferenceClient, reload_all
    from rlctl.orchestrator.exchange.weights import hf_state_dict
    from rlctl.trainer.weights import load_config
    from test_inference_reload import (lm_head_tied, make_run, max_diff, served_prompt_logprobs,
                                       transformers_prompt_logprobs)

    run = make_run(tmp_path / "run")
    with served(run, tmp_path / "inference.log") as (info, _):
        token = run.admin_token()
        before = served_prompt_logprobs(InferenceClient(info["url"], token), 0)
        state = load_file(str(run.model / "model.safetensors"))
        gen = torch.Generator().manual_seed(11)
        new = {k: v + (0.5 if "embed_tokens" in k else 0.05) * torch.randn(v.shape, generator=gen)
               for k, v in state.items()}
        expected = transformers_prompt_logprobs(run.model, new)
        assert max_diff(expected, before) > 0.1  # the check below can tell old weights from new ones
        config = load_config(run.model)
        tensors = list(hf_state_dict(new, config).items())
        buckets = [dict(tensors[:len(tensors) // 2]), dict(tensors[len(tensors) // 2:])]  # two buckets on the wire
        store = BroadcastWeightStore(run.weights, "127.0.0.1", timeout_s=120)
        sender = threading.Thread(target=store.publish, args=(1, config, iter(buckets)))
        sender.start()
        step_dir = run.weights / "step_1"
        deadline = time.monotonic() + 30
        while not is_served(step_dir):
            assert time.monotonic() < deadline
            time.sleep(0.05)

        async def receive_with_requests_in_flight():
            async with InferenceClient(info["url"], token) as client:
                tasks = [asyncio.create_task(client.complete("abc", max_tokens=16, extra={"ignore_eos": True}))
                         for _ in range(16)]
                await asyncio.sleep(0.3)
                timing = await reload_all([client], str(step_dir), transport="broadcast")
                return timing, await asyncio.gather(*tasks)

        timing, results = asyncio.run(receive_with_requests_in_flight())
        sender.join(60)
        print(f"\n[measure] pause→broadcast→resume: {timing}")
        assert store.last["served"] and store.last["workers"] == 1
        assert timing["servers"] == 1 and all(len(r["choices"][0]["token_ids"]) == 16 for r in results)
        after = served_prompt_logprobs(InferenceClient(info["url"], token), 1)
        assert max_diff(after, expected) < 1e-3
        assert lm_head_tied(info["url"], token)


def _trainer_rank(rank: int, world: int, port: int, folder: str, timeout_s: float) -> None:
    """A 2-rank trainer publishing with nobody to receive: rank 0 must fail with the timeout's message,
    rank 1 must not hang in a collective meanwhile (it drives the gathers once rank 0 gave up)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    coordination = dist.distributed_c10d._get_default_store()  # the trainer's own store, as in the trainer
    store = BroadcastWeightStore(folder, "127.0.0.1", timeout_s, coordination=coordination)

    class Group:
        def barrier(self):
            dist.barrier()

    group = Group()
    group.rank, group.world = rank, world

    def buckets():  # each bucket is a collective, like the FSDP gathers of the real iterator
        for bucket in _buckets(1):
            dist.all_reduce(torch.ones(1))
            if rank == 0:
                yield bucket

    try:
        store.publish(1, CONFIG, buckets(), group)
        outcome = "returned"
    except BroadcastError as exc:
        outcome = "timeout" if "weights.broadcast_timeout_s" in str(exc) else f"error {exc}"
    (Path(folder) / f"rank{rank}").write_text(outcome)


def test_a_trainer_whose_receivers_never_come_fails_on_rank_0_without_hanging_the_others(tmp_path):
    from trainer_fixtures import spawn_ranks

    spawn_ranks(_trainer_rank, 2, str(tmp_path), 1.0, timeout=120)
    assert (tmp_path / "rank0").read_text() == "timeout" and (tmp_path / "rank1").read_text() == "returned"
