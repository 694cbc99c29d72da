"""The hardware probe: this machine measured into a hardware profile (`ktflow hw probe`).

`probe()` times DRAM read bandwidth with all cores, the CPU's bf16 GEMM and the native expert
kernel, and, with a GPU, its HBM bandwidth, bf16 GEMM, grouped products, PCIe both ways, the
launch overhead and the CPU hand-off inside a replayed graph; with several GPUs, each one's PCIe
and NUMA node and the NCCL link between them. It runs backend kernels, so it
lives here, above the profile module (`ktflow.costmodel.hw`), which only describes machines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..costmodel.hw import GB, GUESSED_LINK, GpuLink, GpuSpec, HwProfile, NumaNode, Overheads, this_machine


def _best_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def probe(quick: bool = False, log: Callable[[str], None] = lambda s: None) -> HwProfile:
    """Measure this machine. `quick` uses fewer repeats and smaller CPU compute sizes (seconds,
    for tests; the CPU's GEMM and expert FLOP rates come out lower), but still reads past the
    last-level cache where it measures a bandwidth (a buffer the cache holds reads at the cache's
    rate: a 64 MiB quick buffer read 231 GB/s on a GPU host whose decode streamed experts at about
    158), and times every GPU measurement at its full size (milliseconds each; a small grouped
    product ran at 10 of the H100's 144 TFLOPS and priced every long prompt's streamed experts too
    slow).

    DRAM: read bandwidth of a float32 sum over a buffer far larger than the caches, all cores.
    CPU GEMM: bf16 square matrix product through torch (oneDNN: AMX where present). GEMV: weight
    bytes per second the kernel that runs CPU experts streams at decode: the native routed-experts
    operator on its pool, one token picking 8 bf16 experts of a set 8x the last-level cache
    (torch's bf16 matrix-vector product where the native module is not built; it streams
    several times slower). GPU: device copy
    (read + write bytes), bf16 GEMM, pinned host<->device copies, the time per tiny kernel
    launch, and the CPU task hand-off round trip inside a replayed graph
    (`backends/handoff_probe.py`; priced as cpu_submit_us + cpu_sync_us, the sync taking what
    the submit's value leaves). Per-node DRAM bandwidth is the measured total split evenly over
    the nodes.
    """
    import torch

    base = this_machine()
    nthreads = torch.get_num_threads()
    reps = 2 if quick else 5
    measured = []

    def dram_read(n: int) -> float:
        buf = torch.ones(n // 4, dtype=torch.float32)
        return n / _best_seconds(lambda: buf.sum(), reps) / GB

    def gemm_tflops(m: int) -> float:
        a, b = torch.randn(m, m).bfloat16(), torch.randn(m, m).bfloat16()
        return 2 * m ** 3 / _best_seconds(lambda: a @ b, reps) / 1e12

    def gemv_gbps(rows: int) -> float:
        w, x = torch.randn(rows, 8192).bfloat16(), torch.randn(8192).bfloat16()
        return w.numel() * 2 / _best_seconds(lambda: w @ x, reps) / GB

    n = min(1 << 30, max(64 << 20, 4 * last_level_cache_bytes())) if quick else (1 << 30)
    dram = dram_read(n)
    log(f"DRAM read: {dram:.1f} GB/s ({n >> 20} MiB, {nthreads} threads)")
    m = 512 if quick else 2048
    gemm = gemm_tflops(m)
    log(f"CPU bf16 GEMM {m}x{m}x{m}: {gemm:.2f} TFLOPS")
    gemv = _native_expert_gbps(quick)
    table: list[tuple[float, float]] = []
    if gemv is not None:
        log(f"CPU routed experts (native kernel, 1 token, 8 picks): {gemv:.1f} GB/s of weights")
        table = _native_expert_tflops(quick)
        log("CPU routed experts (native kernel) by rows per expert: "
            + ", ".join(f"{rows:.0f} rows {t:.2f} TFLOPS" for rows, t in table))
        measured.append("expert_tflops")
    else:
        rows = max(2048 if quick else 16384, 4 * last_level_cache_bytes() // (8192 * 2))  # past the cache
        gemv = gemv_gbps(rows)
        log(f"CPU bf16 GEMV {rows}x8192 (torch; the native module is not built): {gemv:.1f} GB/s of weights")
    measured += ["dram_gbps", "gemm_tflops", "gemv_gbps"]

    numa = [NumaNode(cores=node.cores, memory_bytes=node.memory_bytes, dram_gbps=dram / len(base.cpu.numa))
            for node in base.cpu.numa]
    cpu = base.cpu.model_copy(update=dict(numa=numa, gemm_tflops=gemm, gemv_gbps=gemv, expert_tflops=table))
    gpus, link, overheads = [], None, base.overheads
    if torch.cuda.is_available():
        gpus, link, overheads = _probe_gpus(torch, quick, reps, overheads, len(base.cpu.numa), log)
        measured += ["hbm_gbps", "bf16_tflops", "pcie_h2d_gbps", "pcie_d2h_gbps", "gpu_launch_us", "attention_tflops",
                     "grouped_tflops"] + (["gpu_link"] if link is not None else [])
        from .handoff_probe import round_trip_us

        trip = round_trip_us(n=8 if quick else 32, reps=reps)
        if trip is not None:  # priced whole: submit keeps its value, the sync takes the rest
            overheads = overheads.model_copy(update=dict(cpu_sync_us=max(trip - overheads.cpu_submit_us, 0.0)))
            measured.append("cpu_sync_us")
            log(f"CPU task hand-off in a replayed graph (doorbell, dispatcher, done flag; empty task): {trip:.1f} us "
                "round trip")
    return HwProfile(name="probed", description=f"measured on this machine{' (quick)' if quick else ''}",
                     cpu=cpu, gpus=gpus, gpu_link=link, overheads=overheads, measured=measured)


def last_level_cache_bytes() -> int:
    """Size of CPU 0's largest cache, from sysfs (32 MiB where it does not say)."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        if size.rstrip("KMG").isdigit():
            best = max(best, int(size.rstrip("KMG")) * mult)
    return best or 32 << 20


def _probe_experts(hidden: int, inter: int, experts: int | None, most: int, seed: int):
    """(operator, expert count, generator) for a probe: `experts` bf16 experts of hidden x inter
    (None: eight times the last-level cache, at least 64, at most `most`), each packed on its
    own so its bytes are real."""
    import torch

    from ..backends.native import binding as native

    if experts is None:
        experts = min(most, max(64, -(-8 * last_level_cache_bytes() // (3 * hidden * inter * 2))))
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(inter, hidden, generator=g).bfloat16() for _ in range(2))
    down = torch.randn(hidden, inter, generator=g).bfloat16()
    op = native.ExpertOp(experts, hidden, inter)
    op.pack(lambda e: (gate, up, down))
    return op, experts, g


def _native_expert_gbps(quick: bool) -> float | None:
    """Weight bytes/s of the native routed-experts operator at decode: 32 one-token calls, each
    picking 8 random experts of a set of bf16 experts (2048 x 1408, DeepSeek-V2-Lite's) eight
    times the last-level cache, at least 64 (a smaller set is partly served from the cache and
    overstates DRAM-bound decode: 64 experts read 127 GB/s on the GPU host, where decode streamed
    at most 114); quick: experts of 1024 x 512, as many (8x the cache, at least 64)."""
    import torch

    from ..backends.native import binding as native

    if not native.available():
        return None
    k, calls = 8, 32
    hidden, inter = (1024, 512) if quick else (2048, 1408)
    op, experts, g = _probe_experts(hidden, inter, None, 1024, seed=0)
    x = torch.randn(1, hidden, generator=g).bfloat16()
    picks = [torch.randperm(experts, generator=g)[:k].view(1, k) for _ in range(calls)]
    weights = torch.full((1, k), 1.0 / k)
    out = torch.empty(1, hidden)

    def run():
        for ids in picks:
            op.forward(x, ids, weights, out)

    seconds = _best_seconds(run, 2 if quick else 5)
    return calls * k * 3 * hidden * inter * 2 / seconds / GB


def _native_expert_tflops(quick: bool) -> list[tuple[float, float]]:
    """The native routed-experts operator's FLOP rate at several rows per expert (prefill):
    bf16 experts of 2048 x 768 (Qwen3-30B-A3B's), as many as 8x the last-level cache holds (at
    least 64, at most 256: a layer's experts stream from DRAM in a real prefill; a smaller set
    may partly stay in the cache: 32 experts gave 3.0-4.4 TFLOPS on the GPU host where the
    operator ran at 1.0-2.0 inside a prefill), 8 picks
    per token spread evenly so each expert computes exactly `rows` rows; quick: 16 experts of
    512 x 256."""
    import torch

    k = 8
    hidden, inter = (512, 256) if quick else (2048, 768)
    op, experts, g = _probe_experts(hidden, inter, 16 if quick else None, 256, seed=1)
    out = []
    for rows in ((16, 64, 256) if quick else (16, 64, 256, 1024)):
        tokens = rows * experts // k
        ids = ((torch.arange(tokens)[:, None] * k + torch.arange(k)[None, :]) % experts).to(torch.int64)
        x = torch.randn(tokens, hidden, generator=g).bfloat16()
        wts = torch.full((tokens, k), 1.0 / k)
        dst = torch.empty(tokens, hidden)
        seconds = _best_seconds(lambda: op.forward(x, ids, wts, dst), 2 if quick or rows >= 1024 else 3)
        out.append((float(rows), 6.0 * tokens * k * hidden * inter / seconds / 1e12))
    return out


def _probe_gpus(torch, quick: bool, reps: int, overheads: Overheads, numa_nodes: int,
                log) -> tuple[list[GpuSpec], GpuLink | None, Overheads]:
    """Every CUDA device: the first in full (`_probe_gpu`), each other one's PCIe copies both ways
    (its rates copied from the first where it is the same model, else probed in full too), each
    one's NUMA node from sysfs; with several, the link between them (`_probe_link`)."""
    first, overheads = _probe_gpu(torch, quick, reps, overheads, log)
    gpus = [first.model_copy(update={"numa_node": _numa_node(torch, 0, numa_nodes)})]
    for i in range(1, torch.cuda.device_count()):
        with torch.cuda.device(i):
            p = torch.cuda.get_device_properties(i)
            if p.name == first.name:
                h2d, d2h = _pcie(torch, reps)
                g = first.model_copy(update=dict(memory_bytes=float(p.total_memory), pcie_h2d_gbps=h2d,
                                                 pcie_d2h_gbps=d2h))
                log(f"GPU {i} {p.name}: PCIe {h2d:.1f}/{d2h:.1f} GB/s h2d/d2h (the rest as GPU 0's)")
            else:
                g, _ = _probe_gpu(torch, quick, reps, overheads, log)
        gpus.append(g.model_copy(update={"numa_node": _numa_node(torch, i, numa_nodes)}))
    link = None
    if len(gpus) > 1:
        try:
            link = _probe_link(torch, len(gpus), reps, log)
        except (RuntimeError, ImportError) as e:  # a torch without NCCL: the guess `this` makes, said so
            link = GUESSED_LINK
            log(f"GPU link not measured ({type(e).__name__}: {e}); guessed: PCIe, {link.allreduce_busbw_gbps:.0f} GB/s")
    return gpus, link, overheads


def _numa_node(torch, index: int, numa_nodes: int) -> int:
    """The NUMA node CUDA device `index`'s PCIe link hangs off (sysfs; 0 where unknown)."""
    p = torch.cuda.get_device_properties(index)
    if not all(hasattr(p, f) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return 0  # this torch does not say where the device sits
    bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return 0
    return node if 0 <= node < numa_nodes else 0


def _pcie(torch, reps: int, size: int = 1 << 28) -> tuple[float, float]:
    """Pinned host <-> current device copies of `size` bytes: (h2d, d2h) GB/s."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(size, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = size / _best_seconds(lambda: dev_buf.copy_(host, non_blocking=True), reps, sync) / GB
    d2h = size / _best_seconds(lambda: host.copy_(dev_buf, non_blocking=True), reps, sync) / GB
    return h2d, d2h


def _probe_link(torch, n: int, reps: int, log) -> GpuLink:
    """The link between `n` CUDA devices, through NCCL in this process (torch.cuda.nccl): a 256
    MiB all-reduce's bus bandwidth (2 (n - 1) / n x bytes / time), an 8-byte one's time (50 back
    to back), and a copy from GPU 0 to GPU 1. NVLink where that copy outruns PCIe 5.0 x16 (more
    than 100 GB/s)."""
    from torch.cuda import nccl

    def sync_all():
        for i in range(n):
            torch.cuda.synchronize(i)

    big = [torch.ones(64 << 20, dtype=torch.float32, device=f"cuda:{i}") for i in range(n)]
    nbytes = big[0].numel() * 4
    busbw = 2 * (n - 1) / n * nbytes / _best_seconds(lambda: nccl.all_reduce(big), reps, sync_all) / GB
    tiny = [torch.ones(2, dtype=torch.float32, device=f"cuda:{i}") for i in range(n)]
    times = 50  # back to back, one sync: the all-reduce's own time, not the host's syncs

    def tiny_ones():
        for _ in range(times):
            nccl.all_reduce(tiny)

    latency_us = _best_seconds(tiny_ones, reps, sync_all) / times * 1e6
    dst = torch.empty_like(big[1])
    p2p = nbytes / _best_seconds(lambda: dst.copy_(big[0], non_blocking=True), reps, sync_all) / GB
    kind = "nvlink" if p2p > 100 else "pcie"
    log(f"GPU link ({n} GPUs, {kind}): all-reduce bus {busbw:.0f} GB/s, {latency_us:.1f} us an 8-byte one; "
        f"GPU 0 -> 1 {p2p:.0f} GB/s")
    return GpuLink(kind=kind, allreduce_busbw_gbps=busbw, allreduce_latency_us=latency_us, p2p_gbps=p2p)


def _probe_gpu(torch, quick: bool, reps: int, overheads: Overheads, log) -> tuple[GpuSpec, Overheads]:
    """The current CUDA device: device copy (read + write bytes), bf16 GEMM, pinned copies both
    ways, launch time. Each takes milliseconds at full size, so quick only repeats less (a quick
    2048 GEMM ran at 230 TFLOPS on an H100 whose 8192 one ran at 780)."""
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    hbm = 2 * size / _best_seconds(lambda: dst.copy_(src), reps, sync) / GB
    g = 8192
    ga, gb = torch.randn(g, g, device=dev, dtype=torch.bfloat16), torch.randn(g, g, device=dev, dtype=torch.bfloat16)
    tflops = 2 * g ** 3 / _best_seconds(lambda: ga @ gb, reps, sync) / 1e12
    h2d, d2h = _pcie(torch, reps, size // 4)
    tiny = torch.zeros(16, device=dev)
    launches = 200 if quick else 2000

    def many():
        for _ in range(launches):
            tiny.add_(1)

    launch_us = _best_seconds(many, reps, sync) / launches * 1e6
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(torch.cuda.Stream()):  # a new stream's first matrix product allocates its workspace
        product = ga[:1] @ gb
    sync()
    workspace = torch.cuda.memory_allocated() - before - product.numel() * product.element_size()
    del ga, gb, src, dst, product
    attention, grouped = _prefill_rates(torch, reps, sync)
    log(f"GPU {p.name}: HBM {hbm:.0f} GB/s, bf16 {tflops:.0f} TFLOPS, PCIe {h2d:.1f}/{d2h:.1f} GB/s h2d/d2h, "
        f"launch {launch_us:.1f} us, BLAS workspace {workspace / 2**20:.0f} MiB per stream; prefill: causal attention "
        f"{attention:.0f} TFLOPS, grouped experts {grouped:.0f} TFLOPS")
    return (GpuSpec(name=p.name, memory_bytes=float(p.total_memory), hbm_gbps=hbm, bf16_tflops=tflops,
                    pcie_h2d_gbps=h2d, pcie_d2h_gbps=d2h, workspace_bytes=float(max(workspace, 0)),
                    attention_tflops=attention, grouped_tflops=grouped),
            overheads.model_copy(update=dict(gpu_launch_us=launch_us)))


def _prefill_rates(torch, reps: int, sync) -> tuple[float, float]:
    """TFLOPS of the GPU rules a long prefill runs: causal flash attention (32 heads of 128, 8192
    tokens) and the grouped routed experts (Qwen3-30B-A3B's 128 experts of 2048 x 768, 8 picks per
    token for 8192 tokens). Milliseconds each on a datacenter GPU, so a quick probe takes them at
    these sizes too: smaller products run far below the rate a long prompt's get."""
    import torch.nn.functional as F

    from ..backends.kernels.moe_gpu import expert_map, grouped_experts

    dev, bf = torch.device("cuda"), torch.bfloat16
    t = 8192
    q, kk, v = (torch.randn(1, 32, t, 128, device=dev, dtype=bf) for _ in range(3))
    attention = 2 * t * t * 128 * 32 / _best_seconds(lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True),
                                                     reps, sync) / 1e12
    del q, kk, v
    experts, hidden, inter, k = 128, 2048, 768, 8
    gate, up = (torch.randn(experts, inter, hidden, device=dev, dtype=bf) * 0.02 for _ in range(2))
    down = torch.randn(experts, hidden, inter, device=dev, dtype=bf) * 0.02
    x = torch.randn(t, hidden, device=dev, dtype=bf)
    ids = torch.rand(t, experts, device=dev).argsort(dim=1)[:, :k]  # k distinct experts a token
    wts = torch.rand(t, k, device=dev)
    local = expert_map(tuple(range(experts)), experts, dev)
    seconds = _best_seconds(lambda: grouped_experts(x, ids, wts, local, gate, up, down), reps, sync)
    return attention, 6 * t * k * hidden * inter / seconds / 1e12


