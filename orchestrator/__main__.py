"""`python -m rlctl.orchestrator --run-dir DIR`: router + rollout loop + weight watcher for one run.

1. Waits for `placement.inference_servers` inference announcements (fails with the servers' log tails
   if one exits or they time out), starts vllm-router in front of them (loopback only, every route
   behind the run's api key) and announces it. Every `RLCTL_WORKER_CHECK_S` seconds it compares the
   router's worker list with the announced servers and aborts the run (one line, exit 1) on a change.
2. Runs the rollout loop for `orchestrator.max_steps` batches while the weight watcher applies each
   newly published `weights/step_N` to every server in flight; one metrics line per batch.
3. After the last batch it keeps serving weight updates until the trainer has published the final
   weights `weights/step_{last + 1}` (the trainer exits on DONE, so writing DONE earlier could stop it
   before it trains the last batch), then writes `<run>/DONE`, stops the router and exits 0.

Resume: with `RLCTL_RESUME_STEP=N` the loop starts at batch N with the sampler/environment state saved
in `checkpoints/step_N/orchestrator` (written before each batch, see `launchers/checkpoints.py`);
without it, batches already complete in `rollouts/` are not regenerated. The weight watcher applies
the newest published weights at start, so resumed servers serve the resumed policy before batch N.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from pathlib import Path

from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.heartbeat import Heartbeat
from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord, append_record
from rlctl.orchestrator.exchange.steps import complete_steps
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import validate

WORKER_CHECK_S = float(os.environ.get("RLCTL_WORKER_CHECK_S", "2"))
WORKER_CHECK_FAILURES = 5  # consecutive unanswered checks before the router counts as gone


class OrchestratorError(RuntimeError):
    """A fatal, explained failure (message printed as one line, exit 1)."""


def log(msg: str) -> None:
    print(f"[orchestrator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _log_tails(run: RunDir, attempt: int, lines: int = 15) -> str:
    out = []
    for path in sorted((run.attempt_logs(attempt) / "inference").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "\n".join(out) or "(no inference logs found)"


def _dead_servers(run: RunDir) -> list[str]:
    """Inference tasks the local launcher recorded as exited (Slurm fails the whole job instead)."""
    import json

    dead = []
    for path in sorted(run.status.glob("inference.*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("state") == "exited":
            dead.append(f"{path.stem} (exit code {rec.get('returncode')})")
    return dead


def preload_batch_modules() -> threading.Thread:
    """Import torch and safetensors in the background while the servers start: the first batch needs
    them (tensors, the rollout file), and imported there they delayed the first batch, and with it the
    trainer's first step, by 1.5 s on 2 cores."""
    def load() -> None:
        import safetensors.torch  # noqa: F401 (brings torch)

    thread = threading.Thread(target=load, name="preload-torch", daemon=True)
    thread.start()
    return thread


def wait_for_servers(run: RunDir, count: int, attempt: int, timeout_s: float) -> list[str]:
    """URLs of `count` announced inference servers, ordered by index."""
    deadline = time.monotonic() + timeout_s
    last = -1
    heartbeat = Heartbeat(run, "orchestrator")
    while True:
        heartbeat.beat(0, waiting_for="inference servers")
        found = run.announced("inference")
        if len(found) != last:
            log(f"inference servers announced: {len(found)}/{count}")
            last = len(found)
        if len(found) >= count:
            return [s["url"] for s in sorted(found, key=lambda s: int(s.get("index", 0)))][:count]
        dead = _dead_servers(run)
        if dead:
            raise OrchestratorError(f"inference server(s) exited before announcing: {', '.join(dead)}\n"
                                    + _log_tails(run, attempt))
        if time.monotonic() > deadline:
            raise OrchestratorError(f"only {len(found)}/{count} inference servers announced within "
                                    f"{timeout_s:g} s (inference.startup_timeout_s)\n" + _log_tails(run, attempt))
        time.sleep(0.1)  # a directory listing; the first batch waits for this poll


async def watch_router_workers(router_url: str, api_key: str, server_urls: list[str],
                               interval_s: float = WORKER_CHECK_S) -> None:
    """Poll the router's worker list forever (cancel to stop): any worker the run did not announce
    (or an announced one gone) raises OrchestratorError, which ends the run."""
    from rlctl.inference.router import RouterWorkersChanged, check_workers

    failures = 0
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(check_workers, router_url, api_key, server_urls)
            failures = 0
        except RouterWorkersChanged as exc:
            raise OrchestratorError(str(exc)) from None
        except ConnectionError as exc:
            failures += 1
            if failures >= WORKER_CHECK_FAILURES:
                raise OrchestratorError(f"router worker check failed {failures} times in a row: {exc}") from None


async def orchestrate(run: RunDir, recipe, router_url: str, server_urls: list[str], admin_token: str,
                      api_key: str, pool=None) -> None:
    """`pool` (an attached `pool_attach.PoolSession`): the run is served by a shared pool, whose front
    is `router_url` and applies the weight updates; `server_urls` and `admin_token` are then unused."""
    from rlctl.orchestrator.dataset_environment import build_environment
    from rlctl.orchestrator.loop import LoopSettings, PolicyVersion, RolloutLoop
    from rlctl.orchestrator.rewards import RewardScorer
    from rlctl.orchestrator.exchange.batches_fs import FilesystemBatchWriter
    from rlctl.orchestrator.exchange.retention import record_serving, sweep_orchestrator_staging
    from rlctl.orchestrator.weight_watcher import WeightWatcher, inference_reloader

    sweep_orchestrator_staging(run)  # before the first write: leftovers are a killed orchestrator's
    cfg = recipe.orchestrator
    env = build_environment(recipe, run)
    start_step = resume_start_step(run)
    rng, base_counters = restore_progress(run, cfg.seed, env, start_step)
    end_step = cfg.max_steps
    policy = PolicyVersion(0)  # servers start from the initial weights (= weights/step_0)
    if pool is None:
        reload, close = inference_reloader(server_urls, admin_token)  # the servers' own URLs, never the router
    else:
        reload, close = pool.reload, _nothing
    watcher = WeightWatcher(run.weights, policy, reload, serving=lambda version: record_serving(run, version))
    reload_index = 0

    def on_batch(step: int, groups, metrics: dict) -> None:
        nonlocal reload_index
        reload_s, reload_bytes, reload_index = watcher.reloads_since(reload_index)
        append_record(run, "orchestrator", OrchestratorStepRecord(step=step, **metrics, weight_reload_s=reload_s,
                                                                  weight_reload_bytes=reload_bytes))
        log(f"step {step + 1}/{end_step}  reward {metrics['reward_mean']:.3f}  policy v{metrics['policy_version']}  "
            f"lag {metrics['off_policy_lag_mean']:.2f}/{metrics['off_policy_lag_max']}  "
            f"dropped {metrics['dropped_groups']}  {metrics['rollouts_per_s']:.0f} rollouts/s  "
            f"wait policy {metrics['wait_policy_s']:.2f}s")

    def save_progress(step: int, state: dict) -> None:
        """State after batch `step` = checkpoint part `step + 1`; written before the batch itself."""
        from rlctl.orchestrator.exchange.checkpoints import save_orchestrator_state

        counters = {k: base_counters.get(k, 0) + v for k, v in state["counters"].items()}
        save_orchestrator_state(run.checkpoints, step + 1, {**state, "counters": counters})
        prune_dead_progress()

    def prune_dead_progress() -> None:
        """The trainer's next checkpoint (periodic, on preemption, or none after the last step) is at a
        step it has not trained yet, so never below the version the servers serve: older parts without a
        trainer part are dead (with checkpoint.interval = 0 they piled up, one per step)."""
        from rlctl.orchestrator.exchange.checkpoints import newest_complete, prune_progress

        prune_progress(run.checkpoints, max(newest_complete(run.checkpoints) or 0, policy.version))

    from rlctl.orchestrator.monitoring import OrchestratorMonitor

    monitor = OrchestratorMonitor(run, recipe, start_step)
    loop = None
    monitor_task = asyncio.create_task(monitor.run(
        lambda: loop.heartbeat_state() if loop else (policy.version, "trainer (final weights)")))
    watch_task = asyncio.create_task(watcher.run())
    guard_task = asyncio.create_task(watch_router_workers(router_url, api_key, server_urls) if pool is None
                                     else asyncio.Event().wait())  # a pool's front guards its own servers
    evaluator, eval_task = start_evaluation(run, recipe, env, router_url, api_key, policy, start_step)
    try:
        if start_step < end_step:
            log(f"collecting batches {start_step}..{end_step - 1} via {router_url}")
            settings = LoopSettings.from_config(cfg, start_step=start_step,
                                                context_tokens=recipe.inference.max_model_len)
            settings.max_steps = end_step - start_step
            settings.routed_experts = recipe.trainer.router_replay  # payload.routed_experts in every batch
            scorer = RewardScorer.build(cfg.reward, env, cfg.environment.name, cfg.environment.args)
            await scorer.start()  # a reward that cannot load fails here, before any generation
            loop = RolloutLoop(settings, env, router_url, api_key, policy, FilesystemBatchWriter(run.rollouts),
                               rng=rng, on_batch=on_batch, before_write=save_progress, scorer=scorer)
            await _until_first(loop.run(), watch_task, guard_task)
            loop = None  # from here on the beats say: waiting for the trainer's final weights
        log(f"all {end_step} batches written; waiting for the trainer's final weights step_{end_step}")
        deadline = time.monotonic() + cfg.final_weights_timeout_s
        while policy.version < end_step:
            for task in (watch_task, guard_task):
                if task.done():
                    task.result()
            if time.monotonic() > deadline:
                raise OrchestratorError(f"trainer did not publish weights/step_{end_step} within "
                                         f"{cfg.final_weights_timeout_s:g} s (orchestrator.final_weights_timeout_s)")
            await asyncio.sleep(0.1)
        prune_dead_progress()  # the last batches' parts: the trainer trained them all
        if evaluator is not None:  # the final policy's evaluation, before DONE stops the servers
            await evaluator.finish(end_step)
        await monitor.finish(end_step - 1)
    finally:
        if eval_task is not None:
            eval_task.cancel()
            await asyncio.gather(eval_task, return_exceptions=True)
            if evaluator.scorer is not None:
                await evaluator.scorer.close()
        monitor_task.cancel()
        watch_task.cancel()
        guard_task.cancel()
        await asyncio.gather(monitor_task, watch_task, guard_task, return_exceptions=True)
        monitor.forwarder.close()
        await close()


async def _nothing() -> None:
    return None


def start_evaluation(run: RunDir, recipe, env, router_url: str, api_key: str, policy, start_step: int):
    """(evaluator, its background task) for `[orchestrator.eval]`, or (None, None) when it is off."""
    from rlctl.orchestrator.dataset_environment import eval_environment
    from rlctl.orchestrator.evaluation import Evaluator

    eval_env = eval_environment(recipe, run, env)
    if eval_env is None:
        return None, None
    cfg = recipe.orchestrator
    scorer = None
    if cfg.reward.function:  # the recipe's reward scores eval too, in its own pool
        from rlctl.orchestrator.rewards import RewardScorer  # (the loop closes its scorer when training ends)

        scorer = RewardScorer.build(cfg.reward, eval_env, cfg.environment.name, cfg.environment.args)
    evaluator = Evaluator(cfg.eval, eval_env, router_url, api_key, policy, cfg.max_tokens,
                          record=lambda rec: append_record(run, "eval", rec), log=log, start_version=start_step,
                          request_timeout_s=cfg.request_timeout_s, scorer=scorer)
    log(f"evaluating {len(evaluator.prompts)} eval prompts every {cfg.eval.interval} policy versions")
    return evaluator, asyncio.create_task(evaluator.run())


def resume_start_step(run: RunDir) -> int:
    """First batch to collect: the resume step when one is given (`RLCTL_RESUME_STEP`, set by
    `rlctl resume` and requeued jobs, which also removed newer batches), else after the last batch."""
    from rlctl.orchestrator.exchange.checkpoints import newest_complete

    value = os.environ.get("RLCTL_RESUME_STEP", "")
    if value == "latest":
        value = str(newest_complete(run.checkpoints) or 0)
    if value.isdigit():
        return int(value)
    done_batches = complete_steps(run.rollouts)
    return done_batches[-1] + 1 if done_batches else 0


def restore_progress(run: RunDir, seed: int, env, start_step: int) -> tuple[random.Random, dict]:
    """Sampler and environment as saved in `checkpoints/step_<start>/orchestrator` (the prompt stream
    then continues exactly), or a sampler derived from (seed, step) when nothing was saved."""
    from rlctl.orchestrator.exchange.checkpoints import fallback_rng, load_orchestrator_state

    state = load_orchestrator_state(run.checkpoints, start_step) if start_step else None
    if state is None:
        if start_step:
            log(f"no saved orchestrator state for step {start_step}: sampler derived from (seed, step)")
        return fallback_rng(seed, start_step), {}
    rng = random.Random()
    rng.setstate(state["rng"])
    env.load_state_dict(state.get("environment") or {})
    log(f"restored sampler and environment state of step {start_step}")
    return rng, dict(state.get("counters") or {})


async def _until_first(main, *watchers: asyncio.Task) -> None:
    """Run `main`; if a watcher ends first (a reload error, a changed worker list), cancel main and
    raise the watcher's error."""
    main_task = asyncio.create_task(main)
    done, _ = await asyncio.wait({main_task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    if main_task not in done:
        main_task.cancel()
        await asyncio.gather(main_task, return_exceptions=True)
        for task in done:
            task.result()
        raise OrchestratorError("a watcher stopped unexpectedly")
    main_task.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.orchestrator")
    parser.add_argument("--run-dir", default=os.environ.get("RLCTL_RUN_DIR"), help="the run directory")
    args = parser.parse_args(argv)
    from rlctl.inference.processes import private_umask

    private_umask()  # rollouts, metrics, the router's log: the owner's only, whatever umask we were given
    if not args.run_dir:
        print("orchestrator: error: --run-dir (or RLCTL_RUN_DIR) is required", file=sys.stderr)
        return 2
    run = RunDir(Path(args.run_dir))
    attempt = int(os.environ.get("RLCTL_ATTEMPT", "1"))
    router = None
    try:
        import json

        from rlctl.inference.router import ROUTER_HOST, start_router
        from rlctl.orchestrator.exchange.placement import Placement

        recipe = validate(run.recipe_data())
        placement = Placement.from_dict(json.loads((run.configs / "placement.json").read_text()))
        preload_batch_modules()
        if recipe.deployment.inference_pool:
            return _orchestrate_in_pool(run, recipe)
        try:
            admin_token, api_key = run.admin_token(), run.api_key()
        except FileNotFoundError as exc:
            raise OrchestratorError(str(exc)) from None
        urls = wait_for_servers(run, placement.inference_servers, attempt, recipe.inference.startup_timeout_s)
        log_path = run.log_path(attempt, "orchestrator", "router")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            router = start_router(urls, recipe.router.policy, api_key=api_key, log_path=log_path)
        except (RuntimeError, OSError) as exc:  # not installed, died at start, or a foreign worker already
            raise OrchestratorError(str(exc)) from None
        run.announce("router", "0", {"url": router.url, "pid": router.proc.pid, "host": ROUTER_HOST})
        log(f"router {router.url} ({recipe.router.policy}) in front of {len(urls)} server(s)")
        _run_loop(orchestrate(run, recipe, router.url, urls, admin_token, api_key))
        _finish(run, recipe)
        return 0
    except RecipeError as exc:
        print(f"orchestrator: error: {exc}", file=sys.stderr)
        return 2
    except OrchestratorError as exc:
        print(f"orchestrator: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if router is not None:
            router.stop()


def _run_loop(main) -> None:
    from rlctl.inference.processes import fewer_gc_passes

    # at CPython's default: a full collection every ~25 steps, 0.1-0.24 s each with torch loaded
    fewer_gc_passes()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main)


def _finish(run: RunDir, recipe) -> None:
    atomic_write_json(run.done, {"time": time.time(), "by": "orchestrator", "steps": recipe.orchestrator.max_steps})
    log("DONE")


def _orchestrate_in_pool(run: RunDir, recipe) -> int:
    """The run's requests and weight updates go through the shared pool's front (pool_attach.py)."""
    from rlctl.orchestrator.pool_attach import PoolUnavailable, open_session, pool_gone

    import signal

    # a cancelled run detaches (the `finally` below) before the launcher's KILL: SIGTERM exits like ^C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = recipe.deployment.inference_pool
    try:
        session = open_session(run, name)
    except PoolUnavailable as exc:
        raise OrchestratorError(str(exc)) from None
    run.announce("router", "0", {"url": session.url, "pool": name})
    log(f"attached to pool {name} at {session.front}")
    try:
        _run_loop(orchestrate(run, recipe, session.url, [], "", session.api_key, pool=session))
    except Exception as exc:  # a stopped pool fails requests and reloads in many ways: say why, once
        if pool_gone(run, name, session.front):
            raise OrchestratorError(f"pool {name} is gone (stopped or failed): "
                                    f"`rlctl resume {run.root.name}` once it runs again") from None
        if isinstance(exc, PoolUnavailable):
            raise OrchestratorError(str(exc)) from None
        raise
    finally:
        session.detach()
    _finish(run, recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
