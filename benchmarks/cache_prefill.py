"""Long-prompt prefill with and without the expert cache: what a cached layer's prefill costs.

A split layer's CPU experts are streamed to the GPU for a long prompt where the prefill pass prices
that faster (`passes/prefill.py`). A layer whose GPU experts are a cache can be streamed only whole
(every expert, standing in for the cache part in that step) or kept as placed (the cache's rows on
the GPU, the rest on the CPU). This benchmark times one prompt of each length in `--tokens` through
four plans compiled at one VRAM budget (the one putting `--share` of the routed experts on the GPU,
as cache_speed.py finds it):

- `static`: no cache, `prefill_experts` auto (split layers streamed where priced faster);
- `static cpu`: no cache, every layer's CPU experts kept on the CPU (`prefill_experts="cpu"`);
- `cache`: the expert cache, auto (a cached layer streamed whole where priced faster), followed
  (`ExpertCache.follow`: the refill from the prompt's picks after its prefill is timed with it);
- `cache cpu`: the expert cache with `prefill_experts="cpu"`: what every cached layer's prefill
  did before the pass could stream it whole.

Reported per length: prefill tok/s per plan (best of `--rounds`, after one untimed run of other
ids; a cache put back to its first filling before each, and its refill from the prompt timed
until its copies land, that part also given alone in ms), and the cache's against static's.
`--routing-profile` compiles every plan with a profile (cache_speed.py --save-profile writes the
one its plans use); without one the pass prices a cache from uniform routing. Prompts are the
checkpoint's held-out text where it has some (else seeded random ids). Prints a table and appends
each length's row to benchmarks/cache_prefill.jsonl as it is measured. On the GPU machine:

    python benchmarks/cache_prefill.py /tmp/moe-small-xx --share 0.25 --tokens 512,2048,8192 \
        --routing-profile routing.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import budget_for, gpu_experts, held_out_or_random, roofline_only  # noqa: E402

PLANS = ("static", "static cpu", "cache", "cache cpu")


def prefill_seconds(compiled, ids: torch.Tensor, cache, rounds: int, vocab: int) -> tuple[float, float]:
    """The best of `rounds` timed prefills of `ids` (after one untimed of other, random ids), each
    from a fresh sequence, as (seconds until the logits are on the host, seconds more until the
    cache's refill from the prompt's picks has landed; 0 without a cache). With a cache each round
    starts from the plan's first filling (put back untimed) and follows the routing; `stop` waits
    for the refill's copies. The best round is the one with the least total."""
    import ktflow

    first = {layer: list(c.resident) for layer, c in cache.layers.items()} if cache is not None else {}
    warm = torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(1))
    best = (float("inf"), 0.0)
    for r in range(rounds + 1):
        for layer, ids_first in first.items():
            cache.refill(layer, ids_first)
        if cache is not None:
            cache.follow()
        t0 = time.perf_counter()
        out, _ = ktflow.execute(compiled, ids if r else warm, logits="last")
        float(out[0, -1, 0])  # the logits on the host: the step is done
        t1 = time.perf_counter()
        if cache is not None:
            cache.stop()
        t2 = time.perf_counter()
        if r and t2 - t0 < sum(best):
            best = (t1 - t0, t2 - t1)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir (cache_speed's scaled model, or any ktflow.load reads)")
    ap.add_argument("--share", type=float, default=0.25, help="GPU share of the routed experts (the VRAM budget)")
    ap.add_argument("--tokens", default="512,2048,8192", help="prompt lengths (comma list)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--hw", default=None, help="the hardware profile the plans are compiled with, its fixed per-op "
                    "costs left out (default: paper-a100's rates; e.g. `ktflow hw probe`'s JSON)")
    ap.add_argument("--routing-profile", default=None,
                    help="a routing profile (JSON: `ktflow profile`, or cache_speed.py --save-profile) every plan is "
                    "compiled with, so the cache plan is the one cache_speed.py decodes with (default: none; the "
                    "pass then prices a cache from uniform routing)")
    ap.add_argument("--out", default=str(HERE / "cache_prefill.jsonl"))
    a = ap.parse_args()
    try:
        lengths = sorted({int(x) for x in a.tokens.split(",") if x.strip()})
    except ValueError:
        lengths = [0]
    if not lengths or lengths[0] < 1 or a.rounds < 1:
        print(f"cache_prefill: --tokens takes a comma list of prompt lengths >= 1 and --rounds >= 1 (got "
              f"{a.tokens!r}, {a.rounds})", file=sys.stderr)
        return 2
    import ktflow
    from ktflow.ir.ops import Op
    from ktflow.runtime.expert_cache import ExpertCache

    d = Path(a.model)
    model = ktflow.load(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    max_seq = lengths[-1] + 8
    budget = budget_for(model, a.share, max_seq)
    opts = dict(hw=roofline_only(a.hw, a.device), device=a.device, backend=a.backend, dtype="bfloat16",
                vram_budget_gb=budget, max_seq_len=max_seq, numa_nodes=1, routing_profile=a.routing_profile)
    plans = {"static": ktflow.compile(model, **opts),
             "static cpu": ktflow.compile(model, prefill_experts="cpu", **opts),
             "cache": ktflow.compile(model, expert_cache=True, **opts),
             "cache cpu": ktflow.compile(model, expert_cache=True, prefill_experts="cpu", **opts)}
    caches = {name: ExpertCache(c) if name.startswith("cache") else None for name, c in plans.items()}
    info = dict(bench="cache_prefill", commit=commit(), **machine(), model=str(d), device=a.device,
                gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else None, hw=a.hw or "paper-a100",
                share=a.share, budget_gb=round(budget, 4), rounds=a.rounds, routing_profile=a.routing_profile)
    static_gpu = gpu_experts(plans["static"].decode)  # per layer: the static plan's GPU experts
    cached = {n.attrs.layer: n for n in plans["cache"].decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached}
    print(f"share {a.share:.2f} (budget {budget:.3f} GB); the cache plan's cached layers (rows/refill interval): "
          + (", ".join(f"L{layer} {len(n.attrs.ids)}/{n.attrs.refill_every}" for layer, n in sorted(cached.items()))
             or "none (the pass priced static rows)"))
    print(f"{'tokens':>7} " + " ".join(f"{name:>11}" for name in PLANS)
          + "   cache / static   (prefill tok/s; the cache's refill from the prompt landing after it, ms)")
    for n in lengths:
        ids = held_out_or_random(d, n, vocab).view(1, n)
        timed = {name: prefill_seconds(plans[name], ids, caches[name], a.rounds, vocab) for name in PLANS}
        secs = {name: sum(t) for name, t in timed.items()}
        refill_ms = {name: round(1e3 * timed[name][1], 2) for name in PLANS if name.startswith("cache")}
        # the cache plan's prefill plan for this length: its cached layers streamed whole (or kept)
        whole = sorted({m.attrs.layer for m in plans["cache"].prefill_plan(n).ir.nodes
                        if m.op == Op.ROUTED_EXPERTS and m.attrs.cache_size})
        tok_s = {name: n / s for name, s in secs.items()}
        print(f"{n:>7} " + " ".join(f"{tok_s[name]:>11.1f}" for name in PLANS)
              + f"   {tok_s['cache'] / tok_s['static']:.3f}x   (refill "
              + ", ".join(f"{name} {v:.1f}" for name, v in refill_ms.items())
              + f"; cached layers streamed whole: {whole or 'none'})",
              flush=True)
        append_jsonl(a.out, [dict(**info, tokens=n, cached_layers=sorted(cached), whole_layers=whole,
                                  static_gpu=static_gpu,
                                  **{f"{name.replace(' ', '_')}_refill_ms": v for name, v in refill_ms.items()},
                                  **{f"{name.replace(' ', '_')}_tok_s": round(v, 1) for name, v in tok_s.items()})])
    return 0


if __name__ == "__main__":
    sys.exit(main())
