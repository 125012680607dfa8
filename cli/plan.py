"""`rlctl plan`: size a run before launch (placement, memory, throughput, step times)."""
from __future__ import annotations

from typing import List, Optional

import typer

from rlctl.cli.common import print_json, user_errors

HELP = """Plan RECIPE(s) on a cluster profile without launching anything.

RECIPE is a TOML file or a built-in recipe name (`rlctl recipes list`). Several recipes are merged
left to right (later tables override earlier keys); then every `-o key.path=value` override is applied
in order (values are TOML literals: `-o trainer.cp=4 -o inference.fp8=true`)."""


def register(app: typer.Typer) -> None:
    @app.command("plan", help=HELP)
    @user_errors
    def plan_cmd(
        recipe: List[str] = typer.Argument(..., help="Recipe TOML files or built-in names, merged left to right."),
        cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="Cluster profile name or YAML path (overrides cluster.profile)."),
        override: List[str] = typer.Option([], "--override", "-o", help="key.path=value override (repeatable)."),
        as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    ) -> None:
        from rlctl.recipes.clusters import load_profile
        from rlctl.recipes.load import load_recipe
        from rlctl.recipes.plan import plan

        overrides = list(override) + ([f'cluster.profile="{cluster}"'] if cluster else [])
        rec = load_recipe(recipe, overrides)
        report = plan(rec, load_profile(rec.cluster.profile))
        if as_json:
            print_json(report.to_json())
        else:
            from rlctl.cli.plan_view import render

            render(report.to_json())
