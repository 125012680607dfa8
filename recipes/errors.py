"""The one error type users see for bad input: a single line, exit code 2."""
from __future__ import annotations

import errno


class RecipeError(Exception):
    """Bad user input (recipe, override, profile, path). `str()` is the one-line message shown."""

    exit_code = 2

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def format_validation_error(err, prefix: str = "") -> str:
    """Turn a pydantic ValidationError into one line: `key.path: what is wrong (got VALUE)`."""
    first = err.errors()[0]
    loc = _dotted(first.get("loc", ()))
    key = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "recipe"
    msg = first.get("msg", "invalid value")
    kind = first.get("type")
    if kind == "missing":  # its input is the table around it: "(got a table)" read as if one had been given
        return f"{key}: required, but not set"
    if kind == "extra_forbidden":
        msg = "unknown key"
        parent = _dotted(first.get("loc", ())[:-1])
        allowed = _allowed_keys(err, first.get("loc", ())[:-1])
        if allowed:
            msg += f" (allowed in {parent or 'the top level'}: {', '.join(allowed)})"
        return f"{key}: {msg}"
    if any(_is_union_tag(p) for p in first.get("loc", ())):
        msg = "invalid value; allowed: " + " or ".join(sorted({_union_member(e) for e in err.errors()}))
    elif kind == "literal_error":
        msg = _only_value_doc(err, first.get("loc", ())) or msg
    elif kind == "model_type":  # pydantic names the class (TrainerConfig); the user wrote a value, not a table
        msg = "should be a table of settings ([section] or key = { ... } in TOML), not a single value"
    elif kind == "value_error":  # a validator's own message, without pydantic's "Value error, " in front
        msg = str((first.get("ctx") or {}).get("error") or msg)
    elif kind == "string_pattern_mismatch":
        from rlctl.recipes.base import RUN_NAME_ALLOWED, RUN_NAME_PATTERN, SLURM_TIME_ALLOWED, SLURM_TIME_PATTERN

        pattern = (first.get("ctx") or {}).get("pattern")  # not a regex to decode: what is allowed
        allowed = {RUN_NAME_PATTERN: RUN_NAME_ALLOWED, SLURM_TIME_PATTERN: SLURM_TIME_ALLOWED}.get(pattern)
        if allowed:
            msg = f"allowed: {allowed}"
    value = first.get("input")
    return f"{key}: {msg} (got {'a table' if isinstance(value, dict) else _short_repr(value)})"


def _short_repr(value) -> str:
    """repr() cut to 60 characters without building the whole of it: a YAML alias bomb is a list of
    10⁹ items sharing storage, and an int of 5000 digits has no repr at all."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 2, 4, 4, 4, 4
    r.maxstring = r.maxother = 60
    r.maxlong = 40
    text = r.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _only_value_doc(err, loc) -> str | None:
    """A setting with one allowed value (`pp: Literal[1]`) is a refusal: its docstring says why, and
    is the message instead of pydantic's "Input should be 1"."""
    from typing import Literal, get_args, get_origin

    from rlctl.recipes.base import field_docs

    model = getattr(err, "_rlctl_model", None)
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        model = field.annotation if field is not None else None
    field = getattr(model, "model_fields", {}).get(str(loc[-1])) if loc else None
    if field is None or get_origin(field.annotation) is not Literal or len(get_args(field.annotation)) != 1:
        return None
    return field.description or field_docs(model).get(str(loc[-1]))


def _allowed_keys(err, loc) -> list[str]:
    model = getattr(err, "_rlctl_model", None)
    if model is None:
        return []
    for part in loc:
        field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        ann = field.annotation
        model = ann if hasattr(ann, "model_fields") else None
        if model is None:
            return []
    return sorted(model.model_fields) if model is not None else []


_UNION_TAGS = {"int", "str", "float", "bool", "none", "list", "dict"}


def _is_union_tag(part) -> bool:
    """pydantic names union members in locs (`cp.int`, `cp.constrained-int`, `cp.literal['auto']`);
    users never typed those."""
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part.startswith("constrained-"))


def _dotted(loc) -> str:
    out = ""
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true/false"}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _union_member(e) -> str:
    """One member of a union as the user would write it: `'auto'`, `an integer >= 1`."""
    tag = next((p for p in reversed(e.get("loc", ())) if _is_union_tag(p)), "")
    if tag.startswith("literal["):
        return tag[len("literal["):].rstrip("]")
    kind = _KINDS.get(tag.replace("constrained-", ""), "a valid value")
    ctx = e.get("ctx") or {}
    bound = " and ".join(f"{op} {ctx[k]}" for k, op in _BOUNDS if k in ctx)
    return f"{kind} {bound}".strip()


def path_kind(path) -> str | None:
    """'file', 'dir' or None, never an exception: a name too long for the filesystem, a NUL byte or a
    directory we may not enter is a path that does not exist for the user, not a traceback."""
    from pathlib import Path

    try:
        p = Path(path).expanduser()
        return "file" if p.is_file() else "dir" if p.is_dir() else None
    except (OSError, ValueError, RuntimeError):  # RuntimeError: `~user` of an unknown user
        return None


# OS errors that mean a path the user gave cannot be used (too long, not there, not a folder, not
# allowed): bad input, one line. Others (disk full, I/O) are failures.
UNUSABLE_PATH = frozenset({errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES,
                           errno.EPERM, errno.ELOOP, errno.EROFS})


def shown(text: str, limit: int = 80) -> str:
    """A user's string (a path, a name) cut to fit in a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


TOO_DEEP = "nested too deeply (lists/tables more than a few hundred levels deep)"
