"""NUMA split: CPU routed experts divided over the NUMA nodes, partial outputs reduced."""

from __future__ import annotations

import math
from dataclasses import replace

from ..errors import ConfigError
from ..ir.graph import Graph, Node
from ..ir.ops import Op, ReduceAttrs
from ..ir.types import Device, Placement
from ..plan.options import CompileContext
from .annotate_costs import cost_in, recost_changed, step_work
from .infra import compiler_pass


def tp_slices(inter: int, nodes: int, block: int) -> list[tuple[int, int]]:
    """Split 0..inter into at most `nodes` contiguous slices of whole blocks (the last block may
    be short), as even as the blocks allow; earlier nodes take the extra blocks."""
    blocks = -(-inter // block)
    base, extra = divmod(blocks, nodes)
    out, row = [], 0
    for i in range(nodes):
        nb = base + (1 if i < extra else 0)
        if nb == 0:
            continue
        hi = min(row + nb * block, inter)
        out.append((row, hi))
        row = hi
    return out


def ep_groups(ids: tuple[int, ...], load: dict[int, float], nodes: int) -> list[tuple[int, ...]]:
    """Whole experts per node, balanced by expected load: heaviest first onto the least loaded
    node (ties: lower node index, then lower expert id)."""
    total = [0.0] * nodes
    groups: list[list[int]] = [[] for _ in range(nodes)]
    for e in sorted(ids, key=lambda e: (-load[e], e)):
        k = min(range(nodes), key=lambda i: (total[i], i))
        groups[k].append(e)
        total[k] += load[e]
    return [tuple(sorted(gr)) for gr in groups if gr]


def _shards(n: Node, ctx: CompileContext, mode: str) -> list[Node]:
    a, nodes = n.attrs, ctx.numa_nodes
    if mode == "tp":
        parts = [replace(a, inter_slice=s) for s in tp_slices(a.inter, nodes, slice_block(ctx))]
        what = [f"rows {p.rows[0]}..{p.rows[1]} of every expert" for p in parts]
    else:
        w = step_work(n, ctx)
        probs = w.expert_probs or [a.top_k / a.experts] * a.experts
        parts = [replace(a, subset=grp) for grp in ep_groups(a.ids, dict(enumerate(probs)), nodes)]
        what = [f"{len(p.ids)} whole experts" for p in parts]
    return [replace(n, name=f"{n.name}.numa{i}", attrs=p, place=Placement(Device.CPU, numa=i, cause=f"NUMA node {i}: {w}"))
            for i, (p, w) in enumerate(zip(parts, what, strict=True))]


def _predicted(shards: list[Node], g: Graph, ctx: CompileContext) -> float:
    """Seconds until the slowest shard is done (they run at once, one per node)."""
    return max(cost_in(s, g, ctx).cpu_s for s in shards)


def slice_block(ctx: CompileContext) -> int:
    """Rows tp slices are multiples of: numa_block, and for fp8 experts also whole 128-column
    groups (a slice of the down matrix that starts inside a checkpoint block would have to be
    re-quantized instead of keeping the checkpoint's bytes)."""
    block = ctx.options.numa_block
    return math.lcm(block, 128) if ctx.expert_format == "fp8" else block


@compiler_pass(requires="placed", produces="placed")
def split_numa(g: Graph, ctx: CompileContext) -> Graph:
    """Split every CPU routed-experts node over the NUMA nodes, then reduce.

    Algorithm: with N > 1 NUMA nodes (the profile's, or the numa_nodes option), each CPU
    routed-experts node becomes shards `<node>.numa<i>` placed on node i and a reduce node with
    the original name that sums their partial outputs. tp: shard i owns a contiguous slice of the
    intermediate dimension of every expert (rows of gate/up, columns of down), slices whole
    multiples of `slice_block` rows with uneven remainders on the first nodes, so no weight is
    duplicated or read remotely. ep: shard i owns whole experts, balanced by expected load. auto:
    both are priced with the cost model (each shard gets its node's share of the CPU) and the
    cheaper kept, ties to tp; the reduce node's cause records the choice.
    Requires: placed graph. Guarantees: every expert row computed exactly once per layer (rule
    V10); consumers of the original node read the reduce, unchanged.
    """
    nodes = ctx.numa_nodes
    if nodes < 1:
        raise ConfigError(f"numa_nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return g
    out: list[Node] = []
    for n in g.nodes:
        if n.op != Op.ROUTED_EXPERTS or n.place.device != Device.CPU:
            out.append(n)
            continue
        options = {m: _shards(n, ctx, m) for m in ("tp", "ep")}
        times = {m: _predicted(s, g, ctx) for m, s in options.items()}
        mode = ctx.options.numa if ctx.options.numa != "auto" else min(("tp", "ep"), key=lambda m: (times[m], m != "tp"))
        shards = options[mode]
        why = (f"sum of {len(shards)} NUMA shards ({mode}; predicted tp {times['tp'] * 1e6:.1f} us, "
               f"ep {times['ep'] * 1e6:.1f} us{'; chosen by option' if ctx.options.numa != 'auto' else ''})")
        out += shards
        out.append(Node(n.name, Op.REDUCE, tuple(s.name for s in shards), ReduceAttrs(n.attrs.hidden), n.out,
                        place=Placement(Device.CPU, cause=f"{n.place.cause}; {why}")))
    return recost_changed(g, g.replace_nodes(out), ctx)
