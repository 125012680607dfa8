"""Built-in GPU catalog: the peak numbers the planner divides by (dense, no sparsity)."""
from __future__ import annotations

from dataclasses import dataclass

from rlctl.recipes.errors import RecipeError


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet peaks of one accelerator (dense math, no 2:4 sparsity)."""

    name: str
    bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float
    """Dense FP8 tensor-core peak, TFLOP/s (equal to bf16 where the GPU has no FP8 units)."""
    hbm_gib: float
    """GPU memory in GiB."""
    hbm_tbps: float
    """GPU memory bandwidth in TB/s."""

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30


GPUS: dict[str, GPUSpec] = {
    # 80 GB HBM3 = 74.5 GiB; NVIDIA H100 SXM5 datasheet.
    "h100-sxm": GPUSpec("h100-sxm", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gib=80e9 / 2**30, hbm_tbps=3.35),
    # 141 GB HBM3e = 131.3 GiB; same tensor cores as H100.
    "h200": GPUSpec("h200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gib=141e9 / 2**30, hbm_tbps=4.8),
    # HGX B200: 180 GB HBM3e, ~2.25 PFLOP/s dense BF16, 4.5 dense FP8.
    "b200": GPUSpec("b200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gib=180e9 / 2**30, hbm_tbps=8.0),
    # A100 SXM 80 GB: no FP8 tensor cores.
    "a100-80gb": GPUSpec("a100-80gb", bf16_tflops=312.0, fp8_tflops=312.0, hbm_gib=80e9 / 2**30, hbm_tbps=2.04),
    # A CPU "device": a couple of AVX2 cores and DDR bandwidth; only used to size the tiny local demo.
    "cpu": GPUSpec("cpu", bf16_tflops=0.2, fp8_tflops=0.2, hbm_gib=16.0, hbm_tbps=0.02),
}


def gpu_spec(kind: str) -> GPUSpec:
    """Catalog entry for `kind`, or a RecipeError naming the known kinds."""
    try:
        return GPUS[kind.lower()]
    except KeyError:
        raise RecipeError(f"unknown GPU kind {kind!r} (known: {', '.join(GPUS)})", key="gpu") from None
