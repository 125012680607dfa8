"""Publishing policy weights for the inference servers: `weights/step_N/` on the shared filesystem.

A published step holds `model.safetensors` (full weights, Hugging Face parameter names, the tied
`lm_head.weight` dropped because loaders re-tie it to the embedding) and `config.json`. The whole
directory is written under a hidden temp name, fsynced, renamed to `step_N`, and the `COMPLETE`
marker is written last — readers that only trust directories with the marker never see a partial
step (rename is atomic on POSIX filesystems, and NFS/Lustre keep rename atomic within a directory).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from rlctl.launchers.rundir import MARKER, complete_steps, fsync_path, remove_steps, step_dir_name

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def latest_complete(weights_dir: str | os.PathLike) -> int | None:
    """The newest step under `weights_dir` whose marker exists, or None."""
    steps = complete_steps(Path(weights_dir))
    return steps[-1] if steps else None


def hf_state_dict(state: dict, config: dict) -> dict:
    """Contiguous CPU tensors under HF names, without the tied lm_head (it aliases the embedding)."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        out[name] = t.contiguous()
    return out


def publish_weights(weights_dir: str | os.PathLike, step: int, state: dict, config: dict) -> Path:
    """Write `weights_dir/step_N` atomically (see module docstring); returns the step directory.

    `state` is a full (unsharded) state dict; `config` the HF config.json dict written beside it.
    Publishing a step that is already complete is a no-op (a restarted trainer republishing).
    """
    from safetensors.torch import save_file

    weights_dir = Path(weights_dir)
    final = weights_dir / step_dir_name(step)
    if (final / MARKER).exists():
        return final
    weights_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=weights_dir))
    try:
        save_file(hf_state_dict(state, config), str(stage / WEIGHTS_FILE), metadata={"format": "pt", "step": str(step)})
        (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            fsync_path(stage / name)
        os.chmod(stage, 0o755)
        if final.exists():  # leftover of a writer that crashed between rename and marker
            shutil.rmtree(final)
        os.rename(stage, final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    # Only the data needs fsync before the marker exists. Losing the rename or the marker in a
    # crash merely hides the step (it is republished), so those metadata writes are not synced.
    marker = final / f".{MARKER}.tmp"
    marker.write_text(json.dumps({"step": step, "file": WEIGHTS_FILE, "time": time.time()}))
    os.replace(marker, final / MARKER)
    return final


def discard_after(weights_dir: str | os.PathLike, step: int) -> list[int]:
    """Remove published steps newer than `step` (a resumed run rewinds to `step`; those policies belong
    to the abandoned attempt)."""
    return remove_steps(Path(weights_dir), lambda s: s <= step)


def gather_full_state_dict(model) -> dict:
    """Collective: every rank must call it. Rank 0 gets the full CPU state dict, others an empty dict.

    Works for FSDP2-sharded (DTensor) modules and plain modules alike.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_config(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / CONFIG_FILE).read_text())
