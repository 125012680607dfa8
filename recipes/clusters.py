"""Cluster profiles (YAML): what the cluster has, and the Slurm defaults to submit with."""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from rlctl.recipes.base import MAX_GPUS_PER_NODE, MAX_NODES, StrictModel
from rlctl.recipes.errors import TOO_DEEP, RecipeError, path_kind, shown


class Partitions(StrictModel):
    """Slurm partitions of the cluster."""

    gpu: str | None = None
    """Partition of GPU nodes (trainer and inference); None on the local profile."""
    cpu: str | None = None
    """Partition of CPU-only nodes for router + orchestrator; None if the cluster has none."""


class ClusterProfile(StrictModel):
    """A cluster: node count and shape, interconnect, filesystem, Slurm defaults."""

    name: str
    """Profile name."""
    scheduler: Literal["slurm", "local"] = "slurm"
    """`slurm` submits heterogeneous jobs; `local` runs every component as a local process."""
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)]
    """GPU nodes available to one job."""
    gpus_per_node: Annotated[int, Field(ge=0, le=MAX_GPUS_PER_NODE)]
    """GPUs per node (0 for CPU-only machines)."""
    gpu: str = "cpu"
    """GPU kind, a key of the GPU catalog (`h100-sxm`, `h200`, `b200`, `a100-80gb`, `cpu`)."""
    cpus_per_node: Annotated[int, Field(ge=1, le=1 << 16)] = 64
    """CPU cores per node."""
    mem_gib_per_node: Annotated[int, Field(ge=1, le=1 << 24)] = 512
    """CPU memory per node in GiB."""
    cpu_nodes: Annotated[int, Field(ge=0, le=MAX_NODES)] = 0
    """CPU-only nodes in the `cpu` partition (for router + orchestrator)."""
    # > 0: a zero or negative bandwidth made communication free (or its time negative) in the plan.
    interconnect_gbps: Annotated[float, Field(gt=0, le=1e6)] = 400.0
    """Inter-node bandwidth per GPU in Gbit/s (e.g. 400 for NDR InfiniBand); the weight broadcast's NIC. On
    CPU-only profiles: the bandwidth between two processes of the gloo weight broadcast."""
    intra_node_gbps: Annotated[float, Field(gt=0, le=1e6)] = 7200.0
    """Intra-node GPU-to-GPU bandwidth in Gbit/s (NVLink 900 GB/s = 7200); unused on CPU-only profiles."""
    # > 0 as the NIC figures: a zero bandwidth made the weight sync and checkpoint writes free (or endless).
    fs_aggregate_gbs: Annotated[float, Field(gt=0, le=1e6)] = 10.0
    """Shared filesystem bandwidth of the whole cluster in GB/s (all nodes reading or writing together);
    bounds the weight sync of `weights.transport = "filesystem"` and checkpoint writes. The default is a
    conservative guess (a small NFS/Lustre install); set the figure your storage sustains (IOR, fio)."""
    fs_node_gbs: Annotated[float, Field(gt=0, le=1e5)] = 1.0
    """Shared filesystem bandwidth of one node's client in GB/s (one node reading or writing alone). The
    default is conservative (≈ 1 GB/s per client over 10-100 GbE); set what one node sustains."""
    shared_fs: str | None = None
    """Path of the shared filesystem where run directories go (None: ./runs)."""
    partitions: Partitions = Partitions()
    """Slurm partitions."""
    account: str | None = None
    """Default Slurm account."""
    qos: str | None = None
    """Default Slurm QoS."""
    constraint: str | None = None
    """Default Slurm node constraint."""
    calibration: str | None = None
    """Calibration file (`rlctl plan --calibrate RUN`) whose constants plans on this cluster use."""
    gres_gpu: bool = True
    """Request GPUs with `--gpus-per-node` (set false on clusters without GPU gres)."""


def builtin_profile_names() -> list[str]:
    root = resources.files("rlctl.recipes").joinpath("profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_profile(ref: str) -> ClusterProfile:
    """A built-in profile name or a path to a YAML file → ClusterProfile (RecipeError on bad input)."""
    import yaml
    from pydantic import ValidationError

    from rlctl.recipes.errors import format_validation_error

    kind = path_kind(ref)
    path = Path(ref).expanduser() if kind == "file" else None
    if path is None:
        if kind == "dir":
            raise RecipeError(f"is a directory, not a cluster profile YAML file: {shown(ref)}", key="cluster.profile")
        if "/" in ref or ref.endswith((".yaml", ".yml")):
            raise RecipeError(f"cluster profile file not found: {shown(ref)}", key="cluster.profile")
        path = Path(str(resources.files("rlctl.recipes").joinpath("profiles", f"{ref}.yaml")))
        if path_kind(path) != "file":
            raise RecipeError(
                f"unknown cluster profile {shown(ref)!r} (built-in: {', '.join(builtin_profile_names())}, or a YAML path)",
                key="cluster.profile",
            )
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"malformed YAML in {path}: {_yaml_problem(e)}", key="cluster.profile") from None
    except UnicodeDecodeError:
        raise RecipeError(f"cluster profile is not UTF-8 text: {path}") from None
    except RecursionError:
        raise RecipeError(f"cluster profile {path} is {TOO_DEEP}", key="cluster.profile") from None
    except ValueError as e:  # an integer longer than Python converts (4300 digits)
        raise RecipeError(f"malformed YAML in {path}: {shown(str(e), 100)}", key="cluster.profile") from None
    except OSError as e:
        raise RecipeError(f"cannot read cluster profile {path}: {e.strerror}", key="cluster.profile") from None
    if not isinstance(data, dict):
        raise RecipeError(f"cluster profile {path} must be a YAML mapping (got {type(data).__name__})",
                          key="cluster.profile")
    data.setdefault("name", path.stem)
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as e:
        e._rlctl_model = ClusterProfile
        raise RecipeError(f"{path.name}: " + format_validation_error(e)) from None


def _yaml_problem(err) -> str:
    """What is wrong and where, in one line: the first line of PyYAML's message is often only its context
    ("while parsing a flow node"), with the problem and its line on the lines after it."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem:
        return shown(str(err).splitlines()[0], 100)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return shown(problem, 100) + where
