"""The CPU routed experts of a backend's plans on the native pool (`NativeExperts`): each CPU
routed-experts node (NUMA shards included) runs on the C++ fused MoE operator
(ktflow.backends.native.binding), and each fetch streams experts from the same packed copy to the
GPU (staging.py). Two rules go into the backend's rule table: GPU routed experts grouped over the
fetched or the stacked weights, and the fetch.

Each CPU routed-experts node runs on an `ExpertOp` holding the layer's experts that live in host
memory (the plan's `host`: GPU-resident experts are never packed) and the node's intermediate rows
(its NUMA slice), on the pool group of its NUMA index (or split over every group when the plan did
not split it); a node over fewer experts (the CPU part of a split prefill layer) computes its own
through a mask. A fetch copies from the packs the plan names (`packs`). Packed weights are cached
on disk (KTFLOW_CACHE_DIR, default ~/.cache/ktflow/packed) keyed by the checkpoint files, the
node's tensors and rows, the format and the split, so a second load only reads them back.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import torch

from . import binding as native
from ...errors import WeightError
from ...frontend.weights import WeightSource
from ...ir.graph import Graph, Node
from ...ir.ops import Op, host_packs
from ...ir.types import Device
from ...util import env
from ..base import node_key
from ..kernels import moe_gpu
from ..base import staged
from .staging import ExpertStager, pieces_of


def cache_dir() -> Path | None:
    """Where packed experts are cached: KTFLOW_CACHE_DIR (default ~/.cache/ktflow/packed); 'off':
    nowhere (pack at every load; for disks without room for a second copy of the experts)."""
    where = env.get("KTFLOW_CACHE_DIR")
    if where == "off":
        return None
    return Path(where or Path.home() / ".cache" / "ktflow" / "packed")


def _checkpoint_digest(weights: WeightSource) -> str:
    """The checkpoint files' identity: each file's resolved path, device, inode, size, mtime and
    ctime (a file replaced, rewritten or copied over gets another inode or ctime, which no
    `touch` sets back), and the hash of its safetensors header taken when it was opened (every
    tensor's name, dtype, shape and offsets). Packed experts cached under another identity are never used."""
    h = hashlib.sha256()
    for name, f in sorted(weights.files.items()):
        path = Path(f.path).resolve()
        st = os.stat(path)
        h.update(f"{name}:{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:"
                 f"{f.header_digest};".encode())
    return h.hexdigest()


def _fingerprint(checkpoint: str, refs, ids: tuple[int, ...], rows: tuple[int, int]) -> str:
    """What packed weights depend on: the checkpoint, the tensor keys, the experts and rows."""
    h = hashlib.sha256(checkpoint.encode())
    h.update(repr([r.key for r in refs]).encode())
    h.update(repr((ids, rows)).encode())
    return h.hexdigest()


class NativeExperts:
    """The native side of a backend's plans (see the module doc). `device_of(node)` is the torch
    device a node runs on; the packed experts are in `expert_format`, unpacked to `dtype`."""

    def __init__(self, dtype: torch.dtype, expert_format: str, device_of: Callable[[Node], torch.device]):
        native.module()  # a clear error now if the module is not built
        self.dtype, self.expert_format, self.device_of = dtype, expert_format, device_of
        # prepared state per node (keyed by node_key: plans reuse node names for different work)
        self.ops: dict[tuple, native.ExpertOp] = {}
        self.masks: dict[tuple, torch.Tensor] = {}  # its experts, where its operator holds more
        self.stagers: dict[tuple, ExpertStager] = {}  # fetch -> where its experts are packed
        self.loaded: dict[str, str] = {}  # node name -> 'cache', 'packed' or 'shared'
        # one operator per (tensors, the layer's host experts, rows, NUMA node): the nodes of every
        # plan over the same weights share its packed copy (a deferred `.def` node, the CPU part of a
        # split prefill layer, a fetch that streams them to the GPU), each computing its own experts
        self._packed: dict[tuple, native.ExpertOp] = {}
        self._local_maps: dict[tuple, torch.Tensor] = {}  # streamed experts node -> its ids' rows
        self._held_ids: dict[tuple, torch.Tensor] = {}  # a part of a layer -> its expert ids on its device

    @staticmethod
    def takes(node: Node) -> bool:
        """Whether the native side prepares `node`: a CPU routed-experts node or a fetch."""
        return node.op == Op.FETCH or (node.op == Op.ROUTED_EXPERTS and node.place is not None
                                       and node.place.device == Device.CPU)

    def prepare(self, graph: Graph, weights: WeightSource | None) -> list[Node]:
        """Pack (or share) what `graph`'s CPU routed-experts nodes and fetches read; returns the
        nodes it took, whose weights nothing else loads."""
        todo = [n for n in graph.nodes if self.takes(n) and node_key(n) not in self.ops
                and node_key(n) not in self.stagers]
        if not todo or weights is None:
            return []
        checkpoint = _checkpoint_digest(weights)
        from ...util.progress import bar

        for n in bar(todo, "packing experts", "node", show=len(todo) > 1):
            ids = n.attrs.host  # the layer's experts in host memory: set by the plan's lowering
            if n.op == Op.FETCH:  # the packs the plan names (one over every row in a plan made without them)
                packs = n.attrs.packs or ((0, n.attrs.inter, None),)
                self.stagers[node_key(n)] = self._stager(n, ids, packs, weights, checkpoint)
            else:
                self.ops[node_key(n)] = self._operator(n, ids, n.attrs.rows, n.place.numa, weights, checkpoint)
                if n.attrs.ids != ids:
                    mask = torch.zeros(n.attrs.experts, dtype=torch.uint8)
                    mask[list(n.attrs.ids)] = 1
                    self.masks[node_key(n)] = mask
        return todo

    def runs(self, node: Node) -> bool:
        """Whether `node` runs on the native pool (a prepared CPU routed-experts node)."""
        return node_key(node) in self.ops

    def run(self, node: Node, inputs: list[Any], spin: bool) -> Any:
        """A prepared CPU routed-experts node on the pool (`spin`: the workers spin between
        tasks, for steps whose other ops are not on the CPU)."""
        native.set_spinning(spin)
        x, (ids, wts) = inputs
        xb = x.to(torch.bfloat16).contiguous()
        out = torch.empty(xb.shape, dtype=torch.bfloat16)
        self.ops[node_key(node)].forward(xb, ids.contiguous(), wts.float().contiguous(), out=out,
                                         ranks=node.attrs.rank_range, mask=self.masks.get(node_key(node)))
        return out.to(x.dtype)

    def rules(self) -> dict[Op, Callable]:
        """The rules the backend's rule table takes from the native side: GPU routed experts
        grouped over the fetched or the stacked weights, and the fetch from its packs."""
        return {Op.ROUTED_EXPERTS: self._gpu_experts, Op.FETCH: self._fetch}

    def _gpu_experts(self, be, node: Node, w, ins, ctx, dev):
        x, (ids, wts) = ins[:2]
        a = node.attrs
        lo, hi = a.rank_range
        if len(ins) >= 3:
            gate, up, down = staged(ins[2], a.hidden, a.inter)
            key = node_key(node)
            if key not in self._local_maps:
                self._local_maps[key] = moe_gpu.expert_map(a.ids, a.experts, dev)
            local = self._local_maps[key]
        else:
            st = be.stacked(node)
            gate, up, down, local = st["gate"], st["up"], st["down"], st["local"]
        addend = ins[3] if len(ins) == 4 else None
        if len(ins) >= 3 or (len(a.ids) < a.experts and not a.cached):
            # a part of its layer (a streamed group, a split layer's GPU part; not a cache, whose rows
            # the runtime refills): the layer's picks sorted by expert and counted (one host read)
            # once for all its parts; each takes its own as slices, in the staged or stacked rows'
            # order (a.ids)
            if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                picks = ctx.once(("layer picks", a.layer, lo, hi), lambda: moe_gpu.LayerPicks(ids[:, lo:hi], a.experts))
                key = node_key(node)
                if key not in self._held_ids:
                    self._held_ids[key] = torch.tensor(a.ids, dtype=torch.int64, device=dev)
                chosen, offs, counts = picks.part(a.ids, self._held_ids[key])
                return moe_gpu.grouped_part(x, picks.k, wts[:, lo:hi], chosen, offs, counts, gate, up, down,
                                            addend=addend, running=a.running)
        return moe_gpu.grouped_experts(x, ids[:, lo:hi], wts[:, lo:hi], local, gate, up, down,
                                       addend=addend, running=a.running)

    def _fetch(self, be, node: Node, w, ins, ctx, dev):
        out = ctx.staging.get(node.name) if ctx.staging else None  # a borrowing step: the lent region
        return self.stagers[node_key(node)].stage(node.attrs.subset, out=out, landing=ctx.landing)

    def _operator(self, n: Node, ids: tuple[int, ...], rows: tuple[int, int], numa: int | None,
                  weights: WeightSource, checkpoint: str) -> native.ExpertOp:
        key = (tuple(r.key for r in n.weights), ids, rows, numa)
        if key in self._packed:
            self.loaded[n.name] = "shared"
        else:
            self._packed[key] = self._pack(n, ids, rows, numa, weights, checkpoint)
        return self._packed[key]

    def cpu_expert_mask(self, node: Node) -> torch.Tensor | None:
        """The uint8 mask of the experts CPU routed-experts node `node` computes, where its
        operator holds more (writes to it take effect at the next task; `native.sync()` first
        while tasks may run); None where it computes all it holds."""
        return self.masks.get(node_key(node))

    def cpu_expert_stager(self, parts: list[Node], weights: WeightSource, device) -> ExpertStager:
        """A stager over the packed CPU copy of every expert of a cached layer, from the plan's CPU
        parts of that layer (`parts`: a cached layer's CPU side holds them all), landing on
        `device`: the expert cache refills its GPU rows from it, a copy over PCIe and an unpack on
        the GPU, no CPU work."""
        n = parts[0]
        packs = host_packs(parts, n.attrs.inter)
        return self._stager(n, tuple(range(n.attrs.experts)), packs, weights, _checkpoint_digest(weights), device)

    def _stager(self, n: Node, ids: tuple[int, ...], packs, weights: WeightSource, checkpoint: str,
                device=None) -> ExpertStager:
        """Where a fetch's experts are copied from: the packs `packs` ((first row, end row, NUMA
        node) tiling the rows) of experts `ids`, each shared with the CPU part that computes on it
        or packed here, landing on `device` (default: the node's)."""
        a = n.attrs
        chosen = [(lo, self._operator(n, ids, (lo, hi), numa, weights, checkpoint)) for lo, hi, numa in packs]
        pieces = pieces_of([op for _, op in chosen], [lo for lo, _ in chosen])
        return ExpertStager(pieces, self.expert_format, a.hidden, a.inter, device or self.device_of(n), self.dtype)

    def _pack(self, n: Node, ids: tuple[int, ...], rows: tuple[int, int], numa: int | None, weights: WeightSource,
              checkpoint: str) -> native.ExpertOp:
        a = n.attrs
        lo, hi = rows
        pool = native.pool()
        groups = [numa % pool.groups] if numa is not None else None
        op = native.ExpertOp(a.experts, a.hidden, hi - lo, held=ids, fmt=self.expert_format, groups=groups,
                             group_size=native.fp8_group(self.expert_format, weights.quant))
        refs = {r.role: r for r in n.weights}

        def tensors(e: int):  # FP8 ones as stored: packed from the checkpoint's bytes
            g, u, d = (weights.load_expert_stored(refs[role], e) for role in ("gate", "up", "down"))
            return native.rows_of(g, lo, hi), native.rows_of(u, lo, hi), native.cols_of(d, lo, hi)

        try:
            self.loaded[n.name] = op.pack(tensors, cache=cache_dir(),
                                          fingerprint=_fingerprint(checkpoint, n.weights, ids, rows))
        except WeightError as e:
            keys = ", ".join(refs[role].key for role in ("gate", "up", "down"))
            raise WeightError(f"layer {a.layer} ({keys}): {e}") from None
        return op
