"""ktflow where users run it (issue 42, deliverable 5): a VRAM limit the size of a consumer GPU,
sampled decoding beside greedy, the full model depth. GPU machine; a dry run on the CPU.

One process, one model, the phases of `--phases` in order (rows appended to the JSONL as each is
measured, so a run cut short keeps them):

  user         compiled with the VRAM limit (`vram_gb`: decode residency, KV cache, prefill
               staging, activations and workspaces in one budget). On CUDA the torch allocator is
               capped at the limit less the CUDA context (`set_per_process_memory_fraction`): a
               plan that under-predicts its memory fails with an OOM (an `error` row), it does not
               quietly use more. Prefill at each `--prefill` length; then decode in rounds, each
               round every variant once after a DRAM read: greedy (`greedy_steps` default: runs a
               launch), greedy one step a launch (`greedy_steps=1`, same placement, same backend)
               and sampled (`--temperature`, `--top-p`, seed = round), all through
               `generate_with_stats` after a 32-token prompt (and greedy and sampled after each
               `--decode-depth` prompt: the KV cache of an agent's long prompt behind the decode,
               as llama-bench -d). Then a `vram` row: the plans'
               predicted peak (max `plan.memory.gpu_bytes` over the plans run) against torch's
               peak allocated, and the process's card memory (nvidia-smi's used less what was
               used before this process) against it plus `vram_reserve_gb`.
  decode-only  the same limit with nothing reserved for prefill (DECODE_ONLY_OPTIONS) on the user
               phase's backend (the cap raised to two limits for the two placements), greedy decode
               in rounds beside the user plan's: what the prefill reservation costs decode.
  cpu-experts  every routed expert in CPU memory, VRAM not limited by a budget (e2e.py's prefill
               placement; the allocator capped at the plans' peak and vram_reserve_gb): prefill at
               each length, the rate the limited prefill is held against.

    python benchmarks/user_configs.py --model qwen3 --fp8 --vram-gb 24 --prefill 8192,32768
    python benchmarks/user_configs.py --model qwen3-tiny --device cpu --hw rtx4090-desktop ...   # dry run

llama.cpp at the same VRAM: `llama_user.py`; the joined table: `user_report.py`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import (MODELS as FULL, budget_without_experts, compile_cpu_experts, expert_bytes_per_token,  # noqa: E402
                 ready_checkpoint)

TINY = {  # dry-run shapes: the families of the real ones, small enough for a CPU test
    "qwen3-tiny": dict(FULL["qwen3"], vocab_size=1024, hidden_size=256, intermediate_size=512,
                       moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096),
    "dsv2lite-tiny": dict(FULL["dsv2lite"], vocab_size=1024, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=4096),
}
MODELS = {**FULL, **TINY}
DEFAULT_VRAM_GB = {"qwen3": 24.0, "dsv2lite": 16.0}

DECODE_ONLY_OPTIONS = {"prefill_reserve": "none"}  # decode first: nothing reserved for prefill
PROMPT = 32  # decode runs start after a prompt of this many tokens


# ------------------------------------------------------------------------------------ VRAM


def card_used_mib() -> float | None:
    """Memory used on GPU 0 by every process (nvidia-smi), MiB; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


class Vram:
    """The process's GPU memory: the allocator's cap, and peaks against it. On the CPU: nothing."""

    def __init__(self, cuda: bool):
        self.cuda, self.cap_gb, self.ctx_bytes = cuda, None, 0.0
        self.card_before = card_used_mib() if cuda else None  # before this process made a context
        if cuda:
            torch.ones(64, 64, device="cuda", dtype=torch.bfloat16) @ torch.ones(64, 64, device="cuda",
                                                                                 dtype=torch.bfloat16)
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            self.total = total
            self.ctx_bytes = total - free - torch.cuda.memory_reserved()  # context, cuBLAS, other processes

    def cap(self, gb: float | None) -> None:
        """The allocator may hold `gb` GB less the context (None: the whole card)."""
        self.cap_gb = gb
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()  # what the probe or a phase before left cached counts against a cap
            free, _ = torch.cuda.mem_get_info()  # the context grows (cuBLAS handles, kernels loaded): measured again
            self.ctx_bytes = max(self.ctx_bytes, self.total - free - torch.cuda.memory_reserved())
            frac = 1.0 if gb is None else (gb * 1e9 - self.ctx_bytes) / self.total
            if not 0 < frac <= 1:
                raise SystemExit(f"a {gb} GB limit leaves nothing beside the {self.ctx_bytes / 1e9:.2f} GB context")
            torch.cuda.set_per_process_memory_fraction(frac)

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def measured(self) -> dict:
        if not self.cuda:
            return {}
        torch.cuda.synchronize()
        used = card_used_mib()
        return dict(max_allocated_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3),
                    max_reserved_gb=round(torch.cuda.max_memory_reserved() / 1e9, 3),
                    process_gb=round((used - self.card_before) * 2**20 / 1e9, 3)
                    if used is not None and self.card_before is not None else None,
                    context_gb=round(self.ctx_bytes / 1e9, 3), cap_gb=self.cap_gb)


def vram_row(c, plans, vram: Vram, variant: str) -> dict:
    """Predicted peak (the plans run: what they allocate) beside the measured peaks: torch's
    allocated bytes (err_allocated against the prediction) and the process's memory on the card
    past its CUDA context, which the report sets against the prediction too (the reserve is room
    left for the context and the allocator's slack, not a prediction)."""
    pred = max(p.memory.gpu_bytes for p in plans) / 1e9
    card = pred + c.plans.options.vram_reserve_gb
    row = dict(table="vram", variant=variant, predicted_gb=round(pred, 3), predicted_with_reserve_gb=round(card, 3),
               plans=sorted({f"{p.phase}{p.step_tokens if p.phase == 'prefill' else ''}" for p in plans}),
               **vram.measured())
    if row.get("max_allocated_gb"):
        row["err_allocated"] = round(row["max_allocated_gb"] / pred - 1, 4)
    return row


# ------------------------------------------------------------------------------------ compiling


def plans_run(c, lengths: list[int]) -> list:
    """The plans a phase runs: decode, and the prefill plans of its prompt lengths and PROMPT."""
    return list({id(p): p for p in [c.decode] + [c.prefill_plan(n) for n in {*lengths, PROMPT}]}.values())


def compile_limited(model, base: dict, vram_gb: float, decode_only: bool):
    """Compiled under the VRAM limit (compile option vram_gb; decode_only: nothing reserved for
    prefill, DECODE_ONLY_OPTIONS): the compiled model, its options and how the limit was given."""
    import ktflow

    extra = DECODE_ONLY_OPTIONS if decode_only else {}
    opts = dict(base, vram_gb=vram_gb, **extra)
    return ktflow.compile(model, **opts), opts, "vram_gb" + "".join(f"+{k}={v}" for k, v in extra.items())


def resident(plan) -> dict:
    """The decode plan's GPU-resident routed experts (each once: a deferred twin shares them)."""
    from ktflow.ir.ops import Op

    nodes = [n for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS]
    gpu = [n for n in nodes if n.place.device.value == "gpu" and n.attrs.rank_range[0] == 0]
    total = sum(n.attrs.experts for n in {n.attrs.layer: n for n in nodes}.values())
    return dict(gpu_experts=sum(len(n.attrs.ids) for n in gpu), experts=total,
                gpu_expert_gb=round(sum(n.weight_bytes(2) for n in gpu) / 1e9, 3),
                gpu_keys=sorted((n.attrs.layer, tuple(n.attrs.ids)) for n in gpu))


# ------------------------------------------------------------------------------------ measuring


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def prefill_row(c, vocab: int, tokens: int, reps: int, cuda: bool) -> dict:
    """llama-bench style: random ids, a warm-up, then `reps` timed prompts (logits of the last)."""
    import ktflow
    from ktflow.plan.artifact import prefill_decisions

    g = torch.Generator().manual_seed(tokens)
    ktflow.execute(c, torch.randint(0, vocab, (1, tokens), generator=g), logits="last")
    rates = []
    for _ in range(reps):
        ids = torch.randint(0, vocab, (1, tokens), generator=g)
        sync(cuda)
        t0 = time.perf_counter()
        logits, _ = ktflow.execute(c, ids, logits="last")
        logits[:, -1].argmax(-1)
        sync(cuda)
        rates.append(tokens / (time.perf_counter() - t0))
        del logits
    plan = c.prefill_plan(tokens)
    return dict(table="prefill", prompt=tokens, tok_s=round(statistics.mean(rates), 1),
                sd=round(statistics.stdev(rates), 1) if len(rates) > 1 else 0.0, reps=rates,
                bucket=plan.step_tokens, chunks=-(-tokens // c.chunk_tokens), decisions=prefill_decisions(plan),
                predicted_tok_s=round(plan.step_tokens / plan.predicted_step_us * 1e6, 1),
                predicted_gb=round(plan.memory.gpu_bytes / 1e9, 3),
                staging_gb=round(plan.memory.staging_bytes / 1e9, 3))


def traced_prefill(c, vocab: int, tokens: int, path: Path) -> dict:
    """One prompt of `tokens` with its prefill plan's (last) step instrumented: the measured
    instructions written as a Chrome trace to `path` (beside the plan's predicted ones: `ktflow compile
    --trace`), and per lane the measured busy time against the predicted, with the step's span."""
    import ktflow
    from ktflow.plan.timeline import with_measured_plans, write_chrome_trace

    plan = c.prefill_plan(tokens)
    ex = c.executor(plan)
    ex.trace = 1
    g = torch.Generator().manual_seed(tokens + 1)
    ktflow.execute(c, torch.randint(0, vocab, (1, tokens), generator=g), logits="last")
    instrs = ex.measured or []

    def lanes(ss) -> dict:
        busy: dict[str, float] = {}
        for st in ss:
            busy[st.lane] = busy.get(st.lane, 0.0) + st.end_us - st.start_us
        return {k: round(v, 1) for k, v in sorted(busy.items())}

    def kind(st) -> str:  # lane:op, routed experts told apart by where their weights come from
        n = plan.ir.by_name(st.node)
        what = n.op.value
        if what == "routed_experts":
            what += ".streamed" if len(n.inputs) >= 3 else (".gpu" if n.place.device.value == "gpu" else ".cpu")
        return f"{st.lane}:{what}"

    def by_kind(ss, field=lambda st: st.end_us - st.start_us) -> dict:
        busy: dict[str, float] = {}
        for st in ss:
            if st.kind not in ("record", "wait") and st.lane in ("gpu", "fetch") and field(st) is not None:
                busy[kind(st)] = busy.get(kind(st), 0.0) + field(st)
        return busy

    write_chrome_trace(with_measured_plans(c.plans, lambda p: instrs if p is plan else None), str(path),
                       label="measured")
    span = (max(st.end_us for st in instrs) - min(st.start_us for st in instrs)) if instrs else 0.0
    measured, predicted = by_kind(instrs), by_kind(plan.instructions)
    issued = by_kind(instrs, lambda st: st.issue_us)
    # the GPU-side kinds, most measured time first: [measured us, predicted us, host issue us (None:
    # not timed, an eager run)]; issue near measured: the host's issue held the lane back
    gpu_kinds = {k: [round(measured.get(k, 0.0), 1), round(predicted.get(k, 0.0), 1),
                     round(issued[k], 1) if k in issued else None]
                 for k in sorted(set(measured) | set(predicted), key=lambda k: -measured.get(k, 0.0))}
    from ktflow.backends.kernels import moe_gpu

    how = moe_gpu.GROUPED_FALLBACK.get("cuda" if torch.cuda.is_available() else "cpu")
    return dict(table="prefill_trace", prompt=tokens, bucket=plan.step_tokens, trace=str(path),
                grouped_matmul="torch" if how is None else f"loop over experts ({how})",
                span_us=round(span, 1), predicted_us=round(plan.predicted_step_us, 1),
                busy_us=lanes(instrs), predicted_busy_us=lanes(plan.instructions), gpu_kinds_us=gpu_kinds)


def profiled_prefill(c, vocab: int, tokens: int, path: Path, rows: int = 40) -> None:
    """One prompt of `tokens` under torch.profiler (CUDA and host activity): the ops and kernels
    with the most GPU time, then those with the most host time, as text tables to `path`."""
    import ktflow
    from ktflow.util.fsutil import write_atomic
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(tokens + 2)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ktflow.execute(c, ids, logits="last")
        torch.cuda.synchronize()
    avg = prof.key_averages()
    text = (f"prefill of {tokens} tokens, by GPU time\n{avg.table(sort_by='cuda_time_total', row_limit=rows)}\n\n"
            f"by host time\n{avg.table(sort_by='self_cpu_time_total', row_limit=rows)}\n")
    write_atomic(path, text)


def profiled_decode(c, c1, vocab: int, path: Path, new: int = 32, rows: int = 40) -> dict:
    """Where a decode token's time goes: one step of the one-step plan `c1` issued eagerly with
    its instructions timed (busy time per lane and per kind, measured against predicted: the
    lanes' sum beside the span shows what overlaps), then `new` greedy tokens of `c` (its
    captured graphs, as users run) under torch.profiler: the kernels with the most GPU time and
    the host calls with the most host time, as text tables to `path`."""
    from ktflow.runtime.generate import generate_with_stats
    from ktflow.util.fsutil import write_atomic
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(7))
    ex = c1.executor(c1.decode)
    ex.trace = 3  # the first decode steps traced; the last one is kept
    generate_with_stats(c1, ids, 3)
    instrs = ex.measured or []
    plan = c1.decode

    def busy(ss) -> dict:
        out: dict[str, float] = {}
        for st in ss:
            if st.kind in ("record", "wait"):
                continue
            n = plan.ir.by_name(st.node)
            k = f"{st.lane}:{n.op.value}" + (".gpu" if n.op.value == "routed_experts" and
                                              n.place.device.value == "gpu" else "")
            out[k] = out.get(k, 0.0) + st.end_us - st.start_us
        return out

    measured, predicted = busy(instrs), busy(plan.instructions)
    span = (max(st.end_us for st in instrs) - min(st.start_us for st in instrs)) if instrs else 0.0
    kinds = {k: [round(measured.get(k, 0.0), 1), round(predicted.get(k, 0.0), 1)]
             for k in sorted(set(measured) | set(predicted), key=lambda k: -measured.get(k, 0.0))}
    from ktflow.runtime.execute import decode_greedy, execute

    steps = c.plans.options.greedy_steps
    new = max(steps, new // steps * steps)  # whole graph launches
    last, state = execute(c, ids, logits="argmax")  # the prompt, not profiled
    last = decode_greedy(c, last, state, steps)  # its graph captured
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(new // steps):
            last = decode_greedy(c, last[:, -1:], state, steps)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    avg = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    tok_s = new / seconds
    head = (f"decode: {new} greedy tokens after a {PROMPT}-token prompt (the prompt not profiled) under "
            f"torch.profiler, {tok_s:.2f} tok/s; GPU kernel time {gpu_us / new:.0f} us a token\n"
            f"one eager one-step decode step: span {span:.0f} us measured, {plan.predicted_step_us:.0f} us "
            f"predicted; busy us by lane:kind, measured / predicted:\n"
            + "".join(f"  {k}: {m} / {p}\n" for k, (m, p) in kinds.items()))
    write_atomic(path, f"{head}\nby GPU time\n{avg.table(sort_by='cuda_time_total', row_limit=rows)}\n\n"
                       f"by host time\n{avg.table(sort_by='self_cpu_time_total', row_limit=rows)}\n")
    return dict(table="decode_trace", span_us=round(span, 1), predicted_us=round(plan.predicted_step_us, 1),
                kinds_us=kinds, profiled_tok_s=round(tok_s, 2), gpu_kernel_us_per_token=round(gpu_us / new, 1),
                profile=str(path))


def decode_rate(c, vocab: int, new: int, seed: int, temperature: float = 0.0, top_p: float = 1.0,
                prompt: int = PROMPT) -> float:
    """Decode tokens/s of `new` tokens after a random prompt of `prompt` tokens (its prefill not timed)."""
    from ktflow.runtime.generate import generate_with_stats

    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(seed))
    _, stats = generate_with_stats(c, ids, new, temperature=temperature, top_p=top_p, seed=seed)
    return stats.decode_tokens_per_s


def decode_rounds(variants: list[tuple[str, object, dict]], vocab: int, new: int, rounds: int, dram,
                  depth: int = 0) -> list[dict]:
    """Every variant once a round, after the round's DRAM read; a row per variant. `depth`: the
    decode follows a prompt of that many tokens (0: a PROMPT-token one), its KV cache that full."""
    prompt = max(depth, PROMPT)
    for _, c, kw in variants:  # warm: graphs captured, first-call costs paid
        decode_rate(c, vocab, min(new, 16), 99, prompt=PROMPT, **kw)
    got: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    reads = []
    for r in range(rounds):
        reads.append(dram())
        for name, c, kw in variants:
            got[name].append(decode_rate(c, vocab, new, r, prompt=prompt, **kw))
        print(f"  round {r + 1}/{rounds} (DRAM {reads[-1]:.1f} GB/s, depth {depth}): "
              + ", ".join(f"{n} {v[-1]:.2f}" for n, v in got.items()) + " tok/s", flush=True)
    rows = []
    for name, c, kw in variants:
        xs = got[name]
        bpt = expert_bytes_per_token(c.decode, c.plans.options.expert_format)
        roof = {}
        if bpt:  # the physical limit: the CPU's expert bytes at each round's DRAM read
            roof = dict(cpu_expert_bytes_per_token=round(bpt),
                        cpu_roofline_tok_s=round(statistics.mean(reads) * 1e9 / bpt, 2),
                        cpu_roofline_fraction=round(statistics.mean(x * bpt / (g * 1e9) for x, g in zip(xs, reads)), 3))
        rows.append(dict(table="decode", variant=name, decode_tok_s=round(statistics.mean(xs), 2), **roof,
                         decode_sd=round(statistics.stdev(xs), 2) if len(xs) > 1 else 0.0, per_round=xs,
                         dram_gbps_rounds=reads, tokens=new, decode_depth=depth,
                         greedy_steps=c.plans.options.greedy_steps, **kw,
                         **{k: v for k, v in resident(c.decode).items() if k != "gpu_keys"},
                         predicted_step_us=round(c.decode.predicted_step_us, 1)))
    return rows


# ------------------------------------------------------------------------------------ phases


class Run:
    """What every phase shares: arguments, model, row info, the backend, the DRAM read."""

    def __init__(self, a, model, base: dict, info: dict, vram: Vram, dram):
        self.a, self.model, self.base, self.info, self.vram, self.dram = a, model, base, info, vram, dram
        self.cuda = a.device == "cuda"
        self.lengths = [int(x) for x in a.prefill.split(",") if x]
        self.depths = [int(x) for x in a.decode_depth.split(",") if x and int(x) > 0]
        self.vocab = model.config.vocab_size
        self.user = None  # (compiled, options, how) of the user phase, for decode-only

    def emit(self, rows: list[dict]) -> None:
        for r in rows:
            append_jsonl(self.a.out, [dict(self.info, **r)])


def share(c, donor=None):
    """`c` runs on `donor`'s backend (packed experts, GPU weights and KV caches made once)."""
    if donor is not None:
        c._backend = donor._backend
    c.prepare()
    return c


def phase_user(run: Run) -> None:
    """At the limit: prefill, then greedy and sampled decode warmed, then the VRAM row (what a
    user's process holds); then the one-step plan beside it (the cap raised by its decode step's
    activations: its own captured graph is the benchmark's, not the user's) and the rounds."""
    import ktflow

    a, vram = run.a, run.vram
    vram.cap(a.vram_gb)
    vram.reset()
    t0 = time.perf_counter()
    c, opts, how = compile_limited(run.model, run.base, a.vram_gb, False)
    c1 = ktflow.compile(run.model, **dict(opts, greedy_steps=1))
    same = resident(c1.decode)["gpu_keys"] == resident(c.decode)["gpu_keys"]
    run.info["vram_option"] = how
    t1 = time.perf_counter()
    share(c)
    res = {k: v for k, v in resident(c.decode).items() if k != "gpu_keys"}
    print(f"user: {how}; compiled in {t1 - t0:.1f} s, ready in {time.perf_counter() - t1:.1f} s; GPU experts "
          f"{res['gpu_experts']}/{res['experts']} ({res['gpu_expert_gb']} GB); one-step plan same placement: {same}",
          flush=True)
    for n in run.lengths:
        row = dict(prefill_row(c, run.vocab, n, a.prefill_reps, run.cuda), variant="user", **res)
        print(f"  user prefill {n}: {row['tok_s']} +- {row['sd']} tok/s ({row['decisions']}, bucket {row['bucket']}, "
              f"{row['chunks']} chunk(s))", flush=True)
        run.emit([row])
    if a.trace_dir:  # where a prompt's step goes: measured lanes against the plan's
        for n in run.lengths:
            row = traced_prefill(c, run.vocab, n, Path(a.trace_dir) / f"{a.model}-prefill{n}.trace.json")
            print(f"  traced prefill {n} (a {row['bucket']}-token step): {row['span_us'] / 1e3:.1f} ms measured, "
                  f"{row['predicted_us'] / 1e3:.1f} ms predicted; busy ms by lane, measured / predicted: "
                  + ", ".join(f"{k} {v / 1e3:.1f} / {row['predicted_busy_us'].get(k, 0) / 1e3:.1f}"
                              for k, v in row["busy_us"].items()), flush=True)
            print(f"    grouped experts through: {row['grouped_matmul']}", flush=True)
            print("    GPU-side kinds, ms measured / predicted / host issue: " + ", ".join(
                f"{k} {m / 1e3:.1f} / {p / 1e3:.1f} / {'—' if h is None else f'{h / 1e3:.1f}'}"
                for k, (m, p, h) in list(row["gpu_kinds_us"].items())[:8]), flush=True)
            run.emit([row])
        if run.cuda:  # the shortest prompt under torch.profiler: which kernels and host calls its time goes to
            n = min(run.lengths)
            path = Path(a.trace_dir) / f"{a.model}-prefill{n}.profile.txt"
            profiled_prefill(c, run.vocab, n, path)
            print(f"  profiled prefill {n}: {path}", flush=True)
    kw = dict(temperature=a.temperature, top_p=a.top_p)
    for extra in ({}, kw):  # the user's decode graphs captured: greedy runs, single steps, logits for sampling
        decode_rate(c, run.vocab, 2 * c.plans.options.greedy_steps + 2, 98, **extra)
    row = vram_row(c, plans_run(c, run.lengths), vram, "user")
    print(f"  VRAM user: predicted {row['predicted_gb']} GB ({row['predicted_with_reserve_gb']} with the reserve); "
          f"measured {row.get('max_allocated_gb')} allocated / {row.get('max_reserved_gb')} reserved / "
          f"{row.get('process_gb')} process", flush=True)
    run.emit([row])
    run.user = (c, opts, how)
    beside = 2 * c1.decode.memory.activation_bytes / 1e9
    vram.cap(a.vram_gb + beside)
    share(c1, c)
    if a.trace_dir and run.cuda:  # where a decode token's time goes (before the rounds: they are not disturbed)
        path = Path(a.trace_dir) / f"{a.model}-decode.profile.txt"
        try:
            prof = profiled_decode(c, c1, run.vocab, path)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the rounds below are the measurement
            print(f"  profiled decode failed: {type(e).__name__}: {e}", flush=True)
            prof = None
    if a.trace_dir and run.cuda and prof is not None:
        print(f"  profiled decode: one eager step {prof['span_us'] / 1e3:.2f} ms measured, "
              f"{prof['predicted_us'] / 1e3:.2f} ms predicted; GPU kernels {prof['gpu_kernel_us_per_token']:.0f} us a "
              f"token at {prof['profiled_tok_s']} tok/s; busy ms by lane:kind, measured / predicted: "
              + ", ".join(f"{k} {m / 1e3:.2f} / {p / 1e3:.2f}" for k, (m, p) in list(prof["kinds_us"].items())[:8])
              + f"; {path}", flush=True)
        run.emit([prof])
    rows = decode_rounds([("greedy", c, {}), ("greedy, one step a launch", c1, {}), ("sampled", c, kw)],
                         run.vocab, a.decode, a.rounds, run.dram)
    for r in rows:
        r.update(same_placement_as_greedy=same if r["greedy_steps"] == 1 else True, cap_gb=vram.cap_gb)
    run.emit(rows)
    for depth in run.depths:  # decode with a long prompt's KV cache behind it (llama-bench -d)
        run.emit(decode_rounds([("greedy", c, {}), ("sampled", c, kw)], run.vocab, a.decode, a.depth_rounds,
                               run.dram, depth))


def phase_decode_only(run: Run) -> None:
    a, vram = run.a, run.vram
    if run.user is None:
        raise SystemExit("the decode-only phase runs beside the user phase's plan: list user before it")
    c, _, _ = run.user
    if run.cuda and 2 * a.vram_gb * 1e9 > 0.95 * vram.total:
        print(f"decode-only skipped: two {a.vram_gb} GB placements do not fit this card", flush=True)
        return
    vram.cap(2 * a.vram_gb)  # both placements on one backend
    sync(run.cuda)
    before = torch.cuda.memory_allocated() if run.cuda else 0
    d, _, how = compile_limited(run.model, run.base, a.vram_gb, True)
    share(d, c)
    print(f"decode-only: {how}; GPU experts {resident(d.decode)['gpu_experts']} against the user plan's "
          f"{resident(c.decode)['gpu_experts']}", flush=True)
    rows = decode_rounds([("greedy", c, {}), ("decode-only greedy", d, {})], run.vocab, a.decode, a.ab_rounds,
                         run.dram)
    for r in rows:
        r.update(table="decode_ab", decode_only_option=how)
    ratio = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    paired = statistics.mean(u / o for u, o in zip(rows[0]["per_round"], rows[1]["per_round"]))
    rows[0].update(vs_decode_only=round(ratio, 4), vs_decode_only_paired=round(paired, 4))
    print(f"  user greedy / decode-only greedy: {ratio:.4f} (mean of the rounds' ratios {paired:.4f})", flush=True)
    row = dict(table="vram_decode_only", variant="decode-only", predicted_gb=round(d.decode.memory.gpu_bytes / 1e9, 3),
               predicted_with_reserve_gb=round(d.decode.memory.gpu_bytes / 1e9 + d.plans.options.vram_reserve_gb, 3))
    if run.cuda:  # beside the user plan: what it added (weights both plans hold are counted once), graphs captured
        row["added_allocated_gb"] = round((torch.cuda.memory_allocated() - before) / 1e9, 3)
    run.emit(rows + [row])


def phase_cpu_experts(run: Run) -> None:
    import ktflow

    a, vram = run.a, run.vram
    run.user = None  # the limited plans' backend let go first (where this process ran them)
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()
    vram.cap(None)
    vram.reset()
    wide = ktflow.compile(run.model, **dict(run.base, vram_budget_gb=1000, allow_oversize=True))
    budget = budget_without_experts(wide.decode)
    c = compile_cpu_experts(run.model, dict(run.base, vram_budget_gb=budget))
    # the plans' own peak and the reserve, as the user phase's limit is: without a cap torch's
    # allocator keeps whatever it freed cached (session 48: the process 38.6% above the plan)
    peak = max(p.memory.gpu_bytes for p in c.plans.plans) / 1e9 + c.plans.options.vram_reserve_gb
    vram.cap(peak)
    vram.reset()
    c.prepare()
    print(f"cpu-experts: every routed expert in CPU memory (budget {budget:.2f} GB: dense + KV), the allocator capped "
          f"at the plans' peak and the reserve ({peak:.2f} GB)", flush=True)
    for n in run.lengths:
        row = dict(prefill_row(c, run.vocab, n, a.prefill_reps, run.cuda), variant="cpu-experts")
        print(f"  cpu-experts prefill {n}: {row['tok_s']} +- {row['sd']} tok/s ({row['decisions']})", flush=True)
        run.emit([row])
    run.emit([vram_row(c, [c.prefill_plan(n) for n in run.lengths], vram, "cpu-experts")])


PHASES = {"user": phase_user, "decode-only": phase_decode_only, "cpu-experts": phase_cpu_experts}


# ------------------------------------------------------------------------------------ main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the model (0: all)")
    ap.add_argument("--fp8", action="store_true", help="write the checkpoint as an FP8 release")
    ap.add_argument("--dir", default=None, help="checkpoint dir (default /tmp/ktflow-e2e/<name>)")
    ap.add_argument("--vram-gb", type=float, default=None, help="the VRAM limit (default: qwen3 24, dsv2lite 16)")
    ap.add_argument("--phases", default="user,decode-only,cpu-experts")
    ap.add_argument("--prefill", default="8192,32768", help="prompt lengths (comma list)")
    ap.add_argument("--prefill-reps", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128, help="tokens per decode run")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds")
    ap.add_argument("--decode-depth", default="", help="also decode after prompts of these lengths (comma "
                    "list; llama_user.py's --decode-depth runs llama-bench -d at the same)")
    ap.add_argument("--depth-rounds", type=int, default=2, help="decode rounds at each depth")
    ap.add_argument("--ab-rounds", type=int, default=6, help="rounds of the user plan against the decode-only one "
                    "(a 3%% difference needs more than the spread of three: one round was 40 tok/s against 55)")
    ap.add_argument("--trace-dir", default="", help="also trace one prompt of each length at the limit: a Chrome "
                    "trace per length in this folder, and a row of busy time per lane against the plan's; on CUDA "
                    "also the shortest prompt under torch.profiler (<model>-prefill<n>.profile.txt)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--expert-format", default="auto", choices=["auto", "bf16", "int8", "int4", "fp8"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--hw", default=None, help="a profile (preset or JSON); default: probed (CUDA) and kept in "
                    "--hw-cache for the next process on this machine")
    ap.add_argument("--hw-cache", default="/tmp/ktflow-e2e/hw.json")
    ap.add_argument("--options", default="{}", help="more compile options, JSON")
    ap.add_argument("--dram-mib", type=int, default=1024, help="bytes each round's DRAM read streams")
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", time.strftime("%Y%m%d-%H%M%S")))
    ap.add_argument("--out", default=str(HERE / "user_configs.jsonl"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("user_configs.py --device cuda needs a CUDA GPU (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    bad = [p for p in a.phases.split(",") if p not in PHASES]
    if bad:
        print(f"unknown phases {bad}; known: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    family = a.model.split("-")[0]
    a.vram_gb = a.vram_gb or DEFAULT_VRAM_GB.get(family, 24.0)
    vram = Vram(cuda)  # before anything else touches the GPU
    import ktflow
    from ktflow.backends.native import binding as native

    cfg = dict(MODELS[a.model], **({"num_hidden_layers": a.layers} if a.layers else {}))
    d = ready_checkpoint(a.model, cfg, a.layers, a.fp8, a.dir)
    native.pool(spare=2)
    hw = a.hw
    if hw is None and cuda:
        cache = Path(a.hw_cache)
        if cache.exists():
            hw = str(cache)
        else:
            from ktflow.tools.probe import probe

            prof = probe(log=lambda s: print(f"  probe: {s}", flush=True))
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(prof.model_dump_json(indent=1))
            hw = str(cache)
    dram_pool = native.module().Pool(threads=0, groups=0, pin=True)
    dram = lambda: native.module().stream_read_gbps(dram_pool, a.dram_mib << 20, 3)  # noqa: E731
    lengths = [int(x) for x in a.prefill.split(",") if x]
    depths = [int(x) for x in a.decode_depth.split(",") if x]
    base = dict(hw=hw or "this", device=a.device, backend="cuda_graph" if cuda else "native",
                max_seq_len=max(lengths + depths + [PROMPT]) + a.decode + 64, expert_format=a.expert_format,
                **json.loads(a.options))
    model = ktflow.load(d)
    info = dict(bench="user_configs", run_id=a.run_id, commit=commit(), **machine(),
                gpu=torch.cuda.get_device_name(0) if cuda else None, device=a.device, model=a.model,
                layers=cfg["num_hidden_layers"], checkpoint="fp8" if a.fp8 else "bf16", vram_gb=a.vram_gb,
                threads=native.pool().threads, dram_gbps=round(dram(), 1))
    run = Run(a, model, base, info, vram, dram)
    print(f"{a.model}, {info['layers']} layers, {info['checkpoint']} checkpoint, VRAM limit {a.vram_gb} GB "
          f"(context {vram.ctx_bytes / 1e9:.2f} GB); DRAM {info['dram_gbps']} GB/s", flush=True)
    for p in a.phases.split(","):
        try:
            PHASES[p](run)
        except torch.cuda.OutOfMemoryError as e:  # the limit held and the plan did not: loudly, with a row
            row = dict(table="error", phase=p, error="OOM", message=str(e)[:800], **vram.measured())
            run.emit([row])
            print(f"OOM in phase {p} at the {vram.cap_gb} GB cap: {row['message'][:300]}", file=sys.stderr, flush=True)
            return 3
        gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
