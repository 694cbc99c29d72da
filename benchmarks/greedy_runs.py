"""Greedy decoding one step per graph launch against K steps per launch, A/B in one process (GPU machine).

One compiled model (every routed expert on the CPU, as `e2e.py` places them), one backend; rounds
alternate the two ways (1, K, K, 1, 1, K, ...) so that a machine's drift falls on both. Each round:
a 32-token prompt, then 128 greedy steps, either `execute(..., logits="argmax")` per token or
`decode_greedy(..., steps=K)` per K tokens. From the native queue's task records (one clock for
the whole run):

  step boundary   the last CPU task of a step finishing to the first task of the next starting:
                  the last layer's tail, lm_head, argmax, the next step's embedding, first layer
                  and router, and, one step per launch, the host's turnaround (wait, return,
                  next execute, graph launch)
  between tasks   the same between two layers of one step (the per-layer GPU work and hand-off)
  CPU task        one task's run (the experts of one layer)

`--kernels` also prints the GPU kernels around one step boundary of a K-step run (torch.profiler:
gap before each, its duration, its stream), which is where a GPU-side stall would show.

    python benchmarks/greedy_runs.py --model qwen3 --layers 12 --expert-format int8 --rounds 6

Needs the checkpoint `e2e.py --prepare-only` writes. Rows go to benchmarks/greedy_runs.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402

TOKENS = 128


def compile_model(d: Path, fmt: str, defer: int | None):
    """Every routed expert on the CPU (the dense weights and KV cache on the GPU), as e2e.py."""
    import ktflow
    from ktflow.backends.native import binding as native
    from ktflow.tools.probe import probe
    from e2e import budget_without_experts, compile_cpu_experts

    model = ktflow.load(d)
    native.pool(spare=2)  # the pool the cuda_graph backend makes (the first caller sizes it)
    base = dict(hw=probe(quick=True), max_seq_len=512, expert_format=fmt)
    wide = ktflow.compile(model, device="cuda", vram_budget_gb=1000, allow_oversize=True, **base).decode
    opts = dict(base, device="cuda", backend="cuda_graph", defer=defer, vram_budget_gb=budget_without_experts(wide))
    c = compile_cpu_experts(model, opts)
    c.prepare()
    return c, model.config.vocab_size


def one_round(c, vocab: int, k: int, seed: int) -> dict:
    """128 greedy steps, k per call; tok/s and the medians of the task records' gaps."""
    import ktflow
    from ktflow.backends.native import binding as native
    from ktflow.runtime.execute import decode_greedy

    g = torch.Generator().manual_seed(seed)
    nxt, state = ktflow.execute(c, torch.randint(0, vocab, (1, 32), generator=g), logits="argmax")
    native.queue().set_recording(True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = []
    for _ in range(TOKENS // k):
        if k == 1:
            nxt, state = ktflow.execute(c, nxt, state, logits="argmax")
            ids.append(nxt)
        else:
            out = decode_greedy(c, nxt, state, k)
            nxt = out[:, -1:]
            ids.append(out)
    wall = time.perf_counter() - t0
    recs = sorted(native.queue().take_records(), key=lambda r: r[2])  # (batch, submitted, started, finished)
    native.queue().set_recording(False)
    first = recs[0][0]  # the ring's first batch: a step starts where it runs
    starts = set(j for j, r in enumerate(recs) if r[0] == first)
    gap = lambda j: (recs[j][2] - recs[j - 1][3]) / 1e3  # noqa: E731
    return dict(tok_s=TOKENS / wall, ids=torch.cat(ids, 1),
                boundary_us=statistics.median(gap(j) for j in sorted(starts) if j),
                between_us=statistics.median(gap(j) for j in range(1, len(recs)) if j not in starts),
                task_us=statistics.median((r[3] - r[2]) / 1e3 for r in recs))


def kernels_at_boundary(c, vocab: int, k: int) -> None:
    """The GPU kernels around a step boundary of a K-step run (the middle lm_head of 3 runs)."""
    import ktflow
    from torch.profiler import ProfilerActivity, profile

    from ktflow.runtime.execute import decode_greedy

    nxt, state = ktflow.execute(c, torch.randint(0, vocab, (1, 32)), logits="argmax")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            nxt = decode_greedy(c, nxt, state, k)[:, -1:]
    torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    heads = [i for i, e in enumerate(ev) if e.time_range.elapsed_us() > 150]
    mid = heads[len(heads) // 2]
    print(f"kernels around a step boundary (K={k}): gap before (us), duration (us), stream, kernel")
    for i in range(max(1, mid - 10), min(len(ev), mid + 14)):
        e = ev[i]
        print(f"  {e.time_range.start - ev[i - 1].time_range.end:8.1f} {e.time_range.elapsed_us():7.1f} "
              f"s{getattr(e, 'device_resource_id', '?')} {e.name[:64]}")


def kernels_of_a_layer(c, vocab: int, k: int) -> None:
    """The GPU kernels of one layer in the middle of a K-step run, from one router kernel to the
    next: what the GPU does between two CPU tasks (the largest gap is the CPU task itself)."""
    import ktflow
    from torch.profiler import ProfilerActivity, profile

    from ktflow.runtime.execute import decode_greedy

    nxt, state = ktflow.execute(c, torch.randint(0, vocab, (1, 32)), logits="argmax")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        nxt = decode_greedy(c, nxt, state, k)[:, -1:]
    torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    routers = [i for i, e in enumerate(ev) if e.name == "route"]
    if len(routers) < 3:
        print(f"kernels of a layer: {len(routers)} router kernels in the run, too few to cut a layer out")
        return
    lo, hi = routers[len(routers) // 2], routers[len(routers) // 2 + 1]
    busy = sum(ev[i].time_range.elapsed_us() for i in range(lo + 1, hi + 1))
    span = ev[hi].time_range.end - ev[lo].time_range.end
    print(f"kernels of one layer (router to router, K={k}): {hi - lo} kernels, {busy:.1f} us busy in a "
          f"{span:.1f} us span; gap before (us), duration (us), stream, kernel")
    for i in range(lo, hi + 1):
        e = ev[i]
        print(f"  {e.time_range.start - ev[i - 1].time_range.end:8.1f} {e.time_range.elapsed_us():7.1f} "
              f"s{getattr(e, 'device_resource_id', '?')} {e.name[:90]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default=None, help="the checkpoint (default: e2e.py's /tmp/ktflow-e2e/<model>-<layers>l)")
    ap.add_argument("--expert-format", default="bf16", choices=["bf16", "int8", "int4"])
    ap.add_argument("--defer", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8, help="K: greedy steps per launch against one")
    ap.add_argument("--rounds", type=int, default=6, help="A/B rounds (0: none, only the kernel listings)")
    ap.add_argument("--kernels", action="store_true", help="print the GPU kernels around one step boundary")
    ap.add_argument("--layer-kernels", action="store_true", help="print the GPU kernels of one layer (router to router)")
    ap.add_argument("--out", default=str(HERE / "greedy_runs.jsonl"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("greedy_runs.py needs a CUDA GPU", file=sys.stderr)
        return 2
    d = Path(a.dir or f"/tmp/ktflow-e2e/{a.model}" + (f"-{a.layers}l" if a.layers else ""))
    if not (d / "config.json").exists():
        print(f"no checkpoint at {d}: run benchmarks/e2e.py --model {a.model} --layers {a.layers} --prepare-only",
              file=sys.stderr)
        return 2
    c, vocab = compile_model(d, a.expert_format, a.defer)
    K = a.steps
    one_round(c, vocab, 1, 99), one_round(c, vocab, K, 99)  # capture both graphs, warm
    if a.rounds:
        ab_rounds(a, c, vocab)
    if a.kernels:
        kernels_at_boundary(c, vocab, K)
    if a.layer_kernels:
        kernels_of_a_layer(c, vocab, K)
    return 0


def ab_rounds(a, c, vocab: int) -> None:
    """The A/B: rounds alternating one step a launch and K, their rows printed and appended."""
    K = a.steps
    rounds: dict[int, list[dict]] = {1: [], K: []}
    for r in range(a.rounds):
        for k in (1, K) if r % 2 == 0 else (K, 1):
            rounds[k].append(one_round(c, vocab, k, r))
    rows = []
    for k in (1, K):
        rs = rounds[k]
        tps = [x["tok_s"] for x in rs]
        row = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model, layers=a.layers,
                   expert_format=a.expert_format, defer=a.defer, steps_per_launch=k, rounds=len(rs),
                   tok_s=round(statistics.mean(tps), 2), tok_s_sd=round(statistics.stdev(tps), 2) if len(tps) > 1 else 0.0,
                   **{f: round(statistics.median(x[f] for x in rs), 1) for f in ("boundary_us", "between_us", "task_us")})
        rows.append(row)
        print(f"{a.expert_format} defer={a.defer} {k} step(s) a launch: {row['tok_s']:.2f} +- {row['tok_s_sd']:.2f} tok/s; "
              f"step boundary {row['boundary_us']:.0f} us, between tasks {row['between_us']:.0f} us, "
              f"CPU task {row['task_us']:.0f} us (medians)", flush=True)
    same = [torch.equal(rounds[1][r]["ids"], rounds[K][r]["ids"]) for r in range(a.rounds)]
    print(f"rounds whose greedy ids match between the two ways: {sum(same)} of {a.rounds} (a random-weight "
          "model's near ties can flip; equality is tested on the tiny models, tests/test_cuda_graph.py)")
    append_jsonl(a.out, rows)


if __name__ == "__main__":
    sys.exit(main())
