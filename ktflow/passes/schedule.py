"""Schedule: the ordered instructions of a plan on lanes, with predicted start and end times."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph
from ..ir.ops import Op
from ..ir.types import Timing
from ..plan.options import CompileContext
from ..plan.artifact import Instruction
from .infra import compiler_pass

#: instruction kind per op; everything else is a kernel launch on its lane (record/wait instructions
#: mark events)
INSTRUCTION_KIND = {Op.COPY: "copy", Op.SUBMIT: "submit", Op.SYNC: "sync", Op.FETCH: "fetch"}


@compiler_pass(requires="lowered", produces="scheduled")
def schedule(g: Graph, ctx: CompileContext) -> Graph:
    """Time every node of the step on its lane (the graph's order is the issue order).

    Algorithm: list scheduling in topological order; a node starts when its lane is free, its
    inputs are done and (a CPU task) its submit is done, and lasts its predicted seconds on its
    device. Lanes run concurrently, so CPU tasks overlap the GPU work placed between their submit
    and sync. Requires: a costed, placed, lowered graph. Guarantees: every node timed (rule T1:
    after its inputs; T2: one node at a time on a lane), predicted times from the cost model;
    `instructions_of` turns the timed graph into the plan's instructions.
    """
    lane_free: dict[str, float] = {}
    done: dict[str, float] = {}
    submitted = {m: n.name for n in g.nodes if n.op == Op.SUBMIT for m in n.attrs.members}  # task node -> submit
    timed = []
    for n in g.nodes:
        lane = n.place.lane
        deps = [done[i] for i in n.inputs] + ([done[submitted[n.name]]] if n.name in submitted else [])
        start = max([lane_free.get(lane, 0.0)] + deps)
        end = start + n.cost.on(n.place.device)
        lane_free[lane] = done[n.name] = end
        timed.append(replace(n, timing=Timing(round(start * 1e6, 3), round(end * 1e6, 3))))
    return g.replace_nodes(timed)


def instructions_of(g: Graph) -> list[Instruction]:
    """A scheduled graph's plan instructions: one per node, in graph order, on its lane at its
    predicted time, with the cross-lane orderings as record/wait events (`with_events`)."""
    instrs = [Instruction(kind=INSTRUCTION_KIND.get(n.op, "launch"), node=n.name, lane=n.place.lane,
                          reads=list(n.inputs), writes=[n.name], start_us=n.timing.start_us, end_us=n.timing.end_us)
              for n in g.nodes]
    return with_events(g, instrs)


def with_events(g: Graph, instrs: list[Instruction]) -> list[Instruction]:
    """Insert the cross-lane orderings as events: for a value read on another lane than the one
    that wrote it, a `record` right after the writer and a `wait` right before the first reader
    on each other lane (one event per value and reading lane)."""
    lane = {s.node: s.lane for s in instrs}
    end = {s.node: s.end_us for s in instrs}
    needed: dict[str, list[str]] = {}  # value -> lanes that read it
    for s in instrs:
        for r in s.reads:
            if lane.get(r) not in (None, s.lane) and s.lane not in needed.setdefault(r, []):
                needed[r].append(s.lane)
    out: list[Instruction] = []
    waited: set[tuple[str, str]] = set()
    for s in instrs:
        for r in s.reads:
            if s.lane in needed.get(r, []) and (r, s.lane) not in waited:
                waited.add((r, s.lane))
                out.append(Instruction(kind="wait", node=s.node, lane=s.lane, reads=[], writes=[],
                                       start_us=s.start_us, end_us=s.start_us, event=f"{r}>{s.lane}"))
        out.append(s)
        for to in needed.get(s.node, []):
            out.append(Instruction(kind="record", node=s.node, lane=s.lane, reads=[], writes=[],
                                   start_us=end[s.node], end_us=end[s.node], event=f"{s.node}>{to}"))
    return out
