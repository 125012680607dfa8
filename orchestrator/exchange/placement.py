"""What the planner decides about where things run; the launchers turn it into job groups."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal


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
