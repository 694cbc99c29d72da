"""Reading a plan's predicted timeline: per-layer lane busy times, Chrome trace export."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .passes.schedule import lane_order
from .plan import Plan, PlanFile

_LAYER = re.compile(r"^L(\d+)\.")


@dataclass(frozen=True)
class LayerTime:
    """One layer's share of a step: `span` from its first step's start to its last step's end;
    busy seconds per lane; `overlap` the time GPU and CPU lanes are busy at once."""

    layer: int | None  # None: steps outside the layers (embedding, final norm, lm_head)
    span_us: float
    gpu_us: float
    cpu_us: float
    copy_us: float
    overlap_us: float

    @property
    def gpu_busy(self) -> float:
        return self.gpu_us / self.span_us if self.span_us else 0.0

    @property
    def cpu_busy(self) -> float:
        return self.cpu_us / self.span_us if self.span_us else 0.0


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _busy(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _merge(intervals))


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Time both sets of intervals are busy at once (each merged first, so nothing counts twice)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in _merge(x) for c, d in _merge(y))


def layer_times(plan: Plan) -> list[LayerTime]:
    groups: dict[int | None, list] = {}
    for s in plan.steps:
        m = _LAYER.match(s.node)
        groups.setdefault(int(m.group(1)) if m else None, []).append(s)
    out = []
    for layer, steps in sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        lanes: dict[str, list] = {"gpu": [], "cpu": [], "copy": []}
        for s in steps:  # the CPU counts as busy while any of its NUMA lanes is
            lanes["cpu" if s.lane.startswith("cpu") else s.lane].append((s.start_us, s.end_us))
        span = max(s.end_us for s in steps) - min(s.start_us for s in steps)
        out.append(LayerTime(layer, span, _busy(lanes["gpu"]), _busy(lanes["cpu"]), _busy(lanes["copy"]),
                             _overlap(lanes["gpu"], lanes["cpu"])))
    return out


def step_utilisation(plan: Plan) -> dict[str, float]:
    """Fraction of the predicted step each lane is busy."""
    total = plan.predicted_step_us or 1.0
    lanes: dict[str, list] = {}
    for s in plan.steps:
        lanes.setdefault(s.lane, []).append((s.start_us, s.end_us))
    return {lane: _busy(iv) / total for lane, iv in sorted(lanes.items())}


def chrome_trace(pf: PlanFile) -> dict:
    """The predicted timelines of both plans in Chrome trace format (open in Perfetto or
    chrome://tracing): one process per plan, one thread per lane, one complete event per step."""
    events = []
    for pid, plan in enumerate((pf.prefill, pf.decode)):
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{plan.phase} plan (predicted, {plan.step_tokens} tokens/step)"}})
        lanes = sorted({s.lane for s in plan.steps}, key=lane_order)
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        g = plan.ir
        for s in plan.steps:
            n = g.by_name(s.node)
            events.append({"name": s.node, "cat": s.kind, "ph": "X", "pid": pid, "tid": lanes.index(s.lane),
                           "ts": s.start_us, "dur": max(s.end_us - s.start_us, 0.001),
                           "args": {"op": n.op.value, "device": n.place.device.value,
                                    "flops": n.cost.flops if n.cost else 0, "bytes": n.cost.bytes if n.cost else 0}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"model": pf.model.model_type,
                                                                         "hardware": pf.hw.name}}


def write_chrome_trace(pf: PlanFile, path) -> None:
    from .fsutil import write_atomic

    write_atomic(path, json.dumps(chrome_trace(pf)))
