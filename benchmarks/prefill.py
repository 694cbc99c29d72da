"""ktflow's long-prompt prefill, measured (GPU machine; `e2e.py --prefill` runs it beside llama.cpp).

For each variant (auto: the compiler's choice per layer and bucket; cpu, stream, split: forced)
and prompt length, llama-bench style (random ids, `reps` repetitions after a warm-up, mean +- sd):
tokens/s, time to the first token's logits, peak VRAM against the plan; then one traced run: the
busy fraction of the GPU compute stream, the fetch (copy engine h2d) stream, the activation copy
stream and the CPU tasks over the step; the PCIe bound (bytes the plan streams over the h2d
bandwidth the probe measured, plus the plan's predicted work after the last copy); predicted
against measured per-layer time.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch


def _busy(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def lane_busy(instrs) -> dict[str, float]:
    """Fraction of the measured step each lane (gpu, fetch, copy, cpu) is busy; a sync (the GPU
    stream waiting for a CPU task) and a submit are not GPU work."""
    lanes: dict[str, list] = {}
    for s in instrs:
        if s.kind in ("record", "wait", "sync", "submit"):
            continue
        lane = "cpu" if s.lane.startswith("cpu") else s.lane
        lanes.setdefault(lane, []).append((s.start_us, s.end_us))
    span = max((s.end_us for s in instrs), default=0.0) or 1.0
    return {k: round(_busy(v) / span, 3) for k, v in lanes.items()}


def pcie_bound(plan, hw, chunks: int) -> tuple[float, float]:
    """(bytes streamed by the prompt, the PCIe bound in seconds): those bytes over the measured
    h2d bandwidth, plus the plan's predicted work after its last fetch ends (it cannot overlap a
    copy), once per chunk."""
    from ktflow.ir.ops import Op

    fetches = [n for n in plan.ir.nodes if n.op == Op.FETCH]
    nbytes = sum(n.attrs.link_bytes for n in fetches)
    ends = [s.end_us for s in plan.instructions if s.kind == "fetch"]
    tail = (plan.predicted_step_us - max(ends)) * 1e-6 if ends else plan.predicted_step_us * 1e-6
    per_chunk = nbytes / (hw.gpus[0].pcie_h2d_gbps * 1e9) + tail
    return nbytes * chunks, per_chunk * chunks


def measure(compiled, vocab: int, tokens: int, reps: int, hw, layers: int) -> dict:
    """One variant at one prompt length."""
    import ktflow
    from ktflow.plan.artifact import prefill_decisions
    from ktflow.plan.timeline import layer_times, with_measured_instructions

    g = torch.Generator().manual_seed(tokens)
    plan = compiled.prefill_plan(tokens)
    chunks = -(-tokens // compiled.chunk_tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    ktflow.execute(compiled, ids, logits="last")  # warm-up: binds the plan's buffers, first-call costs
    rates, ttft, peaks = [], [], []
    for _ in range(reps):
        ids = torch.randint(0, vocab, (1, tokens), generator=g)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        logits, _ = ktflow.execute(compiled, ids, logits="last")
        first = logits[:, -1].argmax(-1)  # the first generated token
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rates.append(tokens / dt)
        ttft.append(dt)
        peaks.append(torch.cuda.max_memory_allocated())
        del logits, first
    ex = compiled.executor(plan)
    ex.trace = 1
    ktflow.execute(compiled, torch.randint(0, vocab, (1, min(tokens, compiled.chunk_tokens)), generator=g),
                   logits="last")
    busy = lane_busy(ex.measured) if ex.measured else {}
    measured_plan = with_measured_instructions(plan, ex.measured) if ex.measured else None
    def mean_layer(p) -> float | None:
        spans = [t.span_us for t in layer_times(p) if t.layer is not None] if p is not None else []
        return statistics.mean(spans) if spans else None

    streamed, bound_s = pcie_bound(plan, hw, chunks)
    mean = statistics.mean(rates)
    seconds = tokens / mean
    predicted_layer, measured_layer = mean_layer(plan), mean_layer(measured_plan)
    return dict(
        prompt=tokens, tok_s=round(mean, 1), sd=round(statistics.stdev(rates) if len(rates) > 1 else 0.0, 1),
        ttft_s=round(statistics.mean(ttft), 4), bucket=plan.step_tokens, chunks=chunks,
        decisions=prefill_decisions(plan), predicted_tok_s=round(plan.step_tokens / plan.predicted_step_us * 1e6, 1),
        streamed_gb=round(streamed / 1e9, 3), pcie_bound_s=round(bound_s, 4),
        pcie_bound_fraction=round(bound_s / seconds, 3) if streamed else None,
        busy=busy, predicted_layer_us=round(predicted_layer, 1) if predicted_layer else None,
        step_layer_us=round(seconds / layers * 1e6, 1),  # the untraced step over the layers
        measured_layer_us=round(measured_layer, 1) if measured_layer else None,  # the traced step's layer windows
        peak_vram_gb=round(max(peaks) / 1e9, 3), planned_vram_gb=round(plan.memory.gpu_bytes / 1e9, 3),
        planned_staging_gb=round(plan.memory.staging_bytes / 1e9, 3), layers=layers,
        instructions=[(s.kind, s.node, s.lane, s.start_us, s.end_us) for s in ex.measured or []])
