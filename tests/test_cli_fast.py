"""`rlctl --help` and `rlctl plan` must not import torch, vLLM or transformers, nor do work the plan does
not need (bench/bench_plan.py measures the time)."""
import json
import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers")

PROBE = """
import json, linecache, sys
sys.argv = ["rlctl"] + {args!r}
from rlctl.cli.main import app
try:
    app()
except SystemExit:
    pass
import pydantic.plugin._loader as plugins
print("PROBE:" + json.dumps({{
    "modules": sorted(sys.modules),
    "plugins_looked_up": plugins._plugins is not None,
    "sources_read": sorted(f for f in linecache.cache if f.endswith(".py") and "site-packages" not in f),
}}))
"""


def _probe(args) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True,
                         timeout=120)
    line = [l for l in out.stdout.splitlines() if l.startswith("PROBE:")][-1]
    return json.loads(line[len("PROBE:"):])


def _heavy_modules(args):
    return [m for m in _probe(args)["modules"] if m.split(".")[0] in HEAVY]


def test_help_imports_nothing_heavy():
    assert _heavy_modules(["--help"]) == []


def test_plan_imports_nothing_heavy():
    assert _heavy_modules(["plan", "recipes/glm5-swe.toml", "--json"]) == []
    assert _heavy_modules(["plan", "recipes/tiny-cpu.toml", "--json"]) == []


def test_plan_does_only_what_the_plan_needs():
    """The human plan is plain text (rich's Console and Table cost more than the plan), the models'
    field docstrings are not read from source at import (only `recipes show --schema` reads them),
    pydantic's plugins are not looked up (a scan of every installed package), and neither the run
    lock nor the calibration fitting is imported without a run or a calibration file."""
    for args in (["plan", "recipes/qwen3-4b.toml"], ["plan", "recipes/qwen3-4b.toml", "--json"]):
        got = _probe(args)
        assert not {"rich.console", "rich.table"} & set(got["modules"]), args
        assert not {"rlctl.recipes.run_calibration", "rlctl.orchestrator.exchange.lock"} & set(got["modules"])
        assert got["sources_read"] == [], args
        assert not got["plugins_looked_up"], args


def test_a_locked_run_is_still_one_line_exit_1():
    """The lock module is imported only when an error reaches the CLI; RunLocked keeps its exit 1."""
    import typer
    from typer.testing import CliRunner

    from rlctl.cli.common import user_errors
    from rlctl.orchestrator.exchange.lock import RunLocked

    app = typer.Typer()

    @app.command()
    @user_errors
    def locked(name: str) -> None:
        raise RunLocked(f"run {name} is held by pid 3")

    r = CliRunner().invoke(app, ["x"])
    assert r.exit_code == 1 and r.output == "rlctl: error: run x is held by pid 3\n"
