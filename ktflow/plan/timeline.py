"""Reading a plan's timeline (predicted, or measured by a traced run): per-layer lane busy times,
the CPU/GPU hand-off of each CPU task, Chrome trace export."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..ir.ops import Op
from .artifact import Plan, PlanFile, lane_order



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
    # the CPU counts as busy while any of its NUMA lanes is; PCIe while either copy lane is
    for s in plan.instructions:
        lane = "cpu" if s.lane.startswith("cpu") else "copy" if s.lane == "fetch" else s.lane
        lanes[lane].append((s.start_us, s.end_us))
    g = plan.ir
    ends = sorted((a.layer, s.end_us) for s in plan.instructions
                  if s.kind not in ("record", "wait") and g.by_name(s.node).op == Op.ADD
                  and (a := g.by_name(s.node).attrs).residual == "ffn")

    def window(layer, lo, hi):
        g, c, cp = (_clip(lanes[k], lo, hi) for k in ("gpu", "cpu", "copy"))
        return LayerTime(layer, hi - lo, _busy(g), _busy(c), _busy(cp), _overlap(g, c))

    out, prev = [], None
    for layer, end in ends:
        if prev is None:
            # the first layer starts with the first instruction of a node after the embedding
            embed = max((g.position(n.name) for n in g.nodes if n.op == Op.EMBED), default=-1)
            prev = min(s.start_us for s in plan.instructions if s.kind not in ("record", "wait")
                       and g.position(s.node) > embed)
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


@dataclass(frozen=True)
class Handoff:
    """One CPU task's two crossings in a step, each counted from when the receiving side could
    start: `to_cpu_us` from the later of the end of the last copy bringing its inputs to host
    memory and the end of the CPU's previous work, to the start of its first part on a CPU lane
    (the submit, the wake-up, the dispatch); `to_gpu_us` from the later of the end of its last
    part and the end of the GPU lane's instruction before its sync, to the end of that sync (the done
    flag seen by the stream, or the host wait returning). What a step loses per layer to
    handing work over and back."""

    task: str
    layer: int | None
    to_cpu_us: float
    to_gpu_us: float


def handoffs(plan: Plan) -> list[Handoff]:
    """The hand-offs of every CPU task of `plan` (submit/sync pairs), in plan order."""
    g = plan.ir
    by_node: dict[str, list] = {}
    for s in plan.instructions:
        by_node.setdefault(s.node, []).append(s)
    timed = [(i, s) for i, s in enumerate(plan.instructions) if s.kind not in ("record", "wait")]
    syncs = {g.by_name(s.node).attrs.task: (i, s) for i, s in timed if s.kind == "sync"}
    out = []
    for s in plan.instructions:
        if s.kind != "submit":
            continue
        sub = g.by_name(s.node)
        task = sub.attrs.task
        parts = [p for m in sub.attrs.members for p in by_node.get(m, []) if p.lane.startswith("cpu")]
        if not parts or task not in syncs:
            continue
        start, end = min(p.start_us for p in parts), max(p.end_us for p in parts)
        ready = max((c.end_us for i in sub.inputs for c in by_node.get(i, []) if c.kind == "copy"), default=s.end_us)
        lanes = {p.lane for p in parts}
        cpu_free = max((x.end_us for _, x in timed if x.lane in lanes and x not in parts and x.start_us < start),
                       default=ready)
        at, sync = syncs[task]
        gpu_free = max((x.end_us for i, x in timed if i < at and x.lane == sync.lane), default=end)
        first = g.by_name(sub.attrs.members[0]).attrs
        out.append(Handoff(task, getattr(first, "layer", None), start - max(ready, cpu_free),
                           sync.end_us - max(end, gpu_free)))
    return out


def handoff_summary(measured: Plan, predicted: Plan) -> str:
    """One line: the median hand-off of a measured step's CPU tasks, each way, beside the
    plan's prediction."""
    import statistics

    def med(plan: Plan) -> tuple[float, float, int]:
        h = handoffs(plan)
        if not h:
            return 0.0, 0.0, 0
        return statistics.median(x.to_cpu_us for x in h), statistics.median(x.to_gpu_us for x in h), len(h)

    (mc, mg, n), (pc, pg, _) = med(measured), med(predicted)
    if not n:
        return "decode step: no CPU tasks (no hand-off)"
    return (f"decode hand-off per CPU task (median of {n}): to the CPU {mc:.1f} us, back to the GPU {mg:.1f} us "
            f"(predicted {pc:.1f} us and {pg:.1f} us)")


def step_utilisation(plan: Plan) -> dict[str, float]:
    """Fraction of the predicted step each lane is busy."""
    total = plan.predicted_step_us or 1.0
    lanes: dict[str, list] = {}
    for s in plan.instructions:
        lanes.setdefault(s.lane, []).append((s.start_us, s.end_us))
    return {lane: _busy(iv) / total for lane, iv in sorted(lanes.items())}


def chrome_trace(pf: PlanFile, label: str = "predicted") -> dict:
    """The timelines of every plan (each prefill bucket, then decode) in Chrome trace format (open
    in Perfetto or chrome://tracing): one process per plan, one thread per lane, one complete event
    per instruction. `label` names what the instruction times are (predicted by the cost model, or
    measured by `ktflow run --trace`). A plan without instructions (not measured) is left out."""
    events = []
    for pid, plan in enumerate(pf.plans):
        if not plan.instructions:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": f"{plan.phase} plan ({label}, {plan.step_tokens} tokens/step)"}})
        lanes = sorted({s.lane for s in plan.instructions}, key=lane_order)
        for tid, lane in enumerate(lanes):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        g = plan.ir
        for s in plan.instructions:
            n = g.by_name(s.node)
            events.append({"name": s.node, "cat": s.kind, "ph": "X", "pid": pid, "tid": lanes.index(s.lane),
                           "ts": s.start_us, "dur": max(s.end_us - s.start_us, 0.001),
                           "args": {"op": n.op.value, "device": n.place.device.value,
                                    "flops": n.cost.flops if n.cost else 0, "bytes": n.cost.bytes if n.cost else 0}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"model": pf.model.model_type,
                                                                         "hardware": pf.hw.name}}


def write_chrome_trace(pf: PlanFile, path, label: str = "predicted") -> None:
    from ..util.fsutil import write_atomic

    write_atomic(path, json.dumps(chrome_trace(pf, label)))


def with_measured_instructions(plan: Plan, instrs) -> Plan:
    """`plan` with its instructions' times replaced by measured ones (same instructions, same order)."""
    return plan.model_copy(update={"instructions": list(instrs),
                                   "predicted_step_us": max((s.end_us for s in instrs), default=0.0)})


def with_measured_plans(pf: PlanFile, measured) -> PlanFile:
    """`pf` with each plan's instructions those `measured(plan)` gives (`with_measured_instructions`),
    and no instructions where it gives none: a trace of it shows only what ran."""
    def one(plan: Plan) -> Plan:
        instrs = measured(plan)
        return with_measured_instructions(plan, instrs) if instrs else plan.model_copy(update={"instructions": []})

    return pf.model_copy(update=dict(prefill=[one(p) for p in pf.prefill], decode=one(pf.decode)))
