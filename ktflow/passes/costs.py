"""Cost annotation: predicted FLOPs, bytes and seconds of every node for one step."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, Work
from ..ir.types import Cost, DType
from ..options import CompileContext


def node_cost(n: Node, g: Graph, ctx: CompileContext) -> Cost:
    """Roofline time of `n` on the context's device: max(flops / peak, bytes / bandwidth)
    plus one fixed dispatch overhead. Bytes = weights read (the op's fraction: routed experts
    read only the experts hit) + KV cache read + activations in and out."""
    facts = FACTS[n.op]
    w = Work(tokens=ctx.tokens, context=ctx.context, batch=ctx.batch)
    act = g.act_dtype.itemsize
    flops = facts.flops(n.attrs, w)
    io = sum(g.by_name(i).out.numel(w.tokens) * g.by_name(i).out.dtype.itemsize for i in n.inputs)
    io += n.out.numel(w.tokens) * n.out.dtype.itemsize
    nbytes = (n.weight_elems() * ctx.weight_itemsize * facts.weight_fraction(n.attrs, w)
              + facts.state_elems(n.attrs, w) * act + io)
    if ctx.device == "cuda" and ctx.hw.gpus:
        gpu = ctx.hw.gpus[0]
        peak, bw, overhead = gpu.bf16_tflops * 1e12, gpu.hbm_gbps * 1e9, ctx.hw.overheads.gpu_launch_us * 1e-6
    else:
        cpu = ctx.hw.cpu
        peak = cpu.gemm_tflops * 1e12 * (0.5 if act == DType.F32.itemsize else 1.0)
        bw, overhead = cpu.gemv_gbps * 1e9, ctx.hw.overheads.cpu_submit_us * 1e-6
    seconds = max(flops / peak, nbytes / bw) + overhead
    return Cost(tokens=w.tokens, flops=flops, bytes=nbytes, seconds=seconds)


def annotate_costs(g: Graph, ctx: CompileContext) -> Graph:
    """Attach a `Cost` to every node.

    Algorithm: roofline per node from the facts table (`node_cost`), for a step of
    ctx.tokens tokens attending to ctx.context positions. Requires: a verified spec graph.
    Guarantees: every node has `cost`; nothing else changes.
    """
    return g.map(lambda n: replace(n, cost=node_cost(n, g, ctx)))
