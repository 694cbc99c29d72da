"""One MoE layer on the CPU, side by side: ktflow's native operator (bf16, int8, int4, fp8), a torch
per-expert bf16 loop, and kt-kernel (KTransformers' CPU MoE, optional: `pip install --no-deps
kt-kernel`), for T tokens with top-k routing, on two layer shapes. Also measures this machine's
DRAM read bandwidth in the same run and prints each ktflow decode row as a fraction of it.

Per row: us per call (median of repeats), GB/s of touched expert bytes (the distinct experts the
call routes to, each read once), TFLOPS (2 * T * k * 3 * H * I / time). Appends JSONL to
benchmarks/moe_kernel.jsonl.

ktflow's rows cycle through several packed copies of the layer (as a model's decode step goes
through every layer before it comes back to one), enough that the experts of one call are out of
the last-level cache when their copy comes round again; the baselines run one copy.

    python benchmarks/moe_kernel.py [--shapes qwen3,dsv3] [--tokens 1,2,4,...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from common import append_jsonl, commit, machine
from ktflow.backends.native import binding as native

SHAPES = {  # name: (experts, top_k, hidden, inter)
    "qwen3": (128, 8, 2048, 768),
    "dsv3": (64, 8, 7168, 2048),  # 64 of DeepSeek-V3's 256 experts: the layer's bytes fit any host
}
TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
# bytes read per weight: int8 per output channel (one fp32 scale per row, negligible), int4 and
# fp8 in groups of 128 with one fp32 scale each
BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 128, "fp8": 1.0 + 4 / 128}
PHASES = ("route", "gather", "up", "down", "reduce")  # of the native operator, us of the last call


def kernel_table(shapes: list[str], threads: int) -> list[dict]:
    """One thread's matmul kernel on in-cache data (the gate shape of each layer, n = 256 rows of
    it), per path and rows: the compute ceiling the layer rows are measured against."""
    out = []
    print(f"{'kernel':22s} {'rows':>5s} {'TFLOPS/thread':>14s} {'x threads':>10s}")
    for shape in shapes:
        _, _, H, _ = SHAPES[shape]
        for path in native.kernel_paths():
            if path == "generic":
                continue
            for fmt in ("bf16", "int8", "int4", "fp8"):
                for M in (1, 8, 32, 128, 256):
                    tf = native.module().kernel_tflops(path, M, 256, H, fmt)
                    print(f"{shape + ' ' + path + ' ' + fmt:22s} {M:5d} {tf:14.3f} {tf * threads:10.2f}")
                    out.append(dict(bench="moe_kernel.kernel", shape=shape, path=path, fmt=fmt, rows=M, n=256, k=H,
                                    tflops_per_thread=tf))
    return out


def dram_read_gbps() -> dict[str, float]:
    """All-core read bandwidth of a 2 GiB buffer, two ways: torch's float32 sum (every intra-op
    thread) and the native pool's threads streaming it; the larger is the machine's figure."""
    a = torch.ones(2 << 28, dtype=torch.float32)
    a.sum()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    del a
    stream = native.module().stream_read_gbps(native.pool(), 2 << 30, 5)
    return dict(torch_sum=best, native_stream=stream, dram=max(best, stream))


def llc_bytes() -> int:
    """Size of the last-level cache CPU 0 sees (64 MiB when the OS does not say)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        return int(size.rstrip("KMG")) * unit
    return 64 << 20


def layer_copies(k: int, H: int, I: int, fmt: str, llc: int) -> int:
    """Copies to cycle through: between two calls on one copy, the other copies' calls (one token:
    k experts each) read at least twice the last-level cache."""
    per_call = k * 3 * H * I * BYTES[fmt]
    return max(2, min(8, math.ceil(2 * llc / per_call) + 1))


class Cycle:
    """Calls the forwards of several copies of a native layer in turn, keeping each call's phase
    times (microseconds: route, gather, up, down, reduce)."""

    def __init__(self, ops):
        self.ops, self.i, self.phases = ops, 0, []

    def __call__(self, *args):
        self.i += 1
        op = self.ops[self.i % len(self.ops)]
        out = op.forward(*args)
        self.phases.append([v / 1e3 for v in op.op.last_phase_ns])
        return out


def routing(T: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    w, ids = scores.topk(k, dim=-1)
    return ids.contiguous(), (w / w.sum(-1, keepdim=True)).float().contiguous()


def touched_bytes(ids: torch.Tensor, H: int, I: int, fmt: str) -> float:
    return ids.unique().numel() * 3 * H * I * BYTES[fmt]


def timeit(fn, calls: list, repeats: int, min_seconds: float = 0.3) -> float:
    """Median seconds per call, cycling through `calls` (different routings each call, so the
    touched experts are not left in the caches by the previous call). Warms every copy of a Cycle."""
    for _ in range(len(getattr(fn, "ops", [fn]))):
        fn(*calls[-1])
    if isinstance(fn, Cycle):
        fn.phases.clear()
    times = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < repeats or time.perf_counter() < t_end:
        args = calls[len(times) % len(calls)]
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        if len(times) > 200:
            break
    return statistics.median(times)


class TorchLoop:
    name = "torch-loop-bf16"

    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x, ids, wts):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in ids.unique().tolist():
            rows, slot = torch.where(ids == e)
            h = torch.nn.functional.silu(x[rows] @ self.gate[e].T) * (x[rows] @ self.up[e].T)
            out.index_add_(0, rows, (h @ self.down[e].T).float() * wts[rows, slot, None])
        return out


class KtKernel:
    """kt-kernel's AMX MoE (bf16 or int8), through its low-level API."""

    def __init__(self, gate, up, down, k, fmt, threads):
        try:
            import kt_kernel_ext as kt  # optional baseline
        except ImportError:
            from kt_kernel import kt_kernel_ext as kt

        E, I, H = gate.shape
        self.kt, self.k, self.H = kt, k, H
        self.cpu = kt.CPUInfer(threads)
        cfg = kt.moe.MOEConfig(E, k, H, I, 0)
        self.keep = [gate.contiguous(), up.contiguous(), down.contiguous(), torch.arange(E, dtype=torch.int64)]
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in self.keep[:3])
        for name in ("gate_scale", "up_scale", "down_scale"):
            if hasattr(cfg, name):
                setattr(cfg, name, 0)
        if hasattr(cfg, "physical_to_logical_map"):
            cfg.physical_to_logical_map = self.keep[3].data_ptr()
        if hasattr(cfg, "pool"):
            cfg.pool = self.cpu.backend_
        if hasattr(cfg, "max_len"):
            cfg.max_len = 4096
        cls = kt.moe.AMXBF16_MOE if fmt == "bf16" else kt.moe.AMXInt8_MOE
        self.moe = cls(cfg)
        self.cpu.submit(self.moe.load_weights_task())
        self.cpu.sync()
        self.name = f"kt-kernel-{fmt}"

    def __call__(self, x, ids, wts):
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        qlen = torch.tensor([x.shape[0]], dtype=torch.int32)
        self.cpu.submit(self.moe.forward_task(qlen.data_ptr(), self.k, ids.data_ptr(), wts.data_ptr(),
                                              x.data_ptr(), out.data_ptr(), False))
        self.cpu.sync()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3,dsv3")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default="bf16,int8,int4,fp8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch loop")
    ap.add_argument("--torch-max-tokens", type=int, default=1024)
    ap.add_argument("--out", default=str(__import__("pathlib").Path(__file__).parent / "moe_kernel.jsonl"))
    a = ap.parse_args()
    threads = native.pool().threads
    torch.set_num_threads(threads)
    bw = dram_read_gbps()
    dram = bw["dram"]
    crossover = native.module().amx_crossover() if "amx" in native.kernel_paths() else None
    llc = llc_bytes()
    info = dict(**machine(), commit=commit(), threads=threads, paths=native.kernel_paths(), dram_gbps=dram,
                dram_torch_sum_gbps=bw["torch_sum"], dram_native_stream_gbps=bw["native_stream"],
                amx_crossover=crossover, llc_bytes=llc)
    print(f"# {info}")
    rows, failures = [], []
    kernels = kernel_table(a.shapes.split(","), threads)
    for r in kernels:
        r.update(info)
    rows += kernels
    print(f"{'shape':6s} {'impl':18s} {'T':>5s} {'us/call':>10s} {'GB/s':>7s} {'of DRAM':>7s} {'TFLOPS':>7s}"
          f" {'op':>7s}  {' '.join(PHASES)} (us)")
    print("# of DRAM: touched bytes / call time / DRAM read bandwidth; op: the same for the native\n"
          "# operator's own time (its phases, without the Python call), then the phases' medians")
    for shape in a.shapes.split(","):
        E, k, H, I = SHAPES[shape]
        g = torch.Generator().manual_seed(0)
        gate = (torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16()
        up = (torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16()
        down = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
        impls = []
        fp8 = {}  # fp8 is packed from e4m3 bytes and 128 x 128 block scales, as an FP8 release holds them
        if "fp8" in a.formats.split(","):
            from ktflow.frontend.quant import Fp8Matrix, quantize

            fp8 = {e: tuple(Fp8Matrix(*quantize(t[e], (128, 128)), (128, 128)) for t in (gate, up, down))
                   for e in range(E)}
        for fmt in a.formats.split(","):
            ops = [native.ExpertOp(E, H, I, fmt=fmt) for _ in range(layer_copies(k, H, I, fmt, llc))]
            for op in ops:
                op.pack(lambda e: fp8[e] if fmt == "fp8" else (gate[e], up[e], down[e]))
            impls.append((f"ktflow-{fmt}", fmt, Cycle(ops)))
            print(f"# ktflow-{fmt}: {len(ops)} copies of the layer")
        if not a.no_torch:
            impls.append(("torch-loop-bf16", "bf16", TorchLoop(gate, up, down)))
        for fmt in ("bf16", "int8"):
            try:
                kk = KtKernel(gate, up, down, k, fmt, threads)
                impls.append((kk.name, fmt, kk))
            except Exception as e:  # noqa: BLE001 - optional baseline
                print(f"# kt-kernel {fmt} unavailable: {type(e).__name__}: {e}")
        for T in map(int, a.tokens.split(",")):
            n_calls = max(2, min(32, 4096 // T))
            calls = [(torch.randn(T, H, generator=g).bfloat16(), *routing(T, E, k, seed=T * 100 + i))
                     for i in range(n_calls)]
            for name, fmt, fn in impls:
                if name.startswith("torch") and T > a.torch_max_tokens:
                    continue
                try:
                    s = timeit(fn, calls, a.repeats)
                except Exception as e:  # noqa: BLE001 - report it, finish the table, exit non-zero
                    failures.append(f"{shape} {name} T={T}: {type(e).__name__}: {e}")
                    print(f"# FAILED {failures[-1]}")
                    continue
                nbytes = statistics.mean(touched_bytes(ids, H, I, fmt) for _, ids, _ in calls)
                gbps, tflops = nbytes / s / 1e9, 2 * T * k * 3 * H * I / s / 1e12
                frac = gbps / dram
                phases, op_frac = {}, None
                if isinstance(fn, Cycle):  # ktflow: where the time went (medians over the calls)
                    phases = {p: statistics.median(c[i] for c in fn.phases) for i, p in enumerate(PHASES)}
                    op_frac = nbytes / (sum(phases.values()) * 1e-6) / 1e9 / dram
                print(f"{shape:6s} {name:18s} {T:5d} {s * 1e6:10.1f} {gbps:7.1f} {frac:7.0%} {tflops:7.2f}"
                      + (f" {op_frac:7.0%}  " + " ".join(f"{v:.0f}" for v in phases.values()) if phases else ""))
                rows.append(dict(bench="moe_kernel", shape=shape, E=E, k=k, H=H, I=I, impl=name, T=T,
                                 us=s * 1e6, gbps=gbps, dram_fraction=frac, tflops=tflops, phases_us=phases,
                                 op_dram_fraction=op_frac, **info))
    append_jsonl(a.out, rows)
    if failures:
        raise SystemExit("failed:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
