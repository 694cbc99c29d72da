"""Running a prefill plan on the GPU lanes: every instruction issued in plan order on its lane's
stream, nothing waited for on the host until the step's end.

The plan's lanes map to CUDA streams (`gpu`: compute and the host functions that drive the CPU;
`copy`: activations across PCIe; `fetch`: streamed expert weights, their copy and conversion),
ordered by the plan's record/wait events, so the instructions overlap as the plan's schedule predicts.
Nothing is captured (prompts vary in length). Buffers come from the plan: the pinned exchange arena
(laid out for the bucket's step_tokens; a shorter step uses each view's first rows) and the
fetches' staging arena. Host sources are pinned. Other values are torch tensors freed after their
last reader; one read on another stream than it was made on is recorded there (record_stream), so
its memory is not reused under the reader. How the lanes overlap: docs/design-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..native import binding as native
from ...errors import ConfigError
from ...ir.graph import Node
from ...ir.ops import Op
from ...ir.types import Device
from ...plan.artifact import Plan
from ...frontend.weights import TORCH_DTYPE
from ..base import StepContext, lm_head_rows, node_key, step_output
from ..lending import StagingLayout, lent_of
from .driver import done_flags, exchange_views, host_prologue, native_batches
from ..instructions import run_instructions
from .lanes import Lanes
from .trace import InstructionTimer


@dataclass
class PrefillBound:
    """What a prefill plan's instructions run on, made once per plan: pinned views, native tasks,
    the token-count word they read, staging buffers and the landing buffer of the fetches."""

    arena: torch.Tensor  # pinned uint8: the exchange arena
    views: dict[str, Any]  # value -> pinned view with step_tokens rows
    tokens: torch.Tensor  # pinned int32 [1]: rows of the step being run
    tasks: dict[str, list[native.Batch]]  # task root -> its native batches
    done_at: dict[str, int]  # task root -> device address of its last batch's done flag
    staging: StagingLayout  # where the fetches land: the staging arena and the landing buffer


def _rows(v: Any, n: int) -> Any:
    """The first n rows of a pinned view (a routing: of both its tensors)."""
    return tuple(t[:n] for t in v) if isinstance(v, tuple) else v[:n]


def _tensors(v: Any) -> tuple:
    return v if isinstance(v, tuple) else (v,)


class _DeviceView:
    """Pinned host memory described for torch.as_tensor as device memory: under unified
    addressing the host address is valid on the GPU."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3}


def host_mapped(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A CUDA tensor over the pinned, contiguous host tensor t (no copy): kernels that read it
    fetch its bytes over PCIe themselves, beside the copy engine's queue."""
    raw = torch.as_tensor(_DeviceView(t.data_ptr(), t.numel() * t.element_size()), device=dev)
    return raw.view(t.dtype).view(t.shape)


class PrefillRunner:
    """Runs one prefill plan with GPU work on the cuda_graph backend (see the module doc)."""

    def __init__(self, plan: Plan, be):
        self.plan, self.be, self.g = plan, be, plan.ir
        self.gpu = be.gpu_stream
        self.streams = {"gpu": be.gpu_stream, "copy": be.copy_stream, "fetch": be.fetch_stream}
        self.home = {n.name: n.inputs[1] for n in self.g.nodes if n.op == Op.SYNC}
        self.done = torch.cuda.Event(blocking=True)
        self.bound: PrefillBound | None = None
        self.prologue = {n.name for n in host_prologue(self.g, be, "a prefill on the GPU lanes")}
        self.lane = {s.node: s.lane for s in plan.instructions if s.kind not in ("record", "wait")}
        self.streams_experts = any(s.kind == "fetch" for s in plan.instructions)
        self.recorder, self.gate_layer = None, {}  # routing counted as the GPU's routers run (`set_recorder`)

    def set_recorder(self, recorder, gate_layer: dict[str, int]) -> None:
        """Count each router's picks into `recorder` (None: stop), router node -> its layer."""
        self.recorder, self.gate_layer = recorder, gate_layer

    # ------------------------------------------------------------------------------ binding
    def _bind(self) -> PrefillBound:
        plan, g, be = self.plan, self.g, self.be
        arenas = plan.arena_bytes()
        arena = torch.zeros(max(arenas.get("pinned", 0), 1), dtype=torch.uint8, pin_memory=True)
        views = exchange_views(g, plan.buffers, arena, plan.step_tokens)
        tokens = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        tasks = {n.attrs.task: native_batches(be, g, n, views, self.home, tokens=tokens)
                 for n in g.nodes if n.op == Op.SUBMIT}
        done_at, _, _ = done_flags(be.driver, tasks)
        return PrefillBound(arena=arena, views=views, tokens=tokens, tasks=tasks, done_at=done_at,
                            staging=StagingLayout.of(plan, be.experts.stagers))

    def _staging(self, bound: PrefillBound) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """This step's staging buffers and landing buffer: views of the backend's GPU buffers,
        which every prefill plan shares (they never run at once), so the memory is the largest
        plan's, not the sum; or, for a plan that borrows (Plan.borrows), views of the lent
        experts' region, the shared buffers freed first."""
        lay = bound.staging
        if not lay.at:
            return {}, None
        if self.plan.borrows:  # the lent experts' memory (the VRAM plan's time-share design); the shared
            self.be.release_staging()  # buffers are not counted in this plan's memory
            staging, landing = lent_of(self.be).staging(lay.staging_bytes, lay.landing_bytes)
        else:
            staging, landing = self.be.staging_buffers(lay.staging_bytes, lay.landing_bytes)
        return lay.views(staging, TORCH_DTYPE[self.g.act_dtype]), landing

    # ------------------------------------------------------------------------------ running
    def run(self, input_ids: torch.Tensor, state, trace: bool = False, logits: str = "all", segments=None):
        """One prefill step of input_ids [batch, seq] at state.position (seq * batch at most the
        plan's step_tokens); returns logits as the executor does (with trace, also the plan's
        instructions with measured times). With `segments`, a packed step (`Executor.run`)."""
        b, s = input_ids.shape
        rows = b * s
        if rows > self.plan.step_tokens:
            raise ConfigError(f"a prefill step of {rows} tokens on the {self.plan.step_tokens}-token plan")
        if self.bound is None:
            self.bound = self._bind()
        bound = self.bound
        bound.tokens[0] = rows
        ids = input_ids.reshape(-1).to(torch.int64)
        ctx = StepContext(batch=b, seq=s, position=0 if segments else state.position, state=state, token_ids=ids,
                          logits=logits, segments=segments)
        staged, landing = self._staging(bound)
        for stream in self.streams.values():
            stream.wait_stream(torch.cuda.current_stream())
        lanes = Lanes(self.streams)
        timer = InstructionTimer(self, lanes, self.prologue) if trace else None

        def issue(i, ins, values):
            self._issue(ins, self.g.by_name(ins.node), lanes.stream(ins), values, bound, ctx, rows, staged, landing)

        handlers = dict.fromkeys(("launch", "copy", "fetch", "submit", "sync"), issue)
        values = run_instructions(self.plan, {**handlers, "record": lanes.record, "wait": lanes.wait}, watcher=timer)
        out = values[self.g.outputs[0]]
        for lane in ("copy", "fetch"):
            self.gpu.wait_stream(self.streams[lane])
        self.done.record(self.gpu)
        self.done.synchronize()
        torch.cuda.current_stream().wait_stream(self.gpu)
        native.sync()  # raises here if a CPU task failed
        if not segments:
            state.position += s
        out = None if out is None else step_output(out, b, s, logits, segments)
        return (out, timer.instructions(bound)) if trace else out

    def _issue(self, instr, node: Node, stream, values: dict, bound: PrefillBound, ctx: StepContext, rows: int,
               staged: dict[str, torch.Tensor], landing: torch.Tensor | None) -> None:
        be = self.be
        ins = []
        for v in node.inputs:  # a value another stream made, read here: keep its memory until this stream is done
            src = self.lane.get(v)
            if stream is not None and src in self.streams and src != instr.lane and values.get(v) is not None:
                for t in _tensors(values[v]):
                    if t.is_cuda:
                        t.record_stream(stream)
            ins.append(values.get(v))
        if instr.kind == "launch" and node.place.device == Device.CPU:
            if node.op == Op.INPUT:
                values[node.name] = ctx.token_ids
            elif node.name in self.prologue:  # from the token ids alone, on the host now
                view = _rows(bound.views[node.name], rows) if node.name in bound.views else None
                table = be.weights.get(node_key(node), {}).get("weight") if node.op == Op.EMBED else None
                if view is not None and table is not None and table.dtype == view.dtype:
                    # gathered straight into its pinned view (a new tensor first would cost its page
                    # faults and a second pass: 3x the time for a 32k-token prompt)
                    torch.index_select(table, 0, ins[0], out=view)
                    values[node.name] = view
                    return
                values[node.name] = be.run(node, ins, ctx)
                if view is not None:  # into its pinned view: the copy to the GPU reads it from there
                    view.copy_(values[node.name])
                    values[node.name] = view
            else:  # a task's member: the task computes it into its view
                values[node.name] = _rows(bound.views[node.name], rows) if node.name in bound.views else None
            return
        with torch.cuda.stream(stream):
            if instr.kind == "launch":
                values[node.name] = (lm_head_rows(be, node, ins[0], ctx) if node.op == Op.LM_HEAD
                                     else be.run(node, ins, ctx))
                if self.recorder is not None and node.name in self.gate_layer:
                    self.recorder.add(self.gate_layer[node.name], values[node.name][0], node.attrs.experts)
            elif instr.kind == "fetch":
                values[node.name] = be.experts.stagers[node_key(node)].stage(node.attrs.subset, out=staged[node.name],
                                                                     landing=landing)
            elif instr.kind == "copy":
                values[node.name] = self._copy(node, ins[0], bound, rows)
            elif instr.kind == "submit":
                for batch in bound.tasks[node.attrs.task]:
                    be.driver.launch_host(stream, be.driver.submit_fn, batch.handle)
            elif instr.kind == "sync":
                root = node.inputs[1]
                if bound.tasks[root]:
                    if be.wait == "flag":
                        be.driver.wait_value(stream, bound.done_at[root], 1)
                    else:
                        be.driver.launch_host(stream, be.driver.wait_fn, bound.tasks[root][-1].handle)
                values[node.name] = _rows(bound.views[root], rows)

    def _copy(self, node: Node, src: Any, bound: PrefillBound, rows: int) -> Any:
        """On the current (copy) stream: into the value's pinned view (to the CPU), or from a
        pinned view into new GPU memory (to the GPU)."""
        if node.attrs.dst == "cpu":
            dst = _rows(bound.views[node.name], rows)
            for d, s in zip(_tensors(dst), _tensors(src), strict=True):
                d.copy_(s.view(d.shape), non_blocking=True)
            return dst
        dev = self.be.devices[Device.GPU]
        outs = []
        for t in _tensors(src):
            out = torch.empty(t.shape, dtype=t.dtype, device=dev)
            if self.streams_experts and t.is_pinned() and t.is_contiguous():
                # the copy engine works through a fetch's commands in order: a CPU part's result
                # copied by it waited for the next layer's whole fetch; SMs read it over PCIe now
                torch.mul(host_mapped(t, dev), 1, out=out)
            else:
                out.copy_(t, non_blocking=True)
            outs.append(out)
        return tuple(outs) if isinstance(src, tuple) else outs[0]
