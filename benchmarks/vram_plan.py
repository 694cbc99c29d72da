"""The VRAM plan measured (GPU machine): at one VRAM limit (default 24 GB), what the default plan's
prefill reservation costs decode and buys prefill, and whether every plan stays inside the limit.

Variants, each compiled with --vram-gb (the same probed profile):
- shared: the defaults (the VRAM plan's choice for --workload);
- decode-first: prefill_reserve='none' (decode residency first, today's placement);
- cpu-experts: every routed expert in CPU memory (vram_budget_gb = the dense weights and the KV
  cache), the rest of the limit left to prefill: the prefill reference.

Per variant: greedy decode tok/s after a 32-token prompt (--decode steps, --reps rounds), prefill
tok/s at each --prompts length (benchmarks/prefill.py `measure`: mean of --reps, peak VRAM per
prompt), peak VRAM through the decode, each against the plans' predictions; with
--limit-process the process may allocate no more than the limit (an OOM is a failed row, not a
crash). Then the targets: decode cost of shared against decode-first (predicted and measured),
shared's prefill rate against cpu-experts' at each length, predicted peak within 10% of measured.

    python benchmarks/vram_plan.py --layers 24 --vram-gb 24 --prompts 8192,32768

Rows go to benchmarks/vram_plan.jsonl; the checkpoint (e2e.py's qwen3 shape, cut to --layers) is
reused from /tmp/ktflow-e2e.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import MODELS, budget_without_experts, decode_run, write_checkpoint  # noqa: E402
from prefill import measure  # noqa: E402


def compile_variant(model, name: str, base: dict, budget: float):
    import ktflow

    opts = dict(base)
    if name == "decode-first":
        opts["prefill_reserve"] = "none"
    elif name == "cpu-experts":
        opts["vram_budget_gb"] = budget
    return ktflow.compile(model, **opts)


def decode_rate(c, vocab: int, steps: int, reps: int) -> tuple[float, float, int]:
    """(mean tok/s, sd, peak bytes allocated) of greedy decode after a 32-token prompt."""
    rates = []
    torch.cuda.reset_peak_memory_stats()
    for r in range(reps):
        rate, _, _ = decode_run(c, vocab, steps, seed=r)
        rates.append(rate)
    torch.cuda.synchronize()
    return statistics.mean(rates), statistics.stdev(rates) if reps > 1 else 0.0, torch.cuda.max_memory_allocated()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (0: all)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--vram-gb", type=float, default=24.0)
    ap.add_argument("--workload", default="agent", choices=["agent", "chat"])
    ap.add_argument("--prompts", default="8192,32768")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="shared,decode-first,cpu-experts")
    ap.add_argument("--limit-process", action="store_true",
                    help="torch.cuda.set_per_process_memory_fraction(limit x 1.05 / the card's memory) per variant")
    ap.add_argument("--out", default=str(HERE / "vram_plan.jsonl"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("vram_plan.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import ktflow
    from ktflow.backends.native import binding as native
    from ktflow.tools.probe import probe

    cfg = dict(MODELS[a.model])
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    d = Path(a.dir or f"/tmp/ktflow-e2e/{a.model}" + (f"-{a.layers}l" if a.layers else ""))
    write_checkpoint(cfg, d)
    native.pool(spare=2)
    hw = probe(log=lambda line: print(f"  probe: {line}", flush=True))
    prompts = [int(x) for x in a.prompts.split(",") if x]
    max_seq = max(prompts) + a.decode + 64
    model = ktflow.load(d)
    base = dict(hw=hw, device="cuda", max_seq_len=max_seq, vram_gb=a.vram_gb, workload=a.workload)
    wide = ktflow.compile(model, device="cuda", hw=hw, max_seq_len=max_seq, vram_budget_gb=1000, allow_oversize=True)
    budget = budget_without_experts(wide.decode)
    vocab = cfg["vocab_size"]
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model,
                layers=cfg["num_hidden_layers"], vram_gb=a.vram_gb, workload=a.workload)
    total = torch.cuda.get_device_properties(0).total_memory
    rows: dict[str, dict] = {}
    for name in [v for v in a.variants.split(",") if v]:
        gc.collect()
        torch.cuda.empty_cache()
        if a.limit_process:
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.vram_gb * 1e9 * 1.05 / total))
        row, c = dict(info, variant=name), None
        try:
            t0 = time.perf_counter()
            c = compile_variant(model, name, base, budget)
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            v = c.plans.vram
            row.update(chosen=v.chosen, reserved_gb=round(v.reserved_bytes / 1e9, 3),
                       residency_gb=round(v.residency_bytes / 1e9, 3), chunk_tokens=c.chunk_tokens,
                       stage_experts=v.stage_experts, predicted_decode_ms=round(c.decode.predicted_step_us / 1e3, 3),
                       predicted_decode_vram_gb=round(c.decode.memory.gpu_bytes / 1e9, 3),
                       predicted_peak_vram_gb=round(max(p.memory.gpu_bytes for p in c.plans.plans) / 1e9, 3))
            print(f"{name}: {v.chosen}; reserve {row['reserved_gb']} GB, residency {row['residency_gb']} GB, "
                  f"chunk {c.chunk_tokens}", flush=True)
            c.prepare()
            rate, sd, peak = decode_rate(c, vocab, a.decode, a.reps)
            row.update(decode_tok_s=round(rate, 2), decode_sd=round(sd, 2), decode_peak_vram_gb=round(peak / 1e9, 3))
            row["prefill"] = [measure(c, vocab, n, a.reps, hw, cfg["num_hidden_layers"]) for n in prompts]
            for p in row["prefill"]:
                p.pop("instructions", None)
        except torch.cuda.OutOfMemoryError as e:
            row["oom"] = str(e).splitlines()[0]
            print(f"{name}: out of memory: {row['oom']}", flush=True)
        finally:
            if a.limit_process:
                torch.cuda.set_per_process_memory_fraction(1.0)
        rows[name] = row
        drop(c)
    append_jsonl(a.out, list(rows.values()))
    report(rows, prompts)
    return 0


def drop(c) -> None:
    """Free a variant's GPU memory before the next one compiles and loads."""
    if c is not None:
        c._executors.clear()
        c._backend = None
    gc.collect()
    torch.cuda.empty_cache()


def report(rows: dict[str, dict], prompts: list[int]) -> None:
    shared, first, cpu = (rows.get(k, {}) for k in ("shared", "decode-first", "cpu-experts"))
    print("\nvariant        decode tok/s  predicted ms  peak decode GB (pred)  " +
          "  ".join(f"prefill {n} tok/s (pred) peak GB (pred)" for n in prompts))
    for name, r in rows.items():
        if "oom" in r:
            print(f"{name:14s} OOM: {r['oom']}")
            continue
        pre = "  ".join(f"{p['tok_s']:9.0f} ({p['predicted_tok_s']:6.0f}) {p['peak_vram_gb']:6.2f} "
                        f"({p['planned_vram_gb']:6.2f})" for p in r.get("prefill", []))
        print(f"{name:14s} {r.get('decode_tok_s', 0):12.2f} {r.get('predicted_decode_ms', 0):13.2f} "
              f"{r.get('decode_peak_vram_gb', 0):10.2f} ({r.get('predicted_decode_vram_gb', 0):6.2f})  {pre}")
    if shared.get("decode_tok_s") and first.get("decode_tok_s"):
        measured = first["decode_tok_s"] / shared["decode_tok_s"] - 1
        predicted = shared["predicted_decode_ms"] / first["predicted_decode_ms"] - 1
        print(f"decode cost of the reservation: measured {measured:+.1%}, predicted {predicted:+.1%} (target <= +3%)")
    for p_s, p_c in zip(shared.get("prefill", []), cpu.get("prefill", [])):
        print(f"prefill {p_s['prompt']}: shared {p_s['tok_s']:.0f} tok/s = {p_s['tok_s'] / p_c['tok_s']:.0%} of "
              f"cpu-experts' {p_c['tok_s']:.0f} (target >= 70%)")
    for name, r in rows.items():
        for p in r.get("prefill", []):
            err = p["planned_vram_gb"] / p["peak_vram_gb"] - 1 if p["peak_vram_gb"] else 0.0
            print(f"peak VRAM {name} {p['prompt']}: measured {p['peak_vram_gb']:.2f} GB, predicted "
                  f"{p['planned_vram_gb']:.2f} GB ({err:+.1%}; target within 10%)")


if __name__ == "__main__":
    sys.exit(main())
