"""The trainer's side of weight publishing: gather the full state dict (checkpoint names) and read the HF config.

Where and how weights travel is the exchange's business (`rlctl.orchestrator.exchange.weights`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG_FILE = "config.json"


def gather_full_state_dict(model) -> dict:
    """Collective: every rank must call it. Rank 0 gets the full CPU state dict under the names a
    Hugging Face checkpoint uses (MoE experts one tensor per expert, as vLLM's reload expects:
    `hf_names.to_checkpoint_names`), others an empty dict.

    Works for FSDP2-sharded (DTensor, experts possibly over an `ep` mesh too) and plain modules alike.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlctl.trainer.hf_names import to_checkpoint_names

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return to_checkpoint_names(state, model.config) if state else state


def load_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / CONFIG_FILE).read_text())
