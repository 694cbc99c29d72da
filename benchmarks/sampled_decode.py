"""Sampled against greedy decoding on the GPU machine: what selecting tokens inside the captured
decode step costs, and what it saves against sampling on the host.

Writes (or reuses) a random-weight checkpoint of a real model's shape (benchmarks/e2e.py's
writer), compiles it with every routed expert in CPU memory (e2e's placement), and decodes
`--decode` tokens after a 32-token prompt in these variants, in rounds (each round every variant
once, so the machine's drift falls on all alike):

  greedy/K      greedy, K steps a graph launch (decode_tokens(..., K); K = 1 and the plan's default)
  sampled/K     temperature 0.7, top-p 0.95 (a chat client's settings), selected on the GPU inside
                the captured step, K steps a launch
  sampled+pen/K the same with presence and frequency penalties and a repetition penalty
  host/1        the way before: each step returns the last position's logits and the host samples
                (a float32 softmax, a sort and torch.multinomial in one thread, as
                runtime/generate.sample did), one step a launch

Also the selection alone: `Sampler.select` captured in a CUDA graph and replayed, at the model's
vocabulary, batch 1 and 8 (microseconds a replay).

    python benchmarks/sampled_decode.py --model qwen3 --layers 12

Rows go to benchmarks/sampled_decode.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from common import append_jsonl, commit, machine  # noqa: E402

CHAT = dict(temperature=0.7, top_p=0.95)
PENALTIES = dict(CHAT, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)


def host_sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """The host sampler decoding used before selection moved into the step (kept here as the
    baseline): softmax, sort, the nucleus, torch.multinomial, on the CPU."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1)


def decode(compiled, vocab: int, variant: str, new: int, seed: int) -> float:
    """Tokens/s of `new` decode steps of `variant` after a 32-token prompt."""
    import ktflow
    from ktflow.runtime.execute import decode_tokens, start_sampling

    kind, k = variant.split("/")
    k = int(k)
    params = {"greedy": {}, "sampled": CHAT, "sampled+pen": PENALTIES, "host": {}}[kind]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (1, 32), generator=g)
    logits, state = ktflow.execute(compiled, prompt, logits="last")
    start_sampling(compiled, state, ktflow.SamplingParams.make(seed=seed, **params), prompt)
    nxt = state.sampler.select(logits[:, -1].to(state.sampler.device)).cpu()[:, None]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = new // k
    for _ in range(steps):
        if kind == "host":
            out, state = ktflow.execute(compiled, nxt, state, logits="last")
            nxt = host_sample(out[:, -1], CHAT["temperature"], CHAT["top_p"], g)[:, None]
        else:
            nxt = decode_tokens(compiled, nxt, state, k, sampled=kind != "greedy")[:, -1:]
    torch.cuda.synchronize()
    return steps * k / (time.perf_counter() - t0)


def selection_us(vocab: int, rows: int, reps: int = 200) -> float:
    """Microseconds a replay of `Sampler.select` captured alone in a CUDA graph takes."""
    from ktflow.backends.sampling import Sampler, SamplingParams

    s = Sampler(rows, vocab, "cuda")
    for r in range(rows):
        s.set_row(r, SamplingParams(seed=r, presence_penalty=0.5, **CHAT))
    logits = torch.randn(rows, vocab, device="cuda")
    out = torch.zeros(rows, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out.copy_(s.select(logits, captured=True))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(s.select(logits, captured=True))
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> int:
    from e2e import MODELS, budget_without_experts, compile_cpu_experts, write_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="greedy/1,greedy/8,sampled/1,sampled/8,sampled+pen/8,host/1")
    ap.add_argument("--out", default=str(HERE / "sampled_decode.jsonl"))
    a = ap.parse_args()
    import ktflow

    cfg = dict(MODELS[a.model])
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    ckpt = Path(a.dir or f"/tmp/ktflow-e2e/{a.model}-{cfg['num_hidden_layers']}")
    write_checkpoint(cfg, ckpt)
    model = ktflow.load(ckpt)
    from ktflow.backends.native import binding as native
    from ktflow.tools.probe import probe

    native.pool(spare=2)  # the pool the cuda_graph backend makes: probe with it
    base = dict(hw=probe(quick=True), max_seq_len=512, device="cuda")
    wide = ktflow.compile(model, vram_budget_gb=1000, allow_oversize=True, **base)
    compiled = compile_cpu_experts(model, dict(base, vram_budget_gb=budget_without_experts(wide.decode)))
    compiled.prepare()
    vocab = cfg["vocab_size"]
    variants = a.variants.split(",")
    for v in variants:  # warm: capture every graph
        decode(compiled, vocab, v, 16, 0)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(a.rounds):
        for v in variants:
            rates[v].append(decode(compiled, vocab, v, a.decode, r + 1))
            print(f"round {r} {v:14s} {rates[v][-1]:7.1f} tok/s", flush=True)
    base = {k: statistics.mean(rates[k]) for k in ("greedy/1", "greedy/8") if k in rates}
    rows = []
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model,
                layers=cfg["num_hidden_layers"], vocab=vocab, decode=a.decode, rounds=a.rounds)
    print(f"\n{'variant':14s} {'tok/s':>14s} {'/ greedy/1':>11s} {'/ greedy/8':>11s}")
    for v in variants:
        m = statistics.mean(rates[v])
        sd = statistics.stdev(rates[v]) if len(rates[v]) > 1 else 0.0
        row = dict(info, variant=v, tok_s=round(m, 2), sd=round(sd, 2), rounds_tok_s=[round(x, 2) for x in rates[v]],
                   vs_greedy1=round(m / base["greedy/1"], 3) if "greedy/1" in base else None,
                   vs_greedy8=round(m / base["greedy/8"], 3) if "greedy/8" in base else None)
        rows.append(row)
        print(f"{v:14s} {m:8.1f} +- {sd:4.1f} {row['vs_greedy1'] or 0:11.3f} {row['vs_greedy8'] or 0:11.3f}")
    for b in (1, 8):
        us = selection_us(vocab, b)
        rows.append(dict(info, variant=f"select-only/b{b}", us_per_replay=round(us, 1)))
        print(f"selection alone, batch {b}: {us:.1f} us a replay")
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
