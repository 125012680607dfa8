"""Shared CLI plumbing: one-line errors with exit code 2, JSON output, the console."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from typing import Any, Callable

import typer

USAGE_ERROR = 2


def fail(message: str, code: int = USAGE_ERROR) -> "typer.Exit":
    """Print `rlctl: error: message` on stderr and exit with `code` (2 = bad input)."""
    typer.echo(f"rlctl: error: {message}", err=True)
    raise typer.Exit(code)


def user_errors(fn: Callable) -> Callable:
    """Turn RecipeError (bad input, exit 2) and RunLocked (exit 1) into one line, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from rlctl.recipes.errors import RecipeError

        try:
            return fn(*args, **kwargs)
        except RecipeError as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            typer.echo("rlctl: interrupted", err=True)
            raise typer.Exit(130)
        except OSError as e:
            # A path the user gave that cannot be used (too long, not there, not allowed) and that no
            # check before caught: still one line. Other OS errors (disk full, I/O) are failures, exit 1.
            from rlctl.recipes.errors import UNUSABLE_PATH, shown

            if e.filename is None or e.errno not in UNUSABLE_PATH:
                raise
            fail(f"{shown(str(e.filename))}: {e.strerror}", USAGE_ERROR)
        except Exception as e:
            # imported here, not above: the lock module is not needed on the path of a plan
            from rlctl.orchestrator.exchange.lock import RunLocked

            if isinstance(e, RunLocked):  # another command acts on the run (exit 1)
                fail(str(e), e.exit_code)
            raise

    return wrapper



@contextlib.contextmanager
def pydantic_plugins_off():
    """Build the recipe models with pydantic's plugins off, as typer does for its own: looking plugins
    up scans every installed package's entry points (~15 ms, a quarter of importing typer and rich)
    and nothing of the CLI uses one. Set for the block only, so no child process inherits it."""
    previous = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = previous


def print_json(obj: Any) -> None:
    """Strict JSON on stdout: a NaN or ±inf (a figure that could not be computed, a NaN loss) is written
    as null — `Infinity` is not JSON and breaks every strict parser (jq, json.loads(parse_constant=...))."""
    text = json.dumps(_finite(obj), indent=2, sort_keys=False, default=str, allow_nan=False)
    sys.stdout.write(text + "\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def console():
    from rich.console import Console

    return Console()
