"""10,000 rollouts in flight against a slow real HTTP backend: bounded memory, none lost or duplicated."""
from __future__ import annotations

import asyncio
import random
import tracemalloc

from sim_inference import fetch_stats, sim_server

from rlctl.orchestrator.environments import load_environment
from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop
from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter, read_batch, step_dir


def test_ten_thousand_in_flight_bounded_and_exactly_once(tmp_path):
    G, per_step = 8, 10_000
    settings = LoopSettings(rollouts_per_step=per_step, group_size=G, max_tokens=2, max_off_policy_steps=0,
                            max_in_flight=10_000, start_step=0, max_steps=2)
    gps = per_step // G
    with sim_server(token_delay=0.3, token="secret") as url:
        policy = PolicyVersion(0)
        written: list[int] = []
        loop = RolloutLoop(settings, load_environment("count_a"), url, "secret", policy, FilesystemBatchWriter(tmp_path),
                           rng=random.Random(1), on_batch=lambda step, groups, m: written.extend(g.group_id for g in groups))

        async def scenario():
            task = asyncio.create_task(loop.run())
            # Version 0 allows batch 0 only (max_off_policy_steps=0): the dispatcher must stop there even
            # though the trainer "never" publishes, and batch 1 must wait for the policy.
            while not step_dir(tmp_path, 0).joinpath("COMPLETE").exists():
                assert not task.done(), task.exception()
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            assert loop.started == gps, "dispatched beyond the off-policy gate"
            assert not step_dir(tmp_path, 1).exists()
            await policy.set(1)
            await asyncio.wait_for(task, 120)

        tracemalloc.start()
        asyncio.run(scenario())
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats = fetch_stats(url)

    assert loop.peak_in_flight == 10_000  # the cap was reached: 10k rollouts streaming at once
    assert stats["peak_active"] == 10_000 // G
    assert peak < 300 * 2**20, f"loop memory peaked at {peak / 2**20:.0f} MiB"
    assert loop.peak_queued <= gps  # at most max_off_policy_steps + 1 batches wait in memory
    # Exactly once: every written group is unique, was served exactly once, and nothing was dropped.
    assert len(written) == len(set(written)) == 2 * gps
    assert loop.dropped_ids == []
    for gid in written:
        assert stats["completed"][f"rlctl-g{gid}"] == 1
    on_disk = []
    for step in range(2):
        tensors, meta = read_batch(step_dir(tmp_path, step))
        assert tensors["input_ids"].shape[0] == per_step
        on_disk.extend(meta["group_ids"])
    assert sorted(on_disk) == sorted(written)


def test_a_batch_is_published_only_after_its_metrics_record(tmp_path):
    """A writer killed between the two leaves a record without a batch (dropped by the rewind), never a
    trainable batch without its record (which a later checkpoint would then cover: a step lost)."""
    events: list[tuple[str, int]] = []

    class RecordingWriter(FilesystemBatchWriter):
        def write(self, step, tensors, meta):
            events.append(("batch", step))
            super().write(step, tensors, meta)

    settings = LoopSettings(rollouts_per_step=8, group_size=4, max_tokens=2, max_off_policy_steps=2,
                            max_in_flight=16, start_step=0, max_steps=3)
    with sim_server(token_delay=0.0, token="secret") as url:
        loop = RolloutLoop(settings, load_environment("count_a"), url, "secret", PolicyVersion(0),
                           RecordingWriter(tmp_path), rng=random.Random(0),
                           on_batch=lambda step, groups, m: events.append(("record", step)))
        asyncio.run(asyncio.wait_for(loop.run(), 60))
    assert events == [(kind, step) for step in range(3) for kind in ("record", "batch")]


def test_an_environment_that_raises_while_sampling_fails_the_loop(tmp_path):
    """The dispatcher draws prompts: an error there (a user's environment, or no dataset row fitting the
    context) ends the loop with that error; the collector waited for groups forever."""
    import pytest

    class Broken(type(load_environment("count_a"))):
        def sample_prompts(self, rng, n):
            raise ZeroDivisionError("the environment's own bug")

    settings = LoopSettings(rollouts_per_step=8, group_size=4, max_tokens=2, max_off_policy_steps=1,
                            max_in_flight=16, start_step=0, max_steps=2)
    with sim_server(token_delay=0.0, token="secret") as url:
        loop = RolloutLoop(settings, Broken(), url, "secret", PolicyVersion(0), FilesystemBatchWriter(tmp_path),
                           rng=random.Random(0))
        with pytest.raises(ZeroDivisionError, match="own bug"):
            asyncio.run(asyncio.wait_for(loop.run(), 30))
