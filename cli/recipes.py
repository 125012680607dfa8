"""`rlctl recipes list | show NAME [--schema] | clone NAME DEST [--force]`."""
from __future__ import annotations

from typing import Optional

import typer

from rlctl.cli.common import fail, user_errors
from rlctl.recipes.errors import shown

recipes_app = typer.Typer(help="Built-in recipes: list, show, clone.", no_args_is_help=True)


@recipes_app.command("list")
@user_errors
def list_cmd() -> None:
    """List the built-in recipes."""
    from rlctl.recipes.load import builtin_recipe_names, builtin_recipe_path, read_toml

    for name in builtin_recipe_names():
        data = read_toml(builtin_recipe_path(name))
        typer.echo(f"{name:20s} model={data.get('model', {}).get('name', '?')} "
                   f"profile={data.get('cluster', {}).get('profile', 'local')}")


@recipes_app.command("show")
@user_errors
def show_cmd(
    name: Optional[str] = typer.Argument(None, help="Built-in recipe name."),
    schema: bool = typer.Option(False, "--schema", help="Print every recipe field: path, type, default, description."),
) -> None:
    """Print a built-in recipe, or with --schema the documented recipe schema."""
    if schema:
        from rlctl.cli.schema_view import schema_lines

        for line in schema_lines():
            typer.echo(line)
        return
    if not name:
        fail("give a recipe NAME or --schema")
    from rlctl.recipes.load import builtin_recipe_path

    typer.echo(builtin_recipe_path(name).read_text(), nl=False)


@recipes_app.command("clone")
@user_errors
def clone_cmd(
    name: str = typer.Argument(..., help="Built-in recipe name."),
    dest: str = typer.Argument(..., help="Destination TOML file."),
    force: bool = typer.Option(False, "--force", help="Overwrite DEST if it exists."),
) -> None:
    """Copy a built-in recipe to DEST to edit it."""
    from pathlib import Path

    from rlctl.orchestrator.exchange.files import atomic_write_bytes
    from rlctl.recipes.load import builtin_recipe_path

    src = builtin_recipe_path(name)
    try:
        out = Path(dest).expanduser()
        out = out / src.name if out.is_dir() else out
        problem = (f"{out} exists; pass --force to overwrite" if out.exists() and not force
                   else f"directory {out.parent} does not exist" if not out.parent.is_dir() else None)
        if problem is None:
            atomic_write_bytes(out, src.read_bytes())
    except (OSError, ValueError, RuntimeError) as e:  # unwritable, name too long, a NUL byte, `~nobody`
        problem = f"cannot write {shown(dest)}: {getattr(e, 'strerror', None) or e}"
    if problem:
        fail(problem)
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.add_typer(recipes_app, name="recipes")
