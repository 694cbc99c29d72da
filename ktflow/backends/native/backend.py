"""The native backend ("native"): the plan's CPU routed experts on the native pool
(experts.py's `NativeExperts`), every other node by the reference rules (torch_ref.py's
`TorchRefBackend`), composed: the reference engine takes the native side's rules for GPU routed
experts and fetches, and a node the native side prepared runs there. The expert weight format is
the compile option `expert_format`.
"""

from __future__ import annotations

from typing import Any

import torch

from ...frontend.weights import WeightSource
from ...ir.graph import Graph, Node
from ...ir.types import Device
from ..base import StepContext, node_key
from ..kv import StaticCaches
from ..torch_ref import TorchRefBackend
from .experts import NativeExperts
from .staging import ExpertStager


class NativeBackend:
    name = "native"

    def __init__(self, gpu_device: str = "cpu", dtype: torch.dtype = torch.bfloat16, options: Any = None, *,
                 static_kv: StaticCaches | None = None):
        """`static_kv`: the KV caches are lent from it (the CUDA backend's)."""
        self.ref = TorchRefBackend(gpu_device, dtype, static_kv=static_kv)
        self.experts = NativeExperts(dtype, getattr(options, "expert_format", "bf16"), self.ref.device_of)
        self.ref.rules.update(self.experts.rules())
        # the step's other ops run in torch on the CPU between the pool's runs: the pool sleeps
        # between them rather than spin on those cores (native.set_spinning)
        self.torch_on_cpu = self.ref.devices[Device.GPU].type == "cpu"

    # the reference engine's state, read by the runners and the expert cache
    @property
    def dtype(self) -> torch.dtype:
        return self.ref.dtype

    @property
    def devices(self) -> dict:
        return self.ref.devices

    @property
    def weights(self) -> dict:
        return self.ref.weights

    @property
    def loaded(self) -> dict[str, str]:
        return self.experts.loaded

    def device_of(self, node: Node) -> torch.device:
        return self.ref.device_of(node)

    def prepare(self, graph: Graph, weights: WeightSource | None) -> None:
        for n in self.experts.prepare(graph, weights):
            self.ref.weights[node_key(n)] = {}  # packed by the native side: nothing for the engine to load
        self.ref.prepare(graph, weights)

    def run(self, node: Node, inputs: list[Any], ctx: StepContext) -> Any:
        if self.experts.runs(node):
            return self.experts.run(node, inputs, spin=not self.torch_on_cpu)
        return self.ref.run(node, inputs, ctx)

    @property
    def lent(self):
        return self.ref.lent

    def lend(self, nodes: list[Node]) -> None:
        self.ref.lend(nodes)

    # the experts interface (runtime.expert_cache's)
    def stacked(self, node: Node) -> dict:
        return self.ref.stacked(node)

    def place_experts(self, node: Node, moves: dict[int, int | None]) -> None:
        self.ref.place_experts(node, moves)

    def cpu_expert_mask(self, node: Node) -> torch.Tensor | None:
        return self.experts.cpu_expert_mask(node)

    def cpu_expert_stager(self, parts: list[Node], weights: WeightSource, device) -> ExpertStager:
        return self.experts.cpu_expert_stager(parts, weights, device)
