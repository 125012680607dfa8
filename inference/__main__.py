"""`python -m rlctl.inference --run-dir DIR`: run one vLLM server of the run and supervise it.

Reads the resolved recipe and placement from the run dir and `RLCTL_SERVER_INDEX` / `RLCTL_BIND_HOST`
from the environment, starts the server as a child (its own process group, output copied to our
stdout), announces it once healthy, and exits when it dies (non-zero), when `<run>/DONE` appears
(exit 0) or on SIGTERM/SIGINT — always taking the server's whole process group down with it (TERM, then
KILL after `SERVER_STOP_S`: see rlctl.inference.processes for why TERM alone does not do).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from rlctl.inference.caches import share_compile_cache
from rlctl.inference.server import (ADDRESS_IN_USE, PORT_TRIES, check_model_for_target, data_parallel,
                                    format_command, free_port, inference_target, render_server_command,
                                    server_env, tensor_parallel)
from rlctl.inference.ipc_dir import ipc_safe_tmpdir
from rlctl.inference.processes import exit_status, own_group_dying_with_parent, private_umask, stop_process_group
from rlctl.orchestrator.exchange.heartbeat import Heartbeat, beat_interval
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import validate

LOG_TAIL_LINES = 40
# TERM → KILL bound for the server's process group; shorter than the launchers' own bound for this
# process (launchers/local.py KILL_AFTER_S), so the server is gone before anyone kills us.
SERVER_STOP_S = 8.0
WARM_UP_MAX_N = 16  # completions in the warm-up request: a group's worth, as the first real batch sends
# A port taken before the server bound it (a resumed attempt's server died of it once in a test run):
# what _serve returns for that; never a process's exit code here. Retried up to server.PORT_TRIES.
PORT_TAKEN = -98


def _placement(run: RunDir) -> Placement:
    path = run.configs / "placement.json"
    if path.exists():
        return Placement.from_dict(json.loads(path.read_text()))
    return Placement(1, 1, 1, 1, 0, "inference_node")


def resolve_model_dir(recipe, run: RunDir) -> str:
    """The checkpoint the server loads first: the built tiny model, a local HF dir, or a hub id."""
    name = recipe.model.name
    from rlctl.trainer.tiny_model import build_tiny_model, is_tiny_model

    if is_tiny_model(name):  # no-op when the launcher built it
        return str(build_tiny_model(run.model, recipe.model.build_seed, name=name))
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        return str(path.parent)
    return str(path) if path.is_dir() else name


def _dp_master(run: RunDir, host: str, index: int, dp: int, timeout_s: float) -> tuple[str, int]:
    """Rank 0 of each expert-parallel DP group publishes (host, rpc port); the other ranks read it."""
    group, rank = index // dp, index % dp
    if rank == 0:
        master = {"host": host, "port": free_port(host)}
        run.announce("dp_master", str(group), master)
        return master["host"], master["port"]
    path = run.services / "dp_master" / f"{group}.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"DP group {group}: rank 0 never announced its address ({path})")
        time.sleep(1)
    master = json.loads(path.read_text())
    return master["host"], int(master["port"])


def _pump(stream, tail: collections.deque) -> None:
    """Copy the server's output to our stdout (the launcher's log) and keep the last lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        sys.stdout.write(line)
        sys.stdout.flush()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _warm_up(url: str, api_key: str, group_size: int, timeout_s: float) -> float | None:
    """One tiny completion before the server is announced; returns its seconds, or None if it failed.

    Why: vLLM's first request after start-up stalls (on 2 CPU cores 7–11 s: the engine polls its
    worker several times before the first result). Taken here, the stall overlaps the trainer's own
    start-up instead of delaying the run's first batch and therefore its first trainer step."""
    from rlctl.inference.server import SERVED_MODEL_NAME

    # shaped like the orchestrator's requests: the stall is in the first sampled request with logprobs
    # (a greedy request without them is answered in 0.03 s and leaves it to the first real batch)
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": [1, 1], "max_tokens": 2, "temperature": 1.0,
                       "n": max(1, min(group_size, WARM_UP_MAX_N)),
                       "logprobs": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=max(timeout_s, 1.0)) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as e:
        print(f"rlctl.inference: warm-up request failed ({e}); announcing the server anyway", flush=True)
        return None
    return time.monotonic() - start


def _fail(message: str, tail: collections.deque | None = None) -> int:
    text = f"rlctl.inference: {message}"
    if tail:
        text += f"\n--- last {len(tail)} lines of the server log ---\n" + "".join(tail).rstrip()
    print(text, file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlctl.inference", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=os.environ.get("RLCTL_RUN_DIR"), help="the run directory")
    args = parser.parse_args(argv)
    private_umask()  # the server's caches and temp files under the run dir, too
    if not args.run_dir:
        return _fail("--run-dir (or RLCTL_RUN_DIR) is required")
    run = RunDir(Path(args.run_dir))
    index = int(os.environ.get("RLCTL_SERVER_INDEX", "0"))
    host = os.environ.get("RLCTL_BIND_HOST", "127.0.0.1")
    if host in ("0.0.0.0", "::"):
        return _fail(f"RLCTL_BIND_HOST={host}: bind to the node's own address, not a wildcard")
    # A server killed hard in an earlier attempt may have left its endpoint behind: never announce stale.
    (run.services / "inference" / f"{index}.json").unlink(missing_ok=True)
    try:
        recipe = validate(run.recipe_data())
        placement = _placement(run)
        target = inference_target(placement)
        admin_token, api_key = run.admin_token(), run.api_key()
        model_dir = resolve_model_dir(recipe, run)
        check_model_for_target(model_dir, target)
        dp_master = None
        if target == "gpu" and recipe.inference.ep and data_parallel(recipe, placement) > 1:
            dp = data_parallel(recipe, placement)
            dp_master = _dp_master(run, host, index, dp, recipe.inference.startup_timeout_s)
        initial_adapter = None
        if recipe.trainer.lora.enabled:  # served until the trainer's first adapter is swapped in
            from rlctl.inference.lora_serving import write_zero_adapter

            initial_adapter = write_zero_adapter(model_dir, recipe.trainer.lora, run.root / "cache" / f"lora_zero_{index}")

        def command(port: int) -> list[str]:
            return render_server_command(recipe, placement, target, model_dir=model_dir, host=host, port=port,
                                         server_index=index, dp_master=dp_master, initial_adapter=initial_adapter)

        port = free_port(host)
        cmd = command(port)
    except (RecipeError, FileNotFoundError, RuntimeError, ValueError) as e:
        return _fail(str(e))
    env = {**os.environ, **server_env(recipe, target, run.root, admin_token, api_key,
                                      tp=tensor_parallel(recipe, placement))}
    private_tmp = ipc_safe_tmpdir(env["TMPDIR"])  # a deep run dir would overflow socket paths
    if private_tmp:
        env["TMPDIR"] = private_tmp.path
    for key in ("VLLM_CACHE_ROOT", "TMPDIR"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    share_compile_cache(env["TMPDIR"], env["TORCHINDUCTOR_CACHE_DIR"])
    print(f"rlctl.inference[{index}]: starting ({target}): {format_command(cmd)}", flush=True)

    stop = threading.Event()

    def request_stop(*_) -> None:
        # Said at once, as one write (no buffer a handler could re-enter): the launcher's stop reaches
        # vLLM too, and what it logs after this line (EngineDeadError...) is the summary's shutdown noise.
        if not stop.is_set():
            os.write(sys.stdout.fileno(), f"rlctl.inference[{index}]: stop requested, stopping the server\n".encode())
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        for tries in range(PORT_TRIES):
            if tries:
                taken, port = port, free_port(host)
                cmd = command(port)
                print(f"rlctl.inference[{index}]: port {taken} was taken before the server could bind it; "
                      f"starting it again on port {port}", flush=True)
            code = _serve(run, cmd, env, host, port, index, recipe, stop, api_key)
            if code != PORT_TAKEN:
                return code
        return _fail(f"server {index}: {PORT_TRIES} ports in a row were taken before the server could bind them")
    finally:
        if private_tmp:
            private_tmp.remove()


def _serve(run, cmd, env, host, port, index, recipe, stop, api_key) -> int:
    """Start the server and supervise it until it ends: its exit code, or PORT_TAKEN."""
    started = time.monotonic()
    # Own process group so we can stop it (and vLLM's engine, workers, resource tracker) without signalling
    # ourselves; inside our session, so the launcher reaches it even if we die first.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=run.root, preexec_fn=own_group_dying_with_parent)
    tail: collections.deque = collections.deque(maxlen=LOG_TAIL_LINES)
    pump = threading.Thread(target=_pump, args=(proc.stdout, tail), daemon=True)
    pump.start()
    try:
        return _supervise(run, proc, f"http://{host}:{port}", index, host, recipe, stop, started, tail, api_key)
    finally:
        stop_process_group(proc, SERVER_STOP_S)
        pump.join(timeout=5)
        (run.services / "inference" / f"{index}.json").unlink(missing_ok=True)


def _supervise(run, proc, url, index, host, recipe, stop, started, tail, api_key) -> int:
    deadline = started + recipe.inference.startup_timeout_s
    # Progress of a server = health probes it answers; its startup is bounded by its own timeout.
    heartbeat = Heartbeat(run, f"inference.{index}", beat_interval(recipe.monitoring.stall_timeout_s))
    probes, next_probe = 0, 0.0
    while not _healthy(url):
        heartbeat.beat(probes, waiting_for="server startup")
        if stop.is_set():
            return 143
        if (code := exit_status(proc)) is not None:
            time.sleep(0.5)  # let the pump catch the last lines
            if stop.is_set():  # the launcher's stop reached the server's group too, first: a stop, not a failure
                return 143
            if any(ADDRESS_IN_USE in line for line in tail):
                return PORT_TAKEN
            return _fail(f"server {index} exited with code {code} before becoming ready", tail)
        if time.monotonic() > deadline:
            return _fail(f"server {index} not healthy after {recipe.inference.startup_timeout_s:.0f} s at {url}", tail)
        time.sleep(0.2)
    healthy_s = time.monotonic() - started
    # P/D servers answer only as a pair (a decode server waits for its prefill's KV): no lone warm-up
    disaggregated = recipe.inference.disaggregation.enabled
    warm_up_s = None if disaggregated else _warm_up(url, api_key, recipe.orchestrator.group_size,
                                                         deadline - time.monotonic())
    startup_s = time.monotonic() - started
    run.announce("inference", str(index), {
        "url": url, "index": index, "pid": proc.pid, "host": host, "startup_s": round(startup_s, 2),
        "healthy_s": round(healthy_s, 2), "warm_up_s": None if warm_up_s is None else round(warm_up_s, 2),
        # It serves the initial model; the orchestrator reloads the newest published step into it.
        "weights_step": None,
    })
    warm = "skipped (P/D)" if disaggregated else "failed" if warm_up_s is None else f"{warm_up_s:.1f} s"
    print(f"rlctl.inference[{index}]: ready at {url} after {startup_s:.1f} s (healthy at {healthy_s:.1f} s, "
          f"first request {warm})", flush=True)
    done = run.done
    while True:
        if done.exists():
            print(f"rlctl.inference[{index}]: run finished, stopping the server", flush=True)
            return 0
        if stop.is_set():  # request_stop said so
            return 143
        if (code := exit_status(proc)) is not None:
            time.sleep(0.5)
            if stop.is_set():
                return 143
            return _fail(f"server {index} died with code {code}", tail)
        if time.monotonic() >= next_probe:
            next_probe = time.monotonic() + heartbeat.interval_s
            if _healthy(url):
                probes += 1
                heartbeat.beat(probes)
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
