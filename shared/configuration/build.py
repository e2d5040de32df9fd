"""Frozen dataclasses from plain data (parsed YAML), checked against their type hints at the boundary.

The one builder behind the run config, its sections read from checkpoints and messages, and the study axes
(``fedpose.shared.configuration.schema``): ``Literal``, ``Optional``/unions, fixed and variable tuples, nested
dataclasses and finite numbers; a failure names the dotted key path.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin, get_type_hints

from fedpose.shared.errors import ConfigError


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check/convert one YAML value against a type hint, naming ``path`` on failure."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return build_dataclass(tp, value, path)
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: expected one of {list(get_args(tp))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError("; ".join(errors))
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        try:
            number = float(value)
        except OverflowError as err:
            raise ConfigError(f"{path}: number too large ({len(str(value))} digits)") from err
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite number, got {number}")
        return number
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")  # pragma: no cover - schema bug


def build_dataclass(cls: Any, data: dict[str, Any], prefix: str = "") -> Any:
    """An instance of the frozen dataclass ``cls`` from plain data: unknown keys and wrong types are refused with the
    dotted key path named (``train.lr: expected a number, got str 'fast'``); the section's own checks run last."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:  # a section validated by its own module (e.g. data.synth: WardSpec)
        raise ConfigError(f"{prefix or 'config'}: {err}") from err
