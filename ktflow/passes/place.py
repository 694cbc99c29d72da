"""Placement on one device (the foundation's placement; arithmetic-intensity placement replaces it)."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph
from ..ir.types import Device, Placement
from ..options import CompileContext


def place_on_one_device(g: Graph, ctx: CompileContext) -> Graph:
    """Put every node on the context's device.

    Algorithm: ctx.device ('cuda' -> GPU, 'cpu' -> CPU), chosen by `compile` from the hardware
    profile and the `device` option. Requires: nothing. Guarantees: every node has a placement
    whose cause says why.
    """
    if ctx.device == "cuda":
        p = Placement(Device.GPU, cause=f"single-device plan on {ctx.hw.gpus[0].name}")
    else:
        why = "profile has no GPU" if not ctx.hw.has_gpu else "device=cpu"
        p = Placement(Device.CPU, cause=f"single-device plan on the CPU ({why})")
    return g.map(lambda n: replace(n, place=p))
