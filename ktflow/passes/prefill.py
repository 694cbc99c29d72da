"""Prefill placement of routed experts: on the CPU, streamed to the GPU, or split between them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..costmodel.roofline import fetch_seconds, transfer_seconds
from ..errors import ConfigError
from ..costmodel.hw import HwProfile
from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, FetchAttrs, Op, expert_weight_bytes, sums_parts
from ..ir.types import Device, Placement, _si
from ..costmodel.memory import gpu_activation_peak, prefill_room, stream_bytes, streamed_step_bytes
from ..plan.options import CompileContext, vram_limit
from .annotate_costs import cost_in, recost_changed, step_work
from .infra import compiler_pass

#: candidate streamed-expert counts per layer: 0, then steps of 1/GRID of the layer's CPU experts
GRID = 32

#: a step that borrows lent experts stages in at most this share of their bytes, less LEND_SLACK:
#: the landing buffer's page-aligned pieces and the staging's alignment (backends/lending.py)
LEND_USE, LEND_SLACK = 0.98, 64 << 10


@dataclass(frozen=True)
class LayerChoice:
    """The decision for one layer's CPU experts in a prefill step."""

    streamed: tuple[int, ...]  # expert ids copied to the GPU (empty: all stay on the CPU)
    kept: tuple[int, ...]  # expert ids computed on the CPU
    cause: str  # what was decided, with the times compared
    groups: tuple[tuple[int, ...], ...] = ()  # the streamed ids as fetched: one group a staging buffer
    seconds: float = 0.0  # the layer's priced steady-state time


@compiler_pass(requires="placed", produces="placed")
def place_prefill_experts(g: Graph, ctx: CompileContext) -> Graph:
    """Decide, for a prefill step of ctx.tokens tokens, where each MoE layer's CPU routed
    experts compute: `cpu` (the native kernels, where they live), `stream` (their packed
    weights copied to a GPU staging buffer, converted there and computed by a grouped matmul, the
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
    must fit the GPU memory the step leaves under the VRAM limit (memory.prefill_room, the
    step's activations with a chunk's past; ctx.vram: the VRAM plan's limit and its buffer size;
    a step that borrows lent experts (time-share, `CompileContext.lends`): their bytes, LEND_USE;
    a shorter step beside such steps: what the longest step that does not borrow leaves):
    `staging_buffers` buffers of up to `cap` experts, one landing buffer for a buffer's packed bytes,
    and the layer's partial outputs (memory.stream_bytes). A streamed set larger than `cap` is
    fetched in groups of up to `cap` (`groups_of`), one fetch and one GPU node each, priced as
    the sum of their fetches and GPU work; with no room for two buffers the pass uses one (no
    prefetch), with none it keeps the CPU, and says so in the cause.
    Rewrite: a streamed node runs on the GPU, holds no weights, and reads a third input: a fetch
    node (lane `fetch`) holding the experts' weight references, placed right after the node that
    used its buffer before (its input: the copy waits for it), or at the start; the buffers are used
    in turn. A split keeps the CPU part under the node's name and adds `<name>.stream` on the
    GPU; their reader (the residual add) reads both. A layer fetched in groups has one node a
    group (`<name>`, `<name>2`, ..; `.stream`, `.stream2`, .. for a split), each after the first
    adding to the float32 running sum of those before (a fourth input; `running` on all but the
    last), the residual add reading the last.
    A layer whose GPU experts are a cache (`expert_cache`: the runtime moves experts between its
    parts, so no subset can be fixed here) has two candidates only: as placed (the cache's rows on
    the GPU, the rest on the CPU), or streamed whole: one GPU node computing every expert from a
    fetch of them all, standing in for both parts in this step (`cache_size` says the cache's
    rows stay resident, unread; priced without the cache part's GPU work). A cached layer with
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
    cpu_nodes = streamable(g, several)
    if not cpu_nodes:
        return g
    fmt = ctx.expert_format
    room = prefill_room(g, ctx.hw, tokens=ctx.tokens, weight_itemsize=ctx.weight_itemsize,
                        kv_tokens=ctx.max_seq_len * ctx.options.max_batch, limit=limit_of(ctx),
                        past=max(ctx.max_seq_len - ctx.tokens, 0))
    if ctx.lends:  # the staging is the lent layers' memory (the room counts it free: their experts stream here)
        room = min(room, LEND_USE * ctx.vram.lend_bytes - LEND_SLACK)
    elif ctx.vram is not None and ctx.vram.lend_layers:
        # a shorter step beside lending ones: its staging buffers, kept for the next prompts, must fit
        # beside the activations of any step that does not borrow (those that do free them first)
        longest = ctx.vram.lend_tokens - 1
        room = min(room, prefill_room(g, ctx.hw, tokens=longest, weight_itemsize=ctx.weight_itemsize,
                                      kv_tokens=ctx.max_seq_len * ctx.options.max_batch, limit=limit_of(ctx),
                                      past=max(ctx.max_seq_len - longest, 0)))
    most = max(n.attrs.experts if n.attrs.layer in caches else len(n.attrs.ids) for n in cpu_nodes)
    # the VRAM plan's buffer size (staging_experts where given)
    upto = ctx.vram.stage_experts if ctx.vram is not None else ctx.options.staging_experts
    buffers, cap = staging_capacity(cpu_nodes, fmt, room, ctx.options.staging_buffers, ctx.tokens, most, upto)
    widest = max((n.attrs.experts for n in cpu_nodes if n.attrs.layer in caches), default=1)
    if mode == "stream" and cap < widest:
        one = _fetch(cpu_nodes[0], cpu_nodes[0].attrs.ids[:1], fmt, 0)
        need = widest * (ctx.options.staging_buffers * one.out.numel(0) * one.out.dtype.itemsize + one.attrs.link_bytes)
        what = "a cached layer's experts" if caches else "one expert"
        raise ConfigError(f"prefill_experts='stream' at {ctx.tokens} tokens needs {_si(need)}B of GPU staging "
                          f"({ctx.options.staging_buffers} buffers of {what} and a landing buffer); "
                          f"{_si(max(room, 0.0))}B are left after weights, KV caches and activations. Use "
                          "prefill_experts='auto', fewer staging_buffers, a smaller prefill_chunk or a larger vram_gb")
    if upto and cap < min(upto, most):
        # the estimate (every part's output live beside the step's peak) refuses the VRAM plan's
        # buffer size: the rewritten step measured instead, taken at the largest buffer size (the
        # plan's, then its halvings) where it fits
        past = max(ctx.max_seq_len - ctx.tokens, 0)
        room_here = room + gpu_activation_peak(g, ctx.tokens, past, streamed=True)
        want = min(upto, most)
        while want > cap:
            trial = _placed_for(g, ctx, cpu_nodes, caches, fmt, want, ctx.options.staging_buffers, mode)
            if trial is not None and streamed_step_bytes(trial, ctx.tokens, past) <= room_here:
                return trial
            want //= 2
    return _placed_for(g, ctx, cpu_nodes, caches, fmt, cap, buffers, mode) or g


def _placed_for(g: Graph, ctx: CompileContext, cpu_nodes: list[Node], caches: dict[int, Node], fmt: str, cap: int,
                buffers: int, mode: str) -> Graph | None:
    """`g` with every CPU layer's choice at `cap` experts a buffer and `buffers` buffers (None: no
    layer's choice changed, then only the causes are new)."""
    sharing = _sharing(ctx)
    bounds = _layer_bounds(g, cpu_nodes)
    choices, alike = {}, {}  # layers alike but for their index (uniform routing) are priced once
    for n in cpu_nodes:
        cache = caches.get(n.attrs.layer)
        key = None if ctx.routing is not None or cache is not None else (replace(n.attrs, layer=0), bounds[n.name])
        if key is None or key not in alike:
            choice = _choose(g, ctx, n, bounds[n.name], fmt, cap, buffers, sharing, mode, cache)
            if key is not None:
                alike[key] = choice
        choices[n.name] = alike[key] if key is not None else choice
    if not any(c.streamed for c in choices.values()):
        return g.map(lambda n: _with_cause(n, choices[n.name]) if n.name in choices else n)
    return _rewrite(g, ctx, choices, fmt, buffers, caches)


def limit_of(ctx: CompileContext) -> float:
    """The VRAM limit the plan fits in: the VRAM plan's, else the options' (`vram_limit`)."""
    return ctx.vram.limit if ctx.vram is not None else vram_limit(ctx.options, ctx.hw)


def streamable(g: Graph, skip_layers=()) -> list[Node]:
    """The routed-experts nodes placed on the CPU that could stream: their hidden states and
    routing are on the GPU (layers in `skip_layers` left out)."""
    return [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device == Device.CPU
            and all(g.by_name(i).place.device == Device.GPU for i in n.inputs) and n.attrs.layer not in skip_layers]


def staging_capacity(cpu_nodes: list[Node], fmt: str, room: float, want_buffers: int, tokens: int,
                     widest: int, upto: int | None = None) -> tuple[int, int]:
    """(buffers, experts per buffer) that `room` bytes hold for a step of `tokens` tokens
    (`memory.stream_bytes`: the buffers, a landing buffer for one buffer's packed bytes and the
    outputs of the parts of a layer streaming `widest` experts): `want_buffers` buffers if one
    expert fits each, else fewer; the most experts (up to `widest`, and `upto`) a buffer then
    holds; at least one buffer, 0 experts where none fits."""
    a = max((n.attrs for n in cpu_nodes), key=lambda a: a.hidden * a.inter)
    act = cpu_nodes[0].out.dtype.itemsize
    packed = expert_weight_bytes(fmt, a.hidden, a.inter)
    for buffers in range(want_buffers, 0, -1):
        for cap in range(min(widest, widest if upto is None else upto), 0, -1):
            if stream_bytes(widest, cap, buffers, tokens, a.hidden, a.inter, act, packed) <= room:
                return buffers, cap
    return 1, 0


def _sharing(ctx: CompileContext) -> HwProfile:
    """While a split layer's experts stream, the copy engine reads host memory too: the machine
    with the DRAM rate the CPU part is left (at least a quarter of its own)."""
    cpu = ctx.hw.cpu
    return ctx.hw.model_copy(update={"cpu": cpu.model_copy(update={
        "gemv_gbps": max(cpu.gemv_gbps - ctx.hw.gpus[0].pcie_h2d_gbps, cpu.gemv_gbps / 4)})})


def layer_seconds(g: Graph, ctx: CompileContext, node: Node, cap: int, buffers: int) -> float:
    """The steady-state seconds of CPU routed-experts `node`'s layer in a prefill step of
    ctx.tokens tokens, as this pass prices its fastest choice with at most `cap` experts a
    staging buffer and `buffers` buffers (0 caps: the CPU). For the VRAM plan (ktflow.passes.vram_plan),
    which weighs staging bytes against decode residency; `g` is placed and costed for the step."""
    bounds = _layer_bounds(g, streamable(g))
    cache = next((n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached
                  and n.attrs.layer == node.attrs.layer), None)
    return _choose(g, ctx, node, bounds[node.name], ctx.expert_format, cap, max(buffers, 1), _sharing(ctx),
                   ctx.options.prefill_experts, cache).seconds


def groups_of(ids, cap: int) -> list[tuple[int, ...]]:
    """`ids` in order as ceil(len / cap) runs of near-equal size (each sorted): the fetches a
    streamed set takes when a staging buffer holds `cap` experts."""
    ids = list(ids)
    if not ids:
        return []
    m = -(-len(ids) // max(cap, 1))
    base, extra = divmod(len(ids), m)
    out, at = [], 0
    for i in range(m):
        size = base + (1 if i < extra else 0)
        out.append(tuple(sorted(ids[at:at + size])))
        at += size
    return out


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


def _fetch(n: Node, ids, fmt: str, buffer: int) -> Node:
    a = n.attrs
    attrs = FetchAttrs(a.layer, a.hidden, a.inter, a.experts, tuple(sorted(ids)), fmt, buffer)
    return Node(n.name + ".fetch", Op.FETCH, (), attrs, FACTS[Op.FETCH].shape(attrs, [], n.out.dtype), n.weights)


def _choose(g: Graph, ctx: CompileContext, n: Node, bounds: tuple[float, float], fmt: str, cap: int, buffers: int,
            sharing: HwProfile, mode: str, cache: Node | None = None) -> LayerChoice:
    """Price the candidate counts of streamed experts for `n` and pick one (see the pass).
    `cap`: the most experts a staging buffer holds (a streamed set of more goes as several
    fetches, `groups_of`). `sharing`: the machine with the DRAM bandwidth a fetch leaves the
    CPU. `cache`: the layer's GPU part where it is a cache: then `n` stays as placed or streams
    with every expert of the layer in one fetch, which also takes over the cache part's work."""
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
    uniform = work.expert_probs is None
    memo: dict = {}

    def part(ids) -> Node:
        return replace(n, attrs=replace(n.attrs, subset=tuple(sorted(ids))))

    def group_cost(ids: tuple[int, ...]) -> tuple[float, float]:
        """(GPU seconds, fetch seconds) of one streamed group (by size where routing is uniform)."""
        key = len(ids) if uniform else ids
        if key not in memo:
            gpu_node = replace(part(ids), weights=())
            memo[key] = (cost_in(gpu_node, g, ctx, work=work, numa_nodes=1, expert_format="bf16").gpu_s,
                         fetch_seconds(_fetch(n, ids, fmt, 0).attrs, ctx.hw, g.act_dtype))
        return memo[key]

    def price(k: int) -> tuple[float, float, float, float]:
        """(layer seconds, CPU part, GPU part, fetch) with the first k of `order` streamed."""
        hw = sharing if 0 < k < total else ctx.hw
        kept = placed if cache is not None else part(order[k:])
        cpu = cost_in(kept, g, ctx, work=work, hw=hw, numa_nodes=1, expert_format=fmt).cpu_s + xfer if k < total else 0.0
        if k == 0:
            return d1 + max(cpu, d2), cpu, 0.0, 0.0
        costs = [group_cost(ids) for ids in groups_of(order[:k], cap)]
        gpu, fetch = sum(c[0] for c in costs), sum(c[1] for c in costs)
        beside = d2 - (cache.cost.on(Device.GPU) if cache is not None else 0.0)  # the cache part's work taken over
        return max(d1 + max(cpu, beside + gpu), fetch), cpu, gpu, fetch

    step = max(1, math.ceil(total / GRID))
    if cache is not None:  # streamed whole in one fetch, or kept
        counts = [0, total] if cap >= total else [0]
    else:
        counts = sorted({0, total, *range(step, total, step)}) if cap >= 1 else [0]
    priced = {k: price(k) for k in counts}
    cpu_t = priced[0][0]
    if mode == "cpu":
        k = 0
    elif mode == "stream":
        k = total if total in priced else 0
    elif mode == "split":
        inner = [k for k in priced if 0 < k < total]
        k = min(inner, key=lambda k: (priced[k][0], k)) if inner else 0
    else:
        k = min(priced, key=lambda k: (priced[k][0], k))
    secs, cpu, gpu, fetch = priced[k]
    full = priced.get(total)
    splits = [k2 for k2 in priced if 0 < k2 < total]
    best_split = min(splits, key=lambda k2: (priced[k2][0], k2)) if splits else None
    alts = [f"cpu {_si(cpu_t)}s", f"stream {_si(full[0])}s" if full else "stream (no room)"]
    if best_split is not None:
        alts.append(f"split {best_split}/{total} {_si(priced[best_split][0])}s")
    head = f"prefill {t} tokens" + (f" (the layer's GPU part a cache of {len(cache.attrs.ids)} rows: streamed "
                                     "whole or kept)" if cache is not None else "")
    groups = tuple(groups_of(order[:k], cap)) if k else ()
    if k == 0:
        why = "prefill_experts=cpu" if mode == "cpu" else (
            "no GPU room for staging" if cap == 0 else "no GPU room to stage the whole layer"
            if cache is not None and cap < total else "fastest")
        cause = f"{head}: cpu ({why}; {', '.join(alts)})"
    else:
        parts = f"fetch {_si(fetch)}s, GPU {_si(gpu)}s" + (f", CPU {_si(cpu)}s" if k < total else "")
        staging_note = "" if buffers >= ctx.options.staging_buffers else f"; {buffers} staging buffer(s) fit, no prefetch" \
            if buffers == 1 else f"; {buffers} staging buffers fit"
        if len(groups) > 1:
            staging_note += (f"; {len(groups)} fetches of up to {max(len(x) for x in groups)} experts "
                          "(a staging buffer's room)")
        forced = f"prefill_experts={mode}" if mode != "auto" else "fastest"
        cause = (f"{head}: {'stream' if k == total else 'split'} {k}/{total} experts, {_si(secs)}s/layer "
                 f"({parts}; {forced}; {', '.join(alts)}){staging_note}")
    return LayerChoice(tuple(sorted(order[:k])), tuple(sorted(order[k:])), cause, groups, secs)


# ------------------------------------------------------------------------------- rewrite


def _with_cause(n: Node, c: LayerChoice, **changes) -> Node:
    """`n` (with `changes`) whose cause also says what prefill decided for its layer."""
    return replace(n, place=replace(n.place, cause=f"{n.place.cause}; {c.cause}"), **changes)


def _rewrite(g: Graph, ctx: CompileContext, choices: dict[str, LayerChoice], fmt: str, buffers: int,
             caches: dict[int, Node]) -> Graph:
    # a cached layer streamed whole: its streamed node stands in for the cache part too
    whole = {caches[n.attrs.layer].name: n for n in g.nodes
             if n.name in choices and choices[n.name].streamed and n.attrs.layer in caches}
    nodes: list[Node] = []
    extra_reads: dict[str, str] = {}  # a split's CPU part -> its streamed parts' sum, which its readers also read
    renamed: dict[str, str] = {}  # a layer streamed in groups -> their sum, which its readers read instead
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
        base = n.name if not c.kept else n.name + ".stream"
        if c.kept:
            nodes.append(_with_cause(n, c, attrs=replace(n.attrs, subset=c.kept)))
        groups = c.groups or (c.streamed,)
        total = base  # the layer's running sum: the group before this one
        for i, ids in enumerate(groups):
            name = base if i == 0 else f"{base}{i + 1}"  # a layer fetched in groups: L3.experts, L3.experts2, ..
            buffer = len(streamed_order) % buffers
            what = f"stage {len(ids)} experts for {name}"
            if len(groups) > 1:
                what += f" (fetch {i + 1} of {len(groups)})"
            fetch = replace(_fetch(n, ids, fmt, buffer), name=name + ".fetch",
                            place=Placement(Device.GPU, cause=what, stream="fetch"))
            prev = streamed_order[-buffers] if len(streamed_order) >= buffers else None
            if prev is None:
                first_fetches.append(fetch)
            else:
                fetch = replace(fetch, inputs=(prev,))
                after.setdefault(prev, []).append(fetch)
            streamed_order.append(name)
            cache = caches.get(n.attrs.layer)
            attrs = replace(n.attrs, subset=ids if (c.kept or len(groups) > 1) else n.attrs.subset,
                            running=i < len(groups) - 1)
            if cache is not None:  # every expert of the layer, beside the cache's resident rows
                attrs = replace(n.attrs, subset=(), cache_size=len(cache.attrs.ids))
            # a group after the first adds to the running sum of the ones before (float32: one
            # rounding for the layer, and one partial sum live, not every group's output)
            inputs = n.inputs + (fetch.name,) + ((total,) if i else ())
            nodes.append(replace(n, name=name, inputs=inputs, weights=(), attrs=attrs,
                                 out=FACTS[Op.ROUTED_EXPERTS].shape(attrs, [], n.out.dtype) if attrs.running else n.out,
                                 place=Placement(Device.GPU, cause=c.cause)))
            total = name
        if c.kept:
            extra_reads[n.name] = total
        elif total != n.name:
            renamed[n.name] = total
    out: list[Node] = []
    for n in nodes:
        if sums_parts(n):  # a layer's residual add (or all-reduce) reads its streamed parts' sum
            extra = tuple(extra_reads[i] for i in n.inputs if i in extra_reads)
            ins = tuple(renamed.get(i, i) for i in n.inputs if i not in whole) + extra
            n = replace(n, inputs=ins) if ins != n.inputs else n
        out.append(n)
        if n.op == Op.INPUT and not n.attrs.hidden:  # (an MTP graph's hidden input is a second input node)
            out += first_fetches
        out += after.get(n.name, [])
    return recost_changed(g, g.replace_nodes(out), ctx)
