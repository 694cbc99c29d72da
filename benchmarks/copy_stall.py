"""How much longer a decode step takes while a DMA copies bytes from page-locked host memory to the
GPU beside it: the DMA part of what an expert-cache refill costs the decode steps (a refill also
unpacks on the GPU and does host work this does not; `passes/place.py`'s `COPY_STALL` prices the
whole).

One plan decodes held-out conversations one step a token: the model placed without a routing
profile at the VRAM budget that puts `--share` of its routed experts on the GPU (cache_speed's
`uniform` plan). After every decode step, where the expert cache issues its refills' copies, a
stream of its own copies B MB (`--mb`) from a page-locked host buffer to the GPU, in pieces of
`--piece-mb` (0: one copy); B = 0 is the baseline. The variants take turns conversation by
conversation, the first moving on by one each conversation and round, so a machine's drift falls
on all alike. Reported per variant: ms a decoded token, the host's ms a token issuing the copies
(the decode loop waits for that part whatever the link does), the ms a token it adds over the
baseline per MB copied (the stall), the same copy's ms per MB with the GPU idle (the link's own time), and
their ratio: 1 means a step waits out the whole copy, 0 that the copy hides beside it entirely.
A copy issued after a step while the one before is still under way queues behind it, so once B
MB take longer than a step, every step runs beside a copy. Needs a CUDA device. On the GPU
machine:

    python benchmarks/copy_stall.py /tmp/moe-small-x --share 0.25 --mb 0,4,16,64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cache_speed import decode_seconds  # noqa: E402
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from placement_hits import budget_for, roofline_only  # noqa: E402

MB = 1 << 20  # (a MiB: "MB" in this benchmark's options and rows)


class SideCopies:
    """Copies `mb` MB host -> GPU on a stream of their own after each decode step of a plan."""

    def __init__(self, most_mb: float):
        self.stream = torch.cuda.Stream()
        n = max(int(most_mb * MB), 1)
        self.src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self.src.random_(0, 255)
        self.dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.mb, self.piece_mb = 0.0, 0.0
        self.host_seconds = 0.0  # the host's time issuing the copies (the decode loop waits for it)

    def issue(self) -> None:
        n = int(self.mb * MB)
        if n == 0:
            return
        t0 = time.perf_counter()
        piece = int(self.piece_mb * MB) or n
        with torch.cuda.stream(self.stream):
            for at in range(0, n, piece):
                self.dst[at:min(at + piece, n)].copy_(self.src[at:min(at + piece, n)], non_blocking=True)
        self.host_seconds += time.perf_counter() - t0

    def after_run(self, executor, tokens: int) -> None:
        if executor.plan.phase == "decode":
            self.issue()

    def link_ms_per_mb(self, mb: float, piece_mb: float, reps: int = 5) -> float:
        """The copy's own time per MB, the GPU otherwise idle (best of `reps`)."""
        self.mb, self.piece_mb = mb, piece_mb
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.issue()
            self.stream.synchronize()
            best = min(best, time.perf_counter() - t0)
        return 1e3 * best / mb


def conversations(d: Path, seqs: int, prompt: int, decode: int, vocab: int):
    """`seqs` (prompt, text) pairs from the checkpoint's held-out split, or seeded random ids where
    it has none (the step's time hardly depends on the text)."""
    length = prompt + decode
    if (d / "heldout.safetensors").exists():
        from placement_hits import held_out

        ids = held_out(d, seqs * length).tolist()
    else:
        ids = torch.randint(0, vocab, (seqs * length,), generator=torch.Generator().manual_seed(0)).tolist()
    return [(ids[i * length:i * length + prompt], ids[i * length + prompt:(i + 1) * length]) for i in range(seqs)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a checkpoint dir (cache_speed's scaled model, or any ktflow.load reads)")
    ap.add_argument("--share", type=float, default=0.25, help="GPU share of the routed experts (the VRAM budget)")
    ap.add_argument("--mb", default="0,4,16,64", help="MB copied after each decode step (comma list; 0: baseline)")
    ap.add_argument("--piece-mb", type=float, default=0.0, help="MB a copy (0: the step's MB as one copy)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "copy_stall.jsonl"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("copy_stall: needs a CUDA device (it measures copies to the GPU)", file=sys.stderr)
        return 2
    sizes = sorted({float(x) for x in a.mb.split(",") if x.strip()} | {0.0})
    if sizes[0] < 0 or a.piece_mb < 0:
        print(f"copy_stall: --mb and --piece-mb take MB >= 0, got {a.mb!r} and {a.piece_mb}", file=sys.stderr)
        return 2
    import json

    import ktflow

    d = Path(a.model)
    model = ktflow.load(d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    convs = conversations(d, a.seqs, a.prompt, a.decode, vocab)
    max_seq = a.prompt + a.decode + 8
    budget = budget_for(model, a.share, max_seq)
    c = ktflow.compile(model, hw=roofline_only(), device="cuda", dtype="bfloat16", vram_budget_gb=budget,
                       max_seq_len=max_seq, numa_nodes=1)
    side = SideCopies(max(sizes))
    c.executor(c.decode).after_run.append(side.after_run)
    decode_seconds(c, convs[0][0], min(a.decode, 16), convs[0][1])  # warm: weights ready, graph captured
    took = {mb: [0.0] * a.rounds for mb in sizes}
    issuing = dict.fromkeys(sizes, 0.0)
    for r in range(a.rounds):
        for i, (prompt, text) in enumerate(convs):
            k = (r + i) % len(sizes)
            for mb in sizes[k:] + sizes[:k]:
                side.mb, side.piece_mb, side.host_seconds = mb, a.piece_mb, 0.0
                took[mb][r] += decode_seconds(c, prompt, a.decode, text)
                side.stream.synchronize()  # the next variant starts without this one's copies
                issuing[mb] += side.host_seconds
    tokens = a.seqs * a.decode
    ms = {mb: [1e3 * t / tokens for t in ts] for mb, ts in took.items()}
    base = statistics.mean(ms[0.0])
    info = dict(bench="copy_stall", commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=str(d),
                share=a.share, budget_gb=round(budget, 4), piece_mb=a.piece_mb, seqs=a.seqs, decode=a.decode,
                rounds=a.rounds)
    rows = []
    print(f"{'MB a step':>9} {'ms a token':>14} {'issuing':>8} {'added ms/MB':>12} {'link ms/MB':>11} {'stall':>6}")
    for mb in sizes:
        mean = statistics.mean(ms[mb])
        added = (mean - base) / mb if mb else 0.0
        link = side.link_ms_per_mb(mb, a.piece_mb) if mb else 0.0
        ratio = added / link if mb else 0.0
        host = 1e3 * issuing[mb] / (a.rounds * tokens)
        print(f"{mb:>9g} {mean:>8.3f} +- {statistics.pstdev(ms[mb]):.3f} {host:>8.3f} {added:>12.4f} {link:>11.4f} "
              f"{ratio:>6.2f}")
        rows.append(dict(**info, mb=mb, ms_per_token=round(mean, 4), sd=round(statistics.pstdev(ms[mb]), 4),
                         host_issue_ms_per_token=round(host, 4), added_ms_per_mb=round(added, 5),
                         link_ms_per_mb=round(link, 5), link_gbps=round(MB / 1e6 / link, 1) if mb else None,
                         stall=round(ratio, 3)))
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
