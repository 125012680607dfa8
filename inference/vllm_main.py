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

Logprobs without token strings: for every sampled token whose logprob a request asks for, vLLM's output
processor decodes the token's string (and re-decodes its context when the string ends in a partial
character), whether or not the response will carry it. rlctl's clients read token ids and logprob
values only and ask for ids in place of strings (`return_tokens_as_token_ids`); a request that also
names `TOKEN_ID_LOGPROBS_XARG` in its `vllm_xargs` has its logprobs kept without decoding (its text is
still detokenised). On the generation-heavy peer batch (16 x 16 completions of 32 tokens) that is 0.43
-> 0.34 API-server CPU-s per batch. Other requests are served exactly as by vLLM.

Streamed chunks written together: vLLM yields one server-sent event per choice and per engine step, and
its HTTP server writes each event to the socket by itself (a system call, then a read and a write in the
router and a read in the client, for a few hundred bytes). A request with n = 16 completions gets 16
events from every engine step that advances it, all ready at once. The completion stream is read ahead
into a queue, and everything already there leaves as one write; the bytes are the same events in the
same order.

Fewer garbage collections: the server runs its cyclic GC at `GC_YOUNG_THRESHOLD` (processes.py) net new
objects instead of 700, which cost it about 13% of its CPU per step; the engine core inherits that where
it is forked (CPU).
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import runpy

from rlctl.inference.processes import fewer_gc_passes

log = logging.getLogger("rlctl.inference.vllm_main")
# Named in a request's `vllm_xargs` (rlctl.inference.client.SAMPLED_LOGPROBS): keep its logprobs without
# their token strings. Defined here, not in client.py, so the API server does not import httpx for it.
TOKEN_ID_LOGPROBS_XARG = "rlctl_token_id_logprobs"


def vllm_attribute(module: str, owner: str, name: str, unchanged: str):
    """(class `owner` of vLLM's `module`, its attribute `name`), or None when this vLLM lacks either;
    then a log line says what is served `unchanged`, as vLLM does."""
    try:
        cls = getattr(importlib.import_module(module), owner)
        return cls, getattr(cls, name)
    except (ImportError, AttributeError) as exc:
        log.warning("%s are served as vLLM does (no %s.%s: %r)", unchanged, owner, name, exc)
        return None


def load_adapters_in_place_once() -> bool:
    """Make `/v1/load_lora_adapter` with `load_inplace` load once, not at every later step; False when
    this vLLM has no such method."""
    import msgspec

    found = vllm_attribute("vllm.entrypoints.openai.models.serving", "OpenAIServingModels", "load_lora_adapter",
                           "adapter swaps")
    if found is None:
        return False
    OpenAIServingModels, load = found

    @functools.wraps(load)
    async def load_lora_adapter(self, request, *args, **kwargs):
        result = await load(self, request, *args, **kwargs)
        cached = self.lora_requests.get(request.lora_name)
        if cached is not None and cached.load_inplace:
            self.lora_requests[request.lora_name] = msgspec.structs.replace(cached, load_inplace=False)
        return result

    OpenAIServingModels.load_lora_adapter = load_lora_adapter
    return True


def logprobs_without_token_strings() -> bool:
    """Skip decoding logprob token strings for requests that name `TOKEN_ID_LOGPROBS_XARG`; False when
    this vLLM has no such hook."""
    found = vllm_attribute("vllm.v1.engine.logprobs", "LogprobsProcessor", "from_new_request", "logprob token strings")
    if found is None:
        return False
    LogprobsProcessor, new_request = found[0], found[1].__func__

    def from_new_request(cls, tokenizer, request):
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        if extra and extra.get(TOKEN_ID_LOGPROBS_XARG):
            tokenizer = None  # the processor then keeps logprobs without their strings
        return new_request(cls, tokenizer, request)

    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    return True


async def joined_when_ready(stream):
    """The strings of async iterator `stream`, each batch that is ready at once joined into one string.
    Closing or cancelling the result cancels the reading of `stream` (vLLM then aborts the request)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read_ahead():
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    reader = asyncio.create_task(read_ahead())
    try:
        while True:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            text = "".join(x for x in ready if isinstance(x, str))
            if text:
                yield text
            for x in ready:
                if isinstance(x, Exception):
                    raise x
            if ready[-1] is done:
                return
    finally:
        reader.cancel()


def stream_events_joined() -> bool:
    """Write each batch of ready completion-stream events at once; False when this vLLM has no
    OpenAIServingCompletion.completion_stream_generator."""
    found = vllm_attribute("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
                           "completion_stream_generator", "completion streams (an event per write)")
    if found is None:
        return False
    OpenAIServingCompletion, stream = found

    @functools.wraps(stream)
    def completion_stream_generator(self, *args, **kwargs):
        return joined_when_ready(stream(self, *args, **kwargs))

    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator
    return True


def patch_vllm() -> None:
    """Every change above, applied in this process before vLLM's server starts."""
    load_adapters_in_place_once()
    logprobs_without_token_strings()
    stream_events_joined()
    fewer_gc_passes()


def run_openai_server() -> None:
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def main() -> None:
    patch_vllm()
    run_openai_server()


if __name__ == "__main__":
    main()
