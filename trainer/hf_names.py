"""Parameter names in memory (transformers 5) vs in Hugging Face checkpoints (what vLLM loads).

transformers 5 keeps MoE experts fused: `<prefix>.experts.gate_up_proj [E, 2I, H]` (gate rows first,
then up rows) and `<prefix>.experts.down_proj [E, H, I]`, while checkpoints (and vLLM) hold one tensor
per expert: `<prefix>.experts.{e}.gate_proj.weight [I, H]`, `.up_proj.weight [I, H]`,
`.down_proj.weight [H, I]`. This is transformers' `qwen2_moe` conversion pattern, shared by Qwen3-MoE,
DeepSeek-V3 and GLM-4.5-MoE (`conversion_mapping._MODEL_TO_CONVERSION_PATTERN`). Dense models (Qwen3,
Llama) use the same names on both sides.

- Loading (`checkpoint_reads`): the part of a fused parameter one rank owns (a range of experts, maybe
  a range of rows) becomes the per-expert tensors, or row ranges of them, it is made of, so a rank reads
  only its experts. transformers' own loader converts whole tensors only, hence this small mapping.
- Publishing (`to_checkpoint_names`): fused → per-expert with transformers' `revert_weight_conversion`,
  the function `save_pretrained` uses, so published weights carry exactly the names it would write.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class CheckpointRead:
    """Copy `source[source_index]` of checkpoint tensor `name` into `local[target_index]`, where `local`
    is the block of the model tensor starting at the owned offset."""

    name: str
    source_index: tuple[slice, ...]
    target_index: tuple[slice, ...]


def _shift(s: slice, by: int) -> slice:
    return slice(s.start - by, s.stop - by)


def _intersect(s: slice, lo: int, hi: int) -> slice | None:
    start, stop = max(s.start, lo), min(s.stop, hi)
    return slice(start, stop) if start < stop else None


def checkpoint_reads(name: str, shape, owned: tuple[slice, ...], in_checkpoint) -> list[CheckpointRead]:
    """What to read for `owned` (one slice per dim, start/stop set) of model tensor `name` of global
    `shape`. `in_checkpoint(name) -> bool` says which names the checkpoint holds: a name it holds is read
    as is (a checkpoint saved fused is fine too); a fused expert parameter it lacks is read per expert.
    Raises KeyError naming the missing tensor otherwise."""
    whole = tuple(slice(0, s.stop - s.start) for s in owned)
    if in_checkpoint(name):
        return [CheckpointRead(name, owned, whole)]
    match = FUSED_EXPERTS.match(name)
    if match is None or len(shape) != 3:
        raise KeyError(name)
    prefix, kind = match["prefix"], match["kind"]
    experts, rows, cols = owned
    reads = []
    for e in range(experts.start, experts.stop):
        at = e - experts.start
        if kind == "down_proj":
            parts = [(f"{prefix}.{e}.down_proj.weight", rows, 0)]
        else:  # gate rows [0, I), then up rows [I, 2I)
            inter = shape[1] // 2
            parts = [(f"{prefix}.{e}.{proj}.weight", _intersect(rows, lo, lo + inter), lo)
                     for proj, lo in (("gate_proj", 0), ("up_proj", inter))]
        for source, part_rows, lo in parts:
            if part_rows is None:
                continue
            if not in_checkpoint(source):
                raise KeyError(source)
            reads.append(CheckpointRead(
                source, (_shift(part_rows, lo), cols),
                (slice(at, at + 1), _shift(part_rows, rows.start), whole[2]),
            ))
    return reads


@lru_cache(maxsize=4)
def _meta_model(config_json: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(config_json)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _config_dict(config) -> dict:
    return dict(config) if isinstance(config, dict) else config.to_dict()


def to_checkpoint_names(state: dict, config) -> dict:
    """`state` (model names → full tensors) with the names a checkpoint uses: fused experts split into
    per-expert tensors (contiguous, ready for safetensors); other tensors unchanged. `config` is the
    model's config.json as a dict (or its transformers config). Any subset of the model's tensors works
    as long as each fused tensor is whole."""
    cfg = _config_dict(config)
    if not any(FUSED_EXPERTS.match(k) for k in state):  # dense models: nothing to rename
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    model = _meta_model(json.dumps(cfg, sort_keys=True, default=str))  # only its conversion mapping is used
    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(state)).items()}
