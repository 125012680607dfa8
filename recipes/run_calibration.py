"""Calibration from a finished run (`rlctl plan --calibrate RUN`) and the calibration files a cluster
profile points to (`calibration: path` in the profile YAML).

A calibration file is TOML: `[constants]` maps names of `rlctl.recipes.calibration` to values (a number,
or a table GPU kind → number for the per-kind constants), `[source]` says which run and when. While a
plan runs, those values replace the module's attributes (the planner reads every constant at call time
as `C.NAME`), so nothing else in the planner knows calibration files exist.

The fit: one run gives two measured numbers, its median trainer step and its median rollout step, so
two scale factors are identifiable, one per side. On each side every efficiency constant the plan of
that run depends on is scaled by the same factor (throughputs and efficiencies multiplied, latencies
and overheads divided) until the plan reproduces the measurement. Constants that move both sides, and
the ones that describe work or memory rather than speed (recompute factors, byte sizes, GiB reserves),
are left alone.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import statistics
from pathlib import Path

from rlctl.recipes import calibration as C
from rlctl.recipes.errors import RecipeError

# Name patterns: what makes a constant a speed (scaled up when the run was faster than planned) or a
# time (scaled down). Checked in this order: `..._PER_S` is a throughput although it ends in `_S`.
THROUGHPUT_MARKS = ("EFF", "MFU", "FLOPS", "PER_S", "SPEEDUP")
LATENCY_SUFFIX = "_S"
FIT_TOLERANCE = 1e-3
FIT_ROUNDS = 12
MIN_ROLLOUT_SHARE = 0.1
"""Floor of the rollout-side fit target, as a fraction of the measured time: when the modelled weight
sync alone exceeds what the run measured, the generation constants are not driven towards zero."""


# ---- reading a finished run --------------------------------------------------------------------

def measured_medians(run_dir: Path) -> dict:
    """Median trainer step, orchestrator step and rollout time (orchestrator step minus the time the
    off-policy gate held it) of a run's metrics; the first step (server start, warm-up) is left out
    when there are others."""
    from rlctl.orchestrator.exchange.metrics import OrchestratorStepRecord, TrainerStepRecord, keys_of, read_records

    (trainer_key,) = keys_of(TrainerStepRecord, "trainer_step_time_s")
    orch_key, wait_key = keys_of(OrchestratorStepRecord, "orchestrator_step_time_s", "wait_policy_s")
    records = read_records(run_dir)
    trainer, orch = by_step(records, "trainer"), by_step(records, "orchestrator")
    trainer, orch = (trainer[1:] if len(trainer) > 1 else trainer), (orch[1:] if len(orch) > 1 else orch)
    t = [r[trainer_key] for r in trainer if _number(r.get(trainer_key))]
    o = [r[orch_key] for r in orch if _number(r.get(orch_key))]
    g = [r[orch_key] - (r.get(wait_key) or 0.0) for r in orch if _number(r.get(orch_key))]
    if not t or not o:
        raise RecipeError(f"{run_dir} has no trainer and orchestrator step metrics to calibrate on "
                          "(metrics/*.jsonl); let the run finish some steps first", key="--calibrate")
    return {"trainer_step_time_s": statistics.median(t), "orchestrator_step_time_s": statistics.median(o),
            "generation_time_s": statistics.median(g), "steps": min(len(t), len(o))}


def by_step(records: list[dict], component: str) -> list[dict]:
    """One record per step of `component` (the last written wins), in step order."""
    latest = {r["step"]: r for r in records if r.get("component") == component and isinstance(r.get("step"), int)}
    return [latest[s] for s in sorted(latest)]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def run_recipe(run_dir: Path):
    """The recipe a run was launched with (its run.json), its split pinned to the nodes it ran on."""
    import json

    from rlctl.recipes.load import validate

    manifest = Path(run_dir) / "run.json"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"cannot read {manifest}: {e}", key="--calibrate") from None
    if not isinstance(data, dict) or not isinstance(data.get("recipe"), dict):
        raise RecipeError(f"{manifest} holds no recipe (not a run directory made by `rlctl launch`?)", key="--calibrate")
    recipe = validate(data["recipe"])
    placement = data.get("placement") or {}
    for side in ("trainer_nodes", "inference_nodes"):
        if isinstance(placement.get(side), int) and placement[side] > 0:
            setattr(recipe.deployment, side, placement[side])
    return recipe


# ---- applying constants ------------------------------------------------------------------------

@contextlib.contextmanager
def applied(constants: dict | None):
    """Replace attributes of `rlctl.recipes.calibration` for the duration of the block (tables are
    merged into the built-in table, so a file may name one GPU kind only)."""
    saved = {}
    try:
        for name, value in (constants or {}).items():
            saved[name] = getattr(C, name)
            setattr(C, name, {**saved[name], **value} if isinstance(saved[name], dict) else value)
        yield
    finally:
        for name, value in saved.items():
            setattr(C, name, value)


def load_calibration(path: str | Path, key: str = "calibration") -> dict:
    """The `[constants]` of a calibration file, checked: every name must be a planner constant and
    every value a finite positive number (or a table of them for per-kind constants). `key` names
    where the path came from in errors (a cluster profile's `calibration`, or `--calibration`)."""
    from rlctl.recipes.errors import path_kind, shown
    from rlctl.recipes.load import read_toml

    kind = path_kind(path)  # never raises: a name too long, a NUL byte, `~nobody` are "not there"
    if kind != "file":
        what = "is a directory, not a calibration file" if kind == "dir" else "calibration file not found"
        raise RecipeError(f"{what}: {shown(str(path))}", key=key)
    path = Path(path).expanduser()
    try:
        data = read_toml(path)
    except RecipeError as e:  # "malformed TOML in ...": named by where the path came from, as the errors below
        raise RecipeError(str(e), key=key) from None
    constants = data.get("constants")
    if not isinstance(constants, dict):
        raise RecipeError(f"{path} has no [constants] table", key=key)
    for name, value in constants.items():
        current = getattr(C, name, None) if name.isupper() else None
        if current is None or callable(current) or isinstance(current, (str, bool)):
            raise RecipeError(f"unknown planner constant in {path} (see rlctl/recipes/calibration.py)",
                              key=f"constants.{name}")
        values = value.values() if isinstance(current, dict) and isinstance(value, dict) else [value]
        if isinstance(current, dict) != isinstance(value, dict) or not all(_number(v) for v in values):
            kind = "a table of GPU kind = positive number" if isinstance(current, dict) else "a finite number > 0"
            raise RecipeError(f"must be {kind} (got {value!r}) in {path}", key=f"constants.{name}")
    return constants


def profile_calibration_key(profile) -> str:
    """How errors name a profile's calibration file: `cluster profile 'NAME': calibration`."""
    return f"cluster profile {getattr(profile, 'name', '?')!r}: calibration"


# ---- fitting -----------------------------------------------------------------------------------

def _direction(name: str) -> int:
    """+1: a speed (time ∝ 1/value), -1: a time (time ∝ value), 0: not an efficiency constant."""
    if any(mark in name for mark in THROUGHPUT_MARKS):
        return 1
    return -1 if name.endswith(LATENCY_SUFFIX) else 0


def _candidates(gpu_kind: str) -> dict[str, float]:
    """Efficiency constants and their current value (the entry for `gpu_kind` of per-kind tables)."""
    out = {}
    for name in dir(C):
        value = getattr(C, name)
        if not name.isupper() or not _direction(name):
            continue
        if isinstance(value, dict):
            value = C.per_kind(value, gpu_kind)
        if _number(value):
            out[name] = float(value)
    return out


def _scaled(names: dict[str, float], factor: float, gpu_kind: str) -> dict:
    out = {}
    for name, value in names.items():
        new = value * factor ** _direction(name)
        out[name] = {gpu_kind: new} if isinstance(getattr(C, name), dict) else new
    return out


def _planned(recipe, profile, constants: dict) -> dict:
    """The orchestrator section of the plan with `constants` applied."""
    from rlctl.recipes.plan_compose import build_report

    with applied(constants):
        o = build_report(recipe, profile).orchestrator
    if o["trainer_step_time_s"] is None or o["rollout_step_time_s"] is None:
        raise RecipeError("the run's recipe does not plan on this profile (no step time to fit)", key="--calibrate")
    return o


def _times(recipe, profile, constants: dict) -> tuple[float, float]:
    o = _planned(recipe, profile, constants)
    return o["trainer_step_time_s"], o["rollout_step_time_s"]


def _sides(recipe, profile, base: dict) -> dict[str, dict[str, float]]:
    """Which constants move only the trainer step, which only the rollout step (a 25% nudge each)."""
    t0, r0 = _times(recipe, profile, base)
    sides = {"trainer": {}, "inference": {}}
    for name, value in _candidates(profile.gpu).items():
        t1, r1 = _times(recipe, profile, {**base, **_scaled({name: value}, 1.25, profile.gpu)})
        moved_t, moved_r = abs(t1 / t0 - 1) > 1e-9, abs(r1 / r0 - 1) > 1e-9
        if moved_t != moved_r:
            sides["trainer" if moved_t else "inference"][name] = value
    return sides


def _fit_side(recipe, profile, names: dict, index: int, target: float, base: dict) -> tuple[float, dict]:
    """Scale factor s of `names` that makes the plan's time `index` (0 trainer, 1 rollout) hit `target`:
    time falls as s rises, close to 1/s, so s ← s × predicted/target converges in a few rounds."""
    s = 1.0
    for _ in range(FIT_ROUNDS):
        fitted = _scaled(names, s, profile.gpu)
        predicted = _times(recipe, profile, {**base, **fitted})[index]
        if abs(predicted / target - 1) < FIT_TOLERANCE:
            break
        s *= predicted / target
    return s, _scaled(names, s, profile.gpu)


def fit(recipe, profile, measured: dict, base: dict | None = None) -> tuple[dict, dict]:
    """(fitted constants, scale per side). The rollout side is fitted to the orchestrator step when the
    run was rollout-bound (generating took longer than a trainer step and its publish: the plan's async
    step is then the rollout side, and what the orchestrator adds per step belongs to it), else to the
    generation time alone (the off-policy gate's wait is the trainer's pace, not inference's) and the
    rest of the orchestrator step beyond the trainer step and its modelled publish becomes
    ASYNC_STEP_SYNC_S. Either way the modelled weight sync is taken out first: the fit attributes only
    what the model does not already explain (the plan adds the sync back on its side)."""
    base = dict(base or {})
    sides = _sides(recipe, profile, base)
    constants, scales = {}, {}
    if sides["trainer"]:
        scales["trainer"], fitted = _fit_side(recipe, profile, sides["trainer"], 0, measured["trainer_step_time_s"], base)
        constants.update(fitted)
    o = _planned(recipe, profile, {**base, **constants})
    trainer_s, trainer_sync, rollout_sync = o["trainer_step_time_s"], o["weight_sync_trainer_s"], o["weight_sync_rollout_s"]
    # the gate rarely held the orchestrator: generating (reload pauses included) outlasted the trainer's loop
    rollout_bound = measured["generation_time_s"] > trainer_s + trainer_sync
    target = measured["orchestrator_step_time_s"] if rollout_bound else measured["generation_time_s"]
    target = max(target - rollout_sync, MIN_ROLLOUT_SHARE * target)
    if sides["inference"]:
        scales["inference"], fitted = _fit_side(recipe, profile, sides["inference"], 1, target, {**base, **constants})
        constants.update(fitted)
    if not rollout_bound:
        # the trainer set the pace: what its loop spends beyond the step and the modelled publish (the
        # gate's hand-off, round trips) is the rest of the orchestrator's step
        sync_s = measured["orchestrator_step_time_s"] - trainer_s - trainer_sync
        if sync_s > 0:  # a calibration file holds positive numbers only
            constants["ASYNC_STEP_SYNC_S"] = sync_s
    return constants, scales


def write_calibration(path: Path, constants: dict, source: dict) -> None:
    import tomli_w

    from rlctl.orchestrator.exchange.files import atomic_write_bytes

    header = ("# Planner constants fitted to a finished run by `rlctl plan --calibrate`.\n"
              "# Point a cluster profile at this file (`calibration: PATH` in its YAML) to plan with them.\n")
    body = tomli_w.dumps({"source": source, "constants": constants})
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (header + body).encode())
    except OSError as e:
        raise RecipeError(f"cannot write {path}: {e.strerror or e}", key="--calibration-out") from None


def calibrate(run_dir: Path, profile, out: Path, recipe=None) -> dict:
    """Fit the constants to `run_dir` (planned with `recipe`, default the run's own) on `profile` and
    write them to `out`; returns what was written."""
    run_dir = Path(run_dir)
    recipe = recipe if recipe is not None else run_recipe(run_dir)
    measured = measured_medians(run_dir)
    path = getattr(profile, "calibration", None)
    base = load_calibration(path, key=profile_calibration_key(profile)) if path else {}
    constants, scales = fit(recipe, profile, measured, base)
    source = {"run": str(run_dir.resolve()), "recipe": recipe.name, "profile": profile.name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "measured": {k: round(v, 6) for k, v in measured.items()},
              "scale": {k: round(v, 6) for k, v in scales.items()}}
    write_calibration(out, constants, source)
    return {"path": str(out), "constants": constants, "source": source}
