"""What approximations cost in accuracy, on a model with learned routing (train_small_moe.py).

For each variant, the held-out split (`heldout.safetensors` in the model dir) is run through
ktflow as a reader would: the first `--prompt` tokens of each sequence prefilled, then every
later token fed one decode step at a time (teacher forcing), so every next-token distribution
after the prompt comes from a decode plan, where Expert Deferral acts. Against the reference (the
exact decode plan, bf16 experts) it reports:

- held-out perplexity over those positions;
- the mean KL(reference || variant) of the next-token distributions;
- the fraction of positions whose most likely token differs from the reference's.

Variants: Expert Deferral with d = 1 .. top_k - 1 (`--defer`), expert skipping with the same d
(each token's d lowest-weight picks dropped: the paper's figure-13 comparison; a custom pass
after placement sets the routed experts' `skip` to d and their rank range to the top k - d, in
every MoE layer but the last, as deferral does), and the CPU experts' formats (`--formats`: int8, int4, fp8 e4m3 in groups of 128) without
deferral.
Every plan keeps every routed expert on the CPU (native backend) and runs the sequences in
batches of 8: quantized experts take the kernel path of a single sequence's decode, and the
exact plan's distributions move from one-at-a-time runs by bf16 rounding only (KL 3e-6 on the
tiny model, where deferral's smallest is 2e-4); 6x faster on the dev box. Prints a table and appends rows
to benchmarks/fidelity.jsonl.

    python benchmarks/fidelity.py /tmp/moe-tiny --seqs 8 --len 96
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import held_out  # noqa: E402


def skip_lowest(d: int):
    """A custom pass (after placement): in decode plans, every MoE layer but the last computes
    only each token's top k - d picks; the other d are dropped, not deferred."""
    from ktflow.ir.ops import Op

    def skip_experts(g, ctx):
        if ctx.phase != "decode":
            return g
        layers = sorted({n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS})

        def cut(n):
            if n.op == Op.ROUTED_EXPERTS and n.attrs.layer != layers[-1]:
                return replace(n, attrs=replace(n.attrs, ranks=(0, n.attrs.top_k - d), skip=d))
            return n

        return g.map(cut)

    return skip_experts


#: rows per batch: the native kernel computes quantized (int8, int4, fp8) experts with quantized
#: activations for up to this many rows per expert (QUANT_ROWS_MAX) and dequantizes them above,
#: so batches of at most this many rows decode as one sequence at a time would
BATCH_ROWS = 8


def run_variant(model, opts: dict, seqs: torch.Tensor, prompt: int) -> torch.Tensor:
    """log-softmax of every next-token distribution after the prompt: [seqs, len - prompt, vocab].
    The sequences run in batches of BATCH_ROWS (each row's routing, deferral and skipping are its
    own: a decode step's rows do not mix), so a decode plan runs len - prompt - 1 times per batch,
    not per sequence."""
    import ktflow

    c = ktflow.compile(model, max_batch=min(len(seqs), BATCH_ROWS), **opts)
    out = []
    for part in seqs.split(BATCH_ROWS):
        logits, state = ktflow.execute(c, part[:, :prompt], logits="last")
        steps = [logits[:, -1]]
        for t in range(prompt, part.shape[1] - 1):
            logits, state = ktflow.execute(c, part[:, t:t + 1], state, logits="last")
            steps.append(logits[:, -1])
        out.append(torch.log_softmax(torch.stack(steps, dim=1).float(), dim=-1))
    return torch.cat(out)


def compare(ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> dict:
    """A variant's log-probabilities `lp` against the reference's (both [seqs, positions, vocab]):
    held-out perplexity of `targets`, mean KL(reference || variant), share of changed top-1s."""
    return dict(perplexity=math.exp(-float(lp.gather(-1, targets[..., None]).mean())),
                kl=float((ref.exp() * (ref - lp)).sum(-1).mean()),
                top1_changed=float((lp.argmax(-1) != ref.argmax(-1)).float().mean()))


def cpu_options(length: int) -> dict:
    """The exact reference's compile options: every routed expert on the CPU, bf16, native."""
    return dict(hw="cpu", device="cpu", dtype="bfloat16", backend="native", placement="cpu", max_seq_len=length + 8,
                expert_format="bf16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (with heldout.safetensors)")
    ap.add_argument("--seqs", type=int, default=8, help="held-out sequences")
    ap.add_argument("--len", type=int, default=96, help="tokens per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="tokens prefilled before the decode steps")
    ap.add_argument("--defer", default="", help="comma list of d (default: 1 .. top_k - 1)")
    ap.add_argument("--formats", default="int8,int4,fp8")
    ap.add_argument("--out", default=str(HERE / "fidelity.jsonl"))
    a = ap.parse_args()
    import ktflow

    d = Path(a.model)
    model = ktflow.load(d)
    seqs = held_out(d, a.seqs * a.len).view(a.seqs, a.len)
    targets = seqs[:, a.prompt:]
    cfg = json.loads((d / "config.json").read_text())
    k = cfg["num_experts_per_tok"]
    ds = [int(x) for x in a.defer.split(",") if x] or list(range(1, k))
    base = cpu_options(a.len)
    variants = [("exact", {})] + [(f"defer {x}", dict(defer=x)) for x in ds] \
        + [(f"skip {x}", dict(passes=[("after:place_by_intensity", skip_lowest(x))])) for x in ds] \
        + [(f"{f} experts", dict(expert_format=f)) for f in a.formats.split(",") if f]
    ref = None
    rows = []
    print(f"{'variant':14s} {'perplexity':>10s} {'KL vs exact':>12s} {'top-1 changed':>14s} {'seconds':>8s}")
    for name, extra in variants:
        t0 = time.perf_counter()
        lp = run_variant(model, {**base, **extra}, seqs, a.prompt)
        if ref is None:
            ref = lp
        m = compare(ref, lp, targets)
        ppl, kl, changed = m["perplexity"], m["kl"], m["top1_changed"]
        secs = time.perf_counter() - t0
        print(f"{name:14s} {ppl:10.3f} {kl:12.5f} {100 * changed:13.2f}% {secs:8.1f}", flush=True)
        rows.append(dict(bench="fidelity", commit=commit(), **machine(), model=str(d), variant=name, top_k=k,
                         seqs=a.seqs, len=a.len, prompt=a.prompt, positions=int(targets.numel()),
                         perplexity=round(ppl, 4), kl=round(kl, 6), top1_changed=round(changed, 5)))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
