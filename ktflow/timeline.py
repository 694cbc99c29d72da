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
    """One layer's window of a step: from the end of the previous layer's residual add (or the
    step's start) to the end of this layer's (`L<i>.ffn_res`), with each lane's busy time in
    that window, whatever layer the work belongs to (deferred experts of layer i-1 run in layer
    i's window); `overlap` is the time GPU and CPU are busy at once."""

    layer: int | None  # None: the rest of the step (embedding before layer 0, final norm, lm_head)
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


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def layer_times(plan: Plan) -> list[LayerTime]:
    lanes: dict[str, list] = {"gpu": [], "cpu": [], "copy": []}
    for s in plan.steps:  # the CPU counts as busy while any of its NUMA lanes is; PCIe while either copy lane is
        lane = "cpu" if s.lane.startswith("cpu") else "copy" if s.lane == "fetch" else s.lane
        lanes[lane].append((s.start_us, s.end_us))
    ends = sorted((int(m.group(1)), s.end_us) for s in plan.steps
                  if s.kind not in ("record", "wait") and (m := _LAYER.match(s.node)) and s.node.endswith(".ffn_res"))

    def window(layer, lo, hi):
        g, c, cp = (_clip(lanes[k], lo, hi) for k in ("gpu", "cpu", "copy"))
        return LayerTime(layer, hi - lo, _busy(g), _busy(c), _busy(cp), _overlap(g, c))

    out, prev = [], None
    for layer, end in ends:
        if prev is None:
            prev = min(s.start_us for s in plan.steps if s.node.startswith(f"L{layer}."))
            first = prev
        out.append(window(layer, prev, end))
        prev = end
    total = plan.predicted_step_us
    if ends:
        rest_gpu = _busy(_clip(lanes["gpu"], 0, first)) + _busy(_clip(lanes["gpu"], prev, total))
        rest_cpu = _busy(_clip(lanes["cpu"], 0, first)) + _busy(_clip(lanes["cpu"], prev, total))
        rest_copy = _busy(_clip(lanes["copy"], 0, first)) + _busy(_clip(lanes["copy"], prev, total))
        out.insert(0, LayerTime(None, first + total - prev, rest_gpu, rest_cpu, rest_copy,
                                _overlap(_clip(lanes["gpu"], prev, total), _clip(lanes["cpu"], prev, total))))
    return out


def step_utilisation(plan: Plan) -> dict[str, float]:
    """Fraction of the predicted step each lane is busy."""
    total = plan.predicted_step_us or 1.0
    lanes: dict[str, list] = {}
    for s in plan.steps:
        lanes.setdefault(s.lane, []).append((s.start_us, s.end_us))
    return {lane: _busy(iv) / total for lane, iv in sorted(lanes.items())}


def chrome_trace(pf: PlanFile, label: str = "predicted") -> dict:
    """The timelines of every plan (each prefill bucket, then decode) in Chrome trace format (open
    in Perfetto or chrome://tracing): one process per plan, one thread per lane, one complete event
    per step. `label` names what the step times are (predicted by the cost model, or measured by
    `ktflow run --trace`). A plan without steps (not measured) is left out."""
    events = []
    for pid, plan in enumerate(pf.plans):
        if not plan.steps:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{plan.phase} plan ({label}, {plan.step_tokens} tokens/step)"}})
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


def write_chrome_trace(pf: PlanFile, path, label: str = "predicted") -> None:
    from .fsutil import write_atomic

    write_atomic(path, json.dumps(chrome_trace(pf, label)))


def with_measured_steps(plan: Plan, steps) -> Plan:
    """`plan` with its steps' times replaced by measured ones (same steps, same order)."""
    return plan.model_copy(update={"steps": list(steps),
                                   "predicted_step_us": max((s.end_us for s in steps), default=0.0)})
