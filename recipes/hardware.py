"""Built-in GPU catalog: the peak numbers the planner divides by (dense, no sparsity), and the memory
a process can really allocate (what CUDA reports as the device total, in GiB — not the datasheet's GB)."""
from __future__ import annotations

from dataclasses import dataclass

from rlctl.recipes.errors import RecipeError


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet peaks of one accelerator (dense math, no 2:4 sparsity) and its usable memory."""

    name: str
    bf16_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    fp8_tflops: float
    """Dense FP8 tensor-core peak, TFLOP/s (equal to bf16 where the GPU has no FP8 units)."""
    hbm_gib: float
    """Device memory in GiB as CUDA reports it (torch.cuda.mem_get_info()[1]); the datasheet's
    "80 GB" is 80·10⁹ B of which the driver keeps a little, so this is neither 80 nor 74.5."""
    hbm_tbps: float
    """GPU memory bandwidth in TB/s."""

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30


GPUS: dict[str, GPUSpec] = {
    # H100 SXM5 80 GB HBM3, NVIDIA datasheet peaks. Usable: vLLM logs `total_gpu_memory (79.11–79.33GiB)`
    # on H100 80GB (vllm-project/vllm issues #11550-era logs); torch reports ≈ 79.2–79.6 GiB by driver.
    "h100-sxm": GPUSpec("h100-sxm", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gib=79.2, hbm_tbps=3.35),
    # H100 96 GB HBM2e at 500 W (Meta Grand Teton), the GPUs of torchtitan's docs/performance.md:
    # 2.4 TB/s; same tensor cores (its peak lies "between SXM and NVL" — the power cap is in the
    # per-kind efficiencies of recipes/calibration.py, not here). Usable ≈ 94.5 GiB (96·10⁹ B less
    # the driver's share, as on the 80 GB part).
    "h100-96gb": GPUSpec("h100-96gb", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gib=94.5, hbm_tbps=2.4),
    # H200 141 GB HBM3e, 4.8 TB/s, the H100's tensor cores. Usable: CUDA reports ≈ 139.8 GiB.
    "h200": GPUSpec("h200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gib=139.8, hbm_tbps=4.8),
    # HGX B200: 180 GB HBM3e (nvidia-smi 183,359 MiB = 179.1 GiB), ~2.25 PFLOP/s dense BF16, 4.5 dense FP8.
    "b200": GPUSpec("b200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gib=179.1, hbm_tbps=8.0),
    # A100 SXM 80 GB (nvidia-smi 81,920 MiB; CUDA reports ≈ 79.2 GiB): no FP8 tensor cores.
    "a100-80gb": GPUSpec("a100-80gb", bf16_tflops=312.0, fp8_tflops=312.0, hbm_gib=79.2, hbm_tbps=2.04),
    # A CPU "device": a couple of AVX2 cores and DDR bandwidth; only used to size the tiny local demo.
    "cpu": GPUSpec("cpu", bf16_tflops=0.2, fp8_tflops=0.2, hbm_gib=16.0, hbm_tbps=0.02),
}


def gpu_spec(kind: str) -> GPUSpec:
    """Catalog entry for `kind`, or a RecipeError naming the known kinds."""
    try:
        return GPUS[kind.lower()]
    except KeyError:
        raise RecipeError(f"unknown GPU kind {kind!r} (known: {', '.join(GPUS)})", key="gpu") from None
