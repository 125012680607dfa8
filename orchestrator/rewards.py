"""Scoring rollouts without stalling or killing the rollout loop: `RewardScorer`.

`await scorer.score(prompt, completion_text)` returns the reward, or None when the call failed (counted
as a timeout, an error or a memory kill); `score_group` applies `orchestrator.reward.on_failure`.

Where a reward runs, decided once when the scorer is built:
- `orchestrator.reward.function` set (a built-in name or `module:function`): an `async def` function
  is awaited on the event loop under `timeout_s` (it must not block: remote judges, HTTP verifiers); a
  function with the attribute `reward_inline = True` (the cheap `exact_match`) is called inline; any
  other function runs in the worker pool. Workers import it by its reference, so it must be a
  module-level function of a module importable with the orchestrator's `sys.path`; only the prompt,
  the completion text and the float result cross the process boundary.
- unset: the environment's own `reward` method. `async def reward` is awaited; the built-in
  environments (`sequence`, `count_a`: a few character comparisons, cheaper than a round trip to a
  worker), an environment class with `reward_inline = True`, and an environment that was not loaded
  by name (nothing to rebuild it from) are called inline; any other environment runs in the pool,
  where each worker builds its own copy from `orchestrator.environment.name` / `args`.
Inline rewards are still guarded (an exception counts as an error) but cannot be timed out.

The pool: `workers` interpreters started fresh (never forked from the orchestrator, whose threads and
sockets must not be duplicated), each in a process group of its own, with its address space limited
(RLIMIT_AS = memory_mb, set after the reward is imported). One call at a time per worker over a socket
pair; the event loop waits on the socket (add_reader), no thread per call. A call past `timeout_s`
kills the worker's process group (the worker and whatever it started, e.g. the code sandbox).
MemoryError, or a worker killed by SIGKILL (the kernel OOM killer's signal), counts as a memory kill;
another exception or a worker that died counts as an error. Workers that timed out, ran out of memory
or died are replaced in the background while the others keep serving.
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import multiprocessing
import os
import pickle
import resource
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

from rlctl.orchestrator.reward_config import (BUILTIN_REWARDS, RewardConfig, check_reward_args,
                                              check_reward_dependencies, unknown_reward)
from rlctl.recipes.errors import RecipeError

STARTUP_TIMEOUT_S = 120.0  # importing a heavy reward (sympy, a verifier's stack) on a loaded machine
FAILURE_KINDS = ("timeouts", "errors", "memory_kills")
LOGGED_FAILURES = 3  # per kind: the first few go to the log with their message, the rest only to the metrics
MEMORY_HEADROOM_MB = 64  # a worker needs some room above what its imports took to run a call at all


class RewardsFailing(RuntimeError):
    """`max_consecutive_failures` reward calls in a row failed: the reward itself is broken."""


class RewardScorer:
    """Scores completions inline, on the loop (async rewards) or in a worker pool; counts failures."""

    def __init__(self, cfg: RewardConfig, mode: str, call: Callable | None = None, target: dict | None = None,
                 key: str = "orchestrator.reward.function"):
        self.cfg = cfg
        self.mode = mode  # "inline" | "async" | "pool"
        self._call = call
        self._pool = _WorkerPool(target or {}, cfg, key) if mode == "pool" else None
        self.counts = {kind: 0 for kind in (*FAILURE_KINDS, "dropped_groups")}
        self._reported = dict(self.counts)
        self._streak = 0

    @classmethod
    def build(cls, cfg: RewardConfig | None, env, env_name: str | None = None,
              env_args: dict[str, Any] | None = None) -> "RewardScorer":
        """The scorer for `cfg` (default: the environment's reward); see the module docstring."""
        from rlctl.orchestrator.environments import CountAEnvironment, SequenceEnvironment

        cfg = cfg or RewardConfig()
        if cfg.function:
            ref = BUILTIN_REWARDS.get(cfg.function, cfg.function)
            fn = load_reward(cfg)
            if inspect.iscoroutinefunction(fn):
                return cls(cfg, "async", functools.partial(fn, **cfg.args))
            if getattr(fn, "reward_inline", False):
                return cls(cfg, "inline", functools.partial(fn, **cfg.args))
            return cls(cfg, "pool", target={"function": ref, "args": dict(cfg.args)})
        if inspect.iscoroutinefunction(env.reward):
            return cls(cfg, "async", env.reward)
        if (type(env) in (SequenceEnvironment, CountAEnvironment) or getattr(env, "reward_inline", False)
                or env_name is None):
            return cls(cfg, "inline", env.reward)
        return cls(cfg, "pool", target={"environment": env_name, "args": dict(env_args or {})},
                   key="orchestrator.environment.name")

    async def start(self) -> None:
        """Start the workers now (else at the first call): a reward that cannot load fails the run early."""
        if self._pool is not None:
            await self._pool.ensure_started()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def score(self, prompt, completion_text: str) -> float | None:
        """The reward of one completion, or None if the call failed (the failure is counted)."""
        if self.mode == "pool":
            kind, value = await self._pool.call(prompt, completion_text)
        elif self.mode == "async":
            try:
                kind, value = "ok", await asyncio.wait_for(self._call(prompt, completion_text), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                kind, value = "timeouts", f"no result within {self.cfg.timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 - any failure of user code is counted, never fatal
                kind, value = _classify(exc)
        else:
            try:
                kind, value = "ok", self._call(prompt, completion_text)
            except Exception as exc:  # noqa: BLE001
                kind, value = _classify(exc)
        if kind == "ok":
            try:
                value = float(value)
            except (TypeError, ValueError):
                kind, value = "errors", f"returned {type(value).__name__}, not a number"
            else:
                if not math.isfinite(value):
                    kind, value = "errors", f"returned {value} (rewards must be finite)"
        if kind == "ok":
            self._streak = 0
            return value
        self.counts[kind] += 1
        self._streak += 1
        if self.counts[kind] <= LOGGED_FAILURES:
            print(f"[orchestrator reward] {kind[:-1].replace('_', ' ')}: {str(value)[:300]}"
                  + (" (further ones only in the metrics)" if self.counts[kind] == LOGGED_FAILURES else ""),
                  flush=True)
        if self._streak >= self.cfg.max_consecutive_failures:
            raise RewardsFailing(f"{self._streak} reward calls in a row failed (orchestrator.reward."
                                 f"max_consecutive_failures), last: {str(value)[:300]}")
        return None

    async def score_group(self, prompt, texts: list[str]) -> list[float] | None:
        """Rewards of a group's completions, scored concurrently. A failed call scores 0, or with
        `on_failure = "drop_group"` the whole group is dropped (None; counted)."""
        values = await asyncio.gather(*(self.score(prompt, t) for t in texts))
        if any(v is None for v in values):
            if self.cfg.on_failure == "drop_group":
                self.counts["dropped_groups"] += 1
                return None
            return [0.0 if v is None else v for v in values]
        return list(values)

    def take_step_counts(self) -> dict[str, int]:
        """Failures since the previous call, keyed like the orchestrator's step record fields."""
        out = {f"reward_{k}": self.counts[k] - self._reported[k] for k in self.counts}
        self._reported = dict(self.counts)
        return out


def _classify(exc: BaseException) -> tuple[str, str]:
    kind = "memory_kills" if isinstance(exc, MemoryError) else "errors"
    return kind, f"{type(exc).__name__}: {exc}"


def load_reward(cfg: RewardConfig) -> Callable:
    """`cfg.function`, imported, with what it needs installed and `cfg.args` fitting it (launch calls
    this for the built-ins, so that their args fail there rather than when the orchestrator starts)."""
    fn = import_reward(BUILTIN_REWARDS.get(cfg.function, cfg.function))
    check_reward_dependencies(cfg.function)
    check_reward_args(cfg.function, fn, cfg.args)
    return fn


def import_reward(ref: str, key: str = "orchestrator.reward.function") -> Callable:
    """The callable a `module:function` reference names (one-line RecipeError otherwise)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise unknown_reward(ref, key)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RecipeError(f"cannot import module {module_name!r} ({exc})", key=key) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"module {module_name!r} has no function {attr!r}", key=key)
    return fn


# ---- the pool ---------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc = proc
        self.conn = conn

    def kill(self) -> None:
        """SIGKILL the worker's process group: the worker and any subprocess it started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.conn.close()


class _WorkerPool:
    def __init__(self, target: dict, cfg: RewardConfig, key: str):
        self.target = target
        self.cfg = cfg
        self.key = key  # the recipe key to name when the reward cannot be loaded in a worker
        self._idle: asyncio.Queue[_Worker | None] | None = None
        self._workers: set[_Worker] = set()
        self._background: set[asyncio.Task] = set()
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._closing = False
        self._broken: str | None = None

    async def ensure_started(self) -> None:
        if self._started:
            return
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            self._idle = asyncio.Queue()
            results = await asyncio.gather(*(self._spawn() for _ in range(self.cfg.workers)), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await self.close()
                raise failed[0]
            for worker in results:
                self._idle.put_nowait(worker)
            self._started = True

    async def call(self, prompt, text: str) -> tuple[str, Any]:
        await self.ensure_started()
        worker = await self._idle.get()
        if worker is None:  # a replacement could not be started: the pool is gone
            self._idle.put_nowait(None)
            raise RewardsFailing(f"reward workers cannot be restarted: {self._broken}")
        try:
            payload = pickle.dumps((prompt, text))
        except Exception as exc:  # noqa: BLE001 - e.g. a lambda in prompt.info
            self._idle.put_nowait(worker)
            return "errors", f"the prompt cannot be sent to a reward worker: {type(exc).__name__}: {exc}"
        try:
            worker.conn.send_bytes(payload)
            kind, value = await asyncio.wait_for(_reply(worker.conn), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            self._replace(worker)
            return "timeouts", f"no result within {self.cfg.timeout_s:g} s (worker replaced)"
        except (EOFError, OSError):
            code = await asyncio.to_thread(worker.proc.wait)
            self._replace(worker)
            kind = "memory_kills" if code == -signal.SIGKILL else "errors"
            return kind, f"reward worker died (exit code {code}; replaced)"
        except BaseException:  # cancelled mid-call: its reply would reach the next caller
            self._replace(worker)
            raise
        if kind == "memory_kills":
            self._replace(worker)  # after a MemoryError its heap (or a C extension's state) is suspect
        else:
            self._idle.put_nowait(worker)
        return kind, value

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        if self._closing:
            return
        task = asyncio.get_running_loop().create_task(self._respawn(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _respawn(self, dead: _Worker) -> None:
        await asyncio.to_thread(dead.proc.wait)
        error = None
        for attempt in range(3):
            try:
                self._idle.put_nowait(await self._spawn())
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                error = exc
                await asyncio.sleep(0.5 * 2 ** attempt)
        self._broken = str(error)
        self._idle.put_nowait(None)

    async def _spawn(self) -> _Worker:
        parent, child = multiprocessing.Pipe(duplex=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)}
        proc = subprocess.Popen(
            [sys.executable, "-c", "from rlctl.orchestrator.rewards import worker_main; worker_main()",
             str(child.fileno())],
            pass_fds=[child.fileno()], start_new_session=True, stdin=subprocess.DEVNULL, env=env)
        child.close()
        worker = _Worker(proc, parent)
        self._workers.add(worker)
        try:
            parent.send({**self.target, "memory_mb": self.cfg.memory_mb})
            kind, value = await asyncio.wait_for(_reply(parent), STARTUP_TIMEOUT_S)
        except (asyncio.TimeoutError, EOFError, OSError):
            worker.kill()
            self._workers.discard(worker)
            code = await asyncio.to_thread(proc.wait)
            raise RuntimeError(f"a reward worker did not start within {STARTUP_TIMEOUT_S:g} s (exit code {code})") from None
        except BaseException:
            worker.kill()
            self._workers.discard(worker)
            raise
        if kind == "ready":
            return worker
        worker.kill()
        self._workers.discard(worker)
        if kind == "too_big":
            raise RecipeError(f"{self.cfg.memory_mb} MiB is too small: a reward worker already uses {value} MiB of "
                              f"address space after loading the reward (allowed up to {1 << 22})",
                              key="orchestrator.reward.memory_mb")
        raise RecipeError(f"the reward cannot be loaded in a worker: {value}", key=self.key)

    async def close(self) -> None:
        self._closing = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()
        await asyncio.gather(*(asyncio.to_thread(w.proc.wait) for w in workers))


async def _reply(conn: Connection):
    """The next message on `conn`, waiting on the event loop. Replies are a few bytes written at once,
    so once the socket is readable the whole message is there (or EOF: the worker died)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    return conn.recv()


# ---- inside a worker process ------------------------------------------------------------------------
def _load_target(init: dict) -> Callable:
    if "function" in init:
        return functools.partial(import_reward(init["function"]), **init.get("args", {}))
    from rlctl.orchestrator.environments import load_environment

    return load_environment(init["environment"], init.get("args")).reward


def _address_space_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20


def worker_main() -> None:
    """A reward worker: load the reward, limit the address space, then answer calls until EOF."""
    conn = Connection(int(sys.argv[1]))
    init = conn.recv()
    try:
        fn = _load_target(init)
    except BaseException as exc:  # noqa: BLE001 - reported to the orchestrator as one line
        conn.send(("init_error", str(exc) if isinstance(exc, RecipeError) else f"{type(exc).__name__}: {exc}"))
        return
    used, limit = _address_space_mb(), int(init["memory_mb"])
    if used + MEMORY_HEADROOM_MB > limit:
        conn.send(("too_big", used))
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit << 20, limit << 20))
    conn.send(("ready", used))
    while True:
        try:
            prompt, text = conn.recv()
        except (EOFError, OSError):
            return  # the orchestrator closed the pool or died
        try:
            reply = ("ok", float(fn(prompt, text)))
        except MemoryError as exc:
            reply = ("memory_kills", f"MemoryError past orchestrator.reward.memory_mb = {limit} ({exc})")
        except BaseException as exc:  # noqa: BLE001 - SystemExit from user code is a failed call too
            reply = ("errors", f"{type(exc).__name__}: {str(exc)[:300]}")
        conn.send(reply)
