"""How many of a held-out token's routed picks a GPU expert cache would serve, against static
placement, on a model with learned routing (train_small_moe.py): the hit rates that decide whether
the decode-time expert cache (`ktflow.runtime.expert_cache`) can pay, before any GPU time.

Each held-out sequence stands for one conversation: its first `--prompt` tokens are the prompt,
the rest are decoded tokens. The routers' picks of every token are recorded (exact plans on the
CPU, `ktflow.runtime.routing`). Per MoE layer, S = share x experts GPU rows, and the share of the
decoded tokens' picks that land in them, for:

- `uniform`: the first S experts of each layer (what placement does without a profile);
- `profiled`: the S experts a routing profile of training-split text picks most (placement with
  `--routing-profile`; placement_hits.py checks the plans do exactly this);
- `cache`: the profiled experts until the prompt has run, then the S the prompt picked most
  (refilled after prefill), refilled again every `--every` decoded tokens with the S the tokens
  since the last refill picked most (`ExpertCache.refill_from` over a recorder reset at each
  refill; ties keep the refill before's order). Causal: a token is served by a cache filled from
  tokens before it;
- `oracle`: per sequence, the S its own decoded tokens picked most (the best a static choice made
  for that conversation could do: a bound, not a policy).

`CPU picks` is the fraction of a decoded token's picks left to the CPU; the ratio against
`uniform` is what a CPU-bound decode step would gain if its time followed them: a proxy, not a
measured speed. `copied/token` is the experts a refill copies in per decoded token (times an
expert's bytes: the PCIe traffic).

With `--batch B`, B conversations decode in lockstep with one cache, as a serving step runs them
(members spread over the held-out sequences, `cache_curves.spread`, since neighbours share a file):
a step reads each expert any of its rows picked once, so the shares are of the steps' expert
reads (at B = 1, the picks); the refills count every row's picks, every `--every` decoded tokens
of the batch (every ceil(every / B) steps, as the runtime counts a step's rows); the oracle is the
batch's S most read experts. Prints a table and appends rows to benchmarks/cache_hits.jsonl.

    python benchmarks/cache_hits.py /tmp/moe-tiny --shares 0.1,0.25 --every 16
    python benchmarks/cache_hits.py /tmp/moe-tiny --shares 0.1,0.25 --every 32 --batch 4
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import add_text_args, held_out, training_profile  # noqa: E402


def picks_of(model, seqs: list[list[int]], max_seq_len: int) -> list[dict[int, torch.Tensor]]:
    """Per sequence, per MoE layer, each token's picks [tokens, top_k] (one prefill each, exact
    CPU plans)."""
    import ktflow
    from ktflow.runtime.routing import RoutingRecorder

    class Trace(RoutingRecorder):
        def __init__(self):
            super().__init__()
            self.ids: dict[int, list[torch.Tensor]] = {}

        def add(self, layer, ids, experts):
            super().add(layer, ids, experts)
            self.ids.setdefault(layer, []).append(ids.reshape(-1, ids.shape[-1]).cpu().clone())

    c = ktflow.compile(model, hw="cpu", device="cpu", backend="native", placement="cpu", max_seq_len=max_seq_len)
    out = []
    for seq in seqs:
        rec = Trace()
        for plan in (c.decode, *c.prefill):
            c.executor(plan).recorder = rec
        ktflow.execute(c, torch.tensor([seq]), logits="last")
        out.append({layer: torch.cat(parts) for layer, parts in rec.ids.items()})
    for plan in (c.decode, *c.prefill):
        c.executor(plan).recorder = None
    return out


def top(counts: torch.Tensor, s: int, keep: set[int] = frozenset()) -> set[int]:
    """The s most counted experts (ties: one in `keep`, then the lower id)."""
    return set(sorted(range(len(counts)), key=lambda e: (-float(counts[e]), e not in keep, e))[:s])


def reads_of(decoded: torch.Tensor, experts: int) -> torch.Tensor:
    """[steps, experts] bool: the experts each decode step reads (picked by any row of the batch;
    decoded [steps, rows, top_k])."""
    m = torch.zeros(decoded.shape[0], experts, dtype=torch.bool)
    return m.scatter_(1, decoded.reshape(decoded.shape[0], -1), True)


def served(reads: torch.Tensor, slots: set[int]) -> int:
    """Of the steps' expert reads, how many the GPU rows hold."""
    return int(reads[:, sorted(slots)].sum())


def cache_run(picks: torch.Tensor, first: set[int], prompt: int, every: int, s: int, experts: int) -> tuple[int, int]:
    """(decode steps' expert reads the cache served, experts copied in) over one layer of a batch
    of conversations run in lockstep (picks [tokens, rows, top_k], or [tokens, top_k] for one):
    filled with `first`, refilled after the prompts with the S their picks counted most, then
    every `every` decode steps with the S the steps since picked most, ordered as
    `ExpertCache.refill_from` orders (`cache_curves.next_order`: ties keep the order of the refill
    before)."""
    from ktflow.runtime.cache_curves import next_order

    if picks.dim() == 2:
        picks = picks[:, None]

    def counts(rows):
        return torch.bincount(rows.reshape(-1), minlength=experts)

    order = torch.tensor(sorted(first) + sorted(set(range(experts)) - first))
    order = next_order(order, counts(picks[:prompt]))
    slots = set(order[:s].tolist())
    copied, hits = len(slots - first), 0
    reads = reads_of(picks[prompt:], experts)
    for lo in range(0, reads.shape[0], every):
        hits += served(reads[lo:lo + every], slots)
        if lo + every < reads.shape[0]:
            order = next_order(order, counts(picks[prompt + lo:prompt + lo + every]))
            new = set(order[:s].tolist())
            copied += len(new - slots)
            slots = new
    return hits, copied


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir from train_small_moe.py (with heldout.safetensors)")
    ap.add_argument("--shares", default="0.1,0.25", help="GPU shares of the routed experts (comma list)")
    ap.add_argument("--every", type=int, default=16, help="decoded tokens between refills")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens of each held-out sequence")
    ap.add_argument("--len", type=int, default=192, help="tokens per held-out sequence (prompt and decoded)")
    ap.add_argument("--seqs", type=int, default=48, help="held-out sequences")
    ap.add_argument("--batch", type=int, default=1,
                    help="conversations decoded together in lockstep, one cache for the batch (a serving step): "
                    "a step reads each expert any row picked once, so the shares are of the steps' expert reads")
    add_text_args(ap)
    ap.add_argument("--out", default=str(HERE / "cache_hits.jsonl"))
    a = ap.parse_args()
    if not 0 < a.prompt < a.len or a.every < 1 or not 1 <= a.batch <= a.seqs:
        raise SystemExit(f"need 0 < --prompt < --len, --every >= 1 and 1 <= --batch <= --seqs (got {a.prompt}, "
                         f"{a.len}, {a.every}, {a.batch})")
    import ktflow
    from ktflow.runtime.cache_curves import spread

    d = Path(a.model)
    model = ktflow.load(d)
    cfg = json.loads((d / "config.json").read_text())
    experts = cfg["n_routed_experts"]
    held = held_out(d, a.seqs * a.len)
    prof = training_profile(model, d, a, 128)
    seqs = picks_of(model, held.view(a.seqs, a.len).tolist(), a.len + 8)
    groups = [[seqs[i] for i in members] for members in spread(len(seqs), a.batch)]  # not neighbours: one file's text
    steps = math.ceil(a.every / a.batch)  # the runtime counts a step's rows toward the interval
    tokens = len(groups) * a.batch * (a.len - a.prompt)
    info = dict(bench="cache_hits", commit=commit(), **machine(), model=str(d), every=a.every, prompt=a.prompt,
                len=a.len, seqs=a.seqs, batch=a.batch)
    rows = []
    what = "picks" if a.batch == 1 else f"expert reads (batches of {a.batch})"
    print(f"{'share':>5s} {'layer':>5s} {'slots':>5s} {'uniform':>8s} {'profiled':>8s} {'cache':>8s} {'oracle':>8s} "
          f"{'copied/token':>12s}   (share of the decode steps' {what} on the GPU)")
    for share in [float(x) for x in a.shares.split(",") if x]:
        s = max(1, round(share * experts))
        got = {"uniform": [], "profiled": [], "cache": [], "oracle": []}
        for layer in sorted(seqs[0]):
            uniform, profiled = set(range(s)), top(torch.tensor(prof.layers[layer]), s)
            hits = dict.fromkeys(got, 0)
            copied = total = 0
            for group in groups:
                p = torch.stack([seq[layer] for seq in group], dim=1)  # [tokens, rows, top_k]
                reads = reads_of(p[a.prompt:], experts)
                total += int(reads.sum())
                hits["uniform"] += served(reads, uniform)
                hits["profiled"] += served(reads, profiled)
                hits["oracle"] += served(reads, top(reads.sum(0), s))
                h, c = cache_run(p, profiled, a.prompt, steps, s, experts)
                hits["cache"] += h
                copied += c
            on = {name: v / total for name, v in hits.items()}
            per_token = copied / tokens
            for name in got:
                got[name].append(on[name])
            print(f"{share:5.2f} {layer:5d} {s:5d} {on['uniform']:8.1%} {on['profiled']:8.1%} {on['cache']:8.1%} "
                  f"{on['oracle']:8.1%} {per_token:12.3f}")
            rows.append(dict(**info, share=share, layer=layer, slots=s, copied_per_token=round(per_token, 4),
                             reads_per_step=round(total / (len(groups) * (a.len - a.prompt)), 3),
                             **{name: round(v, 4) for name, v in on.items()}))
        mean = {name: statistics.mean(v) for name, v in got.items()}
        cpu = {name: 1 - v for name, v in mean.items()}
        print(f"{share:5.2f}  mean on the GPU: uniform {mean['uniform']:.1%}, profiled {mean['profiled']:.1%}, cache "
              f"{mean['cache']:.1%}, oracle {mean['oracle']:.1%}; CPU {what} against uniform: profiled "
              f"{cpu['uniform'] / cpu['profiled']:.3f}x, cache {cpu['uniform'] / cpu['cache']:.3f}x, oracle "
              f"{cpu['uniform'] / cpu['oracle']:.3f}x fewer")
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
