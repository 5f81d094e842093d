"""The config reference: every field's dotted name, type, default and doc, read from the pydantic
models (`gyre config-doc` renders docs/config.md from this)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from gyre_slurm.config import RunConfig


def _type_name(ann: Any) -> str:
    args = get_args(ann)
    if get_origin(ann) is Literal:
        return " / ".join(str(a) for a in args)
    if args and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if get_origin(ann) is dict:
        return "map"
    return getattr(ann, "__name__", str(ann))


def field_reference() -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) for every field: docs/config.md is made from this."""
    rows = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            tname = _type_name(ann)
            if f.is_required():
                default = "required"
            else:
                value = f.default_factory() if f.default_factory is not None else f.default
                default = "null" if value is None else str(value) if isinstance(value, Path) else repr(value)
            rows.append((prefix + name, tname, default, f.description or ""))

    walk(RunConfig, "")
    return rows
