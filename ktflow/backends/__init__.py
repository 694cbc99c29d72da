"""Backends run the instructions of a plan. Each implements the small `Backend` protocol (base.py)
and registers in BACKENDS, a plain dict from name to class."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import Backend, StepContext
from .native.backend import NativeBackend
from .cuda.backend import CudaGraphBackend
from .null import NullBackend
from .torch_ref import TorchRefBackend

BACKENDS: dict[str, type] = {
    "torch_ref": TorchRefBackend,
    "native": NativeBackend,
    "cuda_graph": CudaGraphBackend,
    "null": NullBackend,
}


def resolve_backend(name: str, act_dtype: torch.dtype, device: str = "cpu") -> str:
    """'auto' is, where the native module is built and the plan computes in bfloat16 (its
    kernels take bf16 activations): 'cuda_graph' for plans whose GPU nodes run on CUDA, else
    'native'; otherwise 'torch_ref'."""
    if name != "auto":
        return name
    from .native import binding as native

    if not (native.available() and act_dtype == torch.bfloat16):
        return "torch_ref"
    return "cuda_graph" if device == "cuda" else "native"


def get_backend(name: str) -> type:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]


__all__ = ["BACKENDS", "Backend", "StepContext", "get_backend", "resolve_backend"]
