"""The public API: load, compile, execute, generate."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from pydantic import ValidationError

from .backends import get_backend, resolve_backend
from .frontend.config import DTYPE_BY_NAME
from .costmodel.roofline import held_weight_bytes
from .errors import ConfigError, PlanError, ResourceError
from .costmodel.hw import HwProfile, resolve_hw
from .ir.graph import Graph
from .ir.ops import Op
from .ir.types import Device
from .frontend.load import Model, load
from .plan.options import CompileContext, CompileOptions
from .costmodel.memory import activation_peak, gpu_activation_peak, gpu_workspace_bytes, kv_cache_bytes, staging_bytes
from .plan.options import VramShare
from .passes import PIPELINE, PassTimer, default_instruments, edit_pipeline, pass_id, run_pipeline
from .passes.schedule import steps_of
from .plan.artifact import MemoryEstimate, ModelInfo, Plan, PlanFile
from .passes.vram_plan import bucket_grid, decide
from .runtime.execute import decode_greedy, decode_tokens, execute, start_sampling  # noqa: F401 (the public API's)
from .runtime.executor import Executor
from .runtime.generate import generate_with_stats
from .frontend.weights import TORCH_DTYPE



class Compiled:
    """A model's plans: prefill plans for buckets of prompt length (ascending `step_tokens`; a
    step longer than the last runs as chunks of it) and one decode plan, with the model they run
    (when it is loaded).

    `save(path)` writes the plan file; `Compiled.load(path, model)` reads it back, checking
    that it was compiled by this ktflow version for this model.
    """

    def __init__(self, plans: PlanFile, model: Model | None):
        self.plans, self.model = plans, model
        self._backend: Any = None
        self._executors: dict[int, Executor] = {}
        #: check every step's values for NaN and infinity (also KTFLOW_CHECK_FINITE=1): slower, for finding
        #: where a model goes non-finite
        self.check_finite = False

    @property
    def prefill(self) -> list[Plan]:
        """The prefill plans, one per prompt-length bucket, ascending."""
        return self.plans.prefill

    @property
    def decode(self) -> Plan:
        return self.plans.decode

    @property
    def max_seq_len(self) -> int:
        return self.decode.max_seq_len

    @property
    def chunk_tokens(self) -> int:
        """Most tokens one prefill step runs; longer prompts run as chunks of this many."""
        return self.prefill[-1].step_tokens

    @property
    def vocab_size(self) -> int:
        return self.decode.ir.by_name(self.decode.ir.outputs[0]).attrs.vocab

    def prefill_plan(self, tokens: int) -> Plan:
        """The prefill plan of the smallest bucket that holds a step of `tokens` tokens (the
        largest bucket for a longer step, which runs as chunks)."""
        return self.plans.prefill_for(tokens)

    def save(self, path: str | os.PathLike) -> None:
        self.plans.save(path)

    @staticmethod
    def load(path: str | os.PathLike, model: Model | str | os.PathLike | None = None) -> "Compiled":
        """Read a plan file. `model` (a Model or a checkpoint dir) defaults to the dir the plan
        was compiled from; the plan must match its config fingerprint."""
        pf = PlanFile.load(path)  # read and verified once
        if model is None:
            model = load(pf.model.path)
        elif not isinstance(model, Model):
            model = load(model)
        pf.require_model(model.fingerprint, path)
        from .plan.check import spec_mismatches

        for plan in pf.plans:
            bad = spec_mismatches(plan, model.graph(plan.ir.act_dtype))
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise PlanError(f"plan file {path}: its {plan.phase} plan does not match the model at {model.path}: "
                                f"{bad[0]}{more}. Recompile it with `ktflow compile`.")
        return Compiled(pf, model)

    def summary(self) -> str:
        return self.plans.summary()

    def as_text(self) -> str:
        return "\n".join(p.as_text() for p in (*self.prefill, self.decode))

    # -------------------------------------------------------------------------------- running
    def prepare(self) -> float:
        """Make every plan ready to run (the backend loads the weights); returns seconds taken.
        `execute` does this on first use; call it first to keep loading out of timings."""
        import time

        t0 = time.perf_counter()
        for plan in (self.decode, *self.prefill):  # decode first: prefill plans stream from its packed experts
            self.executor(plan)
        return time.perf_counter() - t0

    def executor(self, plan: Plan | str) -> Executor:
        """The executor of `plan` (or of the decode plan / the first prefill plan, by phase name)."""
        if isinstance(plan, str):
            plan = self.decode if plan == "decode" else self.prefill[0]
        key = id(plan)
        if key not in self._executors and plan is not self.decode and any(n.op == Op.FETCH for n in plan.ir.nodes):
            # the decode plan's CPU experts packed first: a prefill fetch then copies from them (NUMA
            # shards included) instead of packing the layer's experts again
            self.executor(self.decode)
        if key not in self._executors:
            if self.model is None:
                raise PlanError("this plan has no model attached; use Compiled.load(path, model)")
            if self._backend is None:
                device = "cuda" if plan.device == "cuda" else "cpu"
                if device == "cuda":
                    check_gpu(self.plans)
                dtype = TORCH_DTYPE[plan.ir.act_dtype]
                name = resolve_backend(self.plans.options.backend, dtype, device)
                self._backend = get_backend(name)(device, dtype, options=self.plans.options)
            self._backend.prepare(plan.ir, self.model.weights)
            self._executors[key] = Executor(plan, self._backend)
        ex = self._executors[key]
        ex.check_finite = ex.check_finite or self.check_finite
        return ex


#: how far this GPU's memory may be from the one a plan was compiled for
GPU_MEMORY_TOLERANCE = 0.03


def check_gpu(pf: PlanFile) -> None:
    """A plan whose GPU nodes run on CUDA needs a CUDA device here, with the memory it was
    placed for (its VRAM budget and expert placement assume that size)."""
    where = f"{pf.model.model_type} plan compiled for {pf.hw.name}"
    if not torch.cuda.is_available():
        raise PlanError(f"this {where} runs its GPU nodes on CUDA, but torch sees no CUDA device on this machine; "
                        "compile it for this machine (`ktflow compile --hw this`, or hw=None / device='cpu' in "
                        "ktflow.compile) and run that plan")
    if not pf.hw.gpus:
        return
    planned = pf.hw.gpus[0].memory_bytes
    here = float(torch.cuda.get_device_properties(0).total_memory)
    if abs(here - planned) > GPU_MEMORY_TOLERANCE * planned:
        raise PlanError(f"this {where} was placed for a GPU with {planned / 2**30:.1f} GiB of memory "
                        f"({pf.hw.gpus[0].name}); this GPU ({torch.cuda.get_device_name(0)}) has {here / 2**30:.1f} GiB. "
                        "Recompile it for this machine (`ktflow compile --hw this`, or `ktflow hw probe`)")
    # before anything is allocated: what the plans will take against what is free now (memory this
    # process's allocator already holds counts as free; the reserve is what the plan leaves unused)
    need = max((p.memory.gpu_bytes for p in pf.plans if p.device == "cuda"), default=0.0)
    free, total = torch.cuda.mem_get_info()
    usable = free + torch.cuda.memory_reserved()
    if need > usable:
        raise ResourceError(f"the {where} needs {need / 1e9:.1f} GB of GPU memory; {usable / 1e9:.1f} GB of "
                            f"{total / 1e9:.1f} GB are free (other processes hold the rest). Free the GPU, or compile "
                            "with a smaller --vram-gb")


def _device(opts: CompileOptions, hw: HwProfile) -> str:
    if opts.device == "cpu":
        return "cpu"
    usable = hw.has_gpu and torch.cuda.is_available()
    if opts.device == "cuda" and not usable:
        raise ConfigError("device='cuda' was asked for but " + (
            f"hardware profile {hw.name!r} lists no GPU" if not hw.has_gpu else "torch sees no CUDA device"))
    return "cuda" if usable else "cpu"


def _memory(g: Graph, ctx: CompileContext) -> MemoryEstimate:
    """Predicted memory per device: weights and KV caches where their nodes are placed (a GPU
    expert has no host copy, unless its layer's GPU part is a cache, whose CPU packs hold every
    expert, and whose slots stay on the GPU in a prefill step that streams the layer whole;
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
        if n.op == Op.ROUTED_EXPERTS and n.attrs.cache_slots:  # a cache's slots, resident though this step streams
            weights[Device.GPU] += n.attrs.cache_slots * 3 * n.attrs.hidden * n.attrs.inter * ctx.weight_itemsize
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
    return MemoryEstimate(weight_bytes=weights[Device.CPU] + weights[Device.GPU], kv_cache_bytes=kv_all,
                          activation_bytes=gpu_act, workspace_bytes=ws, staging_bytes=staging,
                          gpu_bytes=weights[Device.GPU] + kv_gpu + gpu_act + staging + ws,
                          host_bytes=weights[Device.CPU] + (kv_all - kv_gpu) + act)


def _compile_plan(spec: Graph, ctx: CompileContext, instruments=(), pipeline=PIPELINE) -> Plan:
    timer = PassTimer()
    g = run_pipeline(spec, ctx, pipeline=pipeline, instruments=[timer, *instruments])
    steps = steps_of(g)  # the scheduled graph's steps
    return Plan.of_graph(g, phase=ctx.phase, device=ctx.device, max_seq_len=ctx.max_seq_len, step_tokens=ctx.tokens,
                steps=steps, predicted_step_us=_predicted_step_us(g, ctx),
                memory=_memory(g, ctx), pass_seconds=timer.seconds,
                capture=[(0, len(steps) - 1)] if _captured(g, ctx) else [])


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
    from .util.progress import bar

    for t in bar(cands, "compile: prefill buckets", "plan", show=len(cands) > 1):
        plan = _compile_plan(spec, ctx_for(t), instruments if t == cands[-1] else (), pipeline)
        if auto and plans and _signature(plans[-1]) == _signature(plan):
            plans[-1] = plan  # same decisions: the larger bucket covers both
        else:
            plans.append(plan)
    return _shared_staging(plans)


def _shared_staging(plans: list[Plan]) -> list[Plan]:
    """`plans` with each GPU plan's memory counting the largest staging of them all: the
    runtime's staging buffers are shared by the buckets and kept, once a prompt streamed, at the
    largest size used."""
    held = max((p.memory.staging_bytes for p in plans), default=0.0)
    out = []
    for p in plans:
        m = p.memory
        if m.gpu_bytes and m.staging_bytes < held:
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
        ctx = replace(self.context("prefill", tokens, share), context=attended)
        g = run_pipeline(self.spec, ctx, pipeline=self.pricing)
        return _predicted_step_us(g, ctx), g


def compile(model: Model, hw: HwProfile | str | os.PathLike | None = None, *, print_after: str | None = None,
            passes: list | None = None, instruments: list | None = None, **options: Any) -> Compiled:
    """Compile `model` into prefill plans (one per prompt-length bucket) and a decode plan for
    hardware `hw` (a profile, a preset name, a profile JSON path, or None for this machine).
    Options: see `CompileOptions`. `passes` edits the pass pipeline (`passes.edit_pipeline`: a
    list of (where, pass) pairs such as ("after:place_by_intensity", my_pass)); the plan file
    records the pipeline that made it (`PlanFile.pipeline`). `instruments` (passes.Instrument)
    watch every pass of the decode plan and the largest prefill bucket's, as `print_after`
    (the graph printed after that pass) and KTFLOW_DUMP do."""
    try:
        opts = CompileOptions(**options)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'options'}: {er['msg']}" for er in e.errors())
        raise ConfigError(f"compile options: {msgs} (valid options: {', '.join(CompileOptions.model_fields)})") from None
    hwp = resolve_hw(hw)
    cfg = model.config
    act = DTYPE_BY_NAME[opts.dtype] if opts.dtype else cfg.weight_dtype
    max_seq = opts.max_seq_len or min(4096, cfg.max_position_embeddings)
    device = _device(opts, hwp)
    spec = model.graph(act)
    if opts.expert_format == "auto":  # experts stored in FP8 (an FP8 release) keep their bytes
        stored = {w.fmt for n in spec.nodes if n.op == Op.ROUTED_EXPERTS for w in n.weights}
        opts = opts.model_copy(update=dict(expert_format="fp8" if stored == {"fp8"} else "bf16"))
    routing = None
    if opts.routing_profile:
        from .costmodel.roofline import RoutingProfile

        routing = RoutingProfile.load(opts.routing_profile)
        routing.check_against(spec)

    def context(phase: str, tokens: int, share: VramShare | None = None) -> CompileContext:
        batch = tokens if phase == "decode" else 1
        attended = max_seq // 2 if phase == "decode" else (tokens + 1) // 2
        return CompileContext(hw=hwp, options=opts, phase=phase, tokens=tokens, batch=batch, context=attended,
                              weight_itemsize=act.itemsize, max_seq_len=max_seq, device=device,
                              routing=routing, fp8_block=model.quant.block if model.quant is not None else None,
                              vram=share)

    pipeline = edit_pipeline(passes)
    watching = [*default_instruments(print_after), *(instruments or ())]
    decided = decide(context, opts, max_seq, _Pricer(spec, context, opts.max_batch, pipeline))
    share, vram, first, estimated = decided if decided is not None else (None, None, None, None)
    decode = _decode_plan(spec, context("decode", opts.max_batch, share), watching, pipeline)
    prefill = _prefill_plans(spec, lambda t: context("prefill", t, share), opts, max_seq, share, watching, pipeline)
    if share is not None and share != estimated and _over(share.limit, decode, prefill):
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
    pf = PlanFile(model=info, hw=hwp, options=opts, prefill=prefill, decode=_with_staging(decode, prefill),
                  pipeline=[pass_id(fn) for fn, _ in pipeline], vram=vram)
    if not opts.allow_oversize:
        _check_fits(pf, runnable=model.weights is not None)
    return Compiled(pf, model)


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
    from .util import notices

    hw = pf.hw
    host = sum(n.memory_bytes for n in hw.cpu.numa)
    gpu = pf.vram.limit_bytes if pf.vram is not None else (
        hw.gpus[0].memory_bytes - pf.options.vram_reserve_gb * 1e9 if hw.gpus else 0.0)
    for plan in pf.plans:
        m, what = plan.memory, f"the {plan.phase} plan ({plan.step_tokens} tokens/step)"
        parts = (f"weights {m.weight_bytes / 1e9:.1f} GB, KV caches {m.kv_cache_bytes / 1e9:.1f} GB, activations "
                 f"{m.activation_bytes / 1e9:.2f} GB, both devices")
        problem = None
        if plan.device == "cuda" and gpu and m.gpu_bytes > gpu:
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


def generate(compiled: Compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None,
             **sampling: Any) -> torch.Tensor:
    """Prompt + up to `max_new_tokens` generated tokens per row, [batch, prompt + new] (greedy when
    temperature is 0; rows that reach an eos token are padded with it until all rows have).
    `sampling`: the other token-selection parameters (top_k, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, logit_bias; or sampling=SamplingParams, or a list with
    one per row), selected where the logits are (inside the captured decode step on a GPU).
    Decoding runs `greedy_steps` steps per call of the decode plan (`decode_tokens`: one graph
    launch on the cuda_graph backend), greedy or sampled; the ids are those of one step at a time."""
    return generate_with_stats(compiled, input_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, eos_token_id=eos_token_id, **sampling)[0]
