"""The CUDA-graph backend: a hybrid decode step, every layer, as one CUDA graph.

GPU-placed nodes run as PyTorch CUDA ops (the static-shape rules of static_rules.py where
torch_ref's are not capturable); CPU routed experts run on the native queue (cpu_native). The
decode plan's steps are issued in plan order onto two CUDA streams, one per GPU lane of the plan
(`gpu`: compute, and the host functions that drive the CPU; `copy`: PCIe copies), ordered by the
plan's record/wait events:

- copy to the CPU: the value is written into its slot of the pinned exchange arena, laid out by
  the plan's buffer plan (one arena for the whole step, slots reused across layers);
- submit: the backend's `submit` (default: doorbell where the driver runs stream write-value
  operations). "host": a host node (`cuLaunchHostFunc`) calling
  `ktf_submit(batch)`, which only enqueues the task's prepared native batch, whose jobs read and
  write the pinned slots. "doorbell": two stream write-value operations (`cuStreamWriteValue32`),
  one clearing the batch's done flag, one setting its doorbell, a pinned word the native
  dispatcher polls while the step's ring of batches is armed (armed by the host before each
  launch): no host function, no driver callback thread, no wake-up on the way. Either way the
  stream goes on with the GPU work the plan put between submit and sync (the shared expert;
  under deferral the next layer's attention and router);
- sync: the stream waits for that task only, not for deferred tasks queued after it. Two ways
  (the backend's `wait`): "flag", the default, a wait-value operation (`cuStreamWaitValue32`) on
  the batch's done flag, a pinned word the native dispatcher sets once the outputs are written;
  the GPU polls it and no host thread blocks; "host", a host node calling
  `ktf_wait_batch(batch)`, which holds the driver's one host-function thread until the task has
  run (a submit behind it on another stream waits too);
- copy to the GPU: from the task's pinned slot after the sync.

For each batch size the first decode step runs eagerly on those streams (warming up and giving
that step's logits), then the same issue sequence is captured once into a graph with
`torch.cuda.graph`; later steps write the token ids and the position into pinned inputs and
replay it: one graph launch per token. KV caches are static: one set per batch size, owned by the
backend and lent to the sequence that prefilled last. Prefill plans run through
backends.prefill_runner: issued on the same lanes, not captured (prompts vary in length).

Token selection: a step's logits stay on the GPU. Its argmax goes to the pinned `next_ids`
(logits='argmax'), or a sampled step (logits='sample') selects each row's token by the state's
sampler (`backends.sampling`: temperature, top-p/k, min-p, penalties, logit_bias, a seed per row)
inside the same graph, captured once per batch size: only the ids reach the host. The sampler's
tensors are static like the KV caches: the backend keeps one per batch size and lends it to the
sequence decoding (a ragged step uses its caller's, whose addresses key the graph).

Runs (`DecodeGraph.run_tokens`): K decode steps issued one after another and captured as one
graph per batch size, K and selection (greedy or sampled); each step's token goes into the pinned
token ids the next step reads (and its row of the run's pinned ids), the position advances on the
GPU, and the ring is armed K times before the launch. A host prologue of embedding lookups is made on the GPU for the
steps after the first, from the page-locked table; any other prologue runs one step a launch.

CPU threads: the native pool's pinned workers spin between tasks, so they get every CPU but two
(the Python thread, and the driver's host-function thread that runs host-node submits; the
Python thread is confined to those two, `keep_off_workers`, and the pool's dispatcher pinned to
its thread 0's CPU), and torch's
own CPU ops one thread (`torch.set_num_threads(1)`, process-wide): an OpenMP team spinning after
a parallel op (a logits copy, a caller's sampling on the CPU) takes the workers' cores.

`trace=True` runs a step eagerly with CUDA events around every GPU step and the native queue's
timestamps for the CPU tasks, and returns it as the plan's steps with measured times.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...errors import ConfigError
from ...ir.graph import Graph
from ...ir.types import Device
from ...plan.artifact import Plan
from ..base import StepContext
from ..native import binding as native
from ..native.backend import NativeBackend
from ..native.staging import pin
from .decode import DecodeGraph
from .driver import Driver, expandable_segments, keep_off_workers
from .prefill import PrefillRunner
from .static_rules import StaticRules


class CudaGraphBackend(StaticRules, NativeBackend):
    name = "cuda_graph"

    #: how a captured step waits for a CPU task: "flag" (the stream waits on the task's done flag,
    #: cuStreamWaitValue32) or "host" (a host node calling ktf_wait_batch, which blocks the driver's
    #: host-function thread until the task has run); "auto": flag where the driver supports it
    WAITS = ("auto", "flag", "host")
    #: how a step submits a CPU task: "host" (a host node calling ktf_submit) or "doorbell" (the
    #: stream writes the batch's doorbell word, which the armed native dispatcher polls; needs the
    #: flag wait); "auto": doorbell where the driver supports it (a traced Qwen3-shaped step on the
    #: GPU host: 41 us from the inputs in host memory to the task's start, against 147 us through
    #: a host node; benchmarks/RESULTS.md)
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
        # after each parallel op would take the workers' cores (GPU host, DeepSeek-V2-Lite shape, 15
        # workers: decode 31.8 tok/s with one torch thread, 23.0 with sixteen; benchmarks/RESULTS.md)
        keep_off_workers(native.pool(spare=2))
        torch.set_num_threads(1)
        expandable_segments()
        super().__init__(gpu_device, dtype, options)
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
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (layer, batch) -> static caches
        self.kv_owner: dict[int, Any] = {}  # batch -> weakref to the state using those caches
        self.static_setup()

    def cache(self, ctx: StepContext, attrs, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """The static caches of this batch size (the graph captured their addresses), lent to
        the sequence that prefilled last."""
        state, b = ctx.state, ctx.batch
        if attrs.layer not in state.kv:
            key = (attrs.layer, b, str(dev), state.max_seq_len)
            if key not in self.kv:
                self.kv[key] = super().cache(ctx, attrs, dev)  # allocates into state.kv
            state.kv[attrs.layer] = self.kv[key]
            self.kv_owner[b] = weakref.ref(state)
        return state.kv[attrs.layer]

    def prepare(self, graph: Graph, weights) -> None:
        super().prepare(graph, weights)
        self.fuse_weights(graph)
        for stager in self.stagers.values():  # host memory experts are streamed from: page-locked, once
            for piece in stager.pieces:
                pin(piece.op)

    def staging_buffers(self, staging: int, landing: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """GPU buffers every prefill plan's streamed experts share (grown to the largest asked
        for): the staging slots, and the landing buffer packed experts are copied into. A prefill
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


