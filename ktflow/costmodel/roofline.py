"""The cost model: what a node's work costs on each device, and what a PCIe transfer costs.

Work (FLOPs and bytes moved) comes from the per-op facts table (ktflow.ir.ops.FACTS); this file
turns it into seconds with one roofline per device:

    seconds = max(flops / peak, bytes / bandwidth) + fixed overhead

GPU: bf16 tensor throughput, HBM bandwidth, one kernel launch (the grouped routed-experts rule of a
prefill step: the longer of its work and a launch for each of its ops). CPU: bf16 GEMM throughput (half
for float32), the bandwidth a GEMV streams weights at, one task submit. On N > 1 sockets a node
that is not NUMA-split reads (N-1)/N of its bytes across the socket link (which bounds it when
slower); a NUMA shard gets its own node's share of throughput and bandwidth, all local. Routed experts read only
the experts their tokens hit: with T tokens and per-expert pick probabilities p_e (uniform k/E,
or a routing profile's measured frequencies) the expected bytes are sum_e (1 - (1 - p_e)^T)
times one expert's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, FetchAttrs, Op, Work, expert_weight_bytes, experts_hit_fraction
from ..ir.types import Cost, Device, DType
from .collectives import collective_seconds
from .hw import HwProfile
from .memory import GROUPED_ROWS

#: GPU ops the grouped routed-experts rules issue outside a capture: a whole layer
#: (backends.kernels.moe_gpu.grouped_experts) per node (map, sort and count the picks), a part of a
#: layer (a streamed group, a split layer's GPU part: `grouped_part`) per node (its offsets) and
#: its share of the layer's one sort and count (`LayerPicks`); both per block of GROUPED_ROWS
#: picks (gather, three grouped products, SiLU, weighting, scatter), a block that cuts the rows
#: shifting its offsets. Each costs a launch from the host, which overlaps the GPU's work on
#: earlier ones, so a node takes the longer of its work and its launches: a layer streamed as many
#: small groups is bound by the launches (tests/test_cost.py counts the ops)
GROUPED_NODE_OPS, GROUPED_PART_OPS, GROUPED_LAYER_OPS = 11, 4, 4
GROUPED_BLOCK_OPS, GROUPED_CUT_OPS = 11, 2


def is_part(n: Node) -> bool:
    """A routed-experts node the GPU runs as a part of its layer (`grouped_part`): a streamed
    group (it reads a fetch) or a split layer's fixed GPU part (not a cache's rows)."""
    a = n.attrs
    return len(n.inputs) >= 3 or (len(a.ids) < a.experts and not a.cached)


@dataclass(frozen=True)
class Roof:
    """One device's roofline: peak FLOP/s, bytes/s, fixed seconds per op."""

    flops: float
    bandwidth: float
    overhead: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops, nbytes / self.bandwidth) + self.overhead


def roof(hw: HwProfile, device: Device, act: DType) -> Roof | None:
    """The roofline of `device` in `hw` (None for a GPU the profile does not have)."""
    if device == Device.GPU:
        if not hw.gpus:
            return None
        g = hw.gpus[0]
        e = g.efficiency
        return Roof(g.bf16_tflops * 1e12 * e * (0.5 if act == DType.F32 else 1.0), g.hbm_gbps * 1e9 * e,
                    hw.overheads.gpu_launch_us * 1e-6)
    c = hw.cpu
    return Roof(c.gemm_tflops * 1e12 * (0.5 if act == DType.F32 else 1.0), c.gemv_gbps * 1e9,
                hw.overheads.cpu_op_us * 1e-6)


def transfer_seconds(nbytes: float, hw: HwProfile, direction: str) -> float:
    """PCIe copy of `nbytes`: 'h2d' host to GPU or 'd2h' GPU to host, plus one launch."""
    if not hw.gpus:
        raise ConfigError(f"hardware profile {hw.name!r} has no GPU to copy to or from")
    g = hw.gpus[0]
    bw = g.pcie_h2d_gbps if direction == "h2d" else g.pcie_d2h_gbps
    return nbytes / (bw * 1e9) + hw.overheads.gpu_launch_us * 1e-6


def fetch_seconds(a: FetchAttrs, hw: HwProfile, act: DType) -> float:
    """Streaming experts to the GPU: the packed bytes over PCIe, then one conversion pass on the
    GPU reading them and writing the GPU layout."""
    g = hw.gpus[0]
    converted = len(a.subset) * 3 * a.hidden * a.inter * act.itemsize
    return transfer_seconds(a.link_bytes, hw, "h2d") + (a.link_bytes + converted) / (g.hbm_gbps * 1e9 * g.efficiency)


def rows_per_expert(n: Node, work: Work) -> float:
    """Expected tokens per expert a routed-experts step computes (over the experts it hits)."""
    a = n.attrs
    flops = FACTS[n.op].flops(a, work)
    hit = experts_hit_fraction(a, work) * len(a.ids)
    return flops / (6.0 * a.hidden * a.inter * a.slice_fraction) / max(hit, 1e-9)


def node_work(n: Node, g: Graph, work: Work, weight_itemsize: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one step of `n`: weights read (the op's fraction), state read (KV cache)
    and activations in and out."""
    facts = FACTS[n.op]
    flops = facts.flops(n.attrs, work)
    io = sum(g.by_name(i).out.numel(work.tokens) * g.by_name(i).out.dtype.itemsize for i in n.inputs)
    io += n.out.numel(work.tokens) * n.out.dtype.itemsize
    nbytes = (n.weight_bytes(weight_itemsize) * facts.weight_fraction(n.attrs, work)
              + facts.state_elems(n.attrs, work) * g.act_dtype.itemsize + io)
    return flops, nbytes


def grouped_pick_bytes(n: Node, work: Work, act_itemsize: int) -> float:
    """GPU memory traffic of routed experts on the GPU beyond their weights and products
    (backends.moe_gpu.grouped_experts): every pick of the step in the node's rank range sorted
    by expert, then the node's own picks gathered, SiLU'd, masked and summed in fp32. The parts
    of a layer (`is_part`) sort its picks once between them: each pays its share."""
    a = n.attrs
    lo, hi = a.rank_range
    picks = work.tokens * (hi - lo) * (len(a.ids) / a.experts if is_part(n) else 1.0)
    own = FACTS[n.op].flops(a, work) / (6.0 * a.hidden * a.inter * a.slice_fraction) if a.hidden and a.inter else 0.0
    rows = a.rows[1] - a.rows[0]
    return picks * 32 + own * (a.hidden * (4 * act_itemsize + 20) + 5 * rows * act_itemsize)


def held_weight_bytes(n: Node, device: Device, weight_itemsize: int, expert_format: str) -> float:
    """Bytes of weights `n` holds on `device`: routed experts on the CPU (and the fetches that
    stream them from there) packed in `expert_format`, scales included; the rest at
    `weight_itemsize`, or at their stored size where held in FP8 (Node.weight_bytes)."""
    if device == Device.CPU and n.op in (Op.ROUTED_EXPERTS, Op.FETCH):
        return n.weight_elems() * expert_weight_bytes(expert_format, n.attrs.hidden, n.attrs.inter)
    return n.weight_bytes(weight_itemsize)


def node_cost(n: Node, g: Graph, work: Work, hw: HwProfile, weight_itemsize: int, numa_nodes: int = 1,
              expert_format: str = "bf16") -> Cost:
    """FLOPs, bytes and seconds of one step of `n` on each device. A NUMA shard (placement with a
    numa index) gets 1/numa_nodes of the CPU's throughput and bandwidth: its node's share.
    Weights are read at `weight_itemsize` bytes each, or at their stored size where held in FP8
    (a GPU routed expert held so reads about half the bytes of one in bf16: the decode rule
    gathers the picks' FP8 bytes), but routed experts on the CPU at their packed size in
    `expert_format` (int8: about 1 byte, int4: about 0.5)."""
    pricing = FACTS[n.op].pricing
    if pricing == "fetch":
        s = fetch_seconds(n.attrs, hw, g.act_dtype)
        return Cost(tokens=work.tokens, flops=0.0, bytes=n.attrs.link_bytes, cpu_s=s, gpu_s=s)
    if pricing == "collective":  # the ranks' link, ring algorithms (a CPU rank: gloo, priced the same)
        nbytes = n.out.numel(work.tokens) * 4  # summed in float32 (torch_ref._collective)
        s = collective_seconds(n.attrs.kind, nbytes, n.attrs.ranks, hw)
        return Cost(tokens=work.tokens, flops=0.0, bytes=nbytes, cpu_s=s, gpu_s=s)
    if pricing != "compute":
        nbytes = n.out.numel(work.tokens) * n.out.dtype.itemsize
        if pricing == "copy":
            s = transfer_seconds(nbytes, hw, "h2d" if n.attrs.dst == "gpu" else "d2h")
        else:
            s = (hw.overheads.cpu_submit_us if pricing == "submit" else hw.overheads.cpu_sync_us) * 1e-6
        return Cost(tokens=work.tokens, flops=0.0, bytes=nbytes if pricing == "copy" else 0.0, cpu_s=s, gpu_s=s)
    flops, nbytes = node_work(n, g, work, weight_itemsize)
    cpu_bytes = nbytes
    if n.op == Op.ROUTED_EXPERTS:  # the CPU reads its packed copy (the GPU its own: FP8-held ones at their size)
        per = expert_weight_bytes(expert_format, n.attrs.hidden, n.attrs.inter)
        fraction = FACTS[n.op].weight_fraction(n.attrs, work)
        cpu_bytes += (n.weight_elems() * per - n.weight_bytes(weight_itemsize)) * fraction
    cpu = roof(hw, Device.CPU, g.act_dtype)
    half = 0.5 if g.act_dtype == DType.F32 else 1.0
    if n.op == Op.ROUTED_EXPERTS and flops > 0:  # the native operator's measured rate at this many rows per expert
        cpu = Roof(hw.cpu.expert_rate(rows_per_expert(n, work)) * half, cpu.bandwidth, cpu.overhead)
    if n.op == Op.ROUTED_EXPERTS and n.attrs.deferred:  # its own task's extra time
        cpu = Roof(cpu.flops, cpu.bandwidth, cpu.overhead + hw.overheads.cpu_deferred_us * 1e-6)
    sockets = len(hw.cpu.numa)
    if n.place is not None and n.place.numa is not None:
        cpu = Roof(cpu.flops / numa_nodes, cpu.bandwidth / numa_nodes, cpu.overhead)
    elif sockets > 1 and hw.cpu.cross_socket_gbps > 0:
        # not NUMA-aware: its data is spread over the sockets, so (N-1)/N of every read is remote
        # and crosses the socket link, which may be the slower path
        remote = (sockets - 1) / sockets / (hw.cpu.cross_socket_gbps * 1e9)
        cpu = Roof(cpu.flops, 1.0 / max(1.0 / cpu.bandwidth, remote), cpu.overhead)
    gpu = roof(hw, Device.GPU, g.act_dtype)
    if gpu is not None:  # measured prefill rates where the probe took them
        measured = {Op.ATTENTION: hw.gpus[0].attention_tflops, Op.ROUTED_EXPERTS: hw.gpus[0].grouped_tflops}.get(n.op)
        if measured:
            gpu = Roof(measured * 1e12 * half, gpu.bandwidth, gpu.overhead)
    # a prefill step (more tokens than sequences) runs GPU experts by the grouped path; a decode
    # step by the captured per-pick rule, which this does not price
    grouped = n.op == Op.ROUTED_EXPERTS and work.tokens > work.batch
    gpu_bytes = nbytes + (grouped_pick_bytes(n, work, g.act_dtype.itemsize) if grouped else 0.0)
    gpu_s = gpu.seconds(flops, gpu_bytes) if gpu else None
    if gpu is not None and grouped:  # the host issues its ops while the GPU runs earlier ones: the slower
        a = n.attrs
        picks = flops / (6.0 * a.hidden * a.inter * a.slice_fraction) if a.hidden and a.inter else 0.0
        blocks = max(1, math.ceil(picks / GROUPED_ROWS))
        ops = (GROUPED_PART_OPS + GROUPED_LAYER_OPS * len(a.ids) / a.experts if is_part(n) else GROUPED_NODE_OPS) \
            + (GROUPED_BLOCK_OPS + (GROUPED_CUT_OPS if blocks > 1 else 0)) * blocks
        gpu_s = max(gpu_s - gpu.overhead, ops * gpu.overhead)
    return Cost(tokens=work.tokens, flops=flops, bytes=nbytes, cpu_s=cpu.seconds(flops, cpu_bytes), gpu_s=gpu_s)
