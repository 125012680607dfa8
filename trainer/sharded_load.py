"""Sharded loading: build on the meta device, let the caller shard, then read only the owned bytes.

No rank ever holds the whole model: `build_meta_model` creates modules without storage, the caller
shards them (FSDP2 `fully_shard`, expert parameters possibly DTensors over `ep` first), and
`materialize_and_load` allocates each parameter's local shard (`to_empty`) and fills it from the HF
safetensors files, reading for each DTensor parameter only the block it owns (offset and shape from
`compute_local_shape_and_global_offset`, which also resolves the `_StridedShard` placements of
experts sharded over `ep` and then `efsdp`) with `safe_open(...).get_slice(name)[block]`.

Why not torch.distributed.checkpoint's `HuggingFaceStorageReader`: it reads owned slices the same way,
but maps one model tensor to one checkpoint tensor of the same name. transformers 5 keeps MoE experts
fused (`experts.gate_up_proj [E, 2I, H]`) while checkpoints store one tensor per expert and
projection, so a fused shard is assembled from many checkpoint tensors (`hf_names.checkpoint_reads`);
one reader for dense and expert parameters keeps a single path.

Host memory: safetensors returns slices as views of a memory map, and touched pages count in the
process's RSS until the map is dropped, so files are opened per parameter and closed after its copy:
the peak is this rank's shards plus one parameter's slice.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from rlctl.trainer.hf_names import checkpoint_reads

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper inserts it in names
_COMPILED = "_orig_mod"  # torch.compile's wrapper


def _hf_config(config):
    """A transformers config from a config.json dict, a model directory, its config.json, or a config."""
    from transformers import AutoConfig

    if isinstance(config, dict):
        return AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    if isinstance(config, (str, Path)):
        path = Path(config)
        return AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path))
    return config


def build_meta_model(config) -> torch.nn.Module:
    """The transformers causal LM of `config` (dict, model directory or config object) on the meta
    device: fp32, SDPA attention, no KV cache, train mode. Shapes only; no storage is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(config), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    return model.train()


def checkpoint_files(model_dir) -> dict[str, Path]:
    """Checkpoint tensor name → the safetensors file holding it (sharded index or one file)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def owned_block(tensor) -> tuple[slice, ...]:
    """The block of the global tensor this rank holds (the whole tensor for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def checkpoint_name(module_path: str) -> str:
    """A parameter's name without the wrappers activation checkpointing and torch.compile insert."""
    return module_path.replace(f"{_CHECKPOINT_WRAPPED}.", "").replace(f"{_COMPILED}.", "")


def _local(tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fill(name: str, tensor, files: dict[str, Path]) -> None:
    """Read this rank's block of model tensor `name` into its local storage; files opened here only."""
    from safetensors import safe_open

    local = _local(tensor)
    block = owned_block(tensor)
    if tuple(s.stop - s.start for s in block) != tuple(local.shape):
        raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the owned block {block}")
    reads = checkpoint_reads(name, tuple(tensor.shape), block, files.__contains__)
    if local.numel() == 0:  # an empty shard (more ranks than rows): nothing to read
        return
    with ExitStack() as stack, torch.no_grad():
        opened = {}
        for read in reads:
            file = files[read.name]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            part = opened[file].get_slice(read.name)
            if part.get_dtype().startswith("F8"):
                raise ValueError(f"{name}: the checkpoint stores {read.name} in FP8 (block-scaled); "
                                 "the trainer loads bf16/fp16/fp32 checkpoints")
            source = part[read.source_index]
            local[read.target_index].copy_(source.reshape(local[read.target_index].shape))
            del source  # drop the memory-map view before the next read


def _tied_aliases(model) -> dict[int, list[str]]:
    """Every name of each parameter/buffer object (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(checkpoint_name(name))
    return names


def _non_persistent_buffers(model) -> list[tuple[torch.nn.Module, str]]:
    return [(module, name) for module in model.modules()
            for name in module._buffers if name in module._non_persistent_buffers_set
            and module._buffers[name] is not None]


def _reinit_non_persistent_buffers(model, owners: list[tuple[torch.nn.Module, str]]) -> None:
    """Recompute buffers that are not in checkpoints (rotary `inv_freq`, ...) with the model's own
    `_init_weights`, which writes only tensors not flagged as initialised: the loaded parameters and
    persistent buffers of those modules are flagged for the call, so only the buffers change."""
    modules = {id(m): m for m, _ in owners}
    for module in modules.values():
        flagged = [t for t in [*module.parameters(recurse=False), *(
            b for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set)]]
        for t in flagged:
            t._is_hf_initialized = True
        for name in module._buffers:
            buf = module._buffers[name]
            if name in module._non_persistent_buffers_set and buf is not None and buf.is_floating_point():
                buf.fill_(float("nan"))  # so a buffer the init does not cover is caught below
        try:
            with torch.no_grad():
                model._init_weights(module)
        finally:
            for t in flagged:
                del t._is_hf_initialized
    for module, name in owners:
        buf = module._buffers[name]
        if buf.is_floating_point() and torch.isnan(buf).any():
            raise RuntimeError(f"{type(module).__name__}.{name}: non-persistent buffer not recomputed by "
                               f"{type(model).__name__}._init_weights")


def _retie(model) -> None:
    """`to_empty` gives each name of a tied weight its own storage on a plain module (FSDP2 keeps the
    one sharded parameter): tie lm_head to the input embedding again, as transformers does."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(text, "tie_word_embeddings", False) or out is None or out.weight is inp.weight:
        return
    model.tie_weights()
    if out.weight is not inp.weight:
        raise RuntimeError("tie_word_embeddings: lm_head.weight could not be tied to the input embedding "
                           "after materialisation (shard the tied weights in one FSDP group, e.g. the root)")


def materialize_and_load(model, model_dir, device) -> None:
    """Allocate the (already sharded) meta `model`'s local shards on `device` and fill them from the
    HF safetensors in `model_dir`, reading only the bytes this rank owns. Parameters and persistent
    buffers come from the files (cast to their dtype; fused experts assembled from per-expert tensors);
    non-persistent buffers are recomputed; a tied lm_head stays the input embedding (it is absent from
    the files). Not collective: each rank reads its own blocks."""
    files = checkpoint_files(model_dir)
    owners = _non_persistent_buffers(model)
    model.to_empty(device=device)
    _retie(model)
    aliases = _tied_aliases(model)
    non_persistent = {id(m._buffers[n]) for m, n in owners}
    missing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in non_persistent or ".lora_A." in name or ".lora_B." in name:
            continue  # LoRA adapters are not in the HF files: `lora.init_adapters` fills them
        # a tied weight is filled once, from whichever of its names the files hold
        name = checkpoint_name(name)
        source = next((n for n in aliases[id(tensor)] if n in files), name)
        try:
            _fill(source, tensor, files)
        except KeyError as e:
            missing.append(f"{name} ({e.args[0]})" if e.args[0] != name else name)
    if missing:
        raise KeyError(f"{len(missing)} tensors not in the checkpoint {model_dir}: {', '.join(missing[:5])}"
                       + (" ..." if len(missing) > 5 else ""))
    _reinit_non_persistent_buffers(model, owners)
