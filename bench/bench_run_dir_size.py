"""Run-directory size over a long run: retention must keep it flat, whatever the number of steps.

Runs the smoke recipe on the local launcher for 1,000 steps: its trainer publishes real weights every
step through the weight store (1 MiB each) with the run's retention (`weights.keep_last`), writes a
checkpoint every 10 steps (`checkpoint.keep_last` pruning), and its orchestrator plays the weight
watcher. The run directory is sampled every 10 ms; printed are its size when the trainer has recorded
100, 500 and 1,000 steps and its peak in each window (0-100, 100-500, 500-1,000 steps). A single
sample swings by one weights step (a step being published sits beside the kept ones), so the flatness
check compares the window peaks: each must stay within `--max-ratio` of the first (exit 1 otherwise).
Without retention the weights alone would grow by one step's size per step.

    python bench/bench_run_dir_size.py [--steps 1000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "smoke.toml"


def tree_bytes(root: Path) -> int:
    """Bytes of every regular file under `root` (files vanishing meanwhile are skipped)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def trainer_steps(run: Path) -> int:
    try:
        return (run / "metrics" / "trainer.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-s", type=float, default=0.005, help="seconds per smoke training step")
    parser.add_argument("--max-ratio", type=float, default=1.25, help="fail when a window's peak exceeds the first's by this ratio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    marks = sorted({m for m in (100, args.steps // 2, args.steps) if m <= args.steps})
    out_dir = Path(tempfile.mkdtemp(prefix="bench-run-dir-"))
    run = out_dir / "size"
    cmd = [sys.executable, "-m", "rlctl.cli.main", "launch", str(SMOKE), "--cluster", "local", "--name", "size",
           "--wait", "-o", f"deployment.output_dir={out_dir}", "-o", "deployment.trainer_nodes=1",
           "-o", "trainer.fsdp=2", "-o", f"deployment.smoke.steps={args.steps}",
           "-o", f"deployment.smoke.step_s={args.step_s}", "-o", "checkpoint.interval=10"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sizes: dict[int, int] = {}
    window_peaks = {mark: 0 for mark in marks}
    while proc.poll() is None:
        size = tree_bytes(run) if run.exists() else 0
        done = trainer_steps(run) if run.exists() else 0
        window = next((m for m in marks if done <= m), marks[-1])
        window_peaks[window] = max(window_peaks[window], size)
        for mark in marks:
            if mark not in sizes and done >= mark:
                sizes[mark] = size
        time.sleep(0.01)
    log = proc.communicate()[0]
    took = time.monotonic() - t0
    if proc.returncode != 0:
        print(log, file=sys.stderr)
        print(f"the smoke run failed (exit {proc.returncode}); run dir {run}", file=sys.stderr)
        return 1
    final = tree_bytes(run)
    for mark in marks:
        sizes.setdefault(mark, final)  # the last steps can finish between two samples
    weights_step = tree_bytes(run / "weights") // max(1, len(list((run / "weights").glob("step_*"))))
    report = {
        "steps": args.steps, "wall_s": round(took, 1), "size_bytes_at_step": sizes,
        "ratio_to_step_100": {m: round(sizes[m] / sizes[marks[0]], 3) for m in marks},
        "window_peak_bytes": window_peaks,
        "window_peak_ratio": {m: round(window_peaks[m] / window_peaks[marks[0]], 3) for m in marks},
        "weights_step_bytes": weights_step,
        "without_retention_weights_bytes": weights_step * (args.steps + 1),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for m in marks:
            print(f"step {m:>5}: run dir {sizes[m] / 2**20:6.2f} MiB (ratio to step {marks[0]}: "
                  f"{report['ratio_to_step_100'][m]:.3f}); peak up to here {window_peaks[m] / 2**20:6.2f} MiB "
                  f"(ratio {report['window_peak_ratio'][m]:.3f})")
        print(f"one weights step {weights_step / 2**20:.2f} MiB; without retention the weights alone would take "
              f"{report['without_retention_weights_bytes'] / 2**20:.0f} MiB; {took:.0f} s wall")
    ok = max(report["window_peak_ratio"].values()) <= args.max_ratio
    subprocess.run(["rm", "-rf", str(out_dir)], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
