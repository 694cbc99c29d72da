"""Backends run the steps of a plan. Each implements the small `Backend` protocol (base.py) and
registers in BACKENDS, a plain dict from name to class."""

from __future__ import annotations

from ..errors import ConfigError
from .base import Backend, StepContext
from .null import NullBackend
from .torch_ref import TorchRefBackend

BACKENDS: dict[str, type] = {
    "torch_ref": TorchRefBackend,
    "null": NullBackend,
}


def get_backend(name: str) -> type:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]


__all__ = ["BACKENDS", "Backend", "StepContext", "get_backend"]
