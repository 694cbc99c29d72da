"""What changed between two plan files: `ktflow diff A.json B.json`, or `plan_diff(a, b)`.

Plans are matched by phase (the decode plan with the decode plan, prefill plans by bucket size;
a bucket only one side has is listed as such). For each matched pair: nodes whose placement
differs (device, and B's cause), nodes only one side has, Expert Deferral per MoE layer (the
deferred picks), predicted memory per device and the predicted step and per-layer times
(`timeline.layer_times`). Also the options and pipelines that differ, since those made the plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Graph
from ..ir.ops import Op
from .artifact import Plan, PlanFile
from .timeline import layer_times


@dataclass(frozen=True)
class PlacementChange:
    node: str
    before: str  # device in A ("-": the node is not in A)
    after: str  # device in B ("-": not in B)
    cause: str  # B's cause (A's for a node only A has)


@dataclass
class PlanPairDiff:
    """One matched pair of plans: `label` is "decode" or "prefill<tokens>"."""

    label: str
    placements: list[PlacementChange] = field(default_factory=list)
    deferral: dict[int, tuple[int, int]] = field(default_factory=dict)  # MoE layer -> (picks deferred in A, in B)
    memory: dict[str, tuple[float, float]] = field(default_factory=dict)  # what -> (bytes in A, in B)
    step_us: tuple[float, float] = (0.0, 0.0)
    layer_us: dict[int, tuple[float, float]] = field(default_factory=dict)  # layer -> predicted span (A, B)


@dataclass
class PlanDiff:
    options: dict[str, tuple[object, object]]  # option -> (A's value, B's), where they differ
    pipeline: tuple[list[str], list[str]] | None  # both pipelines, where they differ
    pairs: list[PlanPairDiff]
    only_a: list[str]  # plan labels only A has
    only_b: list[str]

    def text(self) -> str:
        out = []
        for k, (a, b) in self.options.items():
            out.append(f"option {k}: {a} -> {b}")
        if self.pipeline:
            out.append("pipeline: " + " -> ".join(_short(p) for p in self.pipeline[0]))
            out.append("      now: " + " -> ".join(_short(p) for p in self.pipeline[1]))
        for label in self.only_a:
            out.append(f"{label}: only in A")
        for label in self.only_b:
            out.append(f"{label}: only in B")
        for p in self.pairs:
            a, b = p.step_us
            out.append(f"{p.label}: predicted step {a:.1f} -> {b:.1f} us ({_pct(a, b)})")
            for what, (x, y) in p.memory.items():
                if x != y:
                    out.append(f"  {what}: {x / 1e9:.3f} -> {y / 1e9:.3f} GB")
            for layer, (x, y) in sorted(p.deferral.items()):
                out.append(f"  layer {layer}: deferred picks {x} -> {y}")
            for c in p.placements:
                out.append(f"  {c.node}: {c.before} -> {c.after} ({c.cause})")
            changed = [(layer, x, y) for layer, (x, y) in sorted(p.layer_us.items()) if abs(y - x) > 0.005 * max(x, 1e-9)]
            for layer, x, y in changed:
                out.append(f"  layer {layer}: predicted {x:.1f} -> {y:.1f} us ({_pct(x, y)})")
        return "\n".join(out or ["no differences"]) + "\n"


def _short(pass_id: str) -> str:
    module, _, name = pass_id.rpartition(":")
    return name if module.startswith("ktflow.passes") else pass_id


def _pct(a: float, b: float) -> str:
    return f"{100 * (b - a) / a:+.1f}%" if a else "new"


def _label(plan: Plan) -> str:
    return "decode" if plan.phase == "decode" else f"prefill{plan.step_tokens}"


def _deferred(g: Graph) -> dict[int, int]:
    """MoE layer -> picks per token deferred to the next layer (routed-experts parts whose ranks
    do not start at 0)."""
    out: dict[int, int] = {}
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS and n.attrs.deferred:
            lo, hi = n.attrs.rank_range
            out[n.attrs.layer] = max(out.get(n.attrs.layer, 0), hi - lo)
    return out


def _pair(a: Plan, b: Plan) -> PlanPairDiff:
    ga, gb = a.ir, b.ir
    d = PlanPairDiff(_label(a), step_us=(a.predicted_step_us, b.predicted_step_us))
    na, nb = {n.name: n for n in ga.nodes}, {n.name: n for n in gb.nodes}
    lowered = (Op.COPY, Op.SUBMIT, Op.SYNC)  # follow from the placements: not listed
    for name, n in nb.items():
        if n.op in lowered:
            continue
        old = na.get(name)
        if old is None:
            d.placements.append(PlacementChange(name, "-", n.place.device.value, n.place.cause))
        elif old.place.device != n.place.device:
            d.placements.append(PlacementChange(name, old.place.device.value, n.place.device.value, n.place.cause))
    for name, n in na.items():
        if name not in nb and n.op not in lowered:
            d.placements.append(PlacementChange(name, n.place.device.value, "-", n.place.cause))
    da, db = _deferred(ga), _deferred(gb)
    d.deferral = {layer: (da.get(layer, 0), db.get(layer, 0)) for layer in sorted(set(da) | set(db))
                  if da.get(layer, 0) != db.get(layer, 0)}
    ma, mb = a.memory, b.memory
    d.memory = {"GPU memory": (ma.gpu_bytes, mb.gpu_bytes), "host memory": (ma.host_bytes, mb.host_bytes),
                "weights": (ma.weight_bytes, mb.weight_bytes), "KV cache": (ma.kv_cache_bytes, mb.kv_cache_bytes)}
    ta = {t.layer: t.span_us for t in layer_times(a) if t.layer is not None}
    tb = {t.layer: t.span_us for t in layer_times(b) if t.layer is not None}
    d.layer_us = {layer: (ta[layer], tb[layer]) for layer in ta if layer in tb}
    return d


def plan_diff(a: PlanFile, b: PlanFile) -> PlanDiff:
    """What changed from plan file `a` to plan file `b`."""
    oa, ob = a.options.model_dump(), b.options.model_dump()
    options = {k: (oa.get(k), ob.get(k)) for k in sorted(set(oa) | set(ob)) if oa.get(k) != ob.get(k)}
    pipeline = (a.pipeline, b.pipeline) if a.pipeline != b.pipeline else None
    pa, pb = {_label(p): p for p in a.plans}, {_label(p): p for p in b.plans}
    pairs = [_pair(pa[k], pb[k]) for k in pa if k in pb]
    return PlanDiff(options, pipeline, pairs, [k for k in pa if k not in pb], [k for k in pb if k not in pa])
