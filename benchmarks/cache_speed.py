"""Decode speed with the GPU expert cache against static placement, on held-out conversations of
a model with learned routing (train_small_moe.py, scaled with scale_moe.py so experts cost real
bandwidth: the same routing, token for token).

For each GPU share of the routed experts, one VRAM budget (the smallest at which the plan without
a profile puts that share on the GPU, as placement_hits.py finds it) and four plans:

- `uniform`: placed without a routing profile;
- `profiled`: placed with a profile of training-split conversations (`--routing-profile`): each a
  `--prompt`-token prompt and `--decode` decode steps (`--profile-decode`; read as `--text`
  says), so the profile holds the cache's curves;
- `cache`: compiled with `expert_cache=True` and the same profile: the placement pass prices a
  cache per layer from the curves (how many GPU rows each layer gets, cache or static, the refill
  interval; with `--profile-decode 0` the profile has no curves and every split layer is a
  cache, unpriced), and the run follows the routing (`ExpertCache.follow`: refills after each
  prompt and at the plan's intervals, or every `--every` tokens; the copies behind the decode
  steps). Where the pass prices no cache on any layer, the plan is static and the row's cache
  measures (hit rate, copies, host time, lag) are null: nothing was measured;
- `frozen`: the cache's plan compiled again but never refilled: its slots keep their first
  filling (the profile's most picked experts), so `frozen` against `profiled` is what the cache's
  plan costs without refills, and `cache` against `frozen` what the refills cost and bring.

Each plan runs the same held-out conversations: a `--prompt`-token prompt, then `--decode` decode
steps, fed the held-out text that follows (`--text heldout`, one step a token) or the model's own
greedy tokens (`--text greedy`, K steps a launch as `generate` runs them). Decode tok/s is the decoded tokens over the
decode time of all conversations; the cache's refills are inside that time. The plans take turns
conversation by conversation, in rounds, so a machine's drift falls on all alike. For the static
plans it reports the share of the held-out picks on their GPU experts (the conversations' routing
recorded once, every expert on the GPU); for the cache, the share of the decoded picks its slots
held at the refills (hit rate), the bytes it copied to the GPU and the host's seconds at step
ends (refills begun, copies issued and taken in: the decode loop waits for them) per decoded
token, and the decode tokens between a copy's issue and its expert taking the slot. The plans
are compiled with paper-a100's rates, or with `--hw`'s (this machine's, from `ktflow hw probe`,
prices the cache's hits and copies as a user's plan would be), fixed per-op costs left out.
Prints a table and appends rows to benchmarks/cache_speed.jsonl. On the GPU machine:

    python benchmarks/scale_moe.py /tmp/moe-small --inter 2048 -o /tmp/moe-scaled
    python benchmarks/cache_speed.py /tmp/moe-scaled --device cuda --shares 0.1,0.25
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import (add_text_args, budget_for, gpu_experts, held_out, profile_of, roofline_only,  # noqa: E402
                            training_profile)


def decode_seconds(compiled, prompt: list[int], decode: int, text: list[int] | None = None) -> float:
    """The prompt, then `decode` greedy decode steps as `generate` runs them (or, with `text`, its
    first `decode` tokens fed one decode step a token: teacher forcing): the decode part's wall
    seconds."""
    import time

    import ktflow
    from ktflow.runtime.generate import generate_with_stats

    if text is None:
        return generate_with_stats(compiled, torch.tensor([prompt]), decode + 1)[1].decode_seconds
    nxt, state = ktflow.execute(compiled, torch.tensor([prompt]), logits="argmax")
    t0 = time.perf_counter()
    for t in text[:decode]:
        nxt, state = ktflow.execute(compiled, torch.tensor([[t]]), state, logits="argmax")
    int(nxt[0, -1])  # the last step's result on the host
    return time.perf_counter() - t0


def timed_rounds(plans: dict, prompts: list[list[int]], texts: list, decode: int, rounds: int,
                 before=None) -> dict[str, list[float]]:
    """Decode tok/s per plan and round. Within a round the plans take turns conversation by
    conversation (each runs conversation i before any runs conversation i + 1), so a machine's
    drift over seconds falls on all alike; the plan that goes first moves on by one each
    conversation and each round, so no plan keeps a place in the order. `before(name)` is called
    for each plan at the start of each round. Each round's tok/s are printed as it ends, so a run
    cut short (a time limit) still says what it measured."""
    took: dict[str, list[float]] = {name: [0.0] * rounds for name in plans}
    names = list(plans)
    for r in range(rounds):
        for name in names if before is not None else ():
            before(name)
        for i, (p, t) in enumerate(zip(prompts, texts)):
            k = (r + i) % len(names)
            for name in names[k:] + names[:k]:
                took[name][r] += decode_seconds(plans[name], p, decode, t)
        print(f"  round {r + 1} of {rounds}: "
              + ", ".join(f"{name} {len(prompts) * decode / took[name][r]:.1f}" for name in names) + " tok/s",
              flush=True)
    return {name: [len(prompts) * decode / t for t in ts] for name, ts in took.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (scaled: scale_moe.py)")
    ap.add_argument("--shares", default="0.25", help="GPU shares of the routed experts (comma list)")
    ap.add_argument("--every", type=int, default=None,
                    help="decoded tokens between the cache's refills (default: each layer's, as the plan prices it)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of each conversation")
    ap.add_argument("--decode", type=int, default=128, help="decoded tokens of each conversation")
    ap.add_argument("--seqs", type=int, default=8, help="held-out conversations")
    ap.add_argument("--profile-decode", type=int, default=None,
                    help="decode steps of each profile conversation (default: --decode). 0: a profile of the "
                    "prompts alone, without the cache's curves: the cache plan then holds every split layer's GPU "
                    "experts as a cache, unpriced (as a user's profile without curves places it)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", choices=["heldout", "greedy"], default="heldout",
                    help="what the decode steps read: heldout (each conversation's held-out text after the "
                    "prompt, one step a token, and the profile's training text likewise; default) or greedy (the "
                    "model's own greedy tokens, K steps a launch; a small model's greedy text repeats itself, "
                    "which makes routing stickier than real text)")
    add_text_args(ap)
    ap.add_argument("--profile-model", default=None,
                    help="the checkpoint the routing profile is recorded with (default: the model). Give the "
                    "unscaled one scale_moe.py started from: it routes as the scaled one does, and its experts "
                    "cost a fraction of the bytes, so the profile's thousands of decode steps cost less")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--hw", default=None,
                    help="the hardware profile the four plans are compiled with, its fixed per-op costs left out "
                    "(default: paper-a100's rates). Give this machine's (`ktflow hw probe -o hw.json`) to price "
                    "the cache's hits and copies at its own CPU and PCIe rates; the VRAM budget of a share is "
                    "found with paper-a100's either way")
    ap.add_argument("--save-profile", default=None,
                    help="also write the routing profile the plans were compiled with to this JSON file")
    ap.add_argument("--out", default=str(HERE / "cache_speed.jsonl"))
    a = ap.parse_args()
    import ktflow
    from ktflow.ir.ops import Op
    from ktflow.runtime.expert_cache import ExpertCache

    d = Path(a.model)
    model = ktflow.load(d)
    length = a.prompt + a.decode
    held = held_out(d, a.seqs * length)
    prompts = [held[i * length:i * length + a.prompt].tolist() for i in range(a.seqs)]
    texts = [held[i * length + a.prompt:(i + 1) * length].tolist() if a.text == "heldout" else None
             for i in range(a.seqs)]
    profiler = model if a.profile_model is None else ktflow.load(a.profile_model)
    profile_decode = a.decode if a.profile_decode is None else a.profile_decode
    prof = training_profile(profiler, d, a, a.prompt, profile_decode, forced=a.text == "heldout" and profile_decode > 0,
                            device=a.device)
    tmp = tempfile.TemporaryDirectory()
    path = Path(tmp.name) / "routing.json"
    path.write_text(prof.model_dump_json() + "\n")
    if a.save_profile:
        from ktflow.util.fsutil import write_atomic

        write_atomic(a.save_profile, prof.model_dump_json() + "\n")
    # the held-out conversations' own routing (the same text the timed runs read): static plans' hits
    check = profile_of(profiler, prompts, length + 8, a.decode, None if a.text == "greedy" else texts, a.device)
    k = json.loads((d / "config.json").read_text())["num_experts_per_tok"]
    max_seq = length + 8
    info = dict(bench="cache_speed", commit=commit(), **machine(), model=str(d), device=a.device, every=a.every,
                hw=a.hw or "paper-a100", text=a.text, profile_decode=profile_decode,
                prompt=a.prompt, decode=a.decode, seqs=a.seqs,
                gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else None)
    for share in [float(x) for x in a.shares.split(",") if x]:
        budget = budget_for(model, share, max_seq)
        opts = dict(hw=roofline_only(a.hw, a.device), device=a.device, backend=a.backend, dtype="bfloat16",
                    vram_budget_gb=budget, max_seq_len=max_seq, numa_nodes=1)
        plans = {"uniform": ktflow.compile(model, **opts),
                 "profiled": ktflow.compile(model, routing_profile=str(path), **opts),
                 "cache": ktflow.compile(model, routing_profile=str(path), expert_cache=True, **opts),
                 "frozen": ktflow.compile(model, routing_profile=str(path), expert_cache=True, **opts)}
        cached = [n for n in plans["cache"].decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.cached]
        cache = ExpertCache(plans["cache"]) if cached else None
        if cache is not None:
            cache.follow(a.every)
        for c in plans.values():  # warm: weights ready, graphs captured
            decode_seconds(c, prompts[0], min(a.decode, 16), texts[0])
        last = [0] * 6  # the cache's counters before its last round

        def mark(name: str) -> None:
            if name == "cache" and cache is not None:
                last[:] = (cache.served, cache.picked, cache.copied_bytes, cache.host_seconds, cache.lag_tokens,
                           cache.copied)
        tok_s = timed_rounds(plans, prompts, texts, a.decode, a.rounds, mark)
        served0, picked0, bytes0, seconds0, lag0, copied0 = last
        mean = {name: statistics.mean(v) for name, v in tok_s.items()}
        gpu = {name: gpu_experts(c.decode) for name, c in plans.items()}
        hit = (cache.served - served0) / max(1, cache.picked - picked0) if cache else None
        # what the profile's curves predicted for the cached layers (training-split conversations)
        predicted = statistics.mean(prof.cache[n.attrs.refill_every][n.attrs.layer].hits[len(n.attrs.ids) - 1]
                                    for n in cached) if cached and prof.cache else None
        # (no cache: nothing measured, so None, not 0.0)
        per_token = (cache.copied_bytes - bytes0) / (a.seqs * a.decode) if cache else None
        host_ms = 1e3 * (cache.host_seconds - seconds0) / (a.seqs * a.decode) if cache else None
        lag = (cache.lag_tokens - lag0) / max(1, cache.copied - copied0) if cache else None
        static_hit = {name: statistics.mean(sum(fr[e] for e in gpu[name].get(layer, ())) / k
                                            for layer, fr in check.layers.items())
                      for name in ("uniform", "profiled", "frozen")}
        layout = ", ".join(f"L{layer} {len(ids)}" + (f"/{n.attrs.refill_every}" if n.attrs.cached else "")
                           for layer, ids in sorted(gpu["cache"].items())
                           for n in plans["cache"].decode.ir.nodes
                           if n.op == Op.ROUTED_EXPERTS and n.attrs.layer == layer and n.place.device.value == "gpu")
        print(f"share {share:.2f} (budget {budget:.3f} GB): "
              + ", ".join(f"{name} {mean[name]:.1f} +- {statistics.pstdev(v):.1f}" for name, v in tok_s.items())
              + f" tok/s; cache {mean['cache'] / mean['uniform']:.3f}x uniform, {mean['cache'] / mean['profiled']:.3f}x "
              "profiled", flush=True)
        print(f"  cache plan: GPU slots per layer (/refill interval where a cache): {layout or 'none'}; "
              + (f"last round: {100 * hit:.1f}% of decoded picks in the slots (the profile's curves predicted "
                 + (f"{100 * predicted:.1f}%" if predicted is not None else "nothing: unpriced")
                 + f"), {per_token / 1e6:.2f} MB copied a decoded token (the host {host_ms:.2f} ms a decoded "
                 f"token at step ends: refills, copies issued and taken in), a copy's expert in its slot {lag:.1f} decode tokens after its refill; {cache.refills} "
                 "refills in all" if cache else "the pass priced no cache"), flush=True)
        print("  held-out picks on the GPU experts of the static plans (every MoE layer): "
              + ", ".join(f"{name} {100 * v:.1f}%" for name, v in static_hit.items()), flush=True)
        row = dict(**info, share=share, budget_gb=round(budget, 4), refills=cache.refills if cache else 0,
                   cache_hit=round(hit, 4) if hit is not None else None,
                   cache_hit_predicted=round(predicted, 4) if predicted is not None else None,
                   copied_mb_per_token=round(per_token / 1e6, 4) if cache else None,
                   host_ms_per_token=round(host_ms, 4) if cache else None,
                   copy_lag_tokens=round(lag, 2) if cache else None,
                   **{f"{name}_hit": round(v, 4) for name, v in static_hit.items()},
                   cache_layout={layer: len(ids) for layer, ids in gpu["cache"].items()},
                   **{f"{name}_tok_s": round(mean[name], 2) for name in plans},
                   **{f"{name}_sd": round(statistics.pstdev(tok_s[name]), 2) for name in plans})
        if cache is not None:
            cache.stop()
        append_jsonl(a.out, [row])  # each share's row as it is measured: a later share's failure keeps it
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
