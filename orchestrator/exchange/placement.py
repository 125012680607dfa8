"""What the planner decides about where things run; the launchers turn it into job groups, the trainer
builds its device mesh from the degrees written here (one set of degrees: the plan's)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

PLACEMENT_FILE = "placement.json"
"""Name of the placement under the run directory's `configs/` (written by the launcher)."""

DEGREE_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
"""The trainer's parallel degrees, named as in `rlctl.trainer.degrees.ParallelDims`."""


def shared_host_trainer_threads(cpus: int, servers: int, ranks: int) -> int:
    """CPU threads per trainer rank when every task shares one host (the local launcher): the cores left
    after one per inference server (its engine loop and API server keep about a core busy), split among
    the ranks, at least one each. The planner counts the trainer's cores the same way."""
    return max(1, (cpus - servers) // max(1, ranks))


@dataclass(frozen=True)
class Placement:
    """Node split and per-node process counts of one run."""

    trainer_nodes: int
    """Nodes of the trainer group."""
    inference_nodes: int
    """Nodes of the inference group."""
    trainer_ranks_per_node: int
    """Trainer processes per node (GPUs per node on GPU clusters; FSDP ranks on CPU profiles)."""
    inference_servers_per_node: int
    """vLLM API servers per node (one per DP rank, or 1 for a TP-only replica)."""
    inference_gpus_per_server: int
    """GPUs each vLLM server uses (its TP degree); 0 on CPU."""
    orchestrator: Literal["cpu_partition", "inference_node"]
    """Where router + orchestrator run: a CPU partition, or beside inference when the cluster has none."""
    trainer_degrees: dict | None = None
    """The trainer's degrees the plan chose ({dp_replicate, dp_shard, cp, tp, ep}; their product without
    ep is the trainer world size); None when the plan could not choose any (it reports why)."""

    def __post_init__(self):
        if self.trainer_degrees is not None:
            object.__setattr__(self, "trainer_degrees", _degrees(self.trainer_degrees))

    @property
    def trainer_world_size(self) -> int:
        return self.trainer_nodes * self.trainer_ranks_per_node

    @property
    def inference_servers(self) -> int:
        return self.inference_nodes * self.inference_servers_per_node

    def to_dict(self) -> dict:
        out = asdict(self)
        out["trainer_world_size"] = self.trainer_world_size
        out["inference_servers"] = self.inference_servers
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Placement":
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})


def _degrees(data: dict) -> dict:
    """The five degrees as positive ints, in their canonical order; ValueError names what is wrong."""
    missing = [k for k in DEGREE_KEYS if k not in data]
    if missing:
        raise ValueError(f"trainer degrees lack {', '.join(missing)} (need {', '.join(DEGREE_KEYS)})")
    out = {k: int(data[k]) for k in DEGREE_KEYS}
    bad = [k for k, v in out.items() if v < 1 or v != data[k]]
    if bad:
        raise ValueError(f"trainer degrees must be positive integers (got {', '.join(f'{k}={data[k]!r}' for k in bad)})")
    return out


def read_placement(run) -> Placement | None:
    """The placement the launcher wrote into `run` (a RunDir); None when the run has none (a component
    started by hand on a bare run directory)."""
    path = run.configs / PLACEMENT_FILE
    if not path.is_file():
        return None
    return Placement.from_dict(json.loads(path.read_text()))


def read_trainer_degrees(run) -> dict | None:
    """The trainer degrees the plan chose for `run`, for `resolve_dims(cfg, world, device, planned=...)`;
    None when the run has no placement or the plan chose none (then the recipe's degrees apply)."""
    placement = read_placement(run)
    return None if placement is None else placement.trainer_degrees


def describe_degrees(degrees: dict | None) -> str:
    """One line for people: the trainer's degrees and the world they multiply to."""
    if not degrees:
        return "none (the plan chose no trainer degrees; see `rlctl plan`)"
    world = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    return (f"dp_replicate {degrees['dp_replicate']} × fsdp {degrees['dp_shard']} × cp {degrees['cp']} "
            f"× tp {degrees['tp']} = {world} ranks; ep {degrees['ep']} (within fsdp)")
