"""Start-up timeline of the tiny CPU recipe: when each part of a local run becomes ready.

    python bench/bench_startup.py [--steps 4] [--recipe recipes/tiny-cpu.toml] [-o key=value ...]

Runs `rlctl launch RECIPE --wait` with a few steps and watches the run directory every 20 ms from
outside (nothing in the run is instrumented for this): the inference server's announcement (healthy
and warmed up), the trainer's first published weights (model built and sharded), the first rollout
batch, and the trainer's first step record (its start = record time − step − publish seconds).

Goal (issue: start-up): the first trainer step starts ≤ 3 s after the inference server is ready.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 3.0


class Watcher(threading.Thread):
    """Records the first time each path (relative to the single run dir under `root`) exists."""

    EVENTS = {
        "server ready (announced)": "services/inference/0.json",
        "weights/step_0 published": "weights/step_0/COMPLETE",
        "rollouts/step_0 complete": "rollouts/step_0/COMPLETE",
    }

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.seen, self.announcement, self.stop = root, {}, None, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for run in self.root.iterdir() if self.root.exists() else ():
                for name, rel in self.EVENTS.items():
                    path = run / rel
                    if name not in self.seen and path.exists():
                        self.seen[name] = time.time()
                        if rel.startswith("services/"):
                            try:
                                self.announcement = json.loads(path.read_text())
                            except (OSError, ValueError):
                                self.seen.pop(name)  # written but not yet whole: look again
            time.sleep(0.02)


def first_trainer_step(root: Path) -> dict | None:
    for path in root.glob("*/metrics/trainer*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("step") == 0 and "trainer_step_time_s" in rec:
                return rec
    return None


def launch_and_watch(root: Path, args) -> tuple[Watcher, dict | None, int]:
    watcher = Watcher(root)
    watcher.start()
    steps = [f"orchestrator.max_steps={args.steps}"] if args.steps else []  # None: the recipe's own
    overrides = [*steps, f"deployment.output_dir={root}", *args.override]
    cmd = [sys.executable, "-m", "rlctl.cli.main", "launch", args.recipe, "--wait"]
    for o in overrides:
        cmd += ["-o", o]
    watcher.launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    watcher.stop.set()
    watcher.join()
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    return watcher, first_trainer_step(root), proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-cpu.toml"))
    parser.add_argument("-o", "--override", action="append", default=[])
    parser.add_argument("--keep", action="store_true", help="keep the run directory (its path is printed)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="rlctl-startup-")
    try:
        watcher, record, rc = launch_and_watch(Path(tmp) / "runs", args)
    finally:
        if args.keep:
            print(f"run directory kept under {tmp}/runs")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if rc != 0:
        return rc
    events = dict(watcher.seen)
    if record is not None:
        took = record["trainer_step_time_s"] + record.get("weight_publish_s", 0.0)
        events["first trainer step starts"] = record["time"] - took
    print(f"{'event':32} {'s after launch':>15}")
    for name, t in sorted(events.items(), key=lambda kv: kv[1]):
        print(f"{name:32} {t - watcher.launched:15.2f}")
    ann = watcher.announcement or {}
    print(f"server: healthy after {ann.get('healthy_s')} s, warm-up request {ann.get('warm_up_s')} s, "
          f"announced after {ann.get('startup_s')} s of its own start")
    ready, first = events.get("server ready (announced)"), events.get("first trainer step starts")
    if ready is None or first is None:
        print("timeline incomplete: server announcement or first trainer step not seen")
        return 1
    gap = first - ready
    print(f"first trainer step starts {gap:.2f} s after the server is ready (goal ≤ {GOAL_S:.0f} s): "
          f"{'ok' if gap <= GOAL_S else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
