"""Property test of every input path of `rlctl plan`: 1,000 generated recipes, cluster profiles and model
config.json files, each mutated from a real one (wrong types, huge/negative/zero/NaN numbers, missing and
unknown keys, deep nesting, unicode), written to files and planned through the CLI in-process.

Each must end in exit 0 or 2 — 2 with one `rlctl: error:` line — never a traceback; `--json` must parse
with strict JSON (no NaN/Infinity), hold no negative figure, and `fits: true` must mean that every trainer
rank and the GPU of every kind of inference replica (decode, P/D prefill) fits in its memory. A few cases run as real subprocesses to check the same end to end.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.recipes.clusters import ClusterProfile
from rlctl.recipes.hardware import gpu_spec
from rlctl.recipes.load import load_recipe
from rlctl.recipes.model_catalog import CATALOG
from rlctl.recipes.models import ModelSpec
from rlctl.recipes.schema import Recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
PROFILES = sorted((ROOT / "recipes" / "profiles").glob("*.yaml"))
CASES = 1000
SEED = 20240612
DELETE = object()


class Deep:
    """A value nested `depth` lists deep, written as text (no writer, parser or list recursion here)."""

    def __init__(self, depth: int):
        self.depth = depth


class Digits:
    """An integer of `count` digits, written as text: Python's int() refuses more than 4300."""

    def __init__(self, count: int):
        self.count = count


# ---- writing TOML / YAML / JSON by hand: the values must reach the parsers exactly as generated ----------
def _scalar(v, style: str) -> str:
    if isinstance(v, Deep):
        return "[" * v.depth + "1" + "]" * v.depth
    if isinstance(v, Digits):
        return "9" * v.count
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"  # never in TOML: a None there is written as a missing key
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return repr(v)
        sign = "-" if v < 0 else ""
        return {"toml": f"{sign}inf", "yaml": f"{sign}.inf", "json": f"{sign}Infinity"}[style] if math.isinf(v) \
            else {"toml": "nan", "yaml": ".nan", "json": "NaN"}[style]
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x, style) for x in v if not (style == "toml" and x is None)) + "]"
    if isinstance(v, dict):
        sep = " = " if style == "toml" else ": "
        items = [f"{json.dumps(str(k), ensure_ascii=False)}{sep}{_scalar(x, style)}" for k, x in v.items()
                 if not (style == "toml" and x is None)]
        return "{" + ", ".join(items) + "}"
    raise TypeError(type(v))


def write_toml(data: dict, path: Path) -> None:
    path.write_text("".join(f"{json.dumps(str(k), ensure_ascii=False)} = {_scalar(v, 'toml')}\n"
                            for k, v in data.items() if v is not None), encoding="utf-8")


def write_yaml(data: dict, path: Path) -> None:
    path.write_text("".join(f"{json.dumps(str(k), ensure_ascii=False)}: {_scalar(v, 'yaml')}\n"
                            for k, v in data.items()), encoding="utf-8")


def write_json(data: dict, path: Path) -> None:
    path.write_text(_scalar(data, "json"), encoding="utf-8")


# ---- mutations ------------------------------------------------------------------------------------------
def _schema_paths(model, prefix=()) -> list[tuple]:
    from pydantic import BaseModel

    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _schema_paths(kind, prefix + (name,))
        else:
            out.append(prefix + (name,))
    return out


RECIPE_PATHS = _schema_paths(Recipe)
PROFILE_PATHS = _schema_paths(ClusterProfile)
CONFIG_PATHS = [(f,) for f in ModelSpec.__dataclass_fields__ if f not in ("name", "extra")] + [
    ("num_experts",), ("first_k_dense_replace",), ("mlp_only_layers",), ("mlp_layer_types",),
    ("shared_expert_intermediate_size",), ("text_config",), ("num_local_experts",)]

INTS = [0, -1, 1, 2, 3, 5, 8, 64, 1000, 10 ** 6, 10 ** 9, 10 ** 12, 10 ** 18, 10 ** 30, 10 ** 400, -10 ** 9]
FLOATS = [0.0, -0.0, 0.5, -1.5, 1e-300, 1e300, float("nan"), float("inf"), float("-inf")]
ODD = ["", "x", "auto", "1", "nan", "模型", "\u0000", "\U0001f4a5" * 3, "ä" * 5000, True, False, [], [1, 2],
       [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 50, {}, {"a": 1}, None, Digits(5000)]


def _plausible(rng: random.Random, old):
    """A value of the right type near the old one: most of these still plan (exit 0)."""
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice([old * 2, max(1, old // 2), old + 1, max(0, old - 1), old * 8])
    if isinstance(old, float):
        return rng.choice([old * 2, old / 2, old * 1.1])
    if old == "auto":
        return rng.choice([1, 2, 4, 8, 16])
    return old


def nasty(rng: random.Random, old):
    roll = rng.random()
    if roll < 0.3:
        return _plausible(rng, old)
    if roll < 0.55:
        return rng.choice(INTS)
    if roll < 0.7:
        return rng.choice(FLOATS)
    if roll < 0.8:
        return Deep(rng.choice([5, 200, 2000, 20000]))
    if roll < 0.88:
        return DELETE
    if isinstance(old, list) and old:
        return [nasty(rng, x) for x in old]
    return rng.choice(ODD)


def _set(data: dict, path: tuple, value) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if value is DELETE:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def _get(data: dict, path: tuple):
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def mutate(rng: random.Random, data: dict, paths: list[tuple], times: int) -> dict:
    for _ in range(times):
        if rng.random() < 0.05:  # an unknown key somewhere
            _set(data, rng.choice(paths)[:-1] + (rng.choice(["bogus", "ünknown", "x" * 300]),), 1)
            continue
        path = rng.choice(paths)
        _set(data, path, nasty(rng, _get(data, path)))
    return data


def make_case(rng: random.Random, tmp: Path, i: int) -> list[str]:
    """Files for case i on disk; returns the `rlctl plan` arguments."""
    recipe = _load_toml(rng.choice(RECIPES))
    profile = yaml.safe_load(rng.choice(PROFILES).read_text())
    gpu_profiles = [p for p in PROFILES if "gpus_per_node: 0" not in p.read_text()]
    if rng.random() < 0.5:  # most cases on a GPU cluster: that is where the model's figures are
        profile = yaml.safe_load(rng.choice(gpu_profiles).read_text())
    if rng.random() < 0.3:
        recipe.setdefault("model", {})["name"] = rng.choice(sorted(CATALOG))
    mutate(rng, recipe, RECIPE_PATHS, rng.choice([0, 0, 1, 1, 2, 3]))
    mutate(rng, profile, PROFILE_PATHS, rng.choice([0, 0, 0, 1, 2]))
    if rng.random() < 0.4:
        config = dict(CATALOG[rng.choice(sorted(CATALOG))])
        mutate(rng, config, CONFIG_PATHS, rng.choice([0, 1, 1, 2]))
        write_json(config, tmp / f"config{i}.json")
        recipe.setdefault("model", {})
        if isinstance(recipe["model"], dict):
            recipe["model"]["name"] = str(tmp / f"config{i}.json")
    write_toml(recipe, tmp / f"recipe{i}.toml")
    write_yaml(profile, tmp / f"profile{i}.yaml")
    return ["plan", str(tmp / f"recipe{i}.toml"), "--cluster", str(tmp / f"profile{i}.yaml"), "--json"]


def _load_toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


# ---- what every outcome must satisfy -------------------------------------------------------------------
def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"--json wrote {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def _numbers(obj, path=""):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}" if path else k)
    elif isinstance(obj, list):
        for n, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{n}]")


def check_plan(plan: dict, profile_file: Path, recipe_file: Path) -> None:
    for where, value in _numbers(plan):
        assert math.isfinite(value) and value >= 0, f"{where} = {value}"
    if not plan["fits"]:
        return
    profile = ClusterProfile.model_validate(yaml.safe_load(profile_file.read_text()) | {"name": "p"})
    trainer, inference = plan["trainer"], plan["inference"]
    if profile.gpus_per_node == 0 or not inference.get("gpus"):  # a CPU run: ranks share the host memory
        ranks = plan["placement"]["trainer_ranks_per_node"]
        assert trainer["memory_gib_per_gpu"] * ranks <= profile.mem_gib_per_node * 1.001, plan
        return
    hbm = gpu_spec(profile.gpu).hbm_gib
    assert trainer["memory_gib_per_gpu"] <= hbm * 1.001, ("trainer rank exceeds its GPU", trainer, hbm)
    # vLLM's budget is gpu_memory_utilization × the GPU: weights and KV cache must both be inside it.
    recipe = load_recipe([str(recipe_file)], [f'cluster.profile="{profile_file}"'])  # as --cluster did
    budget = hbm * recipe.inference.gpu_memory_utilization
    used = inference["weights_gib_per_gpu"] + inference["kv_cache_gib_per_gpu"]
    assert used <= budget * 1.001, ("inference GPU exceeds its memory", inference, budget)
    # Every kind of replica (P/D prefill ones too): weights, activations and KV cache inside the budget,
    # and room for the least KV it must hold (a rollout to decode, a prompt chunk to prefill).
    assert inference["usable_gib_per_gpu"] == pytest.approx(budget, abs=0.01)
    kinds = inference["replica_memory_gib"]
    assert set(kinds) == ({"decode", "prefill"} if recipe.inference.disaggregation.enabled else {"decode"})
    for kind, m in kinds.items():
        assert m["weights"] + m["activations"] + m["kv_cache"] <= budget + 0.01, (f"{kind} replica exceeds its GPU", m, budget)
        assert m["kv_cache"] >= m["kv_needed"] - 0.001, (f"{kind} replica has no room for its KV", m)


def test_thousand_generated_inputs_plan_or_fail_in_one_line(tmp_path):
    rng = random.Random(SEED)
    runner = CliRunner()
    outcomes: Counter = Counter()
    for i in range(CASES):
        args = make_case(rng, tmp_path, i)
        r = runner.invoke(app, args)
        if r.exit_code not in (0, 1, 2):
            import traceback

            detail = "".join(traceback.format_exception(r.exception)) if r.exception else r.output
            pytest.fail(f"case {i} ({args[1]}) exited {r.exit_code}:\n{detail[-3000:]}")
        assert "Traceback" not in r.output, r.output
        outcomes[r.exit_code] += 1
        if r.exit_code == 2:
            lines = r.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("rlctl: error: "), (i, r.output[-2000:])
            continue
        plan = _strict_json(r.stdout)
        assert r.exit_code == (0 if plan["fits"] else 1), (i, plan["errors"])  # 1: printed, does not fit
        check_plan(plan, tmp_path / f"profile{i}.yaml", tmp_path / f"recipe{i}.toml")
    # The generator must exercise both ends: inputs that plan and inputs that are refused.
    assert outcomes[0] >= CASES // 10 and outcomes[1] >= 1 and outcomes[2] >= CASES // 10, outcomes
    print(f"fuzz outcomes: {dict(outcomes)}")


@pytest.mark.parametrize("kind", ["deep-toml", "config-json-string", "huge-nodes", "nan-profile", "unwritable-clone",
                                  "huge-cpu-kv-cache"])
def test_end_to_end_exit_2_without_traceback(tmp_path, kind):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nname = "qwen3-4b"\n')
    profile = tmp_path / "p.yaml"
    profile.write_text("nodes: 4\ngpus_per_node: 8\ngpu: h200\n")
    args = ["plan", str(recipe), "--cluster", str(profile), "--json"]
    if kind == "deep-toml":
        recipe.write_text("x = " + "[" * 20000 + "]" * 20000 + "\n")
    elif kind == "config-json-string":
        config = tmp_path / "config.json"
        write_json(dict(CATALOG["qwen3-4b"], mlp_only_layers=7, num_experts=8, num_experts_per_tok=2), config)
        args += ["-o", f'model.name="{config}"']
    elif kind == "huge-nodes":
        profile.write_text("nodes: 100000000\ngpus_per_node: 8\ngpu: h200\n")
    elif kind == "huge-cpu-kv-cache":  # its GiB in bytes overflowed to inf, and the plan's token count to NaN
        args += ["-o", "inference.kv_cache_gib_cpu=1e300"]
    elif kind == "nan-profile":
        profile.write_text("nodes: 4\ngpus_per_node: 8\ngpu: h200\ninterconnect_gbps: .nan\n")
    else:
        args = ["recipes", "clone", "qwen3-4b", str(tmp_path / ("c" * 300 + ".toml"))]
    out = subprocess.run([sys.executable, "-m", "rlctl.cli.main", *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlctl: error: ") and out.stdout == "", out.stderr[-2000:]
