"""Strict typed construction of config dataclasses from plain JSON/TOML values.

`build_dataclass` walks a dataclass's type hints: nested dataclasses, enums (by
value), ``tuple[X, ...]``, ``dict[K, V]``, optionals, sizes (``"64GiB"``, fields
marked ``metadata={"size": True}``), bools, ints, finite floats and strings. An
unknown key, a wrong type or an invalid value raises `ConfigError` naming the
dotted path of the field; `to_plain` turns a built config back into values that
`build_dataclass` accepts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from ..errors import ConfigError, shown
from .sizes import parse_size

T = TypeVar("T")


def join_path(prefix: str, name: object) -> str:
    """The dotted path of key `name` under `prefix`; a key that is not a string is `shown`."""
    text = name if isinstance(name, str) else shown(name)
    return f"{prefix}.{text}" if prefix else text


def build_dataclass(cls: type[T], data: Mapping[str, Any], path: str) -> T:
    """Strictly build dataclass `cls` from `data`, recursing into nested ones.

    Unknown keys, wrong types and invalid values raise ConfigError with the
    dotted path. Calls ``validate(path)`` on the result when it exists.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", f"expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted((k for k in data if k not in fields), key=lambda k: join_path("", k))
    if unknown:
        raise ConfigError(
            join_path(path, unknown[0]),
            f"unknown key; allowed keys: {', '.join(sorted(fields))}",
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        kwargs[name] = _coerce(hints[name], value, join_path(path, name), bool(f.metadata.get("size")))
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def _coerce(tp: Any, value: Any, path: str, is_size: bool) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        allowed = [m.value for m in tp]
        if not isinstance(value, (str, int, float)) or value not in allowed:
            raise ConfigError(path, f"must be one of {allowed}, got {shown(value)}")
        return tp(value)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:  # pragma: no cover - programming error
            raise ConfigError(path, f"unsupported config type {tp!r}")
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        if len(value) > 10_000:
            raise ConfigError(path, f"at most 10000 entries, got {len(value)}")
        return tuple(_coerce(args[0], v, f"{path}[{i}]", is_size) for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected an object, got {type(value).__name__}")
        return {
            _coerce(key_tp, k, join_path(path, k), False): _coerce(val_tp, v, join_path(path, k), is_size)
            for k, v in value.items()
        }
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(members[0], value, path, is_size)
    if tp is int and is_size:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(path, str(exc)) from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {shown(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(path, "number too large") from None
        if not math.isfinite(number):
            raise ConfigError(path, f"must be a finite number, got {shown(value)}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {shown(value)}")
        return value
    raise ConfigError(path, f"unsupported config type {tp!r}")  # pragma: no cover - programming error


def to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    return value
