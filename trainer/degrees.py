"""The trainer's parallel degrees: one set, the planner's, validated once.

Layout follows torchtitan's `ParallelDims`: world = dp_replicate × dp_shard × cp × tp. Expert
parallelism borrows from dp_shard (ep divides dp_shard): the ep ranks of one expert group hold
different experts and different rows of the batch; tokens travel between them by all-to-all.

Named sub-meshes (built by `parallel.build_mesh`):
- `fsdp`  = dp_shard × cp: dense parameters are sharded over it (FSDP2),
- `efsdp` = (dp_shard / ep) × cp: expert parameters (already split over `ep`) are sharded over it,
- `ep`, `cp`: the all-to-all groups of expert and context parallelism,
- `dp`    = dp_replicate × dp_shard: ranks that read different rows of the batch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rlctl.recipes.errors import RecipeError


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees for one trainer run."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int

    @property
    def dp(self) -> int:
        """Ranks that read different rows of a batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Size of the mesh dense parameters are sharded over."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def efsdp(self) -> int:
        """Size of the mesh each expert shard is FSDP-sharded over."""
        return self.dp_shard_mod_ep * self.cp

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self, device_type: str) -> "ParallelDims":
        """Refuse what the trainer cannot execute, naming the key; returns self."""
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise RecipeError(
                f"dp_replicate {self.dp_replicate} × fsdp {self.dp_shard} × cp {self.cp} × tp {self.tp} = {product} "
                f"must equal the trainer world size {self.world_size}", "trainer.fsdp",
            )
        if self.tp > 1:
            raise RecipeError(
                f"tensor parallelism (got {self.tp}) is not implemented by the trainer on {device_type}; allowed: 1 "
                "(shard with trainer.fsdp, split sequences with trainer.cp, experts with trainer.ep)", "trainer.tp",
            )
        if self.dp_shard % self.ep:
            raise RecipeError(f"must divide the FSDP degree {self.dp_shard} (expert parallelism borrows "
                              f"from the data-parallel shard ranks; got {self.ep})", "trainer.ep")
        return self


def _fixed(value) -> int | None:
    return None if value == "auto" else int(value)


def resolve_dims(trainer_cfg, world_size: int, device_type: str, planned: dict | None = None) -> ParallelDims:
    """The degrees the trainer runs with: the plan's (`planned`, written with the placement) when there
    is one, else the recipe's with 'auto' resolved for `world_size` ranks (cp, tp, ep → 1, fsdp → the
    rest)."""
    if planned:
        dims = ParallelDims(**{k: int(planned[k]) for k in ParallelDims.__dataclass_fields__ if k != "world_size"},
                            world_size=world_size)
        return dims.validate(device_type)
    cp, tp, ep = (_fixed(getattr(trainer_cfg, k)) or 1 for k in ("cp", "tp", "ep"))
    if tp > 1:  # refused before the arithmetic below, which would blame another key
        ParallelDims(1, 1, 1, tp, 1, tp).validate(device_type)
    per_replica_other = cp * tp
    if world_size % per_replica_other:
        raise RecipeError(f"cp × tp = {per_replica_other} must divide the trainer world size {world_size}",
                          "trainer.cp")
    shard = _fixed(trainer_cfg.fsdp)
    if shard is None:
        shard = world_size // per_replica_other
    elif shard * per_replica_other > world_size or world_size % (shard * per_replica_other):
        raise RecipeError(f"fsdp × cp × tp = {shard * per_replica_other} must divide the trainer world size "
                          f"{world_size} (got fsdp {shard})", "trainer.fsdp")
    replicate = world_size // (shard * per_replica_other)
    return ParallelDims(replicate, shard, cp, tp, ep, world_size).validate(device_type)
