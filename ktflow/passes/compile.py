"""The compile driver: a model's graph spec and options to a plan file (`compile_plans`).

It prices and decides the VRAM share between decode residency and prompt staging (vram_plan),
runs the pass pipeline for the decode plan (defer='auto': for each candidate, the least deferral
within DEFER_TIE of the fastest) and for each prefill bucket, predicts every plan's step time
and memory (`_memory`), and checks that the plans fit the machine. It runs nothing: the caller
(ktflow.api.compile) validates the options, resolves the hardware and the device, and wraps the
plan file with its model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..costmodel.hw import HwProfile
from ..costmodel.memory import activation_peak, gpu_activation_peak, gpu_workspace_bytes, kv_cache_bytes, staging_bytes
from ..costmodel.roofline import held_weight_bytes
from ..costmodel.routing import RoutingProfile
from ..errors import ConfigError, PlanError
from ..ir.graph import Graph
from ..ir.ops import Op, host_packs
from ..ir.types import DTYPE_BY_NAME, Device
from ..plan.artifact import MemoryEstimate, ModelInfo, Plan, PlanFile
from ..plan.options import CompileContext, CompileOptions, VramShare
from ..util import notices
from ..util.progress import bar
from . import PIPELINE, PassTimer, default_instruments, edit_pipeline, pass_id, run_pipeline
from .schedule import instructions_of
from .speculation import decide as decide_speculation
from .vram_plan import bucket_grid, decide


def compile_plans(model: Any, hw: HwProfile, opts: CompileOptions, device: str, print_after: str | None = None,
                  passes: list | None = None, instruments: list | None = None) -> PlanFile:
    """The plan file of `model` (a frontend Model: its config, graph spec, quantization and
    identity) for `hw`, with `opts` validated and GPU nodes to run on `device` ('cuda' or 'cpu').
    `passes` edits the pipeline (passes.edit_pipeline); `instruments` watch the decode plan's and
    the largest prefill bucket's passes, as `print_after` and KTFLOW_DUMP do. Raises ConfigError
    where a plan does not fit the machine (unless opts.allow_oversize)."""
    cfg = model.config
    if opts.gpus > max(len(hw.gpus), 1) or (opts.gpus > 1 and not hw.gpus):
        raise ConfigError(f"gpus={opts.gpus} but hardware profile {hw.name!r} has {len(hw.gpus)} GPU(s); use a profile "
                          "with that many (h100-x2, h100-x4, 2x-rtx4090-workstation, or `ktflow hw probe` on the "
                          "machine) or lower gpus")
    if opts.gpus > 1 and opts.placement != "auto":
        raise ConfigError(f"gpus={opts.gpus} divides the experts between the ranks by the cost model: placement="
                          f"{opts.placement!r} would put every node on every rank; leave placement='auto'")
    if opts.gpus > 1 and (opts.defer is not None or opts.expert_cache):
        raise ConfigError("gpus > 1 does not take " + ("defer" if opts.defer is not None else "expert_cache")
                          + " yet (each rank's parts of a layer meet in one all-reduce); leave it out")
    if len(hw.gpus) > opts.gpus:
        notices.warn(f"hardware profile {hw.name!r} has {len(hw.gpus)} GPUs; the plans use {opts.gpus} "
                     f"(gpus={opts.gpus})", key="gpus")
    act = DTYPE_BY_NAME[opts.dtype] if opts.dtype else cfg.weight_dtype
    max_seq = opts.max_seq_len or min(4096, cfg.max_position_embeddings)
    spec = model.graph(act)
    if opts.expert_format == "auto":  # experts stored in FP8 (an FP8 release) keep their bytes
        stored = {w.fmt for n in spec.nodes if n.op == Op.ROUTED_EXPERTS for w in n.weights}
        opts = opts.model_copy(update=dict(expert_format="fp8" if stored == {"fp8"} else "bf16"))
    routing = None
    if opts.routing_profile:
        routing = RoutingProfile.load(opts.routing_profile)
        routing.check_against(spec)

    # the VRAM plan is rank 0's on every rank (the ranks must share it to agree on their experts)
    lead = opts.model_copy(update=dict(rank=0))

    def context(phase: str, tokens: int, share: VramShare | None = None, o: CompileOptions = opts) -> CompileContext:
        batch = tokens if phase == "decode" else 1
        attended = max_seq // 2 if phase == "decode" else (tokens + 1) // 2
        return CompileContext(hw=hw, options=o, phase=phase, tokens=tokens, batch=batch, context=attended,
                              weight_itemsize=act.itemsize, max_seq_len=max_seq, device=device,
                              routing=routing, fp8_block=model.quant.block if model.quant is not None else None,
                              vram=share)

    def leading(phase: str, tokens: int, share: VramShare | None = None) -> CompileContext:
        return context(phase, tokens, share, lead)

    pipeline = edit_pipeline(passes)
    watching = [*default_instruments(print_after), *(instruments or ())]
    decided = decide(leading, lead, max_seq, _Pricer(spec, leading, opts.max_batch, pipeline))
    share, vram, first, estimated = decided if decided is not None else (None, None, None, None)
    decode = _decode_plan(spec, context("decode", opts.max_batch, share), watching, pipeline)
    prefill = _prefill_plans(spec, lambda t: context("prefill", t, share), opts, max_seq, share, watching, pipeline)
    if share is not None and share != estimated and opts.rank > 0:  # as rank 0 decides below
        lead_decode = _decode_plan(spec, leading("decode", opts.max_batch, share), (), pipeline)
        lead_prefill = _prefill_plans(spec, lambda t: leading("prefill", t, share), lead, max_seq, share, (), pipeline)
        over = _over(share.limit, lead_decode, lead_prefill)
    else:
        over = share is not None and share != estimated and _over(share.limit, decode, prefill)
    if over:
        # the refined reservation was short for some bucket: the one the candidates were compared at
        share = estimated
        vram = vram.model_copy(update=dict(reserved_bytes=estimated.limit - estimated.residency - vram.workspace_bytes,
                                           residency_bytes=estimated.residency,
                                           cause=vram.cause + "; a bucket's plan exceeded the limit with the refined "
                                                 "reservation: the estimated one is kept"))
        decode = _decode_plan(spec, context("decode", opts.max_batch, share), watching, pipeline)
        prefill = _prefill_plans(spec, lambda t: context("prefill", t, share), opts, max_seq, share, watching,
                                 pipeline)
    if vram is not None and vram.design != "none":  # the decode-first plan's step beside this one's, both compiled
        without = vram.decode_us_without
        if opts.defer == "auto":
            without = _decode_plan(spec, context("decode", opts.max_batch, first)).predicted_step_us
        vram = vram.model_copy(update=dict(decode_us=decode.predicted_step_us, decode_us_without=without))
    info = ModelInfo(model_type=cfg.model_type, fingerprint=model.fingerprint, path=str(model.path.resolve()),
                     layers=cfg.num_hidden_layers)
    prefill = _fetch_packs(decode, prefill)
    decode = _lending(decode, prefill, share)
    decode = _with_staging(decode, prefill)
    # speculative decoding with the model's MTP layer: its own plans, where the cost model keeps it
    left = None if vram is None else (vram.limit_bytes - max(p.memory.gpu_bytes for p in (decode, *prefill))) / 1e9
    host = hw.cpu.memory_bytes
    host_left = (host - max(p.memory.host_bytes for p in (decode, *prefill))) / 1e9 if host else None

    def verify_plan(t: int) -> Plan:  # t consecutive tokens of one sequence, attending as a decode step does
        ctx = replace(context("prefill", t, share), context=max_seq // 2, consecutive=True)
        return _shared_staging([*prefill, _compile_plan(spec, ctx, (), pipeline)])[-1]

    speculation, draft, verify = decide_speculation(
        model, opts, device, decode, routing, verify_plan,
        compile_part=lambda part, o: compile_plans(part, hw, o, device, passes=passes), gpu_left_gb=left,
        host_left_gb=host_left)
    if verify is not None and all(p.step_tokens != verify.step_tokens for p in prefill):
        prefill = _fetch_packs(decode, sorted([*prefill, verify], key=lambda p: p.step_tokens))
    pf = PlanFile(model=info, hw=hw, options=opts, prefill=prefill, decode=decode,
                  pipeline=[pass_id(fn) for fn, _ in pipeline], vram=vram, speculation=speculation, draft=draft)
    if not opts.allow_oversize:
        _check_fits(pf, runnable=model.weights is not None)
    return pf


def _memory(g: Graph, ctx: CompileContext) -> MemoryEstimate:
    """Predicted memory per device: weights and KV caches where their nodes are placed (a GPU
    expert has no host copy, unless its layer's GPU part is a cache, whose CPU packs hold every
    expert, and whose rows stay on the GPU in a prefill step that streams the layer whole;
    streamed experts live in host memory, their fetch stages them; CPU experts once per
    packed slice, which a deferred part shares with its immediate one), a
    step's activations on each device that runs nodes (GPU: live values and the running node's
    scratch, for the longest context a step may follow), the staging of streamed experts and the
    BLAS workspaces. The GPU bytes are what the run allocates: the reserve (vram_reserve_gb) is
    outside them."""
    weights = {Device.CPU: 0.0, Device.GPU: 0.0}
    packed = set()  # CPU expert slices already counted: a deferred twin shares its immediate part's pack
    # a layer whose GPU experts are a cache: each of its CPU packs holds every expert of the layer
    cached = {n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached}
    for n in g.nodes:
        device = Device.CPU if n.op == Op.FETCH else n.place.device
        scale = 1.0
        if n.op == Op.ROUTED_EXPERTS and device == Device.CPU:
            key = (tuple(w.key for w in n.weights), n.attrs.ids, n.attrs.rows, n.place.numa)
            if key in packed:
                continue
            packed.add(key)
            if n.attrs.layer in cached:
                scale = n.attrs.experts / len(n.attrs.ids)
        weights[device] += scale * held_weight_bytes(n, device, ctx.weight_itemsize, ctx.expert_format)
        if n.op == Op.ROUTED_EXPERTS and n.attrs.cache_size:  # a cache's rows, resident though this step streams
            weights[Device.GPU] += n.attrs.cache_size * 3 * n.attrs.hidden * n.attrs.inter * ctx.weight_itemsize
    kv_tokens = ctx.max_seq_len * ctx.options.max_batch
    kv_gpu, kv_all = kv_cache_bytes(g, kv_tokens, Device.GPU), kv_cache_bytes(g, kv_tokens)
    on_gpu = any(n.place.device == Device.GPU for n in g.nodes)
    act = activation_peak(g, ctx.tokens)
    if not on_gpu:
        return MemoryEstimate(weight_bytes=weights[Device.CPU], kv_cache_bytes=kv_all, activation_bytes=act,
                              gpu_bytes=0.0, host_bytes=weights[Device.CPU] + kv_all + act)
    past = max(ctx.max_seq_len - ctx.tokens, 0) if ctx.phase == "prefill" else 0
    gpu_act = gpu_activation_peak(g, ctx.tokens, past, decode=ctx.phase == "decode")
    staging = staging_bytes(g)
    ws = gpu_workspace_bytes(ctx.hw)
    lent = 0.0
    if ctx.lends:  # the lent layers' experts stay in VRAM (decode's), their memory this step's staging;
        lent, staging = ctx.vram.lend_bytes, 0.0  # their host copy, kept to restore them, is pinned
    return MemoryEstimate(weight_bytes=weights[Device.CPU] + weights[Device.GPU] + lent, kv_cache_bytes=kv_all,
                          activation_bytes=gpu_act, workspace_bytes=ws, staging_bytes=staging,
                          gpu_bytes=weights[Device.GPU] + lent + kv_gpu + gpu_act + staging + ws,
                          host_bytes=weights[Device.CPU] + lent + (kv_all - kv_gpu) + act)


def _compile_plan(spec: Graph, ctx: CompileContext, instruments=(), pipeline=PIPELINE) -> Plan:
    timer = PassTimer()
    g, ctx = _lending_run(spec, ctx, pipeline, [timer, *instruments])
    instrs = instructions_of(g)  # the scheduled graph's instructions
    return Plan.of_graph(g, phase=ctx.phase, device=ctx.device, max_seq_len=ctx.max_seq_len, step_tokens=ctx.tokens,
                instructions=instrs, predicted_step_us=_predicted_step_us(g, ctx),
                memory=_memory(g, ctx), pass_seconds=timer.seconds,
                capture=[(0, len(instrs) - 1)] if _captured(g, ctx) else [],
                borrows=ctx.lends and staging_bytes(g) > 0)


def _lending_run(spec: Graph, ctx: CompileContext, pipeline, instruments=()) -> tuple[Graph, CompileContext]:
    """The pipeline under `ctx`; a step that would stage in lent experts but streams nothing at
    its size runs again with the lent layers resident (and its context saying so)."""
    g = run_pipeline(spec, ctx, pipeline=pipeline, instruments=instruments)
    if ctx.lends and not staging_bytes(g):
        ctx = replace(ctx, vram=replace(ctx.vram, lend_tokens=ctx.tokens + 1))
        g = run_pipeline(spec, ctx, pipeline=pipeline, instruments=instruments)
    return g, ctx


def _captured(g: Graph, ctx: CompileContext) -> bool:
    """A decode plan with GPU work runs as one captured CUDA graph."""
    return ctx.phase == "decode" and any(n.place.device == Device.GPU for n in g.nodes)


def _predicted_step_us(g: Graph, ctx: CompileContext) -> float:
    """The scheduled graph's last end, plus, for a captured plan, every step's fixed time
    (`overheads.decode_step_us`) and one launch's (`overheads.graph_step_us`, the host's work around
    it) shared by the greedy steps one launch runs (`greedy_steps`: the steps after the first take
    their token on the GPU)."""
    o = ctx.hw.overheads
    fixed = o.decode_step_us + o.graph_step_us / ctx.options.greedy_steps if _captured(g, ctx) else 0.0
    return max((n.timing.end_us for n in g.nodes), default=0.0) + fixed


#: defer="auto" keeps the least deferral predicted within this fraction of the fastest candidate
#: (deferral changes the model's outputs: it has to pay for itself)
DEFER_TIE = 0.01


def _decode_plan(spec: Graph, ctx: CompileContext, instruments=(), pipeline=PIPELINE) -> Plan:
    """The decode plan. With defer="auto", the cost model picks the deferral: the decode plan of
    every candidate is compiled and scheduled (no deferral, each uniform d from 1 to top_k - 2,
    and the defer pass's per-layer rule, which defers until the CPU work covers the GPU gap),
    and the one predicted fastest is kept; among those within DEFER_TIE of it, the one deferring
    the fewest picks. With a calibrated profile (`ktflow calibrate`) the prediction is fitted to
    measured steps, so this is the choice that measures fastest as far as the model holds. The
    chosen plan's deferred nodes name the candidates' predicted steps (their causes)."""
    opts = ctx.options
    top_k = max((n.attrs.top_k for n in spec.nodes if n.op == Op.ROUTED_EXPERTS), default=0)
    if opts.defer != "auto" or top_k < 3:
        return _compile_plan(spec, ctx, instruments, pipeline)
    tried = []
    for d in [0, *range(1, top_k - 1), "auto"]:
        c = replace(ctx, options=opts.model_copy(update=dict(defer=d or None)))
        g = run_pipeline(spec, c, pipeline=pipeline)
        deferred = {n.attrs.layer: n.attrs.rank_range[1] - n.attrs.rank_range[0]
                    for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.deferred}
        tried.append((_predicted_step_us(g, c), d, sum(deferred.values())))
    best = min(us for us, _, _ in tried)
    us, d, _ = min((t for t in tried if t[0] <= best * (1 + DEFER_TIE)), key=lambda t: (t[2], t[0]))
    label = lambda d: "the per-layer rule" if d == "auto" else f"d={d}"  # noqa: E731
    note = (f"auto: {label(d)} predicted {us:.0f} us/step (candidates: "
            + ", ".join(f"{label(d)} {u:.0f}" for u, d, _ in tried) + ")")
    return _compile_plan(spec, replace(ctx, options=opts.model_copy(update=dict(defer=d or None)), defer_choice=note),
                         instruments, pipeline)


def _signature(plan: Plan) -> tuple:
    """What a prefill bucket decided: where each routed-experts node runs and which experts."""
    return tuple((n.name, n.place.device.value, n.attrs.ids, len(n.inputs)) for n in plan.ir.nodes
                 if n.op == Op.ROUTED_EXPERTS)


def _prefill_plans(spec: Graph, ctx_for, opts: CompileOptions, max_seq: int, share: VramShare | None,
                   instruments=(), pipeline=PIPELINE) -> list[Plan]:
    """One prefill plan per bucket. Buckets: the prefill_buckets option, else the grid of
    `vram_plan.bucket_grid` with neighbours whose decisions agree merged (the larger bound kept).
    Bounds above the largest step (prefill_chunk, else the VRAM plan's chunk_tokens) are cut to
    it: longer prompts chunk. Every GPU plan's staging is counted at the largest any bucket lays
    out (the runtime shares one staging buffer between buckets, grown to the largest, and keeps it)."""
    auto = opts.prefill_buckets is None
    cands = sorted({min(t, max_seq) for t in (opts.prefill_buckets or bucket_grid(max_seq))})
    if any(t < 1 for t in cands):
        raise ConfigError(f"prefill_buckets must be positive token counts, got {opts.prefill_buckets}")
    limit = opts.prefill_chunk or (share.chunk_tokens if share is not None else cands[-1])
    cands = sorted({min(t, limit) for t in cands})
    ctx = ctx_for(cands[-1])
    if auto and (not ctx.hw.has_gpu or opts.placement == "cpu"):
        cands = cands[-1:]  # nothing to stream: every bucket would decide the same
    plans: list[Plan] = []
    for t in bar(cands, "compile: prefill buckets", "plan", show=len(cands) > 1):
        plan = _compile_plan(spec, ctx_for(t), instruments if t == cands[-1] else (), pipeline)
        # several ranks keep every bucket: a rank past 0 (no CPU experts) would merge buckets rank 0
        # keeps apart, and the ranks must run the same steps
        if auto and opts.gpus == 1 and plans and _signature(plans[-1]) == _signature(plan):
            plans[-1] = plan  # same decisions: the larger bucket covers both
        else:
            plans.append(plan)
    return _shared_staging(plans)


def _lending(decode: Plan, prefill: list[Plan], share: VramShare | None) -> Plan:
    """The decode plan naming the GPU routed-experts nodes it lends (Plan.lent_experts: the share's
    lent layers, whole on the GPU) where some prefill plan borrows them; a lent layer decode does
    not hold whole is a PlanError (the VRAM plan chose it from this placement)."""
    if share is None or not any(p.borrows for p in prefill):
        return decode
    nodes = [n for n in decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in share.lend_layers]
    bad = sorted({n.attrs.layer for n in nodes if n.place.device != Device.GPU or len(n.attrs.ids) != n.attrs.experts})
    if bad or len({n.attrs.layer for n in nodes}) != len(share.lend_layers):
        raise PlanError(f"the VRAM plan lends layers {list(share.lend_layers)} to prefill staging, but the decode plan "
                        f"does not hold {bad or 'them'} whole on the GPU")
    return decode.model_copy(update=dict(lent_experts=tuple(n.name for n in nodes)))


def _fetch_packs(decode: Plan, prefill: list[Plan]) -> list[Plan]:
    """The prefill plans with each fetch's host packs recorded (FetchAttrs.packs, `host_packs`):
    the decode plan's CPU parts of its layer where they hold the same experts, so a streamed
    layer copies from the packs decode computes on and the backend packs each once, whatever
    order it prepares the plans in."""
    parts: dict[tuple, list] = {}
    for n in decode.ir.nodes:
        if n.op == Op.ROUTED_EXPERTS and n.place.device == Device.CPU:
            parts.setdefault((n.attrs.layer, n.attrs.host), []).append(n)
    out = []
    for plan in prefill:
        g = plan.ir

        def linked(n):
            if n.op != Op.FETCH:
                return n
            packs = host_packs(parts.get((n.attrs.layer, n.attrs.host), ()), n.attrs.inter)
            return replace(n, attrs=replace(n.attrs, packs=packs))

        if any(n.op == Op.FETCH for n in g.nodes):
            plan = plan.with_graph(g.replace_nodes(linked(n) for n in g.nodes))
        out.append(plan)
    return out


def _shared_staging(plans: list[Plan]) -> list[Plan]:
    """`plans` with each GPU plan's memory counting the largest staging of them all: the
    runtime's staging buffers are shared by the buckets and kept, once a prompt streamed, at the
    largest size used; a plan that borrows lent experts' memory frees them before it runs."""
    held = max((p.memory.staging_bytes for p in plans), default=0.0)
    out = []
    for p in plans:
        m = p.memory
        if m.gpu_bytes and m.staging_bytes < held and not p.borrows:  # a borrower frees them first
            m = m.model_copy(update=dict(staging_bytes=held, gpu_bytes=m.gpu_bytes + held - m.staging_bytes))
            p = p.model_copy(update=dict(memory=m))
        out.append(p)
    return out


class _Pricer:
    """Plans priced for the VRAM plan (`vram_plan.Pricer`): the pipeline run under a share."""

    def __init__(self, spec: Graph, context, max_batch: int, pipeline):
        self.spec, self.context, self.max_batch, self.pipeline = spec, context, max_batch, pipeline
        at = next((i for i, (_, stage) in enumerate(pipeline) if stage == "placed"), 1)
        self.placing = pipeline[:at + 1]  # through the first placing pass
        # the schedule predicts the step; the buffer plan after it changes no time
        self.pricing = tuple(p for p in pipeline if p[1] != "buffered") or pipeline

    def costed(self) -> Graph:
        at = next((i for i, (_, stage) in enumerate(self.pipeline) if stage == "costed"), 0)
        return run_pipeline(self.spec, self.context("decode", self.max_batch), pipeline=self.pipeline[:at + 1])

    def placed(self, share: VramShare) -> Graph:
        return run_pipeline(self.spec, self.context("decode", self.max_batch, share), pipeline=self.placing)

    def decode_us(self, share: VramShare) -> tuple[float, Graph]:
        ctx = self.context("decode", self.max_batch, share)
        g = run_pipeline(self.spec, ctx, pipeline=self.pricing)
        return _predicted_step_us(g, ctx), g

    def prefill(self, share: VramShare, tokens: int, attended: int) -> tuple[float, Graph]:
        g, ctx = _lending_run(self.spec, replace(self.context("prefill", tokens, share), context=attended),
                              self.pricing)
        return _predicted_step_us(g, ctx), g


def _over(limit: float, decode: Plan, prefill: list[Plan]) -> bool:
    """Whether a plan's predicted GPU memory, the shared staging counted, exceeds `limit`."""
    return any(p.memory.gpu_bytes > limit for p in (_with_staging(decode, prefill), *prefill))


def _with_staging(decode: Plan, prefill: list[Plan]) -> Plan:
    """The decode plan with the prefill plans' shared staging counted: the runtime keeps it
    between prompts."""
    held = max((p.memory.staging_bytes for p in prefill), default=0.0)
    if not held or not decode.memory.gpu_bytes:
        return decode
    m = decode.memory
    return decode.model_copy(update=dict(memory=m.model_copy(update=dict(
        staging_bytes=held, gpu_bytes=m.gpu_bytes + held - m.staging_bytes))))


def _check_fits(pf: PlanFile, runnable: bool) -> None:
    """Where a plan's predicted peak GPU or host memory exceeds the hardware profile's: a
    ConfigError with the numbers, or for a config-only model (a plan that cannot run here
    anyway: planning for another machine) one warning."""
    hw = pf.hw
    host = hw.cpu.memory_bytes
    gpu = pf.vram.limit_bytes if pf.vram is not None else (
        hw.gpus[0].memory_bytes - pf.options.vram_reserve_gb * 1e9 if hw.gpus else 0.0)
    for plan in pf.plans:
        m, what = plan.memory, f"the {plan.phase} plan ({plan.step_tokens} tokens/step)"
        parts = (f"weights {m.weight_bytes / 1e9:.1f} GB, KV caches {m.kv_cache_bytes / 1e9:.1f} GB, activations "
                 f"{m.activation_bytes / 1e9:.2f} GB, both devices")
        problem = None
        if gpu and m.gpu_bytes > gpu and plan.device != "cuda":  # the GPU nodes run on the CPU here
            notices.warn(f"{what} would need {m.gpu_bytes / 1e9:.2f} GB on {hw.gpus[0].name} ({gpu / 1e9:.2f} GB "
                         f"VRAM limit): it runs here with its GPU nodes on the CPU, but would not fit that GPU "
                         f"({parts})", key="oversize-gpu")
        elif plan.device == "cuda" and gpu and m.gpu_bytes > gpu:
            problem = (f"{what} needs {m.gpu_bytes / 1e9:.2f} GB of GPU memory; the VRAM limit is {gpu / 1e9:.2f} GB "
                       f"({parts}). Lower --vram-budget-gb, --max-seq-len or --max-batch, or raise --vram-gb")
        elif host and m.host_bytes > host:
            problem = (f"{what} needs {m.host_bytes / 1e9:.1f} GB of host memory; the profile {hw.name!r} has "
                       f"{host / 1e9:.1f} GB ({parts}). Lower --max-seq-len or --max-batch, use smaller expert "
                       "weights (--expert-format int8 or int4) or a bigger machine (--hw)")
        if problem is None:
            continue
        if not runnable:
            notices.warn(f"{problem}; this config-only plan is for another machine", key="oversize")
            return
        raise ConfigError(f"{problem}, or pass --allow-oversize (allow_oversize=True) to plan anyway")
