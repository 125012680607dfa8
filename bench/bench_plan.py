"""Planning time: 10 recipes on a 1,000-node profile with `auto` node splits (goal: < 1 s in all)."""
import sys
import time

from rlctl.recipes.clusters import ClusterProfile
from rlctl.recipes.load import load_recipe
from rlctl.recipes.plan import plan

RECIPES = [
    ("glm5-swe", ["deployment.trainer_nodes=\"auto\"", "deployment.inference_nodes=\"auto\"",
                  "inference.disaggregation.enabled=false"]),
    ("qwen3-30b-a3b", ["deployment.total_nodes=1000"]),
    ("qwen3-4b", ["deployment.trainer_nodes=\"auto\"", "deployment.inference_nodes=\"auto\""]),
]


def main():
    profile = ClusterProfile(name="big", nodes=1000, gpus_per_node=8, gpu="h200")
    recipes = []
    for i in range(10):
        name, ov = RECIPES[i % len(RECIPES)]
        recipes.append(load_recipe([name], ov + [f"orchestrator.rollouts_per_step={256 * (1 + i)}"]))
    t = time.perf_counter()
    for rec in recipes:
        plan(rec, profile)
    dt = time.perf_counter() - t
    print(f"planned 10 recipes on a 1,000-node profile in {dt:.3f} s (goal < 1 s)")
    return 0 if dt < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
