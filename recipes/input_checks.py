"""The checks of what a recipe names outside itself (its dataset files, its environment and reward code,
what the LoRA trainer does not do) that need more than the schema. `rlctl launch` runs them before it
writes anything, and `rlctl plan` runs the same ones: a CI script that gates a launch on the plan
learns of a typo from the plan (one line naming the key, exit 2), not from the launch."""
from __future__ import annotations


def check_inputs(recipe) -> None:
    """Raise RecipeError for the first bad input; relative dataset paths are made absolute on the way
    (components run in the run directory, not here)."""
    from rlctl.orchestrator.datasets import check_dataset
    from rlctl.orchestrator.references import check_code_references
    from rlctl.trainer.lora_config import check_launchable

    check_dataset(recipe.orchestrator)  # bad paths or columns
    check_code_references(recipe.orchestrator)  # an unknown environment or reward function
    check_launchable(recipe)
