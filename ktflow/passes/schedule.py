"""Schedule: the ordered steps of a plan with predicted start and end times."""

from __future__ import annotations

from ..ir.graph import Graph
from ..options import CompileContext
from ..plan import Step


def schedule(g: Graph, ctx: CompileContext) -> list[Step]:
    """One `launch` step per node, in graph order, on the lane of its device.

    Algorithm: list scheduling on one lane per device in topological order; a step starts when
    its lane is free and its inputs are done, and lasts its node's predicted seconds.
    Requires: costed and placed graph. Guarantees: every node appears in exactly one step, after
    the steps that produce its inputs.
    """
    lane_free: dict[str, float] = {}
    done: dict[str, float] = {}
    steps = []
    for n in g.nodes:
        lane = n.place.device.value
        start = max([lane_free.get(lane, 0.0)] + [done[i] for i in n.inputs])
        end = start + n.cost.on(n.place.device)
        lane_free[lane] = done[n.name] = end
        steps.append(Step(kind="launch", node=n.name, lane=lane, reads=list(n.inputs), writes=[n.name],
                          start_us=round(start * 1e6, 3), end_us=round(end * 1e6, 3)))
    return steps
