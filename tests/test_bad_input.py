"""Bad input: one line naming the key, exit code 2, no traceback; and no uncaught exception ever."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rlctl.cli.main import app
from rlctl.recipes.clusters import ClusterProfile
from rlctl.recipes.errors import RecipeError
from rlctl.recipes.load import load_recipe, validate
from rlctl.recipes.plan import plan

runner = CliRunner()

CASES = [
    (["-o", 'trainer.cp="x"'], "trainer.cp:"),
    (["-o", "trainer.bogus=1"], "trainer.bogus: unknown key"),
    (["-o", "trainer.ep=3"], "trainer.ep:"),
    (["-o", "trainer.cp=5"], "trainer.cp:"),
    (["-o", "inference.tp=16"], "inference.tp:"),
    (["-o", "trainer.tp=3"], "trainer.tp:"),
    (["-o", "deployment.trainer_nodes=30"], "deployment.trainer_nodes:"),
    (["--cluster", "nope.yaml"], "cluster.profile:"),
]


@pytest.mark.parametrize("extra,key", CASES)
def test_one_line_exit_2(extra, key):
    r = runner.invoke(app, ["plan", "glm5-swe", *extra])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in r.output


@pytest.mark.parametrize("content,expect", [("[trainer\ncp = 1", "malformed TOML"), ("x = \xff", "")])
def test_malformed_files(tmp_path, content, expect):
    f = tmp_path / "r.toml"
    f.write_bytes(content.encode("latin-1"))
    r = runner.invoke(app, ["plan", str(f)])
    assert r.exit_code == 2 and expect in r.output and "Traceback" not in r.output


def test_missing_file_and_bad_yaml(tmp_path):
    assert runner.invoke(app, ["plan", str(tmp_path / "missing.toml")]).exit_code == 2
    y = tmp_path / "c.yaml"
    y.write_text("nodes: [1,\n")
    r = runner.invoke(app, ["plan", "glm5-swe", "--cluster", str(y)])
    assert r.exit_code == 2 and "malformed YAML" in r.output


DEGREE = st.one_of(st.just("auto"), st.integers(-2, 70), st.text(max_size=3), st.floats(allow_nan=True))
MODELS = st.sampled_from(["qwen3-0.6b", "qwen3-30b-a3b", "llama-3.1-70b", "glm-5", "deepseek-v3", "kimi-k2", "nope"])


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=MODELS, fsdp=DEGREE, ep=DEGREE, cp=DEGREE, tp=DEGREE, itp=DEGREE,
       tn=st.one_of(st.just("auto"), st.integers(-1, 40)), inn=st.one_of(st.just("auto"), st.integers(-1, 40)),
       nodes=st.integers(-1, 64), gpn=st.sampled_from([0, 1, 4, 8]), gpu=st.sampled_from(["h100-sxm", "h200", "b200", "a100-80gb", "x"]),
       seq=st.integers(8, 200_000), rollouts=st.integers(0, 2048), group=st.integers(1, 32),
       mean=st.one_of(st.none(), st.integers(-5, 300_000)), dis=st.booleans(), off=st.integers(-1, 9),
       ac=st.booleans(), fp8=st.booleans())
def test_property_no_uncaught_exception(model, fsdp, ep, cp, tp, itp, tn, inn, nodes, gpn, gpu, seq, rollouts, group,
                                        mean, dis, off, ac, fp8):
    data = {"model": {"name": model},
            "deployment": {"trainer_nodes": tn, "inference_nodes": inn},
            "trainer": {"fsdp": fsdp, "ep": ep, "cp": cp, "tp": tp, "activation_checkpointing": ac, "fp8": fp8},
            "inference": {"tp": itp, "max_model_len": seq, "ep": True, "disaggregation": {"enabled": dis}},
            "orchestrator": {"rollouts_per_step": rollouts, "group_size": group, "expected_mean_tokens": mean,
                             "max_off_policy_steps": off}}
    try:
        profile = ClusterProfile.model_validate({"name": "p", "nodes": nodes, "gpus_per_node": gpn, "gpu": gpu})
        report = plan(validate(data), profile)
        report.to_json()
    except RecipeError:
        pass
    except Exception as e:  # pydantic's ValidationError from the profile is the only other expected one
        assert type(e).__name__ == "ValidationError", repr(e)


def test_valid_recipe_loads():
    assert load_recipe(["glm5-swe"]).trainer.ep == 8


# Every timeout of the schema bounds a wait: nan spun a core (batch_timeout_s=nan), inf and negatives
# were accepted. The sweep finds them by name so a new `*_timeout_s` key cannot escape the rule.
def _timeout_keys(model, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys += _timeout_keys(kind, f"{prefix}{name}.")
        elif name.endswith("timeout_s"):
            keys.append(prefix + name)
    return keys


def test_the_sweep_sees_every_timeout():
    from rlctl.recipes.schema import Recipe

    assert {"inference.startup_timeout_s", "trainer.batch_timeout_s", "deployment.preempt_timeout_s",
            "orchestrator.request_timeout_s", "orchestrator.final_weights_timeout_s",
            "monitoring.stall_timeout_s"} <= set(_timeout_keys(Recipe))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
@pytest.mark.parametrize("key", sorted(set(_timeout_keys(__import__("rlctl.recipes.schema").recipes.schema.Recipe))))
def test_timeouts_are_finite_and_positive(key, value):
    r = runner.invoke(app, ["plan", "glm5-swe", "-o", f"{key}={value}"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and f"{key}:" in lines[0] and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("key", ["deployment.smoke.step_s", "deployment.smoke.run_s", "deployment.smoke.fail_after_s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_smoke_delays_are_finite_and_not_negative(key, value):
    r = runner.invoke(app, ["plan", "glm5-swe", "-o", f"{key}={value}"])
    assert r.exit_code == 2 and f"{key}:" in r.output and len(r.output.strip().splitlines()) == 1, r.output


# ---- input that used to end in a traceback -------------------------------------------------------
def _one_line_2(args, key: str):
    r = runner.invoke(app, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and key in lines[0] and "Traceback" not in r.output, r.output
    return lines[0]


def test_deeply_nested_files_are_one_line(tmp_path):
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")
    _one_line_2(["plan", str(deep_toml)], "nested too deeply")
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("nodes: " + "[" * 50_000 + "]" * 50_000 + "\n")
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(deep_yaml)], "cluster.profile:")
    deep_json = tmp_path / "config.json"
    deep_json.write_text('{"a":' * 50_000 + "1" + "}" * 50_000)
    _one_line_2(["plan", "qwen3-4b", "-o", f'model.name="{deep_json}"'], "model.name:")
    _one_line_2(["plan", "qwen3-4b", "-o", "trainer.cp=" + "[" * 50_000 + "]" * 50_000], "nested too deeply")


@pytest.mark.parametrize("fields,key", [
    ({"hidden_size": "4096"}, "hidden_size"),
    ({"hidden_size": {}}, "hidden_size"),            # 4 * {} was a TypeError
    ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": 5}, "mlp_only_layers"),
    ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "mlp_only_layers": [0, 1, 2, 3, 4]},
     "mlp_only_layers[4]"),                          # beyond the model's 4 layers: negative MoE layers before
    ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
      "shared_expert_intermediate_size": "x"}, "shared_expert_intermediate_size"),
    ({"first_k_dense_replace": 9, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}, "dense layers"),
    ({"vocab_size": 10 ** 400}, "vocab_size"),
    ({"num_attention_heads": 64, "num_key_value_heads": 64, "hidden_size": 32}, "head_dim"),
])
def test_bad_config_json_is_one_line(tmp_path, fields, key):
    cfg = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100, **fields}
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    line = _one_line_2(["plan", "qwen3-4b", "-o", f'model.name="{path}"'], "model.name:")
    assert key in line, line


def test_node_counts_are_bounded(tmp_path):
    """nodes: 100000000 ran the split search out of memory."""
    big = tmp_path / "big.yaml"
    big.write_text("nodes: 100000000\ngpus_per_node: 8\ngpu: h200\n")
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(big)], "nodes: Input should be less than or equal to 100000")
    _one_line_2(["plan", "qwen3-4b", "-o", "deployment.total_nodes=100000000"], "deployment.total_nodes:")


def test_paths_too_long_for_the_filesystem_are_one_line():
    long = "a" * 5000
    _one_line_2(["plan", f"{long}.toml"], "recipe")
    _one_line_2(["plan", "qwen3-4b", "-o", f'model.name="{long}"'], "model.name:")
    _one_line_2(["plan", "qwen3-4b", "--cluster", f"{long}.yaml"], "cluster.profile:")


def test_clone_into_an_unwritable_place_is_one_line(tmp_path, monkeypatch):
    _one_line_2(["recipes", "clone", "qwen3-4b", str(tmp_path / ("b" * 300 + ".toml"))], "cannot write")

    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("rlctl.orchestrator.exchange.files.atomic_write_bytes", refuse)
    line = _one_line_2(["recipes", "clone", "qwen3-4b", str(tmp_path / "x.toml")], "cannot write")
    assert "Permission denied" in line


# ---- nonsense values the schema refuses --------------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("trainer.optimizer.lr=inf", "trainer.optimizer.lr:"),
    ("trainer.optimizer.lr=nan", "trainer.optimizer.lr:"),
    ("trainer.optimizer.betas=[0.9, 2.0]", "trainer.optimizer.betas[1]:"),
    ("trainer.optimizer.betas=[-0.1, 0.9]", "trainer.optimizer.betas[0]:"),
    ("trainer.optimizer.weight_decay=-1.0", "trainer.optimizer.weight_decay:"),
    ("trainer.loss.mask_high=0.5", "trainer.loss.mask_high:"),
    ("trainer.fp8=1", "trainer.fp8:"),                       # an integer where a flag belongs
    ("trainer.micro_batch_size=true", "trainer.micro_batch_size:"),  # a flag where a count belongs
    ("trainer.cp=true", "trainer.cp:"),
    ("deployment.trainer_nodes=true", "deployment.trainer_nodes:"),
    ("inference.max_model_len=1000000000000000000000000000000", "inference.max_model_len:"),  # OverflowError before
    ("inference.gpu_memory_utilization=nan", "inference.gpu_memory_utilization:"),
    ("inference.kv_offload.cpu_gib=-inf", "inference.kv_offload.cpu_gib:"),
    ("orchestrator.temperature=nan", "orchestrator.temperature:"),
    ("orchestrator.rollouts_per_step=1000000000000000000000000000000", "orchestrator.rollouts_per_step:"),
    ("orchestrator.expected_mean_tokens=0", "orchestrator.expected_mean_tokens:"),
    ('orchestrator.seed="1"', "orchestrator.seed:"),
    ("monitoring.metrics_interval=0", "monitoring.metrics_interval:"),
    ("deployment.smoke.exit_code=256", "deployment.smoke.exit_code:"),
])
def test_nonsense_values_are_refused(override, key):
    _one_line_2(["plan", "qwen3-4b", "-o", override], key)


def test_degree_errors_say_what_is_allowed():
    line = _one_line_2(["plan", "qwen3-4b", "-o", "trainer.cp=0"], "trainer.cp:")
    assert "'auto' or an integer >= 1" in line and "constrained" not in line, line


@pytest.mark.parametrize("text,key", [
    ("interconnect_gbps: 0", "interconnect_gbps"), ("interconnect_gbps: -400", "interconnect_gbps"),
    ("interconnect_gbps: .nan", "interconnect_gbps"), ("intra_node_gbps: .inf", "intra_node_gbps"),
    ("gpus_per_node: true", "gpus_per_node"), ("nodes: '4'", "nodes"),
])
def test_profile_values_are_refused(tmp_path, text, key):
    body = {"nodes": "nodes: 4", "gpus_per_node": "gpus_per_node: 8"}
    lines = [body.get(k, "") for k in body if not text.startswith(k)] + [text, "gpu: h200"]
    path = tmp_path / "p.yaml"
    path.write_text("\n".join(line for line in lines if line) + "\n")
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(path)], f"{key}:")


def test_recipe_json_round_trip_under_strict_types():
    """Every component validates configs/recipe.json (lists, not tuples) again: strictness must not refuse it."""
    import json

    from rlctl.recipes.load import builtin_recipe_names

    for name in builtin_recipe_names():
        rec = load_recipe([name])
        assert validate(json.loads(json.dumps(rec.model_dump(mode="json")))) == rec


def test_print_json_never_writes_infinity(capsys):
    import json

    from rlctl.cli.common import print_json

    print_json({"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": -float("inf")}})
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == \
        {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_an_unusable_path_no_check_caught_is_still_one_line(tmp_path):
    """The last net of the CLI: an OSError naming a path is one line with exit 2, whichever module
    opened it. (The profile's calibration file, 5000 characters long, once reached it; it is now
    checked first and the line names the profile's key.)"""
    import errno

    import typer

    from rlctl.cli.common import user_errors

    net = typer.Typer()

    @net.command()
    @user_errors
    def opens(name: str) -> None:
        raise OSError(errno.ENAMETOOLONG, "File name too long", name)

    r = CliRunner().invoke(net, ["a" * 5000])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "File name too long" in r.output
    profile = tmp_path / "p.yaml"
    profile.write_text(f"nodes: 4\ngpus_per_node: 8\ngpu: h200\ncalibration: {'a' * 5000}\n")
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(profile)], "cluster profile 'p': calibration: calibration file not found")


def test_integers_python_cannot_read_are_one_line(tmp_path):
    """Integers of more than 4300 digits raise ValueError in every parser (int() refuses them)."""
    digits = "9" * 5000
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\nname = "qwen3-4b"\n[trainer]\ncp = {digits}\n')
    _one_line_2(["plan", str(recipe)], "malformed TOML")
    _one_line_2(["plan", "qwen3-4b", "-o", f"trainer.cp={digits}"], "not a number")
    profile = tmp_path / "p.yaml"
    profile.write_text(f"nodes: {digits}\ngpus_per_node: 8\n")
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(profile)], "cluster.profile:")
    config = tmp_path / "config.json"
    config.write_text(f'{{"hidden_size": {digits}, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 9}}')
    _one_line_2(["plan", "qwen3-4b", "-o", f'model.name="{config}"'], "model.name:")


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """9 levels of 9 aliases: a list of 9⁹ items sharing storage; the error message used to repr() it all."""
    import time

    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]" for prev, cur in zip("abcdefgh", "bcdefghi")]
    profile = tmp_path / "bomb.yaml"
    profile.write_text("\n".join(lines) + "\nnodes: *i\ngpus_per_node: 8\n")
    start = time.monotonic()
    _one_line_2(["plan", "qwen3-4b", "--cluster", str(profile)], "nodes: Input should be a valid integer")
    assert time.monotonic() - start < 5


def test_the_schema_view_shows_the_bounds():
    """`rlctl recipes show --schema` says what the checks above allow, union members included."""
    r = runner.invoke(app, ["recipes", "show", "--schema"])
    lines = {line.split(":")[0]: line for line in r.output.splitlines() if ":" in line}
    assert "float[> 0, <= 1]" in lines["trainer.optimizer.lr"]
    assert "'auto' | int[>= 1," in lines["trainer.cp"]
    assert "tuple[float[>= 0, < 1], float[>= 0, < 1]]" in lines["trainer.optimizer.betas"]


def test_pipeline_parallelism_is_refused_with_the_reason(tmp_path):
    """`trainer.pp` was an unknown key like any typo; it is a schema field that only accepts 1, and its
    docstring is the one-line refusal."""
    why = "trainer.pp: Pipeline parallelism is not supported by the trainer"
    _one_line_2(["plan", "qwen3-4b", "-o", "trainer.pp=4"], why)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nname = "qwen3-4b"\n[trainer]\npp = 2\n')
    _one_line_2(["plan", str(recipe)], why)
    assert load_recipe(["qwen3-4b"], ["trainer.pp=1"]).trainer.pp == 1


@pytest.mark.parametrize("override,key", [
    ("orchestrator.max_tokens=1000", "orchestrator.max_tokens: 1000 exceeds inference.max_model_len=64"),
    ("orchestrator.eval.max_tokens=65", "orchestrator.eval.max_tokens: 65 exceeds inference.max_model_len=64"),
])
def test_a_completion_longer_than_the_model_len_is_refused(override, key):
    """vLLM refuses every request asking for more tokens than max_model_len: the run started, then failed
    on its first request (or, for evaluation, skipped every one and still ended 'completed')."""
    _one_line_2(["plan", "tiny-dataset-cpu", "-o", override], key)
    assert runner.invoke(app, ["plan", "tiny-dataset-cpu", "-o", override.split("=")[0] + "=64"]).exit_code == 0
