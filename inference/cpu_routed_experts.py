"""Routed experts from vLLM's CPU model runner, for router replay on CPU.

vLLM 0.32 returns the experts each token was routed to (`--enable-return-routed-experts`) through its
aux-output connector, and only Model Runner V2 drives that connector. V2 needs Triton, and the CPU
build has none (PyPI's Triton has GPU backends only), so a CPU server runs the V1 runner and returned
no routed experts. The connector itself is plain torch + numpy: the scheduler side already runs in
every engine, and the worker side needs four calls from the runner. This module adds those four calls
to the CPU runner, as V2 makes them:

- after the KV cache is set up (the connector sizes its store from it): create the connector, which
  binds a capture hook to every MoE router;
- before each step's forward: `begin_step` with the scheduler's metadata (new requests, block hashes,
  finished requests);
- after the forward, before sampling: snapshot the step's routing rows with the batch's request order,
  query offsets and computed-token counts (`prepare_output`);
- after sampling: which requests sampled a token this step (not a partial prefill; the CPU runner
  has no speculative decoding, so nothing is rejected), then `process_output` into the runner output.

It is installed from the worker extension's import, which vLLM performs in every worker process
before it builds the model runner, whatever the start method. It changes nothing unless the server
was started with routed experts on. The API server's config check, which refuses routed experts
without V2, is told by `accept_v1_cpu_runner` (from vllm_cpu_main) that this runner provides them.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

# under "vllm." so that the line reaches the server log through vLLM's handler (runs in its worker)
log = logging.getLogger("vllm.rlctl.cpu_routed_experts")
_INSTALLED = "_rlctl_routed_experts"


def _snapshot(runner):
    """(the connector's pending output, tokens sampled per request) of the step just run, or None on a
    worker that does not own the output (TP rank > 0). `prepare_output` reads an MRV2 input batch's
    request order, query offsets and computed-token counts: the V1 runner keeps them elsewhere."""
    batch = runner.input_batch
    n = batch.num_reqs
    pending = runner._rlctl_aux.prepare_output(SimpleNamespace(
        req_ids=list(batch.req_ids[:n]),
        query_start_loc_np=runner.query_start_loc.np[: n + 1].copy(),
        num_computed_tokens_np=batch.num_computed_tokens_cpu[:n].copy(),
    ))
    if pending is None:
        return None
    # a request whose prompt is still being prefilled in chunks samples nothing this step
    return pending, (~runner.discard_request_mask.np[:n]).astype("int32")


def accept_v1_cpu_runner() -> bool:
    """Let vLLM's config check accept routed experts with the CPU V1 runner: it refuses any in-tree
    runner but V2, and keeps its other checks (MoE model, prefix caching, no pipeline parallelism)."""
    try:
        from vllm.config import VllmConfig
        verify = VllmConfig._verify_aux_output_compatibility
        v2 = VllmConfig.__dict__["use_v2_model_runner"]
    except (ImportError, AttributeError, KeyError) as exc:
        log.warning("routed experts cannot be returned on CPU with this vLLM: %s", exc)
        return False

    def verify_as_v2(self) -> None:
        VllmConfig.use_v2_model_runner = property(lambda _self: True)  # read by this check only
        try:
            verify(self)
        finally:
            VllmConfig.use_v2_model_runner = v2

    VllmConfig._verify_aux_output_compatibility = verify_as_v2
    return True


def install() -> bool:
    """Teach vLLM's CPU model runner to return routed experts; False when this vLLM lacks the pieces."""
    try:
        import numpy as np
        from vllm.distributed.aux_output_connector.worker import get_aux_output_connector
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError as exc:
        log.warning("routed experts cannot be returned on CPU with this vLLM: %s", exc)
        return False
    if getattr(CPUModelRunner, _INSTALLED, False):
        return True
    initialize_kv_cache = CPUModelRunner.initialize_kv_cache
    execute_model = CPUModelRunner.execute_model
    sample_tokens = CPUModelRunner.sample_tokens

    def initialize_kv_cache_with_connector(self, kv_cache_config, is_profiling=False, **kwargs):
        initialize_kv_cache(self, kv_cache_config, is_profiling, **kwargs)
        self._rlctl_aux = None
        self._rlctl_pending = None
        if not is_profiling and self.vllm_config.aux_output_config.enabled:
            self._rlctl_aux = get_aux_output_connector(self.model, self.vllm_config, kv_cache_config)
            log.info("routed experts are captured by the CPU model runner")

    def execute_model_with_capture(self, scheduler_output, *args, **kwargs):
        aux = getattr(self, "_rlctl_aux", None)
        if aux is None:
            return execute_model(self, scheduler_output, *args, **kwargs)
        aux.begin_step(scheduler_output.aux_output_connector_metadata)
        self._rlctl_pending = None
        out = execute_model(self, scheduler_output, *args, **kwargs)
        if out is None and self.execute_model_state is not None:  # a forward ran; sampling follows
            self._rlctl_pending = _snapshot(self)
        return out

    def sample_tokens_with_routed_experts(self, *args, **kwargs):
        out = sample_tokens(self, *args, **kwargs)
        pending = getattr(self, "_rlctl_pending", None)
        self._rlctl_pending = None
        if pending is not None:
            snapshot, sampled = pending
            snapshot.enqueue_cpu_copy(num_sampled=sampled, num_rejected=np.zeros_like(sampled))
            out.aux_output_connector_output = snapshot.process_output()
        return out

    CPUModelRunner.initialize_kv_cache = initialize_kv_cache_with_connector
    CPUModelRunner.execute_model = execute_model_with_capture
    CPUModelRunner.sample_tokens = sample_tokens_with_routed_experts
    setattr(CPUModelRunner, _INSTALLED, True)
    return True
