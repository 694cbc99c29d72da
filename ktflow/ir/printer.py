"""Deterministic text form of a graph: one line per node.

    <name> = <op>(<inputs>) <attrs> -> <type> [w=<tensors>/<elems>[:<stored formats>][ held fp8 <k>]] [@device] [cost] [t=<start>..<end>us]

(`held fp8 <k>`: k of its weights are held on the device as stored, in FP8.)

This text is the debug dump (`--print-after`, KTFLOW_DUMP) and the golden format in tests.
"""

from __future__ import annotations

from .graph import Graph, Node
from .ops import format_attrs
from .types import _si


def format_node(n: Node) -> str:
    attrs = format_attrs(n.attrs)
    line = f"{n.name} = {n.op.value}({', '.join(n.inputs)})"
    if attrs:
        line += " " + attrs
    line += f" -> {n.out}"
    if n.weights:
        line += f" w={len(n.weights)}/{_si(n.weight_elems())}"
        stored = sorted({w.fmt for w in n.weights if w.fmt})
        if stored:  # weights the checkpoint stores other than in the float dtype
            line += ":" + "+".join(stored)
        held = sum(w.held == "fp8" for w in n.weights)
        if held:
            line += f" held fp8 {held}"
    if n.place is not None:
        line += f" {n.place}"
        if n.place.cause:
            line += f" ({n.place.cause})"
    if n.cost is not None:
        line += f" | {n.cost}"
    if n.timing is not None:
        line += f" {n.timing}"
    if n.buffer is not None:
        line += f" {n.buffer}"
    return line


def print_graph(g: Graph) -> str:
    lines = [f"graph act={g.act_dtype.value} nodes={len(g)} outputs=({', '.join(g.outputs)})"]
    lines += [format_node(n) for n in g.nodes]
    return "\n".join(lines) + "\n"
