"""Placement: GPU for the work that gains most per byte of VRAM, CPU for the rest."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..costmodel.roofline import transfer_seconds
from ..costmodel.memory import activation_peak, gpu_workspace_bytes
from ..errors import ConfigError
from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, CollectiveAttrs, Op, Work, fp8_holdable, sums_parts
from ..ir.types import FP8_BLOCK, Cost, Device, Placement, _si
from ..plan.options import CompileContext, vram_limit
from .annotate_costs import cost_in, recost_changed
from .infra import compiler_pass



@dataclass(frozen=True)
class Unit:
    """What placement decides about: a whole node, or one expert of a routed-experts node."""

    node: str
    expert: int | None
    vram: float  # bytes it takes on the GPU: weights (+ KV cache for attention)
    saving: float  # seconds per decode step it saves on the GPU instead of the CPU
    order: int  # graph position, for deterministic ties
    rank: int = 0  # an expert's place in its layer's order (most picked first): ties keep a layer's prefix


def gpu_budget(g: Graph, ctx: CompileContext) -> float:
    """Bytes of GPU memory for weights and KV caches (decode residency): the VRAM plan's
    (ctx.vram, set by the compile driver: ktflow.passes.vram_plan), else `residency_budget`."""
    if ctx.vram is not None:
        return ctx.vram.residency
    return residency_budget(g, ctx)


def residency_budget(g: Graph, ctx: CompileContext) -> float:
    """Decode residency without a VRAM plan: the VRAM limit (`options.vram_limit`) less the BLAS
    workspaces and the activations of a `prefill_tokens`-token step, capped by vram_budget_gb."""
    o = ctx.options
    limit = vram_limit(o, ctx.hw)
    act = activation_peak(g, o.prefill_tokens)
    budget = limit - act - gpu_workspace_bytes(ctx.hw)
    if o.vram_budget_gb is not None:
        return o.vram_budget_gb * 1e9 if o.allow_oversize else min(o.vram_budget_gb * 1e9, max(budget, 0.0))
    if budget <= 0:
        raise ConfigError(f"nothing fits on the GPU: vram_gb is {limit / 1e9:.2f} GB and the activations of a "
                          f"{o.prefill_tokens}-token prefill step take {act / 1e9:.2f} GB; raise vram_gb (or lower "
                          "vram_reserve_gb), or lower prefill_tokens")
    return budget


def _decode_work(ctx: CompileContext, n: Node) -> Work:
    probs = ctx.routing.probs(n.attrs.layer) if ctx.routing is not None and n.op == Op.ROUTED_EXPERTS else None
    b = ctx.options.max_batch
    return Work(tokens=b, context=ctx.max_seq_len // 2, batch=b, expert_probs=probs)


def _copies_avoided(n: Node, g: Graph, ctx: CompileContext, tokens: int) -> float:
    """PCIe time a dense node saves by staying beside its GPU neighbours: its inputs to the host
    and its output back (the residual stream lives on the GPU)."""
    down = sum(transfer_seconds(g.by_name(i).out.numel(tokens) * g.by_name(i).out.dtype.itemsize, ctx.hw, "d2h")
               for i in n.inputs)
    return down + transfer_seconds(n.out.numel(tokens) * n.out.dtype.itemsize, ctx.hw, "h2d")


def _units(g: Graph, ctx: CompileContext) -> tuple[list[Unit], dict[str, tuple[Cost, float]]]:
    """The placement units, and each weighted node's decode cost with the PCIe time a CPU
    placement would add (for the causes)."""
    units, gains = [], {}
    for i, n in enumerate(g.nodes):
        if not n.weights:
            continue
        w = _decode_work(ctx, n)
        c = cost_in(n, g, ctx, work=w, numa_nodes=1)
        # a layer's experts cross to the CPU anyway; dense nodes need not
        copies = _copies_avoided(n, g, ctx, w.tokens) if n.op != Op.ROUTED_EXPERTS else 0.0
        gains[n.name] = (c, copies)
        saving = c.cpu_s - c.gpu_s + copies
        vram = n.weight_bytes(ctx.weight_itemsize)
        if n.op == Op.ATTENTION:
            vram += n.attrs.kv_cache_elems_per_token() * ctx.max_seq_len * ctx.options.max_batch * g.act_dtype.itemsize
        if n.op != Op.ROUTED_EXPERTS:
            units.append(Unit(n.name, None, vram, saving, i))
            continue
        units += _expert_units(n, ctx, w, saving, vram, i)
    return units, gains


#: refill interval (decoded tokens) of a cache the routing profile cannot price (no curves)
DEFAULT_REFILL = 32


@dataclass(frozen=True)
class Residency:
    """What a layer's first S GPU rows are worth, and whether as a cache: `every` > 0 refills
    them every that many decoded tokens (a cache), 0 holds the S most picked experts (static)."""

    every: int
    value: float  # seconds per decode step the S rows save
    static: float  # what static S rows would save
    hits: float  # share of the layer's picks (batched curves: of its expert reads) the rows serve, expected
    copies: float  # experts copied in per decoded token (0 for static)
    priced: bool  # from the profile's cache curves (else a cache by default, unpriced)
    batch: int = 1  # conversations decoded together that the curves priced


def residency_choices(n: Node, ctx: CompileContext, w: Work, saving: float, vram: float) -> list[Residency]:
    """For S = 1 .. len(ids) GPU rows of routed-experts node `n` (whose decode step `saving`
    seconds on the GPU), the best use of S rows. Static: the S experts most likely hit, each
    worth its share of the node's saving (its chance of being hit in a step of w.tokens tokens
    over the node's total). With `expert_cache` and the routing profile's cache curves for the
    layer: a cache refilled every N tokens is worth `saving * hits_N[S]` less its copies, each
    copied expert priced at its bytes' time over PCIe to the GPU for every token of the step.
    (Measured on the H100 machine: a lone DMA of 2-32 MB beside the decode steps costs them
    0.14-0.58 of its link time, `copy_stall.py`, while a refill costs a step about 1.1-1.4 ms of
    the host's work whatever its 6-24 MB, at 605121b; with 25 MB experts the cache's steps showed
    no cost for its copies beyond the hits they bring, `cache_speed.py`. So one link time a copy
    overprices large experts and underprices small ones' refills: a per-refill host term is not
    priced.) S
    rows go to whichever is worth more (ties: static). Without curves a split layer is a cache
    refilled every DEFAULT_REFILL tokens, unpriced (valued as static). At max_batch > 1 the curves of a profiled
    batch (`RoutingProfile.cache_for`) give the share of the step's expert reads the rows serve,
    the unit the static value is in (each expert's chance of being read in the step), so a cache
    is worth `saving * hits_N[S]`; with one conversation's curves only, the picks' share is
    converted as at one token (an overstatement the cause states)."""
    ids = n.attrs.ids
    probs = w.expert_probs or [n.attrs.top_k / n.attrs.experts] * n.attrs.experts
    hit = [1.0 - (1.0 - min(p, 1.0)) ** w.tokens for p in probs]
    total = sum(hit[e] for e in ids) or 1.0
    ranked = sorted(ids, key=lambda e: (-hit[e], e))
    curves, batch = {}, 1
    if ctx.options.expert_cache and ctx.routing is not None and len(ids) == n.attrs.experts:
        curves, batch = ctx.routing.cache_for(ctx.options.max_batch, n.attrs.layer)
    per_copy = vram / len(ids) / (ctx.hw.gpus[0].pcie_h2d_gbps * 1e9) * w.tokens
    picks = sum(probs[e] for e in ids) or 1.0
    out, static, share, picked = [], 0.0, 0.0, 0.0
    for s, e in enumerate(ranked, start=1):
        static += saving * hit[e] / total
        share += hit[e] / total
        picked += probs[e] / picks
        best = Residency(0, static, static, share, 0.0, True)
        if s < n.attrs.experts and ctx.options.expert_cache:
            if not curves:
                best = Residency(DEFAULT_REFILL, static, static, share, 0.0, False)
            # batched curves: a share of the reads, worth the saving times it; one conversation's:
            # a share of the picks, worth what the static rows' share of the picks is worth
            worth = saving if batch > 1 else (static / picked if picked > 0 else saving)
            for every, c in sorted(curves.items()):
                v = worth * c.hits[s - 1] - per_copy * c.copies[s - 1]
                if v > best.value:
                    best = Residency(every, v, static, c.hits[s - 1], c.copies[s - 1], True, batch)
        out.append(best)
    return out


def _expert_units(n: Node, ctx: CompileContext, w: Work, saving: float, vram: float, order: int) -> list[Unit]:
    """One unit per GPU row of a routed-experts node, labelled with the expert a static choice
    would put there (most likely hit first). Static rows are each worth their expert's share of
    the saving. Where a priced cache is worth more for some S (`residency_choices`), row S is worth
    the slope of the upper concave envelope of S -> best value (S = all experts: the whole layer,
    static): no row is worth more than the one before, so greedy placement takes a prefix of each
    layer's rows, and a layer whose cache value levels off can still go whole to the GPU."""
    choices = residency_choices(n, ctx, w, saving, vram)
    probs = w.expert_probs or [n.attrs.top_k / n.attrs.experts] * n.attrs.experts
    ranked = sorted(n.attrs.ids, key=lambda e: (-probs[e], e))
    per = vram / len(n.attrs.ids)
    if not any(c.every and c.priced for c in choices):
        hit = [1.0 - (1.0 - min(p, 1.0)) ** w.tokens for p in probs]
        total = sum(hit[e] for e in n.attrs.ids) or 1.0
        gains = [saving * hit[e] / total for e in ranked]  # each expert's own share (no rounding of sums)
    else:
        gains = concave_slopes([c.value for c in choices])
    return [Unit(n.name, e, per, g, order, r) for r, (e, g) in enumerate(zip(ranked, gains))]


def concave_slopes(values: list[float]) -> list[float]:
    """Per step S = 1 .. len(values): the slope of the upper concave envelope of the points
    (0, 0), (S, values[S - 1]) over the step from S - 1 to S."""
    pts = [(0, 0.0)] + [(i + 1, v) for i, v in enumerate(values)]
    hull: list[tuple[int, float]] = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):  # hull[-1] on or below the chord
                hull.pop()
            else:
                break
        hull.append(p)
    out, last = [], float("inf")
    for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
        last = min(last, (y2 - y1) / (x2 - x1))  # never rising, rounding included
        out += [last] * (x2 - x1)
    return out


def take_units(units: list[Unit], budget: float, ranks: int = 1) -> dict[tuple[str, int | None], tuple[int, ...]]:
    """The greedy choice: units by decode seconds saved per byte of VRAM (ties in graph order,
    then a layer's order), each taken while it fits, with the ranks (GPUs) that hold it. Each of
    `ranks` GPUs has `budget` bytes: a dense unit is replicated, taken only where every rank has
    room for it; an expert goes to the one rank with the most room left (ties: the lowest), so a
    layer's experts are dealt out over the ranks and the ranks fill alike."""
    left = [budget] * ranks
    held: dict[tuple[str, int | None], tuple[int, ...]] = {}
    for u in sorted(units, key=lambda u: (-(u.saving / max(u.vram, 1.0)), u.order, u.rank)):
        if u.saving <= 0:
            continue
        if u.expert is None:
            if all(u.vram <= x for x in left):
                held[(u.node, None)] = tuple(range(ranks))
                left = [x - u.vram for x in left]
            continue
        r = max(range(ranks), key=lambda r: (left[r], -r))
        if u.vram <= left[r]:
            held[(u.node, u.expert)] = (r,)
            left[r] -= u.vram
    return held


@compiler_pass(requires="costed", produces="placed")
def place_by_intensity(g: Graph, ctx: CompileContext) -> Graph:
    """Place every node on the GPU or the CPU.

    Algorithm: without a GPU in the profile, everything goes to the CPU. Otherwise the units
    (each node with weights; each expert of a routed-experts node) are ranked by the decode
    time they save on the GPU per byte of VRAM they take (cost model, one decode step of
    max_batch tokens; an expert's share is its chance of being hit, from the routing profile or
    uniform) and taken greedily, ties in graph order, while they fit the budget (`gpu_budget`).
    Dense work read by every token ranks far above experts read with probability k/E, so
    attention, routers, shared experts and dense MLPs land first, then lm_head and embeddings,
    then hot experts while VRAM lasts. A layer whose experts are split becomes two nodes:
    L<i>.experts.gpu (the experts taken) and L<i>.experts (the rest, CPU). Nodes without
    weights follow their neighbours.
    Several GPUs (option gpus=N, this graph rank `rank`'s): the greedy runs over N budgets
    (`take_units`: dense units replicated, each expert on the rank with the most room), the
    rank keeps its own experts, rank 0 alone the CPU ones, and each MoE layer's parts on the
    rank feed `L<i>.experts.all_reduce` (`all_reduce_of`), which the layer's readers read; a
    router nothing reads on this rank is dropped.
    Option placement='cpu' / 'gpu' puts every node on that device instead (baselines).
    FP8 checkpoints (`_fp8_choices`): the dense weights the FP8 kernels can read are held in FP8
    on the GPU (WeightRef.held) when fp8_on_gpu='keep', or under 'auto' when the dense units
    would not all fit the budget dequantized (`_fp8_choice`); the routed experts stored in FP8
    (128 x 128 blocks) are held in FP8 when 'keep', or under 'auto' when the experts in the
    activation dtype and the dense units do not all fit the budget (`_fp8_experts_choice`; never
    with expert_cache), so about twice as many experts fit. Held weights are priced and counted
    at their stored size (with their scales) before the greedy choice above, and the causes of
    the GPU nodes holding them say why. A node placed on the CPU (a split layer's CPU part
    included) holds nothing in FP8.
    Requires: a costed graph. Guarantees: every node placed with a cause; GPU weights + KV
    caches fit the budget (each rank's); decisions use decode costs only, so the prefill and
    decode plans of one compile place identically (but for the whole layers a time-share step
    takes as its staging, `CompileContext.lends`: its CPU experts, to stream), and every rank
    computes the same division.
    """
    mode = ctx.options.placement
    if mode == "cpu" or not ctx.hw.has_gpu:
        why = "placement=cpu" if mode == "cpu" else f"profile {ctx.hw.name!r} has no GPU"
        if mode == "gpu":
            raise ConfigError(f"placement='gpu' but hardware profile {ctx.hw.name!r} has no GPU")
        return g.map(lambda n: replace(n, place=Placement(Device.CPU, cause=why)))
    budget = gpu_budget(g, ctx)
    units, gains = _units(g, ctx)
    keep_fp8, fp8_why, experts_fp8, experts_why = _fp8_choices(g, ctx, units, budget)
    if keep_fp8 or experts_fp8:
        g = recost_changed(g, g.map(lambda n: _hold_fp8(n, keep_fp8, experts_fp8)), ctx)
        units, gains = _units(g, ctx)
    if mode == "gpu":
        need = sum(u.vram for u in units)
        if need > budget:
            raise ConfigError(f"placement='gpu' needs {need / 1e9:.2f} GB of weights and KV caches on the GPU, "
                              f"the VRAM budget is {budget / 1e9:.2f} GB; use placement='auto'")
        return g.map(lambda n: replace(n, place=Placement(Device.GPU, cause="placement=gpu")))
    if units and min(u.vram for u in units) > budget:
        smallest = min(units, key=lambda u: u.vram)
        raise ConfigError(f"nothing fits on the GPU: the smallest placement unit ({smallest.node}) needs "
                          f"{_si(smallest.vram)}B, the VRAM budget is {_si(budget)}B; lower max_seq_len "
                          "or max_batch, or raise vram_gb (vram_budget_gb where set)")
    ranks, rank = ctx.options.gpus, ctx.options.rank
    held = take_units(units, budget, ranks)
    taken = {k for k, rs in held.items() if rank in rs}
    # time-share: a long prompt's step takes the lent layers' resident experts as its staging
    lent = {n.name for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in ctx.vram.lend_layers} \
        if ctx.lends else set()
    taken = {k for k in taken if k[0] not in lent or k[1] is None}
    elsewhere = {k for k, rs in held.items() if rank not in rs}  # experts another rank holds
    ridge = ctx.hw.gpus[0].bf16_tflops * 1e12 / (ctx.hw.gpus[0].hbm_gbps * 1e9)
    placed: dict[str, Device] = {}
    split: dict[str, str] = {}  # a split layer's CPU part -> its GPU part
    nodes: list[Node] = []
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS:
            parts = _place_experts(n, g, ctx, taken, ridge, placed, split, experts_why, elsewhere, n.name in lent)
            nodes += parts
            if ranks > 1:  # the ranks' parts of the layer meet in one all-reduce
                nodes.append(all_reduce_of(n, parts, ctx))
                split.pop(n.name, None)
            continue
        if not n.weights:
            nodes.append(n)  # placed below, after its neighbours
            continue
        c, copies = gains[n.name]
        why = (f"decode step cpu {_si(c.cpu_s)}s + copies {_si(copies)}s vs gpu {_si(c.gpu_s)}s; "
               f"{_si(n.weight_bytes(ctx.weight_itemsize))}B")
        dev = Device.GPU if (n.name, None) in taken else Device.CPU
        if dev == Device.CPU:
            why = ("over the VRAM budget; " if c.cpu_s + copies > c.gpu_s else "no faster on the GPU; ") + why
            n = _drop_fp8(n)
        elif fp8_why and any(fp8_holdable(n.op, w) and not w.experts for w in n.weights):
            why += "; " + fp8_why
        placed[n.name] = dev
        nodes.append(replace(n, place=Placement(dev, cause=why)))
    if ranks > 1:  # the layers' readers take the all-reduce instead of the parts
        layers = {n.name for n in g.nodes if n.op == Op.ROUTED_EXPERTS}
        nodes = [replace(n, inputs=tuple(f"{i}.all_reduce" if i in layers else i for i in n.inputs))
                 if n.op != Op.COLLECTIVE else n for n in nodes]
        for n in nodes:
            if n.op == Op.COLLECTIVE:
                placed[n.name] = Device.GPU
    placed_g = _rewire_split_experts(_place_weightless(g.replace_nodes(nodes), placed), split)
    if ranks > 1:  # a layer this rank holds none of: its router has no reader here
        placed_g = placed_g.without_unread()
    return recost_changed(g, placed_g, ctx)


def decode_savings(g: Graph, ctx: CompileContext, budgets: list[float]) -> list[float]:
    """Per residency budget: the decode seconds a step saves by the units `place_by_intensity`
    takes under it (its ranking and greedy, the FP8 choice included), so the VRAM plan can price
    what a smaller budget costs decode without placing again. `g`: the spec costed for decode."""
    if not ctx.hw.has_gpu:
        return [0.0] * len(budgets)
    def ranked(units: list[Unit]) -> list[Unit]:
        return sorted(units, key=lambda u: (-(u.saving / max(u.vram, 1.0)), u.order, u.rank))

    plain, _ = _units(g, ctx)
    orders = {(False, False): ranked(plain)}
    out = []
    for budget in budgets:
        dense, _, experts, _ = _fp8_choices(g, ctx, plain, budget)
        keep = (dense, experts)
        if keep not in orders:
            held = g.map(lambda n: _hold_fp8(n, dense, experts))
            orders[keep] = ranked(_units(recost_changed(g, held, ctx), ctx)[0])
        taken = take_units(orders[keep], budget, ctx.options.gpus)
        out.append(sum(u.saving for u in orders[keep] if (u.node, u.expert) in taken))
    return out


def _fp8_choices(g: Graph, ctx: CompileContext, units: list[Unit], budget: float) -> tuple[bool, str, bool, str]:
    """(dense weights held in FP8, why; routed experts held in FP8, why): `_fp8_choice` and
    `_fp8_experts_choice` under `budget`, from the units of the graph holding nothing in FP8."""
    dense, dense_why = _fp8_choice(g, ctx, units, budget)
    experts, experts_why = _fp8_experts_choice(g, ctx, units, budget, dense)
    return dense, dense_why, experts, experts_why


def _holdable(g: Graph, experts: bool) -> bool:
    """Does any node of `g` hold a weight it could hold in FP8: per-expert ones (`experts`) or dense ones."""
    return any(fp8_holdable(n.op, w) and bool(w.experts) == experts for n in g.nodes for w in n.weights)


def _fp8_blocks(ctx: CompileContext, what: str) -> str:
    """'' where the checkpoint's FP8 scale blocks are the 128 x 128 the GPU rules read; else why
    its FP8 weights are dequantized (fp8_on_gpu='keep': a ConfigError)."""
    block = ctx.fp8_block
    if block == (FP8_BLOCK, FP8_BLOCK):
        return ""
    if ctx.options.fp8_on_gpu == "keep":
        raise ConfigError(f"fp8_on_gpu='keep': the checkpoint's FP8 scale blocks are {block}, the FP8 kernels read "
                          f"{FP8_BLOCK}x{FP8_BLOCK}; use fp8_on_gpu='dequantize'")
    return f"{what} dequantized: scale blocks {block}, the FP8 kernels read {FP8_BLOCK}x{FP8_BLOCK}"


def _fp8_fixed(g: Graph, ctx: CompileContext, experts: bool) -> tuple[bool, str] | None:
    """The FP8 choice for the dense weights (`experts` False) or the routed experts where nothing
    needs pricing, with its cause: nothing holdable, scale blocks the kernels do not read, the
    expert cache (experts: dequantized), or fp8_on_gpu 'keep' / 'dequantize'; None under 'auto'."""
    what = "fp8 routed experts" if experts else "fp8 weights"
    if not _holdable(g, experts=experts):
        return False, ""
    mode = ctx.options.fp8_on_gpu
    blocks = _fp8_blocks(ctx, what)
    if blocks:
        return False, blocks
    if experts and ctx.options.expert_cache:
        return False, (f"{what} dequantized: expert_cache refills the GPU experts in the activation dtype "
                       f"(fp8_on_gpu={mode} applies to the dense weights)")
    if mode != "auto":
        return mode == "keep", f"{what} {'held in fp8' if mode == 'keep' else 'dequantized'} (fp8_on_gpu={mode})"
    return None


def _fp8_choice(g: Graph, ctx: CompileContext, units: list[Unit], budget: float) -> tuple[bool, str]:
    """Whether the dense weights an FP8 checkpoint stores in FP8 stay FP8 on the GPU, and why
    (the cause GPU nodes holding such weights carry): option fp8_on_gpu, and under 'auto' FP8
    only when the dense units (units with a decode saving, experts aside) dequantized would
    exceed the budget: cuBLAS on dequantized weights outruns the FP8 kernels at most shapes
    (benchmarks/fp8_linear.py), FP8 halves their bytes."""
    fixed = _fp8_fixed(g, ctx, experts=False)
    if fixed is not None:
        return fixed
    dense = sum(u.vram for u in units if u.expert is None and u.saving > 0)
    if dense <= budget:
        return False, f"fp8 weights dequantized: the dense units fit the budget so ({_si(dense)}B of {_si(budget)}B)"
    return True, f"fp8 weights held in fp8: the dense units need {_si(dense)}B dequantized, the budget is {_si(budget)}B"


def _fp8_experts_choice(g: Graph, ctx: CompileContext, units: list[Unit], budget: float,
                        dense_fp8: bool) -> tuple[bool, str]:
    """Whether the routed experts an FP8 checkpoint stores in FP8 are held in FP8 where placed on
    the GPU, and why (the cause of GPU experts nodes): option fp8_on_gpu ('keep': always,
    'dequantize': never), and under 'auto' FP8 only when the experts in the activation dtype and
    the dense units with a decode saving (as `dense_fp8` holds them) do not all fit the budget:
    then FP8 fits about twice as many experts in the same VRAM, each read at half the bytes;
    where all fit, the experts are dequantized (no dequantization per step). Every
    expert counts, whatever its saving in the activation dtype (one that saves nothing there may
    in FP8, read at half the bytes). Never with option expert_cache: the cache refills its rows
    in the activation dtype."""
    fixed = _fp8_fixed(g, ctx, experts=True)
    if fixed is not None:
        return fixed
    size = ctx.weight_itemsize
    nodes = {n.name: n for n in g.nodes}
    need = 0.0
    for u in units:
        if u.saving <= 0 and u.expert is None:
            continue
        need += u.vram
        if dense_fp8 and u.expert is None:  # the dense choice holds its FP8 weights at their stored size
            n = nodes[u.node]
            need -= n.weight_bytes(size) - _hold_fp8(n, True, False).weight_bytes(size)
    if need <= budget:
        return False, (f"fp8 routed experts dequantized: every expert fits the budget so ({_si(need)}B of "
                       f"{_si(budget)}B with the dense units)")
    return True, (f"routed experts held in fp8 (1 byte a weight and block scales): with them dequantized the GPU "
                  f"units need {_si(need)}B, the budget is {_si(budget)}B")


def _hold_fp8(n: Node, dense: bool = True, experts: bool = True) -> Node:
    """`n` with the weights it can hold in FP8 held so: the dense ones (`dense`), the per-expert ones (`experts`)."""
    def held(w) -> bool:
        return fp8_holdable(n.op, w) and (experts if w.experts else dense)

    if not any(held(w) for w in n.weights):
        return n
    return replace(n, weights=tuple(replace(w, held="fp8") if held(w) else w for w in n.weights))


def _drop_fp8(n: Node) -> Node:
    if not any(w.held for w in n.weights):
        return n
    return replace(n, weights=tuple(replace(w, held="") for w in n.weights))


def _place_experts(n: Node, g: Graph, ctx: CompileContext, taken, ridge: float, placed, split,
                   fp8_why: str = "", elsewhere=frozenset(), lent: bool = False) -> list[Node]:
    """The parts of routed-experts node `n` on this rank: its GPU experts (`taken`), and the CPU
    ones (neither taken nor held by another rank: `elsewhere`), which rank 0 alone computes; no
    part where this rank has none. `lent`: decode holds the layer, this step's staging takes it."""
    gpu_ids = tuple(e for e in n.attrs.ids if (n.name, e) in taken)
    cpu_ids = tuple(e for e in n.attrs.ids if (n.name, e) not in taken and (n.name, e) not in elsewhere)
    if ctx.options.rank > 0:  # rank 0 drives the CPU experts: computed once, one copy in host memory
        cpu_ids = ()
    whole = ctx.options.gpus == 1  # one GPU: a layer all on the GPU keeps its name (several: parts of an all-reduce)
    probs = ctx.routing.probs(n.attrs.layer) if ctx.routing is not None else None
    source = "routing profile" if probs else "uniform routing"
    # the share of the layer's picks its GPU experts are expected to take (the plan shows it)
    weights = probs or (1.0,) * n.attrs.experts
    total = sum(weights[e] for e in n.attrs.ids)
    share = sum(weights[e] for e in gpu_ids) / total if total > 0 else 0.0
    out = []  # a split layer: the CPU part keeps the name and comes first, its GPU part is <name>.gpu
    if cpu_ids:
        attrs = replace(n.attrs, subset=cpu_ids if (gpu_ids or len(cpu_ids) < len(n.attrs.ids)) else n.attrs.subset)
        part = replace(n, attrs=attrs)
        w = _decode_work(ctx, part)
        flops = FACTS[n.op].flops(part.attrs, w)
        nbytes = part.weight_elems() * ctx.weight_itemsize * FACTS[n.op].weight_fraction(part.attrs, w)
        why = (f"{len(cpu_ids)} of {n.attrs.experts} experts, {_si(part.weight_elems() * ctx.weight_itemsize)}B: "
               f"decode intensity {flops / max(nbytes, 1.0):.2f} FLOP/B, GPU ridge {ridge:.0f}; "
               + ("resident for decode, lent to this step's staging (time-share)" if lent else "over the VRAM budget"))
        out.append(replace(_drop_fp8(part), place=Placement(Device.CPU, cause=why)))
        placed[n.name] = Device.CPU
    if gpu_ids:
        name = n.name if not cpu_ids and whole else n.name + ".gpu"
        every, cache_why = _cache_choice(n, g, ctx, len(gpu_ids)) if cpu_ids else (0, "")
        attrs = replace(n.attrs, subset=gpu_ids if (cpu_ids or not whole) else n.attrs.subset, refill_every=every)
        why = (f"{len(gpu_ids)} of {n.attrs.experts} experts fit the VRAM budget: expected {share:.0%} of the "
               f"layer's picks ({source})" + cache_why + (f"; {fp8_why}" if fp8_why else ""))
        out.append(replace(n, name=name, attrs=attrs, place=Placement(Device.GPU, cause=why)))
        placed[name] = Device.GPU
        if cpu_ids:
            split[n.name] = name
    return out


def all_reduce_of(n: Node, parts: list[Node], ctx: CompileContext) -> Node:
    """The all-reduce that sums routed-experts layer `n` over the ranks: it reads this rank's
    `parts` of the layer (none: it adds zeros), runs on the GPU lane (its reader waits for it at
    once, so a lane of its own would overlap nothing), and every reader of the layer reads it
    instead."""
    gpu = sum(len(p.attrs.ids) for p in parts if p.place.device == Device.GPU)
    cpu = sum(len(p.attrs.ids) for p in parts if p.place.device == Device.CPU)
    r = ctx.options.gpus
    why = (f"expert parallel over {r} GPUs: sums the ranks' parts of layer {n.attrs.layer} (rank {ctx.options.rank}: "
           f"{gpu} of {n.attrs.experts} experts on its GPU" + (f", {cpu} on the CPU, which it drives" if cpu else "")
           + ")")
    return Node(f"{n.name}.all_reduce", Op.COLLECTIVE, tuple(p.name for p in parts),
                CollectiveAttrs("all_reduce", n.attrs.hidden, r, n.attrs.layer), n.out,
                place=Placement(Device.GPU, cause=why))


def _cache_choice(n: Node, g: Graph, ctx: CompileContext, rows: int) -> tuple[int, str]:
    """(refill interval, cause) for a split layer's `rows` GPU rows (`residency_choices`)."""
    if not ctx.options.expert_cache:
        return 0, ""
    w = _decode_work(ctx, n)
    c = cost_in(n, g, ctx, work=w, numa_nodes=1)
    ch = residency_choices(n, ctx, w, c.cpu_s - c.gpu_s, n.weight_bytes(ctx.weight_itemsize))[rows - 1]
    if not ch.priced:
        return ch.every, (f"; a cache the runtime refills every {ch.every} decoded tokens from recent routing (not "
                          "priced: the routing profile has no cache curves; record one with `ktflow profile`)")
    if ch.every:
        batch = ctx.options.max_batch
        if ch.batch > 1:
            shared = f"; priced for {ch.batch} conversations decoded together" + (
                f" (the largest batch the profile holds; the plan's is up to {batch})" if ch.batch < batch else "")
        elif batch > 1:
            shared = (f"; priced for one conversation: a batch of up to {batch} shares the rows, and is served "
                      "less (not modelled: the routing profile has no batched curves; record one with `ktflow "
                      "profile` and two or more prompts)")
        else:
            shared = ""
        unit = "expert reads" if ch.batch > 1 else "picks"
        return ch.every, (f"; a cache the runtime refills every {ch.every} decoded tokens from recent routing: "
                          f"{ch.hits:.0%} of the decoded {unit} for {ch.copies:.2f} experts copied in a token "
                          f"(the profile's cache curves), saving {_si(ch.value)}s a step against {_si(ch.static)}s "
                          f"static{shared}")
    return 0, "; no cache: the profile's cache curves price a refilled cache below these static experts"


def _place_weightless(g: Graph, placed: dict[str, Device]) -> Graph:
    """Nodes without weights (the residual adds) run on the GPU when any input comes from it, so
    the residual stream stays there; else on the CPU. The input node is on the CPU (host memory)."""
    nodes = list(g.nodes)
    for k, n in enumerate(nodes):
        if n.place is not None:
            continue
        if n.inputs:
            gpu_in = [i for i in n.inputs if placed[i] == Device.GPU]
            dev = Device.GPU if gpu_in else Device.CPU
            why = f"no weights: with its input {gpu_in[0] if gpu_in else n.inputs[0]}"
        else:
            dev, why = Device.CPU, "token ids arrive in host memory"
        placed[n.name] = dev
        nodes[k] = replace(n, place=Placement(dev, cause=why))
    return g.replace_nodes(nodes)


def _rewire_split_experts(g: Graph, split: dict[str, str]) -> Graph:
    """Every add that reads a split layer's CPU part also reads its GPU part (`split`: the CPU
    part's name -> the GPU part's, as `_place_experts` made them)."""
    out = []
    for n in g.nodes:
        extra = tuple(split[i] for i in n.inputs if i in split and sums_parts(n))
        out.append(replace(n, inputs=n.inputs + extra) if extra else n)
    return g.replace_nodes(out)
