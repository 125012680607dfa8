"""`rlctl pool launch|list|show|stop`: shared inference pools that several runs attach to."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli.common import print_json, user_errors

pool_app = typer.Typer(help="Shared inference pools (one set of vLLM servers serving several runs).",
                       no_args_is_help=True, rich_markup_mode=None)

ROOT_HELP = "Output root the pools live under (<root>/pools/; default: $RLCTL_OUTPUT_DIR, else --profile's shared filesystem, else ./runs)."


def _root(root: Optional[Path], profile: Optional[str]) -> Path:
    from rlctl.launchers.output_root import default_root

    return (root if root is not None else default_root(profile)).expanduser().absolute()


@user_errors
def launch_cmd(
    recipes: List[str] = typer.Argument(..., help="Recipe TOML files (or built-in names) whose [model] and [inference] the pool serves."),
    name: Optional[str] = typer.Option(None, "--name", help="Pool name runs attach by (default: the recipe's name)."),
    cluster: Optional[str] = typer.Option(None, "--cluster", "-c", help="Cluster profile; overrides cluster.profile."),
    override: List[str] = typer.Option([], "--override", "-o", help="key.path=value override (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Start a pool: the recipe's inference servers and the pool's front, as one job (or local processes)."""
    from rlctl.launchers.pool import launch_pool

    result = launch_pool(recipes, override, cluster=cluster, name=name)
    summary = {"name": result.name, "pool_dir": str(result.run.root), "scheduler": result.scheduler,
               "job_id": result.job_id, "supervisor_pid": result.supervisor_pid, "attempt": result.attempt}
    if as_json:
        print_json(summary)
        return
    where = f"job id {result.job_id}" if result.job_id else f"local supervisor pid {result.supervisor_pid}"
    typer.echo(f"pool {result.name} starting ({where}): {result.run.root}")
    typer.echo(f"attach a run with -o deployment.inference_pool={result.name}; `rlctl pool show {result.name}` "
               "says when it serves")


@user_errors
def list_cmd(root: Optional[Path] = typer.Option(None, "--root", help=ROOT_HELP),
             profile: Optional[str] = typer.Option(None, "--profile", help="Cluster profile whose shared filesystem is the output root."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the pools under an output root with their state and attached runs."""
    from rlctl.launchers.attach import pools_root
    from rlctl.launchers.pool import list_pools

    base = _root(root, profile)
    pools = list_pools(base)
    if as_json:
        print_json(pools)
        return
    if not pools:
        typer.echo(f"no pools under {pools_root(base)}")
    for info in pools:
        runs = ", ".join((info.get("stats") or {}).get("runs", {})) or "-"
        typer.echo(f"{info['name']:<24} {info['state']:<10} {info['mode']:<5} {info['model'] or '-'}  runs: {runs}")


@user_errors
def show_cmd(pool: str = typer.Argument(..., help="Pool name (or its directory)."),
             root: Optional[Path] = typer.Option(None, "--root", help=ROOT_HELP),
             profile: Optional[str] = typer.Option(None, "--profile", help="Cluster profile whose shared filesystem is the output root."),
             as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """A pool's state, endpoint, idle fraction, residency switches and each run's share and queue."""
    from rlctl.launchers.pool import describe_pool, resolve_pool

    info = describe_pool(resolve_pool(pool, _root(root, profile)))
    if as_json:
        print_json(info)
    else:  # the view of `rlctl monitor POOL --once`
        from rich.console import Console

        from rlctl.cli.pool_view import render_pool

        Console().print(render_pool(info))


@user_errors
def stop_cmd(pool: str = typer.Argument(..., help="Pool name (or its directory)."),
             root: Optional[Path] = typer.Option(None, "--root", help=ROOT_HELP),
             profile: Optional[str] = typer.Option(None, "--profile", help="Cluster profile whose shared filesystem is the output root."),
             timeout: float = typer.Option(60.0, help="Seconds to wait until everything has stopped.")) -> None:
    """Stop a pool's servers and front; runs still attached to it fail (their checkpoints stay)."""
    from rlctl.launchers.control import cancel_run
    from rlctl.launchers.pool import resolve_pool
    from rlctl.recipes.errors import RecipeError

    if not timeout >= 0:  # nan too
        raise RecipeError(f"must be >= 0 seconds (got {timeout})", key="--timeout")
    typer.echo(cancel_run(resolve_pool(pool, _root(root, profile)), timeout, kind="pool"))


def register(app: typer.Typer) -> None:
    pool_app.command("launch")(launch_cmd)
    pool_app.command("list")(list_cmd)
    pool_app.command("show")(show_cmd)
    pool_app.command("stop")(stop_cmd)
    app.add_typer(pool_app, name="pool")
