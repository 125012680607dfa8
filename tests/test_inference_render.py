"""Rendering of the vLLM server and router command lines for CPU and GPU targets (no processes started)."""
from __future__ import annotations

import json
import os

import pytest

from rlctl.inference.auth import ADMIN_TOKEN_ENV, API_KEY_ENV
from rlctl.inference.caches import share_compile_cache, torch_default_compile_dir
from rlctl.inference.router import render_router_command
from rlctl.inference.server import (
    check_model_for_target,
    format_command,
    render_server_command,
    server_env,
)
from rlctl.orchestrator.exchange.placement import Placement
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import load_recipe

CPU = Placement(1, 1, 2, 1, 0, "inference_node")
GPU = Placement(2, 2, 8, 8, 1, "cpu_partition")
TOKEN = "s3cret-token-value"


def recipe(*overrides: str):
    return load_recipe(["tiny-cpu"], list(overrides))


def render(r, placement, target, **kw):
    kw.setdefault("has_module", lambda name: True)
    return render_server_command(r, placement, target, model_dir="/models/m", host="10.0.0.5", port=8123, **kw)


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def test_cpu_command_has_model_host_port_and_reload_extension():
    cmd = render(recipe(), CPU, "cpu")
    # never imports from the cwd; vLLM's server with its engine core forked (rlctl.inference.vllm_cpu_main)
    assert cmd[1:4] == ["-P", "-m", "rlctl.inference.vllm_cpu_main"]
    assert flag(cmd, "--model") == "/models/m"
    assert flag(cmd, "--host") == "10.0.0.5" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "--max-model-len") == "64"
    assert flag(cmd, "--tensor-parallel-size") == "1"
    assert flag(cmd, "--worker-extension-cls") == "rlctl.inference.worker_ext.ReloadExtension"
    assert flag(cmd, "--middleware") == "rlctl.inference.auth.AdminAuthMiddleware"
    assert "--enforce-eager" in cmd
    assert "--gpu-memory-utilization" not in cmd  # meaningless on CPU


def test_enforce_eager_follows_recipe():
    assert "--enforce-eager" not in render(recipe("inference.enforce_eager=false"), CPU, "cpu")


def test_engine_stats_follow_recipe():
    assert "--disable-log-stats" in render(recipe(), CPU, "cpu")  # the tiny recipe turns them off
    assert "--disable-log-stats" not in render(recipe("inference.engine_stats=true"), CPU, "cpu")


def test_max_num_seqs_follows_recipe():
    # the tiny recipe: every rollout in flight
    assert flag(render(recipe(), CPU, "cpu"), "--max-num-seqs") == "1024"
    assert flag(render(recipe("inference.max_num_seqs=64"), GPU, "gpu"), "--max-num-seqs") == "64"
    assert "--max-num-seqs" not in render(load_recipe(["tiny-moe-cpu"], []), CPU, "cpu")  # vLLM's default


@pytest.mark.parametrize(
    "override, key",
    [
        ("inference.fp8=true", "inference.fp8"),
        ("inference.ep=true", "inference.ep"),
        ("inference.disaggregation.enabled=true", "inference.disaggregation.enabled"),
        ("inference.kv_offload.tier=cpu", "inference.kv_offload.tier"),
    ],
)
def test_gpu_only_features_fail_on_cpu_naming_the_key(override, key):
    with pytest.raises(RecipeError) as err:
        render(recipe(override), CPU, "cpu")
    msg = str(err.value)
    assert msg.startswith(key + ":") and "GPU" in msg and "\n" not in msg


def test_gpu_command_renders_fp8_ep_deepep_and_memory():
    r = recipe("inference.fp8=true", "inference.ep=true", "inference.all2all_backend=deepep_low_latency",
               "inference.dp=4", "inference.tp=2", "inference.gpu_memory_utilization=0.8")
    cmd = render(r, GPU, "gpu", server_index=6, dp_master=("10.0.0.1", 13345))
    assert cmd[1:4] == ["-P", "-m", "rlctl.inference.vllm_main"]  # vLLM's own server, adapter swaps read once
    assert flag(cmd, "--quantization") == "fp8"
    assert "--enable-expert-parallel" in cmd
    assert flag(cmd, "--all2all-backend") == "deepep_low_latency"
    assert flag(cmd, "--tensor-parallel-size") == "2"
    assert flag(cmd, "--data-parallel-size") == "4" and flag(cmd, "--data-parallel-rank") == "2"
    assert flag(cmd, "--data-parallel-address") == "10.0.0.1" and flag(cmd, "--data-parallel-rpc-port") == "13345"
    assert flag(cmd, "--gpu-memory-utilization") == "0.8"


def test_gpu_tp_auto_takes_the_placement_gpus_per_server():
    cmd = render(recipe("inference.tp=auto"), Placement(1, 1, 8, 2, 4, "cpu_partition"), "gpu")
    assert flag(cmd, "--tensor-parallel-size") == "4"
    assert "--quantization" not in cmd and "--enable-expert-parallel" not in cmd


def test_deepep_without_deep_ep_names_the_extra():
    r = recipe("inference.ep=true", "inference.all2all_backend=deepep_high_throughput")
    with pytest.raises(RecipeError, match="deep_ep") as err:
        render(r, GPU, "gpu", has_module=lambda name: name != "deep_ep")
    assert str(err.value).startswith("inference.all2all_backend:")


def test_all2all_backend_without_ep_is_rejected():
    with pytest.raises(RecipeError, match="inference.ep = true"):
        render(recipe("inference.all2all_backend=naive"), GPU, "gpu")


@pytest.mark.parametrize("connector, cls", [("nixl", "NixlConnector"), ("mooncake", "MooncakeConnector")])
def test_prefill_decode_roles_and_kv_transfer_config(connector, cls):
    r = recipe("inference.disaggregation.enabled=true", f"inference.disaggregation.kv_connector={connector}",
               "inference.disaggregation.prefill_replicas=1")
    placement = Placement(1, 2, 8, 1, 8, "cpu_partition")
    prefill = json.loads(flag(render(r, placement, "gpu", server_index=0), "--kv-transfer-config"))
    decode = json.loads(flag(render(r, placement, "gpu", server_index=1), "--kv-transfer-config"))
    assert prefill == {"kv_connector": cls, "kv_role": "kv_producer"}
    assert decode == {"kv_connector": cls, "kv_role": "kv_consumer"}


def test_kv_offload_tiers():
    cpu_tier = render(recipe("inference.kv_offload.tier=cpu", "inference.kv_offload.cpu_gib=64"), GPU, "gpu")
    assert flag(cpu_tier, "--kv-offloading-size") == "64.0" and flag(cpu_tier, "--kv-offloading-backend") == "native"
    both = render(recipe("inference.kv_offload.tier=mooncake", "inference.disaggregation.enabled=true"), GPU, "gpu")
    config = json.loads(flag(both, "--kv-transfer-config"))
    assert config["kv_connector"] == "MultiConnector" and config["kv_role"] == "kv_producer"
    names = [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]]
    assert names == ["NixlConnector", "MooncakeStoreConnector"]
    with pytest.raises(RecipeError, match="cpu_gib"):
        render(recipe("inference.kv_offload.tier=cpu"), GPU, "gpu")


def test_token_travels_in_env_never_on_the_command_line(tmp_path):
    r = recipe()
    cmd = render(r, CPU, "cpu")
    env = server_env(r, "cpu", tmp_path, TOKEN, "api-key")
    assert env[ADMIN_TOKEN_ENV] == TOKEN and env[API_KEY_ENV] == "api-key" and env["VLLM_API_KEY"] == ""
    assert not any(TOKEN in part for part in cmd) and TOKEN not in format_command(cmd)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["TMPDIR"].startswith(str(tmp_path))
    for shared in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):  # caches keyed by code outlive the run
        assert not env[shared].startswith(str(tmp_path))


@pytest.mark.parametrize("key,name", [("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("VLLM_CACHE_ROOT", "vllm")])
def test_code_keyed_caches_are_shared_between_runs_unless_the_user_says_where(tmp_path, monkeypatch, key, name):
    monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    r = recipe()
    assert server_env(r, "cpu", tmp_path / "a", TOKEN, "k")[key] == \
        server_env(r, "cpu", tmp_path / "b", TOKEN, "k")[key] == str(tmp_path / "xdg" / "rlctl" / name)
    monkeypatch.setenv(key, str(tmp_path / "mine"))
    assert server_env(r, "gpu", tmp_path / "a", TOKEN, "k")[key] == str(tmp_path / "mine")
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env(r, "gpu", tmp_path, TOKEN, "api-key")


def test_servers_do_not_inherit_the_tmp_cache_torch_put_in_the_launchers_environment(tmp_path, monkeypatch):
    """torch's first look at its cache dir writes its default (under this process's /tmp) into the
    environment: a launcher that had imported torch._dynamo would otherwise hand that to every server."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "job_tmp"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cache_dir() == os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(torch_default_compile_dir())
    env = server_env(recipe(), "cpu", tmp_path / "run", TOKEN, "k")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg" / "rlctl" / "torchinductor")



def test_a_one_worker_cpu_engine_keeps_its_worker_in_process_unless_the_user_says(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    r = recipe()
    assert server_env(r, "cpu", tmp_path, TOKEN, "k", tp=1)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(r, "cpu", tmp_path, TOKEN, "k", tp=2)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(r, "gpu", tmp_path, TOKEN, "k", tp=1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(r, "cpu", tmp_path, TOKEN, "k", tp=1)


def test_a_cpu_engine_waits_passively_between_passes_unless_the_user_says(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    r = recipe()
    assert server_env(r, "cpu", tmp_path, TOKEN, "k", tp=2)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in server_env(r, "gpu", tmp_path, TOKEN, "k")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "OMP_WAIT_POLICY" not in server_env(r, "cpu", tmp_path, TOKEN, "k")


def test_cpu_rejects_head_dims_its_attention_kernels_lack(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(RecipeError, match="head_dim 16"):
        check_model_for_target(tmp_path, "cpu")
    check_model_for_target(tmp_path, "gpu")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}))
    check_model_for_target(tmp_path, "cpu")


def test_router_command_has_workers_policy_key_checks_and_own_prometheus_port():
    cmd = render_router_command(["http://a:1", "http://b:2"], "round_robin", 9000, 9001, python="python")
    assert cmd[:4] == ["python", "-P", "-m", "rlctl.inference.router"]
    assert cmd[cmd.index("--worker-urls") + 1: cmd.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]
    assert [cmd[i + 1] for i, part in enumerate(cmd) if part == "--key-check-url"] == [
        "http://a:1/v1/models", "http://b:2/v1/models"]
    assert flag(cmd, "--policy") == "round_robin"
    assert flag(cmd, "--prometheus-port") == "9001" and flag(cmd, "--port") == "9000"


def test_dtype_auto_follows_the_trainer():
    assert flag(render(recipe("trainer.dtype=float32"), CPU, "cpu"), "--dtype") == "float32"
    assert flag(render(recipe("trainer.dtype=bfloat16"), CPU, "cpu"), "--dtype") == "bfloat16"
    assert flag(render(recipe("trainer.dtype=float32", "inference.dtype=bfloat16"), CPU, "cpu"), "--dtype") == "bfloat16"


def test_the_servers_tmpdir_sends_torchs_precompiled_headers_to_the_shared_cache(tmp_path):
    import getpass

    run_tmp, shared = tmp_path / "run" / "tmp", tmp_path / "shared"
    run_tmp.mkdir(parents=True)
    share_compile_cache(run_tmp, shared)
    share_compile_cache(run_tmp, tmp_path / "other")  # a second call (a resumed server) keeps the link
    # torch's default_cache_dir(): <gettempdir()>/torchinductor_<user>, where the precompiled header goes
    header_dir = run_tmp / f"torchinductor_{getpass.getuser()}"
    (header_dir / "precompiled_headers").mkdir(parents=True)
    assert (shared / "precompiled_headers").is_dir() and not (tmp_path / "other").exists()
    # the empty directory torch's first look creates gives way to the link; one with content stays
    torch_tmp, kept_tmp = tmp_path / "torch_looked", tmp_path / "kept"
    torch_default_compile_dir(torch_tmp).mkdir(parents=True)
    (torch_default_compile_dir(kept_tmp) / "kernels").mkdir(parents=True)
    share_compile_cache(torch_tmp, shared)
    share_compile_cache(kept_tmp, shared)
    assert torch_default_compile_dir(torch_tmp).resolve() == shared.resolve()
    assert not torch_default_compile_dir(kept_tmp).is_symlink()


def test_the_cpu_entry_keeps_fork_unless_the_user_chose(monkeypatch):
    """vLLM's CPU platform sets `spawn`; the entry's hook puts `fork` back after it, except where the user
    set a start method."""
    import os

    from vllm.platforms.cpu import CpuPlatform

    from rlctl.inference import vllm_cpu_main

    calls = []
    monkeypatch.setattr(CpuPlatform, "check_and_update_config",
                        classmethod(lambda cls, cfg: (calls.append(cfg), os.environ.__setitem__(vllm_cpu_main.START_METHOD, "spawn"))))
    monkeypatch.setenv(vllm_cpu_main.START_METHOD, "spawn")
    assert not vllm_cpu_main.keep_fork_on_cpu()  # the user's choice stands
    monkeypatch.delenv(vllm_cpu_main.START_METHOD)
    assert vllm_cpu_main.keep_fork_on_cpu()
    CpuPlatform.check_and_update_config("config")
    assert calls == ["config"] and os.environ[vllm_cpu_main.START_METHOD] == "fork"
    monkeypatch.delenv(vllm_cpu_main.START_METHOD)


def test_logprobs_of_requests_naming_the_xarg_are_kept_without_token_strings(monkeypatch):
    """The entry's hook hands the logprobs processor no tokenizer (no token-string decode) for a request
    whose `vllm_xargs` name TOKEN_ID_LOGPROBS_XARG, as rlctl's clients send; other requests keep it."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor

    from rlctl.inference.client import SAMPLED_LOGPROBS
    from rlctl.inference.vllm_main import (TOKEN_ID_LOGPROBS_XARG, append_sampled_logprobs, logprobs_without_token_strings,
                                          sampled_logprobs_class)

    monkeypatch.setattr(LogprobsProcessor, "from_new_request", LogprobsProcessor.__dict__["from_new_request"])
    assert logprobs_without_token_strings()
    tokenizer = object()

    def processor(xargs, logprobs=0):
        request = SimpleNamespace(sampling_params=SamplingParams(logprobs=logprobs, extra_args=xargs))
        return LogprobsProcessor.from_new_request(tokenizer=tokenizer, request=request)

    ours = processor(dict(SAMPLED_LOGPROBS["vllm_xargs"]))
    assert ours.tokenizer is None and isinstance(ours.logprobs, sampled_logprobs_class())
    assert ours._update_sample_logprobs.__func__ is append_sampled_logprobs  # only the sampled tokens' asked for
    assert "_update_sample_logprobs" not in vars(processor(dict(SAMPLED_LOGPROBS["vllm_xargs"]), logprobs=2))
    for other in (processor(None), processor({"other": 1})):
        assert other.tokenizer is tokenizer and type(other.logprobs) is list  # vLLM's own container
    assert SAMPLED_LOGPROBS["return_tokens_as_token_ids"] and TOKEN_ID_LOGPROBS_XARG in SAMPLED_LOGPROBS["vllm_xargs"]


def test_sampled_logprobs_are_appended_as_vllm_appends_them():
    """The list-at-a-time append of a `logprobs = 0` request gives the container, positions and cumulative
    logprob vLLM's own per-position loop gives, for one new token or several, whatever the batch's width."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from rlctl.inference.vllm_main import append_sampled_logprobs, sampled_logprobs_class

    rng = np.random.default_rng(0)
    ids, values = rng.integers(0, 64, (7, 3)).astype(np.int32), -rng.random((7, 3)).astype(np.float32)
    batch = LogprobsLists(ids, values, rng.integers(1, 9, 7).astype(np.int32))
    theirs, ours = (LogprobsProcessor(tokenizer=None, logprobs=sampled_logprobs_class()(), prompt_logprobs=None,
                                      cumulative_logprob=0.0, num_logprobs=0, num_prompt_logprobs=None)
                    for _ in range(2))
    for start, n in ((0, 1), (1, 1), (2, 4), (6, 1)):
        part = batch.slice_request(start, n)
        theirs._update_sample_logprobs(part)
        append_sampled_logprobs(ours, part)
    assert ours.logprobs == theirs.logprobs and len(ours.logprobs) == 7
    assert all(type(v) is float for v in ours.logprobs.logprobs)  # Python numbers, as vLLM's, not numpy's
    assert all(type(v) is int for v in ours.logprobs.token_ids + ours.logprobs.ranks)
    assert ours.cumulative_logprob == theirs.cumulative_logprob
    assert ours.logprobs[3:5].logprobs == [float(v) for v in values[3:5, 0]]


def test_completions_of_requests_naming_the_xarg_carry_the_sampled_logprobs_alone(monkeypatch):
    """With the entry's change, a completion chunk of an rlctl request (its logprobs in the marked
    container) has `token_logprobs` only, equal to what vLLM puts there; vLLM's own logprobs are answered
    as before, and so is a marked container when top logprobs were asked for."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob

    from rlctl.inference.vllm_main import sampled_logprobs_class, sampled_logprobs_only

    create = OpenAIServingCompletion.__dict__["_create_completion_logprobs"]
    monkeypatch.setattr(OpenAIServingCompletion, "_create_completion_logprobs", create)
    serving = object.__new__(OpenAIServingCompletion)
    serving.return_tokens_as_token_ids = True
    ids, values = [5, 9, 5, 7], [-0.5, -1.25, float("-inf"), -2.0]
    marked = sampled_logprobs_class()()
    for token, value in zip(ids, values):
        marked.append({token: Logprob(logprob=value, rank=1)})
    dicts = [{t: Logprob(logprob=v, rank=1)} for t, v in zip(ids, values)]
    kwargs = dict(num_output_top_logprobs=0, tokenizer=None, return_as_token_id=True)
    full = create(serving, token_ids=ids[1:], top_logprobs=dicts[1:], **kwargs)
    assert sampled_logprobs_only()
    patched = OpenAIServingCompletion._create_completion_logprobs
    lean = patched(serving, token_ids=ids[1:], top_logprobs=marked[1:], **kwargs)  # a stream's later chunk
    assert lean.model_dump(exclude_unset=True) == {"token_logprobs": full.token_logprobs}
    assert full.token_logprobs == [-1.25, -9999.0, -2.0] and full.tokens
    assert patched(serving, token_ids=ids, top_logprobs=dicts, **kwargs) == create(serving, token_ids=ids,
                                                                                    top_logprobs=dicts, **kwargs)
    top1 = {**kwargs, "num_output_top_logprobs": 1}
    assert patched(serving, token_ids=ids, top_logprobs=marked, **top1).tokens == [f"token_id:{t}" for t in ids]


def test_cpu_tensor_parallel_workers_get_a_share_of_the_cores_each_unless_the_user_says(tmp_path, monkeypatch):
    from rlctl.inference.server import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_thread_binding(2, [4, 5, 6]) == "4|5"  # the odd core is left to the engine and API server
    assert cpu_thread_binding(3, [0, 1]) == "0|1|0"  # fewer cores than workers: shared, but it starts
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2, 0})
    r = recipe()
    assert server_env(r, "cpu", tmp_path, TOKEN, "k", tp=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(r, "cpu", tmp_path, TOKEN, "k", tp=1)  # vLLM's own binding
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(r, "gpu", tmp_path, TOKEN, "k", tp=2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(r, "cpu", tmp_path, TOKEN, "k", tp=2)
