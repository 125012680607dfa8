"""`rlctl recipes` and `rlctl plan` through the real CLI."""
import json
import subprocess
import sys

from typer.testing import CliRunner

from rlctl.cli.main import app

runner = CliRunner()


def test_list_show_schema():
    r = runner.invoke(app, ["recipes", "list"])
    assert r.exit_code == 0 and "glm5-swe" in r.output and "tiny-cpu" in r.output
    r = runner.invoke(app, ["recipes", "show", "glm5-swe"])
    assert r.exit_code == 0 and 'name = "glm-5"' in r.output
    r = runner.invoke(app, ["recipes", "show", "--schema"])
    assert r.exit_code == 0
    assert "trainer.cp: " in r.output and "Context-parallel degree" in r.output
    assert "orchestrator.max_off_policy_steps: int[>= 0, <= 65536] = 1" in r.output
    # optional tables (`DatasetConfig | None`) are listed with their keys, not as one opaque line
    assert "[orchestrator.dataset]  (optional, default None) " in r.output
    assert "orchestrator.dataset.prompt_column: str | None = 'prompt'  # " in r.output
    assert "[orchestrator.eval]  (optional, default None) " in r.output and "orchestrator.eval.interval: " in r.output


def test_clone_refuses_overwrite(tmp_path):
    dest = tmp_path / "my.toml"
    assert runner.invoke(app, ["recipes", "clone", "tiny-cpu", str(dest)]).exit_code == 0
    r = runner.invoke(app, ["recipes", "clone", "tiny-cpu", str(dest)])
    assert r.exit_code == 2 and "--force" in r.output
    assert runner.invoke(app, ["recipes", "clone", "qwen3-4b", str(dest), "--force"]).exit_code == 0
    assert "qwen3-4b" in dest.read_text()


def test_clone_rejects_path_names(tmp_path):
    r = runner.invoke(app, ["recipes", "clone", "../etc/passwd", str(tmp_path / "x.toml")])
    assert r.exit_code == 2 and "path separators" in r.output


def test_plan_tiny_cpu_subprocess():
    out = subprocess.run([sys.executable, "-m", "rlctl.cli.main", "plan", "recipes/tiny-cpu.toml", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert j["fits"] and j["placement"]["trainer_ranks_per_node"] == 2


def test_plan_composes_and_overrides():
    r = runner.invoke(app, ["plan", "glm5-swe", "-o", "trainer.cp=4", "--json"])
    assert r.exit_code == 1, r.output  # planned in full, but cp does not run with sparse attention
    assert json.loads(r.output)["trainer"]["cp"] == 4
    r = runner.invoke(app, ["plan", "glm5-swe"])
    assert r.exit_code == 0 and "bottleneck" in r.output
