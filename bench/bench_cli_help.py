"""Cost of `rlctl --help` relative to `python -c "import typer, rich"` (goal: ≤ 1.5×), median of runs."""
import statistics
import subprocess
import sys
import time


def _median(cmd, runs=7):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    base = _median([sys.executable, "-c", "import typer, rich"])
    cli = _median([sys.executable, "-m", "rlctl.cli.main", "--help"])
    ratio = cli / base
    print(f"import typer, rich: {base * 1000:.0f} ms   rlctl --help: {cli * 1000:.0f} ms   ratio: {ratio:.2f}x (goal <= 1.5x)")
    return 0 if ratio <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
