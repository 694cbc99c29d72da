"""Expert Deferral's decode speed-up on a model with learned routing, beside what it costs in
accuracy (GPU machine).

Issue 19 asks for deferral's KL at the d that `defer="auto"` picks, quoted beside its speed-up.
This measures both for one trained model (train_small_moe.py; scaled with scale_moe.py so experts
cost real bandwidth: the same routing, token for token):

- speed: on the scaled model, every routed expert on the CPU (the VRAM budget holds the dense
  weights and the KV cache only, as benchmarks/e2e.py places them), cuda_graph backend, the
  hardware probed (`ktflow.tools.probe.probe`: `defer="auto"` decides from it), for the exact plan,
  `defer="auto"` and each `--defer` d. Each runs the same held-out conversations: a
  `--prompt`-token prompt, then `--decode` decode steps fed the held-out text that follows (one
  step a token); decode tok/s is those tokens over their wall time, the plans taking turns
  conversation by conversation in `--rounds` rounds (`cache_speed.timed_rounds`) so the machine's
  drift falls on all alike;
- accuracy: the deferral each plan chose (per MoE layer), run on the unscaled model
  (`--fidelity-model`, default the model) as benchmarks/fidelity.py runs it: every routed expert
  on the CPU, `--kl-seqs` held-out sequences of `--kl-len` tokens, teacher forced; held-out
  perplexity, mean KL(exact || variant) and the share of changed top-1 tokens.

Prints a table and appends rows to benchmarks/defer_speed.jsonl.

    python benchmarks/scale_moe.py /tmp/moe-small --inter 2048 -o /tmp/moe-small-x
    python benchmarks/defer_speed.py /tmp/moe-small-x --fidelity-model /tmp/moe-small
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cache_speed import decode_seconds, timed_rounds  # noqa: E402
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import budget_without_experts, compile_cpu_experts  # noqa: E402
from fidelity import compare, cpu_options, run_variant  # noqa: E402
from placement_hits import held_out  # noqa: E402


def deferral(plan) -> dict[int, int]:
    """Per MoE layer of a decode plan: the picks per token it defers (0 where none)."""
    from ktflow.ir.ops import Op

    routed = [n for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS]
    out = dict.fromkeys(sorted({n.attrs.layer for n in routed}), 0)
    for n in routed:
        if n.attrs.deferred:
            out[n.attrs.layer] = n.attrs.rank_range[1] - n.attrs.rank_range[0]
    return out


def dense_on_the_gpu(name: str, plan) -> None:
    """Exit naming the nodes if the decode plan left any dense work on the CPU: only the routed
    experts (with their reduce), the token ids and their embedding may be there (what a CUDA-graph
    step can run), so that the variants differ only in their deferral."""
    from ktflow.ir.ops import Op

    host = {Op.ROUTED_EXPERTS, Op.REDUCE, Op.SUBMIT, Op.SYNC, Op.COPY, Op.INPUT, Op.EMBED}
    stray = [n.name for n in plan.ir.nodes if n.place.device.value == "cpu" and n.op not in host]
    if stray:
        raise SystemExit(f"{name}: the budget left dense nodes on the CPU: {', '.join(stray)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (scaled: scale_moe.py)")
    ap.add_argument("--fidelity-model", default=None,
                    help="the checkpoint the accuracy is measured on (default: the model; give the unscaled one "
                    "scale_moe.py started from: the same outputs, a fraction of the CPU time)")
    ap.add_argument("--defer", default="", help="comma list of uniform d to measure beside exact and auto")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of each conversation")
    ap.add_argument("--decode", type=int, default=128, help="decoded tokens of each conversation")
    ap.add_argument("--seqs", type=int, default=8, help="held-out conversations timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kl-seqs", type=int, default=16, help="held-out sequences for the accuracy")
    ap.add_argument("--kl-len", type=int, default=160, help="tokens per accuracy sequence (16 prefilled)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (the measurement), or cpu: a dry run of the same steps (the GPU lane on the CPU, "
                    "paper-a100's rates instead of a probe; its tok/s mean nothing)")
    ap.add_argument("--out", default=str(HERE / "defer_speed.jsonl"))
    a = ap.parse_args()
    import ktflow
    from ktflow.costmodel.hw import PRESETS
    from ktflow.tools.probe import probe

    d = Path(a.model)
    model = ktflow.load(d)
    length = a.prompt + a.decode
    held = held_out(d, a.seqs * length).view(a.seqs, length)
    prompts = [row[:a.prompt].tolist() for row in held]
    texts = [row[a.prompt:].tolist() for row in held]
    gpu = a.device == "cuda"
    hw = probe(log=lambda line: print(f"  probe: {line}", flush=True)) if gpu else PRESETS["paper-a100"]
    base = dict(hw=hw, device=a.device, dtype="bfloat16", backend="cuda_graph" if gpu else "native",
                max_seq_len=length + 8, expert_format="bf16")
    wide = ktflow.compile(model, vram_budget_gb=1000, allow_oversize=True, **base)
    budget = budget_without_experts(wide.decode)
    variants = {"exact": None, "auto": "auto", **{f"d={x}": int(x) for x in a.defer.split(",") if x}}
    plans = {name: compile_cpu_experts(model, dict(base, vram_budget_gb=budget, defer=v)) for name, v in variants.items()}
    for name, c in plans.items():
        dense_on_the_gpu(name, c.decode)
    chosen = {name: deferral(c.decode) for name, c in plans.items()}
    for c in plans.values():  # warm: weights ready, graphs captured
        decode_seconds(c, prompts[0], min(a.decode, 16), texts[0])
    tok_s = timed_rounds(plans, prompts, texts, a.decode, a.rounds)
    mean = {name: statistics.mean(v) for name, v in tok_s.items()}

    fd = Path(a.fidelity_model or a.model)
    fmodel = ktflow.load(fd)
    seqs = held_out(fd, a.kl_seqs * a.kl_len).view(a.kl_seqs, a.kl_len)
    prompt = 16
    opts = cpu_options(a.kl_len)
    ref = run_variant(fmodel, opts, seqs, prompt)
    info = dict(bench="defer_speed", commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0) if gpu else None,
                device=a.device, model=str(d),
                fidelity_model=str(fd), budget_gb=round(budget, 3), prompt=a.prompt, decode=a.decode, seqs=a.seqs,
                rounds=a.rounds, positions=int(seqs[:, prompt:].numel()))
    rows = []
    print(f"\n{'variant':8s} {'deferred picks per MoE layer':30s} {'decode tok/s':>14s} {'vs exact':>9s} "
          f"{'perplexity':>10s} {'KL vs exact':>12s} {'top-1 changed':>14s}")
    measured: dict[tuple, dict] = {}  # per-layer deferral -> its accuracy (plans choosing alike run once)
    for name in plans:
        per_layer = list(chosen[name].values())
        if tuple(per_layer) not in measured:
            lp = ref if not any(per_layer) else run_variant(fmodel, dict(opts, defer=per_layer), seqs, prompt)
            measured[tuple(per_layer)] = compare(ref, lp, seqs[:, prompt:])
        m = measured[tuple(per_layer)]
        speedup = mean[name] / mean["exact"]
        print(f"{name:8s} {str(per_layer):30s} {mean[name]:8.1f} +- {statistics.pstdev(tok_s[name]):3.1f} "
              f"{speedup:8.3f}x {m['perplexity']:10.3f} {m['kl']:12.5f} {100 * m['top1_changed']:13.2f}%", flush=True)
        rows.append(dict(info, variant=name, deferred=per_layer, decode_tok_s=round(mean[name], 2),
                         decode_tok_s_sd=round(statistics.pstdev(tok_s[name]), 2), vs_exact=round(speedup, 4),
                         perplexity=round(m["perplexity"], 4), kl=round(m["kl"], 6),
                         top1_changed=round(m["top1_changed"], 5)))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
