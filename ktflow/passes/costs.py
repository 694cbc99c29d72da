"""Cost annotation: predicted FLOPs, bytes and seconds on each device for every node."""

from __future__ import annotations

from dataclasses import replace

from ..cost import node_cost
from ..ir.graph import Graph, Node
from ..ir.ops import Op, Work
from ..options import CompileContext


def step_work(n: Node, ctx: CompileContext) -> Work:
    """The step size the plan is for, with the routing profile's probabilities for routed experts."""
    probs = None
    if ctx.routing is not None and n.op == Op.ROUTED_EXPERTS:
        probs = ctx.routing.probs(n.attrs.layer)
    return Work(tokens=ctx.tokens, context=ctx.context, batch=ctx.batch, expert_probs=probs)


def annotate_costs(g: Graph, ctx: CompileContext) -> Graph:
    """Attach a `Cost` to every node.

    Algorithm: the roofline cost model (ktflow.cost) per node, on the CPU and (when the profile
    has one) the GPU, for a step of ctx.tokens tokens attending to ctx.context positions; routed
    experts priced from the routing profile when given, else uniform routing.
    Requires: a verified spec graph. Guarantees: every node has `cost`; nothing else changes.
    """
    return g.map(lambda n: replace(n, cost=node_cost(n, g, step_work(n, ctx), ctx.hw, ctx.weight_itemsize,
                                                     ctx.numa_nodes, ctx.expert_format)))


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
        return replace(n, cost=node_cost(n, after, step_work(n, ctx), ctx.hw, ctx.weight_itemsize, ctx.numa_nodes,
                                         ctx.expert_format))

    return after.map(fresh)
