"""vLLM worker extension: reload the policy in place from a published `weights/step_N/` directory.

vLLM mixes this class into its worker (`--worker-extension-cls rlctl.inference.worker_ext.ReloadExtension`),
so `self` is the worker: `self.model_runner`, `self.vllm_config` and `self.reload_weights` exist.
The client calls it through `/collective_rpc` with method `rlctl_reload` (see `client.py`).

Why not plain `reload_weights`: for models with `tie_word_embeddings` the LM head is not in the
checkpoint, so the layer-wise reload never re-processes it: its weight may end up a different tensor
than the new embedding, and kernels prepared from the old values (oneDNN keeps its own packed copy on
CPU) keep computing logits with the old head. We re-tie the head to the embedding and redo the
head's post-load processing.

The same kind of staleness on the CPU fused-MoE path (vLLM 0.32): the experts' first load prepacks
w13/w2 into the grouped-GEMM layout, but a weight update skips that step (the kernel "is already set
up") and copies the new values, unpacked, into the packed storage. The kernel then reads unpacked
weights as packed: reloading even identical weights moved the tiny MoE's logprobs by 0.03, and the
trainer/inference mismatch of tiny-moe-cpu grew to KL 0.15 over a run. We redo the prepack after
each reload (tests/test_routed_experts.py checks the served model against transformers after one).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

# kept literal (the exchange's `steps.MARKER`, `weights_fs.INDEX_FILE`) so workers import nothing of ours
MARKER = "COMPLETE"
INDEX_FILE = "model.safetensors.index.json"


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


def repack_cpu_moe_experts(model) -> int:
    """Redo the CPU fused-MoE experts' prepack on every MoE layer after a reload; returns how many.
    Experts of other backends (GPU kernels) are left alone: their weight update path is complete."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE experts
        return 0
    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


def _weight_files(step_dir: Path) -> list[Path]:
    """The safetensors files vLLM loads from `step_dir`: those its index names, else all of them
    (the rule of vLLM's `filter_duplicate_safetensors_files`)."""
    index = step_dir / INDEX_FILE
    if index.exists():
        return [step_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(step_dir.glob("*.safetensors"))


def _serves_part(vllm_config) -> bool:
    """Whether this worker holds only part of the weights (a TP slice, a pipeline stage, some experts)."""
    p = vllm_config.parallel_config
    return p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1 or bool(getattr(p, "enable_expert_parallel", False))


def _storage_read_bytes() -> int | None:
    """Bytes this process has caused to be read from storage so far (Linux), else None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _install_cpu_routed_experts() -> None:
    """vLLM imports this module in each worker process before it builds the model runner: the moment
    to let the CPU runner return routed experts (cpu_routed_experts.py; inert unless the server asked
    for them)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    if current_platform.is_cpu():
        from rlctl.inference.cpu_routed_experts import install

        install()


_install_cpu_routed_experts()


class ReloadExtension:
    """Methods callable by name through `/collective_rpc` on every worker of the server."""

    @property
    def _rlctl_host_cache(self):
        cache = getattr(self, "_rlctl_cache", None)
        if cache is None:
            from rlctl.inference.host_cache import HostCache

            cache = self._rlctl_cache = HostCache(_weight_files)
        return cache

    def rlctl_stage(self, step_dir: str, budget_bytes: int, replaces: str = "") -> dict:
        """Start reading a marked step into host RAM (a shared pool's next switch loads it from there,
        host_cache.py); returns at once, the read goes on in the background."""
        if not (Path(step_dir) / MARKER).exists():
            raise FileNotFoundError(f"{step_dir} has no {MARKER} marker: refusing to stage a partial step")
        return self._rlctl_host_cache.stage(str(step_dir), int(budget_bytes), replaces or None)

    def rlctl_reload(self, step_dir: str) -> dict:
        """Load the step's safetensors shards into the running model; returns timings and bytes read for
        the caller's metrics.

        The shards are read through memory maps (`mapped_shards.py`): vLLM's loader narrows each tensor
        to the slice this worker serves before copying it, so a TP or EP rank reads only its slices,
        where vLLM's own file loader reads every tensor whole on every worker. `bytes_read` is what
        this worker's loader touched of the shards (their pages mapped in; the tensor bytes when it
        serves the whole model; the whole files when vLLM's loader had to read them: a dtype the maps
        do not cover); `storage_read_bytes` is what this process fetched from storage meanwhile
        (/proc/self/io, 0 when the shards were still in the page cache)."""
        import torch

        from rlctl.inference.mapped_shards import MappedShards

        path = Path(step_dir)
        if not (path / MARKER).exists():
            raise FileNotFoundError(f"{path} has no {MARKER} marker: refusing to load a partial step")
        io_before = _storage_read_bytes()
        start = time.perf_counter()
        staged = self._rlctl_host_cache.take(str(path))
        files = _weight_files(path)
        shards = MappedShards(files) if staged is None else None
        with torch.inference_mode():
            if staged is not None:  # staged in host RAM by a shared pool: no file is read now
                self.reload_weights(weights_iterator=iter(staged.items()), is_checkpoint_format=True)
                bytes_read = 0
            elif shards.mappable:
                self.reload_weights(weights_iterator=shards.tensors(), is_checkpoint_format=True)
                # a worker serving the whole model copies every tensor: no need to count its pages
                touched = shards.touched_bytes() if _serves_part(self.vllm_config) else None
                bytes_read = touched if touched is not None else shards.data_bytes()
                del shards  # the maps go with the last view of them
            else:
                self.reload_weights(weights_path=str(path), is_checkpoint_format=True)
                bytes_read = sum(f.stat().st_size for f in files)
            loaded = time.perf_counter()
            model = self.model_runner.get_model()
            retied = _tied(self.vllm_config.model_config.hf_config) and refresh_tied_lm_head(model)
            repacked = repack_cpu_moe_experts(model)
        done = time.perf_counter()
        io_after = _storage_read_bytes()
        return {"step_dir": str(path), "load_s": loaded - start, "retie_s": done - loaded,
                "total_s": done - start, "retied_lm_head": bool(retied), "repacked_moe_layers": repacked,
                "source": "files" if staged is None else "host", "bytes_read": bytes_read,
                "storage_read_bytes": io_after - io_before if io_before is not None and io_after is not None else None}

    def rlctl_receive(self, step_dir: str, servers: int) -> dict:
        """Receive version `step_dir` over the broadcast transport (`weights_receiver.py`); `servers`
        is how many servers the orchestrator asked to join; returns timings like `rlctl_reload`."""
        from rlctl.inference.weights_receiver import receive_weights

        def refresh(model) -> dict:  # the same fixes as after a reload from files
            retied = _tied(self.vllm_config.model_config.hf_config) and refresh_tied_lm_head(model)
            return {"retied_lm_head": bool(retied), "repacked_moe_layers": repack_cpu_moe_experts(model)}

        return receive_weights(self, step_dir, int(servers), refresh)

    def rlctl_lm_head_tied(self) -> bool:
        """Whether the LM head shares the embedding's storage (a check for tests and debugging)."""
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        return lm_head is not None and lm_head.weight.data_ptr() == _input_embedding(model).weight.data_ptr()
