"""The executor runs a plan on a backend: through the backend's own runner where it has one (the
CUDA decode graph, the prefill on the GPU lanes), else eagerly through the one instruction loop
(backends/instructions.py), each node's instruction handed to the backend. The sequence state (KV
caches, position) lives in `State` and is advanced here.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

from ..backends import StepContext
from ..backends.base import lm_head_rows, step_output
from ..backends.instructions import nothing, run_instructions
from ..backends.lending import StagingLayout, lent_of
from ..backends.sampling import mark_nonfinite
from ..errors import require_finite
from ..frontend.weights import TORCH_DTYPE
from ..ir.graph import Graph
from ..ir.ops import Op
from ..plan.artifact import Plan, Instruction
from .routing import gate_layers
from .state import State
from ..util import env


def _check_finite(v: Any, what: str) -> None:
    """A NumericError naming `what` if a float tensor in v (a tensor or a tuple) holds a NaN or
    an infinity."""
    from ..errors import NumericError
    from ..frontend.weights import first_non_finite

    for t in v if isinstance(v, tuple) else (v,):
        bad = first_non_finite(t) if isinstance(t, torch.Tensor) else None
        if bad is not None:
            raise NumericError(f"{what} produced {bad[1]} at {bad[0]} of shape {list(t.shape)}")


class _EagerWatcher:
    """Around each instruction of an eager run: the finite-value check (KTFLOW_CHECK_FINITE) and,
    when traced, the instruction's host time (GPU work synced: instructions run one after another
    here)."""

    def __init__(self, ex: "Executor", ctx: StepContext, tracing: bool):
        self.ex, self.ctx, self.timed = ex, ctx, [] if tracing else None
        self.t0 = time.perf_counter()

    def before(self, i: int, ins: Instruction) -> None:
        pass

    def after(self, i: int, ins: Instruction, values: dict) -> None:
        ex = self.ex
        if ex.check_finite and ins.writes:
            _check_finite(values.get(ins.writes[0]), f"node {ins.node} ({ex.graph.by_name(ins.node).op.value}, "
                          f"{ex.plan.phase} step at position {self.ctx.state.position})")
        if self.timed is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = (time.perf_counter() - self.t0) * 1e6
            start = self.timed[-1].end_us if self.timed else 0.0
            self.timed.append(ins.model_copy(update={"start_us": round(start, 3), "end_us": round(now, 3)}))


class Executor:
    def __init__(self, plan: Plan, backend: Any):
        self.plan, self.backend = plan, backend
        self.graph: Graph = plan.ir
        self.attention_layers = frozenset(n.attrs.layer for n in self.graph.nodes if n.op == Op.ATTENTION)
        #: a RoutingRecorder (runtime/routing.py) that sees every router's picks, or None
        self.recorder = None
        self.gate_layer = gate_layers(self.graph)
        #: what State.keep_hidden keeps: what the lm_head reads (the final normalised hidden states,
        #: which a multi-token-prediction layer reads), or in a graph that reads hidden vectors (that
        #: layer's own) the input of its final norm, which its next chained draft step reads
        head_input = next(n.inputs[0] for n in self.graph.nodes if n.op == Op.LM_HEAD)
        final = self.graph.by_name(head_input)
        reads_hidden = any(n.op == Op.INPUT and n.attrs.hidden for n in self.graph.nodes)
        self.kept_hidden = final.inputs[0] if reads_hidden and final.op == Op.RMSNORM else head_input
        #: called after each finished run as hook(executor, tokens it ran): a runtime policy's
        #: point between steps (the expert cache refills there: runtime/expert_cache.py)
        self.after_run: list[Callable[["Executor", int], None]] = []
        # a backend may run a whole plan its own way (cuda_graph: decode captured as one graph)
        make_runner = getattr(backend, "step_runner", None)
        self.runner = make_runner(plan) if make_runner else None
        #: runs left to trace: each traced run keeps its instructions with measured times in `measured`
        self.trace = 0
        #: check every value an instruction writes for NaN and infinity (the first bad node is named); a
        #: plan the backend runs as a whole (a captured graph) has its output checked
        self.check_finite = env.get("KTFLOW_CHECK_FINITE")
        self.measured: list[Instruction] | None = None
        self._staging_layout = None  # a borrowing plan's (lending.StagingLayout), made at its first step

    def _launch(self, ctx: StepContext, i: int, ins: Instruction, values: dict) -> None:
        node = self.graph.by_name(ins.node)
        inputs = [values[i] for i in node.inputs]
        if node.op == Op.LM_HEAD:
            values[ins.writes[0]] = lm_head_rows(self.backend, node, inputs[0], ctx)
            return
        values[ins.writes[0]] = self.backend.run(node, inputs, ctx)
        if self.recorder is not None and node.op == Op.GATE and node.name in self.gate_layer:
            self.recorder.add(self.gate_layer[node.name], values[ins.writes[0]][0], node.attrs.experts)

    def _hand_recorder(self) -> None:
        """A runner that runs the plan as a whole counts the routing itself (inside its graph);
        one that cannot is an error naming the backend."""
        if hasattr(self.runner, "set_recorder"):
            self.runner.set_recorder(self.recorder, self.gate_layer)
        elif self.recorder is not None:
            from ..errors import ConfigError

            raise ConfigError(f"routing is recorded op by op, but the {self.backend.name} backend runs this "
                              f"{self.plan.phase} plan as a whole: compile with backend='native' to record it")

    def tokens(self, input_ids: torch.Tensor, state: State, steps: int, sampled: bool = False) -> torch.Tensor:
        """`steps` decode steps from input_ids [batch, 1] at state.position, each step's token
        (the argmax, or with `sampled` the one state.sampler selects) the next one's input;
        returns the ids [batch, steps] (int64, CPU) and advances state.position by `steps`. A
        runner that can (cuda_graph) runs them as one launch; any other backend runs them one
        step at a time."""
        self._reclaim_lent()
        run_tokens = getattr(self.runner, "run_tokens", None)
        # (ids: nothing to check for NaN; a whole run keeps no hidden states)
        if run_tokens is not None and self.trace == 0 and not state.keep_hidden:
            self._hand_recorder()
            ids = run_tokens(input_ids, state, steps, sampled)
            if ids is not None:
                self._finished(ids.numel())
                return require_finite(ids, f"a run of {steps} {self.plan.phase} steps")
        out = []
        for _ in range(steps):
            input_ids = self.run(input_ids, state, logits="sample" if sampled else "argmax").reshape(-1, 1).cpu()
            out.append(input_ids)
        return torch.cat(out, dim=1)

    def _borrowed(self) -> tuple[dict, torch.Tensor]:
        """A borrowing plan's fetch outputs and landing buffer in the lent region (lending.py)."""
        if self._staging_layout is None:
            stagers = getattr(getattr(self.backend, "experts", None), "stagers", {})
            self._staging_layout = StagingLayout.of(self.plan, stagers)
        lay = self._staging_layout
        staging, landing = lent_of(self.backend).staging(lay.staging_bytes, lay.landing_bytes)
        return lay.views(staging, TORCH_DTYPE[self.graph.act_dtype]), landing

    def _reclaim_lent(self) -> None:
        """Before a plan that does not borrow the lent experts' memory runs: their bytes restored,
        if a long prompt's step borrowed them (backends/lending.py)."""
        lent = getattr(self.backend, "lent", None)
        if lent is not None and lent.dirty and not self.plan.borrows:
            lent.restore()

    def _finished(self, tokens: int) -> None:
        for hook in self.after_run:
            hook(self, tokens)

    def run(self, input_ids: torch.Tensor, state: State, position_t: torch.Tensor | None = None,
            logits: str = "all", positions: torch.Tensor | None = None,
            segments: tuple[tuple[int, int, int], ...] | None = None,
            hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """One step (`_run`), then the `after_run` hooks; selected ids (logits 'argmax' or
        'sample') are checked: a row whose logits were not finite is a NumericError."""
        out = self._run(input_ids, state, position_t, logits, positions, segments, hidden)
        self._finished(input_ids.numel())
        if logits in ("argmax", "sample"):
            require_finite(out, f"the {self.plan.phase} step")
        return out

    def _run(self, input_ids: torch.Tensor, state: State, position_t: torch.Tensor | None = None,
             logits: str = "all", positions: torch.Tensor | None = None,
             segments: tuple[tuple[int, int, int], ...] | None = None,
             hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run one step over input_ids [batch, seq] from state.position; returns logits [batch, seq,
        vocab], with logits='last' [batch, 1, vocab] (the last position's), with 'argmax' the last
        position's greedy next ids [batch, 1] (int64; on the device where the runner can), with
        'none' None (a prompt's chunk before the last). With `position_t` (the position as a tensor), backends
        run their static-shape rules.

        With logits='sample', the ids state.sampler selects from the last position's logits
        ([batch, 1] int64, on the sampler's device; a runner that can selects them inside its
        step).

        With `positions` (int64 [batch] on the host: a ragged decode step, seq 1), each row is a
        sequence at its own position, over its own row of `state`'s caches, which must exist for
        every layer (`SlotPool` makes them); state.position is then neither read nor advanced:
        the caller keeps the rows' positions.

        With `segments` (a packed prefill step: input_ids [1, T] holding several sequences' prompt
        chunks one after another, each (row of `state`'s caches, its first position, its token
        count)), each segment continues its own row; logits='last' gives [segments, 1, vocab],
        each segment's last position; state.position is left alone as with `positions`.

        With `hidden` ([batch, seq, width]): the hidden vectors of a graph that reads them (a
        multi-token-prediction layer's), one a token; run eagerly, one instruction at a time."""
        self._reclaim_lent()
        if hidden is not None:
            if self.runner is not None:
                from ..errors import ConfigError

                raise ConfigError(f"the {self.backend.name} backend runs this {self.plan.phase} plan as a whole and "
                                  "takes no hidden vectors yet: compile the multi-token-prediction layer with "
                                  "backend='native' or 'torch_ref'")
            hidden = hidden.reshape(-1, hidden.shape[-1])
        if positions is not None:
            _check_ragged(self.attention_layers, input_ids, state, positions)
        if segments is not None:
            _check_packed(self.attention_layers, input_ids, state, segments)
        extra = {k: v for k, v in (("positions", positions), ("segments", segments)) if v is not None}
        on_device = {"argmax": "argmax_on_device", "sample": "selects_on_device"}.get(logits)
        if on_device and not (self.runner is not None and position_t is None and getattr(self.runner, on_device, False)):
            out = self._run(input_ids, state, position_t, "last", hidden=hidden, **extra)  # the last logits, then the ids
            if out is None or logits == "argmax":
                return None if out is None else mark_nonfinite(out[:, -1], out[:, -1].argmax(-1)).view(-1, 1)
            return state.sampler.select(out[:, -1].to(state.sampler.device)).view(-1, 1)
        tracing = self.trace > 0
        self.trace = max(self.trace - 1, 0)
        if self.runner is not None and position_t is None and state.keep_hidden:
            from ..errors import ConfigError

            raise ConfigError(f"the {self.backend.name} backend runs this {self.plan.phase} plan as a whole and keeps "
                              "no hidden states yet (state.keep_hidden): compile with backend='native' or 'torch_ref'")
        if self.runner is not None and position_t is None:
            self._hand_recorder()
            if tracing:
                out, self.measured = self.runner.run(input_ids, state, trace=True, logits=logits, **extra)
            else:
                out = self.runner.run(input_ids, state, logits=logits, **extra)
            if self.check_finite and logits != "argmax":
                _check_finite(out, f"the {self.plan.phase} step's output (the backend ran the plan as a whole: "
                              "run it with backend='native' or 'torch_ref' to find the node)")
            return out
        b, s = input_ids.shape
        ctx = StepContext(batch=b, seq=s, position=0 if extra else state.position, state=state,
                          token_ids=input_ids.reshape(-1), position_t=position_t, logits=logits, positions=positions,
                          segments=segments, hidden=hidden)
        if self.plan.borrows and getattr(self.backend, "lent", None) is not None:  # stage in the lent experts
            ctx.staging, ctx.landing = self._borrowed()
        # every node's instruction goes to the backend (a copy moves the value, submit is a no-op,
        # sync passes the task's value); instructions run one after another on this thread, so
        # record/wait have nothing to order
        launch = functools.partial(self._launch, ctx)
        handlers = {**dict.fromkeys(("launch", "copy", "fetch", "submit", "sync"), launch),
                    "record": nothing, "wait": nothing}
        watcher = _EagerWatcher(self, ctx, tracing) if tracing or self.check_finite else None
        keep = frozenset((self.kept_hidden,)) if state.keep_hidden else frozenset()
        values = run_instructions(self.plan, handlers, watcher=watcher, keep=keep)
        if tracing:
            self.measured = watcher.timed
        if not extra:
            state.position += s
        if state.keep_hidden:
            state.hidden_out = values[self.kept_hidden].reshape(b, s, -1)
        out = values[self.graph.outputs[0]]
        return None if out is None else step_output(out, b, s, logits, segments)


def _check_packed(layers: frozenset[int], input_ids: torch.Tensor, state: State, segments) -> None:
    """A packed prefill step's inputs as `Executor.run` needs them, or an InputError."""
    from ..errors import InputError

    total = sum(n for _, _, n in segments)
    if input_ids.shape != (1, total) or not segments:
        raise InputError(f"a packed prefill step takes input_ids [1, T] with T the segments' tokens ({total}), "
                         f"got {list(input_ids.shape)}")
    rows = [r for r, _, _ in segments]
    if len(set(rows)) != len(rows) or not all(0 <= r < state.batch for r in rows):
        raise InputError(f"a packed step's segments need distinct rows of the state's {state.batch}: got {rows}")
    for r, p, n in segments:
        if n < 1 or p < 0 or p + n > state.max_seq_len:
            raise InputError(f"segment of row {r}: {n} tokens at position {p} do not fit its KV cache "
                             f"({state.max_seq_len} positions)")
    missing = sorted(layers - set(state.kv))
    if missing:
        raise InputError(f"a packed step needs the state's caches made for every attention layer (SlotPool makes "
                         f"them); layers {missing} have none")


def _check_ragged(layers: frozenset[int], input_ids: torch.Tensor, state: State, positions: torch.Tensor) -> None:
    """A ragged step's inputs as `Executor.run` needs them, or an InputError saying what is wrong."""
    from ..errors import InputError

    b, s = input_ids.shape
    if s != 1 or positions.shape != (b,) or positions.device.type != "cpu":
        raise InputError(f"a ragged decode step takes one token per row and a position per row on the host: got "
                         f"input_ids {list(input_ids.shape)} and positions {list(positions.shape)} on {positions.device}")
    if b != state.batch:
        raise InputError(f"a ragged step of {b} rows over a state of {state.batch}: give a state of exactly its rows "
                         "(SlotPool passes a view of rows 0..b-1)")
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or hi >= state.max_seq_len:
        raise InputError(f"a row's position {lo if lo < 0 else hi} is outside its KV cache (0..{state.max_seq_len - 1})")
    missing = sorted(layers - set(state.kv))
    if missing:
        raise InputError(f"a ragged step needs the state's caches made for every attention layer (SlotPool makes "
                         f"them); layers {missing} have none")
