"""Hardware profiles: what the cost model and placement know about a machine.

A profile is a pydantic model, read from and written to JSON as it is. `resolve_hw` accepts a
profile object, a preset name, a path to a profile JSON, or None / 'this' for this machine as
the OS and torch describe it (with conservative throughput guesses: run `ktflow hw probe` to
measure them; the probe is `ktflow.tools.probe`, which runs kernels: this module runs none).
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import ConfigError

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
    #: the NUMA node the GPU's PCIe link hangs off: host memory there reaches it without crossing
    #: the socket link
    numa_node: int = Field(0, ge=0)


class GpuLink(_Frozen):
    """How the GPUs of one host reach each other, as NCCL measures it: the bus bandwidth of a
    large all-reduce (each link's rate under the ring: time = 2 (n - 1) / n x bytes / busbw), the
    time of a tiny one, and one GPU's send to another."""

    kind: Literal["nvlink", "pcie"]
    allreduce_busbw_gbps: float = Field(gt=0)
    allreduce_latency_us: float = Field(ge=0)
    p2p_gbps: float = Field(gt=0)


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
    """A machine: its CPU (NUMA nodes), its GPUs (gpu:0..N-1, each on a NUMA node) and, with
    more than one, the link between them (`gpu_link`)."""

    name: str
    description: str = ""
    cpu: CpuSpec
    gpus: list[GpuSpec] = []
    gpu_link: GpuLink | None = None
    overheads: Overheads = Overheads()
    measured: list[str] = []  # fields `probe` measured on this machine; the rest are quoted or guessed

    @model_validator(mode="after")
    def _gpus_fit_the_machine(self) -> "HwProfile":
        for i, g in enumerate(self.gpus):
            if g.numa_node >= len(self.cpu.numa):
                raise ValueError(f"gpus[{i}] ({g.name}) hangs off NUMA node {g.numa_node}, but the CPU has "
                                 f"{len(self.cpu.numa)} node(s)")
        if len(self.gpus) > 1 and self.gpu_link is None:
            raise ValueError(f"{len(self.gpus)} GPUs need gpu_link (their all-reduce bus bandwidth and latency, "
                             "GPU-to-GPU rate): `ktflow hw probe` measures it")
        return self

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
        for i, g in enumerate(self.gpus):
            where = f" (gpu:{i}, NUMA node {g.numa_node})" if len(self.gpus) > 1 or len(c.numa) > 1 else ""
            lines.append(f"  gpu   {g.name}{where}: {g.memory_bytes / GiB:.0f} GiB, HBM {g.hbm_gbps:.0f} GB/s, "
                         f"bf16 {g.bf16_tflops:.0f} TFLOPS, PCIe {g.pcie_h2d_gbps:.0f}/{g.pcie_d2h_gbps:.0f} GB/s h2d/d2h"
                         + (f", kernels at {g.efficiency:.0%} of roofline" if g.efficiency < 1 else "")
                         + (f"; prefill: attention {g.attention_tflops:.0f}, grouped experts {g.grouped_tflops:.0f} TFLOPS"
                            if g.attention_tflops and g.grouped_tflops else ""))
        if not self.gpus:
            lines.append("  gpu   none")
        if self.gpu_link is not None:
            k = self.gpu_link
            lines.append(f"  link  {k.kind} between the GPUs: all-reduce bus {k.allreduce_busbw_gbps:.0f} GB/s, "
                         f"{k.allreduce_latency_us:.0f} us a tiny one; GPU to GPU {k.p2p_gbps:.0f} GB/s")
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

_AMX = IsaFlags(avx512f=True, avx512_bf16=True, avx512_vnni=True, amx_bf16=True, amx_int8=True)
_H100 = GpuSpec(name="NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB, hbm_gbps=3350, bf16_tflops=780,
                pcie_h2d_gbps=55, pcie_d2h_gbps=55, efficiency=0.45)

#: the link `this` assumes between GPUs it has not measured (and the probe, where NCCL is missing)
GUESSED_LINK = GpuLink(kind="pcie", allreduce_busbw_gbps=10, allreduce_latency_us=30, p2p_gbps=10)


def _h100_server(n: int, cores: int, memory_gib: int, dram_gbps: float, gemm_tflops: float, gemv_gbps: float,
                 latency_us: float) -> HwProfile:
    """Xeon cores with AMX and `n` H100s over NVLink, like the n-GPU machine kinds (link rates quoted)."""
    words = {2: "two", 4: "four"}.get(n, str(n))
    return HwProfile(
        name=f"h100-x{n}", description=f"{cores} Xeon cores (AMX) + {words} NVIDIA H100 80GB (NVLink), like the "
                                       f"{n}-GPU machine kind; link rates quoted",
        cpu=CpuSpec(name=f"{cores} Xeon cores (AMX)",
                    numa=[NumaNode(cores=cores, memory_bytes=memory_gib * GiB, dram_gbps=dram_gbps)],
                    isa=_AMX, gemm_tflops=gemm_tflops, gemv_gbps=gemv_gbps),
        gpus=[_H100] * n,
        gpu_link=GpuLink(kind="nvlink", allreduce_busbw_gbps=350, allreduce_latency_us=latency_us, p2p_gbps=350))


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
                    isa=_AMX, gemm_tflops=4.86, gemv_gbps=110),
        gpus=[_H100]),
    # several GPUs (issue 44): links quoted, not measured (`ktflow hw probe` measures them). Consumer
    # RTX 4090s have no peer-to-peer path: NCCL goes through host memory.
    "2x-rtx4090-workstation": HwProfile(
        name="2x-rtx4090-workstation",
        description="two RTX 4090s (PCIe 4.0 x16 each, no peer-to-peer) beside a 32-core single-socket workstation "
                    "with 512 GB of 8-channel DDR5; link rates quoted",
        cpu=CpuSpec(name="32-core workstation CPU", numa=[NumaNode(cores=32, memory_bytes=512 * GiB, dram_gbps=250)],
                    isa=IsaFlags(avx512f=True, avx512_bf16=True, avx512_vnni=True), gemm_tflops=3.0, gemv_gbps=200),
        gpus=[GpuSpec(name="NVIDIA RTX 4090", memory_bytes=24 * GiB, hbm_gbps=1008, bf16_tflops=165,
                      pcie_h2d_gbps=25, pcie_d2h_gbps=25)] * 2,
        gpu_link=GpuLink(kind="pcie", allreduce_busbw_gbps=10, allreduce_latency_us=30, p2p_gbps=12)),
    "h100-x2": _h100_server(2, cores=32, memory_gib=256, dram_gbps=200, gemm_tflops=9.7, gemv_gbps=190,
                            latency_us=15),
    "h100-x4": _h100_server(4, cores=64, memory_gib=512, dram_gbps=300, gemm_tflops=19.4, gemv_gbps=280,
                            latency_us=20),
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
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            p = torch.cuda.get_device_properties(i)
            gpus.append(GpuSpec(name=p.name, memory_bytes=float(p.total_memory), hbm_gbps=1000, bf16_tflops=100,
                                pcie_h2d_gbps=20, pcie_d2h_gbps=20))
    except Exception:
        pass
    link = GUESSED_LINK if len(gpus) > 1 else None
    return HwProfile(name="this", description="this machine, throughputs guessed (run `ktflow hw probe` to measure)",
                     cpu=cpu, gpus=gpus, gpu_link=link)


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
        from ..util.fsutil import read_model_json

        return read_model_json(HwProfile, p, "hardware profile")
    raise ConfigError(f"unknown hardware profile {s!r}; use a preset ({', '.join(PRESETS)}), 'this', "
                      "or a path to a profile JSON")
