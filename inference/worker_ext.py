"""vLLM worker extension: reload the policy in place from a published `weights/step_N/` directory.

vLLM mixes this class into its worker (`--worker-extension-cls rlctl.inference.worker_ext.ReloadExtension`),
so `self` is the worker: `self.model_runner`, `self.vllm_config` and `self.reload_weights` exist.
The client calls it through `/collective_rpc` with method `rlctl_reload` (see `client.py`).

Why not plain `reload_weights`: for models with `tie_word_embeddings` the LM head is not in the
checkpoint, so the layer-wise reload never re-processes it: its weight may end up a different tensor
than the new embedding, and kernels prepared from the old values (oneDNN keeps its own packed copy on
CPU) keep computing logits with the old head. We re-tie the head to the embedding and redo the
head's post-load processing.
"""
from __future__ import annotations

import time
from pathlib import Path

MARKER = "COMPLETE"  # same marker as launchers.rundir; kept literal so workers import nothing of ours


def _tied(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))


def _input_embedding(model):
    if hasattr(model, "get_input_embeddings"):
        try:
            return model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            pass
    return model.model.embed_tokens


def refresh_tied_lm_head(model) -> bool:
    """Re-tie `lm_head.weight` to the embedding's current weight and redo the head's post-load
    processing. Needed even when the Parameter is still shared: the reload copies new values into
    it, but kernels prepared from the old values (e.g. oneDNN's packed copy on CPU) stay stale.
    Returns True if the Parameter itself had to be re-tied."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or not hasattr(lm_head, "weight"):
        return False
    embed = _input_embedding(model)
    retied = lm_head.weight is not embed.weight
    if retied:
        lm_head.weight = embed.weight
    quant = getattr(lm_head, "quant_method", None)
    if quant is not None and hasattr(quant, "process_weights_after_loading"):
        quant.process_weights_after_loading(lm_head)
    return retied


class ReloadExtension:
    """Methods callable by name through `/collective_rpc` on every worker of the server."""

    def rlctl_reload(self, step_dir: str) -> dict:
        """Load `step_dir/*.safetensors` into the running model; returns timings for the caller's metrics."""
        import torch

        path = Path(step_dir)
        if not (path / MARKER).exists():
            raise FileNotFoundError(f"{path} has no {MARKER} marker: refusing to load a partial step")
        start = time.perf_counter()
        with torch.inference_mode():
            self.reload_weights(weights_path=str(path), is_checkpoint_format=True)
            loaded = time.perf_counter()
            model = self.model_runner.get_model()
            retied = _tied(self.vllm_config.model_config.hf_config) and refresh_tied_lm_head(model)
        done = time.perf_counter()
        return {"step_dir": str(path), "load_s": loaded - start, "retie_s": done - loaded,
                "total_s": done - start, "retied_lm_head": bool(retied)}

    def rlctl_lm_head_tied(self) -> bool:
        """Whether the LM head shares the embedding's storage (a check for tests and debugging)."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        return lm_head is not None and lm_head.weight.data_ptr() == _input_embedding(model).weight.data_ptr()
