"""The planner's speed: `rlctl --help` and `rlctl plan` wall time as ratios to `python -c "import typer,
rich"` (goal ≤ 1.5×, median of rounds), and planning 10 recipes on a generated 1,000-node profile with
`auto` node splits (goal < 1 s in all). Prints what it measured; exit 1 when a goal is missed. For
reference it also prints the ratios of importing pydantic's BaseModel (validating a recipe needs it)
and of a typer command that does nothing: the floor under `rlctl plan`.

    python bench/bench_plan.py [--runs 7]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

RECIPES = [
    ("glm5-swe", ['deployment.trainer_nodes="auto"', 'deployment.inference_nodes="auto"',
                  "inference.disaggregation.enabled=false"]),
    ("qwen3-30b-a3b", ["deployment.total_nodes=1000"]),
    ("qwen3-4b", ['deployment.trainer_nodes="auto"', 'deployment.inference_nodes="auto"']),
]


# Measured as installed: an installed package has its .pyc files, so the unmeasured first run may write
# them even where PYTHONDONTWRITEBYTECODE is set (else every run compiles ~60 modules: +40 ms).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

# The least any typer command with an argument costs (typer ≥ 0.29 coerces every parameter with a
# pydantic TypeAdapter, so it imports pydantic and looks up its plugins): the floor of `rlctl plan`.
TYPER_FLOOR = """
import sys, typer
app = typer.Typer(rich_markup_mode=None, pretty_exceptions_enable=False)
@app.command()
def plan(recipe: str) -> None:
    pass
sys.argv = ["plan", "x"]
app()
"""


def _once(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True, env=ENV)
    return time.perf_counter() - t


def ratios(base: list[str], cmds: dict[str, list[str]], runs: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """Median wall time of `base`, and per command (median wall time, median ratio to `base`). Each
    round runs the base and every command back to back, and a ratio is taken within a round, so
    that a shared machine's load, which changes between rounds, cancels out. One unmeasured round
    first: the file cache, .pyc files."""
    for cmd in [base, *cmds.values()]:
        _once(cmd)
    base_s, times = [], {label: [] for label in cmds}
    for _ in range(runs):
        base_s.append(_once(base))
        for label, cmd in cmds.items():
            times[label].append(_once(cmd))
    return statistics.median(base_s), {
        label: (statistics.median(ts), statistics.median(t / b for t, b in zip(ts, base_s)))
        for label, ts in times.items()}


def big_profile_plans() -> float:
    from rlctl.recipes.clusters import ClusterProfile
    from rlctl.recipes.load import load_recipe
    from rlctl.recipes.plan import plan

    profile = ClusterProfile(name="generated-1000", nodes=1000, gpus_per_node=8, gpu="h200")
    recipes = []
    for i in range(10):
        name, overrides = RECIPES[i % len(RECIPES)]
        recipes.append(load_recipe([name], overrides + [f"orchestrator.rollouts_per_step={256 * (1 + i)}"]))
    t = time.perf_counter()
    for rec in recipes:
        plan(rec, profile)
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    py = sys.executable
    rlctl = [py, "-m", "rlctl.cli.main"]
    base, measured = ratios([py, "-c", "import typer, rich"], {
        "+ from pydantic import BaseModel": [py, "-c", "import typer, rich; from pydantic import BaseModel"],
        "a typer command, no-op": [py, "-c", TYPER_FLOOR],
        "rlctl --help": rlctl + ["--help"],
        "rlctl plan qwen3-4b": rlctl + ["plan", "qwen3-4b"],
        "rlctl plan --json": rlctl + ["plan", "qwen3-4b", "--json"],
    }, runs)
    many_s = big_profile_plans()
    ok = True
    print(f"{'import typer, rich':<33} {base * 1000:6.0f} ms")
    for label, (s, ratio) in measured.items():
        goal = label.startswith("rlctl")
        ok &= not goal or ratio <= 1.5
        print(f"{label:<33} {s * 1000:6.0f} ms  {ratio:.2f}x  " + ("(goal <= 1.5x)" if goal else "(reference)"))
    ok &= many_s < 1.0
    print(f"{'10 plans, 1,000 nodes':<33} {many_s * 1000:6.0f} ms  (goal < 1000 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
