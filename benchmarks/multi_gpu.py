"""Decode on one GPU against several (issue 44): the same model, the same VRAM limit on each GPU,
every routed expert that no GPU holds driven by rank 0's CPU.

    python benchmarks/multi_gpu.py --model qwen3 --layers 12 --fp8 --vram-gb 8 --gpus 1,2
    python benchmarks/multi_gpu.py --model qwen3 --layers 0 --fp8 --vram-gb 24 --gpus 1,2 --prefill 8192,32768

For each GPU count: the plans compiled for it (one process a rank, NCCL between them; one GPU
runs in this process), a 32-token random prompt, then greedy and sampled (0.7 / 0.95, seeded)
decode rounds through the public API; with --prefill, a random prompt of each length prefilled
from a fresh state (`--rounds` times after a warm-up), its prefill tok/s. Every rank's allocator is capped at --vram-gb
(`torch.cuda.set_per_process_memory_fraction`), so a plan that does not fit fails loudly. Prints a
table (tok/s, the experts each rank's GPU holds and the CPU drives, the predicted step) and
appends one row per GPU count to --out. Random weights: routing is near uniform, so the GPU share
of the picks is the share of experts held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import MODELS, ready_checkpoint  # noqa: E402

PROMPT = 32


def _measure(rank: int, out: str, ckpt: str, options: dict, vram_gb: float, new: int, rounds: int,
             prefill: tuple[int, ...] = ()) -> None:
    """One rank (or the only process): cap its allocator, compile, decode `rounds` times greedy
    and sampled, prefill each length of `prefill`; rank 0 writes what it measured to `out`."""
    import ktflow
    from ktflow.ir.ops import Op
    from ktflow.runtime.generate import generate_with_stats

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gb * 1e9 / total))
    gpus = options.get("gpus", 1)
    c = ktflow.compile(ktflow.load(ckpt), rank=rank, **options)
    if gpus > 1:
        from ktflow.runtime.ranks import all_ready, check_plans_agree

        check_plans_agree(c.plans.plans)
        c.prepare()
        all_ready()
    vocab = c.model.config.vocab_size
    rates: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for r in range(rounds + 1):  # the first round warms up (captures the graphs)
        for kind, temp, top_p in (("greedy", 0.0, 1.0), ("sampled", 0.7, 0.95)):
            ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(r))
            _, st = generate_with_stats(c, ids, new, temperature=temp, top_p=top_p, seed=r)
            if r:
                rates[kind].append(st.decode_tokens_per_s)
    prefill_rates: dict[str, list[float]] = {}
    for n in prefill:
        for r in range(rounds + 1):  # the first round warms up
            ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(100 + r))
            _, st = generate_with_stats(c, ids, 1, seed=r)
            if r:
                prefill_rates.setdefault(str(n), []).append(st.prefill_tokens_per_s)
    d = c.decode
    held = sum(len(n.attrs.ids) for n in d.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu")
    cpu = sum(len(n.attrs.ids) for n in d.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu"
              and n.attrs.rows[0] == 0)
    row = dict(rank=rank, gpu_experts=held, cpu_experts=cpu, predicted_ms=round(d.predicted_step_us / 1e3, 3),
               peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3),
               prefill_tok_s={n: round(statistics.mean(v), 1) for n, v in prefill_rates.items()},
               prefill_sd={n: round(statistics.stdev(v), 1) if len(v) > 1 else 0.0 for n, v in prefill_rates.items()}, **{
                   f"{k}_tok_s": round(statistics.mean(v), 2) for k, v in rates.items()}, **{
                   f"{k}_sd": round(statistics.stdev(v), 2) if len(v) > 1 else 0.0 for k, v in rates.items()})
    if gpus > 1:  # every rank's share, gathered to rank 0 as JSON text in a byte tensor
        import torch.distributed as dist

        mine = torch.tensor(list(json.dumps(row).encode().ljust(1024)), dtype=torch.uint8)
        every = [torch.zeros_like(mine) for _ in range(gpus)]
        dist.all_gather(every, mine)
        shares = [json.loads(bytes(t.tolist()).decode()) for t in every]
    else:
        shares = [row]
    if rank == 0:
        Path(out).write_text(json.dumps(shares))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=12, help="cut the model to this many layers (0: all)")
    ap.add_argument("--fp8", action="store_true", help="an FP8 checkpoint (experts kept in FP8)")
    ap.add_argument("--vram-gb", type=float, default=8.0, help="the VRAM limit of each GPU")
    ap.add_argument("--gpus", default="1,2", help="GPU counts to compare (comma list)")
    ap.add_argument("--new", type=int, default=64, help="decoded tokens a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="", help="prompt lengths to prefill (comma list; default none)")
    ap.add_argument("--hw", default="this")
    ap.add_argument("--dir", default=None, help="checkpoint dir (default under /tmp/ktflow-e2e)")
    ap.add_argument("--out", default=str(HERE / "multi_gpu.jsonl"))
    ap.add_argument("--run-id", default=time.strftime("%Y%m%d-%H%M%S"))
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.gpus.split(",") if x]
    lengths = tuple(int(x) for x in a.prefill.split(",") if x)
    if not torch.cuda.is_available() or torch.cuda.device_count() < max(counts):
        print(f"multi_gpu.py needs {max(counts)} CUDA GPUs; torch sees {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    from ktflow.runtime.ranks import run_ranks

    cfg = dict(MODELS[a.model], **({"num_hidden_layers": a.layers} if a.layers else {}))
    ckpt = ready_checkpoint(a.model, cfg, a.layers, a.fp8, a.dir)
    info = dict(bench="multi_gpu", run_id=a.run_id, commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0),
                model=a.model, layers=cfg["num_hidden_layers"], checkpoint="fp8" if a.fp8 else "bf16",
                vram_gb_each=a.vram_gb, new=a.new, rounds=a.rounds)
    rows = []
    for g in counts:
        options = dict(hw=a.hw, device="cuda", vram_gb=a.vram_gb, gpus=g,
                       max_seq_len=max(PROMPT + a.new + 64, max(lengths, default=0) + 8))
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "shares.json")
            t0 = time.perf_counter()
            if g == 1:
                _measure(0, out, str(ckpt), options, a.vram_gb, a.new, a.rounds, lengths)
            else:
                run_ranks(g, _measure, out, str(ckpt), options, a.vram_gb, a.new, a.rounds, lengths, cuda=True)
            shares = json.loads(Path(out).read_text())
        r0 = shares[0]
        rows.append(dict(info, gpus=g, greedy_tok_s=r0["greedy_tok_s"], greedy_sd=r0["greedy_sd"],
                         sampled_tok_s=r0["sampled_tok_s"], sampled_sd=r0["sampled_sd"],
                         gpu_experts=[s["gpu_experts"] for s in shares], cpu_experts=r0["cpu_experts"],
                         predicted_ms=r0["predicted_ms"], peak_gb=[s["peak_gb"] for s in shares],
                         prefill_tok_s=r0["prefill_tok_s"], prefill_sd=r0["prefill_sd"],
                         seconds=round(time.perf_counter() - t0, 1)))
        print(f"{g} GPU(s) done in {rows[-1]['seconds']} s", flush=True)
    base = rows[0]
    print(f"\n{a.model} {info['layers']} layers {info['checkpoint']}, {a.vram_gb:g} GB each GPU, {info['gpu']}, "
          f"commit {info['commit']}")
    print(f"{'GPUs':>4} {'GPU experts':>14} {'CPU experts':>11} {'pred ms':>8} {'greedy tok/s':>14} {'sampled tok/s':>14} "
          f"{'x 1st':>6}")
    for r in rows:
        print(f"{r['gpus']:>4} {'+'.join(map(str, r['gpu_experts'])):>14} {r['cpu_experts']:>11} {r['predicted_ms']:>8.2f} "
              f"{r['greedy_tok_s']:>8.2f} ± {r['greedy_sd']:<4.2f} {r['sampled_tok_s']:>8.2f} ± {r['sampled_sd']:<4.2f} "
              f"{r['greedy_tok_s'] / base['greedy_tok_s']:>6.2f}")
    for n in map(str, lengths):
        print(f"prefill {n} tokens: " + ", ".join(
            f"{r['gpus']} GPU(s) {r['prefill_tok_s'][n]:.0f} ± {r['prefill_sd'][n]:.0f} tok/s "
            f"({r['prefill_tok_s'][n] / base['prefill_tok_s'][n]:.2f}x)" for r in rows))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
