"""Decode over GPU routed experts held in FP8 (GPU machine): the three ways the captured decode
rule (`backends/static_rules.routed_experts`) can multiply a step's picks, per expert shape and
number of picks:

- `bf16`: the picks gathered from a bf16 stack, then batched matrix products (experts held in
  the activation dtype: twice the bytes, half the experts in the same VRAM);
- `gather+dequant`: the picks' FP8 bytes and scales gathered and dequantized into a temporary,
  then the same products (`fp8_gpu.dequantize_experts`: the reference path, plain torch);
- `fused`: one kernel per projection reads each pick's FP8 bytes once (`fp8_gpu.picked_linear`,
  what the rule runs on CUDA with Triton).

    python benchmarks/fp8_experts_decode.py [--out benchmarks/fp8_experts_decode.jsonl]

Each row: GPU microseconds per projection call (20 calls in a CUDA graph, median of 10 replays,
as benchmarks/fp8_linear.py), the picked bytes read per second for the FP8 ways (the weights
held: 1 byte each plus the block scales), that rate against the card's copy rate (read + write of a
1 GiB copy), and the fused kernel's largest error against float64, relative to the largest output.
"""

from __future__ import annotations

import argparse

import torch

from common import append_jsonl, commit, machine
from fp8_linear import timed
from ktflow.backends.kernels import fp8_gpu
from ktflow.frontend.quant import quantize

SHAPES = {  # name: (n, k) of one expert's projection
    "qwen3.gate_up": (768, 2048), "qwen3.down": (2048, 768),
    "dsv2lite.gate_up": (1408, 2048), "dsv2lite.down": (2048, 1408),
    "dsv3.gate_up": (2048, 7168), "dsv3.down": (7168, 2048),
}
EXPERTS = 64  # in the stack (a layer's GPU-held experts)
TOKENS = (1, 4)  # decode rows; 8 picks a token


def hbm_gbps() -> float:
    """The card's copy rate (bytes read and written per second: a 1 GiB device-to-device copy)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), calls=3, reps=5) for _ in range(2))
    return 2 * src.numel() / best / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/fp8_experts_decode.jsonl")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    torch.manual_seed(0)
    hbm = hbm_gbps()
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), hbm_gbps=round(hbm))
    rows = []
    print(f"HBM {hbm:.0f} GB/s (a copy); {EXPERTS} experts a stack, 8 picks a token")
    print(f"{'shape':18s} {'picks':>5s} {'bf16 us':>8s} {'deq us':>8s} {'fused us':>8s} {'fused/deq':>9s} "
          f"{'fused/bf16':>10s} {'fused GB/s':>10s} {'of HBM':>7s} {'err':>8s}")
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        pairs = [quantize(torch.randn(n, k) * 0.02) for _ in range(EXPERTS)]
        w = fp8_gpu.Fp8Weight(torch.stack([q for q, _ in pairs]).cuda(), torch.stack([s for _, s in pairs]).cuda())
        dense = fp8_gpu.dequantize_experts(w, torch.bfloat16)
        for tokens in TOKENS:
            picks = 8 * tokens
            slot = torch.randperm(EXPERTS, device="cuda")[:picks] if picks <= EXPERTS else \
                torch.randint(0, EXPERTS, (picks,), device="cuda")
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            xs = x.repeat_interleave(8, dim=0)[:, :, None]
            t_bf16 = timed(lambda: torch.bmm(dense[slot], xs))
            t_deq = timed(lambda: torch.bmm(fp8_gpu.dequantize_experts(w, torch.bfloat16, slot), xs))
            t_fused = timed(lambda: fp8_gpu.picked_linear(x, w, slot, 8))
            ref = torch.bmm(fp8_gpu.dequantize_experts(w, torch.float64, slot), xs.double())[:, :, 0]
            err = float((fp8_gpu.picked_linear(x, w, slot, 8).double() - ref).abs().max() / ref.abs().max())
            picked = picks * (n * k + w.scale_inv[0].numel() * 4)
            gbps = picked / t_fused / 1e3
            row = dict(info, shape=name, n=n, k=k, picks=picks, bf16_us=round(t_bf16, 2), dequant_us=round(t_deq, 2),
                       fused_us=round(t_fused, 2), fused_gbps=round(gbps), fused_of_hbm=round(gbps / hbm, 3),
                       rel_err=err)
            rows.append(row)
            print(f"{name:18s} {picks:5d} {t_bf16:8.1f} {t_deq:8.1f} {t_fused:8.1f} {t_deq / t_fused:8.2f}x "
                  f"{t_bf16 / t_fused:9.2f}x {gbps:10.0f} {gbps / hbm:7.2f} {err:8.1e}", flush=True)
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
