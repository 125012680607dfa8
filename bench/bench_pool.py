"""Two LoRA runs sharing one inference pool vs the same two runs one after the other, each with its own server.

    python bench/bench_pool.py [--steps 80] [--recipe recipes/tiny-lora-cpu.toml] [--out DIR] [--plain]

isolated: each run on a pool of its own (`rlctl pool launch`, one run attached, the pool stopped after
          it), one after the other; wall = the sum of both, pool start-ups included. A pool of one
          run measures the server's idle time the same way as the shared pool does; `--plain` runs the
          two isolated runs as plain `rlctl launch RECIPE --wait` instead (their own servers, no
          front: wall only, idle then from the orchestrator's `wait_policy_s`, a different measure).
pooled:   `rlctl pool launch RECIPE -o inference.max_loras=2`, then both runs at once with
          `-o deployment.inference_pool=NAME --wait`; wall = from the pool's launch until both ended.
Same resources: one vLLM server at a time either way, the same machine. Prints both walls and their
ratio, each run's final reward (mean of its last 5 steps) and the idle fractions: time with no request
in flight and no reload, since the first attach.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RLCTL = [sys.executable, "-m", "rlctl.cli.main"]


def rlctl(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([*RLCTL, *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"rlctl {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def orchestrator_records(run: Path) -> list[dict]:
    path = run / "metrics" / "orchestrator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_reward(run: Path) -> float:
    rewards = [r["reward_mean"] for r in orchestrator_records(run)]
    return sum(rewards[-5:]) / len(rewards[-5:])


def inference_idle(run: Path) -> float:
    recs = orchestrator_records(run)
    return sum(r["wait_policy_s"] for r in recs) / sum(r["orchestrator_step_time_s"] for r in recs)


def launch(root: Path, recipe: str, name: str, steps: int, *extra: str) -> list[str]:
    args = [*RLCTL, "launch", recipe, "--name", name, "-o", f"deployment.output_dir={root}",
            "-o", f"orchestrator.max_steps={steps}", *extra, "--wait"]
    return args


def isolated_plain(root: Path, recipe: str, steps: int) -> tuple[float, list[float]]:
    t0 = time.monotonic()
    for name in ("iso-a", "iso-b"):
        out = subprocess.run(launch(root, recipe, name, steps), capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"isolated run {name} failed:\n{out.stdout}\n{out.stderr}")
    return time.monotonic() - t0, [inference_idle(root / n) for n in ("iso-a", "iso-b")]


def on_pool(root: Path, recipe: str, steps: int, pool: str, runs: tuple[str, ...]) -> tuple[float, dict]:
    """`runs` at once on a new pool `pool`: (wall from the pool's launch, the pool's final stats)."""
    t0 = time.monotonic()
    rlctl("pool", "launch", recipe, "--name", pool, "-o", f"deployment.output_dir={root}",
          "-o", f"inference.max_loras={len(runs)}")
    try:
        while not json.loads(rlctl("pool", "show", pool, "--root", str(root), "--json").stdout)["url"]:
            time.sleep(1)
        procs = [subprocess.Popen(launch(root, recipe, name, steps, "-o", f"deployment.inference_pool={pool}"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for name in runs]
        for proc in procs:
            out = proc.communicate()[0]
            if proc.returncode != 0:
                raise SystemExit(f"run on pool {pool} failed:\n{out}")
        took = time.monotonic() - t0
        stats = json.loads(rlctl("pool", "show", pool, "--root", str(root), "--json").stdout)["stats"]
    finally:
        rlctl("pool", "stop", pool, "--root", str(root), check=False)
    return took, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-lora-cpu.toml"))
    parser.add_argument("--out", default=None, help="Output root (default: a temporary directory).")
    parser.add_argument("--plain", action="store_true", help="Isolated runs without a pool (see above).")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_pool_")).absolute()
    if args.plain:
        iso_s, iso_idle = isolated_plain(root, args.recipe, args.steps)
        iso_names, idle_kind = ("iso-a", "iso-b"), "inference idle (wait_policy_s / step)"
    else:
        walls = [on_pool(root, args.recipe, args.steps, f"own-{n}", (n,)) for n in ("iso-a", "iso-b")]
        iso_s, iso_idle = sum(w for w, _ in walls), [stats["idle_fraction"] for _, stats in walls]
        iso_names, idle_kind = ("iso-a", "iso-b"), "server idle"
    pool_s, stats = on_pool(root, args.recipe, args.steps, "shared", ("pool-a", "pool-b"))
    print(f"{args.steps} steps per run, output root {root}")
    print(f"isolated, one after the other: {iso_s:7.1f} s   final rewards "
          f"{final_reward(root / iso_names[0]):.3f} {final_reward(root / iso_names[1]):.3f}   {idle_kind} "
          f"{iso_idle[0]:.0%} {iso_idle[1]:.0%}")
    print(f"pooled, both at once:          {pool_s:7.1f} s   final rewards "
          f"{final_reward(root / 'pool-a'):.3f} {final_reward(root / 'pool-b'):.3f}   server idle "
          f"{stats['idle_fraction']:.0%}   residency switches {stats['switches']}")
    print(f"pooled / isolated wall: {pool_s / iso_s:.2f}x")


if __name__ == "__main__":
    main()
