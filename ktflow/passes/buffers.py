"""Static buffer plan: every value of a step gets an arena and an offset, reused by liveness."""

from __future__ import annotations

from ..ir.graph import Graph
from ..ir.ops import Op
from ..ir.types import Device, DType
from ..plan import Buffer, Step

ALIGN = 256


def plan_buffers(g: Graph, steps: list[Step], tokens: int) -> tuple[list[Buffer], dict[str, int]]:
    """Assign each value an (arena, offset) for a step of `tokens` tokens.

    Algorithm: a value lives from the step that writes it to the last step that reads it (graph
    outputs to the end). Arena: pinned for values a PCIe copy reads or writes on the host side
    (the exchange buffer, reused across layers), gpu for other GPU values, host for other CPU
    values. Within an arena, values are placed in order of their first step at the lowest
    256-byte-aligned offset that no value live at the same time occupies (first fit). Streamed
    expert weights (fetch outputs) go to the staging arena: its first fit gives one slot per
    fetch in flight.
    A sync's value is its task's (no buffer of its own; the task's stays live until the sync's
    readers are done). A CPU task runs asynchronously from its submit to its sync, so its nodes'
    values are live from the submit and their inputs until the sync. Guarantees: values live at once never share bytes of one arena;
    completion tokens and the token-id input (host memory handed in by the caller) take no buffer.
    """
    alias = {n.name: n.inputs[1] for n in g.nodes if n.op == Op.SYNC}  # a sync passes its task's value on

    def home(v: str) -> str:
        while v in alias:
            v = alias[v]
        return v

    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, s in enumerate(steps):
        for w in s.writes:
            first.setdefault(home(w), i)
            last[home(w)] = max(last.get(home(w), i), i)
        for r in s.reads:
            last[home(r)] = i
    for o in g.outputs:
        last[home(o)] = len(steps) - 1
    _extend_async_tasks(g, steps, first, last, home)
    pinned = set()
    for n in g.nodes:
        if n.op == Op.COPY:
            if n.attrs.src == "cpu":
                pinned.add(home(n.inputs[0]))
            if n.attrs.dst == "cpu":
                pinned.add(n.name)
    values = []
    for n in g.nodes:
        if n.out.dtype == DType.TOKEN or n.op == Op.INPUT or n.name in alias or n.name not in first:
            continue
        arena = "pinned" if n.name in pinned else "staging" if n.op == Op.FETCH else (
            "gpu" if n.place.device == Device.GPU else "host")
        size = n.out.numel(tokens) * n.out.dtype.itemsize
        values.append((first[n.name], last[n.name], n.name, arena, -(-size // ALIGN) * ALIGN))
    buffers, arenas = [], {}
    live: dict[str, list[tuple[int, int, int]]] = {}  # arena -> (offset, size, last step)
    for start, end, name, arena, size in sorted(values):
        taken = sorted((o, sz) for o, sz, e in live.get(arena, []) if e >= start)
        offset = 0
        for o, sz in taken:
            if offset + size <= o:
                break
            offset = max(offset, o + sz)
        live.setdefault(arena, []).append((offset, size, end))
        arenas[arena] = max(arenas.get(arena, 0), offset + size)
        buffers.append(Buffer(value=name, arena=arena, offset=offset, bytes=size, first_step=start, last_step=end))
    return buffers, arenas


def _extend_async_tasks(g: Graph, steps: list[Step], first: dict[str, int], last: dict[str, int], home) -> None:
    """Widen the lifetimes of CPU task values to the task's real extent: the CPU may write a
    member's output any time after the submit and read the member's inputs until the sync."""
    at = {(s.kind, s.node): i for i, s in enumerate(steps)}
    sync_of = {n.inputs[1]: n.name for n in g.nodes if n.op == Op.SYNC}
    for sub in (n for n in g.nodes if n.op == Op.SUBMIT):
        start = at[("submit", sub.name)]
        ends = [at[("sync", sync_of[m])] for m in sub.attrs.members if m in sync_of]
        if not ends:
            continue
        end = max(ends)
        for m in sub.attrs.members:
            v = home(m)
            first[v] = min(first.get(v, start), start)
            for i in g.by_name(m).inputs:
                last[home(i)] = max(last.get(home(i), end), end)
