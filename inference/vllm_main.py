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
-> 0.34 API-server CPU-s per batch. Such a request's logprobs are also kept in flat lists (vLLM's
FlatLogprobs, not a Logprob object in a dict per token), appended a list at a time where only the sampled
token's are asked for (`logprobs = 0`): 2.5 -> 1.15 us per decoded token. With `logprobs = 0` its
completions also carry `token_logprobs` alone: vLLM built `tokens`, `top_logprobs` and `text_offset`
beside it, 20 -> 10 us of API-server CPU and 846 -> 382 bytes per streamed chunk of 8 tokens. Together,
about 20 ms less per batch of 8192 tokens. Other requests are served exactly as by vLLM.

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
import types

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
    """Skip decoding logprob token strings for requests that name `TOKEN_ID_LOGPROBS_XARG`, and keep
    their logprobs in a `SampledLogprobs` container (sampled_logprobs_only); False when this vLLM has no
    such hook."""
    found = vllm_attribute("vllm.v1.engine.logprobs", "LogprobsProcessor", "from_new_request", "logprob token strings")
    if found is None:
        return False
    LogprobsProcessor, new_request = found[0], found[1].__func__
    container = sampled_logprobs_class()

    def from_new_request(cls, tokenizer, request):
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        if not (extra and extra.get(TOKEN_ID_LOGPROBS_XARG)):
            return new_request(cls, tokenizer, request)
        processor = new_request(cls, None, request)  # no tokenizer: logprobs kept without their strings
        if container is not None and processor.logprobs is not None and not processor.logprobs:
            processor.logprobs = container()  # flat lists: no Logprob object and dict per token
            if processor.num_logprobs == 0:
                processor._update_sample_logprobs = types.MethodType(append_sampled_logprobs, processor)
        return processor

    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    return True


def append_sampled_logprobs(processor, logprobs_lists) -> None:
    """`LogprobsProcessor._update_sample_logprobs` for a request asking for the sampled tokens' logprobs
    alone (`logprobs = 0`) into a `SampledLogprobs` container: what vLLM's loop appends (the first column,
    the sampled token, at each new position): an append per field for the one position of a decoding step,
    a list operation per field for several, where vLLM makes a call per position and rank."""
    token_ids, logprobs, ranks = logprobs_lists[0], logprobs_lists[1], logprobs_lists[2]
    flat = processor.logprobs
    start = len(flat.logprobs)
    if len(logprobs) == 1:  # while decoding every engine step brings one position: 1.34 -> 0.46 us
        value = logprobs.item(0, 0)
        flat.start_indices.append(start)
        flat.end_indices.append(start + 1)
        flat.token_ids.append(token_ids.item(0, 0))
        flat.logprobs.append(value)
        flat.ranks.append(ranks.item(0))
        flat.decoded_tokens.append(None)
        processor.cumulative_logprob += value
        return
    values = logprobs[:, 0].tolist()
    n = len(values)
    flat.start_indices.extend(range(start, start + n))
    flat.end_indices.extend(range(start + 1, start + n + 1))
    flat.token_ids.extend(token_ids[:, 0].tolist())
    flat.logprobs.extend(values)
    flat.ranks.extend(ranks.tolist())
    flat.decoded_tokens.extend([None] * n)
    total = processor.cumulative_logprob
    for value in values:  # added one by one, as vLLM does
        total += value
    processor.cumulative_logprob = total


@functools.cache
def sampled_logprobs_class():
    """vLLM's FlatLogprobs, marked as the logprobs of a request naming `TOKEN_ID_LOGPROBS_XARG` (its slices,
    a stream's new tokens, stay marked); None when this vLLM has no FlatLogprobs."""
    found = vllm_attribute("vllm.logprobs", "FlatLogprobs", "append_fast", "logprobs of rlctl's requests")
    if found is None:
        return None
    FlatLogprobs = found[0]

    class SampledLogprobs(FlatLogprobs):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            if isinstance(item, FlatLogprobs):
                item.__class__ = SampledLogprobs
            return item

    return SampledLogprobs


def sampled_logprobs_only() -> bool:
    """A completion's `logprobs` for a request naming `TOKEN_ID_LOGPROBS_XARG` carry `token_logprobs` only:
    vLLM also fills `tokens`, `top_logprobs` and `text_offset` (a string, a dict and a number per token)
    that rlctl's clients never read. Only where the request asked for the sampled token's logprob alone
    (`logprobs = 0`, as rlctl's clients do) and got no prompt echoed; False when this vLLM lacks the method
    or the container."""
    found = vllm_attribute("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
                           "_create_completion_logprobs", "completion logprobs (in full)")
    container = sampled_logprobs_class()
    if found is None or container is None:
        return False
    OpenAIServingCompletion, create = found
    from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

    @functools.wraps(create)
    def _create_completion_logprobs(self, token_ids, top_logprobs, num_output_top_logprobs, *args, **kwargs):
        if (not isinstance(top_logprobs, container) or num_output_top_logprobs != 0
                or len(top_logprobs) != len(token_ids)):
            return create(self, token_ids, top_logprobs, num_output_top_logprobs, *args, **kwargs)
        # the sampled token comes first at each position; -inf as the JSON-safe number vLLM uses
        values, ends = top_logprobs.logprobs, top_logprobs.end_indices
        return CompletionLogProbs(token_logprobs=[max(values[s], -9999.0) if s < e else None
                                                  for s, e in zip(top_logprobs.start_indices, ends)])

    OpenAIServingCompletion._create_completion_logprobs = _create_completion_logprobs
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
    sampled_logprobs_only()
    stream_events_joined()
    fewer_gc_passes()


def run_openai_server() -> None:
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def main() -> None:
    patch_vllm()
    run_openai_server()


if __name__ == "__main__":
    main()
