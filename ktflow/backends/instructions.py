"""The one loop over a plan's instructions. Every runner (the executor's eager run, the CUDA decode
step that is captured as a graph, the prefill issued on the GPU lanes) walks `plan.instructions`
here; what differs is the handler each supplies per instruction kind and, optionally, a watcher
around each instruction.

Guarantees: instructions are handed over in plan order, each to `handlers[ins.kind]` (a kind
without a handler is a KeyError naming it); after instruction i the values no later instruction
reads (`plan.frees[i]`) are dropped from `values` unless `free=False` (a captured graph keeps every
value alive) or they are named in `keep`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from ..plan.artifact import Instruction, Plan

#: issues one instruction: (its index, the instruction, the values so far), writing what it makes into values
Handler = Callable[[int, Instruction, dict], None]


class Watcher(Protocol):
    """Sees each instruction before and after its handler (timers, the finite-value check)."""

    def before(self, i: int, ins: Instruction) -> None: ...

    def after(self, i: int, ins: Instruction, values: dict) -> None: ...


def nothing(i: int, ins: Instruction, values: dict) -> None:
    """The handler of an instruction kind a runner has nothing to do for."""


def run_instructions(plan: Plan, handlers: Mapping[str, Handler], values: dict[str, Any] | None = None, *,
                     free: bool = True, watcher: Watcher | None = None, keep: frozenset = frozenset()
                     ) -> dict[str, Any]:
    """Hand every instruction of `plan` to its kind's handler in order; returns the values."""
    values = {} if values is None else values
    frees = plan.frees
    for i, ins in enumerate(plan.instructions):
        if watcher is not None:
            watcher.before(i, ins)
        handlers[ins.kind](i, ins, values)
        if watcher is not None:
            watcher.after(i, ins, values)
        if free:
            for name in frees[i]:
                if name not in keep:
                    values.pop(name, None)
    return values
