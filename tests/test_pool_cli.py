"""`rlctl pool` and `deployment.inference_pool` on bad input: one line naming the key, exit 2, nothing
started; and what a run may attach to (launchers/attach.check_attachable) against a pool's announcement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.launchers import attach
from rlctl.orchestrator.exchange.layout import RunDir
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import compose, validate

RLCTL = [sys.executable, "-m", "rlctl.cli.main"]
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def rlctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*RLCTL, *args], capture_output=True, text=True, timeout=120)


def one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_attaching_to_a_pool_that_is_not_there(tmp_path):
    out = rlctl("launch", str(RECIPES / "tiny-cpu.toml"), "-o", f"deployment.output_dir={tmp_path}",
                "-o", "deployment.inference_pool=nope", "--dry-run")
    one_line_error(out, "deployment.inference_pool", "no pool 'nope'")
    assert not any(tmp_path.iterdir()), "nothing is created for a refused launch"


def test_pool_names_and_commands_on_bad_input(tmp_path):
    one_line_error(rlctl("launch", str(RECIPES / "tiny-cpu.toml"), "-o", "deployment.inference_pool=../x",
                         "--dry-run"), "deployment.inference_pool")
    one_line_error(rlctl("pool", "show", "nope", "--root", str(tmp_path)), "no pool 'nope'")
    one_line_error(rlctl("pool", "stop", "nope", "--root", str(tmp_path)), "no pool 'nope'")
    one_line_error(rlctl("pool", "launch", str(RECIPES / "tiny-cpu.toml"), "--name", "bad/name",
                         "-o", f"deployment.output_dir={tmp_path}"), "--name")
    one_line_error(rlctl("pool", "launch", str(RECIPES / "tiny-cpu.toml"), "--name", "",  # not the recipe's name
                         "-o", f"deployment.output_dir={tmp_path}"), "--name", "invalid run name ''")
    listed = rlctl("pool", "list", "--root", str(tmp_path), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    assert not (tmp_path / "pools").exists() or not any((tmp_path / "pools").iterdir())


def test_run_commands_given_a_pool_say_so(tmp_path):
    """`cancel`, `logs` and `resume` of a pool's name said only "no run.json"; `resume` of its directory
    advised `rlctl launch RECIPE --name NAME --resume`, which starts a run, not the pool."""
    pool = tmp_path / "pools" / "lp"
    pool.mkdir(parents=True)
    (pool / "run.json").write_text(json.dumps({"name": "lp", "run_dir": str(pool), "scheduler": "local",
                                               "job_id": None, "attempt": 0, "groups": [], "recipe": {}}))
    for command in ("cancel", "logs", "resume"):
        one_line_error(subprocess.run([*RLCTL, command, "lp"], capture_output=True, text=True, timeout=120,
                                      env={**os.environ, "RLCTL_OUTPUT_DIR": str(tmp_path)}),
                       "'lp' is a shared pool", "rlctl pool stop lp")
    one_line_error(rlctl("resume", str(pool)), "is a shared pool, not a run", "rlctl pool launch RECIPE --name lp")
    assert sorted(p.name for p in pool.iterdir()) == ["run.json"]


def test_a_refused_submission_leaves_no_pool_behind(tmp_path, monkeypatch):
    """sbatch refusing the pool's job (no controller, bad partition) frees the name: no folder is left."""
    from typer.testing import CliRunner

    from rlctl.cli.main import app
    from rlctl.launchers import launch

    def refused(*_args, **_kwargs):
        raise RecipeError("sbatch refused the job: Unable to contact slurm controller")

    monkeypatch.setattr(launch, "_submit", refused)
    monkeypatch.setattr(launch, "check_submitter", lambda *_a, **_k: None)  # sbatch need not be installed
    args = ["pool", "launch", str(RECIPES / "tiny-cpu.toml"), "-c", "vslurm", "--name", "vs",
            "-o", f"deployment.output_dir={tmp_path}"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 2 and "sbatch refused the job" in out.output, out.output
    assert not any((tmp_path / "pools").iterdir()), list((tmp_path / "pools").iterdir())


@pytest.fixture
def running_pool(tmp_path, monkeypatch):
    """A pool directory whose front announced itself, taken as running."""
    pool = RunDir(tmp_path / "pools" / "p")
    pool.create()
    pool.manifest.write_text(json.dumps({"recipe": {"model": {"name": "tiny-qwen3"}}, "plan": {"inference_servers": 1}}))
    announcement = {"url": "http://127.0.0.1:1", "mode": "full", "model": "tiny-qwen3", "build_seed": 0,
                    "lora_rank": 0, "max_model_len": 64}
    pool.announce("pool", "0", announcement)
    from rlctl.launchers import status

    monkeypatch.setattr(status, "run_state", lambda _root, _manifest=None: type("S", (), {"state": "running", "scheduler": "local", "job_id": None})())
    return tmp_path, pool, announcement


def recipe(*overrides: str):
    return validate(compose([str(RECIPES / "tiny-cpu.toml")], ["deployment.inference_pool=p", *overrides]))


def test_what_may_attach(running_pool):
    root, pool, announcement = running_pool
    attach.check_attachable(recipe(), root)  # the same model, full weights, fits
    refusals = {
        "model.name": recipe("model.name=tiny-qwen3-lora"),
        "model.build_seed": recipe("model.build_seed=1"),  # the same model, other weights
        "trainer.lora.rank": recipe("trainer.lora.rank=8"),
        "inference.max_model_len": recipe("inference.max_model_len=128"),
        "weights.transport": recipe("weights.transport=broadcast"),
    }
    for key, bad in refusals.items():
        with pytest.raises(RecipeError) as err:
            attach.check_attachable(bad, root)
        assert err.value.key == key, (key, str(err.value))
    pool.announce("pool", "0", {**announcement, "mode": "lora", "lora_rank": 8})
    attach.check_attachable(recipe("trainer.lora.rank=8"), root)
    with pytest.raises(RecipeError) as err:
        attach.check_attachable(recipe("trainer.lora.rank=16"), root)
    assert err.value.key == "trainer.lora.rank" and "up to rank 8" in str(err.value)


def test_monitor_shows_a_pool_by_name_or_directory(running_pool, cli):
    root, pool, announcement = running_pool
    stats = {"mode": "full", "servers": 1, "uptime_s": 90.0, "busy_s": 81.0, "idle_fraction": 0.1, "switches": 7,
             "switch_s": 2.5, "inflight": 3, "holders": ["left"],
             "runs": {"left": {"run_dir": "x", "requests": 40, "queued": 2, "service_s": 30.0, "wait_s": 4.0,
                               "adapter": "policy", "weights": "/r/left/weights/step_3", "share": 0.75},
                      "right": {"run_dir": "y", "requests": 12, "queued": 0, "service_s": 10.0, "wait_s": 9.5,
                                "adapter": "policy", "weights": None, "share": 0.25}}}
    pool.announce("pool", "0", {**announcement, "stats": stats})
    shown = cli("monitor", "p", "--root", root, "--once")
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "pool p running full runs of tiny-qwen3 on 1 server(s)" in text and "idle 10%" in text, text
    assert "residency switches 7" in text and "servers hold: 0=left" in text, text
    assert "left 75% 40 2 4.0 s step_3" in text and "right 25% 12 0 9.5 s base model" in text, text
    as_json = cli("monitor", pool.root, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.output)["stats"]["runs"]["left"]["share"] == 0.75
    refused = cli("monitor", "p", "--root", root, "--wait")
    assert refused.exit_code == 2 and "--wait follows a run" in refused.output, refused.output
    missing = cli("monitor", "nope", "--root", root, "--once")
    assert missing.exit_code == 2 and "nor is it a pool" in missing.output, missing.output


def test_pool_view_says_once_that_no_run_attached_yet():
    from rich.console import Console

    from rlctl.cli.pool_view import render_pool

    def shown(stats: dict) -> str:
        console = Console(record=True, width=100, color_system=None)
        console.print(render_pool({"name": "p", "state": "running", "mode": "full", "model": "m", "servers": 1,
                                   "url": None, "stats": stats}))
        return console.export_text()

    before = shown({"idle_fraction": None, "runs": {}})
    assert before.count("no run attached") == 1 and "no run attached yet" in before
    after = shown({"idle_fraction": 0.5, "uptime_s": 10.0, "inflight": 0, "switches": 0, "switch_s": 0.0, "runs": {}})
    assert "no run attached now" in after and "yet" not in after
