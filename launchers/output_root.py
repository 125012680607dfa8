"""Where runs live: the output root `rlctl launch` writes into and run names are looked up in, and the
setting it came from (so a message about that folder names the key to change)."""
from __future__ import annotations

import os
from pathlib import Path


def output_root(recipe, profile) -> Path:
    """Where `rlctl launch` writes: `deployment.output_dir`, else $RLCTL_OUTPUT_DIR, else the profile's
    shared filesystem, else ./runs (`default_root` looks run names up in the same order)."""
    return output_root_and_origin(recipe, profile)[0]


def output_root_and_origin(recipe, profile) -> tuple[Path, str]:
    """`output_root` and where it took its folder from: the key a message about that folder names."""
    value, origin = _output_root_setting(recipe.deployment.output_dir, profile)
    return Path(value).expanduser().absolute(), origin


def default_root(profile: str | None = None) -> Path:
    """Where run names are looked up: the order `rlctl launch` picks its output root in, without a
    recipe's `deployment.output_dir`."""
    return Path(_output_root_setting(None, profile)[0]).expanduser()


def _output_root_setting(output_dir: str | None, profile) -> tuple[str, str]:
    """The output root and the key it came from; `profile`: a loaded cluster profile, a profile name
    (loaded only when the chain reaches it) or None."""
    return next((value, origin) for value, origin in _output_root_chain(output_dir, profile) if value)


def _output_root_chain(output_dir: str | None, profile):
    yield output_dir, "deployment.output_dir"
    yield os.environ.get("RLCTL_OUTPUT_DIR"), "RLCTL_OUTPUT_DIR"
    if isinstance(profile, str):
        from rlctl.recipes.clusters import load_profile

        profile = load_profile(profile)
    if profile is not None:
        yield profile.shared_fs, f"cluster profile '{profile.name}': shared_fs"
    yield "runs", "deployment.output_dir (unset: ./runs)"
