"""Cost annotation: predicted FLOPs, bytes and seconds on each device for every node."""

from __future__ import annotations

from dataclasses import replace

from ..costmodel.roofline import node_cost
from ..ir.graph import Graph, Node
from ..ir.ops import Op, Work
from ..ir.types import Cost
from ..plan.options import CompileContext
from .infra import compiler_pass


def cost_in(n: Node, g: Graph, ctx: CompileContext, *, work: Work | None = None, hw=None,
            numa_nodes: int | None = None, expert_format: str | None = None) -> Cost:
    """`cost.node_cost` as the passes call it: the context's hardware, weight size, NUMA node
    count and expert format, and the plan's step (`step_work`), each replaceable where a pass
    prices something else (a decode step in a prefill plan, one NUMA node's share, a link
    shared with a fetch)."""
    return node_cost(n, g, work if work is not None else step_work(n, ctx), hw if hw is not None else ctx.hw,
                     ctx.weight_itemsize, ctx.numa_nodes if numa_nodes is None else numa_nodes,
                     ctx.expert_format if expert_format is None else expert_format)


def step_work(n: Node, ctx: CompileContext) -> Work:
    """The step size the plan is for, with the routing profile's probabilities for routed experts."""
    probs = neighbours = None
    if ctx.routing is not None and n.op == Op.ROUTED_EXPERTS:
        probs = ctx.routing.probs(n.attrs.layer)
        if ctx.consecutive and ctx.routing.neighbours:
            got = ctx.routing.neighbours.get(n.attrs.layer)
            neighbours = tuple(got) if got is not None else None
    return Work(tokens=ctx.tokens, context=ctx.context, batch=ctx.batch, expert_probs=probs,
                neighbour_probs=neighbours)


@compiler_pass(requires="spec", produces="costed")
def annotate_costs(g: Graph, ctx: CompileContext) -> Graph:
    """Attach a `Cost` to every node.

    Algorithm: the roofline cost model (ktflow.costmodel.roofline) per node, on the CPU and (when the profile
    has one) the GPU, for a step of ctx.tokens tokens attending to ctx.context positions; routed
    experts priced from the routing profile when given, else uniform routing.
    Requires: a verified spec graph. Guarantees: every node has `cost`; nothing else changes.
    """
    return g.map(lambda n: replace(n, cost=cost_in(n, g, ctx)))


def recost_changed(before: Graph, after: Graph, ctx: CompileContext) -> Graph:
    """`after` with costs computed again for the nodes a pass created or changed: a new name, or
    another op, inputs, attrs, weights (an FP8 weight held as stored reads fewer bytes) or NUMA
    node (the one part of a placement the cost depends on)."""

    def fresh(n: Node) -> Node:
        old = before.by_name(n.name) if n.name in before else None
        if old is not None and n.cost is not None \
                and (old.op, old.inputs, old.attrs, old.weights) == (n.op, n.inputs, n.attrs, n.weights) \
                and (old.place.numa if old.place else None) == (n.place.numa if n.place else None):
            return n
        return replace(n, cost=cost_in(n, after, ctx))

    return after.map(fresh)
