"""Hardware profiles: what the cost model and placement know about a machine.

A profile is a pydantic model, read from and written to JSON as it is. `resolve_hw` accepts a
profile object, a preset name, a path to a profile JSON, or None / 'this' for this machine as
the OS and torch describe it (with conservative throughput guesses: run `ktflow hw probe` to
measure them). `probe()` measures this machine: DRAM read bandwidth with all cores, CPU bf16
GEMM and GEMV, and when a GPU is present its HBM bandwidth, bf16 GEMM, PCIe both ways and the
launch overhead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from .errors import ConfigError

GB = 1e9
GiB = 1 << 30


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuSpec(_Frozen):
    name: str
    memory_bytes: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    pcie_h2d_gbps: float = Field(gt=0)
    pcie_d2h_gbps: float = Field(gt=0)
    # fraction of the bf16/HBM roofline the GPU's kernels reach on a decode step (small GEMVs,
    # attention over a short cache, norms): peak numbers overstate them. Presets are calibrated
    # against a measured layer timeline; the runtime's measured step times refine it.
    efficiency: float = Field(1.0, gt=0, le=1)
    # GPU memory the BLAS library takes per CUDA stream that runs matrix products (torch's cuBLAS
    # workspace: 32 MiB on Hopper, measured by the probe); a plan counts one per compute stream
    workspace_bytes: float = Field(32 * 2**20, ge=0)
    # measured prefill rates (TFLOPS), used instead of bf16_tflops x efficiency where present: causal
    # flash attention over a long prompt, and routed experts as one grouped matrix product
    attention_tflops: float | None = Field(None, gt=0)
    grouped_tflops: float | None = Field(None, gt=0)


class NumaNode(_Frozen):
    cores: int = Field(gt=0)
    memory_bytes: float = Field(gt=0)
    dram_gbps: float = Field(gt=0)  # read bandwidth of this node's memory, all its cores


class IsaFlags(_Frozen):
    avx512f: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False


class CpuSpec(_Frozen):
    name: str
    numa: list[NumaNode] = Field(min_length=1)
    cross_socket_gbps: float = Field(0.0, ge=0)  # remote-node read bandwidth (0 with one node)
    isa: IsaFlags = IsaFlags()
    gemm_tflops: float = Field(gt=0)  # bf16 matrix throughput, all cores (measured or quoted)
    gemv_gbps: float = Field(gt=0)  # weight bytes/s a bf16 matrix-vector product streams, all cores
    # the native routed-experts operator's measured rate by rows per expert: (rows, TFLOPS) pairs,
    # rows ascending; empty: gemm_tflops at every size. Few rows per expert run far below the
    # square-GEMM rate (AVX-512 kernels, small AMX tiles), many rows close to it.
    expert_tflops: list[tuple[float, float]] = []

    def expert_rate(self, rows: float) -> float:
        """FLOP/s of the routed-experts operator at `rows` tokens per expert: the measured table,
        interpolated in log(rows) and held flat past its ends (gemm_tflops without a table)."""
        import math

        table = self.expert_tflops
        if not table:
            return self.gemm_tflops * 1e12
        if rows <= table[0][0]:
            return table[0][1] * 1e12
        for (r0, t0), (r1, t1) in zip(table, table[1:]):
            if rows <= r1:
                f = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return (t0 + f * (t1 - t0)) * 1e12
        return table[-1][1] * 1e12

    @property
    def cores(self) -> int:
        return sum(n.cores for n in self.numa)

    @property
    def memory_bytes(self) -> float:
        return sum(n.memory_bytes for n in self.numa)

    @property
    def dram_gbps(self) -> float:
        return sum(n.dram_gbps for n in self.numa)


class Overheads(_Frozen):
    gpu_launch_us: float = Field(5.0, ge=0)  # one kernel launch from the host
    cpu_submit_us: float = Field(2.0, ge=0)  # enqueue one CPU task
    #: the fixed time of one op on the CPU besides its FLOPs and bytes (the host's dispatch of a
    #: torch op or a native call); `ktflow calibrate` fits it
    cpu_op_us: float = Field(2.0, ge=0)
    #: the fixed time of one launch of a captured decode plan besides its ops (the graph's launch
    #: and start on the GPU, the host's wait for its end and its token read back): the greedy steps
    #: one launch runs share it; `ktflow calibrate` fits it
    graph_step_us: float = Field(0.0, ge=0)
    #: the fixed time of every captured decode step besides its scheduled ops, which K greedy
    #: steps a launch do not share (what the step's first and last ops take beyond their roofline:
    #: the token's embedding, the head and the argmax between layers' chains); `ktflow calibrate`
    #: fits it from the exact plan run one step a launch against K steps a launch
    decode_step_us: float = Field(0.0, ge=0)
    cpu_sync_us: float = Field(5.0, ge=0)  # wait for CPU work and see its result
    #: the extra time of a deferred expert task (a layer's lowest-ranked picks, run as a second CPU
    #: task beside the GPU's next layer) over its bytes at the CPU's rate; `ktflow calibrate` fits
    #: it from a deferred plan's replayed steps (0 until then)
    cpu_deferred_us: float = Field(0.0, ge=0)


class HwProfile(_Frozen):
    name: str
    description: str = ""
    cpu: CpuSpec
    gpus: list[GpuSpec] = []
    overheads: Overheads = Overheads()
    measured: list[str] = []  # fields `probe` measured on this machine; the rest are quoted or guessed

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def summary(self) -> str:
        c = self.cpu
        isa = ", ".join(k for k, v in c.isa.model_dump().items() if v) or "none of note"
        lines = [f"{self.name}: {self.description}".rstrip(": "),
                 f"  cpu   {c.name}: {c.cores} cores in {len(c.numa)} NUMA node(s), "
                 f"{c.memory_bytes / GiB:.0f} GiB, DRAM {c.dram_gbps:.0f} GB/s"
                 + (f" (cross-socket {c.cross_socket_gbps:.0f} GB/s)" if len(c.numa) > 1 else ""),
                 f"        bf16 GEMM {c.gemm_tflops:.2f} TFLOPS, GEMV {c.gemv_gbps:.0f} GB/s; ISA: {isa}"]
        if c.expert_tflops:
            lines.append("        routed experts: " + ", ".join(f"{r:.0f} rows/expert {t:.2f} TFLOPS"
                                                             for r, t in c.expert_tflops))
        for g in self.gpus:
            lines.append(f"  gpu   {g.name}: {g.memory_bytes / GiB:.0f} GiB, HBM {g.hbm_gbps:.0f} GB/s, "
                         f"bf16 {g.bf16_tflops:.0f} TFLOPS, PCIe {g.pcie_h2d_gbps:.0f}/{g.pcie_d2h_gbps:.0f} GB/s h2d/d2h"
                         + (f", kernels at {g.efficiency:.0%} of roofline" if g.efficiency < 1 else "")
                         + (f"; prefill: attention {g.attention_tflops:.0f}, grouped experts {g.grouped_tflops:.0f} TFLOPS"
                            if g.attention_tflops and g.grouped_tflops else ""))
        if not self.gpus:
            lines.append("  gpu   none")
        o = self.overheads
        lines.append(f"  fixed launch {o.gpu_launch_us:.1f} us, CPU op {o.cpu_op_us:.1f} us, CPU submit "
                     f"{o.cpu_submit_us:.1f} us, sync {o.cpu_sync_us:.1f} us, captured launch {o.graph_step_us:.0f} us "
                     f"and step {o.decode_step_us:.0f} us, "
                     f"deferred task +{o.cpu_deferred_us:.0f} us")
        if self.measured:
            lines.append("  measured: " + ", ".join(self.measured))
        return "\n".join(lines) + "\n"


_XEON_8452Y = CpuSpec(
    name="2x Intel Xeon Platinum 8452Y", numa=[NumaNode(cores=36, memory_bytes=1024 * GiB, dram_gbps=220)] * 2,
    cross_socket_gbps=125, isa=IsaFlags(avx512f=True, avx512_bf16=True, avx512_vnni=True, amx_bf16=True, amx_int8=True),
    gemm_tflops=2 * 21.3, gemv_gbps=2 * 180)
# The paper's GPUs reach 45% of their roofline on a DeepSeek-V3 decode layer: at that value the
# predicted layer timeline reproduces the paper's figure 10 (no deferral: GPU 28%, CPU 77%, overlap
# 5%; 3 deferred: CPU 100%, GPU 37%; 2 deferred: layer 19% shorter), where peak numbers predict GPU
# 15%. Assumed the same for the RTX 4080.
_PCIE4 = dict(pcie_h2d_gbps=32, pcie_d2h_gbps=32, efficiency=0.45)
_PAPER = "the KTransformers paper's machine (SOSP'25 section 6.1): 220 GB/s per socket, 125 GB/s cross-socket, PCIe 4.0"

PRESETS: dict[str, HwProfile] = {
    "paper-a100": HwProfile(name="paper-a100", description=_PAPER + ", A100 40GB", cpu=_XEON_8452Y,
                            gpus=[GpuSpec(name="NVIDIA A100 40GB", memory_bytes=40 * GiB, hbm_gbps=1555,
                                          bf16_tflops=312, **_PCIE4)]),
    "paper-4080": HwProfile(name="paper-4080", description=_PAPER + ", RTX 4080 16GB", cpu=_XEON_8452Y,
                            gpus=[GpuSpec(name="NVIDIA RTX 4080", memory_bytes=16 * GiB, hbm_gbps=717,
                                          bf16_tflops=97.5, **_PCIE4)]),
    "rtx4090-desktop": HwProfile(
        name="rtx4090-desktop", description="RTX 4090 + a single-socket 16-core desktop with two DDR5 channels",
        cpu=CpuSpec(name="16-core desktop CPU", numa=[NumaNode(cores=16, memory_bytes=192 * GiB, dram_gbps=80)],
                    isa=IsaFlags(avx512f=True, avx512_bf16=True, avx512_vnni=True), gemm_tflops=1.5, gemv_gbps=65),
        gpus=[GpuSpec(name="NVIDIA RTX 4090", memory_bytes=24 * GiB, hbm_gbps=1008, bf16_tflops=165,
                      pcie_h2d_gbps=25, pcie_d2h_gbps=25)]),
    # the benchmarks' GPU machine (16 Xeon cores with AMX of a larger host, PCIe 5.0): CPU, DRAM and
    # PCIe as `ktflow hw probe` measured them there (benchmarks/RESULTS.md), an H100 80GB with the
    # paper presets' kernel efficiency; `ktflow hw probe` on the machine itself is better
    "h100": HwProfile(
        name="h100", description="16 Xeon cores (AMX) + NVIDIA H100 80GB over PCIe 5.0, like the benchmarks' GPU machine",
        cpu=CpuSpec(name="16 Xeon cores (AMX)", numa=[NumaNode(cores=16, memory_bytes=128 * GiB, dram_gbps=116)],
                    isa=IsaFlags(avx512f=True, avx512_bf16=True, avx512_vnni=True, amx_bf16=True, amx_int8=True),
                    gemm_tflops=4.86, gemv_gbps=110),
        gpus=[GpuSpec(name="NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB, hbm_gbps=3350, bf16_tflops=780,
                      pcie_h2d_gbps=55, pcie_d2h_gbps=55, efficiency=0.45)]),
    "cpu": HwProfile(
        name="cpu", description="a generic 16-core x86-64 server CPU, no GPU",
        cpu=CpuSpec(name="generic 16-core x86-64", numa=[NumaNode(cores=16, memory_bytes=128 * GiB, dram_gbps=80)],
                    isa=IsaFlags(avx512f=True), gemm_tflops=1.0, gemv_gbps=60)),
}


# ------------------------------------------------------------------------------ this machine


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _mem_total() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 16.0 * GiB


def _numa_layout() -> list[tuple[int, float]]:
    """(cores, memory bytes) per NUMA node, from sysfs; one node with everything when absent.
    Where sysfs counts less memory than /proc/meminfo (some VMs), the total is spread over the
    nodes in proportion."""
    nodes = []
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = _count_cpulist((d / "cpulist").read_text().strip())
            kb = next(int(line.split()[3]) for line in (d / "meminfo").read_text().splitlines() if "MemTotal" in line)
            if cpus:
                nodes.append((cpus, kb * 1024.0))
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    total = _mem_total()
    if nodes:
        counted = sum(m for _, m in nodes)
        if counted < 0.9 * total:
            nodes = [(c, m * total / counted) for c, m in nodes]
        return nodes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return [(cores, total)]


def _count_cpulist(s: str) -> int:
    n = 0
    for part in filter(None, s.split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def this_machine() -> HwProfile:
    """This machine from what the OS and torch report; throughputs are guesses until probed."""
    flags = _cpu_flags()
    isa = IsaFlags(avx512f="avx512f" in flags, avx512_bf16="avx512_bf16" in flags,
                   avx512_vnni="avx512_vnni" in flags, amx_bf16="amx_bf16" in flags, amx_int8="amx_int8" in flags)
    layout = _numa_layout()
    numa = [NumaNode(cores=c, memory_bytes=m, dram_gbps=5.0 * c) for c, m in layout]
    cores = sum(c for c, _ in layout)
    cpu = CpuSpec(name=_cpu_name(), numa=numa, cross_socket_gbps=2.5 * cores if len(numa) > 1 else 0.0, isa=isa,
                  gemm_tflops=(0.2 if isa.amx_bf16 else 0.05) * cores, gemv_gbps=4.0 * cores)
    gpus = []
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            gpus.append(GpuSpec(name=p.name, memory_bytes=float(p.total_memory), hbm_gbps=1000, bf16_tflops=100,
                                pcie_h2d_gbps=20, pcie_d2h_gbps=20))
    except Exception:
        pass
    return HwProfile(name="this", description="this machine, throughputs guessed (run `ktflow hw probe` to measure)",
                     cpu=cpu, gpus=gpus)


def with_this_gpus_memory(profile: HwProfile) -> HwProfile:
    """`profile` with its first GPU's memory set to this machine's CUDA device's (unchanged where
    torch sees none): a preset's speeds for a plan this GPU will accept (`check_gpu` refuses a plan
    placed for another memory size). Tests and benchmarks that place by a preset's rates use it."""
    import torch

    if not profile.gpus or not torch.cuda.is_available():
        return profile
    here = float(torch.cuda.get_device_properties(0).total_memory)
    return profile.model_copy(update={"gpus": [profile.gpus[0].model_copy(update={"memory_bytes": here}),
                                               *profile.gpus[1:]]})


# ------------------------------------------------------------------------------------- probe


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
    gpus, overheads = [], base.overheads
    if torch.cuda.is_available():
        gpus, overheads = _probe_gpu(torch, quick, reps, overheads, log)
        measured += ["hbm_gbps", "bf16_tflops", "pcie_h2d_gbps", "pcie_d2h_gbps", "gpu_launch_us", "attention_tflops",
                     "grouped_tflops"]
        from .backends.handoff_probe import round_trip_us

        trip = round_trip_us(n=8 if quick else 32, reps=reps)
        if trip is not None:  # priced whole: submit keeps its value, the sync takes the rest
            overheads = overheads.model_copy(update=dict(cpu_sync_us=max(trip - overheads.cpu_submit_us, 0.0)))
            measured.append("cpu_sync_us")
            log(f"CPU task hand-off in a replayed graph (doorbell, dispatcher, done flag; empty task): {trip:.1f} us "
                "round trip")
    return HwProfile(name="probed", description=f"measured on this machine{' (quick)' if quick else ''}",
                     cpu=cpu, gpus=gpus, overheads=overheads, measured=measured)


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

    from . import native

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

    from . import native

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


def _probe_gpu(torch, quick: bool, reps: int, overheads: Overheads, log) -> tuple[list[GpuSpec], Overheads]:
    """GPU 0: device copy (read + write bytes), bf16 GEMM, pinned copies both ways, launch time.
    Each takes milliseconds at full size, so quick only repeats less (a quick 2048 GEMM ran at 230
    TFLOPS on an H100 whose 8192 one ran at 780)."""
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    p = torch.cuda.get_device_properties(0)
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    hbm = 2 * size / _best_seconds(lambda: dst.copy_(src), reps, sync) / GB
    g = 8192
    ga, gb = torch.randn(g, g, device=dev, dtype=torch.bfloat16), torch.randn(g, g, device=dev, dtype=torch.bfloat16)
    tflops = 2 * g ** 3 / _best_seconds(lambda: ga @ gb, reps, sync) / 1e12
    host = torch.empty(size // 4, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(size // 4, dtype=torch.uint8, device=dev)
    h2d = host.numel() / _best_seconds(lambda: dev_buf.copy_(host, non_blocking=True), reps, sync) / GB
    d2h = host.numel() / _best_seconds(lambda: host.copy_(dev_buf, non_blocking=True), reps, sync) / GB
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
    del ga, gb, src, dst, host, dev_buf, product
    attention, grouped = _prefill_rates(torch, reps, sync)
    log(f"GPU {p.name}: HBM {hbm:.0f} GB/s, bf16 {tflops:.0f} TFLOPS, PCIe {h2d:.1f}/{d2h:.1f} GB/s h2d/d2h, "
        f"launch {launch_us:.1f} us, BLAS workspace {workspace / 2**20:.0f} MiB per stream; prefill: causal attention "
        f"{attention:.0f} TFLOPS, grouped experts {grouped:.0f} TFLOPS")
    return ([GpuSpec(name=p.name, memory_bytes=float(p.total_memory), hbm_gbps=hbm, bf16_tflops=tflops,
                     pcie_h2d_gbps=h2d, pcie_d2h_gbps=d2h, workspace_bytes=float(max(workspace, 0)),
                     attention_tflops=attention, grouped_tflops=grouped)],
            overheads.model_copy(update=dict(gpu_launch_us=launch_us)))


def _prefill_rates(torch, reps: int, sync) -> tuple[float, float]:
    """TFLOPS of the GPU rules a long prefill runs: causal flash attention (32 heads of 128, 8192
    tokens) and the grouped routed experts (Qwen3-30B-A3B's 128 experts of 2048 x 768, 8 picks per
    token for 8192 tokens). Milliseconds each on a datacenter GPU, so a quick probe takes them at
    these sizes too: smaller products run far below the rate a long prompt's get."""
    import torch.nn.functional as F

    from .backends.moe_gpu import expert_map, grouped_experts

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


# ----------------------------------------------------------------------------------- resolve


def resolve_hw(hw: "HwProfile | str | os.PathLike | None") -> HwProfile:
    """A profile from a profile object, a preset name, 'this' / None, or a profile JSON path."""
    if hw is None or hw == "this":
        return this_machine()
    if isinstance(hw, HwProfile):
        return hw
    s = str(hw)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if p.suffix == ".json" or p.exists():
        from .fsutil import read_model_json

        return read_model_json(HwProfile, p, "hardware profile")
    raise ConfigError(f"unknown hardware profile {s!r}; use a preset ({', '.join(PRESETS)}), 'this', "
                      "or a path to a profile JSON")
