"""Publish a LoRA run's policy: the adapter alone, in PEFT format, as `weights/step_N/`.

`adapter_model.safetensors` + `adapter_config.json` are staged and sealed by `steps.publish_step`
(the `COMPLETE` marker last), so a reader sees the whole adapter or nothing. The servers keep the
base model and swap adapters (see `inference/lora_swap.py`), which is why only the few MB of A and
B travel each step instead of the full weights.
"""
from __future__ import annotations

import time

from rlctl.orchestrator.exchange.retention import retain_weights
from rlctl.orchestrator.exchange.steps import publish_step, step_dir_name
from rlctl.trainer.lora import adapter_config, adapter_state, write_adapter

ADAPTER_MARKER_KIND = "lora"  # `kind` in the step's marker: readers tell an adapter from full weights


def publish_adapter(trainer, step: int) -> float:
    """Collective (the adapters are FSDP-sharded): every rank gathers the full A and B, rank 0 writes
    them; rank 0 then applies retention. Returns the seconds it took."""
    from rlctl.trainer.weights import serving_dtype

    t0 = time.perf_counter()
    tensors = adapter_state(trainer.model, serving_dtype(trainer.recipe))
    if trainer.rank == 0:
        config = adapter_config(trainer.cfg.lora, str(trainer.model_dir),
                                sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors}))
        written = {}

        def write(stage):
            written["bytes"] = write_adapter(stage, tensors, config)

        publish_step(trainer.run.weights, step_dir_name(step), write,
                     {"step": step, "kind": ADAPTER_MARKER_KIND, "tensors": len(tensors)}, sync_metadata=False)
        retain_weights(trainer.run, trainer.weight_store, trainer.recipe.weights.keep_last)
    return time.perf_counter() - t0
