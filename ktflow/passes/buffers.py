"""The buffer pass: every value of a step gets an arena and an offset, reused by liveness."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph
from ..ir.ops import Op
from ..ir.types import Device, Buffer
from ..ir.verify import needs_buffer
from ..plan.options import CompileContext
from ..plan.artifact import Instruction
from .infra import compiler_pass
from .schedule import instructions_of

#: alignment of a value's bytes per token (a cache line: every buffer of a step of t tokens starts
#: on a multiple of 64 x t bytes)
ALIGN = 64


@compiler_pass(requires="scheduled", produces="buffered")
def plan_buffers(g: Graph, ctx: CompileContext) -> Graph:
    """Give every value of the step a buffer: `Node.buffer`, a Buffer in an arena.

    Algorithm (`layout`): liveness over the scheduled graph's plan instructions (`instructions_of`),
    then first fit per arena in order of first instruction. Requires: a scheduled graph (its
    instructions are the ones the plan will hold). Guarantees (rules B1, B2): a buffer for every
    value an instruction writes except completion tokens, the token-id input (host memory the
    caller hands in) and syncs (a sync's value is its task's); staging buffers for fetched expert
    weights only, absolute; every other buffer per token, so the one layout serves a step of any
    number of tokens (a decode plan run at a larger batch than it was compiled for, a prefill
    chunk shorter than its bucket) without the backend planning anything; values live at once
    never share bytes of one arena.
    """
    placed = layout(g, instructions_of(g))
    return g.map(lambda n: replace(n, buffer=placed.get(n.name)))


def layout(g: Graph, instrs: list[Instruction]) -> dict[str, Buffer]:
    """Each value's Buffer.

    A value lives from the instruction that writes it to the last instruction that reads it (graph
    outputs to the end). Arena: pinned for values a PCIe copy reads or writes on the host side (the
    exchange memory, reused across layers), staging for streamed expert weights (fetch outputs:
    staging buffer i at i x the largest fetch), gpu for other GPU values, host for other CPU values.
    Sizes: per token, rounded up to ALIGN bytes (a value with no token dimension takes its whole
    size per token: more than it needs in a step of several tokens, never less); staging buffers
    their absolute size. Within an arena, values are placed in order of their first instruction at
    the lowest offset that no value live at the same time occupies (first fit).
    A sync's value is its task's (no buffer of its own; the task's stays live until the sync's
    readers are done). A CPU task runs asynchronously from its submit to its sync, so its nodes'
    values are live from the submit and their inputs until the sync.
    """
    alias = {n.name: n.inputs[1] for n in g.nodes if n.op == Op.SYNC}  # a sync passes its task's value on

    def home(v: str) -> str:
        while v in alias:
            v = alias[v]
        return v

    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, s in enumerate(instrs):
        for w in s.writes:
            first.setdefault(home(w), i)
            last[home(w)] = max(last.get(home(w), i), i)
        for r in s.reads:
            last[home(r)] = i
    for o in g.outputs:
        last[home(o)] = len(instrs) - 1
    _extend_async_tasks(g, instrs, first, last, home)
    pinned = set()
    for n in g.nodes:
        if n.op == Op.COPY:
            if n.attrs.src == "cpu":
                pinned.add(home(n.inputs[0]))
            if n.attrs.dst == "cpu":
                pinned.add(n.name)
    values = []
    for n in g.nodes:
        if not needs_buffer(n) or n.name not in first:
            continue
        arena = "pinned" if n.name in pinned else "staging" if n.op == Op.FETCH else (
            "gpu" if n.place.device == Device.GPU else "host")
        size = n.out.numel(0 if arena == "staging" else 1) * n.out.dtype.itemsize
        values.append((first[n.name], last[n.name], n.name, arena, -(-size // ALIGN) * ALIGN))
    placed: dict[str, Buffer] = {}
    live: dict[str, list[tuple[int, int, int]]] = {}  # arena -> (offset, size, last instruction)
    # staging: buffer i of the fetches at i x the largest fetch (a fetch waits for its buffer's last
    # reader, rule S2), so the arena is exactly staging_buffers x the largest fetch
    widest = max((size for _, _, _, arena, size in values if arena == "staging"), default=0)
    for start, end, name, arena, size in sorted(values):
        if arena == "staging":
            placed[name] = Buffer(arena, g.by_name(name).attrs.staging_buffer * widest, size, start, end, per_token=False)
            continue
        taken = sorted((o, sz) for o, sz, e in live.get(arena, []) if e >= start)
        offset = 0
        for o, sz in taken:
            if offset + size <= o:
                break
            offset = max(offset, o + sz)
        live.setdefault(arena, []).append((offset, size, end))
        placed[name] = Buffer(arena, offset, size, start, end, per_token=arena != "staging")
    return placed


def _extend_async_tasks(g: Graph, instrs: list[Instruction], first: dict[str, int], last: dict[str, int],
                        home) -> None:
    """Widen the lifetimes of CPU task values to the task's real extent: the CPU may write a
    member's output any time after the submit and read the member's inputs until the sync."""
    at = {(s.kind, s.node): i for i, s in enumerate(instrs)}
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
