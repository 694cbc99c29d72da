"""Writing HF-layout checkpoints tensor by tensor: a streaming safetensors writer and a
random-weight checkpoint generator driven by a model spec's weight references.

Nothing is materialised beyond one tensor at a time, so full-size shapes can be written for
benchmarks; files and directories appear atomically (temporary name, then rename).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..ir.graph import Graph
from .weights import TORCH_DTYPE

ST_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
            torch.float8_e4m3fn: "F8_E4M3"}


def write_safetensors(path: str | os.PathLike, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      make: Callable[[str], torch.Tensor]) -> None:
    """Write `entries` (name, shape, dtype) in order; `make(name)` returns each tensor when its
    turn comes. The file is written under a temporary name and renamed when complete."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        n = 1
        for d in shape:
            n *= d
        size = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape, dtype in entries:
                t = make(name).to(dtype).contiguous()
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"tensor {name}: made shape {list(t.shape)}, declared {list(shape)}")
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_entries(graph: Graph, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor `graph` reads, per-expert keys expanded, in graph order, once."""
    out, seen = [], set()
    for n in graph.nodes:
        for ref in n.weights:
            keys = [ref.key.format(e=e) for e in range(ref.experts)] if ref.experts else [ref.key]
            for k in keys:
                if k not in seen:
                    seen.add(k)
                    out.append((k, ref.shape, torch.float32 if k.endswith("e_score_correction_bias") else dtype))
    return out


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """Initial values in the style of a trained model's init: norms 1, biases 0, routers wider."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.01
    if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
        return torch.randn(shape, generator=gen) * 0.5
    return torch.randn(shape, generator=gen) * std


def write_random_checkpoint(directory: str | os.PathLike, config: dict, graph: Graph, seed: int = 0) -> Path:
    """Write config.json and model.safetensors with random weights for `graph` into `directory`
    (created atomically: a temporary sibling directory renamed into place)."""
    d = Path(directory)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
    try:
        gen = torch.Generator().manual_seed(seed)
        dtype = TORCH_DTYPE[graph.act_dtype]
        entries = checkpoint_entries(graph, dtype)
        shapes = {k: s for k, s, _ in entries}
        write_safetensors(tmp / "model.safetensors", entries, lambda k: random_tensor(k, shapes[k], gen))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return d
