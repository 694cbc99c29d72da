"""Prefill placement of routed experts: on the CPU, streamed to the GPU, or split between them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..cost import fetch_seconds, transfer_seconds
from ..errors import ConfigError
from ..hw import HwProfile
from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, FetchAttrs, Op
from ..ir.types import Device, Placement, _si
from ..memory import prefill_room
from ..options import CompileContext
from .costs import cost_in, recost_changed, step_work
from .infra import compiler_pass

#: candidate streamed-expert counts per layer: 0, then steps of 1/GRID of the layer's CPU experts
GRID = 32


@dataclass(frozen=True)
class LayerChoice:
    """The decision for one layer's CPU experts in a prefill step."""

    streamed: tuple[int, ...]  # expert ids copied to the GPU (empty: all stay on the CPU)
    kept: tuple[int, ...]  # expert ids computed on the CPU
    cause: str  # what was decided, with the times compared


@compiler_pass(requires="placed", produces="placed")
def place_prefill_experts(g: Graph, ctx: CompileContext) -> Graph:
    """Decide, for a prefill step of ctx.tokens tokens, where each MoE layer's CPU routed
    experts compute: `cpu` (the native kernels, where they live), `stream` (their packed
    weights copied to a GPU staging slot, converted there and computed by a grouped matmul, the
    copy of the next streamed layer overlapping this one) or `split` (the hottest experts
    streamed, the rest on the CPU at the same time, sized so both finish together).

    Algorithm: per routed-experts node placed on the CPU, candidate counts n of streamed experts
    (0, then steps of 1/32 of its experts, hottest first by the routing profile, else by id)
    are priced by the steady-state layer time
        t(n) = max(D1 + max(X + C(rest), D2 + G(n)), F(n))
    where D1 is the layer's GPU work before the experts (norms, attention, router), D2 the GPU
    work beside them (shared expert, resident experts), C the CPU experts left (their weights
    read with the DRAM bandwidth the fetch's copies leave), X their PCIe copies (hidden states
    and routing down, result up), G the streamed experts on the GPU and F their fetch (PCIe +
    conversion), which overlaps the previous layer. The fastest n wins, ties
    to fewer streamed (option prefill_experts forces cpu, stream, or the best split). Staging
    must fit the GPU memory the step leaves (memory.prefill_room): `staging_slots` slots of the
    largest streamed set plus one landing buffer; with no room for two slots the pass uses one
    (no prefetch), with none it keeps the CPU, and says so in the cause.
    Rewrite: a streamed node runs on the GPU, holds no weights, and reads a third input: a fetch
    node (lane `fetch`) holding the experts' weight references, placed right after the node that
    used its slot before (its input: the copy waits for it), or at the start. A split keeps the
    CPU part under the node's name and adds `<name>.stream` on the GPU; their reader (the
    residual add) reads both.
    A layer whose GPU experts are a cache (`expert_cache`: the runtime moves experts between its
    parts, so no subset can be fixed here) has two candidates only: as placed (the cache's slots on
    the GPU, the rest on the CPU), or streamed whole: one GPU node computing every expert from a
    fetch of them all, standing in for both parts in this step (`cache_slots` says the cache's
    slots stay resident, unread; priced without the cache part's GPU work). A cached layer with
    several CPU parts (a custom pass split them before this one: the built-in NUMA and deferral
    passes run after it) keeps its parts, and prefill_experts='stream' refuses it.
    Requires: a costed, placed prefill graph. Decode graphs, graphs without a GPU (or with
    placement='cpu') and layers whose hidden states or routing are on the CPU pass through.
    Guarantees: rules S1-S2; each layer's experts still partitioned (V10); every decision
    recorded in the CPU or GPU node's cause with the times compared.
    """
    mode = ctx.options.prefill_experts
    if ctx.phase != "prefill" or not ctx.hw.has_gpu or ctx.options.placement == "cpu":
        return g
    # a layer whose GPU experts are a cache: its CPU part streams whole or not at all (the runtime
    # moves experts between the parts, and a streamed subset would be fixed here)
    caches = {n.attrs.layer: n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached}
    if caches and mode == "split":
        raise ConfigError(f"prefill_experts='split' with expert_cache: the GPU experts of layers {sorted(caches)} are a "
                          "cache the runtime refills, and a split's streamed subset is fixed at compile time; use "
                          "prefill_experts='auto', 'stream' (those layers then stream all their experts) or 'cpu'")
    parts = {}  # layer -> its CPU parts
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS and n.place.device == Device.CPU:
            parts.setdefault(n.attrs.layer, []).append(n)
    several = sorted(layer for layer in caches if len(parts.get(layer, ())) > 1)
    if several and mode == "stream":
        raise ConfigError(f"prefill_experts='stream' with expert_cache: cached layers {several} have several CPU parts "
                          "(a pass before place_prefill_experts split them), and such a layer streams only whole; "
                          "use prefill_experts='auto' or 'cpu'")
    # a layer streams only where its hidden states and routing are on the GPU
    cpu_nodes = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device == Device.CPU
                 and all(g.by_name(i).place.device == Device.GPU for i in n.inputs) and n.attrs.layer not in several]
    if not cpu_nodes:
        return g
    fmt = ctx.expert_format
    room = prefill_room(g, ctx.hw, tokens=ctx.tokens, weight_itemsize=ctx.weight_itemsize,
                        kv_tokens=ctx.max_seq_len * ctx.options.max_batch,
                        reserve_bytes=ctx.options.vram_reserve_gb * 1e9)
    one = [_fetch(n, n.attrs.ids[:1], fmt, 0) for n in cpu_nodes]
    slot_bytes = max(f.out.numel(0) * f.out.dtype.itemsize for f in one)  # one expert, converted
    landing = max(f.attrs.link_bytes for f in one)  # one expert, packed
    slots, cap = ctx.options.staging_slots, 0
    while slots >= 1:
        cap = int(max(room, 0.0) // (slots * slot_bytes + landing))
        if cap >= 1:
            break
        slots -= 1
    slots = max(slots, 1)
    widest = max(n.attrs.experts if n.attrs.layer in caches else len(n.attrs.ids) for n in cpu_nodes)
    if mode == "stream" and cap < widest:
        need = widest * (ctx.options.staging_slots * slot_bytes + landing)
        raise ConfigError(f"prefill_experts='stream' at {ctx.tokens} tokens needs {_si(need)}B of GPU staging "
                          f"({ctx.options.staging_slots} slots of a whole layer's experts and a landing buffer); "
                          f"{_si(max(room, 0.0))}B are left after weights, KV caches and activations. Use "
                          "prefill_experts='auto', fewer staging_slots, a smaller prefill_chunk or VRAM budget")
    # while a split layer's experts stream, the copy engine reads host memory too: the CPU part
    # streams its weights with what DRAM has left (at least a quarter of its rate)
    cpu = ctx.hw.cpu
    sharing = ctx.hw.model_copy(update={"cpu": cpu.model_copy(update={
        "gemv_gbps": max(cpu.gemv_gbps - ctx.hw.gpus[0].pcie_h2d_gbps, cpu.gemv_gbps / 4)})})
    bounds = _layer_bounds(g, cpu_nodes)
    choices = {n.name: _choose(g, ctx, n, bounds[n.name], fmt, cap, slots, sharing, mode, caches.get(n.attrs.layer))
               for n in cpu_nodes}
    if not any(c.streamed for c in choices.values()):
        return g.map(lambda n: _with_cause(n, choices[n.name]) if n.name in choices else n)
    return _rewrite(g, ctx, choices, fmt, slots, caches)


# ------------------------------------------------------------------------------- pricing


def _layer_bounds(g: Graph, experts: list[Node]) -> dict[str, tuple[float, float]]:
    """(D1, D2) per CPU experts node: the GPU seconds of the layer's work before the experts
    (from the previous experts node's first reader on) and beside them (up to their first reader)."""
    out: dict[str, tuple[float, float]] = {}
    start = 0
    for n in experts:
        at = g.position(n.name)
        first = min(g.position(u) for u in g.users(n.name))

        def busy(lo: int, hi: int) -> float:
            return sum(m.cost.on(m.place.device) for m in g.nodes[lo:hi]
                       if m.op != Op.ROUTED_EXPERTS or m.place.device == Device.GPU)

        out[n.name] = (busy(start, at), busy(at + 1, first))
        start = first
    return out


def _order(n: Node, ctx: CompileContext) -> list[int]:
    """The node's experts, hottest first (routing profile), else by id (contiguous copies)."""
    probs = ctx.routing.probs(n.attrs.layer) if ctx.routing is not None else None
    if not probs:
        return list(n.attrs.ids)
    return sorted(n.attrs.ids, key=lambda e: (-probs[e], e))


def _fetch(n: Node, ids, fmt: str, slot: int) -> Node:
    a = n.attrs
    attrs = FetchAttrs(a.layer, a.hidden, a.inter, a.experts, tuple(sorted(ids)), fmt, slot)
    return Node(n.name + ".fetch", Op.FETCH, (), attrs, FACTS[Op.FETCH].shape(attrs, [], n.out.dtype), n.weights)


def _choose(g: Graph, ctx: CompileContext, n: Node, bounds: tuple[float, float], fmt: str, cap: int, slots: int,
            sharing: HwProfile, mode: str, cache: Node | None = None) -> LayerChoice:
    """Price the candidate counts of streamed experts for `n` and pick one (see the pass).
    `sharing`: the machine with the DRAM bandwidth a fetch leaves the CPU. `cache`: the layer's
    GPU part where it is a cache: then `n` stays as placed or streams with every expert of the
    layer, which also takes over the cache part's work."""
    d1, d2 = bounds
    placed = n
    if cache is not None:
        n = replace(n, attrs=replace(n.attrs, subset=()))  # the candidates' experts: all of the layer's
    order = _order(n, ctx)
    total = len(order)
    work = step_work(n, ctx)
    x, route = (g.by_name(i) for i in n.inputs[:2])
    t = ctx.tokens
    xfer = (transfer_seconds(x.out.numel(t) * x.out.dtype.itemsize, ctx.hw, "d2h")
            + transfer_seconds(route.out.numel(t) * route.out.dtype.itemsize, ctx.hw, "d2h")
            + transfer_seconds(n.out.numel(t) * n.out.dtype.itemsize, ctx.hw, "h2d"))

    def part(ids) -> Node:
        return replace(n, attrs=replace(n.attrs, subset=tuple(sorted(ids))))

    def price(k: int) -> tuple[float, float, float, float]:
        """(layer seconds, CPU part, GPU part, fetch) with the first k of `order` streamed."""
        hw = sharing if 0 < k < total else ctx.hw
        kept = placed if cache is not None else part(order[k:])
        cpu = cost_in(kept, g, ctx, work=work, hw=hw, numa_nodes=1, expert_format=fmt).cpu_s + xfer if k < total else 0.0
        if k == 0:
            return d1 + max(cpu, d2), cpu, 0.0, 0.0
        gpu_node = replace(part(order[:k]), weights=())
        gpu = cost_in(gpu_node, g, ctx, work=work, numa_nodes=1, expert_format="bf16").gpu_s
        fetch = fetch_seconds(_fetch(n, order[:k], fmt, 0).attrs, ctx.hw, g.act_dtype)
        beside = d2 - (cache.cost.on(Device.GPU) if cache is not None else 0.0)  # the cache part's work taken over
        return max(d1 + max(cpu, beside + gpu), fetch), cpu, gpu, fetch

    step = max(1, math.ceil(total / GRID))
    counts = [0, total] if cache is not None else sorted({0, total, *range(step, total, step)})
    priced = {k: price(k) for k in counts if k <= cap}
    cpu_t = priced[0][0]
    if mode == "cpu":
        k = 0
    elif mode == "stream":
        k = total
    elif mode == "split":
        inner = [k for k in priced if 0 < k < total]
        k = min(inner, key=lambda k: (priced[k][0], k)) if inner else 0
    else:
        k = min(priced, key=lambda k: (priced[k][0], k))
    secs, cpu, gpu, fetch = priced[k]
    full = price(total) if total not in priced else priced[total]
    splits = [k2 for k2 in priced if 0 < k2 < total]
    best_split = min(splits, key=lambda k2: (priced[k2][0], k2)) if splits else None
    alts = [f"cpu {_si(cpu_t)}s", f"stream {_si(full[0])}s" + ("" if total in priced else " (no room)")]
    if best_split is not None:
        alts.append(f"split {best_split}/{total} {_si(priced[best_split][0])}s")
    head = f"prefill {t} tokens" + (f" (the layer's GPU part a cache of {len(cache.attrs.ids)} slots: streamed "
                                     "whole or kept)" if cache is not None else "")
    if k == 0:
        why = "prefill_experts=cpu" if mode == "cpu" else (
            "no GPU room for staging" if cap == 0 else "no GPU room to stage the whole layer"
            if cache is not None and cap < total else "fastest")
        cause = f"{head}: cpu ({why}; {', '.join(alts)})"
    else:
        parts = f"fetch {_si(fetch)}s, GPU {_si(gpu)}s" + (f", CPU {_si(cpu)}s" if k < total else "")
        slot_note = "" if slots >= ctx.options.staging_slots else f"; {slots} staging slot(s) fit, no prefetch" \
            if slots == 1 else f"; {slots} staging slots fit"
        forced = f"prefill_experts={mode}" if mode != "auto" else "fastest"
        cause = (f"{head}: {'stream' if k == total else 'split'} {k}/{total} experts, {_si(secs)}s/layer "
                 f"({parts}; {forced}; {', '.join(alts)}){slot_note}")
    return LayerChoice(tuple(sorted(order[:k])), tuple(sorted(order[k:])), cause)


# ------------------------------------------------------------------------------- rewrite


def _with_cause(n: Node, c: LayerChoice, **changes) -> Node:
    """`n` (with `changes`) whose cause also says what prefill decided for its layer."""
    return replace(n, place=replace(n.place, cause=f"{n.place.cause}; {c.cause}"), **changes)


def _rewrite(g: Graph, ctx: CompileContext, choices: dict[str, LayerChoice], fmt: str, slots: int,
             caches: dict[int, Node]) -> Graph:
    # a cached layer streamed whole: its streamed node stands in for the cache part too
    whole = {caches[n.attrs.layer].name: n for n in g.nodes
             if n.name in choices and choices[n.name].streamed and n.attrs.layer in caches}
    nodes: list[Node] = []
    extra_reads: dict[str, str] = {}  # CPU part -> its streamed twin (readers read both)
    after: dict[str, list[Node]] = {}  # node -> fetches placed right after it
    streamed_order: list[str] = []  # streamed nodes in graph order
    first_fetches: list[Node] = []
    for n in g.nodes:
        if n.name in whole:
            continue
        c = choices.get(n.name)
        if c is None or not c.streamed:
            nodes.append(_with_cause(n, c) if c else n)
            continue
        name = n.name if not c.kept else n.name + ".stream"
        slot = len(streamed_order) % slots
        fetch = replace(_fetch(n, c.streamed, fmt, slot), name=name + ".fetch",
                        place=Placement(Device.GPU, cause=f"stage {len(c.streamed)} experts for {name}", stream="fetch"))
        prev = streamed_order[-slots] if len(streamed_order) >= slots else None
        if prev is None:
            first_fetches.append(fetch)
        else:
            fetch = replace(fetch, inputs=(prev,))
            after.setdefault(prev, []).append(fetch)
        streamed_order.append(name)
        cache = caches.get(n.attrs.layer)
        attrs = replace(n.attrs, subset=c.streamed if c.kept else n.attrs.subset)
        if cache is not None:  # every expert of the layer, beside the cache's resident slots
            attrs = replace(n.attrs, subset=(), cache_slots=len(cache.attrs.ids))
        gpu = replace(n, name=name, inputs=n.inputs + (fetch.name,), weights=(), attrs=attrs,
                      place=Placement(Device.GPU, cause=c.cause))
        if c.kept:
            nodes.append(_with_cause(n, c, attrs=replace(n.attrs, subset=c.kept)))
            extra_reads[n.name] = name
        nodes.append(gpu)
    out: list[Node] = []
    for n in nodes:
        if n.op == Op.ADD:  # the residual add of a split layer reads its streamed part too
            extra = tuple(extra_reads[i] for i in n.inputs if i in extra_reads)
            n = replace(n, inputs=tuple(i for i in n.inputs if i not in whole) + extra) if extra or any(
                i in whole for i in n.inputs) else n
        out.append(n)
        if n.op == Op.INPUT:
            out += first_fetches
        out += after.get(n.name, [])
    return recost_changed(g, g.replace_nodes(out), ctx)
