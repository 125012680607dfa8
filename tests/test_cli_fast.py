"""`rlctl --help` and `rlctl plan` must not import torch, vLLM or transformers."""
import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers")

PROBE = """
import sys
sys.argv = ["rlctl"] + {args!r}
from rlctl.cli.main import app
try:
    app()
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print("HEAVY:" + ",".join(heavy))
"""


def _heavy_modules(args):
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args, heavy=HEAVY)],
                         capture_output=True, text=True, timeout=120)
    line = [l for l in out.stdout.splitlines() if l.startswith("HEAVY:")][-1]
    return [m for m in line[6:].split(",") if m]


def test_help_imports_nothing_heavy():
    assert _heavy_modules(["--help"]) == []


def test_plan_imports_nothing_heavy():
    assert _heavy_modules(["plan", "recipes/glm5-swe.toml", "--json"]) == []
    assert _heavy_modules(["plan", "recipes/tiny-cpu.toml", "--json"]) == []
