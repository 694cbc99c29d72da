"""How much longer a decode step takes beside copies to the GPU: a bare DMA of B MB from page-locked
host memory, and the expert cache's own refills of N experts (their DMA, the unpacking on the GPU
and the host's work at the step end together). What a refill costs the decode steps is what the
placement pass prices each copy at (`passes/place.py`, `residency_choices`); the bare DMA of the same
bytes says how much of that the link itself is.

One plan decodes held-out conversations one step a token: the model compiled with
`expert_cache=True` and no routing profile at the VRAM budget that puts `--share` of its routed
experts on the GPU (cache_speed's `uniform` placement; each split layer a cache), never refilled
but by this benchmark. After every decode step, where the cache issues its refills, one variant:

- `dma B` (`--mb`): a stream of its own copies B MB from a page-locked host buffer to the GPU,
  in pieces of `--piece-mb` (0: one copy); `dma 0` is the baseline;
- `refill N` (`--refill`): `ExpertCache.refill` swaps N of the next cached layer's resident
  experts (in turn; a layer whose last copies are under way waits for a later step, as `follow`
  does) for as many random others, without waiting; finished copies are taken in at each step end.

The variants take turns conversation by conversation, the first moving on by one each
conversation and round, so a machine's drift falls on all alike. Reported per variant: ms a
decoded token, the host's ms a token at the step end (issuing the copies; for refills also
emptying and naming rows: the decode loop waits for that part whatever the link does), MB copied
a token, the ms a token it adds over the baseline per MB copied, one copy's ms per MB with the GPU
otherwise idle (the link's own time), and their ratio, the stall: 1 means a step waits out the
whole copy, 0 that the copy hides beside it entirely. A copy issued while the one before is still
under way queues behind it, so once B MB take longer than a step, every step runs beside a copy.
Measures on a CUDA device (`--device cpu` runs the same steps as a check of the benchmark itself).

`--profile K` then says where the host's time at the step ends goes: one more conversation per
variant (not timed) with its first K decode steps' step ends run under torch's profiler (host ops
and, on CUDA, the runtime calls: a `cudaStreamSynchronize` that waits, a pageable copy), printed
per step end, the ops taking the most of the host's time first, and written as `profile` rows.
On the GPU machine:

    python benchmarks/copy_stall.py /tmp/moe-small-x --share 0.25 --mb 0,8,32 --refill 1,2,4 --profile 16
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cache_speed import decode_seconds  # noqa: E402
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import budget_for, held_out_or_random, roofline_only  # noqa: E402

MB = 1 << 20  # (a MiB: "MB" in this benchmark's options and rows)


class SideCopies:
    """After each decode step of a plan, the current variant's copies (`kind`, `amount`): a bare
    DMA of `amount` MB, or a refill of `amount` experts of the next cached layer."""

    def __init__(self, most_mb: float, piece_mb: float, cache, device: str):
        cuda = device == "cuda"
        self.stream = torch.cuda.Stream() if cuda else None
        n = max(int(most_mb * MB), 1)
        self.src = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        self.src.random_(0, 255)
        self.dst = torch.empty(n, dtype=torch.uint8, device=device)
        self.piece_mb, self.cache = piece_mb, cache
        self.kind, self.amount = "dma", 0.0
        self.turn, self.rng = 0, random.Random(0)
        self.host_seconds = 0.0  # the host's time at the step ends (the decode loop waits for it)

    def after_run(self, executor, tokens: int) -> None:
        if executor.plan.phase != "decode" or not self.amount:
            return
        t0 = time.perf_counter()
        if self.kind == "dma":
            self.dma(self.amount)
        else:
            self.refill(int(self.amount))
        self.host_seconds += time.perf_counter() - t0

    def dma(self, mb: float) -> None:
        n = int(mb * MB)
        piece = int(self.piece_mb * MB) or n
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for at in range(0, n, piece):
                self.dst[at:min(at + piece, n)].copy_(self.src[at:min(at + piece, n)], non_blocking=True)

    def refill(self, n: int) -> None:
        """Take in the finished copies; swap `n` resident experts of the next cached layer whose
        copies have landed for random others."""
        cache = self.cache
        cache.poll()
        busy = {c.layer for c, *_ in cache.pending}
        layers = sorted(cache.layers)
        for _ in range(len(layers)):
            layer = layers[self.turn % len(layers)]
            self.turn += 1
            if layer in busy:
                continue
            c = cache.layers[layer]
            cache.refill(layer, swapped(c.resident, c.experts, n, self.rng), wait=False)
            return

    def synchronize(self) -> None:
        if self.stream is not None:
            torch.cuda.synchronize()

    def link_ms_per_mb(self, mb: float, reps: int = 5) -> float:
        """One copy's time per MB (in the variant's pieces; at most the buffer's MB), the GPU
        otherwise idle (best of `reps`)."""
        mb = min(mb, self.src.numel() / MB)
        best = float("inf")
        for _ in range(reps):
            self.synchronize()
            t0 = time.perf_counter()
            self.dma(mb)
            self.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 1e3 * best / mb


def profile_step_ends(c, side: SideCopies, conv, decode: int, steps: int, top: int = 12) -> list[tuple[str, float, float]]:
    """The current variant's first `steps` decode step ends of conversation `conv`, each under
    torch's profiler: per op (host ops; on CUDA also the runtime's calls), its calls and host
    microseconds (self time) a step end, the `top` largest; first the step end's whole time
    ("step end") and what no op took ("outside the ops": Python, and the profiler's own cost)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if side.stream is not None else [])
    calls: dict[str, float] = {}
    micro: dict[str, float] = {}
    seen = [0]
    ex = c.executor(c.decode)
    plain = side.after_run

    def traced(executor, tokens):
        if executor.plan.phase != "decode" or seen[0] >= steps:
            return plain(executor, tokens)
        seen[0] += 1
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            plain(executor, tokens)
            took = time.perf_counter() - t0
        micro["step end"] = micro.get("step end", 0.0) + 1e6 * took
        calls["step end"] = calls.get("step end", 0) + 1
        for ev in prof.key_averages():
            micro[ev.key] = micro.get(ev.key, 0.0) + ev.self_cpu_time_total
            calls[ev.key] = calls.get(ev.key, 0) + ev.count

    ex.after_run[ex.after_run.index(plain)] = traced
    try:
        decode_seconds(c, conv[0], min(decode, steps + 1), conv[1])
        side.synchronize()
        side.cache.poll(wait=True)
    finally:
        ex.after_run[ex.after_run.index(traced)] = plain
    n = max(1, seen[0])
    if "step end" in micro:  # the Python between the ops (the profiler's own cost included)
        micro["outside the ops"] = micro["step end"] - sum(us for k, us in micro.items() if k != "step end")
        calls["outside the ops"] = n
    ranked = sorted((k for k in micro if k not in ("step end", "outside the ops")), key=lambda k: -micro[k])[:top]
    return [(k, calls[k] / n, micro[k] / n) for k in ["step end", "outside the ops", *ranked] if k in micro]


def swapped(resident: list[int], experts: int, n: int, rng: random.Random) -> list[int]:
    """`resident` (a cached layer's expert a row, -1: empty) with `n` of its experts, and every
    empty row, given random experts it does not hold."""
    outside = [e for e in range(experts) if e not in resident]
    held = [s for s, e in enumerate(resident) if e >= 0]
    empty = {s for s, e in enumerate(resident) if e < 0}
    going = empty | set(rng.sample(held, max(0, min(n, len(held), len(outside) - len(empty)))))
    coming = iter(rng.sample(outside, len(going)))
    return [next(coming) if s in going else e for s, e in enumerate(resident)]


def conversations(d: Path, seqs: int, prompt: int, decode: int, vocab: int):
    """`seqs` (prompt, text) pairs from the checkpoint's held-out split, or seeded random ids where
    it has too few (the step's time hardly depends on the text)."""
    length = prompt + decode
    ids = held_out_or_random(d, seqs * length, vocab).tolist()
    return [(ids[i * length:i * length + prompt], ids[i * length + prompt:(i + 1) * length]) for i in range(seqs)]


def amounts(text: str, name: str, whole: bool = False) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = [-1.0]
    if any(x < 0 or (whole and x != int(x)) for x in out):
        raise SystemExit(f"copy_stall: {name} takes a comma list of {'whole numbers' if whole else 'MB'} >= 0, "
                         f"got {text!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir (cache_speed's scaled model, or any ktflow.load reads)")
    ap.add_argument("--share", type=float, default=0.25, help="GPU share of the routed experts (the VRAM budget)")
    ap.add_argument("--mb", default="0,8,32", help="bare DMA variants: MB copied after each decode step (comma "
                    "list; 0, the baseline, always runs)")
    ap.add_argument("--piece-mb", type=float, default=0.0, help="MB a bare copy (0: the step's MB as one copy)")
    ap.add_argument("--refill", default="", help="refill variants: experts the cache swaps after each decode step "
                    "(comma list; default none)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="then profile the host's work at K step ends of each variant but the baseline (module "
                    "doc; default 0: none)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (the measurement); cpu runs the same steps with the copies as host memory copies, "
                    "a check of the benchmark itself whose numbers mean nothing")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=str(HERE / "copy_stall.jsonl"))
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("copy_stall: needs a CUDA device (it measures copies to the GPU; --device cpu only checks the "
              "benchmark)", file=sys.stderr)
        return 2
    if a.piece_mb < 0:
        print(f"copy_stall: --piece-mb takes MB >= 0, got {a.piece_mb}", file=sys.stderr)
        return 2
    variants = [("dma", mb) for mb in sorted(set(amounts(a.mb, "--mb")) | {0.0})]
    variants += [("refill", n) for n in amounts(a.refill, "--refill", whole=True) if n > 0]
    import json

    import ktflow
    from ktflow.runtime.expert_cache import ExpertCache

    d = Path(a.model)
    model = ktflow.load(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    convs = conversations(d, a.seqs, a.prompt, a.decode, vocab)
    max_seq = a.prompt + a.decode + 8
    budget = budget_for(model, a.share, max_seq)
    c = ktflow.compile(model, hw=roofline_only(device=a.device), device=a.device, backend=a.backend, dtype="bfloat16",
                       vram_budget_gb=budget, max_seq_len=max_seq, numa_nodes=1, expert_cache=True)
    side = SideCopies(max(64.0 if a.device == "cuda" else 1.0, *(mb for kind, mb in variants if kind == "dma")),
                      a.piece_mb, ExpertCache(c), a.device)
    c.executor(c.decode).after_run.append(side.after_run)
    decode_seconds(c, convs[0][0], min(a.decode, 16), convs[0][1])  # warm: weights ready, graph captured
    took = {v: [0.0] * a.rounds for v in variants}
    host = dict.fromkeys(variants, 0.0)
    copied = dict.fromkeys(variants, 0)
    for r in range(a.rounds):
        for i, (prompt, text) in enumerate(convs):
            k = (r + i) % len(variants)
            for v in variants[k:] + variants[:k]:
                side.kind, side.amount, side.host_seconds = *v, 0.0
                before = side.cache.copied_bytes
                took[v][r] += decode_seconds(c, prompt, a.decode, text)
                side.synchronize()  # the next variant starts without this one's copies
                side.cache.poll(wait=True)
                host[v] += side.host_seconds
                copied[v] += side.cache.copied_bytes - before
    tokens = a.seqs * a.decode
    ms = {v: [1e3 * t / tokens for t in ts] for v, ts in took.items()}
    base = statistics.mean(ms[("dma", 0.0)])
    info = dict(bench="copy_stall", commit=commit(), **machine(), device=a.device,
                gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else None, model=str(d),
                share=a.share, budget_gb=round(budget, 4), piece_mb=a.piece_mb, seqs=a.seqs, decode=a.decode,
                rounds=a.rounds)
    rows = []
    print(f"{'variant':>10} {'ms a token':>14} {'host':>6} {'MB a token':>10} {'added ms/MB':>12} {'link ms/MB':>11} "
          f"{'stall':>6}")
    for v in variants:
        kind, amount = v
        mean = statistics.mean(ms[v])
        mb = amount if kind == "dma" else copied[v] / MB / (a.rounds * tokens)
        added = (mean - base) / mb if mb else 0.0
        side.piece_mb = a.piece_mb if kind == "dma" else 0.0  # a refill's bytes against one copy of them
        link = side.link_ms_per_mb(mb) if mb else 0.0
        ratio = added / link if mb else 0.0
        host_ms = 1e3 * host[v] / (a.rounds * tokens)
        print(f"{kind:>6} {amount:<3g} {mean:>8.3f} +- {statistics.pstdev(ms[v]):.3f} {host_ms:>6.3f} {mb:>10.2f} "
              f"{added:>12.4f} {link:>11.4f} {ratio:>6.2f}")
        rows.append(dict(**info, kind=kind, mb=round(mb, 4), experts=int(amount) if kind == "refill" else None,
                         ms_per_token=round(mean, 4), sd=round(statistics.pstdev(ms[v]), 4),
                         host_ms_per_token=float(f"{host_ms:.4g}"), added_ms_per_mb=round(added, 5),
                         link_ms_per_mb=round(link, 5), link_gbps=round(MB / 1e6 / link, 1) if mb else None,
                         stall=round(ratio, 3)))
    for v in variants if a.profile > 0 else ():
        if v == ("dma", 0.0):
            continue
        side.kind, side.amount = v
        side.piece_mb = a.piece_mb if v[0] == "dma" else 0.0
        ops = profile_step_ends(c, side, convs[0], a.decode, a.profile)
        print(f"{v[0]} {v[1]:g}: the host's time at a step end, by op (self time; calls a step end)")
        for name, n, us in ops:
            print(f"  {name[:48]:<48} {us:>9.1f} us {n:>6.1f}")
        rows.append(dict(**info, kind="profile", variant=v[0], mb=v[1] if v[0] == "dma" else None,
                         experts=int(v[1]) if v[0] == "refill" else None, steps=a.profile,
                         ops=[dict(op=name, calls=round(n, 2), us=round(us, 1)) for name, n, us in ops]))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
