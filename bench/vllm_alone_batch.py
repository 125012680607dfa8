"""What the peer benchmark's overhead is measured against: vLLM alone (offline, in one process, with the
server's settings and all cores) generating one batch of a variant, and rlctl's own share of its step."""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path


_SERVER_SETTINGS = False  # use_server_settings() ran (a variable set by hand is kept, as the server keeps it)


def use_server_settings(recipe: dict) -> None:
    """The environment of rlctl's one-worker CPU server (inference/server.py: server_env), set before torch
    is imported: libgomp reads OMP_WAIT_POLICY once, when torch loads it. Set after a tiny model was built
    here (torch imported), its threads spun between forward passes with the default policy, and vLLM alone
    took both cores (0.52-0.59 CPU s per batch of the generation variant, against 0.31-0.37 with the
    server's setting) and was 10-15% faster than the server's settings allow: a yardstick out of reach."""
    if "torch" in sys.modules:
        raise RuntimeError("use_server_settings() must run before torch is imported (OMP_WAIT_POLICY)")
    global _SERVER_SETTINGS
    _SERVER_SETTINGS = True
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(recipe["inference"]["kv_cache_gib_cpu"]))))


def vllm_alone(recipe: dict, model_dir: Path, repeats: int = 5) -> dict:
    """Seconds (wall and CPU) vLLM alone needs for one batch of `recipe` (a validated recipe's dict), in a
    process that called `use_server_settings` first."""
    if not _SERVER_SETTINGS:
        raise RuntimeError("vllm_alone() without use_server_settings(): not the server's settings")
    from rlctl.orchestrator.environments import load_environment

    o, inf = recipe["orchestrator"], recipe["inference"]
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=inf["max_model_len"], seed=0)
    env = load_environment(o["environment"]["name"], o["environment"]["args"])
    prompts = [p.text for p in env.sample_prompts(random.Random(0), o["rollouts_per_step"] // o["group_size"])]
    # Every completion max_tokens long: the batch a trained policy sends in rlctl's steady state (count_a's
    # completions run to the limit once learnt), not the untrained model's, whose early EOS shortens it.
    params = SamplingParams(n=o["group_size"], max_tokens=o["max_tokens"], temperature=o["temperature"], logprobs=0,
                            ignore_eos=True)
    times, cpu = [], []
    for _ in range(repeats + 1):  # the first one warms up
        t, c = time.perf_counter(), time.process_time()  # CPU seconds of all this process's threads
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {"side": "vllm-alone", "batch_s": statistics.median(times[1:]), "batch_cpu_s": statistics.median(cpu[1:]),
            "batch_tokens": tokens, "batch_times_s": times[1:], "batch_cpu_times_s": cpu[1:]}


def around(before: dict, after: dict) -> dict:
    """vLLM alone measured before and after the rlctl run, pooled: this host's speed drifts by up to 30%
    within minutes (0.56 and 0.73 s for the same batch a few minutes apart), more than the overhead goal's
    margin, so one measurement on one side of the run can make the overhead look 20 points better or worse."""
    times, cpu = before["batch_times_s"] + after["batch_times_s"], before["batch_cpu_times_s"] + after["batch_cpu_times_s"]
    return {**after, "batch_s": statistics.median(times), "batch_cpu_s": statistics.median(cpu),
            "batch_s_before": before["batch_s"], "batch_s_after": after["batch_s"]}


def overhead(rl: dict | None, alone: dict | None) -> float | None:
    """rlctl's own share of its step: the step interval minus the critical path's compute without rlctl,
    max(vLLM alone on the same batch, the trainer's step), over the step interval."""
    if not (rl and alone and rl["step_interval_s"]):
        return None
    compute = max(alone["batch_s"], rl["trainer_step_s"] or 0.0)
    return (rl["step_interval_s"] - compute) / rl["step_interval_s"]
