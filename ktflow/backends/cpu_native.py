"""The native backend: the plan's CPU routed-expert nodes (NUMA shards included) run on the C++
fused MoE operator (ktflow.native); every other node runs as in torch_ref.

Each CPU routed-experts node becomes one `ExpertOp` holding exactly the node's experts (its
subset: GPU-resident experts are never packed) and intermediate rows (its NUMA slice), on the
pool group of its NUMA index (or split over every group when the plan did not split it). Packed
weights are cached on disk (KTFLOW_CACHE_DIR, default ~/.cache/ktflow/packed) keyed by the
checkpoint files, the node's tensors and rows, the format and the split, so a second load only
reads them back. The expert weight format is the compile option `expert_format`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from .. import native
from ..ir.graph import Graph, Node
from ..ir.ops import Op
from ..ir.types import Device
from ..weights import WeightSource
from .base import StepContext
from .torch_ref import TorchRefBackend


def cache_dir() -> Path | None:
    """Where packed experts are cached: KTFLOW_CACHE_DIR (default ~/.cache/ktflow/packed); 'off':
    nowhere (pack at every load; for disks without room for a second copy of the experts)."""
    env = os.environ.get("KTFLOW_CACHE_DIR")
    if env == "off":
        return None
    return Path(env or Path.home() / ".cache" / "ktflow" / "packed")


def _checkpoint_digest(weights: WeightSource) -> str:
    """The checkpoint files' identity (name, size, mtime)."""
    h = hashlib.sha256()
    for name, f in sorted(weights.files.items()):
        st = os.stat(f.path)
        h.update(f"{name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _fingerprint(checkpoint: str, node: Node) -> str:
    """What the packed weights of `node` depend on: the checkpoint, the node's tensor keys and
    its experts and rows."""
    h = hashlib.sha256(checkpoint.encode())
    h.update(repr([r.key for r in node.weights]).encode())
    h.update(repr((node.attrs.ids, node.attrs.rows)).encode())
    return h.hexdigest()


class NativeBackend(TorchRefBackend):
    name = "native"

    def __init__(self, gpu_device: str = "cpu", dtype: torch.dtype = torch.bfloat16, options: Any = None):
        native.module()  # a clear error now if the module is not built
        super().__init__(gpu_device, dtype)
        self.expert_format = getattr(options, "expert_format", "bf16")
        self.ops: dict[str, native.ExpertOp] = {}
        self.loaded: dict[str, str] = {}  # node -> 'cache' or 'packed'
        # one operator per (tensors, experts, rows, NUMA node): a deferred node (`.def`, other ranks
        # of the same experts) and other plans' nodes over the same weights share its packed copy
        self._packed: dict[tuple, native.ExpertOp] = {}

    def runs_natively(self, node: Node) -> bool:
        return node.op == Op.ROUTED_EXPERTS and node.place is not None and node.place.device == Device.CPU

    def prepare(self, graph: Graph, weights: WeightSource | None) -> None:
        todo = [n for n in graph.nodes if self.runs_natively(n) and n.name not in self.ops]
        if todo and weights is not None:
            checkpoint = _checkpoint_digest(weights)
            for n in todo:
                key = (tuple(r.key for r in n.weights), n.attrs.ids, n.attrs.rows, n.place.numa)
                if key not in self._packed:
                    self._packed[key] = self._pack(n, weights, checkpoint)
                else:
                    self.loaded[n.name] = "shared"
                self.ops[n.name] = self._packed[key]
                self.weights[n.name] = {}  # nothing for torch_ref to load
        super().prepare(graph, weights)

    def _pack(self, n: Node, weights: WeightSource, checkpoint: str) -> native.ExpertOp:
        a = n.attrs
        lo, hi = a.rows
        pool = native.pool()
        groups = [n.place.numa % pool.groups] if n.place.numa is not None else None
        op = native.ExpertOp(a.experts, a.hidden, hi - lo, held=a.ids, fmt=self.expert_format, groups=groups)
        refs = {r.role: r for r in n.weights}

        def tensors(e: int):
            g, u, d = (weights.load_expert(refs[role], e) for role in ("gate", "up", "down"))
            return g[lo:hi], u[lo:hi], d[:, lo:hi].contiguous()

        self.loaded[n.name] = op.pack(tensors, cache=cache_dir(), fingerprint=_fingerprint(checkpoint, n))
        return op

    def run(self, node: Node, inputs: list[Any], ctx: StepContext) -> Any:
        op = self.ops.get(node.name)
        if op is None:
            return super().run(node, inputs, ctx)
        x, (ids, wts) = inputs
        xb = x.to(torch.bfloat16).contiguous()
        out = torch.empty(xb.shape, dtype=torch.bfloat16)
        op.forward(xb, ids.contiguous(), wts.float().contiguous(), out=out, ranks=node.attrs.rank_range)
        return out.to(x.dtype)
