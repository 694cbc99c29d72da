"""Example pass: another Expert Deferral rule, built on the built-in pass.

The built-in `defer_experts` takes one d for every MoE layer, a list, or "auto" (cost model).
This rule defers more where the model is deeper: 1 pick per token in the first half of the MoE
layers, 2 in the second half (none out of the last). It replaces the built-in pass and calls it
with the per-layer list, so the graph rewrite and its verification are the built-in ones:

    ktflow compile MODEL --pass examples/defer_by_depth.py:defer_by_depth@replace=defer_experts
"""

from dataclasses import replace

from ktflow.ir.ops import Op
from ktflow.passes.defer import defer_experts


def defer_by_depth(g, ctx):
    moe = sorted({n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS})
    if ctx.phase != "decode" or len(moe) < 2:
        return g
    ds = [1 if i < len(moe) // 2 else 2 for i in range(len(moe))]
    ds[-1] = 0  # nothing leaves the last MoE layer
    return defer_experts(g, replace(ctx, options=ctx.options.model_copy(update={"defer": ds})))
