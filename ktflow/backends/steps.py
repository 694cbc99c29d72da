"""The one loop over a plan's steps. Every runner (the executor's eager run, the CUDA decode step
that is captured as a graph, the prefill issued on the GPU lanes) walks `plan.steps` here; what
differs is the handler each supplies per step kind and, optionally, a watcher around each step.

Guarantees: steps are handed over in plan order, each to `handlers[step.kind]` (a kind without a
handler is a KeyError naming it); after step i the values no later step reads (`plan.frees[i]`)
are dropped from `values` unless `free=False` (a captured graph keeps every value alive).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from ..plan.artifact import Plan, Step

#: issues one step: (its index, the step, the values so far), writing what it makes into values
Handler = Callable[[int, Step, dict], None]


class Watcher(Protocol):
    """Sees each step before and after its handler (timers, the finite-value check)."""

    def before(self, i: int, step: Step) -> None: ...

    def after(self, i: int, step: Step, values: dict) -> None: ...


def nothing(i: int, step: Step, values: dict) -> None:
    """The handler of a step kind a runner has nothing to do for."""


def run_steps(plan: Plan, handlers: Mapping[str, Handler], values: dict[str, Any] | None = None, *,
              free: bool = True, watcher: Watcher | None = None) -> dict[str, Any]:
    """Hand every step of `plan` to its kind's handler in order; returns the values."""
    values = {} if values is None else values
    frees = plan.frees
    for i, step in enumerate(plan.steps):
        if watcher is not None:
            watcher.before(i, step)
        handlers[step.kind](i, step, values)
        if watcher is not None:
            watcher.after(i, step, values)
        if free:
            for name in frees[i]:
                values.pop(name, None)
    return values
