"""Resident routed experts lent to long prompts as their staging (the VRAM plan's time-share design).

`LentRegion(engine, nodes)` moves the stacked weights of GPU routed-experts nodes `nodes` (the
decode plan's `Plan.lent_experts`) into one contiguous device buffer, the region, through a copy
of its bytes kept in page-locked host memory (so the move never holds two device copies; where
the one block cannot be had, the stacks are put back and the error says so). Every
reader keeps working: the stacks, their per-expert rows and their FP8 scales become views of the
region. The region is made when the decode plan's executor is made, before any CUDA graph is
captured, so captured graphs read the region's addresses, which never change.

`borrow(nbytes)` hands a prefill step the region's first `nbytes` (uint8: its staging and landing
buffers) and marks it dirty: the lent experts' weights are then overwritten. `restore()` copies
the borrowed bytes back from the host copy, bit for bit, and clears the mark. The executor
restores before any plan that does not borrow runs (`runtime.executor`), so a decode step never
reads a lent expert's bytes while they are someone's staging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError, ResourceError
from ..ir.graph import Node
from .base import node_key
from .kernels.fp8_gpu import Fp8Weight
from .native.staging import pin_tensor

ALIGN = 256  # bytes: each lent tensor starts at a multiple (the device's widest access)
ROLES = ("gate", "up", "down")


@dataclass
class _Lent:
    """Where one stacked tensor of a lent node sits in the region."""

    key: tuple
    role: str
    part: str  # "" (a stack in the activation dtype), "data" or "scale_inv" (one held in FP8)
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _parts(stack) -> list[tuple[str, torch.Tensor]]:
    return [("data", stack.data), ("scale_inv", stack.scale_inv)] if isinstance(stack, Fp8Weight) else [("", stack)]


class LentRegion:
    """The lent experts' region of one engine (module doc); `nodes` is not empty."""

    def __init__(self, engine, nodes: list[Node]):
        self.engine = engine
        self.nodes = list(nodes)
        layout: list[_Lent] = []
        at = 0
        sources: list[torch.Tensor] = []
        for n in self.nodes:
            stacked = engine.stacked(n)
            for role in ROLES:
                for part, t in _parts(stacked[role]):
                    layout.append(_Lent(node_key(n), role, part, at, tuple(t.shape), t.dtype))
                    sources.append(t)
                    at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.nbytes = at
        device = sources[0].device
        # the host copy first, then the device copies dropped, then the region: one device copy at a
        # time. Page-locked by registering it (torch's pinned allocator would round it up to a power
        # of two); where the driver refuses, the restores copy from pageable memory, slower.
        self.host = torch.empty(at, dtype=torch.uint8)
        if device.type == "cuda":
            pin_tensor(self.host)
        for lent, t in zip(layout, sources, strict=True):
            self._bytes(self.host, lent).copy_(t.contiguous().view(-1).view(torch.uint8))
        del sources, t
        for n in self.nodes:  # the engine's own references go; its stacks are rebuilt over the region below
            stacked = engine.stacked(n)
            for role in ROLES:
                stacked[role] = None
            held = engine.weights.get(node_key(n))
            if held is not None:
                for role in ROLES:
                    held.pop(role, None)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the freed stacks' blocks back to the driver: the region is one block
        try:
            self.region = torch.empty(at, dtype=torch.uint8, device=device)
        except (torch.OutOfMemoryError, RuntimeError) as e:  # the stacks back as they were, then the error
            self._rebind(layout, lambda lent: self._bytes(self.host, lent).to(device))
            raise ResourceError(f"lending {len(self.nodes)} layers' resident experts ({at / 1e9:.2f} GB) as prefill "
                                f"staging needs one block of that size on {device}: {str(e).splitlines()[0]}; "
                                "compile with prefill_reserve='reserve'") from e
        self.region.copy_(self.host)
        self._rebind(layout, lambda lent: self._bytes(self.region, lent))
        self.used = 0  # bytes borrowed since the last restore (0: clean)

    def _rebind(self, layout: list[_Lent], raw) -> None:
        """The engine's stacks and per-expert weights of the lent nodes over `raw(lent)` (each
        stacked tensor's bytes, uint8)."""
        by_node: dict[tuple, dict[str, dict[str, torch.Tensor]]] = {}
        for lent in layout:
            view = raw(lent).view(lent.dtype).view(lent.shape)
            by_node.setdefault(lent.key, {}).setdefault(lent.role, {})[lent.part] = view
        for n in self.nodes:
            key = node_key(n)
            stacked = self.engine.stacked(n)
            held = self.engine.weights.setdefault(key, {})
            for role in ROLES:
                parts = by_node[key][role]
                stack = parts[""] if "" in parts else Fp8Weight(parts["data"], parts["scale_inv"])
                stacked[role] = stack
                held[role] = {e: (stack[i] if "" in parts else Fp8Weight(stack.data[i], stack.scale_inv[i]))
                              for i, e in enumerate(n.attrs.ids)}

    @staticmethod
    def _bytes(buf: torch.Tensor, lent: _Lent) -> torch.Tensor:
        return buf[lent.offset:lent.offset + int(torch.Size(lent.shape).numel()) * lent.dtype.itemsize]

    @property
    def dirty(self) -> bool:
        return self.used > 0

    def borrow(self, nbytes: int) -> torch.Tensor:
        """The region's first `nbytes` bytes (uint8) for a prefill step's staging; the lent experts
        are garbage until `restore`."""
        if nbytes > self.nbytes:
            raise ConfigError(f"a prefill plan borrows {nbytes / 1e9:.3f} GB of lent experts' memory, the decode plan "
                              f"lends {self.nbytes / 1e9:.3f} GB: the plans do not belong together; compile again")
        self.used = max(self.used, nbytes)
        return self.region[:nbytes]

    def staging(self, staging_bytes: int, landing_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A borrowing step's staging arena (`staging_bytes`) and landing buffer, one after the other
        at the region's start (`borrow`)."""
        at = -(-staging_bytes // ALIGN) * ALIGN
        region = self.borrow(at + landing_bytes)
        return region[:at], region[at:]

    def restore(self) -> None:
        """Copy the borrowed bytes back from the host copy, once every stream's work is done (a step
        that raised may have left copies into the region queued), and wait for the copy."""
        if not self.used:
            return
        if self.region.is_cuda:
            torch.cuda.synchronize()
        self.region[:self.used].copy_(self.host[:self.used])
        if self.region.is_cuda:
            torch.cuda.synchronize()
        self.used = 0


@dataclass(frozen=True)
class StagingLayout:
    """Where a prefill plan's fetches land: each fetch output's (offset, bytes, shape) in the
    plan's staging arena (the buffer pass's layout), the arena's bytes, and the landing buffer
    the largest fetch's packed bytes need."""

    at: dict[str, tuple[int, int, tuple[int, ...]]]
    staging_bytes: int
    landing_bytes: int

    @classmethod
    def of(cls, plan, stagers: dict) -> "StagingLayout":
        """`plan`'s layout; `stagers` (node_key -> ExpertStager) size the landing buffer (a fetch
        without one lands nothing first)."""
        at, landing = {}, 0
        for value, buf in plan.buffers.items():
            if buf.arena == "staging":
                n = plan.ir.by_name(value)
                at[value] = (buf.offset, buf.bytes, n.out.concrete(0))
                if node_key(n) in stagers:
                    landing = max(landing, stagers[node_key(n)].landing_bytes(len(n.attrs.subset)))
        return cls(at, plan.arena_bytes().get("staging", 0), landing)

    def views(self, staging: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each fetch's output as a view of `staging` (the arena's bytes)."""
        return {name: staging[offset:offset + nbytes].view(dtype)[:math.prod(shape)].view(shape)
                for name, (offset, nbytes, shape) in self.at.items()}


def lent_of(backend) -> LentRegion:
    """The lent region a borrowing plan runs on; a ConfigError where the decode plan lent none."""
    lent = getattr(backend, "lent", None)
    if lent is None:
        raise ConfigError("this prefill plan borrows the decode plan's lent experts, but the decode plan lends none: "
                          "the plans do not belong together; compile again")
    return lent
