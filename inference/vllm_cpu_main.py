"""`python -P -m rlctl.inference.vllm_cpu_main ARGS`: vLLM's OpenAI server for the CPU build, its engine
core forked rather than spawned (and with vllm_main.py's changes, as on GPUs).

vLLM's API server runs its engine core in a child process. Its CPU platform sets the start method to
`spawn` unconditionally (`CpuPlatform.check_and_update_config`), so that child imports torch,
transformers and vLLM a second time: ≈ 12 s of a 28 s start on 2 cores, paid again by every resume
and every test that starts a server. On CPU nothing forbids `fork` (spawn exists for CUDA contexts,
which a CPU server has none of): at that moment the API server has one Python thread, has run no
OpenMP region, and its ZMQ contexts are pid-checked by pyzmq, so the child makes its own. Measured
on the tiny model: healthy after 15-18 s with fork against 28-40 s with spawn, same completions.

With `--enable-return-routed-experts` the CPU model runner returns routed experts (router replay;
cpu_routed_experts.py).

A user who sets `VLLM_WORKER_MULTIPROC_METHOD` keeps that choice. A vLLM without the hook (another
version) starts exactly as before, with a log line saying so.
"""
from __future__ import annotations

import logging
import os
import sys

from rlctl.inference.vllm_main import patch_vllm, run_openai_server

log = logging.getLogger("rlctl.inference.vllm_cpu_main")
START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_fork_on_cpu() -> bool:
    """Make vLLM's CPU platform leave the start method at `fork`; False when this vLLM has no such hook
    or the user chose a method."""
    if START_METHOD in os.environ:
        return False
    try:
        from vllm.platforms.cpu import CpuPlatform
        update = CpuPlatform.check_and_update_config.__func__
    except (ImportError, AttributeError) as exc:
        log.warning("vLLM's engine core is spawned (no CpuPlatform.check_and_update_config here: %s)", exc)
        return False

    def check_and_update_config(cls, vllm_config):
        update(cls, vllm_config)
        os.environ[START_METHOD] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


def main() -> None:
    keep_fork_on_cpu()
    if "--enable-return-routed-experts" in sys.argv:
        from rlctl.inference.cpu_routed_experts import accept_v1_cpu_runner

        accept_v1_cpu_runner()
    patch_vllm()
    run_openai_server()


if __name__ == "__main__":
    main()
