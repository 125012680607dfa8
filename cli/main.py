"""The `rlctl` Typer app. Each command module registers its commands; domain code is imported lazily
inside the commands so that `rlctl --help` stays as cheap as importing typer and rich."""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="rlctl",
    help="Plan, launch, monitor and resume asynchronous RL post-training runs on Slurm (or locally).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: typer's rich help renderer alone costs ~0.5 s of imports
)

# Modules under rlctl.cli that define `register(app)`; order is the order in `--help`.
COMMAND_MODULES = ("plan", "recipes", "launch", "monitor", "resume", "pool")


def _version_callback(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"rlctl {version('rlctl')}")
        except PackageNotFoundError:  # running from a source tree without install
            typer.echo("rlctl (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Show the version and exit."),
) -> None:
    """rlctl: asynchronous RL post-training on Slurm."""


for _name in COMMAND_MODULES:
    importlib.import_module(f"rlctl.cli.{_name}").register(app)


def _usage_error_in_one_line(self, file=None) -> None:
    """Bad input is one line in rlctl (`rlctl: error: ...`, exit 2); click's own usage errors (a missing
    argument, an option that does not parse, an unknown command) printed four: usage, hint, blank, error."""
    where = self.ctx.command_path if self.ctx is not None else "rlctl"
    typer.echo(f"rlctl: error: {self.format_message().rstrip('.')} (see `{where} --help`)", err=True)


try:  # typer >= 0.2x parses with a click of its own
    from typer._click.exceptions import UsageError as _UsageError
except ImportError:
    from click.exceptions import UsageError as _UsageError
_UsageError.show = _usage_error_in_one_line  # rlctl's process only: the CLI is its entry point


def main() -> None:
    app()


if __name__ == "__main__":
    main()
