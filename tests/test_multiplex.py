"""`rlctl plan … --multiplex`: several runs isolated vs sharing an HRRS-scheduled inference pool."""
import json

import pytest
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.recipes.multiplex import multiplex
from rlctl.recipes.multiplex_sim import RunTrace, isolated_wall, simulate_isolated

runner = CliRunner()

# The anti-correlated mix: four synchronous runs (max_off_policy_steps = 0) of different models and
# rollout lengths, each planned on 1 trainer + 3 inference nodes with 1024 rollouts a step. A synchronous
# run alternates: its inference nodes generate while its trainer waits, then its trainer trains while its
# inference nodes wait (trainer 17-60 s, rollouts 6-19 s a step: inference idle ~70%). One run's
# inference gap is thus exactly when another run can use those nodes — the gaps are anti-correlated
# across runs once their phases are staggered, which the shared pool's queueing does by itself.
ANTI_CORRELATED = ["tests/multiplex/sync-qwen3-4b.toml", "tests/multiplex/sync-qwen3-4b-short.toml",
                   "tests/multiplex/sync-qwen3-8b.toml", "tests/multiplex/sync-llama-8b.toml"]


def test_anti_correlated_mix_saves_a_quarter_of_the_gpu_hours():
    r = multiplex(ANTI_CORRELATED)
    iso, sh = r["isolated"], r["shared"]
    print(f"isolated {iso['gpu_hours']:.1f} GPU-h, shared {sh['gpu_hours']:.1f} GPU-h "
          f"(pool {sh['pool_nodes']} nodes), saving {r['gpu_hours_saving']:.1%}")
    assert r["gpu_hours_saving"] >= 0.25
    assert sh["pool_nodes"] < sum(run["inference_nodes"] for run in r["runs"])
    assert sh["utilization"] > iso["utilization"]
    assert all(run["slowdown"] <= 1.10 for run in sh["runs"])  # the pool chosen keeps each run's pace


def test_cli_reports_both_modes_for_four_runs_of_different_sizes():
    args = ["plan", "qwen3-4b", "qwen3-30b-a3b", "tests/multiplex/sync-qwen3-8b.toml",
            "tests/multiplex/sync-llama-8b.toml", "--multiplex", "-c", "h200-28"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert len({run["model"] for run in got["runs"]}) == 4
    for mode in ("isolated", "shared"):
        assert got[mode]["gpu_hours"] > 0 and got[mode]["makespan_s"] > 0
        assert len(got[mode]["runs"]) == 4
    human = runner.invoke(app, args)
    assert human.exit_code == 0 and "GPU-hours" in human.output and "shared pool" in human.output


def _trace(name, trainer_s, rollout_s, steps=10, off=1, t=1, i=1):
    return RunTrace(name, "m", trainer_s, rollout_s, steps, off, t, i, 1e9)


def test_isolated_loop_matches_the_planners_async_step():
    # off >= 1: the sides overlap, one step per max(T, R) after the first batch; off = 0: they alternate
    assert isolated_wall(_trace("a", 10, 4, steps=50)) == pytest.approx(4 + 50 * 10)
    assert isolated_wall(_trace("a", 4, 10, steps=50)) == pytest.approx(50 * 10 + 4)
    assert isolated_wall(_trace("a", 4, 10, steps=50, off=0)) == pytest.approx(50 * 14)


def test_isolated_runs_that_do_not_fit_together_queue():
    runs = [_trace("a", 10, 10, t=2, i=2), _trace("b", 10, 10, t=2, i=2), _trace("c", 10, 10, t=1, i=1)]
    out = simulate_isolated(runs, cluster_nodes=6, gpn=8)
    wall = isolated_wall(runs[0])
    starts = {r["name"]: r["start_s"] for r in out["runs"]}
    # first come first served, as a Slurm queue without backfill: c fits beside a but starts after b
    assert starts == {"a": 0.0, "b": pytest.approx(wall), "c": pytest.approx(wall)}
    assert out["makespan_s"] == pytest.approx(2 * wall)
    assert out["gpu_hours"] == pytest.approx((4 + 4 + 2) * 8 * wall / 3600)


@pytest.mark.parametrize("args,key", [
    (["qwen3-4b"], "--multiplex:"),
    (["qwen3-4b", "qwen3-8b-nope"], "recipe"),
    (["qwen3-4b", "qwen3-30b-a3b", "-c", "nope"], "cluster.profile:"),
    (["qwen3-4b", "qwen3-4b", "-c", "local"], "cluster.profile:"),
    (["qwen3-4b", "glm5-swe", "-c", "h200-28"], "model.name:"),
    (["qwen3-4b", "qwen3-30b-a3b", "-c", "h200-28", "-o", "inference.disaggregation.enabled=true"],
     "inference.disaggregation"),
])
def test_bad_input_is_one_line_exit_2(args, key):
    r = runner.invoke(app, ["plan", *args, "--multiplex"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in r.output


def test_single_recipe_plan_does_not_load_the_simulation():
    import subprocess
    import sys

    code = ("import sys; from rlctl.cli.main import app; sys.argv=['rlctl','plan','qwen3-4b','--json'];\n"
            "try: app()\nexcept SystemExit: pass\n"
            "print([m for m in sys.modules if 'multiplex' in m or 'pool_scheduler' in m], file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr
