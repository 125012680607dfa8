"""Trainer step of the tiny recipe (or a variant of it, `-o key.path=value` as for `rlctl launch`) vs a
plain single-process torch step of the same model and batch (goal: ≤ 1.5×), median of steps after a warm-up.

    .venv/bin/python bench/bench_trainer_step.py [--steps 10] [--warmup 3] [-o key.path=value ...]

rlctl = `rlctl.trainer.step.train_step` on the StepContext that `Trainer` builds (mesh, FSDP2 model,
        AdamW, scheduler, loss) with the recipe's fsdp ranks (2 in the tiny recipe), spawned, on gloo with the
        launcher's environment, so `parallel.init_distributed` sets the threads per rank as in a run
        (cpu_count // LOCAL_WORLD_SIZE unless OMP_NUM_THREADS is set). Every rank reads the batch from
        the run directory like the trainer does; rank 0 times each step between two barriers.
torch = one process with every core: the HF model from the same directory in the recipe's dtype, the
        whole batch in one forward, the same loss (`trainer.loss.path`), clipping and AdamW (recipe lr).
batch = rollouts_per_step rows of <bos> + one sampled prompt of the environment + max_tokens tokens (the
        tests' `synthetic_batch`: random tokens, inference logprobs of the initial model).
Prints both medians and the ratio; exit 1 when the ratio is above 1.5.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trainer_fixtures import RECIPE, free_port, make_run, synthetic_batch, write_batches  # noqa: E402

GOAL = 1.5


def _rank(rank: int, world: int, port: int, run_root: str, warmup: int, steps: int, results) -> None:
    """One trainer rank: the real Trainer set-up, then `warmup + steps` timed train_step calls."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from rlctl.orchestrator.exchange.layout import RunDir
    from rlctl.recipes.load import validate
    from rlctl.trainer.step import train_step
    from rlctl.trainer.train import Trainer, _shutdown

    run = RunDir(Path(run_root))
    trainer = Trainer(run, validate(run.recipe_data()))
    batch, _ = trainer.batches.read(0)
    times = []
    for _ in range(warmup + steps):
        dist.barrier()  # both ranks start together: the step's collectives do not wait on a late peer
        t0 = time.perf_counter()
        train_step(trainer.step_ctx, batch)
        dist.barrier()  # the step is over when the slower rank is done
        times.append(time.perf_counter() - t0)
    if rank == 0:
        results.put({"times": times[warmup:], "threads": torch.get_num_threads(), "dims": str(trainer.dims)})
        results.close()
        results.join_thread()
    _shutdown(meet=True)  # the trainer's own teardown (a rank leaving first can abort gloo in its peer)
    sys.stdout.flush()
    os._exit(0)  # as `python -m rlctl.trainer` does: skip the interpreter teardown that can SIGABRT


def _first_result(results, procs, timeout_s: float) -> dict:
    """Rank 0's result; a rank that failed (its traceback is on stderr) ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"trainer ranks exited with {[p.exitcode for p in procs]}") from None
    raise TimeoutError(f"no result from the trainer ranks in {timeout_s:.0f} s")


def rlctl_step_times(run_root: Path, world: int, warmup: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank, as the launcher starts them
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(run_root), warmup, steps, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = _first_result(results, procs, timeout_s=300)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"trainer ranks exited with {[p.exitcode for p in procs]}")
    return out


def torch_step_times(model_dir: Path, batch: dict, cfg, warmup: int, steps: int) -> tuple[list[float], int]:
    """The textbook step: forward over the whole batch, loss, backward, clip, AdamW. Returns times, params."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.trainer.loss import load_loss, token_logprobs_and_entropy

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, cfg.dtype),
                                                 attn_implementation="sdpa").train()
    opt_cfg = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                            weight_decay=opt_cfg.weight_decay)
    loss_fn = load_loss(cfg.loss.path)
    ids = batch["input_ids"]
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        logprobs, entropy = token_logprobs_and_entropy(model(input_ids=ids).logits, ids,
                                                       entropy_grad=cfg.loss.entropy_coef > 0)
        loss, _ = loss_fn(logprobs, batch["inference_logprobs"], batch["advantages"], batch["loss_mask"], cfg.loss,
                          entropy=entropy)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the loss as a number, as the trainer reports it
        times.append(time.perf_counter() - t0)
    return times[warmup:], sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("-o", "--override", action="append", default=[],
                        help="recipe override, as for rlctl launch (e.g. orchestrator.rollouts_per_step=256)")
    args = parser.parse_args(argv)

    import random

    from rlctl.orchestrator.environments import load_environment
    from rlctl.recipes.load import load_recipe

    recipe = load_recipe([str(RECIPE)], args.override)
    orch, cfg = recipe.orchestrator, recipe.trainer
    world = cfg.fsdp  # the tiny recipe's trainer: fsdp ranks on one node, nothing else
    prompt = load_environment(orch.environment.name, orch.environment.args).sample_prompts(random.Random(0), 1)[0]
    prompt_tokens = 1 + len(prompt.text)  # <bos> + the prompt's characters (the tiny model's vocabulary)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-step-", dir=".") as tmp:
        # the recipe.json and the built tiny model, as a launch writes them
        run = make_run(Path(tmp) / "run", args.override)
        batch = synthetic_batch(run.model, rows=orch.rollouts_per_step, prompt_len=prompt_tokens,
                                completion_len=orch.max_tokens)
        write_batches(run, batch, [0])
        ranks = rlctl_step_times(run.root, world, args.warmup, args.steps)
        base, params = torch_step_times(run.model, batch, cfg, args.warmup, args.steps)
    rows, length = batch["input_ids"].shape
    ours, theirs = statistics.median(ranks["times"]), statistics.median(base)
    ratio = ours / theirs
    print(f"model: {recipe.model.name}, {params:,} params ({cfg.dtype}); batch: {rows} x {length} tokens "
          f"({int(batch['loss_mask'].sum())} completion tokens); micro_batch_size {cfg.micro_batch_size}")
    print(f"rlctl train_step ({world} ranks, gloo, {ranks['threads']} thread(s) each, {ranks['dims']}): "
          f"median {ours * 1e3:.1f} ms (min {min(ranks['times']) * 1e3:.1f}, max {max(ranks['times']) * 1e3:.1f}) "
          f"over {len(ranks['times'])} steps")
    print(f"torch single process ({os.cpu_count()} threads): median {theirs * 1e3:.1f} ms "
          f"(min {min(base) * 1e3:.1f}, max {max(base) * 1e3:.1f}) over {len(base)} steps")
    print(f"ratio: {ratio:.2f}x (goal <= {GOAL}x)")
    return 0 if ratio <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
