"""The trainer process: read rollout batch N, one optimizer step, publish policy version N+1.

Run one process per rank (`python -m rlctl.trainer --run-dir DIR`, env RANK/WORLD_SIZE/MASTER_*).
Every rank reads the whole batch file from the shared filesystem and takes rows `rank::world`, so no
data is scattered over the network; the loss is normalised by the batch's total completion-token
count so the gradient is the same however the batch is split across ranks and micro-batches.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchReader
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.retention import release_rollouts, retain_weights, sweep_trainer_staging
from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore
from rlctl.orchestrator.exchange.heartbeat import Heartbeat, beat_interval
from rlctl.orchestrator.exchange.metrics import TrainerStepRecord, append_record
from rlctl.orchestrator.exchange.steps import step_dir_name
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import validate
from rlctl.trainer.checkpoint import CheckpointWriteError
from rlctl.trainer.lr_schedule import build_scheduler

PREEMPTED = object()
TERMINATED_EXIT = 128 + signal.SIGTERM


class TermFlag:
    """SIGTERM asks the trainer to stop: Slurm sends it to every task on preemption (then SIGKILL after
    KillWait/GraceTime), on `scancel` and at the time limit; the local launcher on cancel. The trainer
    finishes the step it is in, saves a checkpoint at the next step boundary like on PREEMPT, and exits
    128+15 (whether the job requeues is the batch script's decision, not the trainer's)."""

    def __init__(self) -> None:
        self.raised = False
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, _signum, _frame) -> None:
        self.raised = True


class Trainer:
    def __init__(self, run: RunDir, recipe, resume: str | None = None, term: TermFlag | None = None):
        import torch

        from rlctl.trainer.checkpoint import load_checkpoint, require_complete, resolve_resume_step
        from rlctl.trainer.loss import load_loss
        from rlctl.orchestrator.exchange.placement import read_trainer_degrees
        from rlctl.trainer.build import build_parallel_model
        from rlctl.trainer.model import resolve_model_dir
        from rlctl.trainer.moe import moe_blocks
        from rlctl.trainer.parallel import build_mesh, init_distributed, resolve_dims
        from rlctl.trainer.step import StepContext
        from rlctl.trainer.weights import load_config

        self.run, self.recipe, self.cfg = run, recipe, recipe.trainer
        self.term = term or TermFlag()
        self.loss_fn = load_loss(self.cfg.loss.path)
        if self.cfg.compile:  # before the first compile: kernels go where torch's cache dir points then
            from rlctl.trainer.compiled_layers import use_user_compile_cache

            use_user_compile_cache()
        resume_step = resolve_resume_step(run.checkpoints, resume)
        if resume_step is not None:
            require_complete(run.checkpoints, resume_step)  # fail before the expensive set-up
        self.rank, self.world, self.device = init_distributed()
        self.dims = resolve_dims(self.cfg, self.world, self.device.type, planned=read_trainer_degrees(run))
        self.model_dir = resolve_model_dir(run, recipe)
        self.hf_config = load_config(self.model_dir)
        torch.manual_seed(recipe.orchestrator.seed)
        self.mesh = build_mesh(self.dims, self.device)
        # meta build, then experts/context/FSDP sharding, then each rank reads only its own slices
        self.model = build_parallel_model(self.model_dir, self.dims, self.mesh, self.device, self.cfg,
                                          load_from=self.model_dir)
        self.is_moe = bool(moe_blocks(self.model))  # from the built model: config.json is read once
        opt = self.cfg.optimizer
        self.optimizer = torch.optim.AdamW(  # with LoRA only the adapters require grad
            [p for p in self.model.parameters() if p.requires_grad], lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay
        )
        self.scheduler = build_scheduler(self.optimizer, opt, recipe.orchestrator.max_steps)
        self.step_ctx = StepContext(
            self.model, self.optimizer, self.scheduler, self.loss_fn, self.cfg, self.dims, self.mesh, self.device,
            moe=self.is_moe, router_replay=self.cfg.router_replay,
        )
        self.weight_files = FilesystemWeightStore(run.weights)  # also the broadcast run's last step
        self.weight_store = self.weight_files
        if recipe.weights.transport == "broadcast":
            from rlctl.trainer.weights_broadcast import broadcast_store

            self.weight_store = broadcast_store(run, recipe, self.device, self.term)
        self.batches = FilesystemBatchReader(run.rollouts)
        self.max_steps = recipe.orchestrator.max_steps
        self.start_step = 0
        if resume_step is not None:
            load_checkpoint(run.checkpoints, resume_step, self.model, self.optimizer, self.scheduler, self.rank)
            self.start_step = resume_step
            if self.rank == 0:
                dropped = self.weight_store.discard_after(resume_step)
                if dropped:
                    self.log(f"resumed at step {resume_step}: removed newer published weights {dropped}")
        if self.rank == 0:  # no rank has written anything yet: leftovers are a killed trainer's
            swept = sweep_trainer_staging(run)
            if swept:
                self.log(f"removed staging leftovers {swept}")
        self.log(
            f"trainer ready: world={self.world} {self.dims} device={self.device} model={self.model_dir} "
            f"start_step={self.start_step} max_steps={self.max_steps}"
        )

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[trainer {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # ---- weights -------------------------------------------------------------------------
    def publish(self, step: int) -> float:
        """Collective: every rank writes its share of the full weights, in the serving dtype, as
        `weights/step_N` (no rank gathers the whole model); rank 0 then deletes the published steps
        retention lets go. Returns the seconds the publishing took. With the broadcast transport the last
        step is written as files too: it is the trained model, which a run leaves as an HF folder."""
        if self.recipe.weights.transport == "broadcast" and step < self.max_steps:  # rank 0 sends to the workers
            from rlctl.trainer.weights_broadcast import publish_broadcast

            return publish_broadcast(self, step)
        if self.cfg.lora.enabled:  # the adapter only, as PEFT files: the servers keep the base
            from rlctl.trainer.lora_publish import publish_adapter

            return publish_adapter(self, step)
        from rlctl.trainer.weights import ProcessGroupRanks, publish_buckets, serving_dtype

        t0 = time.perf_counter()
        group = ProcessGroupRanks()
        buckets = publish_buckets(self.model, self.hf_config, serving_dtype(self.recipe), group.rank, group.world)
        self.weight_files.publish(step, self.hf_config, buckets, group)
        elapsed = time.perf_counter() - t0
        if self.rank == 0:
            retain_weights(self.run, self.weight_files, self.recipe.weights.keep_last)
        return elapsed

    def _warm_up_compile(self) -> None:
        from rlctl.trainer.compiled_layers import compile_summary
        from rlctl.trainer.step import warm_up_compile

        # rows of about the batches' length: inductor's CPU kernels are guarded on power-of-two ranges of
        # it, and a length in another range compiles once more when it first comes (5 s for the tiny model)
        max_len = self.recipe.inference.max_model_len
        length = min(max_len, self.recipe.orchestrator.expected_mean_tokens or max_len // 2)
        t0 = time.perf_counter()
        warm_up_compile(self.step_ctx, length)
        self.log(f"trainer.compile: {compile_summary()} before the first batch, in {time.perf_counter() - t0:.1f}s "
                 f"(kernels cached in {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})")

    # ---- one step ------------------------------------------------------------------------
    def train_step(self, batch: dict) -> dict:
        from rlctl.trainer.step import train_step

        return train_step(self.step_ctx, batch)

    # ---- the loop ------------------------------------------------------------------------
    def fit(self) -> int:
        from rlctl.trainer.checkpoint import save_checkpoint

        self.heartbeat = Heartbeat(self.run, "trainer", beat_interval(self.recipe.monitoring.stall_timeout_s))
        self._beat(self.start_step)
        publish_s = self.publish(self.start_step)
        self.log(f"published weights/{step_dir_name(self.start_step)} in {publish_s:.3f}s")
        if self.cfg.compile:  # while inference starts and generates the first batch
            self._warm_up_compile()
        done = self.run.done
        ckpt = self.recipe.checkpoint
        for step in range(self.start_step, self.max_steps):
            t_wait = time.perf_counter()
            ready = self._wait_batch_or_preempt(step, done)
            if self._agree_on_preemption(ready is PREEMPTED):
                return self._checkpoint_and_stop(step)
            if not ready:
                self.log(f"{done.name} appeared before rollouts/{step_dir_name(step)}: stopping at step {step}")
                return 0
            batch, meta = self.batches.read(step)
            wait_s = time.perf_counter() - t_wait
            t0 = time.perf_counter()
            metrics = self.train_step(batch)
            step_s = time.perf_counter() - t0
            publish_s = self.publish(step + 1)
            if self.rank == 0:
                record = TrainerStepRecord(
                    step=step, trainer_step_time_s=step_s, wait_batch_s=wait_s, weight_publish_s=publish_s,
                    attempt_start=step == self.start_step,
                    reward_mean_batch=float(batch["rewards"].float().mean()) if "rewards" in batch else None,
                    policy_version_max=meta.get("policy_version_max"), **metrics,
                )
                append_record(self.run, "trainer", record)
                self._beat(step + 1)
                self.log(
                    f"step {step}: loss={metrics['loss']:+.4f} kl={metrics['mismatch_kl']:.2e} "
                    f"entropy={metrics.get('entropy', float('nan')):.3f} grad_norm={metrics['grad_norm']:.3f} "
                    f"masked={metrics['masked_fraction']:.3f} tokens={metrics['tokens']} step={step_s:.3f}s "
                    f"wait={wait_s:.3f}s publish={publish_s:.3f}s"
                )
            if ckpt.interval and (step + 1) % ckpt.interval == 0:
                t_ckpt = time.perf_counter()
                save_checkpoint(self.run.checkpoints, step + 1, self.model, self.optimizer, self.scheduler, self.rank, ckpt.keep_last)
                self.log(f"checkpoint step_{step + 1} saved in {time.perf_counter() - t_ckpt:.3f}s")
            if self.rank == 0:  # batches no resume will read again (after a checkpoint, or at once without)
                release_rollouts(self.run, self.batches, step + 1, ckpt.interval)
        self.log(f"finished: trained steps {self.start_step}..{self.max_steps - 1}")
        return 0

    # ---- preemption: `<run>/PREEMPT` (written by the Slurm batch script on USR2 or a preemption's
    # SIGTERM) or SIGTERM to this process ---------------------------------------------------------
    def _stop_requested(self) -> bool:
        return self.term.raised or self.run.preempt.exists()

    def _wait_batch_or_preempt(self, step: int, done: Path):
        """True once batch `step` is complete, False on DONE, or PREEMPTED when a preemption was requested."""
        deadline = time.monotonic() + self.cfg.batch_timeout_s
        while True:
            if self._stop_requested():
                return PREEMPTED
            self._beat(step, waiting_for=f"rollouts/{step_dir_name(step)}")
            try:
                return self.batches.wait(step, min(1.0, max(0.0, deadline - time.monotonic())), stop_file=done)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def _beat(self, steps_done: int, waiting_for: str | None = None) -> None:
        if self.rank == 0:  # one heartbeat per trainer: its rank 0
            self.heartbeat.beat(steps_done, waiting_for)

    def _agree_on_preemption(self, mine: bool) -> bool:
        """All ranks take the same branch: one sees the request, another the batch (a collective)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if mine or self._stop_requested() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _checkpoint_and_stop(self, step: int) -> int:
        """Preempted before training batch `step`: save the state after `step` trained steps; exit 0
        (PREEMPT) or 128+15 (SIGTERM: the task was told to end; its group must not look finished)."""
        import torch
        import torch.distributed as dist

        from rlctl.trainer.checkpoint import save_checkpoint

        t0 = time.perf_counter()
        save_checkpoint(self.run.checkpoints, step, self.model, self.optimizer, self.scheduler, self.rank,
                        self.recipe.checkpoint.keep_last)
        cause = "SIGTERM" if self.term.raised else "PREEMPT"
        self.log(f"preemption requested ({cause}): checkpoint step_{step} saved in "
                 f"{time.perf_counter() - t0:.3f}s; stopping")
        termed = torch.tensor([1.0 if self.term.raised else 0.0], device=self.device)
        dist.all_reduce(termed, op=dist.ReduceOp.MAX)  # every rank exits with the same code
        return TERMINATED_EXIT if termed.item() else 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlctl.trainer", description="rlctl FSDP2 trainer (one process per rank)")
    p.add_argument("--run-dir", default=os.environ.get("RLCTL_RUN_DIR"), help="run directory (default: $RLCTL_RUN_DIR)")
    p.add_argument(
        "--resume-step", default=os.environ.get("RLCTL_RESUME_STEP"),
        help="resume from checkpoints/step_N (a number or 'latest'; default: $RLCTL_RESUME_STEP)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    code = 1  # until the trainer says otherwise (an interrupt leaves without meeting the others)
    try:
        if not args.run_dir:
            raise RecipeError("no run directory: pass --run-dir or set RLCTL_RUN_DIR", "run dir")
        run = RunDir(Path(args.run_dir))
        if not run.recipe_json.is_file():
            raise RecipeError(f"{run.recipe_json} does not exist (not a run directory?)", "run dir")
        term = TermFlag()  # from the start: a TERM during the set-up must not kill the task mid-write
        code = Trainer(run, validate(run.recipe_data()), args.resume_step, term).fit()
    except RecipeError as exc:
        print(f"trainer rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        code = RecipeError.exit_code
    except CheckpointWriteError as exc:
        print(f"trainer rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except Exception as exc:  # noqa: BLE001 - the log gets the traceback, the last line says what failed
        traceback.print_exc()
        print(f"trainer rank {rank}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        _shutdown(meet=code in (0, TERMINATED_EXIT))
    return code


def _shutdown(meet: bool) -> None:
    """Leave the process group together: a rank that tears its connections down while a peer is still
    inside a collective (or still destroying its own groups) can make the peer's gloo abort (SIGABRT),
    so every rank first meets the others, then destroys, and the store's host (rank 0) goes last.
    After a failure (`meet` False) a rank leaves at once: its peers' collectives then fail instead of
    waiting for it."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        from datetime import timedelta

        store = dist.distributed_c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        if not meet:
            dist.destroy_process_group()
            return
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)
            else:
                dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone (crash, kill): just leave
            pass
        dist.destroy_process_group()
        store.set(f"rlctl/left/{rank}", "1")
        if rank == 0:
            store.wait([f"rlctl/left/{r}" for r in range(1, world)], timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
