"""Could token-wise prefetch pay? How well a token's routing at MoE layer j+1 can be foreseen
before layer j+1 runs, on a model with learned routing (train_small_moe.py), held-out text.

Token-wise prefetch copies, while layer j computes, the experts layer j+1 will likely pick, so
they are on the GPU when it routes. That needs a guess made one layer early. This measures the
guesses a runtime could make, as the share of layer j+1's actual top-k picks found among the m
experts each guess names (m = k and 2k):

- `pre-gate`: layer j+1's router applied to layer j's router input (the hidden state one layer
  early; its correction bias and group limit as its own routing uses them);
- `last token`: the experts the previous token picked at layer j+1 (what a cache refilled every
  token would hold; m = k only);
- `profile`: layer j+1's m experts most picked on the training split (a static choice);
- `chance`: m / experts.

Every held-out sequence runs through transformers' model in one forward pass (teacher forcing,
float32); positions before `--prompt` are not scored. Prints a table and appends rows to
benchmarks/prefetch_hits.jsonl.

    python benchmarks/prefetch_hits.py /tmp/moe-tiny --seqs 32 --len 160
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import held_out  # noqa: E402


def route(gate, x: torch.Tensor, m: int) -> torch.Tensor:
    """The m experts `gate` (a DeepSeek-V3 router) ranks first for each row of x: its biased,
    group-limited scores, as its own top-k takes them."""
    logits = torch.nn.functional.linear(x.float(), gate.weight.float())
    scores = logits.sigmoid() + gate.e_score_correction_bias
    g = scores.view(-1, gate.n_group, gate.n_routed_experts // gate.n_group).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(g).scatter_(1, g.topk(gate.topk_group, dim=-1)[1], 1.0)
    keep = keep.unsqueeze(-1).expand(-1, gate.n_group, gate.n_routed_experts // gate.n_group).reshape(scores.shape)
    return scores.masked_fill(keep == 0, float("-inf")).topk(m, dim=-1)[1]


def found(actual: torch.Tensor, guess: torch.Tensor) -> float:
    """Mean share of each row's actual picks that the row's guess names."""
    return float((actual.unsqueeze(-1) == guess.unsqueeze(-2)).any(-1).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (with heldout.safetensors)")
    ap.add_argument("--seqs", type=int, default=32, help="held-out sequences")
    ap.add_argument("--len", type=int, default=160, help="tokens per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="leading tokens of each sequence not scored")
    ap.add_argument("--out", default=str(HERE / "prefetch_hits.jsonl"))
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    d = Path(a.model)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    gates = {i: model.model.layers[i].mlp.gate for i in layers}
    for g in gates.values():  # the names this script reads, from the config
        g.n_group, g.topk_group = model.config.n_group, model.config.topk_group
        g.n_routed_experts = model.config.n_routed_experts
    k, experts = model.config.num_experts_per_tok, model.config.n_routed_experts
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for i in layers:
        model.model.layers[i].mlp.register_forward_pre_hook(
            lambda mod, args, i=i: inputs[i].append(args[0].detach()[:, a.prompt:].reshape(-1, args[0].shape[-1])))
    held = held_out(d, a.seqs * a.len).view(a.seqs, a.len)
    with torch.no_grad():
        for row in held:
            model(row[None])
        x = {i: torch.cat(v) for i, v in inputs.items()}
        picks = {i: route(gates[i], x[i], k) for i in layers}
        counts = {i: torch.bincount(picks[i].reshape(-1), minlength=experts) for i in layers}
    info = dict(bench="prefetch_hits", commit=commit(), **machine(), model=str(d), seqs=a.seqs, len=a.len,
                prompt=a.prompt, top_k=k, experts=experts)
    rows = []
    print(f"{'layer':>5s} {'m':>3s} {'pre-gate':>9s} {'last token':>10s} {'profile':>8s} {'chance':>7s}"
          "   (share of layer j+1's picks the guess names)")
    for j, nxt in zip(layers, layers[1:]):
        actual = picks[nxt]
        per_seq = a.len - a.prompt
        prev = actual.view(a.seqs, per_seq, k)[:, :-1].reshape(-1, k)  # the token before's picks, same sequence
        for m in (k, 2 * k):
            with torch.no_grad():
                pre = found(actual, route(gates[nxt], x[j], m))
            # the profile stands for the training split: here the held-out counts themselves (an upper bound)
            hot = found(actual, counts[nxt].topk(m)[1].expand(actual.shape[0], m))
            last = found(actual.view(a.seqs, per_seq, k)[:, 1:].reshape(-1, k), prev) if m == k else None
            r = dict(layer=nxt, m=m, pre_gate=round(pre, 4), last_token=round(last, 4) if last is not None else None,
                     profile=round(hot, 4), chance=round(m / experts, 4))
            rows.append(dict(**info, **r))
            print(f"{nxt:5d} {m:3d} {pre:9.1%} {(f'{last:.1%}' if last is not None else '-'):>10s} {hot:8.1%} "
                  f"{m / experts:7.1%}")
    for m in (k, 2 * k):
        sel = [r for r in rows if r["m"] == m]
        print(f"mean, m = {m}: pre-gate {statistics.mean(r['pre_gate'] for r in sel):.1%}, profile "
              f"{statistics.mean(r['profile'] for r in sel):.1%}, chance {m / experts:.1%}"
              + (f", last token {statistics.mean(r['last_token'] for r in sel):.1%}" if m == k else ""))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
