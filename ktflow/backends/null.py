"""A backend that computes nothing and records the calls it gets: schedule and executor tests
run with it on any machine. Values are placeholders with the right shape (zeros)."""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node
from ..ir.ops import Op
from ..ir.types import TOKENS


class NullBackend:
    name = "null"

    def __init__(self, gpu_device: str = "cpu", dtype: torch.dtype = torch.float32, options=None):
        self.gpu_device, self.dtype = gpu_device, dtype
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []
        self.prepared: list[str] = []

    def prepare(self, graph: Graph, weights) -> None:
        self.prepared += [n.name for n in graph.nodes if n.name not in self.prepared]

    def run(self, node: Node, inputs, ctx):
        t = ctx.batch * ctx.seq
        shape = tuple(t if d == TOKENS else d for d in node.out.shape)
        self.calls.append((node.name, node.op.value, shape))
        if node.op == Op.GATE:
            return (torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.float32))
        if node.op == Op.INPUT:
            return ctx.token_ids
        return torch.zeros(shape, dtype=self.dtype)
