"""The CUDA-graph backend (`CudaGraphBackend`, "cuda_graph"): a hybrid plan's GPU nodes as PyTorch
CUDA ops (static_rules.py's capturable rules in decode), its CPU routed experts on the native pool.

Decode plans with GPU work run through decode.py's `DecodeGraph` (captured once per batch size,
one graph launch per token or run of tokens), prefill plans through prefill.py's `PrefillRunner`
(issued on the same lanes, not captured); driver.py is the hand-off to the CPU, trace.py one
measured eager step. It computes in bfloat16 on a CUDA device (else ConfigError). `wait` ("flag",
"host") and `submit` ("doorbell", "host") choose how a step waits for and hands over a CPU task:
"auto" takes the first the driver runs (doorbell needs the flag wait), one it refuses is a
ConfigError. KV caches are static: one set per batch size, owned here and lent to the sequence
that prefilled last. Constructing one changes the process: the native workers get every CPU but
two, the calling thread is confined to those two, torch's CPU ops get one thread, and the CUDA
allocator uses expandable segments unless PYTORCH_CUDA_ALLOC_CONF is set. How a step runs, and
why: docs/design-notes.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError
from ...ir.graph import Graph
from ...ir.types import Device
from ...plan.artifact import Plan
from ..kv import StaticCaches
from ..native import binding as native
from ..native.backend import NativeBackend
from ..native.staging import pin
from .decode import DecodeGraph
from .driver import Driver, expandable_segments, keep_off_workers
from .prefill import PrefillRunner
from .static_rules import fuse_weights, static_rules


class CudaGraphBackend(NativeBackend):
    name = "cuda_graph"

    #: how a captured step waits for a CPU task: "flag" (the stream waits on the task's done flag,
    #: cuStreamWaitValue32) or "host" (a host node calling ktf_wait_batch, which blocks the driver's
    #: host-function thread until the task has run); "auto": flag where the driver supports it
    WAITS = ("auto", "flag", "host")
    #: how a step submits a CPU task: "host" (a host node calling ktf_submit) or "doorbell" (the
    #: stream writes the batch's doorbell word, which the armed native dispatcher polls; needs the
    #: flag wait); "auto": doorbell where the driver supports it (it starts a task sooner than a
    #: host node: docs/design-notes.md)
    SUBMITS = ("auto", "host", "doorbell")

    def __init__(self, gpu_device: str = "cuda", dtype: torch.dtype = torch.bfloat16, options: Any = None,
                 wait: str = "auto", submit: str = "auto"):
        if wait not in self.WAITS:
            raise ConfigError(f"wait={wait!r}: the cuda_graph backend waits for CPU tasks with one of {self.WAITS}")
        if submit not in self.SUBMITS:
            raise ConfigError(f"submit={submit!r}: the cuda_graph backend submits CPU tasks with one of {self.SUBMITS}")
        if gpu_device != "cuda" or not torch.cuda.is_available():
            raise ConfigError("the cuda_graph backend runs GPU nodes on a CUDA device: "
                              + ("torch sees none here; compile for this machine (`ktflow compile --hw this`, or "
                                 "device='cpu')" if not torch.cuda.is_available() else
                                 f"this plan runs them on {gpu_device}") + ", or use backend='native'")
        if dtype != torch.bfloat16:
            raise ConfigError(f"the cuda_graph backend computes in bfloat16 (the native experts' activations); "
                              f"this plan computes in {dtype}: compile with dtype='bfloat16' or use backend='native'")
        # the native workers are pinned and spin between tasks: they get all CPUs but two (the Python
        # thread and the driver's host-function thread that runs submits), and torch's own CPU ops
        # (the embedding, the logits copy, a caller's sampling) one thread: an OpenMP team that spins
        # after each parallel op would take the workers' cores (measured: docs/design-notes.md)
        keep_off_workers(native.pool(spare=2))
        torch.set_num_threads(1)
        expandable_segments()
        # the native backend (the reference engine with the native side's rules) with the
        # static-shape rules put into the engine, and its KV caches lent from static ones (the
        # captured graphs read their addresses), one set per batch size
        self.static_kv = StaticCaches(dtype)
        super().__init__(gpu_device, dtype, options, static_kv=self.static_kv)
        self.ref.rules.update(static_rules(self.ref.rules))
        self.driver = Driver()
        if wait == "auto":
            wait = "flag" if self.driver.can_wait_value() else "host"
        elif wait == "flag" and not self.driver.can_wait_value():
            raise ConfigError("wait='flag' needs stream memory operations (cuStreamWaitValue32 on pinned host memory), "
                              "which this driver or GPU refuses; use wait='host'")
        if submit == "auto":
            submit = "doorbell" if wait == "flag" and self.driver.can_write_value() else "host"
        elif submit == "doorbell" and (wait != "flag" or not self.driver.can_write_value()):
            raise ConfigError("submit='doorbell' needs the flag wait and stream write-value operations "
                              "(cuStreamWriteValue32 on pinned host memory); use submit='host'")
        self.submit = submit
        self.wait = wait
        # the lanes' streams, shared by every decode plan this backend runs: each stream that runs a
        # matrix product keeps a BLAS workspace for good, so a stream pair per plan would leak one each
        self.gpu_stream, self.copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self.fetch_stream = torch.cuda.Stream()  # prefill's streamed expert weights: copies and conversion
        self._staging: torch.Tensor | None = None
        self._landing: torch.Tensor | None = None

    def prepare(self, graph: Graph, weights) -> None:
        super().prepare(graph, weights)
        fuse_weights(graph, self.weights)
        for stager in self.experts.stagers.values():  # host memory experts are streamed from: page-locked, once
            for piece in stager.pieces:
                pin(piece.op)

    def staging_buffers(self, staging: int, landing: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GPU buffers every prefill plan's streamed experts share (grown to the largest asked
        for): the staging buffers, and the landing buffer packed experts are copied into. A prefill
        step ends with its streams synchronized, so a buffer replaced here is no longer read."""
        if self._staging is None or self._staging.numel() < staging:
            self._staging = None
            self._staging = torch.empty(max(staging, 1), dtype=torch.uint8, device="cuda")
        if landing and (self._landing is None or self._landing.numel() < landing):
            self._landing = None
            self._landing = torch.empty(landing, dtype=torch.uint8, device="cuda")
        return self._staging, self._landing

    def release_staging(self) -> None:
        """Free the shared staging buffers (the next prefill that streams makes them again)."""
        self._staging = self._landing = None

    def step_runner(self, plan: Plan):
        """Decode plans with GPU work run through a DecodeGraph (captured), prefill plans with
        GPU work through a PrefillRunner (issued on the lanes); others by the executor (None)."""
        if plan.phase == "decode":
            return DecodeGraph(plan, self) if plan.capture else None
        if any(n.place.device == Device.GPU for n in plan.ir.nodes):
            return PrefillRunner(plan, self)
        return None


