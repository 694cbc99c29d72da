"""Hot experts on the GPU from a routing profile, checked on text the profile never saw.

On a model with learned routing (train_small_moe.py), for each GPU share of the routed experts:

1. the profile: the routers' picks over training-split text (the standard library files the
   training used; `ktflow.runtime.routing.record_routing`, exact plans on the CPU);
2. the plan: `ktflow.compile` with that profile and the VRAM budget at which a plan without one
   puts that share of the routed experts on the GPU; the placement pass picks which experts go
   to the GPU per layer and its cause states the share of the layer's picks it expects them to
   take (`expected`: that share, from the profile). The profile is paper-a100 with its fixed per-op costs set to 0: a tiny model's experts
   are too small for a GPU launch to beat the CPU, and without those costs the pass ranks them by
   the roofline alone, as it does a model whose experts cost real bandwidth;
3. the check: the picks over the held-out split (`heldout.safetensors`, files the training never
   saw), and the share of them that lands on the plan's GPU experts, beside the same budget
   placed without a profile (uniform routing: the first experts of each layer) and beside the
   held-out text's own busiest experts in the same numbers (the best any static choice could do).

`CPU picks` is the fraction of a token's routed picks left to the CPU; their ratio (uniform over
profiled) is what a CPU-bound decode step would gain if its time followed the CPU's picks: a
proxy, not a measured speed (that needs the GPU machine and a model whose experts cost real
bandwidth). Prints a table and appends rows to benchmarks/placement_hits.jsonl.

    python benchmarks/placement_hits.py /tmp/moe-tiny --shares 0.1,0.25
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402


def profile_of(model, seqs: list[list[int]], max_seq_len: int, decode: int = 0,
               continuations: list[list[int]] | None = None, device: str | None = None):
    """The routing of `seqs` through exact plans computing in bf16 (as the measured runs do), on
    `device`: "cuda" (every expert on the GPU: a CUDA-graph decode step takes milliseconds) or
    "cpu" (the native backend); None: the GPU where there is one. Each prefilled, then `decode`
    greedy tokens or its continuation fed a decode step a token (with decode steps the profile
    holds the expert cache's curves). A benchmark run with --device cpu records on the CPU too,
    so its plans do not depend on whether the machine has a GPU."""
    import torch

    import ktflow
    from ktflow.runtime.routing import record_routing

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = dict(hw=roofline_only(), device="cuda", placement="gpu") if device == "cuda" else \
        dict(hw="cpu", device="cpu", backend="native", placement="cpu")
    c = ktflow.compile(model, dtype="bfloat16", max_seq_len=max_seq_len + decode, **where)
    return record_routing(c, seqs, decode, progress=False, continuations=continuations)


def add_text_args(ap: argparse.ArgumentParser) -> None:
    """The options naming the trained model's text: how much training text to profile."""
    ap.add_argument("--profile-seqs", type=int, default=64, help="training-split sequences to profile")
    ap.add_argument("--corpus-mb", type=float, default=3.0, help="as train_small_moe.py --corpus-mb")


def _held_ids(d: Path):
    """The checkpoint's whole held-out split (heldout.safetensors) as int64 ids, None where it has none."""
    from safetensors.torch import load_file

    path = d / "heldout.safetensors"
    return load_file(str(path))["ids"] if path.exists() else None


def held_out(d: Path, tokens: int):
    """The first `tokens` of the checkpoint's held-out split, int64."""
    held = _held_ids(d)
    if held is None:
        raise SystemExit(f"{d} has no heldout.safetensors (train_small_moe.py writes one)")
    if len(held) < tokens:
        raise SystemExit(f"not enough held-out tokens: {len(held)}, need {tokens}")
    return held[:tokens]


def held_out_or_random(d: Path, tokens: int, vocab: int):
    """The first `tokens` of the checkpoint's held-out split where it has that many, else seeded
    random ids (for timings, which hardly depend on the text), int64."""
    import torch

    held = _held_ids(d)
    if held is not None and len(held) >= tokens:
        return held[:tokens]
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))


def training_profile(model, d: Path, a: argparse.Namespace, length: int, decode: int = 0, forced: bool = False,
                     device: str | None = None):
    """The routing of `a.profile_seqs` sequences of `length` tokens spread over the training
    split (the standard library text train_small_moe.py trained on, `a.corpus_mb` of it), each
    followed by `decode` greedy tokens, or (`forced`) the text's next `decode` tokens fed one
    decode step a token; recorded on `device` (`profile_of`)."""
    from tokenizers import Tokenizer
    from train_small_moe import corpus, token_stream

    train_ids = token_stream(Tokenizer.from_file(str(d / "tokenizer.json")), corpus(a.corpus_mb)[0])
    if len(train_ids) < a.profile_seqs * (length + decode):
        raise SystemExit(f"not enough training tokens: {len(train_ids)}, need {a.profile_seqs * (length + decode)}")
    step = len(train_ids) // a.profile_seqs
    seqs = [train_ids[i * step:i * step + length + decode].tolist() for i in range(a.profile_seqs)]
    if forced:
        return profile_of(model, [s[:length] for s in seqs], length + 8, decode, [s[length:] for s in seqs], device)
    return profile_of(model, [s[:length] for s in seqs], length + 8, decode, device=device)


def gpu_experts(plan) -> dict[int, tuple[int, ...]]:
    """Per MoE layer: the experts the plan puts on the GPU."""
    from ktflow.ir.ops import Op

    return {n.attrs.layer: tuple(n.attrs.ids) for n in plan.ir.nodes
            if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"}


def roofline_only(hw=None, device: str | None = None):
    """A hardware profile's rates without its fixed per-op costs (module doc): paper-a100's, or
    those of `hw` (a profile or its JSON path, e.g. `ktflow hw probe`'s); with this GPU's memory
    where there is one, unless the plans run on the CPU (`device="cpu"`: they then keep the
    profile's memory, so a --device cpu run compiles the same plans on any machine)."""
    from ktflow.costmodel.hw import PRESETS, Overheads, resolve_hw, with_this_gpus_memory

    base = PRESETS["paper-a100"] if hw is None else resolve_hw(hw)
    if device != "cpu":
        base = with_this_gpus_memory(base)
    return base.model_copy(update={"overheads": Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0,
                                                          cpu_sync_us=0)})


def budget_for(model, share: float, max_seq_len: int) -> float:
    """GB: the smallest VRAM budget (bisected) at which the bf16 plan without a profile puts at
    least `share` of the routed experts on the GPU: the same budget then goes to the other (bf16)
    plans."""
    import ktflow
    from ktflow.ir.ops import Op

    def on_gpu(gb: float) -> float:
        nodes = ktflow.compile(model, hw=roofline_only(), dtype="bfloat16", vram_budget_gb=gb,
                               max_seq_len=max_seq_len, numa_nodes=1).decode.ir.nodes
        routed = [n for n in nodes if n.op == Op.ROUTED_EXPERTS]
        total = sum({n.attrs.layer: n.attrs.experts for n in routed}.values())  # a split layer's parts once
        return sum(len(n.attrs.ids) for n in routed if n.place.device.value == "gpu") / total

    lo, hi = 0.0, 1.0
    while on_gpu(hi) < share:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if on_gpu(mid) < share else (lo, mid)
    return hi


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (with heldout.safetensors)")
    ap.add_argument("--shares", default="0.1,0.25", help="GPU shares of the routed experts (comma list)")
    ap.add_argument("--seqs", type=int, default=64, help="held-out sequences to check on")
    ap.add_argument("--len", type=int, default=128, help="tokens per sequence")
    add_text_args(ap)
    ap.add_argument("--out", default=str(HERE / "placement_hits.jsonl"))
    a = ap.parse_args()
    import ktflow

    d = Path(a.model)
    model = ktflow.load(d)
    cfg = json.loads((d / "config.json").read_text())
    k, experts = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    held = held_out(d, a.seqs * a.len)
    prof = training_profile(model, d, a, a.len)
    check = profile_of(model, held.view(a.seqs, a.len).tolist(), a.len + 8)
    tmp = tempfile.TemporaryDirectory()
    path = Path(tmp.name) / "routing.json"  # what `ktflow profile` would write
    path.write_text(prof.model_dump_json() + "\n")
    rows, info = [], dict(commit=commit(), **machine())
    print(f"{'share':>5s} {'layer':>5s} {'GPU experts':>11s} {'expected':>8s} {'profiled':>8s} {'uniform':>8s} "
          f"{'best':>6s}   (share of the held-out picks on the GPU)")
    for share in [float(x) for x in a.shares.split(",") if x]:
        budget = budget_for(model, share, a.len + 8)
        opts = dict(hw=roofline_only(), dtype="bfloat16", vram_budget_gb=budget, max_seq_len=a.len + 8, numa_nodes=1)
        aware = gpu_experts(ktflow.compile(model, routing_profile=str(path), **opts).decode)
        uniform = gpu_experts(ktflow.compile(model, **opts).decode)
        got = {"profiled": [], "uniform": [], "best": []}
        for layer, fr in sorted(check.layers.items()):
            ids, flat = aware.get(layer, ()), uniform.get(layer, ())
            best = sorted(range(experts), key=lambda e: -fr[e])[:len(ids)]
            on = {name: sum(fr[e] for e in s) / k for name, s in (("profiled", ids), ("uniform", flat), ("best", best))}
            trained = prof.layers[layer]
            expected = sum(trained[e] for e in ids) / sum(trained) if ids else None
            for name in got:
                got[name].append(on[name])
            print(f"{share:5.2f} {layer:5d} {len(ids):5d} / {len(flat):<3d} "
                  f"{'-' if expected is None else f'{expected:.0%}':>8s} {on['profiled']:8.1%} {on['uniform']:8.1%} "
                  f"{on['best']:6.1%}")
            rows.append(dict(bench="placement_hits", **info, model=str(d), share=share, layer=layer,
                             gpu_experts=len(ids), gpu_experts_uniform=len(flat), expected=expected,
                             profiled=round(on["profiled"], 4), uniform=round(on["uniform"], 4),
                             best=round(on["best"], 4), profile_tokens=prof.tokens, check_tokens=check.tokens))
        mean = {name: statistics.mean(v) for name, v in got.items()}
        print(f"{share:5.2f}  mean: on the GPU profiled {mean['profiled']:.1%}, uniform {mean['uniform']:.1%}, best "
              f"{mean['best']:.1%}; CPU picks {1 - mean['profiled']:.1%} vs {1 - mean['uniform']:.1%} "
              f"(ratio {(1 - mean['uniform']) / (1 - mean['profiled']):.3f})")
    append_jsonl(a.out, rows)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
