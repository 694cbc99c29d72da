"""The VRAM plan: one limit for the whole run, shared between decode residency and prefill.

`decide` splits `limit` (option vram_gb, default the profile GPU's memory, less vram_reserve_gb)
between decode residency (`residency`: the GPU weights and KV caches the placement pass takes) and
the prefill reservation (activations of steps up to `chunk_tokens`, and `staging_buffers` buffers of
`stage_experts` streamed experts; in the time-share design the buffers are instead resident experts
of whole layers decode holds, lent to the long prompts' steps and restored after them), for a
declared workload: prompts of lengths P, equally likely,
and answers of N tokens. It compiles each candidate and keeps the runnable one with the shortest
mean request (within TIE, the one reserving less); prefill_reserve='none' keeps decode first,
'reserve' / 'time-share' choose among that design's candidates. The
decision and every candidate's numbers go into the plan file (`plan.artifact.VramPlan`).
Preconditions: the profile has a GPU and placement is not 'cpu' (else `decide` returns None).
Guarantees: the reservation, decode's activations, `residency` and the BLAS workspaces fit inside
`limit`; a limit nothing fits (or a vram_budget_gb / vram_gb the card cannot hold) is a ConfigError
naming the option and the numbers. Candidates and pricing: docs/design-notes.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Protocol

from ..errors import ConfigError
from ..ir.graph import Graph
from ..ir.ops import Op, expert_weight_bytes
from ..ir.types import Device
from ..costmodel.roofline import held_weight_bytes
from ..costmodel.memory import (gpu_activation_peak, gpu_workspace_bytes, hidden_row_bytes, resident_gpu_bytes,
    staging_for, stream_bytes, streamed_step_bytes)
from ..plan.options import WORKLOADS, CompileContext, CompileOptions, VramShare, vram_limit
from .annotate_costs import annotate_costs
from .place import decode_savings
from .prefill import LEND_SLACK, LEND_USE, layer_seconds, streamable
from ..plan.artifact import VramCandidate, VramPlan

#: candidates within this fraction of the fastest request count as tied: the one reserving less wins
TIE = 0.005

#: staging buffer sizes tried per bucket: a layer's CPU experts, halved up to this many times
HALVINGS = 4

#: the chosen reservation, refined to what its priced plan needs, keeps this much more
REFINE_MARGIN = 0.02

#: time-share staging sizes tried: a layer's experts, halved up to this many times
LEND_HALVINGS = 2


class Pricer(Protocol):
    """What the compile driver provides: placement and predictions under a given share."""

    def costed(self) -> Graph:
        """The spec costed for decode (through the first costing pass)."""

    def placed(self, share: VramShare) -> Graph:
        """The spec placed (through the first placing pass) for decode under `share`."""

    def decode_us(self, share: VramShare) -> tuple[float, Graph]:
        """The predicted decode step (us) under `share`, and its final graph."""

    def prefill(self, share: VramShare, tokens: int, attended: int) -> tuple[float, Graph]:
        """The predicted prefill step (us) of `tokens` tokens attending `attended` positions on
        average, and its scheduled graph."""


def bucket_grid(max_seq: int) -> list[int]:
    """Candidate bucket bounds: powers of two from 256 below max_seq_len, and max_seq_len."""
    grid, t = [], 256
    while t < max_seq:
        grid.append(t)
        t *= 2
    return grid + [max_seq]


def workload_of(opts: CompileOptions, max_seq: int) -> tuple[list[int], int, str]:
    """(prompt lengths, equally likely; answer tokens; description) the plan is priced for: the
    workload's, the explicit options over them, each prompt cut so that prompt and answer fit
    max_seq_len."""
    prompts, answer = WORKLOADS[opts.workload]
    prompts = (opts.workload_prompt_tokens,) if opts.workload_prompt_tokens else prompts
    answer = opts.workload_output_tokens if opts.workload_output_tokens is not None else answer
    named = opts.workload if opts.workload_prompt_tokens is None and opts.workload_output_tokens is None else "custom"
    most = max(max_seq - min(answer, max_seq // 2), 1)
    cut = sorted({min(p, most) for p in prompts})
    answer = min(answer, max_seq - max(cut))
    note = f"{named}: {'/'.join(map(str, cut))}-token prompts, {answer}-token answers"
    if cut != sorted(set(prompts)):
        note += f" (prompts cut to fit max_seq_len {max_seq})"
    return cut, answer, note


def check_limit(opts: CompileOptions, ctx: CompileContext) -> tuple[float, str]:
    """(the VRAM limit in bytes, where it comes from); ConfigError for a value the card cannot hold."""
    gpu = ctx.hw.gpus[0]
    limit = vram_limit(opts, ctx.hw)
    run = opts.vram_gb if opts.vram_gb is not None else gpu.memory_bytes / 1e9
    if limit <= 0:
        raise ConfigError(f"vram_reserve_gb={opts.vram_reserve_gb:g} leaves nothing of the run's {run:.2f} GB "
                          f"(vram_gb); lower vram_reserve_gb or raise vram_gb")
    if opts.vram_gb is None:
        return limit, f"{gpu.name} {gpu.memory_bytes / 1e9:.2f} GB less vram_reserve_gb {opts.vram_reserve_gb:g}"
    if opts.vram_gb * 1e9 > gpu.memory_bytes and not opts.allow_oversize:
        raise ConfigError(f"vram_gb={opts.vram_gb:g} is more than {gpu.name} has ({gpu.memory_bytes / 1e9:.2f} GB); "
                          "lower vram_gb (or pass allow_oversize to plan for a bigger card)")
    return limit, f"vram_gb={opts.vram_gb:g} less vram_reserve_gb {opts.vram_reserve_gb:g}"


@dataclass(frozen=True)
class _Sizes:
    """What the candidates are sized from (a graph placed decode-first)."""

    acts: dict[tuple[int, bool], float]  # (tokens, streamed) -> GPU activations of a step (with a chunk's past)
    grid: tuple[int, ...]
    decode_act: float
    workspaces: float
    expert_bytes: tuple[int, int, int, float]  # the widest layer's hidden, inter, act itemsize, packed bytes a weight
    layer_experts: int  # experts of the widest MoE layer (0: no routed experts)

    def act(self, c: int, streamed: bool = True) -> float:
        """GPU activations of prefill steps up to `c` tokens (the largest over the step sizes up
        to c), CPU experts counted as streamed (their scratch on the GPU) or not."""
        return max(v for (t, s), v in self.acts.items() if s == streamed and (t <= c or t == min(self.grid)))


def _sizes(g: Graph, ctx: CompileContext, grid: list[int], extra: list[int]) -> _Sizes:
    """Sizes from `g`, placed decode-first; activations over the grid and the `extra` step sizes,
    each with one value of the hidden size more than the placed graph shows (a CPU part's result
    copied back, which lowering adds)."""
    max_seq = ctx.max_seq_len
    row = hidden_row_bytes(g)
    sizes = sorted({*grid, *extra})
    acts = {(t, s): gpu_activation_peak(g, t, max(max_seq - t, 0), streamed=s) + t * row
            for t in sizes for s in (True, False)}
    # the widest MoE layer, whole: at a smaller residency than `g`'s any layer may stream
    widest = max((n for n in g.nodes if n.op == Op.ROUTED_EXPERTS), key=lambda n: n.attrs.experts * n.attrs.inter,
                 default=None)
    shape = (0, 0, g.act_dtype.itemsize, 0.0)
    if widest is not None:
        a = widest.attrs
        shape = (a.hidden, a.inter, g.act_dtype.itemsize, expert_weight_bytes(ctx.expert_format, a.hidden, a.inter))
    return _Sizes(acts, tuple(sizes), gpu_activation_peak(g, ctx.options.max_batch, decode=True),
                  gpu_workspace_bytes(ctx.hw),
                  shape, widest.attrs.experts if widest is not None else 0)


def _staging(s: _Sizes, experts: int, buffers: int, tokens: int = 0) -> float:
    """Staging of `experts` a buffer, and with `tokens`, the outputs of the widest layer's parts."""
    h, i, act, packed = s.expert_bytes
    if not tokens:
        return staging_for(experts, buffers, h, i, act, packed) if experts else 0.0
    return stream_bytes(s.layer_experts, experts, buffers, tokens, h, i, act, packed)


def decide(ctx_for: Callable[[str, int], CompileContext], opts: CompileOptions, max_seq: int,
           pricer: Pricer) -> tuple[VramShare, VramPlan, VramShare, VramShare] | None:
    """The VRAM plan (see the module doc): the chosen share, its record, the decode-first share
    it was weighed against, and the chosen share as estimated (its reservation not refined: the
    fallback should a plan of the refined one exceed the limit); None where there is nothing to
    share."""
    dctx = ctx_for("decode", opts.max_batch)
    if not dctx.hw.has_gpu or opts.placement == "cpu":
        return None
    limit, limit_why = check_limit(opts, dctx)
    prompts, answer, work_note = workload_of(opts, max_seq)
    grid = sorted({min(t, max_seq) for t in (opts.prefill_buckets or bucket_grid(max_seq))})
    cap = opts.vram_budget_gb * 1e9 if opts.vram_budget_gb is not None else math.inf
    ws = gpu_workspace_bytes(dctx.hw)
    buffers = opts.staging_buffers

    # sizes from a provisional decode-first placement (GPU activations depend only on the dense
    # part being on the GPU)
    first = min(opts.prefill_tokens, max_seq)
    if limit - ws <= 0:
        raise ConfigError(f"nothing fits in vram_gb: {limit / 1e9:.3f} GB ({limit_why}) is less than the BLAS "
                          f"workspaces {ws / 1e9:.3f} GB; raise vram_gb (or lower vram_reserve_gb)")
    provisional = VramShare(limit, min(cap, max(limit - ws, 0.0)), None, first)
    extra = [first] + ([opts.prefill_chunk] if opts.prefill_chunk else [])
    sizes = _sizes(pricer.placed(provisional), dctx, grid, extra)
    reserve_none = max(sizes.act(opts.prefill_chunk or first, streamed=False), sizes.decode_act)

    def residency(reserved: float) -> float:
        return min(cap, limit - ws - reserved)

    if limit - ws - reserve_none <= 0:
        raise ConfigError(f"nothing fits in vram_gb: {limit / 1e9:.2f} GB ({limit_why}) less the BLAS workspaces "
                          f"{ws / 1e9:.2f} GB and a {opts.prefill_chunk or first}-token prefill step's activations "
                          f"{reserve_none / 1e9:.2f} GB leaves nothing for weights; raise vram_gb, or lower "
                          "prefill_tokens (prefill_chunk) or max_seq_len")
    if opts.vram_budget_gb is not None and opts.allow_oversize and cap > limit - ws - reserve_none:  # a bigger card
        top_need = sizes.act(grid[-1]) + _staging(sizes, sizes.layer_experts, buffers, grid[-1])
        limit = cap + ws + max(reserve_none, top_need)
        limit_why += f", raised to {limit / 1e9:.2f} GB to hold vram_budget_gb={opts.vram_budget_gb:g} (allow_oversize)"
    elif opts.vram_budget_gb is not None:
        limit_why += f"; vram_budget_gb={opts.vram_budget_gb:g} caps decode residency"

    decoded: dict[float, tuple[float, Graph]] = {}

    def decode(share: VramShare) -> tuple[float, Graph]:
        key = round(share.residency)
        if key not in decoded:
            decoded[key] = pricer.decode_us(share)
        return decoded[key]

    needs: dict[VramShare, float] = {}  # a share -> what its priced chunk-sized step needs beside residency

    def prefill_s(share: VramShare, chunk: int) -> dict[int, float]:
        """Seconds of each workload prompt: the step of the bucket that holds it (as the runtime
        runs it), or ceil(P / chunk) chunks attending P/2 earlier positions on average."""
        out = {}
        for p in prompts:
            b = min([t for t in grid if p <= t <= chunk] or [chunk])
            us, g = pricer.prefill(share, b, (b + 1) // 2 if p <= chunk else p // 2)
            out[p] = (1 if p <= chunk else math.ceil(p / chunk)) * us * 1e-6
            if b == chunk:
                needs[share] = streamed_step_bytes(g, b, max(max_seq - b, 0))
        return out

    # decode first: the largest bucket whose activations fit next to the residency, staging what is left
    base = VramShare(limit, residency(reserve_none), None, first)
    placed = pricer.placed(base)
    weights, kv = resident_gpu_bytes(placed, dctx.weight_itemsize, max_seq * opts.max_batch)
    left = limit - ws - weights - kv
    whole = [t for t in grid if sizes.act(t) + _staging(sizes, sizes.layer_experts, buffers, t) <= left]
    some = [t for t in grid if sizes.act(t) + _staging(sizes, 1, buffers, t) <= left]
    plain = [t for t in grid if sizes.act(t, streamed=False) <= left]
    c0 = opts.prefill_chunk or max(whole or some or plain or [first])
    g0 = _buffer_experts(sizes, left - sizes.act(c0), buffers, c0)
    if opts.staging_experts:
        g0 = min(g0, opts.staging_experts)
    base = VramShare(limit, base.residency, g0, c0)

    cands: list[VramCandidate] = []

    refused: list[ConfigError] = []

    def add(name: str, design: str, share: VramShare, reserved: float, extra_s: float = 0.0) -> VramCandidate:
        """The candidate priced (`extra_s`: seconds a request pays besides, a time-share's restore);
        one the options refuse (prefill_experts='stream' without staging room) kept as not
        runnable, with the reason."""
        us, _ = decode(share)
        try:
            each, note = prefill_s(share, share.chunk_tokens), ""
        except ConfigError as e:
            refused.append(e)
            each, note = {}, str(e).split(". ")[0]
        pre = sum(each.values()) / len(each) if each else 0.0
        c = VramCandidate(name=name, design=design, chunk_tokens=share.chunk_tokens,
                          stage_experts=share.stage_experts or 0, reserved_bytes=reserved,
                          residency_bytes=share.residency, decode_us=us, prefill_s=pre, prompt_s=each,
                          extra_s=extra_s, request_s=pre + extra_s + answer * us * 1e-6, runnable=not note, note=note)
        cands.append(c)
        return c

    none = add("decode first", "none", base, reserve_none)
    shares = {none.name: base}
    if opts.prefill_reserve != "none" and opts.placement != "gpu":
        bucket = min([t for t in grid if t >= max(prompts)] or [grid[-1]])
        chunks = [opts.prefill_chunk] if opts.prefill_chunk else [t for t in grid if min(first, bucket) <= t <= bucket]
        costed = pricer.costed()

        def decode_loss(reserved: list[float]) -> list[float]:
            """Decode seconds a step loses with each reservation, against decode first."""
            budgets = [max(residency(r), 0.0) for r in reserved]
            base_saved, *saved = decode_savings(costed, dctx, [base.residency, *budgets])
            return [base_saved - s for s in saved]

        best: VramCandidate | None = None
        for c in sorted(chunks, reverse=True):  # down from the prompt's bucket while the requests get faster
            g = _screen(ctx_for, placed, sizes, c, prompts, answer, buffers, decode_loss, weights + kv, opts, limit,
                        ws, cap, reserve_none)
            if g is None:
                continue
            reserved = max(reserve_none, sizes.act(c) + _staging(sizes, g, buffers, c))
            share = VramShare(limit, residency(reserved), g, c)
            cand = add(f"reserve {c} tokens, {g} experts a buffer" if g else f"reserve {c} tokens, no staging",
                       "reserve", share, reserved)
            shares[cand.name] = share
            if not cand.runnable:
                continue
            if best is not None and cand.request_s > best.request_s:
                break
            best = cand
        top = max(chunks)
        full = sizes.layer_experts
        priced = any(c.design == "reserve" and c.chunk_tokens == top and c.stage_experts == full for c in cands)
        if full and opts.prefill_experts != "cpu" and not opts.staging_experts and not priced:
            reserved = max(reserve_none, sizes.act(top) + _staging(sizes, full, buffers, top))
            if residency(reserved) > 0:
                share = VramShare(limit, residency(reserved), full, top)
                cand = add(f"reserve {top} tokens, whole-layer staging ({full} experts a buffer)", "reserve", share,
                           reserved)
                shares[cand.name] = share
        # design b: staging in resident experts decode keeps, lent to long prompts' steps
        best_reserve = min((c for c in cands if c.design == "reserve" and c.runnable), key=lambda c: c.request_s,
                           default=None)
        barred = time_share_barred(opts)
        if best_reserve is not None and full and not barred:
            c = best_reserve.chunk_tokens
            lend_from = min(c, min([t for t in grid if t >= min(prompts)] or [grid[-1]]))
            sizes_tried = [opts.staging_experts] if opts.staging_experts else \
                sorted({max(1, -(-full // 2 ** i)) for i in range(LEND_HALVINGS + 1)}, reverse=True)
            h2d = dctx.hw.gpus[0].pcie_h2d_gbps * 1e9
            # restores a request pays: one after its prompt; with several slots, one after each of its
            # borrowing chunks (the others' decode steps run between them)
            restores = sum((math.ceil(p / c) if opts.max_batch > 1 else 1) for p in prompts if p >= lend_from) \
                / len(prompts)
            for k in sizes_tried:
                staged = _staging(sizes, k, buffers)  # the buffers and the landing buffer: borrowed
                reserved = max(reserve_none, sizes.act(c) + _staging(sizes, k, buffers, c) - staged)
                share = VramShare(limit, residency(reserved), k, c)
                layers, lent = lend_layers(pricer.placed(share), dctx, (staged + LEND_SLACK) / LEND_USE)
                if not layers:
                    continue
                share = replace(share, lend_layers=layers, lend_tokens=lend_from, lend_bytes=lent)
                span = f"L{layers[0]}" if len(layers) == 1 else f"L{layers[0]}-{layers[-1]}"
                cand = add(f"time-share {c} tokens, {k} experts a buffer in {span}'s experts", "time-share", share,
                           reserved, extra_s=restores * staged / h2d)
                shares[cand.name] = share
    runnable = [c for c in cands if c.runnable]
    if opts.prefill_reserve in ("reserve", "time-share"):  # the design asked for
        runnable = [c for c in runnable if c.design == opts.prefill_reserve]
        if not runnable:
            why = "; ".join(f"{c.name}: {c.note}" for c in cands if c.design == opts.prefill_reserve and c.note)
            if not why and opts.prefill_reserve == "time-share":
                why = time_share_barred(opts) or "no layer decode holds whole has the bytes to lend, or nothing streams"
            raise ConfigError(f"prefill_reserve={opts.prefill_reserve!r}: no such share of {limit / 1e9:.2f} GB runs "
                              f"({why or 'nothing streams'}); use prefill_reserve='auto'")
    if not runnable:
        raise refused[0]
    best = min(c.request_s for c in runnable)
    chosen = min((c for c in runnable if c.request_s <= best * (1 + TIE)),
                 key=lambda c: (c.reserved_bytes, c.request_s))
    share = shares[chosen.name]
    refined = chosen.reserved_bytes if chosen.design == "time-share" else \
        _refined(share, needs.get(share), chosen.reserved_bytes, sizes, grid, buffers, reserve_none)
    note = ""
    if refined < chosen.reserved_bytes:
        note = (f"; reservation refined from {chosen.reserved_bytes / 1e9:.2f} GB (estimated) to {refined / 1e9:.2f} "
                f"GB: what the priced {share.chunk_tokens}-token step needs, {1 + REFINE_MARGIN:.0%}")
        share = replace(share, residency=residency(refined))
    record = _record(chosen, none, cands, limit, limit_why, prompts, answer, work_note, opts, ws)
    record = record.model_copy(update=dict(reserved_bytes=min(refined, chosen.reserved_bytes),
                                           residency_bytes=share.residency, cause=record.cause + note))
    return share, record, base, shares[chosen.name]


def time_share_barred(opts: CompileOptions) -> str:
    """Why the options rule the time-share design out ("" where they do not)."""
    if opts.placement == "gpu":
        return "placement='gpu' leaves no expert to stream"
    if opts.gpus > 1:
        return f"gpus={opts.gpus}: lending resident experts is built for one GPU"
    if opts.expert_cache:
        return "expert_cache refills resident experts the time-share would lend"
    if opts.prefill_experts == "cpu":
        return "prefill_experts='cpu' streams nothing"
    return ""


def lend_layers(placed: Graph, ctx: CompileContext, need: float) -> tuple[tuple[int, ...], float]:
    """The MoE layers decode holds whole on the GPU (`placed`), the last first, until their experts'
    bytes reach `need`: (the layers, sorted; their bytes), or ((), 0.0) where they never do."""
    whole: dict[int, float] = {}
    split = set()
    for n in placed.nodes:
        if n.op != Op.ROUTED_EXPERTS:
            continue
        if n.place.device == Device.GPU and len(n.attrs.ids) == n.attrs.experts:
            whole[n.attrs.layer] = held_weight_bytes(n, Device.GPU, ctx.weight_itemsize, ctx.expert_format)
        else:
            split.add(n.attrs.layer)
    chosen, total = [], 0.0
    for layer in sorted(set(whole) - split, reverse=True):
        if total >= need:
            break
        chosen.append(layer)
        total += whole[layer]
    return (tuple(sorted(chosen)), total) if total >= need else ((), 0.0)


def _refined(share: VramShare, need: float | None, estimated: float, sizes: _Sizes, grid: list[int], buffers: int,
             floor: float) -> float:
    """The reservation a chosen share needs: its priced chunk-sized step's GPU activations and
    staging (REFINE_MARGIN above), the estimates of the smaller buckets (their past is longer),
    the floor; never more than the estimate the candidates were compared at."""
    if need is None or not share.stage_experts and share.chunk_tokens <= min(grid):
        return estimated
    smaller = [sizes.act(t) + _staging(sizes, share.stage_experts or 0, buffers, t) for t in grid
               if t < share.chunk_tokens]
    return min(estimated, max(need * (1 + REFINE_MARGIN), *smaller, floor))


def _buffer_experts(s: _Sizes, room: float, buffers: int, tokens: int) -> int:
    """The most experts a staging buffer holds in `room` bytes in a step of `tokens` tokens."""
    return next((g for g in range(s.layer_experts, 0, -1) if _staging(s, g, buffers, tokens) <= room), 0)


def _screen(ctx_for, placed: Graph, sizes: _Sizes, chunk: int, prompts: list[int], answer: int, buffers: int,
            decode_loss: Callable[[list[float]], list[float]], resident: float, opts: CompileOptions, limit: float,
            ws: float, cap: float, floor: float) -> int | None:
    """The staging buffer size (experts) for prefill steps of `chunk` tokens, from the halvings of a
    layer's experts (0 where none streams or prefill_experts='cpu'): the fastest by the prefill
    pass's layer time over the streamed layers and chunks, plus the answer's decode time the
    reservation costs (`decode_loss`: the placement's savings lost, per step). The streamed
    layers: those `placed` (decode first, holding `resident` bytes) leaves on the CPU, and the
    layers a reservation evicts. None: not even the activations fit."""
    full = sizes.layer_experts
    if not full or opts.prefill_experts == "cpu":
        ladder = [0]
    elif opts.staging_experts:
        ladder = [0, min(opts.staging_experts, full)]
    else:
        ladder = sorted({0, *(max(1, -(-full // 2 ** i)) for i in range(HALVINGS + 1))}, reverse=True)
    if opts.prefill_experts in ("stream", "split") and full:  # forced to stream: some staging
        ladder = [g for g in ladder if g] or [1]
    fits = [g for g in ladder if min(cap, limit - ws - sizes.act(chunk) - _staging(sizes, g, buffers, chunk)) > 0]
    if len(fits) <= 1:
        return fits[0] if fits else None
    moe = [n for n in placed.nodes if n.op == Op.ROUTED_EXPERTS]
    h, i, act, _ = sizes.expert_bytes
    layer = full * 3 * h * i * act
    reserved = [max(floor, sizes.act(chunk) + _staging(sizes, k, buffers, chunk)) for k in fits]
    losses = decode_loss(reserved)
    streamed = {}  # layers streamed under each buffer size: decode first's CPU layers and those a reservation evicts
    for k, r in zip(fits, reserved):
        evicted = max(0.0, resident - min(cap, limit - ws - r))
        streamed[k] = min(len(moe), len(streamable(placed)) + math.ceil(evicted / max(layer, 1.0)))
    score = {k: answer * loss for k, loss in zip(fits, losses)}
    for p in prompts:  # each prompt's chunks, its layers priced by the prefill pass at this buffer size
        ctx = ctx_for("prefill", min(chunk, p))
        if p > chunk:
            ctx = replace(ctx, context=p // 2)
        g = annotate_costs(placed, ctx)
        cpu = streamable(g)
        if not cpu:  # decode first holds every expert: price a layer as if the reservation evicted it
            widest = max(moe, key=lambda n: n.attrs.experts * n.attrs.inter)
            g = g.replace_nodes(replace(n, place=replace(n.place, device=Device.CPU)) if n.name == widest.name else n
                                for n in g.nodes)
            cpu = streamable(g)
        if not cpu:
            return 0
        node = max(cpu, key=lambda n: len(n.attrs.ids))
        for k in fits:
            score[k] += math.ceil(p / chunk) * streamed[k] * layer_seconds(g, ctx, node, k, buffers) / len(prompts)
    return min(score, key=lambda k: (score[k], k))


def _record(chosen: VramCandidate, none: VramCandidate, cands: list[VramCandidate], limit: float, limit_why: str,
            prompts: list[int], answer: int, work_note: str, opts: CompileOptions, ws: float) -> VramPlan:
    def gb(b: float) -> str:
        return f"{b / 1e9:.2f} GB"

    def rates(c: VramCandidate) -> str:
        return "/".join(f"{p / c.prompt_s[p]:.0f}" if c.prompt_s.get(p) else "-" for p in prompts)

    def line(c: VramCandidate) -> str:
        if not c.prefill_s:
            return f"{c.name}: reserve {gb(c.reserved_bytes)}, refused ({c.note})"
        extra = f" + copy-back {c.extra_s:.3f} s" if c.extra_s else ""
        tag = f" ({c.note})" if c.note else ""
        return (f"{c.name}: reserve {gb(c.reserved_bytes)}, request {c.request_s:.2f} s = prefill {c.prefill_s:.2f} s"
                f"{extra} + {answer} x {c.decode_us / 1e3:.2f} ms{tag}")

    forced = " (prefill_reserve=none)" if opts.prefill_reserve == "none" else ""
    cost = (chosen.decode_us / none.decode_us - 1.0) * 100 if none.decode_us else 0.0
    lengths = "/".join(map(str, prompts))
    cause = (f"VRAM limit {gb(limit)} ({limit_why}); workload {work_note}: chose {chosen.name}{forced}: "
             f"reserve {gb(chosen.reserved_bytes)} for prefill (activations of steps up to {chosen.chunk_tokens} "
             f"tokens, staging {chosen.stage_experts} experts a buffer), decode residency {gb(chosen.residency_bytes)}, "
             f"workspaces {gb(ws)}; decode {cost:+.1f}% against decode first, prefill of {lengths} tokens "
             f"{rates(chosen)} tok/s against {rates(none)}. Candidates (a request: the prompts' mean prefill and "
             "the answer's decode steps): " + "; ".join(line(c) for c in cands))
    return VramPlan(limit_bytes=limit, limit_cause=limit_why, workload=work_note, prompts=prompts,
                    output_tokens=answer, chosen=chosen.name, design=chosen.design,
                    reserved_bytes=chosen.reserved_bytes, residency_bytes=chosen.residency_bytes,
                    workspace_bytes=ws, chunk_tokens=chosen.chunk_tokens, stage_experts=chosen.stage_experts,
                    decode_us=chosen.decode_us, decode_us_without=none.decode_us, prefill_s=chosen.prompt_s,
                    prefill_s_without=none.prompt_s, candidates=cands, cause=cause)
