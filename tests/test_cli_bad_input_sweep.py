"""A user's sweep of bad input through the CLI: each case is one line naming what is wrong, exit code 2,
no traceback, nothing written. (test_bad_input.py holds the recipe and profile values.)"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlctl.cli.main import app

runner = CliRunner()


def _one_line_2(args, *expect: str) -> str:
    r = runner.invoke(app, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert all(e in lines[0] for e in expect), lines[0]
    return lines[0]


# ---- a directory whose run.json is not a manifest ------------------------------------------------
BROKEN = {"garbage": ("garbage{", "cannot read run.json"), "list": ("[1, 2]", "not a JSON object")}


@pytest.fixture(params=sorted(BROKEN))
def broken(request, tmp_path, monkeypatch):
    """(output root, run name, expected words): a run under the root whose run.json every reader used to
    take for an object (a list was an AttributeError, garbage a JSONDecodeError)."""
    root = tmp_path / "runs"
    text, words = BROKEN[request.param]
    (root / "r-1").mkdir(parents=True)
    (root / "r-1" / "run.json").write_text(text)
    (root / "ok-1").mkdir()
    (root / "ok-1" / "run.json").write_text(json.dumps({"name": "ok-1", "scheduler": "local", "attempt": 1}))
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(root))
    return root, "r-1", words


@pytest.mark.parametrize("argv", [["monitor", "{}", "--once"], ["monitor", "{}", "--json"], ["logs", "{}"],
                                  ["resume", "{}"], ["cancel", "{}"],
                                  ["launch", "tiny-cpu", "--dry-run", "--name", "{}", "--resume"]])
def test_commands_on_a_broken_manifest_are_one_line(broken, argv):
    root, name, words = broken
    before = (root / name / "run.json").read_text()
    _one_line_2([a.replace("{}", name) for a in argv], f"run {name!r}", "is not a run directory", words)
    assert sorted(p.name for p in (root / name).iterdir()) == ["run.json"]  # nothing written, nothing lost
    assert (root / name / "run.json").read_text() == before


def test_runs_lists_a_broken_manifest_beside_the_others(broken):
    root, name, words = broken
    r = runner.invoke(app, ["runs", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.output)}
    assert set(rows) == {name, "ok-1"} and rows[name]["state"] == "unknown" and words in rows[name]["reason"]
    r = runner.invoke(app, ["runs"])
    assert r.exit_code == 0 and name in r.output and "ok-1" in r.output, r.output


def test_pools_with_a_broken_manifest(broken):
    root, _, words = broken
    (root / "pools" / "p").mkdir(parents=True)
    (root / "pools" / "p" / "run.json").write_text("[1]")
    r = runner.invoke(app, ["pool", "list", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["state"] == "unknown", r.output
    assert runner.invoke(app, ["pool", "list"]).exit_code == 0
    for argv in (["pool", "show", "p"], ["pool", "stop", "p"], ["monitor", "p", "--once"]):
        _one_line_2(argv, "pool 'p'", "is not a pool directory")


# ---- options with a range ----------------------------------------------------------------------
@pytest.mark.parametrize("argv,expect", [
    (["resume", "nope", "--step", "-1"], "--step: must be >= 0"),
    (["logs", "nope", "--attempt", "-1"], "--attempt: must be >= 0"),
    (["cancel", "nope", "--timeout", "nan"], "--timeout: must be >= 0"),
    (["pool", "stop", "nope", "--timeout", "-1"], "--timeout: must be >= 0"),
])
def test_option_ranges(argv, expect, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    _one_line_2(argv, expect)


# ---- recipe and profile paths ------------------------------------------------------------------
def test_recipe_paths_say_what_is_wrong_with_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    _one_line_2(["plan", "sub"], "recipe path is a directory")
    _one_line_2(["plan", "sub/mine"], "recipe file not found: sub/mine")  # was "invalid recipe name"
    line = _one_line_2(["plan", "mine.toml"], "recipe file not found: mine.toml", "'mine' a built-in")
    assert "tiny-cpu" in line
    assert runner.invoke(app, ["plan", "tiny-cpu.toml", "--json"]).exit_code == 0  # the built-in, as before
    (tmp_path / "smoke").mkdir()  # a folder named like a built-in does not hide it
    assert runner.invoke(app, ["plan", "smoke", "--json"]).exit_code == 0
    _one_line_2(["plan", "smoke/"], "recipe path is a directory")


def test_profile_paths_and_malformed_yaml(tmp_path):
    _one_line_2(["plan", "tiny-cpu", "-c", str(tmp_path)], "cluster.profile:", "is a directory")
    bad = tmp_path / "p.yaml"
    bad.write_text("nodes: [1,\n")
    # PyYAML's first line is its context ("while parsing a flow node"); the problem and the line follow it
    _one_line_2(["plan", "tiny-cpu", "-c", str(bad)], "cluster.profile: malformed YAML", "line 2")
    bad.write_text("- a\n- b\n")
    _one_line_2(["plan", "tiny-cpu", "-c", str(bad)], "cluster.profile:", "YAML mapping", "list")


def test_a_malformed_calibration_file_names_the_option(tmp_path):
    cal = tmp_path / "c.toml"
    cal.write_text("garbage [[\n")
    _one_line_2(["plan", "tiny-cpu", "--calibration", str(cal)], "--calibration: malformed TOML")


# ---- pydantic's wording, said in the recipe's terms --------------------------------------------
@pytest.mark.parametrize("override,expect", [
    ("trainer=3", "trainer: should be a table"),            # was "instance of TrainerConfig"
    ("trainer.optimizer=[1]", "trainer.optimizer: should be a table"),
    ("model.name=", "model.name: model.name must not be empty"),  # without "Value error, "
    ("name='x y'", "name: allowed: letters, digits"),        # not the regex
])
def test_messages_in_the_recipes_terms(override, expect):
    line = _one_line_2(["plan", "tiny-cpu", "-o", override], expect)
    assert "Config" not in line and "Value error" not in line and "^[" not in line


def test_a_missing_section_is_not_said_to_be_a_table(tmp_path):
    empty = tmp_path / "r.toml"
    empty.write_text("")
    line = _one_line_2(["plan", str(empty)], "model: required")
    assert "got a table" not in line


# ---- degrees the trainer would refuse are refused before a run directory -----------------------
@pytest.mark.parametrize("recipe,override,key", [("qwen3-4b", "trainer.fsdp=7", "trainer.fsdp:"),
                                                 ("glm5-swe", "trainer.cp=2", "trainer.cp:")])
def test_launch_refuses_degrees_the_trainer_cannot_run(recipe, override, key, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    _one_line_2(["launch", recipe, "--dry-run", "-o", override], key)
    assert not any(tmp_path.iterdir())
    r = runner.invoke(app, ["plan", recipe, "-o", override, "--json"])  # plan still reports it, with its figures
    assert r.exit_code == 1 and any(e.startswith(key) for e in json.loads(r.output)["errors"]), r.output


# ---- click's own usage errors (missing argument, unparsable or unknown option, unknown command) -----
@pytest.mark.parametrize("argv,expect", [
    (["plan"], "Missing argument 'recipe' (see `rlctl plan --help`)"),
    (["resume", "x", "--step", "abc"], "Invalid value for '--step'"),
    (["plan", "tiny-cpu", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'"),
])
def test_usage_errors_are_one_line_too(argv, expect):
    assert _one_line_2(argv, expect).startswith("rlctl: error: ")


# ---- an output folder that cannot hold runs -------------------------------------------------------
@pytest.mark.parametrize("where", ["override", "environment"])
def test_an_unusable_output_folder_names_the_setting_it_came_from(tmp_path, monkeypatch, where):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    root = not_a_folder / "runs"
    args, key = ["launch", "tiny-cpu", "--dry-run"], "RLCTL_OUTPUT_DIR"
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(root))
    if where == "override":  # the recipe's key wins over the environment
        args, key = [*args, "-o", f"deployment.output_dir={root}"], "deployment.output_dir"
        monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path / "unused"))
    _one_line_2(args, f"{key}: cannot create a run directory in {root}", "Not a directory")
    assert not_a_folder.read_text() == "x" and not (tmp_path / "unused").exists()


# ---- code a recipe names: found at launch, before anything starts, and by the plan ----------------
@pytest.mark.parametrize("command", ["launch", "plan"])
@pytest.mark.parametrize("override,expect", [
    ("orchestrator.environment.name=nosuchenv", "orchestrator.environment.name: unknown environment 'nosuchenv'"),
    ("orchestrator.environment.name=no_such_module:Env",
     "orchestrator.environment.name: cannot import module 'no_such_module'"),
    ("orchestrator.environment.args={length=3}", "orchestrator.environment.args: bad arguments for environment"),
    ("orchestrator.reward.function=nosuchreward", "orchestrator.reward.function: unknown reward 'nosuchreward'"),
    ("orchestrator.reward.function=no_such_module:score",
     "orchestrator.reward.function: cannot import module 'no_such_module'"),
])
def test_launch_and_plan_refuse_code_references_they_cannot_find(command, override, expect, tmp_path, monkeypatch):
    """A plan that passes is one launch accepts: a CI script gating a launch on the plan hears of it there."""
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    _one_line_2([command, "tiny-cpu", *(["--dry-run"] if command == "launch" else []), "-o", override], expect)
    assert not any(tmp_path.iterdir())


def test_launch_and_plan_take_code_references_they_can_find(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    found = ["-o", "orchestrator.environment.name=rlctl.orchestrator.environments:CountAEnvironment",
             "-o", "orchestrator.reward.function=exact_match"]
    r = runner.invoke(app, ["launch", "tiny-cpu", "--dry-run", "--name", "ok", *found])
    assert r.exit_code == 0 and "nothing started" in r.output, r.output
    r = runner.invoke(app, ["plan", "tiny-cpu", "--json", *found])
    assert r.exit_code == 0 and json.loads(r.output)["fits"], r.output


@pytest.mark.parametrize("command", ["launch", "plan"])
def test_launch_and_plan_refuse_a_dataset_they_cannot_read(command, tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path / "runs"))
    missing = tmp_path / "missing.jsonl"
    _one_line_2([command, "tiny-dataset-cpu", *(["--dry-run"] if command == "launch" else []),
                 "-o", f'orchestrator.dataset.path="{missing}"'], "orchestrator.dataset.path:")
    assert not (tmp_path / "runs").exists()


def test_plan_refuses_what_the_lora_trainer_does_not_do():
    _one_line_2(["plan", "tiny-lora-cpu", "-o", "weights.transport=broadcast"],
                "weights.transport: transport='broadcast' with trainer.lora.rank > 0")


# ---- Slurm time limits ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ['"banana"', '"1:2:3:4"', '"-5"'])
def test_a_time_limit_slurm_would_refuse_is_one_line(value):
    _one_line_2(["plan", "tiny-cpu", "-o", f"deployment.time_limit={value}"],
                "deployment.time_limit: allowed: a Slurm time limit: MM, MM:SS, HH:MM:SS")


def test_a_bare_hh_mm_ss_override_is_the_time_limit_it_reads_as(tmp_path):
    r = runner.invoke(app, ["launch", "smoke", "-c", "vslurm", "--dry-run", "-o", f"deployment.output_dir={tmp_path}",
                            "-o", "deployment.time_limit=01:30:00"])  # TOML: a time of day, not a string
    assert r.exit_code == 0, r.output
    assert "#SBATCH --time=01:30:00" in next(tmp_path.glob("*/sbatch/attempt_0.sh")).read_text()


def test_a_preemption_signal_at_or_before_the_start_is_refused(tmp_path):
    """USR2 `preempt_signal_s` before a 2-minute limit came as the job started: it checkpointed and
    requeued at once, every attempt, and never trained."""
    args = ["launch", "smoke", "-c", "vslurm", "--dry-run", "-o", f"deployment.output_dir={tmp_path}",
            "-o", 'deployment.time_limit="00:02:00"']
    _one_line_2(args, "deployment.preempt_signal_s: 300 s before the orchestrator group's time limit (00:02:00)")
    assert not any(tmp_path.iterdir())
    assert runner.invoke(app, [*args, "-o", "deployment.preempt_signal_s=60"]).exit_code == 0


def test_a_group_time_limit_shorter_than_the_batch_scripts_is_refused(tmp_path):
    """Only the batch script gets the preemption USR2, before its own component's limit: a group with a
    shorter limit was killed at it without a checkpoint."""
    args = ["launch", "smoke", "-c", "vslurm", "--dry-run", "-o", f"deployment.output_dir={tmp_path}",
            "-o", 'deployment.time_limit="01:00:00"']
    short = [*args, "-o", 'deployment.trainer.time_limit="30:00"']
    _one_line_2(short, "deployment.trainer.time_limit: 30:00 is shorter than the orchestrator group's limit (01:00:00)")
    assert not any(tmp_path.iterdir())
    assert runner.invoke(app, [*args, "-o", "deployment.trainer.time_limit=UNLIMITED"]).exit_code == 0
    assert runner.invoke(app, [*short, "-o", "deployment.preempt_signal_s=0"]).exit_code == 0  # nothing to miss


def test_more_gpus_per_node_than_the_profile_has_is_refused_naming_the_key(tmp_path):
    # sbatch said "Requested node configuration is not available", naming no key, after a run directory
    _one_line_2(["launch", "smoke", "-c", "vslurm", "--dry-run", "-o", f"deployment.output_dir={tmp_path}",
                 "-o", "deployment.trainer.gpus_per_node=16"],
                "deployment.trainer.gpus_per_node: asks for 16 GPUs per node; cluster profile 'vslurm' has 8")
    assert not any(tmp_path.iterdir())


# ---- args of the environment and reward: checked at launch by the orchestrator's own checks ---------
@pytest.mark.parametrize("recipe,overrides,expect", [
    ("tiny-tools-cpu", ["orchestrator.environment.args={keyz=3}"],
     "orchestrator.environment.args: bad arguments for environment 'tool_lookup'"),
    ("tiny-tools-cpu", ["orchestrator.environment.args={keys=11}"], "orchestrator.environment.args.keys: keys must be"),
    ("tiny-cpu", ["orchestrator.environment.name=tool_lookup", "orchestrator.environment.args={length=3}"],
     "orchestrator.environment.args: bad arguments for environment 'tool_lookup'"),
    # the name switched, the recipe's args still the old environment's: the line says what the new one takes
    ("tiny-cpu", ["orchestrator.environment.name=count_a"],
     "orchestrator.environment.args: bad arguments for environment 'count_a': CountAEnvironment.__init__() got an "
     "unexpected keyword argument 'alphabets'; 'count_a' takes length, prompt_len"),
    ("tiny-cpu", ["orchestrator.environment.name=verifiers", "orchestrator.environment.args={tasket='x'}"],
     "orchestrator.environment.args: bad arguments for environment 'verifiers'"),
    ("tiny-dataset-cpu", ["orchestrator.environment.args={x=3}"],
     "orchestrator.environment.args: the dataset environment takes no args"),
    ("tiny-cpu", ["orchestrator.reward.function=code", "orchestrator.reward.args={time_limt_s=2}"],
     "orchestrator.reward.args: does not fit 'code'"),
    ("tiny-cpu", ["orchestrator.reward.function=code", 'orchestrator.reward.args={time_limit_s="2"}'],
     "orchestrator.reward.args.time_limit_s: does not fit 'code'"),
    ("tiny-cpu", ["orchestrator.reward.function=exact_match", "orchestrator.reward.args={ignore_case=1.5}"],
     "orchestrator.reward.args.ignore_case: does not fit 'exact_match'"),
])
def test_launch_refuses_args_the_orchestrator_would_refuse(recipe, overrides, expect, tmp_path, monkeypatch):
    """They failed only when the orchestrator built them, 20-40 s after every component had started."""
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    _one_line_2(["launch", recipe, "--dry-run", *(a for o in overrides for a in ("-o", o))], expect)
    assert not any(tmp_path.iterdir())


def test_launch_takes_args_that_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCTL_OUTPUT_DIR", str(tmp_path))
    r = runner.invoke(app, ["launch", "tiny-tools-cpu", "--dry-run", "--name", "ok",
                            "-o", "orchestrator.environment.args={keys=3}",
                            "-o", "orchestrator.reward.function=code",
                            "-o", "orchestrator.reward.args={time_limit_s=2, memory_mb=256}"])
    assert r.exit_code == 0 and "nothing started" in r.output, r.output
