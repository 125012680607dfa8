"""Helpers for trainer tests: a run dir with the tiny recipe, synthetic rollout batches, rank launching."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlctl.inference.server import free_port as server_free_port
from rlctl.orchestrator.exchange.metrics import read_records
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.batches_fs import write_batch
from rlctl.recipes.load import load_recipe
from rlctl.trainer.tiny_model import build_tiny_model

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.toml"


def make_run(root: Path, overrides=(), model_cache: Path | None = None) -> RunDir:
    run = RunDir(root)
    run.create()
    recipe = load_recipe([str(RECIPE)], list(overrides))
    run.recipe_json.write_text(json.dumps(recipe.model_dump(mode="json")))
    if model_cache is not None:  # share one build across tests: copy the built files
        src = build_tiny_model(model_cache, seed=recipe.model.build_seed, name=recipe.model.name)
        run.model.mkdir()
        for f in src.iterdir():
            (run.model / f.name).write_bytes(f.read_bytes())
    else:
        build_tiny_model(run.model, seed=recipe.model.build_seed, name=recipe.model.name)
    return run


def synthetic_batch(model_dir: Path, rows: int = 16, prompt_len: int = 6, completion_len: int = 6, seed: int = 0) -> dict:
    """Random prompts + completions; reward = fraction of 'a' in the completion; inference logprobs
    from a transformers forward of the initial weights (what vLLM would have reported)."""
    from transformers import AutoModelForCausalLM

    from rlctl.trainer.loss import token_logprobs_and_entropy
    from rlctl.trainer.tiny_model import vocab

    g = torch.Generator().manual_seed(seed)
    v = vocab()
    a_id, letters = v["a"], torch.tensor([v[c] for c in "abcde"])
    lengths = torch.randint(2, completion_len + 1, (rows,), generator=g)  # ragged: exercises padding
    total = prompt_len + completion_len
    ids = torch.zeros(rows, total, dtype=torch.long)
    attn = torch.zeros(rows, total, dtype=torch.bool)
    loss_mask = torch.zeros(rows, total, dtype=torch.bool)
    for r in range(rows):
        n = prompt_len + int(lengths[r])
        ids[r, :prompt_len] = torch.randint(4, len(v), (prompt_len,), generator=g)
        ids[r, prompt_len:n] = letters[torch.randint(0, len(letters), (n - prompt_len,), generator=g)]
        attn[r, :n] = True
        loss_mask[r, prompt_len:n] = True
    rewards = torch.tensor([float((ids[r][loss_mask[r]] == a_id).float().mean()) for r in range(rows)])
    group = 4
    grouped = rewards.view(-1, group)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        lp, _ = token_logprobs_and_entropy(model(input_ids=ids).logits, ids)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "inference_logprobs": (lp * loss_mask).float(),
        "advantages": advantages.float(),
        "policy_version": torch.where(loss_mask, 0, -1).int(),
        "rewards": rewards.float(),
        "payload.routed_experts": torch.zeros(rows, 2, total, dtype=torch.uint8),
    }


def write_batches(run: RunDir, batch: dict, steps) -> None:
    for step in steps:
        write_batch(run.rollouts, step, batch, {"policy_version_max": 0})


def free_port() -> int:
    """A rendezvous port for ranks started now (not the OS's pick: see rlctl.inference.server.free_port)."""
    return server_free_port("127.0.0.1")


def launch_ranks(run: RunDir, world: int, extra_env: dict | None = None, args=()) -> list[subprocess.Popen]:
    """Start `world` trainer ranks the way the launchers do (env contract), logs under the run dir."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RLCTL_RUN_DIR": str(run.root), "RLCTL_ATTEMPT": "1", "RLCTL_GROUP": "trainer",
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", **(extra_env or {}),
        }
        log = open(run.root / f"trainer_rank{rank}.log", "ab")
        procs.append(
            subprocess.Popen([sys.executable, "-m", "rlctl.trainer", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


def wait_all(procs, timeout: float = 300) -> list[int]:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


def trainer_metrics(run: RunDir) -> list[dict]:
    if not run.metrics.is_dir():
        return []
    lines = read_records(run)
    return [x for x in lines if x.get("component") == "trainer"]


def _rank_entry(rank: int, rank_main, *args) -> None:
    """One spawned rank: `rank_main`, then out without the interpreter's teardown. Process groups that
    tensors or meshes still reference die there, and gloo's threads can then abort the process
    ("terminate called without an active exception", SIGABRT) after its work is done: the trainer
    leaves the same way (rlctl.trainer.__main__)."""
    rank_main(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(rank_main, world: int, *args, timeout: float = 240) -> None:
    """Run `rank_main(rank, world, port, *args)` in `world` spawned processes (a gloo group on a free
    port); fail the test if they do not all finish within `timeout` seconds (and kill them)."""
    import time

    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_entry, args=(rank_main, world, free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout}s")


def join_gloo(rank: int, world: int, port: int) -> None:
    """A spawned rank joins the ranks' gloo group on `port` (one thread: the ranks share the cores)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def fsdp_random_model(cfg: dict, rank: int, world: int, port: int, seed: int = 0):
    """`cfg`'s model FSDP2-sharded over `world` gloo ranks, each rank allocating and filling only its
    own shard (random, the same global tensors whatever the world size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlctl.trainer.sharded_load import build_meta_model

    join_gloo(rank, world, port)
    model = build_meta_model(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            local = p.to_local()
            gen = torch.Generator().manual_seed(seed * 1000 + i)
            full = torch.randn(p.shape, generator=gen) * 0.02 if local.numel() * world < 2**22 else None
            if full is None:  # large: fill only the own rows (deterministic per rank, no full tensor)
                local.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed * 1000 + i * 7 + rank))
            else:
                rows = full.shape[0]
                per = -(-rows // world)
                local.copy_(full[rank * per:rank * per + local.shape[0]])
    model.tie_weights()
    return model
