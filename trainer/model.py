"""Which model the trainer trains and how it is loaded (a transformers causal LM, HF parameter names)."""
from __future__ import annotations

import time
from pathlib import Path

from rlctl.recipes.errors import RecipeError

TINY_NAME = "tiny-qwen3"  # the dense default; `tiny_model.TINY_MODELS` lists every built-in tiny model


def resolve_model_dir(run, recipe, wait_s: float = 300.0) -> Path:
    """`<run>/model` for a built-in tiny model (tiny-qwen3, tiny-qwen3-moe), else `model.name` as a
    local HF directory.

    The launcher builds the tiny model before starting components; if it is missing (a component
    started by hand) rank 0 builds it and the other ranks wait for its marker.
    """
    import os

    from rlctl.trainer.tiny_model import BUILD_MARKER, build_tiny_model, is_tiny_model

    name = recipe.model.name
    if is_tiny_model(name):
        out = run.model
        if not (out / BUILD_MARKER).exists():
            if int(os.environ.get("RANK", "0")) == 0:
                build_tiny_model(out, seed=recipe.model.build_seed, name=name)
            else:
                deadline = time.monotonic() + wait_s
                while not (out / BUILD_MARKER).exists():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"tiny model was not built into {out} within {wait_s:.0f}s")
                    time.sleep(0.2)
        return out
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise RecipeError(
            f"the trainer needs a local Hugging Face model directory with config.json and weights (got {name!r})",
            "model.name",
        )
    if not any(path.glob("*.safetensors")):
        raise RecipeError(f"no *.safetensors weights in {path} (only a config; the trainer needs weights)", "model.name")
    return path
