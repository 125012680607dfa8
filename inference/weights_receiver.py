"""The inference worker's side of the broadcast weight transport (`weights.transport = "broadcast"`).

Called in every vLLM worker through `/collective_rpc` (`ReloadExtension.rlctl_receive`) while its
server is paused: join the step's group named by `weights/step_N/broadcast.json`, then feed the buckets
as they arrive to vLLM's in-place reload (the same `reload_weights` the filesystem path uses, with a
weights iterator instead of a path), so at most the bucket being loaded plus the one arriving exist
besides the model. The lm_head re-tie and the CPU MoE repack of the filesystem path follow
(`worker_ext.py` passes them in and explains why they are needed).
"""
from __future__ import annotations

import time
from pathlib import Path

from rlctl.orchestrator.exchange.weights_broadcast import Receiver, read_manifest


def _device(worker):
    import torch

    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def receive_weights(worker, step_dir: str, servers: int, refresh) -> dict:
    """Receive version `step_dir` into `worker`'s model; `servers` is how many servers take part (each
    with the same number of workers as this one); `refresh(model) -> dict` redoes what a reload leaves
    stale. Returns timings like `rlctl_reload`."""
    import torch

    manifest = read_manifest(Path(step_dir))
    workers = int(servers) * worker.vllm_config.parallel_config.world_size
    start = time.perf_counter()
    receiver = Receiver(manifest, workers, _device(worker))
    joined = time.perf_counter()
    received = [0]

    def tensors():
        for bucket in receiver.buckets():
            for name, tensor in bucket:
                received[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

    with torch.inference_mode():
        stream = tensors()
        worker.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
        for _ in stream:  # a loader that stopped early: still take every bucket, the sender waits for it
            pass
        loaded = time.perf_counter()
        refreshed = refresh(worker.model_runner.get_model())
    done = time.perf_counter()
    return {"step_dir": str(step_dir), "join_s": joined - start, "load_s": loaded - joined,
            "retie_s": done - loaded, "total_s": done - start, "bytes_received": received[0],
            "rank": receiver.rank, **refreshed}
