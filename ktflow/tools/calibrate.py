"""`ktflow calibrate`: run a model's decode plan on this machine, measure each step, fit the few
terms of the hardware profile the roofline misses, and return the profile the compiler then uses.

Fitted, from the median of traced steps after warm-up: `gpus[0].efficiency` and
`overheads.gpu_launch_us` (a line through the GPU ops' roofline and measured times); the CPU's
rates (`cpu.gemv_gbps`, `cpu.gemm_tflops`, the routed-experts table, scaled by one factor) and
`overheads.cpu_op_us`; `overheads.cpu_submit_us` and `overheads.cpu_sync_us` (plans with
submit/sync). A plan replayed as one captured graph is fitted from replayed steps instead
(`fit_replayed`: also `overheads.cpu_deferred_us`, `overheads.graph_step_us`,
`overheads.decode_step_us`). A term without enough measured ops (no GPU ops, fewer than three, no
CPU tasks) keeps its value. The result (`Calibration`) has `Fitted` rows (term, before, after,
from how many ops) and each plan's predicted step before and after beside the measured one
(untraced decode steps). How each term is fitted: docs/design-notes.md.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..costmodel.hw import HwProfile
from ..ir.ops import Op
from ..ir.types import Device
from ..plan.artifact import Plan, Instruction
from ..plan.timeline import handoffs, with_measured_instructions


@dataclass
class Fitted:
    term: str  # the profile field, as a dotted path
    before: float
    after: float
    ops: int  # measured ops (or hand-offs) it was fitted from
    note: str = ""


@dataclass
class StepPrediction:
    plan: str  # which decode plan was measured ("exact", "defer 2")
    walls_us: list[float]  # each untraced decode step measured
    predicted_before_us: float  # the plan's predicted step with the profile calibration started from
    predicted_after_us: float  # the same plan recompiled with the fitted profile

    @property
    def measured_step_us(self) -> float:
        """The median measured step (0 where none was measured)."""
        return statistics.median(self.walls_us) if self.walls_us else 0.0


@dataclass
class Calibration:
    profile: HwProfile  # the fitted profile
    fitted: list[Fitted]
    steps: list[StepPrediction]  # each measured plan: the exact one first

    def lines(self) -> list[str]:
        out = [f"{'term':28s} {'before':>12s} {'after':>12s}  from"]
        for f in self.fitted:
            out.append(f"{f.term:28s} {f.before:12.4g} {f.after:12.4g}  {f.ops} ops" + (f"; {f.note}" if f.note else ""))
        for s in self.steps:
            spread = f" (median of {len(s.walls_us)}, {min(s.walls_us):.0f}-{max(s.walls_us):.0f})" if s.walls_us else ""
            out.append(f"decode step ({s.plan}): measured {s.measured_step_us:.0f} us{spread}; predicted "
                       f"{s.predicted_before_us:.0f} us before, {s.predicted_after_us:.0f} us after calibration"
                       + (f" ({100 * (s.predicted_after_us / s.measured_step_us - 1):+.1f}%)" if s.measured_step_us > 0 else ""))
        return out


#: decode steps run before any is measured: a captured backend captures in the first, and the
#: CPU experts' freshly packed memory and the pool's threads settle over the rest (too few warm
#: steps measure a slower step than the e2e benchmark's: docs/design-notes.md)
WARM_STEPS = 24


def _warm(compiled, prompt: int, seed: int):
    """A random prompt and WARM_STEPS decode steps: (next ids, state)."""
    import ktflow

    g = torch.Generator().manual_seed(seed)
    nxt, state = ktflow.execute(compiled, torch.randint(0, compiled.vocab_size, (1, prompt), generator=g),
                                logits="argmax")
    for _ in range(WARM_STEPS):
        nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
    return nxt, state


def measure(compiled, steps: int = 3, prompt: int = 16, seed: int = 0) -> tuple[list[list[Instruction]], list[float]]:
    """`steps` traced decode steps of `compiled` (each the plan's instructions with measured times),
    and the times of as many untraced decode steps (at least 3), in us."""
    import ktflow

    nxt, state = _warm(compiled, prompt, seed)
    walls = []
    for _ in range(max(steps, 3)):
        t0 = time.perf_counter()
        nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
        walls.append((time.perf_counter() - t0) * 1e6)
    ex = compiled.executor(compiled.decode)
    traced = []
    for _ in range(steps):
        ex.trace = 1
        nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
        traced.append(list(ex.measured))
    return traced, walls


def median_instructions(traced: list[list[Instruction]]) -> list[Instruction]:
    """Per instruction of the plan, the median measured duration (its start kept from the first run)."""
    out = []
    for i, s in enumerate(traced[0]):
        d = statistics.median(run[i].end_us - run[i].start_us for run in traced)
        out.append(s.model_copy(update={"end_us": s.start_us + d}))
    return out


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y on x, or None where x does not vary."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 1e-12 * max(mx * mx, 1e-30) * len(xs):
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    return slope, my - slope * mx


def _scaled_cpu(c, scale: float) -> dict:
    """The CPU's rates (GEMV, GEMM, the routed-experts table) times `scale`, as a model update."""
    out = dict(gemv_gbps=c.gemv_gbps * scale, gemm_tflops=c.gemm_tflops * scale)
    if c.expert_tflops:
        out["expert_tflops"] = [(rows, tflops * scale) for rows, tflops in c.expert_tflops]
    return out


def _calibrated(hw: HwProfile, overheads: dict, cpu: dict, gpu: dict | None = None) -> HwProfile:
    """`hw` with the fitted fields, named `<name>+calibrated` (once), validated."""
    out = hw.model_copy(update=dict(
        name=hw.name if hw.name.endswith("+calibrated") else f"{hw.name}+calibrated",
        overheads=hw.overheads.model_copy(update=overheads), cpu=hw.cpu.model_copy(update=cpu),
        gpus=[hw.gpus[0].model_copy(update=gpu or {}), *hw.gpus[1:]] if hw.gpus else []))
    return HwProfile.model_validate(out.model_dump())


def fit(plan: Plan, measured: list[Instruction], hw: HwProfile) -> tuple[HwProfile, list[Fitted]]:
    """The profile `plan` was compiled for with the terms the measured instructions fit (module doc)."""
    g = plan.ir
    o = hw.overheads
    fitted: list[Fitted] = []
    upd_gpu, upd_cpu, upd_over = {}, {}, {}
    gpu_pts, cpu_pts = [], []  # (roofline seconds at the profile's peak without the fixed cost, measured)
    for p, m in zip(plan.instructions, measured, strict=True):
        if p.kind != "launch" or m.end_us <= m.start_us:
            continue
        n = g.by_name(p.node)
        if n.cost is None or n.place is None:
            continue
        took = (m.end_us - m.start_us) * 1e-6
        if n.place.device == Device.GPU and n.cost.gpu_s is not None and hw.gpus:
            gpu_pts.append((max(n.cost.gpu_s - o.gpu_launch_us * 1e-6, 0.0) * hw.gpus[0].efficiency, took))
        elif n.place.device == Device.CPU:
            cpu_pts.append((max(n.cost.cpu_s - o.cpu_op_us * 1e-6, 0.0), took))
    line = _line(gpu_pts) if hw.gpus and len(gpu_pts) >= 3 else None
    if line and line[0] > 0:
        eff = min(1.0, max(0.01, 1.0 / line[0]))
        launch = max(0.0, line[1]) * 1e6
        fitted += [Fitted("gpus[0].efficiency", hw.gpus[0].efficiency, eff, len(gpu_pts), "1 / slope"),
                   Fitted("overheads.gpu_launch_us", o.gpu_launch_us, launch, len(gpu_pts), "intercept")]
        upd_gpu["efficiency"], upd_over["gpu_launch_us"] = eff, launch
    if cpu_pts and sum(x for x, _ in cpu_pts) > 0:
        line = _line(cpu_pts) if len(cpu_pts) >= 3 else None
        if line and line[0] > 0:
            scale, op_us, how = 1.0 / line[0], max(0.0, line[1]) * 1e6, "1 / slope"
        else:  # one kind of op (a hybrid plan's expert tasks): the ratio, the fixed cost kept
            op_us = o.cpu_op_us
            beyond = sum(y for _, y in cpu_pts) - len(cpu_pts) * op_us * 1e-6  # measured past the fixed cost
            scale = sum(x for x, _ in cpu_pts) / beyond if beyond > 0 else 1.0
            how = "predicted over measured" if beyond > 0 else "measured within the fixed cost: rates kept"
        c = hw.cpu
        upd_cpu = _scaled_cpu(c, scale)
        upd_over["cpu_op_us"] = op_us
        fitted += [Fitted("cpu.gemv_gbps", c.gemv_gbps, upd_cpu["gemv_gbps"], len(cpu_pts),
                          f"CPU rates x{scale:.3g} ({how})"),
                   Fitted("cpu.gemm_tflops", c.gemm_tflops, upd_cpu["gemm_tflops"], len(cpu_pts)),
                   Fitted("overheads.cpu_op_us", o.cpu_op_us, op_us, len(cpu_pts),
                          "intercept" if how == "1 / slope" else "kept")]
    got, want = handoffs(with_measured_instructions(plan, measured)), handoffs(plan)
    if got and want:
        for term, name, each in (("overheads.cpu_submit_us", "cpu_submit_us", "to_cpu_us"),
                                 ("overheads.cpu_sync_us", "cpu_sync_us", "to_gpu_us")):
            delta = statistics.median(getattr(h, each) for h in got) - statistics.median(getattr(h, each) for h in want)
            old = getattr(o, name)
            upd_over[name] = max(0.0, old + delta)
            fitted.append(Fitted(term, old, upd_over[name], len(got), "the measured hand-off less the predicted"))
    return _calibrated(hw, upd_over, upd_cpu, upd_gpu), fitted


@dataclass
class Replayed:
    """A captured decode step as it replays, from the native queue's timestamps: the step's wall
    time, each CPU task (doorbell seen to done flag) and each gap between consecutive tasks (done
    flag to the next doorbell seen: the GPU's chain from one layer's experts to the next's), in
    the step's order, medians over the steps run (us)."""

    wall_us: float
    tasks_us: list[float]
    gaps_us: list[float]
    walls_us: list[float] = field(default_factory=list)  # each step's, as measured
    #: the same plan's step in greedy runs of `greedy_k` steps a launch (the median run's wall
    #: over its steps; None where not measured)
    greedy_us: float | None = None
    greedy_k: int = 8

    @staticmethod
    def from_records(recs: list, steps: int, walls_us: list[float]) -> "Replayed | None":
        """From the native queue's records of `steps` steps, (batch, seen, started, done) each in
        ns, and each step's wall time; None if the records do not split into equal steps."""
        if not recs or len(recs) % steps:
            return None
        per = len(recs) // steps
        runs = [recs[i * per:(i + 1) * per] for i in range(steps)]
        med = statistics.median
        return Replayed(wall_us=med(walls_us), walls_us=list(walls_us),
                        tasks_us=[med((r[k][3] - r[k][1]) / 1e3 for r in runs) for k in range(per)],
                        gaps_us=[med((r[k + 1][1] - r[k][3]) / 1e3 for r in runs) for k in range(per - 1)])


def measure_replayed(compiled, steps: int = 16, prompt: int = 16, seed: int = 0, greedy_k: int = 8,
                     greedy_runs: int = 4) -> Replayed | None:
    """`steps` untraced decode steps of `compiled` with the queue's records on, then `greedy_runs`
    greedy runs of `greedy_k` steps a launch where the KV cache has room for them (None if the
    records do not split into equal steps)."""
    import ktflow
    from ..backends.native import binding as native
    from ..runtime.execute import decode_greedy

    nxt, state = _warm(compiled, prompt, seed)
    native.sync()
    q = native.queue()
    q.set_recording(True)
    walls = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
            walls.append((time.perf_counter() - t0) * 1e6)
        recs = q.take_records()
    finally:
        q.set_recording(False)
    rep = Replayed.from_records(recs, steps, walls)
    if rep is not None and state.position + (greedy_runs + 1) * greedy_k <= state.max_seq_len:
        runs = []
        for i in range(greedy_runs + 1):  # the first captures the K-step graph
            t0 = time.perf_counter()
            nxt = decode_greedy(compiled, nxt, state, greedy_k)[:, -1:]
            if i:
                runs.append((time.perf_counter() - t0) * 1e6 / greedy_k)
        rep.greedy_us, rep.greedy_k = statistics.median(runs), greedy_k
    return rep


def _task_spans(plan: Plan) -> list[tuple[float, float, bool]]:
    """The plan's native CPU tasks in order: (start, end, deferred), deferred where every routed
    expert node it runs is a deferred part (its ranks start past 0)."""
    g = plan.ir
    by_node: dict[str, list[Instruction]] = {}
    for s in plan.instructions:
        by_node.setdefault(s.node, []).append(s)
    spans = []
    for s in plan.instructions:
        members = g.by_name(s.node).attrs.members if s.kind == "submit" else ()
        routed = [g.by_name(m) for m in members if g.by_name(m).op == Op.ROUTED_EXPERTS]
        if routed:  # a native task (others run before the launch)
            parts = [p for m in members for p in by_node.get(m, []) if p.lane.startswith("cpu")]
            if parts:
                spans.append((min(p.start_us for p in parts), max(p.end_us for p in parts),
                              all(n.attrs.deferred for n in routed)))
    return spans


def deferred_tasks(plan: Plan) -> list[bool]:
    """For each of the plan's native CPU tasks (as `predicted_tasks` lists them): whether it runs
    deferred picks."""
    return [d for _, _, d in _task_spans(plan)]


def predicted_tasks(plan: Plan) -> tuple[list[float], list[float], list[int], int]:
    """The plan's CPU tasks as `Replayed` measures them: each task's predicted duration, each gap
    between consecutive tasks, the GPU-lane ops (launches and copies) starting in each gap, and
    the GPU-lane ops outside every gap (the step's edges)."""
    spans = [(a, b) for a, b, _ in _task_spans(plan)]
    gpu_ops = [s for s in plan.instructions if not s.lane.startswith("cpu") and s.kind in ("launch", "copy")]
    gaps = [(a[1], b[0]) for a, b in zip(spans, spans[1:])]
    in_gap = [sum(1 for s in gpu_ops if lo <= s.start_us < hi) for lo, hi in gaps]
    # the edges: before the first task and after the last (GPU ops during a task, such as the
    # shared expert, are neither in a gap nor at an edge)
    edges = sum(1 for s in gpu_ops if spans and (s.start_us < spans[0][0] or s.start_us >= spans[-1][1]))
    return [e - s for s, e in spans], [hi - lo for lo, hi in gaps], in_gap, edges


def _edge_syncs(plan: Plan) -> int:
    """The plan's sync instructions (a wait for a CPU task's result) outside every gap between its
    native tasks: before the first task ends or after the last (an embedding's, the last layer's)."""
    spans = [(a, b) for a, b, _ in _task_spans(plan)]
    if not spans:
        return 0
    return sum(1 for s in plan.instructions
               if s.kind == "sync" and (s.start_us < spans[0][1] or s.start_us >= spans[-1][1]))


def fit_replayed(plan: Plan, rep: Replayed, hw: HwProfile,
                 keep_rate: bool = False) -> tuple[HwProfile, list[Fitted]] | None:
    """The profile `plan` was compiled for with the terms a replayed step fits (None where its
    tasks do not match the plan's one to one, e.g. NUMA shards: one record per batch):

    - the CPU rate factor: the tasks' predicted time over their measured time, from the tasks
      that run a layer's picks needed now (with `keep_rate`, the profile's rate is kept: a
      deferred plan measured after the exact plan fitted it);
    - in an exact plan (no deferred part), from the GPU's chain between tasks:
      - `overheads.gpu_launch_us`: moved by the median gap's excess over the predicted, spread
        over the GPU ops in a gap (at decode the GPU's ops are small: their fixed time is what the
        roofline misses; the efficiency is left as it is). Where that would go below zero, the
        rest comes off `overheads.cpu_sync_us`: each gap holds one hand-off round trip, and the
        probe that measured it may have met a busy host;
      - the step's edge: what the measured step has beyond its tasks and gaps, less what the
        plan predicts there (its edges' GPU ops with the fitted fixed time). Where `rep` has the
        plan's greedy runs of K steps a launch, the edge splits in two: one launch's
        (`overheads.graph_step_us`), (one a launch - K a launch) x K / (K - 1), and every step's
        (`overheads.decode_step_us`), the rest (a plan's predicted step adds the second and the
        first divided by its greedy steps a launch: `passes.compile._predicted_step_us`). Without
        them the whole edge is the launch's;
    - in a deferred plan, `overheads.cpu_deferred_us`: the deferred tasks' median measured time
      beyond their predicted time at the fitted rate (such a task runs slower per expert than
      the layer's other task). Its gaps and edges fit nothing:
      the next layer's doorbell rings while the deferred task runs, so a gap is not the GPU's
      chain. Fit the exact plan first and this one with the profile that gave
      (`calibrate` does)."""
    tasks, gaps, in_gap, edge_ops = predicted_tasks(plan)
    if len(tasks) != len(rep.tasks_us) or not tasks or sum(rep.tasks_us) <= 0:
        return None
    o, c = hw.overheads, hw.cpu
    fitted: list[Fitted] = []
    upd_over = {}
    deferred = deferred_tasks(plan)
    now = [(t, m) for t, m, d in zip(tasks, rep.tasks_us, deferred) if not d] or list(zip(tasks, rep.tasks_us))
    if keep_rate:  # the profile's rate stands (fitted from the exact plan): the deferred extra is priced at it
        scale, upd_cpu = 1.0, {}
    else:
        scale = sum(t for t, _ in now) / sum(m for _, m in now)
        upd_cpu = _scaled_cpu(c, scale)
        fitted += [Fitted("cpu.gemv_gbps", c.gemv_gbps, upd_cpu["gemv_gbps"], len(now),
                          f"CPU rates x{scale:.3g}: the tasks' predicted over measured (replayed)"),
                   Fitted("cpu.gemm_tflops", c.gemm_tflops, upd_cpu["gemm_tflops"], len(now))]
    late = [(t, m) for t, m, d in zip(tasks, rep.tasks_us, deferred) if d]
    if late:
        if len(late) < len(tasks):
            # a deferred task's time at the fitted rate without the extra it was priced with, and what it took beyond
            extra = max(0.0, statistics.median(m - (t - o.cpu_deferred_us) / scale for t, m in late))
            upd_over["cpu_deferred_us"] = extra
            fitted.append(Fitted("overheads.cpu_deferred_us", o.cpu_deferred_us, extra, len(late),
                                 "the deferred tasks' median time beyond their bytes at the fitted rate"))
        return _calibrated(hw, upd_over, upd_cpu), fitted
    launch = o.gpu_launch_us
    if gaps and statistics.median(in_gap) > 0:
        excess, per = statistics.median(rep.gaps_us) - statistics.median(gaps), statistics.median(in_gap)
        launch = o.gpu_launch_us + excess / per
        how = (f"median gap {statistics.median(rep.gaps_us):.1f} us measured, "
               f"{statistics.median(gaps):.1f} us predicted, {per:.0f} GPU ops in it")
        if launch < 0:  # the gap is shorter than its ops' roofline alone: the hand-off was priced too long
            sync = max(0.0, o.cpu_sync_us + launch * per)
            upd_over["cpu_sync_us"] = sync
            fitted.append(Fitted("overheads.cpu_sync_us", o.cpu_sync_us, sync, len(gaps),
                                 how + "; what the GPU ops' fixed time cannot take"))
            launch = 0.0
        upd_over["gpu_launch_us"] = launch
        fitted.append(Fitted("overheads.gpu_launch_us", o.gpu_launch_us, launch, len(gaps), how))
    edges_measured = rep.wall_us - sum(rep.tasks_us) - sum(rep.gaps_us)
    # the plan's edges without the fixed times it added (its share of graph_step_us, decode_step_us)
    scheduled = max((n.timing.end_us for n in plan.ir.nodes if n.timing is not None), default=0.0)
    sync = upd_over.get("cpu_sync_us", o.cpu_sync_us)  # the edges' own hand-off waits move with a fitted sync
    edges_predicted = (scheduled - sum(tasks) - sum(gaps) + edge_ops * (launch - o.gpu_launch_us)
                       + _edge_syncs(plan) * (sync - o.cpu_sync_us))
    edge = max(0.0, edges_measured - edges_predicted)
    how = f"step edges {edges_measured:.0f} us measured, {edges_predicted:.0f} us predicted"
    if rep.greedy_us is not None and rep.greedy_k > 1:
        k = rep.greedy_k
        per_launch = min(edge, max(0.0, (rep.wall_us - rep.greedy_us) * k / (k - 1)))
        upd_over["decode_step_us"] = edge - per_launch
        fitted.append(Fitted("overheads.decode_step_us", o.decode_step_us, edge - per_launch, 1,
                             f"{how}; the part {k} steps a launch do not share ({rep.wall_us:.0f} us a step one a "
                             f"launch, {rep.greedy_us:.0f} us {k} a launch)"))
        how = f"the part {k} steps a launch share"
    else:  # no greedy runs to split it by: all of it the launch's (none left from the profile's split)
        per_launch = edge
        upd_over["decode_step_us"] = 0.0
    upd_over["graph_step_us"] = per_launch
    fitted.append(Fitted("overheads.graph_step_us", o.graph_step_us, per_launch, 1, how))
    return _calibrated(hw, upd_over, upd_cpu), fitted


def _measure_and_fit(compiled, steps: int, keep_rate: bool = False) -> tuple[list[float], tuple[HwProfile, list[Fitted]]]:
    """Measure `compiled`'s decode plan here and fit (`fit_replayed` for a plan the backend replays
    as a captured graph, `fit` from traced steps otherwise): (its measured untraced steps, the fit)."""
    plan = compiled.decode
    got = None
    if getattr(compiled.executor(plan).runner, "capture", False) and any(s.kind == "submit" for s in plan.instructions):
        rep = measure_replayed(compiled, max(steps, 16))
        got = fit_replayed(plan, rep, compiled.plans.hw, keep_rate=keep_rate) if rep else None
        walls = rep.walls_us if rep else []
    if got is None:
        traced, walls = measure(compiled, steps)
        got = fit(plan, median_instructions(traced), compiled.plans.hw)
    return walls, got


def calibrate(model, hw, steps: int = 3, **options) -> Calibration:
    """Compile `model` for `hw` with `options`, measure its decode plans here, fit the profile and
    recompile with it (module doc). Two plans are measured where the model can defer on this
    machine: the exact plan (no deferral) fits every term but the deferred task's extra time; then
    the plan deferring `options["defer"]` picks a layer (2 where that is not a number), compiled
    with that fit, gives `overheads.cpu_deferred_us` at the exact plan's rate (a deferred plan's
    gaps are not the GPU's chain: `fit_replayed`). The steps are measured one a launch (`execute`),
    so they are compared with that prediction; the profile serves any greedy_steps (a plan divides
    graph_step_us by it)."""
    import gc

    import ktflow

    options = dict(options, greedy_steps=1)
    asked = options.get("defer")
    exact = dict(options, defer=None)
    compiled = ktflow.compile(model, hw=hw, **exact)
    plan = compiled.decode
    walls, (profile, fitted) = _measure_and_fit(compiled, steps)
    del compiled  # its device weights, before the deferred plan binds its own
    gc.collect()
    runs = [("exact", exact, walls, plan.predicted_step_us)]
    d = asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else 2
    deferring = dict(options, defer=d)
    try:  # a model whose top_k leaves no room for d deferred picks has no deferred plan to measure
        deferred = ktflow.compile(model, hw=profile, **deferring)
    except ConfigError:
        deferred = None
    if deferred is not None and plan.capture and any(deferred_tasks(deferred.decode)):
        walls_d, (got_d, fitted_d) = _measure_and_fit(deferred, steps, keep_rate=True)
        extra = [f for f in fitted_d if f.term == "overheads.cpu_deferred_us"]
        if extra:  # fitted from its replay at the kept rate: the exact plan's profile with this term added
            profile = got_d
            fitted += extra
        runs.append((f"defer {d}", deferring, walls_d, ktflow.compile(model, hw=hw, **deferring).decode.predicted_step_us))
    steps_out = [StepPrediction(label, measured, before, ktflow.compile(model, hw=profile, **opts).decode.predicted_step_us)
                 for label, opts, measured, before in runs]
    return Calibration(profile, fitted, steps_out)
