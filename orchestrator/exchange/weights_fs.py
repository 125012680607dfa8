"""The filesystem weight transport: `weights/step_N/` with `model.safetensors` + `config.json`.

Full weights under Hugging Face parameter names (the tied `lm_head.weight` dropped because loaders
re-tie it to the embedding), published with `publish_step` — readers that only trust directories with
the marker never see a partial step (rename is atomic on POSIX filesystems, and NFS/Lustre keep rename
atomic within a directory).
"""
from __future__ import annotations

import json
from pathlib import Path

from rlctl.orchestrator.exchange.steps import (MARKER, complete_steps, parse_step, publish_step, remove_steps,
                                                step_dir_name)
from rlctl.orchestrator.exchange.weights import WeightStore

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


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


class FilesystemWeightStore(WeightStore):
    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def location(self, step: int) -> Path:
        return self.folder / step_dir_name(step)

    def publish(self, step: int, state: dict, config: dict) -> Path:
        """A step that is already complete is left as it is (a restarted trainer republishing)."""
        from safetensors.torch import save_file

        final = self.location(step)
        if (final / MARKER).exists():
            return final

        def write(stage: Path) -> None:
            save_file(hf_state_dict(state, config), str(stage / WEIGHTS_FILE),
                      metadata={"format": "pt", "step": str(step)})
            (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

        # Only the data needs fsync before the marker exists: losing the rename or the marker in a
        # crash merely hides the step (it is republished), so those metadata writes are not synced.
        return publish_step(self.folder, final.name, write, {"step": step, "file": WEIGHTS_FILE},
                            sync_metadata=False)

    def latest(self) -> int | None:
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def discard_after(self, step: int) -> list[int]:
        return remove_steps(self.folder, lambda s: s <= step)

    def retain(self, keep_last: int, in_use: set[int] = frozenset()) -> list[int]:
        """Complete steps beyond the newest `keep_last` go, unless a server may still be loading them;
        steps newer than the newest complete one (being written) are never touched."""
        done = complete_steps(self.folder)
        kept = set(done[-max(keep_last, 1):]) | set(in_use)
        newest = done[-1] if done else -1
        return remove_steps(self.folder, lambda s: s in kept or s > newest)


def step_of(path: Path) -> int | None:
    """The step of a `weights/step_N` directory (what a server reports it has loaded)."""
    return parse_step(Path(path).name)
