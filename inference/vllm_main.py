"""`python -P -m rlctl.inference.vllm_main ARGS`: vLLM's OpenAI server with adapter swaps read once.

A LoRA run swaps its adapter with `/v1/load_lora_adapter` and `load_inplace` (lora_serving.py). vLLM
keeps that request, flag included, as the adapter's cached `LoRARequest`, and every completion request
names it; its workers reload an adapter whose request says `load_inplace` at *every engine step* that
schedules such a request (`LRUCacheWorkerLoRAManager.add_adapter`). So after the first swap vLLM read
the adapter's files again per step (the full adapter, for every decoded token of the batch); a step
whose batch still held a request from before the last swap could reload the *older* adapter for the
whole batch (the step keeps one request object per adapter name); and an adapter directory removed
after the swap (retention) killed the engine core at the next request (HTTP 500, "EngineCore
encountered an issue").

The fix: once the in-place load has succeeded, the cached request drops the flag, so later requests
find the adapter by its id and use what the swap loaded. Nothing awaits between vLLM caching the
request and this, so no request is created with the flag set. A vLLM without that method (another
version) starts unchanged, with a log line saying so. The patch lives in this process: rlctl starts one
API server per vLLM server (no `--api-server-count`).
"""
from __future__ import annotations

import functools
import logging
import runpy

log = logging.getLogger("rlctl.inference.vllm_main")


def load_adapters_in_place_once() -> bool:
    """Make `/v1/load_lora_adapter` with `load_inplace` load once, not at every later step; False when
    this vLLM has no such method."""
    try:
        import msgspec
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels

        load = OpenAIServingModels.load_lora_adapter
    except (ImportError, AttributeError) as exc:
        log.warning("adapter swaps are served as vLLM does (no OpenAIServingModels.load_lora_adapter: %s)", exc)
        return False

    @functools.wraps(load)
    async def load_lora_adapter(self, request, *args, **kwargs):
        result = await load(self, request, *args, **kwargs)
        cached = self.lora_requests.get(request.lora_name)
        if cached is not None and cached.load_inplace:
            self.lora_requests[request.lora_name] = msgspec.structs.replace(cached, load_inplace=False)
        return result

    OpenAIServingModels.load_lora_adapter = load_lora_adapter
    return True


def run_openai_server() -> None:
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def main() -> None:
    load_adapters_in_place_once()
    run_openai_server()


if __name__ == "__main__":
    main()
