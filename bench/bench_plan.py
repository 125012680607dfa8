"""The planner's speed: `rlctl --help` and `rlctl plan` wall time as ratios to `python -c "import typer,
rich"` (goal ≤ 1.5×, median of runs), and planning 10 recipes on a generated 1,000-node profile with
`auto` node splits (goal < 1 s in all). Prints what it measured; exit 1 when a goal is missed.

    python bench/bench_plan.py [--runs 7]
"""
import argparse
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


def wall(cmd: list[str], runs: int) -> float:
    """Median wall time of `cmd` (one unmeasured run first: the file cache, .pyc files)."""
    subprocess.run(cmd, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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
    base = wall([py, "-c", "import typer, rich"], runs)
    help_s = wall([py, "-m", "rlctl.cli.main", "--help"], runs)
    plan_s = wall([py, "-m", "rlctl.cli.main", "plan", "qwen3-4b"], runs)
    plan_json_s = wall([py, "-m", "rlctl.cli.main", "plan", "qwen3-4b", "--json"], runs)
    many_s = big_profile_plans()
    ok = True
    print(f"import typer, rich        {base * 1000:6.0f} ms")
    for label, s in (("rlctl --help", help_s), ("rlctl plan qwen3-4b", plan_s), ("rlctl plan --json", plan_json_s)):
        ratio = s / base
        ok &= ratio <= 1.5
        print(f"{label:<25} {s * 1000:6.0f} ms  {ratio:.2f}x  (goal <= 1.5x)")
    ok &= many_s < 1.0
    print(f"10 plans, 1,000 nodes     {many_s * 1000:6.0f} ms  (goal < 1000 ms)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
