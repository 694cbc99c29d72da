"""FP8 linear layers on the GPU: the fused block-scaled kernel (`backends/fp8_gpu.py`) against
cuBLAS bf16 on the dequantized weight, per shape and rows of activations (GPU machine): what
`fp8_gpu.linear` runs at that row count (the fused tensor-core kernel up to FP8_FUSED_ROWS rows,
above that a one-pass dequantization then cuBLAS), and each of those ways where it applies.

    python benchmarks/fp8_linear.py [--out benchmarks/fp8_linear.jsonl]

Shapes are the dense linears of DeepSeek-V3 (MLA projections, shared expert) and Qwen3-30B-A3B
(GQA projections). Each row: GPU microseconds per call (20 calls in a CUDA graph, median of 10
replays), the weight read rate (bytes held / time: the decode figure of merit), the TFLOP/s (the
prefill one), and the largest error of `linear` against float64 on the dequantized weight,
relative to the largest output.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from common import append_jsonl, commit, machine
from ktflow.backends.kernels import fp8_gpu
from ktflow.costmodel.memory import FP8_FUSED_ROWS
from ktflow.frontend.quant import quantize

SHAPES = {  # name: (n, k)
    "dsv3.q_b": (24576, 1536), "dsv3.kv_a": (576, 7168), "dsv3.o": (7168, 16384),
    "dsv3.shared.gate": (2048, 7168), "dsv3.shared.down": (7168, 2048),
    "qwen3.q": (4096, 2048), "qwen3.kv": (512, 2048), "qwen3.o": (2048, 4096),
}
ROWS = (1, 2, 4, 8, 16, 64, 128, 512, 4096)


def timed(fn, calls: int = 20, reps: int = 10) -> float:
    """GPU microseconds per call: `calls` calls captured in one CUDA graph (decode runs as graphs,
    so no launch overhead), the median over `reps` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/fp8_linear.jsonl")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args()
    torch.manual_seed(0)
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0))
    rows = []
    print(f"{'shape':18s} {'m':>5s} {'bf16 us':>8s} {'fp8 us':>8s} {'fused':>8s} {'deq+mm':>8s} {'fp8/bf16':>8s} "
          f"{'fp8 GB/s':>8s} {'bf16GB/s':>8s} {'fp8 TF':>7s} {'bf16 TF':>7s} {'err':>8s}")
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w8, s = quantize(torch.randn(n, k) * 0.02)
        w = fp8_gpu.Fp8Weight(w8.cuda(), s.cuda())
        wb = w.dequantized(torch.bfloat16)
        exact = w.dequantized(torch.float64)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ exact.t()
            err = float((fp8_gpu.linear(x, w).double() - ref).abs().max() / ref.abs().max())
            t_bf16 = timed(lambda: F.linear(x, wb))
            t_fp8 = timed(lambda: fp8_gpu.linear(x, w))
            t_fused = timed(lambda: fp8_gpu.fused(x, w)) if m <= FP8_FUSED_ROWS else None
            t_deq = timed(lambda: F.linear(x, fp8_gpu.dequantize_gpu(w, torch.bfloat16)))
            flops = 2.0 * m * n * k
            row = dict(info, shape=name, n=n, k=k, m=m, bf16_us=round(t_bf16, 2), fp8_us=round(t_fp8, 2),
                       fused_us=round(t_fused, 2) if t_fused else None, dequant_mm_us=round(t_deq, 2),
                       fp8_vs_bf16=round(t_bf16 / t_fp8, 3),
                       fp8_gbps=round(w.nbytes() / t_fp8 / 1e3, 1), bf16_gbps=round(wb.numel() * 2 / t_bf16 / 1e3, 1),
                       fp8_tflops=round(flops / t_fp8 / 1e6, 1), bf16_tflops=round(flops / t_bf16 / 1e6, 1),
                       rel_err=err)
            rows.append(row)
            fused = f"{t_fused:8.1f}" if t_fused else f"{'-':>8s}"
            print(f"{name:18s} {m:5d} {t_bf16:8.1f} {t_fp8:8.1f} {fused} {t_deq:8.1f} {t_bf16 / t_fp8:7.2f}x "
                  f"{row['fp8_gbps']:8.0f} {row['bf16_gbps']:8.0f} {row['fp8_tflops']:7.1f} {row['bf16_tflops']:7.1f} "
                  f"{err:8.1e}", flush=True)
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
