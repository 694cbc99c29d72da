"""Decode on the GPU: a plan's step bound to its buffers (`Bound`), captured as CUDA graphs and
replayed, one token or a run of tokens a launch (`DecodeGraph`).

Per batch size (a ragged step: per batch size and the caller's caches) the first step is issued
eagerly on the backend's streams and gives its result, then captured; later steps write the token
ids and the position into pinned inputs and replay. Tokens are selected inside the graph (the
argmax, or the state's sampler): only the ids reach the host. `run_tokens` gives what as many calls
of `run` give, in one launch. The stream waits for a CPU task only at its sync. A step that fails
leaves the native dispatcher and the doorbells clean for the next. A new recorder drops the graphs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import InputError, KtflowError
from ...ir.graph import Node
from ...ir.ops import Op
from ...ir.types import Device
from ...plan.artifact import Plan
from ..base import StepContext, node_key
from ..kernels import pinned_copy
from ..native import binding as native
from ..native.staging import pin_tensor
from ..sampling import Sampler, Stages, mark_nonfinite
from .driver import CAPTURE_MODE, done_flags, exchange_views, host_prologue, native_batches
from ..instructions import run_instructions
from .lanes import Lanes
from .trace import InstructionTimer


@dataclass
class Bound:
    """Everything one batch size's decode step is bound to: pinned inputs, the exchange arena
    and its views, the native tasks, the graph and its outputs."""

    batch: int
    tokens: torch.Tensor  # pinned int64 [batch]
    position: torch.Tensor  # pinned int64 [1], or [batch] for a ragged step (a position per row)
    position_dev: torch.Tensor  # the same on the GPU
    arena: torch.Tensor  # pinned uint8
    views: dict[str, Any]  # value -> pinned view (routings: (ids, weights))
    #: task root -> its native batches, run in order (one per NUMA shard: shards after the first add
    #: into the same output); none for a prologue node, computed before the launch
    tasks: dict[str, list[native.Batch]]
    done_at: dict[str, int]  # task root -> device address of its last batch's done flag
    #: submit="doorbell": each batch's (done flag, doorbell) device addresses, and the ring of the
    #: batches in the order the step rings them
    bells: dict[int, tuple[int, int]]
    ring: native.Ring | None
    doorbells: torch.Tensor | None  # the ring's pinned doorbell words, one per batch
    done_words: torch.Tensor  # every batch's pinned done flag
    next_ids: torch.Tensor  # pinned int64 [batch]: the step's argmax, taken on the GPU (logits='argmax')
    logits: torch.Tensor | None = None  # float32 [batch, vocab] on the GPU: the captured graph's output
    graph: torch.cuda.CUDAGraph | None = None
    keep: list = field(default_factory=list)  # values the graph reads or writes
    #: (K, the sampler's tensors' addresses or None: greedy) -> its run (`DecodeGraph.run_tokens`)
    runs: dict[tuple, "TokenRun"] = field(default_factory=dict)
    sampler: Sampler | None = None  # the batch size's static sampler, lent to the sequence decoding


@dataclass
class TokenRun:
    """A run of K steps a launch, each step's token selected on the GPU (greedy or by a
    sampler): the pinned ids [K, batch] it writes, its graph once captured, and the values that
    graph reads or writes."""

    ids: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    keep: list = field(default_factory=list)


class DecodeGraph:
    """Runs a decode plan: captured once per batch size, replayed per token (see module doc)."""

    argmax_on_device = True  # logits='argmax': the graph takes it, only the ids cross
    selects_on_device = True  # logits='sample': the graph selects by the state's sampler, only the ids cross

    def __init__(self, plan: Plan, be):  # be: the CudaGraphBackend that runs it
        self.plan, self.be, self.g = plan, be, plan.ir
        self.gpu, self.copy = be.gpu_stream, be.copy_stream
        self.lanes = Lanes({"gpu": self.gpu, "copy": self.copy})
        # waiting for a step's end sleeps instead of spinning a core the native workers need
        self.done = torch.cuda.Event(blocking=True)
        self.driver = be.driver
        self.bound: dict[int, Bound] = {}  # batch -> its binding over the backend's static caches
        self.ragged: dict[tuple, Bound] = {}  # (batch, the caches' addresses) -> a ragged step's binding
        self.lookups: dict[int, list | None] = {}  # batch -> a run's lookups (`_lookups`)
        self.capture = True  # False: every step eager on the streams (same issue order, no graph)
        self.current = ""  # the node being issued (named in out-of-memory errors)
        self.prologue = host_prologue(self.g, be, "inside a CUDA graph")
        self.inputs = [n.name for n in self.g.nodes if n.op == Op.INPUT]
        self.home = {n.name: n.inputs[1] for n in self.g.nodes if n.op == Op.SYNC}  # sync -> its task's root
        #: a RoutingRecorder whose counters the step adds each router's picks to (inside the graph)
        self.recorder = None
        self.gate_layer: dict[str, int] = {}  # router node -> the MoE layer it routes

    def set_recorder(self, recorder, gate_layer: dict[str, int]) -> None:
        """Count routing into `recorder` (None: stop), each router in `gate_layer` as its layer.
        The step's graphs add to the counters they were captured with, so a change drops them: the
        next step of each batch issues eagerly and captures again, with the new recorder's
        counters made before the capture."""
        if recorder is self.recorder:
            return
        self.recorder, self.gate_layer = recorder, gate_layer
        for bound in (*self.bound.values(), *self.ragged.values()):
            bound.graph, bound.keep, bound.logits = None, [], None
            for run in bound.runs.values():
                run.graph, run.keep = None, []

    def _prepare_recorder(self) -> None:
        if self.recorder is not None:
            for name, layer in self.gate_layer.items():
                self.recorder.prepare(layer, self.g.by_name(name).attrs.experts, "cuda")

    def _run_prologue(self, bound: "Bound", state) -> None:
        if not self.prologue:
            return
        values: dict[str, Any] = dict.fromkeys(self.inputs, bound.tokens)
        ctx = StepContext(batch=bound.batch, seq=1, position=state.position, state=state, token_ids=bound.tokens)
        for n in self.prologue:
            values[n.name] = self.be.run(n, [values[i] for i in n.inputs], ctx)
            if n.name in bound.views:
                bound.views[n.name].copy_(values[n.name])

    # ------------------------------------------------------------------------------ binding
    def _bind(self, b: int, positions: int) -> Bound:
        plan, g = self.plan, self.g
        # the plan's buffer plan is per token: the same layout for any batch
        arena = torch.zeros(max(plan.arena_bytes(b).get("pinned", 0), 1), dtype=torch.uint8, pin_memory=True)
        views = exchange_views(g, plan.buffers, arena, b)
        tasks = {n.attrs.task: native_batches(self.be, g, n, views, self.home) for n in g.nodes if n.op == Op.SUBMIT}
        done_at, flag_at, flags = done_flags(self.driver, tasks)
        bells, ring, words = {}, None, None
        if self.be.submit == "doorbell" and self.be.wait == "flag":  # a host wait counts host submits
            bells, ring, words = self._doorbells(tasks, flag_at)
        pin = dict(pin_memory=True)
        return Bound(batch=b, tokens=torch.zeros(b, dtype=torch.int64, **pin),
                     position=torch.zeros(positions, dtype=torch.int64, **pin),
                     position_dev=torch.zeros(positions, dtype=torch.int64, device="cuda"), arena=arena, views=views,
                     tasks=tasks, done_at=done_at, bells=bells, ring=ring, doorbells=words, done_words=flags,
                     next_ids=torch.zeros(b, dtype=torch.int64, **pin))

    def _doorbells(self, tasks: dict[str, list[native.Batch]], flag_at: dict[int, int]):
        """A pinned doorbell per batch, and the ring of every batch in the order the plan's submit
        instructions ring them (the one GPU lane issues them in plan order)."""
        order = [b for s in self.plan.instructions if s.kind == "submit"
                 for b in tasks[self.g.by_name(s.node).attrs.task]]
        words = torch.zeros(max(len(order), 1), dtype=torch.int32, pin_memory=True)
        base = self.driver.device_address(words)
        bells = {}
        for i, batch in enumerate(order):
            batch.set_doorbell(words[i:i + 1])
            bells[id(batch)] = (flag_at[id(batch)], base + i * words.itemsize)
        return bells, native.Ring(order), words

    # ------------------------------------------------------------------------------ running
    def run(self, input_ids: torch.Tensor, state, trace: bool = False, logits: str = "all",
            positions: torch.Tensor | None = None):
        """One decode step over input_ids [batch, 1] at state.position; returns logits [batch, 1, vocab]
        (float32, CPU: one position, so 'all' and 'last' give the same), or with logits='argmax' the
        greedy next ids [batch, 1] (int64, CPU), taken on the GPU, or with logits='sample' the ids
        state.sampler selects (inside the step's graph: a run of one, `_launch_run`). With trace, also the
        plan's instructions with measured times. With `positions` (a ragged step, `Executor.run`), each
        row at its own position over `state`'s own caches: bound and captured once per batch size
        and caches, and state.position is left as it is."""
        native.set_spinning(True)  # the GPU rings the pool every layer
        b = input_ids.shape[0]
        bound = self._bound_for(state, b, positions is not None)
        bound.tokens.copy_(input_ids.reshape(-1))
        if positions is None:
            bound.position[0] = state.position
        else:
            bound.position.copy_(positions)
        self._run_prologue(bound, state)
        if logits == "sample" and not trace:
            ids = self._launch_run(bound, state, 1, self._sampler(bound, state, positions is not None))
            if positions is None:
                state.position += 1
            return ids.view(b, 1)
        measured = None
        if trace or not self.capture or bound.graph is None:
            with self._abandoned_on_failure(bound):
                measured, out = self._eager(bound, state, trace)
            native.sync()  # raises here if a CPU task failed
            if logits == "sample":  # traced: the eager step's logits, then the sampler
                result = self._sampler(bound, state, positions is not None).select(out).view(b, 1).cpu()
            else:
                result = self._result(bound, out, logits)
            if self.capture and bound.graph is None and not trace:
                self._capture(bound, state)
        else:
            with self._abandoned_on_failure(bound):
                if bound.ring is not None:
                    bound.ring.arm()  # the dispatcher polls the step's doorbells
                with torch.cuda.stream(self.gpu):  # replay launches on the current stream
                    bound.graph.replay()
                self._wait()
            native.sync()
            result = self._result(bound, bound.logits, logits)
        if positions is None:
            state.position += 1
        return (result, measured) if trace else result

    def run_tokens(self, input_ids: torch.Tensor, state, steps: int, sampled: bool = False) -> torch.Tensor | None:
        """`steps` decode steps from input_ids [batch, 1] at state.position, as one graph launch:
        each step's token (its argmax, or with `sampled` the one state.sampler selects) is the
        next step's input, taken and fed back on the GPU, so the host neither waits for nor
        launches the steps between (its turnaround and the graph launch are paid once per
        `steps` tokens). Returns the ids [batch, steps] (int64, CPU); equal to `steps` calls of
        run(logits='argmax' or 'sample'). Captured once per batch size, steps and selection (the
        first call issues the steps eagerly). None where the steps cannot run as one launch (the
        caller runs them one by one): one step, no capture, or a host prologue other than
        embedding lookups the GPU can make from the page-locked table (`pinned_copy.gather_rows`;
        a first step binds the batch's lookups)."""
        native.set_spinning(True)  # the GPU rings the pool every layer
        b = input_ids.shape[0]
        if steps == 1 or not self.capture or self._lookups(b) is None:
            return None
        bound = self._bound_for(state, b, False)
        bound.tokens.copy_(input_ids.reshape(-1))
        bound.position[0] = state.position
        self._run_prologue(bound, state)  # the first step's lookups on the host; the later steps' on the GPU
        ids = self._launch_run(bound, state, steps, self._sampler(bound, state, False) if sampled else None)
        state.position += steps
        return ids

    def _sampler(self, bound: Bound, state, ragged: bool) -> Sampler:
        """The sampler a sampled step of `bound` selects with: a ragged step's is the caller's
        (state.sampler, whose addresses key the run); otherwise the batch size's static one, which
        takes over state.sampler's rows (and becomes it) when it is another."""
        sampler = state.sampler
        if sampler is None:
            raise InputError("a sampled decode step selects by the state's sampling parameters: start them with "
                             "ktflow.runtime.execute.start_sampling")
        if sampler.device.type != "cuda" or sampler.rows != bound.batch:
            raise InputError(f"the state's sampler ({sampler.rows} rows on {sampler.device}) does not fit this "
                             f"step ({bound.batch} rows on the GPU)")
        if ragged:
            return sampler
        if bound.sampler is None:
            bound.sampler = Sampler(bound.batch, sampler.vocab, "cuda")
        if sampler is not bound.sampler:
            bound.sampler.load(sampler)
            state.sampler = bound.sampler
        return bound.sampler

    def _launch_run(self, bound: Bound, state, steps: int, sampler: Sampler | None) -> torch.Tensor:
        """The bound's run of `steps` steps (inputs written) launched, captured after its first
        (eager) launch; returns its ids [batch, steps] (int64, CPU)."""
        # a sampled run is captured per set of selection stages (a graph of fewer stages is replayed
        # only for rows that need no more): CAPTURED_STAGES' few
        stages = sampler.captured_stages() if sampler is not None else None
        key = (steps, sampler.key if sampler is not None else None, stages)
        if key not in bound.runs:
            bound.runs[key] = TokenRun(torch.zeros(steps, bound.batch, dtype=torch.int64, pin_memory=True))
        run = bound.runs[key]
        graph = run.graph if self.capture else None
        with self._abandoned_on_failure(bound):
            if bound.ring is not None:
                for _ in range(steps):
                    bound.ring.arm()  # one pass of the ring per step, polled in order
            if graph is None:
                self.gpu.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.gpu):
                    self._issue(bound, state, None, steps, run, sampler, stages)
            else:
                with torch.cuda.stream(self.gpu):
                    graph.replay()
            self._wait()
        native.sync()
        ids = run.ids.clone().T.contiguous()
        if graph is None and self.capture:
            self._capture_run(bound, state, run, sampler, stages)
        return ids

    def _lookups(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The host prologue as lookups a step can make on the GPU from the ids it computed: (its
        pinned view [b, width], the page-locked table) per prologue node; None where a node is not
        an embedding of the token ids whose table can be page-locked and gathered from."""
        if b not in self.bound:
            return None if self.prologue else []  # (a first step binds; runs follow it)
        if b not in self.lookups:
            self.lookups[b] = self._find_lookups(self.bound[b], b)
        return self.lookups[b]

    def _find_lookups(self, bound: Bound, b: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        out = []
        for n in self.prologue:
            table = self.be.weights.get(node_key(n), {}).get("weight") if n.op == Op.EMBED else None
            view = bound.views.get(n.name)
            if table is None or view is None:
                return None
            view = view.view(b, -1)
            # the kernel's other conditions first: page-locking a table that then is not gathered from
            # would cost its registration (and, for a private mapping, a copy of every page)
            if not (pinned_copy.can_gather(table, view, pinned=False) and pin_tensor(table)
                    and pinned_copy.can_gather(table, view)):
                return None
            out.append((view, table))
        return out

    def _capture_run(self, bound: Bound, state, run: TokenRun, sampler: Sampler | None, stages: Stages | None) -> None:
        graph = torch.cuda.CUDAGraph()
        self._prepare_recorder()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, stream=self.gpu, capture_error_mode=CAPTURE_MODE):
                run.keep, _ = self._issue(bound, state, None, run.ids.shape[0], run, sampler, stages)
        except torch.cuda.OutOfMemoryError:
            raise self._oom(bound) from None
        run.graph = graph

    def _bound_for(self, state, b: int, ragged: bool) -> Bound:
        """The binding of this step: per batch size over the backend's static caches (checked to
        be this state's), or, for a ragged step, per batch size and the caller's caches (the
        graph captures their addresses)."""
        if not ragged:
            self._check_cache(state, b)
            if b not in self.bound:
                self.bound[b] = self._bind(b, 1)
            return self.bound[b]
        key = (b, tuple(t.data_ptr() for ts in state.kv.values() for t in ts))
        if key not in self.ragged:
            self.ragged[key] = self._bind(b, b)
        return self.ragged[key]

    @staticmethod
    def _result(bound: Bound, out: torch.Tensor, logits: str) -> torch.Tensor:
        """The finished step's greedy ids [batch, 1], or its logits [batch, 1, vocab] copied to the host."""
        if logits == "argmax":
            return bound.next_ids.clone().view(bound.batch, 1)
        return out.view(bound.batch, 1, -1).to("cpu")

    def _check_cache(self, state, b: int) -> None:
        if self.be.static_kv.owner(b) is not state:
            raise InputError("this sequence's KV cache is no longer its own: the cuda_graph backend keeps one static "
                             f"cache per batch size ({b}), and a later prefill of that batch size took it over; "
                             "decode a sequence before starting the next one of the same batch size")

    def _ctx(self, bound: Bound, state, k: int = 0) -> StepContext:
        """The context of the step k steps after state.position (a fresh one per step: the values a
        step shares between layers are the step's own)."""
        return StepContext(batch=bound.batch, seq=1, position=state.position + k, state=state,
                           token_ids=bound.tokens, position_t=bound.position_dev)

    def _eager(self, bound: Bound, state, trace: bool):
        """One step issued on the streams, not captured: (its measured instructions with trace, its
        logits)."""
        if bound.ring is not None:
            bound.ring.arm()
        self.gpu.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.gpu):
            timer = InstructionTimer(self, self.lanes) if trace else None
            _, out = self._issue(bound, state, timer)
        self._wait()
        return (timer.instructions(bound) if timer else None), out

    @contextlib.contextmanager
    def _abandoned_on_failure(self, bound: Bound):
        """Around arming a step's ring and issuing or launching what rings it: on a failure there
        (a rule raising mid-issue, a launch or the wait failing) the passes armed are not all
        coming. The dispatcher is told so (it drops them and releases the done flags of the pass
        it polls); the GPU work already issued drains, its waits released from the host (a later
        step of a greedy run clears a flag again before it waits: the flags are set until the
        streams are idle, 10 s at most); the doorbells it rang after the dispatcher stopped
        looking are cleared, so the next step's pass starts clean."""
        try:
            yield
        except BaseException:
            if bound.ring is not None:
                bound.ring.disarm()
                try:
                    deadline = time.monotonic() + 10
                    while not (self.gpu.query() and self.copy.query()) and time.monotonic() < deadline:
                        bound.done_words.fill_(1)
                        time.sleep(50e-6)
                    native.sync()
                except Exception:  # noqa: BLE001 - the failure being raised is the one to report
                    pass
                bound.doorbells.zero_()
            raise

    def _wait(self) -> None:
        self.done.record(self.gpu)
        self.done.synchronize()

    def _capture(self, bound: Bound, state) -> None:
        graph = torch.cuda.CUDAGraph()
        self._prepare_recorder()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, stream=self.gpu, capture_error_mode=CAPTURE_MODE):
                bound.keep, bound.logits = self._issue(bound, state, None)
        except torch.cuda.OutOfMemoryError:
            raise self._oom(bound) from None
        bound.graph = graph

    def _oom(self, bound: Bound) -> KtflowError:
        free, total = torch.cuda.mem_get_info()
        m = self.plan.memory
        return KtflowError(f"CUDA out of memory while capturing the decode step for batch {bound.batch}, at "
                           f"{self.current}: {torch.cuda.memory_allocated() / 1e9:.2f} GB allocated by torch, "
                           f"{free / 1e9:.2f} GB free of {total / 1e9:.2f} GB; the plan predicted a peak of "
                           f"{m.gpu_bytes / 1e9:.2f} GB (weights, KV cache {m.kv_cache_bytes / 1e9:.2f} GB, "
                           f"activations {m.activation_bytes / 1e6:.1f} MB, BLAS workspaces {m.workspace_bytes / 1e6:.0f} MB, "
                           f"staging {m.staging_bytes / 1e9:.2f} GB). Lower max_seq_len or max_batch, or the VRAM "
                           "limit (vram_gb), and recompile")

    def _issue(self, bound: Bound, state, timer, steps: int = 1, run: TokenRun | None = None,
               sampler: Sampler | None = None, stages: Stages | None = None) -> tuple[list, torch.Tensor]:
        """Issue the plan's instructions in order on the streams; returns every value (kept alive
        with the graph that reads them) and the logits [batch, vocab] on the GPU, which stay there
        unless the caller asks for them. Each step's token is selected on the GPU: the argmax, or
        with a `sampler` the token it selects by `stages` (the run's key: its rows need no more). Without a `run`, one step whose token goes to the pinned
        `next_ids` (8 bytes a row cross instead of the logits).

        With a `run` of K steps (`run_tokens`), K decode steps one after another: step k's
        token goes to row k of the run's pinned ids and into the pinned token ids step k + 1
        reads, and the position advances on the GPU; the logits returned are the last step's."""
        pinned_copy.copy(bound.position_dev, bound.position)
        kept: list = []
        for k in range(steps):
            if k:
                bound.position_dev.add_(1)
            values, out = self._issue_step(bound, self._ctx(bound, state, k), timer)
            kept += values
            # -1 in a row whose logits are not finite: the host refuses it (errors.require_finite)
            ids = sampler.select(out, stages) if sampler is not None else mark_nonfinite(out, out.argmax(-1))
            if run is None:
                pinned_copy.copy(bound.next_ids, ids)
                break
            pinned_copy.copy(run.ids[k], ids)
            if k + 1 < steps:
                fed = ids.clamp(min=0)  # a refused row's later steps read a real id (their ids are dropped)
                pinned_copy.copy(bound.tokens, fed)  # the next step's input, read where the first step's was
                for view, table in self._lookups(bound.batch):  # the host prologue's lookups, made here
                    pinned_copy.gather_rows(view, table, fed)
        self.current = ""
        return kept, out

    def _issue_step(self, bound: Bound, ctx: StepContext, timer: InstructionTimer | None) -> tuple[list, torch.Tensor]:
        """One decode step's plan instructions in order on the streams (the position already on the
        GPU), through the one instruction loop: every value (none freed: the graph keeps them), and
        the logits [batch, vocab] on the GPU."""
        be, g, lanes = self.be, self.g, self.lanes

        def launch(i, ins, values):
            node = g.by_name(ins.node)
            self.current = node.name
            if node.place.device == Device.CPU:  # input, prologue or a task's part
                values[node.name] = bound.tokens if node.op == Op.INPUT else bound.views.get(node.name)
            elif node.op == Op.INPUT:  # token ids read on the GPU: copied from their pinned buffer in the graph
                values[node.name] = pinned_copy.copy(torch.empty_like(bound.tokens, device="cuda"), bound.tokens)
            else:
                values[node.name] = be.run(node, [values[v] for v in node.inputs], ctx)
                if self.recorder is not None and node.name in self.gate_layer:
                    self.recorder.add(self.gate_layer[node.name], values[node.name][0], node.attrs.experts)

        def copy(i, ins, values):
            node = g.by_name(ins.node)
            self.current = node.name
            values[node.name] = self._copy(node, values[node.inputs[0]], bound, lanes.stream(ins))

        def submit(i, ins, values):
            self.current = ins.node
            stream = lanes.stream(ins)
            for batch in bound.tasks[g.by_name(ins.node).attrs.task]:
                if bound.ring is not None:  # clear its done flag, then ring: the dispatcher runs it
                    flag, bell = bound.bells[id(batch)]
                    self.driver.write_value(stream, flag, 0)
                    self.driver.write_value(stream, bell, 1)
                else:
                    self.driver.launch_host(stream, self.driver.submit_fn, batch.handle)

        def sync(i, ins, values):  # a task without batches is a prologue node, computed before the launch
            node = g.by_name(ins.node)
            self.current = node.name
            root = node.inputs[1]
            if bound.tasks[root]:
                if be.wait == "flag":
                    self.driver.wait_value(lanes.stream(ins), bound.done_at[root], 1)
                else:
                    self.driver.launch_host(lanes.stream(ins), self.driver.wait_fn, bound.tasks[root][-1].handle)
            values[node.name] = bound.views[root]

        lanes.events.clear()
        # fork the copy stream from the step's stream (under capture this makes it part of the graph;
        # a copy whose only ordering is a CPU-lane event, such as the token ids', would escape it)
        self.copy.wait_stream(self.gpu)
        values = run_instructions(self.plan, {"launch": launch, "copy": copy, "submit": submit, "sync": sync,
                                              "record": lanes.record, "wait": lanes.wait}, free=False, watcher=timer)
        out = values[g.outputs[0]].view(bound.batch, -1)
        self.gpu.wait_stream(self.copy)  # join it back
        return list(values.values()), out

    def _copy(self, node: Node, src: Any, bound: Bound, stream: torch.cuda.Stream) -> Any:
        if node.attrs.dst == "cpu":
            dst = bound.views[node.name]
            with torch.cuda.stream(stream):
                for d, s in zip(dst, src, strict=True) if isinstance(dst, tuple) else ((dst, src),):
                    pinned_copy.copy(d, s.reshape(d.shape))
            return dst
        if isinstance(src, tuple):  # a routing the CPU produced
            outs = tuple(torch.empty(s.shape, dtype=s.dtype, device="cuda") for s in src)
        else:
            outs = (torch.empty(src.shape, dtype=src.dtype, device="cuda"),)
        with torch.cuda.stream(stream):
            for d, s in zip(outs, src if isinstance(src, tuple) else (src,), strict=True):
                pinned_copy.copy(d, s)
        return outs if isinstance(src, tuple) else outs[0]
