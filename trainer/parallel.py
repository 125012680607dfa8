"""Process group, device mesh and FSDP2 sharding of the trainer.

The degrees follow torchtitan's `ParallelDims` (world = dp_replicate × dp_shard × cp × tp, experts
sharded by ep over the data-parallel ranks). This trainer implements data parallelism: FSDP2
`fully_shard` over `dp_shard`, plus plain replication (HSDP) when the recipe's `fsdp` is smaller than
the world. Experts are split over `ep` by `expert_parallel.py` and FSDP-sharded over `efsdp` here.
"""
from __future__ import annotations

import os

from rlctl.trainer.degrees import ParallelDims, resolve_dims  # noqa: F401 - re-exported for callers
from rlctl.trainer.layers import decoder_layers


def init_distributed() -> tuple[int, int, "torch.device"]:  # noqa: F821
    """Initialise torch.distributed from the launcher's env (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Without those variables it runs as a single rank on a private loopback port. NCCL and a
    `cuda:LOCAL_RANK` device when GPUs are present, gloo on CPU.
    """
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        from rlctl.inference.server import free_port  # below the ephemeral range: see there

        os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"trainer: WORLD_SIZE is set but {', '.join(missing)} is not (set by the launcher)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a node would oversubscribe its cores
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world)
    return rank, world, device


def build_mesh(dims: ParallelDims, device: "torch.device"):  # noqa: F821
    """The world mesh (dp_replicate, dp_shard_mod_ep, ep, cp) with the flattened sub-meshes named in
    `degrees.py`: `fsdp`, `efsdp`, `dp_shard` and `dp` (plus `ep`, `cp`, `dp_replicate`)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    # Slicing the named flattened dims (`mesh["fsdp"]`, `mesh["dp_replicate", "fsdp"]`) is how torch
    # 2.13 gives 2-D (HSDP) sub-meshes; its deprecation notice would open every rank's log.
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    names = ("dp_replicate", "dp_shard_mod_ep", "ep", "cp")
    shape = (dims.dp_replicate, dims.dp_shard_mod_ep, dims.ep, dims.cp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("fsdp")
    mesh["dp_shard_mod_ep", "cp"]._flatten("efsdp")
    mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
    return mesh


def own_group(mesh, dim: str):
    """A process group of its own for the ranks of `mesh[dim]` that this rank belongs to. A flattened
    mesh dim may reuse another dim's group (with ep = world, `fsdp` and `ep` are one group); collectives
    of two kinds on one gloo group must then be issued in the same order on every rank, which the
    autograd engine does not promise for the expert all-to-alls and FSDP's reduce-scatters (a mismatch
    aborts gloo). Every rank creates every group of `dim`, in the same order."""
    import torch.distributed as dist

    i = mesh.mesh_dim_names.index(dim)
    mine = None
    for ranks in mesh.mesh.movedim(i, -1).reshape(-1, mesh.mesh.shape[i]).tolist():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def fsdp_mesh(mesh, dims: ParallelDims):
    """The mesh dense parameters are sharded over: (dp_replicate, fsdp) for HSDP, else fsdp."""
    return mesh["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else mesh["fsdp"]


def apply_fsdp(model, dense_mesh, expert_mesh, dtype: str, activation_checkpointing: bool,
               compile_layers: bool = False):
    """torch.compile and activation checkpointing of each decoder layer (both optional; the compiled
    layer inside its checkpoint: compiled_layers.py says why), then `fully_shard` each MoE block's experts over
    `expert_mesh` (torchtitan's layout: experts already split over `ep` are FSDP-sharded over the
    rest, `efsdp`), each decoder layer and the root over `dense_mesh`. `expert_mesh` None: experts are
    sharded with their layer.

    Parameters and optimizer state stay fp32 (master weights); with dtype=bfloat16 the all-gathered
    compute copies are bf16 and gradients are reduced in fp32.

    Gradients are SUMMED over the ranks (no averaging): each rank's loss is already normalised by the
    global token count, and expert and dense parameters reduce over meshes of different sizes, so no
    single rescaling of the loss could undo FSDP's mean for both.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    from rlctl.trainer.moe import moe_blocks

    blocks = moe_blocks(model)
    layers = decoder_layers(model)
    if activation_checkpointing or compile_layers:
        from rlctl.trainer.compiled_layers import wrap_layers

        wrap_layers(layers, checkpoint=activation_checkpointing, compile=compile_layers)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32, reduce_dtype=torch.float32
    )
    n = len(layers)
    if expert_mesh is not None:
        for i, block in blocks:
            local_experts = block.experts.gate_up_proj.shape[0] // _ep_degree(block.experts.gate_up_proj)
            # fewer local experts than shard ranks: shard each expert's rows instead of whole experts
            placement = (lambda _p: Shard(1)) if local_experts < expert_mesh.size() else None
            fully_shard(block.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=i < n - 1,
                        shard_placement_fn=placement)
    for i, layer in enumerate(layers):
        # the last layer's params are needed right away by the root's backward: keep them gathered
        fully_shard(layer, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def _ep_degree(param) -> int:
    """How many ep ranks split a (DTensor) expert parameter's expert dimension; 1 for a plain tensor."""
    mesh = getattr(param, "device_mesh", None)
    return mesh.size() if mesh is not None else 1


def gather_full(param) -> "torch.Tensor":  # noqa: F821
    """The whole tensor of an FSDP-sharded parameter, detached, on every rank, by one blocking all-gather.

    Not `DTensor.full_tensor()`: on gloo (torch 2.13) its functional all-gather corrupts the heap
    now and then when the cores are busy (malloc aborts, SIGSEGV; see docs/trainer.md), and a LoRA
    run gathers every adapter at every publish (the tests gather with it too). FSDP's layout (dim 0
    over one mesh dimension, replicas elsewhere) needs nothing more general than this.
    """
    from torch.distributed.tensor import DTensor, Shard

    param = param.detach()
    if not isinstance(param, DTensor):
        return param
    sharded = [(i, pl) for i, pl in enumerate(param.placements) if not pl.is_replicate()]
    if len(sharded) != 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        return param.full_tensor()  # a layout FSDP does not make: DTensor's own gather
    import torch.distributed as dist

    group = param.device_mesh.get_group(sharded[0][0])
    local, world, rows = param.to_local(), dist.get_world_size(group), param.shape[0]
    per_rank = -(-rows // world)  # torch.chunk's split: the last ranks hold fewer rows, or none
    padded = local.new_zeros((per_rank, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((per_rank * world, *local.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[:rows]
