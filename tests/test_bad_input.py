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
