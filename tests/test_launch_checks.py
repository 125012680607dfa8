"""What launch settles for the components before they start in the run directory."""
from __future__ import annotations

import os

from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.launchers.env import absolute_pythonpath

runner = CliRunner()


def test_relative_pythonpath_entries_are_made_absolute_against_the_launch_directory():
    """Components run with the run dir as their current directory: `mods` meant the launch's."""
    assert absolute_pythonpath({"PYTHONPATH": os.pathsep.join(["mods", "", "/abs/lib", "../x"])}, "/home/u/proj") == {
        "PYTHONPATH": os.pathsep.join(["/home/u/proj/mods", "/home/u/proj", "/abs/lib", "/home/u/x"])}
    assert absolute_pythonpath({"PYTHONPATH": "/abs/lib"}, "/home/u") == {}  # nothing to change: nothing passed
    assert absolute_pythonpath({}, "/home/u") == {}


def test_the_batch_script_exports_the_absolute_pythonpath(tmp_path, monkeypatch):
    """It chdirs to the run dir, where `mods` is not the folder the user meant."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "mods")
    runs = tmp_path / "runs"
    r = runner.invoke(app, ["launch", "smoke", "-c", "vslurm", "--dry-run", "-o", f"deployment.output_dir={runs}"])
    assert r.exit_code == 0, r.output
    script = next(runs.glob("*/sbatch/attempt_0.sh")).read_text()
    assert f"export PYTHONPATH={tmp_path / 'mods'}\n" in script, script
