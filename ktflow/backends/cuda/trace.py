"""Measured step times of one eager step: CUDA events around every GPU step and the native queue's
clock for the CPU tasks, returned as the plan's steps with their times."""

from __future__ import annotations

import torch

from ...ir.ops import Op
from ...plan.artifact import Step
from ..native import binding as native


class _Timer:
    """CUDA events around each GPU/copy-lane step of one eager step, anchored to the native
    queue's clock; CPU tasks timed by the queue (started/finished of each batch)."""

    def __init__(self, runner: DecodeGraph):
        self.runner = runner
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}
        self.host_us: dict[int, tuple[float, float]] = {}
        torch.cuda.synchronize()
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor.record(runner.gpu)
        self.anchor_ns = native.module().now_ns()

    def start(self, i: int, stream) -> None:
        if stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            self.events[i] = (e, e)

    def end(self, i: int, stream) -> None:
        if stream is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            self.events[i] = (self.events[i][0], e)

    def host(self, i: int, start_ns: int, end_ns: int) -> None:
        """Step i ran on the host itself (a prologue node), from start_ns to end_ns."""
        self.host_us[i] = ((start_ns - self.anchor_ns) / 1e3, (end_ns - self.anchor_ns) / 1e3)

    def steps(self, bound: Bound) -> list[Step]:
        """The plan's steps with measured start/end (us from the step's start)."""
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
        for i, s in enumerate(r.plan.steps):
            if i in self.events:
                a, b = (us(e) for e in self.events[i])
            elif i in self.host_us:
                a, b = self.host_us[i]
            elif s.node in task_time and s.kind == "launch":
                a, b = task_time[s.node]
            else:
                a = b = last
            last = max(last, b) if s.kind not in ("record", "wait") else last
            out.append(s.model_copy(update={"start_us": round(a, 3), "end_us": round(b, 3)}))
        return out
