"""Field values of the config dataclasses: checked and gently converted against each field's
type hint (a YAML string "8" for an int field, "16,32" for a tuple), with a ValueError that
names the field and the value; and back to plain data for YAML/JSON."""

from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_types(config: Any) -> None:
    """Type-check (and gently convert) every field, so that direct construction
    (`CacheConfig(page_size="8")`) fails with the same ValueError as YAML and flags do,
    never with a TypeError from a comparison further down. A field holding a section (a
    dataclass with a SECTION name) must be an instance of it."""
    cls = type(config)
    section = getattr(cls, "SECTION", "")
    prefix = f"{section}." if section else ""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        value = getattr(config, f.name)
        hint = hints[f.name]
        if is_dataclass(hint) and hasattr(hint, "SECTION"):
            check(
                isinstance(value, hint),
                f"{f.name} must be a {hint.__name__} (or build the config with "
                f"EngineConfig.from_dict), got {value!r}",
            )
        else:
            object.__setattr__(config, f.name, coerce(value, hint, prefix + f.name))


def coerce(value: Any, hint: Any, name: str) -> Any:
    """Check (and gently convert) a value against a field's type hint."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list, got {value!r}")
        return tuple(coerce(v, args[0], name) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    if hint is int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return number
    if hint is str:
        if isinstance(value, os.PathLike):  # model / tokenizer directories
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value


def to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [to_plain(v) for v in value]
    return value
