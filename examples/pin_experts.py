"""Example pass: pin chosen layers' routed experts to the GPU, whatever the cost model says.

    ktflow compile MODEL --pass examples/pin_experts.py:pin_first_moe_layer@after=place_by_intensity

or from Python, for any layers:

    ktflow.compile(model, passes=[("after:place_by_intensity", pin_layers({1, 2}))])

It runs after placement: every routed-experts node of a chosen layer goes to the GPU, with a cause
saying so. Later passes see ordinary GPU experts (no deferral, streaming or NUMA split for them,
copies around them from lowering). It does not check the VRAM budget: the plan's memory
prediction shows what the pinned experts cost, and compile refuses a plan that does not fit.
"""

from dataclasses import replace

from ktflow.ir.ops import Op
from ktflow.ir.types import Device, Placement


def pin_layers(layers: set[int]):
    """A pass moving the routed experts of MoE layers `layers` to the GPU."""

    def pin_experts(g, ctx):
        def pinned(n):
            if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in layers and n.place.device != Device.GPU:
                return replace(n, place=Placement(Device.GPU, cause=f"pinned to the GPU by pin_layers({sorted(layers)})"))
            return n

        return g.map(pinned)

    return pin_experts


def pin_first_moe_layer(g, ctx):
    """The CLI form: pin the first MoE layer's experts."""
    first = min(n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS)
    return pin_layers({first})(g, ctx)
