"""Trainer checkpoints with torch DCP: `checkpoints/step_N/trainer/` + `COMPLETE` marker.

`step_N` is the state after N trained steps (policy version N; the next batch to train is N).
Each rank writes its own shards of model and optimizer state (DCP, no gather), plus a small
`extra_rank<R>.pt` with its RNG states and the LR schedule. Everything is written under
`step_N/.trainer.tmp`, renamed to `step_N/trainer` once all ranks are done, and the marker is
written last. Other components may keep their own parts beside it (e.g. `step_N/orchestrator`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

# Which steps are complete is one rule for every component's part: `rlctl.orchestrator.exchange.checkpoints`.
from rlctl.orchestrator.exchange.checkpoints import TRAINER as PART
from rlctl.orchestrator.exchange.checkpoints import (complete_checkpoints, is_complete, newest_complete, seal_part,
                                                     step_path)
from rlctl.orchestrator.exchange.files import fsync_path, private_dir
from rlctl.orchestrator.exchange.retention import prune_checkpoints
from rlctl.orchestrator.exchange.steps import MARKER


def trainer_part(checkpoints: Path, step: int) -> Path:
    return step_path(checkpoints, step) / PART


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    import random

    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(checkpoints: Path, step: int, model, optimizer, scheduler, rank: int, keep_last: int) -> Path:
    """Collective: all ranks call it. Returns the trainer part directory of `step`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = trainer_part(checkpoints, step)
    stage = final.parent / f".{PART}.tmp"
    if (final / MARKER).exists():
        return final
    if rank == 0:
        for leftover in (stage, final):  # a crashed earlier attempt at this step
            if leftover.exists():
                shutil.rmtree(leftover)
        private_dir(stage)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(stage))
        extra = stage / f"extra_rank{rank}.pt"
        torch.save({"step": step, "rng": _rng_state(), "scheduler": scheduler.state_dict()}, extra)
        fsync_path(extra)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException; raised on every rank
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        shutil.rmtree(stage, ignore_errors=True)  # give the space back; the marker was never written
        have = complete_checkpoints(checkpoints)
        raise CheckpointWriteError(
            f"checkpoint step_{step} could not be written to {stage.parent}: {_root_cause(exc)}; "
            f"the previous complete checkpoint ({'step_' + str(have[-1]) if have else 'none'}) is intact"
        ) from exc
    _barrier()
    if rank == 0:
        seal_part(stage, final, step)
        prune(checkpoints, keep_last)
    _barrier()
    return final


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error); nothing partial is visible."""


def _root_cause(exc: BaseException) -> str:
    """The innermost OSError of a (DCP-wrapped) failure, as one line."""
    stack = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, OSError):
            return f"{type(e).__name__}: [Errno {e.errno}] {e.strerror or e}"
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
        stack += [v for v in getattr(e, "failures", {}).values() if isinstance(v, BaseException)]
        stack += [v[0] for v in getattr(e, "failures", {}).values() if isinstance(v, tuple) and v and isinstance(v[0], BaseException)]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def prune(checkpoints: Path, keep_last: int) -> list[int]:
    """Keep the `keep_last` newest complete checkpoints (the retention rule of the exchange)."""
    return prune_checkpoints(checkpoints, keep_last)


def require_complete(checkpoints: Path, step: int) -> Path:
    """The trainer part of `step`, or a one-line RecipeError listing the complete ones."""
    from rlctl.recipes.errors import RecipeError

    final = trainer_part(checkpoints, step)
    if not is_complete(checkpoints, step):
        have = complete_checkpoints(checkpoints)
        raise RecipeError(
            f"no complete trainer checkpoint for step {step} in {checkpoints} (complete: {have or 'none'})",
            "resume step",
        )
    return final


def load_checkpoint(checkpoints: Path, step: int, model, optimizer, scheduler, rank: int) -> None:
    """Collective: restore model, optimizer, LR schedule and this rank's RNG from `step`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    final = require_complete(checkpoints, step)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(final))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_path = final / f"extra_rank{rank}.pt"
    if not extra_path.exists():  # resumed with more ranks than saved: reuse rank 0's schedule/RNG
        extra_path = final / "extra_rank0.pt"
    extra = torch.load(extra_path, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])


def resolve_resume_step(checkpoints: Path, value: str | None) -> int | None:
    """`--resume-step` / RLCTL_RESUME_STEP: an int, 'latest' (newest complete, None if there is none)."""
    from rlctl.recipes.errors import RecipeError

    if value is None or value == "":
        return None
    if value == "latest":
        return newest_complete(checkpoints)
    if not value.isdigit():
        raise RecipeError(f"expected a step number or 'latest' (got {value!r})", "resume step")
    return int(value)
