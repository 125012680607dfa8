"""Where a transformers causal LM keeps its repeated blocks (shared by the MoE and FSDP code)."""
from __future__ import annotations


def decoder_layers(model):
    """The repeated transformer blocks of a transformers causal LM (`model.model.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    return layers
