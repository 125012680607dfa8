"""Walk the pydantic recipe models: one line per field with its path, type, default and docstring."""
from __future__ import annotations


def _type_name(ann) -> str:
    """`int`, `'auto' | int[>= 1, <= 6400000]`, `tuple[float[>= 0, < 1], ...]`: types with their bounds."""
    from typing import Annotated, Literal, Union, get_args, get_origin
    import types

    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        return _type_name(args[0]) + _bounds(args[1:])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    text = getattr(ann, "__name__", None) or str(ann)
    return text.replace("typing.", "").replace("NoneType", "None")


def _bounds(metadata) -> str:
    """`[>= 1, <= 100000]` from pydantic's Field(...) / annotated_types metadata."""
    flat = [c for m in metadata for c in (getattr(m, "metadata", None) or [m])]
    found = [f"{op} {getattr(m, k)}" for m in flat for k, op in
             (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, k, None) is not None]
    return f"[{', '.join(found)}]" if found else ""


def _table_model(ann, base):
    """The model of a table field: `Model` itself, or the model of `Model | None`; else None."""
    from typing import Union, get_args, get_origin
    import types

    if isinstance(ann, type) and issubclass(ann, base):
        return ann
    if get_origin(ann) in (Union, types.UnionType):
        models = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, base)]
        if len(models) == 1 and len(get_args(ann)) == 2 and type(None) in get_args(ann):
            return models[0]
    return None


def schema_lines() -> list[str]:
    from pydantic import BaseModel

    from rlctl.recipes.base import field_docs
    from rlctl.recipes.schema import Recipe

    lines: list[str] = []

    def walk(model, prefix: str) -> None:
        for name, f in model.model_fields.items():
            path = f"{prefix}{name}"
            ann = f.annotation
            doc = (f.description or field_docs(model).get(name, "")).replace("\n", " ")
            table = _table_model(ann, BaseModel)
            if table is not None:  # a table, or an optional one (`DatasetConfig | None`): its keys too
                optional = "" if table is ann else f"(optional, default {f.default!r}) "
                lines.append(f"[{path}]  {optional}{doc}")
                walk(table, path + ".")
                continue
            default = "required" if f.is_required() else repr(f.default)
            lines.append(f"{path}: {_type_name(ann)}{_bounds(f.metadata)} = {default}  # {doc}")

    walk(Recipe, "")
    return lines
