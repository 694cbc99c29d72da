"""The CUDA backend's hand-off to the CPU: the driver calls a captured graph makes (host launches,
stream memory writes and waits), and what both runners read from a plan's graph to bind CPU tasks
(the host prologue, the exchange views, native batches, the done flags).

A task's inputs and outputs are views of the pinned exchange arena. Each native batch has a pinned
done flag the native dispatcher sets once its outputs are written; a sync waits on its task's last
batch's flag (shards run in order). Captures are thread-local (`CAPTURE_MODE`): other threads' CUDA
calls do not invalidate them. CPU nodes other than routed experts (with their NUMA reduce) and
nodes computed from the token ids alone are a ConfigError.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from ...errors import ConfigError, KtflowError
from ...frontend.weights import TORCH_DTYPE
from ...ir.graph import Graph, Node
from ...ir.ops import Op
from ...ir.types import Device, DType
from ..base import node_key
from ..native import binding as native
from ...util import env


_TORCH_DTYPE = {**TORCH_DTYPE, DType.I64: torch.int64}  # and the integer values an arena may hold


# A capture checks only its own thread's CUDA calls: another thread's (a server's, a caller's)
# event queries or page-locked allocations while a step is captured would, in the default
# ("global") mode, invalidate the capture under way.
CAPTURE_MODE = "thread_local"


class Driver:
    """CUDA driver (libcuda) calls torch does not expose, through ctypes:

    - `cuLaunchHostFunc`: a host function called in stream order (a host node under capture);
    - `cuStreamWaitValue32`: the stream waits until a 32-bit word reaches a value (a wait-value
      node under capture), polled by the GPU's front end: no host thread takes part;
    - `cuStreamWriteValue32`: the stream writes a 32-bit word (a write-value node under capture),
      after the work before it in the stream;
    - `cuMemHostGetDevicePointer`: the device address of a pinned host word."""

    WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise KtflowError(f"cannot load the CUDA driver library libcuda.so.1 ({e})") from None
        self._launch = lib.cuLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        # the _v2 entry points are the ones cuda.h names since CUDA 12 (stream memory operations on by default)
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
        if self._wait is not None:
            self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            self._wait.restype = ctypes.c_int
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or getattr(lib, "cuStreamWriteValue32", None)
        if self._write is not None:
            self._write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            self._write.restype = ctypes.c_int
        self._devptr = lib.cuMemHostGetDevicePointer_v2
        self._devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        self._devptr.restype = ctypes.c_int
        fns = native.c_entry_points()
        self.submit_fn, self.wait_fn = fns["submit"], fns["wait_batch"]

    def launch_host(self, stream: torch.cuda.Stream, fn: int, arg: int) -> None:
        rc = self._launch(stream.cuda_stream, fn, arg)
        if rc != 0:
            raise KtflowError(f"cuLaunchHostFunc failed (CUDA driver error {rc})")

    def device_address(self, pinned: torch.Tensor) -> int:
        out = ctypes.c_uint64(0)
        rc = self._devptr(ctypes.byref(out), pinned.data_ptr(), 0)
        if rc != 0:
            raise KtflowError(f"cuMemHostGetDevicePointer failed (CUDA driver error {rc}): the word is not pinned")
        return out.value

    def wait_value(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        rc = self._wait(stream.cuda_stream, address, value, self.WAIT_GEQ)
        if rc != 0:
            raise KtflowError(f"cuStreamWaitValue32 failed (CUDA driver error {rc})")

    def write_value(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        rc = self._write(stream.cuda_stream, address, value, 0)  # CU_STREAM_WRITE_VALUE_DEFAULT: after prior work
        if rc != 0:
            raise KtflowError(f"cuStreamWriteValue32 failed (CUDA driver error {rc})")

    def can_write_value(self) -> bool:
        """Whether stream write-value operations to pinned host memory run here (tried once)."""
        return self._write is not None and self._tried(0, lambda st, a: self.write_value(st, a, 1)) == 1

    def can_wait_value(self) -> bool:
        """Whether this driver and GPU run stream wait-value operations on pinned host memory
        (tried once on a word already set)."""
        return self._wait is not None and self._tried(1, lambda st, a: self.wait_value(st, a, 1)) == 1

    def _tried(self, value: int, op) -> int | None:
        """The pinned word (starting at `value`) after `op(stream, its device address)` ran on a
        new stream; None if the driver refused it."""
        word = torch.full((1,), value, dtype=torch.int32, pin_memory=True)
        stream = torch.cuda.Stream()
        try:
            op(stream, self.device_address(word))
            stream.synchronize()
        except (KtflowError, RuntimeError):
            return None
        return int(word[0])


def expandable_segments() -> None:
    """The CUDA caching allocator grows one mapped segment per stream instead of caching blocks of
    the sizes asked for, unless the user configured the allocator (PYTORCH_CUDA_ALLOC_CONF): the
    plans' steps allocate activations of every bucket's sizes, and the blocks a cache of them
    splits are slack the VRAM plan cannot count (measured: docs/design-notes.md)."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def keep_off_workers(pool) -> None:
    """Confine the calling thread (the step loop: launches, the logits' copy, the caller's
    sampling) to the CPUs the native pool does not use, where it has some: left to the scheduler
    it can land on a pinned worker's CPU and share it with a spinning thread. Threads it starts
    later (the driver's) inherit the set. KTFLOW_PIN=0 (an unpinned pool) leaves it alone."""
    if not env.get("KTFLOW_PIN"):
        return
    free = set(os.sched_getaffinity(0)) - set(pool.cpus)
    if free:
        os.sched_setaffinity(0, free)


def host_prologue(g: Graph, be, where: str) -> list[Node]:
    """The members of the plan's tasks marked `on_host` (lowering's: computed from the token ids
    alone), in graph order: the host runs them itself before the step. Any other CPU node but
    the token ids and the routed experts the native backend runs (with their NUMA reduce) is an
    error naming `where` it cannot run."""
    on_host = {m for n in g.nodes if n.op == Op.SUBMIT and n.attrs.on_host for m in n.attrs.members}
    for n in g.nodes:
        if n.place.device != Device.CPU or n.name in on_host or n.op in (Op.INPUT, Op.SUBMIT, Op.SYNC, Op.COPY):
            continue
        if n.op == Op.ROUTED_EXPERTS and be.experts.runs(n):
            continue
        if n.op == Op.REDUCE and all(be.experts.runs(g.by_name(i)) for i in n.inputs):
            continue
        raise ConfigError(f"node {n.name} ({n.op.value}) is placed on the CPU, but {where} only routed experts "
                          "(with their NUMA reduce) and tasks on the host (from the token ids alone) run there; "
                          "use backend='native' for this plan")
    return [n for n in g.nodes if n.name in on_host]


def exchange_views(g: Graph, buffers, arena: torch.Tensor, tokens: int) -> dict[str, Any]:
    """Views of the pinned exchange arena for every value the buffer plan put there, shaped for
    `tokens` tokens (a routing is an (ids int64, weights float32) pair, ids first)."""
    views: dict[str, Any] = {}
    for value, buf in buffers.items():
        if buf.arena != "pinned":
            continue
        t, (offset, _) = g.by_name(value).out, buf.span(tokens)
        if t.dtype == DType.ROUTE:
            k = t.shape[1]
            ids = arena[offset:offset + tokens * k * 8].view(torch.int64).view(tokens, k)
            wts = arena[offset + tokens * k * 8:offset + tokens * k * 12].view(torch.float32).view(tokens, k)
            views[value] = (ids, wts)
        else:
            dt = _TORCH_DTYPE[t.dtype]
            n = t.numel(tokens) * dt.itemsize
            views[value] = arena[offset:offset + n].view(dt).view(t.concrete(tokens))
    return views


def native_batches(be, g: Graph, sub: Node, views: dict, home: dict[str, str],
                   tokens: torch.Tensor | None = None) -> list[native.Batch]:
    """The native batches of the task `sub` submits, run in order (one per NUMA shard: shards
    after the first add into the same output), over their pinned views. `tokens`: a pinned int32
    holding the rows to compute at each run (default: the views' rows)."""
    out = views[sub.attrs.task]
    shards = [g.by_name(m) for m in sub.attrs.members if be.experts.runs(g.by_name(m))]
    batches = []
    for i, node in enumerate(shards):
        x, routing = (views[home.get(v, v)] for v in node.inputs)
        batch = native.Batch()
        batch.add(be.experts.ops[node_key(node)], x, routing[0], routing[1], out, accumulate=i > 0,
                  ranks=node.attrs.rank_range, mask=be.experts.masks.get(node_key(node)), tokens=tokens)
        batches.append(batch)
    return batches


def done_flags(driver: Driver,
               tasks: dict[str, list[native.Batch]]) -> tuple[dict[str, int], dict[int, int], torch.Tensor]:
    """A pinned done flag per native batch (the batch keeps it alive); returns the device address
    of each task's last batch's flag (a sync waits on it: shards run in order), of every batch's
    flag, by id(batch), and the flags' pinned words."""
    flags = torch.zeros(max(sum(map(len, tasks.values())), 1), dtype=torch.int32, pin_memory=True)
    base = driver.device_address(flags)
    done_at, flag_at = {}, {}
    for root, batches in tasks.items():
        for batch in batches:
            batch.set_done_flag(flags[len(flag_at):len(flag_at) + 1])
            flag_at[id(batch)] = base + len(flag_at) * flags.itemsize
        if batches:
            done_at[root] = flag_at[id(batches[-1])]
    return done_at, flag_at, flags
