"""Many instances of a frozen ``slots=True`` dataclass that differ in one field, built cheaply.

A frozen dataclass's ``__init__`` goes through ``object.__setattr__`` per field
and runs ``__post_init__``; at hundreds of objects per engine call that is a
visible share of the call. `build_many` stores the slots directly. The caller
is responsible for every invariant ``__post_init__`` would check (the callers
validate the shared values once and each varying value once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def build_many(cls: type[T], fixed: Mapping[str, Any], varying: str, values: Sequence[Any]) -> list[T]:
    """``[cls(**fixed, **{varying: v}) for v in values]`` without ``__init__``.

    Every slot of `cls` must be named exactly once (in `fixed` or as `varying`),
    so no instance is left with an unset field."""
    slots = set(getattr(cls, "__slots__", ()))
    if set(fixed) | {varying} != slots or varying in fixed:
        raise TypeError(f"{cls.__name__}: build_many must set every slot once: {sorted(slots)}")
    new = object.__new__
    pairs = [(cls.__dict__[name].__set__, value) for name, value in fixed.items()]
    set_varying = cls.__dict__[varying].__set__
    out: list[T] = []
    append = out.append
    for v in values:
        obj = new(cls)
        for setter, value in pairs:
            setter(obj, value)
        set_varying(obj, v)
        append(obj)
    return out
