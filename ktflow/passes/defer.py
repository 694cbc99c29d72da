"""Expert Deferral (decode plans): some routed experts of layer j land in layer j+1."""

from __future__ import annotations

from dataclasses import replace

from ..costmodel.roofline import transfer_seconds
from ..errors import ConfigError
from ..ir.graph import Graph, Node
from ..ir.ops import DeferAttrs, Op, ffn_residual
from ..ir.types import Device, Placement, _si
from ..plan.options import CompileContext
from .annotate_costs import cost_in, recost_changed
from .infra import compiler_pass


@compiler_pass(requires="placed", produces="placed")
def defer_experts(g: Graph, ctx: CompileContext) -> Graph:
    """Split each MoE layer's routed experts into immediate and deferred picks.

    Algorithm (decode plans only; prefill plans are returned unchanged): for MoE layer j with d_j
    > 0, every routed-experts node keeps each token's top k - d_j picks by routing weight
    (ranks 0..k-d_j, immediate) and a copy `<node>.def` takes the other d_j (deferred). A defer
    node `L<j>.deferred` sums the deferred parts and feeds layer j+1's residual add, so
        O_{j+1} = I_{j+1} + S_{j+1}(I_{j+1}) + R_imm_{j+1}(I_{j+1}) + R_def_j(I_j)
    (the paper's formula); the first MoE layer receives nothing, the last defers nothing. d_j:
    the `defer` option as one number for every MoE layer but the last, a list with one entry per
    MoE layer, or "auto": per layer the smallest d (at least 1, leaving at least 2 immediate) whose
    deferred CPU work lasts as long as the GPU work from layer j's sync to layer j+1's submit
    (the residual add, the next attention and router, the copies), so the CPU never waits for
    the GPU; a layer without CPU experts defers nothing.
    Requires: placed, costed graph. Guarantees: deferred edges span one layer (rule D1), nothing
    leaves the last MoE layer (D2), every pick of every token is computed once (V10).
    """
    opt = ctx.options.defer
    if ctx.phase != "decode" or opt in (None, 0, []):
        return g
    moe = sorted({n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS})
    if len(moe) < 2:
        return g
    top_k = next(n.attrs.top_k for n in g.nodes if n.op == Op.ROUTED_EXPERTS)
    ds, causes = _choose(g, ctx, moe, top_k, opt)
    if ctx.defer_choice:
        causes = {j: ctx.defer_choice if c == "fixed by option" else f"{c}; {ctx.defer_choice}" for j, c in causes.items()}
    out: list[Node] = []
    deferred: dict[int, list[str]] = {}
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS and ds.get(n.attrs.layer, 0) > 0:
            d, j = ds[n.attrs.layer], n.attrs.layer
            out.append(replace(n, attrs=replace(n.attrs, ranks=(0, top_k - d))))
            late = replace(n, name=f"{n.name}.def", attrs=replace(n.attrs, ranks=(top_k - d, top_k)),
                           place=replace(n.place, cause=f"deferred picks {top_k - d}..{top_k} ({causes[j]}); "
                                         + n.place.cause))
            out.append(late)
            deferred.setdefault(j, []).append(late.name)
            continue
        if n.op == Op.ADD and n.attrs.residual == "ffn":
            j = n.attrs.layer - 1
            if j in deferred:
                hidden = g.by_name(n.inputs[0]).out.shape[1]
                out.append(Node(f"L{j}.deferred", Op.DEFER, tuple(deferred.pop(j)), DeferAttrs(hidden, j, j + 1),
                                n.out, place=Placement(n.place.device, cause=f"layer {j}'s deferred experts, "
                                                       f"d={ds[j]} ({causes[j]})")))
                out.append(replace(n, inputs=n.inputs + (f"L{j}.deferred",)))
                continue
        out.append(n)
    return recost_changed(g, g.replace_nodes(out), ctx)


def _choose(g: Graph, ctx: CompileContext, moe: list[int], k: int, opt) -> tuple[dict[int, int], dict[int, str]]:
    if opt == "auto":
        ds, causes = {}, {}
        for j in moe[:-1]:
            ds[j], causes[j] = _auto(g, ctx, j, moe, k)
        return ds, causes
    if isinstance(opt, int):
        values = [opt] * (len(moe) - 1) + [0]
    else:
        values = list(opt)
        if len(values) != len(moe):
            raise ConfigError(f"defer list has {len(values)} entries; the model has {len(moe)} MoE layers "
                              f"({moe[0]}..{moe[-1]}): give one per MoE layer")
        if values[-1] != 0:
            raise ConfigError(f"defer list: the last MoE layer ({moe[-1]}) defers nothing, its entry must be 0, "
                              f"got {values[-1]}")
    for d in values:
        if not 0 <= d < k:
            raise ConfigError(f"defer={d} is not possible: each token has top_k={k} routed experts and at least one "
                              f"must stay immediate (0 <= defer < {k})")
    return dict(zip(moe, values, strict=True)), {j: "fixed by option" for j in moe}


def _auto(g: Graph, ctx: CompileContext, j: int, moe: list[int], k: int) -> tuple[int, str]:
    cpu = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == j and n.place.device == Device.CPU]
    if not cpu or k < 3:
        return 0, "auto: no CPU experts to overlap" if not cpu else f"auto: top_k {k} leaves no room"
    gap = _gpu_gap(g, ctx, j, moe)
    for d in range(1, k - 1):
        work = sum(_cpu_seconds(n, g, ctx, (k - d, k)) for n in cpu)
        if work >= gap or d == k - 2:
            return d, (f"auto: deferred CPU work {_si(work)}s vs GPU gap {_si(gap)}s"
                       + ("" if work >= gap else f"; capped at {k - 2} so 2 stay immediate"))
    raise AssertionError("unreachable")


def _cpu_seconds(n: Node, g: Graph, ctx: CompileContext, ranks: tuple[int, int]) -> float:
    """CPU time of `n` restricted to `ranks`; with N NUMA nodes, as one node's tensor-parallel
    shard (the NUMA pass that follows splits it that way)."""
    a = replace(n.attrs, ranks=ranks)
    nodes = ctx.numa_nodes
    if nodes > 1:
        a = replace(a, inter_slice=(0, max(1, a.inter // nodes)))
        m = replace(n, attrs=a, place=replace(n.place, numa=0))
    else:
        m = replace(n, attrs=a)
    return cost_in(m, g, ctx, numa_nodes=nodes).cpu_s


def _gpu_gap(g: Graph, ctx: CompileContext, j: int, moe: list[int]) -> float:
    """GPU seconds from layer j's expert sync to the next MoE layer's expert submit: the GPU nodes
    between them in graph order (residual add, attention, router; not the shared expert, which
    overlaps the CPU), plus the copies and the fixed submit/sync costs of the hand-off."""
    nxt = moe[moe.index(j) + 1]
    res = ffn_residual(g, j)
    start = g.position(res.name)
    end = min(i for i, n in enumerate(g.nodes) if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == nxt)
    gap = sum(n.cost.on(Device.GPU) for n in g.nodes[start:end] if n.place.device == Device.GPU and n.cost)
    if ctx.hw.has_gpu:
        b = ctx.tokens
        x = res.out
        gap += 2 * transfer_seconds(x.numel(b) * x.dtype.itemsize, ctx.hw, "d2h")  # activations + routing out
        gap += transfer_seconds(x.numel(b) * x.dtype.itemsize, ctx.hw, "h2d")  # expert output back
        gap += (ctx.hw.overheads.cpu_submit_us + ctx.hw.overheads.cpu_sync_us) * 1e-6
    return gap
