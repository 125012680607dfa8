"""Load recipes: TOML files composed left to right, then `key.path=value` overrides, then validation."""
from __future__ import annotations

import copy
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from rlctl.recipes.errors import TOO_DEEP, RecipeError, format_validation_error, path_kind, shown


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped in the package (file stems)."""
    root = resources.files("rlctl.recipes")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def builtin_recipe_path(name: str) -> Path:
    """Path of a built-in recipe, or a RecipeError listing the available names."""
    if "/" in name or "\\" in name or name.startswith("."):
        raise RecipeError(f"invalid recipe name {shown(name)!r}: built-in names have no path separators and do not "
                          f"start with '.' (built-in: {', '.join(builtin_recipe_names())})")
    stem = name[:-5] if name.endswith(".toml") else name
    path = Path(str(resources.files("rlctl.recipes").joinpath(f"{stem}.toml")))
    if path_kind(path) != "file":
        raise RecipeError(f"unknown recipe {shown(name)!r} (built-in: {', '.join(builtin_recipe_names())})")
    return path


def resolve_recipe_path(ref: str) -> Path:
    """A file path if it exists, else a built-in recipe name."""
    kind = path_kind(ref)
    if kind == "file":
        return Path(ref).expanduser()
    path = Path(ref)
    # a folder here named like a built-in (`smoke/`) does not hide the built-in `smoke`
    if kind == "dir" and ("/" in ref or path.stem not in builtin_recipe_names()):
        raise RecipeError(f"recipe path is a directory, not a TOML file: {shown(ref)}")
    if "/" in ref:  # a path, not a name: "invalid recipe name" would send the user looking at the wrong thing
        raise RecipeError(f"recipe file not found: {shown(ref)}")
    if path.suffix != ".toml":
        return builtin_recipe_path(ref)
    try:  # `qwen3-4b.toml` is the built-in when no such file is here
        return builtin_recipe_path(path.name)
    except RecipeError:
        raise RecipeError(f"recipe file not found: {shown(ref)} (nor is {path.stem!r} a built-in recipe: "
                          f"{', '.join(builtin_recipe_names())})") from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except IsADirectoryError:
        raise RecipeError(f"recipe path is a directory, not a TOML file: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"malformed TOML in {path}: {e}") from None
    except ValueError as e:  # an integer longer than Python converts (4300 digits)
        raise RecipeError(f"malformed TOML in {path}: {shown(str(e), 100)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe file is not UTF-8 text: {path}") from None
    except RecursionError:
        raise RecipeError(f"recipe {path} is {TOO_DEEP}") from None
    except OSError as e:  # permission denied, name too long, an I/O error
        raise RecipeError(f"cannot read recipe {shown(str(path))}: {e.strerror}") from None


def deep_merge(base: dict, override: dict) -> dict:
    """Tables merge recursively; any other value in `override` replaces the base value."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.cp=4` → (['trainer', 'cp'], 4). Values are TOML literals; bare words are strings."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    parts = [p.strip() for p in key.strip().split(".")]
    if not all(parts):
        raise RecipeError(f"override {text!r} has an empty key segment")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    except RecursionError:
        raise RecipeError(f"override {shown(text)!r}: value {TOO_DEEP}") from None
    except ValueError:  # TOML that Python cannot hold: an integer of thousands of digits
        raise RecipeError(f"override {shown(text)!r}: the value is not a number Python can read") from None
    return parts, value


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"override {text!r}: {'.'.join(parts[: i + 1])} is not a table")
            node = child
        node[parts[-1]] = value
    return out


def compose(refs: Iterable[str], overrides: Iterable[str] = ()) -> dict:
    """Raw recipe dict: each file merged over the previous one, then the overrides."""
    data: dict = {}
    refs = list(refs)
    if not refs:
        raise RecipeError("no recipe given (pass a TOML file or a built-in name; see `rlctl recipes list`)")
    for ref in refs:
        path = resolve_recipe_path(ref)
        try:  # the parser may accept a depth that copying then cannot
            data = deep_merge(data, read_toml(path))
        except RecursionError:
            raise RecipeError(f"recipe {path} is {TOO_DEEP}") from None
    try:
        return apply_overrides(data, overrides)
    except RecursionError:
        raise RecipeError(f"an override is {TOO_DEEP}") from None


def validate(data: dict):
    """Validate a raw dict into a Recipe, raising a one-line RecipeError on the first problem."""
    from pydantic import ValidationError

    from rlctl.recipes.schema import Recipe, check_lengths

    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        e._rlctl_model = Recipe
        raise RecipeError(format_validation_error(e)) from None
    except RecursionError:  # e.g. orchestrator.environment.args: free-form, so any depth parses
        raise RecipeError(f"recipe is {TOO_DEEP}") from None
    check_lengths(recipe)
    return recipe


def load_recipe(refs: Iterable[str], overrides: Iterable[str] = ()):
    """Files (or built-in names) + overrides → validated Recipe."""
    return validate(compose(refs, overrides))
