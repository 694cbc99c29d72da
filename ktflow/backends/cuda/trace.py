"""Measured instruction times of one eager step: CUDA events around every GPU instruction and the
native queue's clock for the CPU tasks, returned as the plan's instructions with their times."""

from __future__ import annotations

import torch

from ...ir.ops import Op
from ...plan.artifact import Instruction
from ..native import binding as native


class InstructionTimer:
    """A watcher of the instruction loop (backends/instructions.py): CUDA events around each
    GPU/copy-lane instruction of one eager step, anchored to the native queue's clock; the host's
    time issuing each (`issue_us`); instructions the host runs itself (`host_nodes`: a prefill's
    prologue) timed on that clock; CPU tasks timed by the queue (started/finished of each batch)."""

    def __init__(self, runner, lanes, host_nodes=frozenset()):
        self.runner, self.lanes, self.host_nodes = runner, lanes, host_nodes
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self.host_us: dict[int, tuple[float, float]] = {}
        self.issue_ns: dict[int, int] = {}  # the host's time issuing each instruction
        self._host_ns = 0
        torch.cuda.synchronize()
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(runner.gpu)
        self.anchor_ns = native.module().now_ns()

    def _mark(self, ins: Instruction) -> torch.cuda.Event | None:
        """A timing event recorded on the instruction's lane stream (None: a lane without one)."""
        stream = self.lanes.stream(ins)
        if stream is None:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def before(self, i: int, ins: Instruction) -> None:
        if ins.kind in ("record", "wait"):
            return
        e = self._mark(ins)
        if e is not None:
            self.events[i] = (e, e)
        self._host_ns = native.module().now_ns()

    def after(self, i: int, ins: Instruction, values: dict) -> None:
        if ins.kind in ("record", "wait"):
            return
        now = native.module().now_ns()  # before the timer's own event
        self.issue_ns[i] = now - self._host_ns
        e = self._mark(ins)
        if e is not None:
            self.events[i] = (self.events[i][0], e)
        if ins.node in self.host_nodes:  # it ran on the host itself
            self.host_us[i] = ((self._host_ns - self.anchor_ns) / 1e3, (now - self.anchor_ns) / 1e3)

    def instructions(self, bound) -> list[Instruction]:
        """The plan's instructions with measured start/end (us from the step's start)."""
        r = self.runner

        def us(e: torch.cuda.Event) -> float:
            return self.anchor.elapsed_time(e) * 1e3

        task_time: dict[str, tuple[float, float]] = {}
        submits = {n.attrs.task: n for n in r.g.nodes if n.op == Op.SUBMIT}
        for root, batches in bound.tasks.items():
            if not batches:  # a prologue node: it ran before the step, on the host
                continue
            members = submits[root].attrs.members
            times = [b.native.timing for b in batches]
            span = ((min(t[1] for t in times) - self.anchor_ns) / 1e3, (max(t[2] for t in times) - self.anchor_ns) / 1e3)
            for m in members:
                task_time[m] = span
        out, last = [], 0.0
        for i, s in enumerate(r.plan.instructions):
            if i in self.events:
                a, b = (us(e) for e in self.events[i])
            elif i in self.host_us:
                a, b = self.host_us[i]
            elif s.node in task_time and s.kind == "launch":
                a, b = task_time[s.node]
            else:
                a = b = last
            last = max(last, b) if s.kind not in ("record", "wait") else last
            issue = round(self.issue_ns[i] / 1e3, 3) if i in self.issue_ns else None
            out.append(s.model_copy(update={"start_us": round(a, 3), "end_us": round(b, 3), "issue_us": issue}))
        return out
