"""The IR's attrs to plain JSON values and back: `attrs_to_dict`, and `attrs_from_dict` /
`dataclass_from` / `typed`, which rebuild typed attrs from a plan file and refuse any value of
the wrong type or out of range with a ValueError naming where it stood."""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from .ops import FACTS, Op

_HINTS: dict[type, tuple[dict[str, Any], set[str]]] = {}  # a dataclass -> its fields' types and names, read once


def attrs_to_dict(attrs: Any) -> dict:
    """Plain JSON-able dict of an attrs dataclass (nested dataclasses become dicts)."""
    out = {}
    for f in fields(attrs):
        v = getattr(attrs, f.name)
        out[f.name] = attrs_to_dict(v) if is_dataclass(v) else (list(v) if isinstance(v, tuple) else v)
    return out


#: no count, index or size in any op's attrs comes near this (the largest: a model's positions)
ATTR_INT_MAX = 1 << 26


def attrs_from_dict(op: Op, d: dict) -> Any:
    """The attrs of `op` from their JSON dict, every field's type checked against the dataclass
    and every integer within 0..ATTR_INT_MAX (a ValueError names the field: plans are read from
    files people edit, and a count of 2**62 experts would be materialised by the rules)."""
    attrs = dataclass_from(FACTS[op].attrs, d, op.value)
    _ints_in_range(attrs, op.value)
    return attrs


def _ints_in_range(a: Any, where: str) -> None:
    for f in fields(a):
        v = getattr(a, f.name)
        if is_dataclass(v):
            _ints_in_range(v, f"{where}.{f.name}")
            continue
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, int) and not isinstance(x, bool) and not 0 <= x <= ATTR_INT_MAX:
                raise ValueError(f"{where}.{f.name}: {x} is outside 0..{ATTR_INT_MAX}")


def dataclass_from(cls: type, d: Any, where: str) -> Any:
    """A dataclass from its JSON dict, every field's type checked (see `typed`)."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: attrs must be a JSON object, got {d!r}")
    if cls not in _HINTS:
        _HINTS[cls] = (typing.get_type_hints(cls), {f.name for f in fields(cls)})
    hints, names = _HINTS[cls]
    extra = sorted(set(d) - names)
    if extra:
        raise ValueError(f"{where}: unknown attrs {extra}")
    kwargs = {k: typed(hints[k], v, f"{where}.{k}") for k, v in d.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ValueError(f"{where}: {e}") from None


def typed(hint: Any, v: Any, where: str) -> Any:
    """v as a value of type `hint` (JSON lists become tuples), or a ValueError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            try:
                return typed(a, v, where)
            except ValueError:
                continue
        raise ValueError(f"{where}: {v!r} is not a {hint}")
    if origin is typing.Literal:
        if v in args and type(v) in {type(a) for a in args}:
            return v
        raise ValueError(f"{where}: {v!r} is not one of {list(args)}")
    if origin is tuple:
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{where}: {v!r} is not a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(typed(args[0], x, where) for x in v)
        if len(args) != len(v):
            raise ValueError(f"{where}: {v!r} does not have {len(args)} items")
        return tuple(typed(a, x, where) for a, x in zip(args, v))
    if hint is type(None):
        if v is None:
            return v
        raise ValueError(f"{where}: {v!r} is not null")
    if is_dataclass(hint):
        return v if isinstance(v, hint) else dataclass_from(hint, v, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(v)
        except (ValueError, TypeError):
            raise ValueError(f"{where}: {v!r} is not one of {[m.value for m in hint]}") from None
    if hint is bool:
        if isinstance(v, bool):
            return v
    elif hint is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    elif hint is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    elif hint is str:
        if isinstance(v, str):
            return v
    elif hint is Any:
        return v
    else:
        return v
    raise ValueError(f"{where}: {v!r} is not a {getattr(hint, '__name__', hint)}")
