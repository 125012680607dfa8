"""Trivial but real entry points for launcher tests: `python -m rlctl.launchers.smoke --run-dir DIR`.

Select them per group with `deployment.entrypoints = {trainer = "rlctl.launchers.smoke", ...}`.
Each task writes `smoke/<group>.<rank>.json` (host, pid, the contract's environment) and follows the
component protocol: inference tasks announce a URL, the orchestrator waits for every inference
announcement and every trainer rank, announces a router, holds `deployment.smoke.run_s` seconds, writes `DONE` and exits 0;
trainer and inference tasks exit 0 once `DONE` exists. `deployment.smoke.fail_*` makes one rank exit
with an error code, for teardown tests.

With `deployment.smoke.steps` the trainer (rank 0) also publishes small real weights every step through
the weight store and applies the run's retention, and the orchestrator plays the weight watcher: it
"loads" (reads) each newest step and records the served version; the trainer trains step N only once
version N - max_off_policy_steps is served, as the real one waits for a batch of such a policy.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlctl.inference.server import free_port
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.orchestrator.exchange.files import atomic_write_json
from rlctl.orchestrator.exchange.metrics import StepRecord


@dataclass(kw_only=True)
class SmokeStepRecord(StepRecord):
    """The smoke trainer's step record: a reward that rises with the step, and the attempt that wrote it."""

    component = "trainer"
    reward_mean: float
    attempt: int

ENV_PREFIXES = ("RLCTL_", "MASTER_", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID", "SLURMD_NODENAME")
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")


def _wait_done(run: RunDir, timeout_s: float = 24 * 3600) -> None:
    deadline = time.time() + timeout_s
    while not run.done.exists():
        if time.time() > deadline:
            sys.exit("smoke: DONE never appeared")
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    run = RunDir(Path(args.run_dir))
    recipe = json.loads(run.recipe_json.read_text())
    placement = json.loads((run.configs / "placement.json").read_text())
    smoke = recipe.get("deployment", {}).get("smoke", {})
    group, rank = os.environ["RLCTL_GROUP"], int(os.environ.get("RLCTL_RANK", "0"))
    record = {
        "group": group, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "started": time.time(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_KEYS},
    }
    out = run.root / "smoke" / f"{group}.{rank}.json"
    atomic_write_json(out, record)
    print(f"smoke {group} rank {rank} on {record['node']} pid {record['pid']}", flush=True)

    if smoke.get("fail_group") == group and int(smoke.get("fail_rank", 0)) == rank:
        time.sleep(float(smoke.get("fail_after_s", 0.0)))
        print(f"smoke {group} rank {rank}: error: failing on purpose", flush=True)
        return int(smoke.get("exit_code", 3))

    steps = int(smoke.get("steps", 0))
    if group == "trainer" and steps:
        return _smoke_training(run, recipe, rank, steps, float(smoke.get("step_s", 0.5)))
    if group == "inference":
        host = os.environ["RLCTL_BIND_HOST"]
        url = f"http://{host}:{free_port(host)}"
        run.announce("inference", os.environ["RLCTL_SERVER_INDEX"],
                     {"url": url, "index": int(os.environ["RLCTL_SERVER_INDEX"]), "pid": os.getpid(), "host": host})
        _wait_done(run)
    elif group == "trainer":
        _wait_done(run)
    else:
        # Like the real orchestrator, which waits for the servers and the trainer's step_0 weights:
        # wait until every inference server announced itself and every trainer rank checked in.
        want = int(placement["inference_servers"])
        ranks = int(placement["trainer_world_size"])
        deadline = time.time() + 300
        while (len(run.announced("inference")) < want
               or len(list((run.root / "smoke").glob("trainer.*.json"))) < ranks):
            if time.time() > deadline:
                print(f"smoke orchestrator: only {len(run.announced('inference'))}/{want} servers", flush=True)
                return 4
            time.sleep(0.2)
        router = {"url": f"http://127.0.0.1:{free_port('127.0.0.1')}", "pid": os.getpid()}
        run.announce("router", "0", router)
        record["saw"] = {"inference": [a["url"] for a in run.announced("inference")], "router": router["url"]}
        atomic_write_json(out, record)
        if steps:  # the smoke trainer ends the run
            code = _smoke_weight_watcher(run)
            if code:
                return code
        else:
            time.sleep(float(smoke.get("run_s", 1.0)))
            atomic_write_json(run.done, {"time": time.time(), "by": "smoke"})
    print(f"smoke {group} rank {rank}: clean exit", flush=True)
    return 0


_TERMINATED = False


def _on_term(_signum, _frame) -> None:
    global _TERMINATED
    _TERMINATED = True


def _smoke_training(run: RunDir, recipe: dict, rank: int, steps: int, step_s: float) -> int:
    """A step counter with the real checkpoint protocol (parts + markers, PREEMPT, resume step)."""
    from rlctl.orchestrator.exchange.checkpoints import TRAINER, is_complete, write_part
    from rlctl.orchestrator.exchange.heartbeat import Heartbeat
    from rlctl.orchestrator.exchange.metrics import append_record
    from rlctl.orchestrator.exchange.retention import prune_checkpoints, sweep_trainer_staging

    preempt, done = run.preempt, run.done
    # Like the real trainer: SIGTERM (Slurm's preemption, scancel) means checkpoint at the next step
    # boundary, then exit 128+15. Other ranks outlive the TERM until rank 0 has saved (srun's
    # --kill-on-bad-exit ends them once rank 0 exits non-zero).
    signal.signal(signal.SIGTERM, _on_term)
    if rank != 0:
        while not (done.exists() or preempt.exists()):
            time.sleep(0.2)
        return 0
    value = os.environ.get("RLCTL_RESUME_STEP", "")
    start = int(value) if value.isdigit() else 0
    if start and not is_complete(run.checkpoints, start):
        print(f"smoke trainer: error: no complete checkpoint step_{start}", flush=True)
        return 2
    interval = int(recipe.get("checkpoint", {}).get("interval", 0))
    keep_checkpoints = int(recipe.get("checkpoint", {}).get("keep_last", 2))
    attempt = int(os.environ.get("RLCTL_ATTEMPT", "0"))

    def save(step: int) -> None:
        write_part(run.checkpoints, step, TRAINER, {"state.json": json.dumps({"step": step}).encode()})
        prune_checkpoints(run.checkpoints, keep_checkpoints)

    sweep_trainer_staging(run)
    publish = _weights_publisher(run, recipe)
    publish(start)
    off_policy = int(recipe.get("orchestrator", {}).get("max_off_policy_steps", 1))
    timeout_s = float(recipe.get("trainer", {}).get("batch_timeout_s", 3600.0))
    heartbeat = Heartbeat(run, "trainer")
    heartbeat.beat(start)
    print(f"smoke trainer: steps {start}..{steps - 1} (attempt {attempt})", flush=True)
    for step in range(start, steps):
        if not _wait_served(run, step - off_policy, timeout_s):
            print(f"smoke trainer: version {step - off_policy} not served within {timeout_s:.0f}s", flush=True)
            return 1
        if preempt.exists() or _TERMINATED:
            save(step)
            cause = "SIGTERM" if _TERMINATED else "PREEMPT"
            print(f"smoke trainer: preempted, checkpoint step_{step} saved ({cause})", flush=True)
            return 128 + signal.SIGTERM if _TERMINATED else 0
        time.sleep(step_s)
        append_record(run, "trainer", SmokeStepRecord(step=step, reward_mean=round(step / steps, 6), attempt=attempt))
        heartbeat.beat(step + 1)
        publish(step + 1)
        if interval and (step + 1) % interval == 0:
            save(step + 1)
    atomic_write_json(done, {"time": time.time(), "by": "smoke trainer", "steps": steps})
    print("smoke trainer: DONE", flush=True)
    return 0


SMOKE_WEIGHTS_NUMEL = 1 << 18  # 1 MiB of float32 per published step: tiny, yet far above the metrics' growth


def _weights_publisher(run: RunDir, recipe: dict):
    """publish(step): small real weights through the weight store, then the run's weight retention."""
    import torch

    from rlctl.orchestrator.exchange.retention import retain_weights
    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore

    store = FilesystemWeightStore(run.weights)
    keep_last = int(recipe.get("weights", {}).get("keep_last", 2))

    def publish(step: int) -> None:
        store.publish_state(step, {"smoke.weight": torch.full((SMOKE_WEIGHTS_NUMEL,), float(step))}, {"smoke": True})
        retain_weights(run, store, keep_last)

    return publish


def _wait_served(run: RunDir, version: int, timeout_s: float) -> bool:
    """Until the servers serve `version` (or newer), or PREEMPT / DONE appears; False on timeout."""
    from rlctl.orchestrator.exchange.retention import served_floor

    deadline = time.monotonic() + timeout_s
    while version > 0 and not (run.preempt.exists() or run.done.exists() or _TERMINATED):
        served = served_floor(run)
        if served is not None and served >= version:
            break
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _smoke_weight_watcher(run: RunDir) -> int:
    """The orchestrator's weight watcher without servers: record the served version (0 at start),
    read every newest complete step as a server would load it, record it, until DONE. A step that
    vanishes while it is being read is the failure retention must never cause: exit 5."""
    from rlctl.orchestrator.exchange.retention import record_serving
    from rlctl.orchestrator.exchange.weights_fs import FilesystemWeightStore, shard_files

    store = FilesystemWeightStore(run.weights)
    served = 0
    record_serving(run, served)
    while not run.done.exists():
        newest = store.latest()
        if newest is None or newest <= served:
            time.sleep(0.005)
            continue
        try:
            for path in shard_files(store.location(newest)):
                path.read_bytes()
        except FileNotFoundError:
            print(f"smoke orchestrator: weights/step_{newest} vanished while being loaded", flush=True)
            return 5
        served = newest
        record_serving(run, served)
    print(f"smoke orchestrator: served up to step_{served}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
