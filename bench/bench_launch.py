"""Launch latency on the virtual Slurm cluster: `rlctl launch` vs a bare `sbatch` of an equivalent het script.

For each repetition it measures
  * return time: how long the submitting command takes to return (rlctl launch without --wait; sbatch),
  * submit → all groups running: until squeue shows every het component RUNNING,
  * submit → all tasks started: until every task of every group has written its marker file.
Jobs are cancelled afterwards. Needs the cluster: `tests/slurm/cluster.sh` (as root).

    python bench/bench_launch.py [--reps 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlctl.launchers.slurm_state import component_states

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "recipes" / "smoke.toml"
TASKS = 19  # smoke on vslurm: 1 orchestrator + 2 inference servers + 2 x 8 trainer ranks

BARE = """#!/bin/bash
#SBATCH --job-name=bare-het --output={out}/slurm-%j.out
#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=4 --partition=cpu --time=00:10:00
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=8 --partition=gpu --gpus-per-node=8 --time=00:10:00
#SBATCH hetjob
#SBATCH --nodes=2 --ntasks-per-node=8 --cpus-per-task=2 --partition=gpu --gpus-per-node=8 --time=00:10:00
for k in 0 1 2; do
  srun --het-group=$k {python} -c "import os,time; open('{out}/marks/%s.%s' % ($k, os.environ['SLURM_PROCID']), 'w'); time.sleep(600)" &
done
wait
"""


def _wait(cond, timeout: float = 300.0, poll: float = 0.05) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(poll)
    return time.monotonic()


def _all_running(job: str) -> bool:
    states = component_states(job)
    return len(states) == 3 and all(s["state"] == "RUNNING" for s in states.values())


def bench_rlctl(tmp: Path) -> dict:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rlctl.cli.main", "launch", str(SMOKE), "--cluster", "vslurm",
                          "-o", f"deployment.output_dir={tmp}", "-o", "deployment.smoke.run_s=600", "--json"],
                         capture_output=True, text=True, check=True)
    returned = time.monotonic()
    info = json.loads(out.stdout)
    run, job = Path(info["run_dir"]), info["job_id"]
    try:
        running = _wait(lambda: _all_running(job))
        started = _wait(lambda: len(list((run / "smoke").glob("*.json"))) >= TASKS)
    finally:
        subprocess.run(["scancel", job], check=False)
    return {"return_s": returned - t0, "all_running_s": running - t0, "all_tasks_started_s": started - t0}


def bench_bare(tmp: Path) -> dict:
    (tmp / "marks").mkdir(parents=True)
    script = tmp / "bare.sh"
    script.write_text(BARE.format(out=tmp, python=sys.executable))
    t0 = time.monotonic()
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
    returned = time.monotonic()
    job = out.stdout.strip().split(";")[0]
    try:
        running = _wait(lambda: _all_running(job))
        started = _wait(lambda: len(list((tmp / "marks").iterdir())) >= TASKS)
    finally:
        subprocess.run(["scancel", job], check=False)
    return {"return_s": returned - t0, "all_running_s": running - t0, "all_tasks_started_s": started - t0}


def _idle() -> None:
    """Wait until no job of ours holds nodes, so each repetition starts from an idle cluster."""
    _wait(lambda: not subprocess.run(["squeue", "-h", "-n", "bare-het", "-o", "%i"], capture_output=True,
                                     text=True).stdout.strip()
          and "rlctl-smoke" not in subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True,
                                                  text=True).stdout, timeout=120, poll=0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        sys.exit("no Slurm cluster answers; start it with tests/slurm/cluster.sh (as root)")
    results: dict[str, list[dict]] = {"rlctl launch": [], "bare sbatch": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        for i in range(args.reps):
            for name, fn in (("rlctl launch", bench_rlctl), ("bare sbatch", bench_bare)):
                _idle()
                results[name].append(fn(Path(tmp) / f"{name.split()[0]}-{i}"))
    summary = {name: {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
               for name, rows in results.items()}
    report = {"reps": args.reps, "median": summary, "runs": results, "load_avg_1m": os.getloadavg()[0],
              "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"median over {args.reps} runs (load average {report['load_avg_1m']:.1f} on {report['cpus']} CPUs)")
        print(f"{'':14}{'return':>10}{'all groups RUNNING':>22}{'all tasks started':>20}")
        for name, s in summary.items():
            print(f"{name:14}{s['return_s']:>9.2f}s{s['all_running_s']:>21.2f}s{s['all_tasks_started_s']:>19.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
