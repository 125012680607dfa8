"""Walk the pydantic recipe models: one line per field with its path, type, default and docstring."""
from __future__ import annotations


def _type_name(ann) -> str:
    text = getattr(ann, "__name__", None) or str(ann)
    return text.replace("typing.", "").replace("NoneType", "None")


def schema_lines() -> list[str]:
    from pydantic import BaseModel

    from rlctl.recipes.schema import Recipe

    lines: list[str] = []

    def walk(model, prefix: str) -> None:
        for name, f in model.model_fields.items():
            path = f"{prefix}{name}"
            ann = f.annotation
            doc = (f.description or "").replace("\n", " ")
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                lines.append(f"[{path}]  {doc}")
                walk(ann, path + ".")
                continue
            default = "required" if f.is_required() else repr(f.default)
            lines.append(f"{path}: {_type_name(ann)} = {default}  # {doc}")

    walk(Recipe, "")
    return lines
