"""The trainer's side of weight publishing: gather the full state dict and read the HF config.

Where and how weights travel is the exchange's business (`rlctl.orchestrator.exchange.weights`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

CONFIG_FILE = "config.json"


def gather_full_state_dict(model) -> dict:
    """Collective: every rank must call it. Rank 0 gets the full CPU state dict, others an empty dict.

    Works for FSDP2-sharded (DTensor) modules and plain modules alike.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / CONFIG_FILE).read_text())
