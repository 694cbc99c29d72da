"""The native CPU MoE backend from Python: the module (`ktflow._native`, built from native/ by
`pip install`), a process-wide thread pool and queue, and `ExpertOp`, one fused routed-experts
operator with checked tensor arguments and an on-disk cache of its packed weights.

Tensors cross into C++ as addresses; every call here checks dtype, shape, device and
contiguity first, so the C++ side can trust what it gets.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ...util import notices
from ...errors import ConfigError, KtflowError, WeightError, first_line
from ...frontend.quant import Fp8Matrix
from ...util import env

try:
    from ... import _native
except ImportError as _e:  # not built (a source checkout without `pip install -e .`)
    _native = None
    _IMPORT_ERROR = str(_e)
else:
    _IMPORT_ERROR = ""

FORMATS = ("bf16", "int8", "int4", "fp8")
PATHS = ("auto", "generic", "avx512", "amx")
LAYOUT_VERSION = 2  # bump when the packed layout changes: old cache files are then ignored
_SRC_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float8_e4m3fn: "float8_e4m3fn"}


def fp8_group(fmt: str, quant) -> int:
    """The quantization group of `fmt` experts packed from a checkpoint quantized by `quant` (a
    QuantConfig or None): fp8 from FP8 blocks whose width the kernels take (a multiple of 32)
    keeps them, so the checkpoint's bytes and scales are copied; otherwise the default."""
    if fmt == "fp8" and quant is not None and quant.block[1] % 32 == 0:
        return quant.block[1]
    return 0


def rows_of(t: "torch.Tensor | Fp8Matrix", lo: int, hi: int):
    """Rows [lo, hi) of a float tensor or an FP8 matrix."""
    return t.rows(lo, hi) if isinstance(t, Fp8Matrix) else t[lo:hi]


def cols_of(t: "torch.Tensor | Fp8Matrix", lo: int, hi: int):
    """Columns [lo, hi) of a float tensor or an FP8 matrix, contiguous."""
    return t.cols(lo, hi) if isinstance(t, Fp8Matrix) else t[:, lo:hi].contiguous()


_CACHE_UNWRITABLE = False  # set once a cache write failed: the process goes on without the cache
_SAMPLE = 4096  # bytes of each tensor's start, middle and end in a cache file's digest


def _sample_digest(arrays: dict) -> str:
    """A digest of every tensor's name, size and sampled bytes (start, middle, end): catches a
    truncated, zeroed or swapped cache file without hashing gigabytes at every load."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name].reshape(-1).view(np.uint8)
        n = a.size
        h.update(f"{name}:{n};".encode())
        for at in (0, max(0, n // 2 - _SAMPLE // 2), max(0, n - _SAMPLE)):
            h.update(a[at:at + _SAMPLE].tobytes())
    return h.hexdigest()


def _reason(e: BaseException) -> str:
    text = first_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _give_up_cache(where: Path, e: BaseException) -> None:
    global _CACHE_UNWRITABLE
    _CACHE_UNWRITABLE = True
    notices.warn(f"cannot write the packed-expert cache in {where} ({_reason(e)}); going on without it (set "
                 "KTFLOW_CACHE_DIR to a writable directory with room, or to 'off')", key="cache-unwritable")


def available() -> bool:
    return _native is not None


_ENV_CHECKED = False


def module():
    global _ENV_CHECKED
    if _native is None:
        raise KtflowError(f"the native CPU backend is not built ({_IMPORT_ERROR}); run `pip install -e .` "
                          "(or `make install`) in the ktflow checkout, which compiles native/")
    if not _ENV_CHECKED:  # the variables the library reads itself: a clear error, not a silent default
        env.check_native()
        _ENV_CHECKED = True
    return _native


def cpu_features() -> dict[str, bool]:
    return dict(module().cpu_features())


def kernel_paths() -> list[str]:
    """Kernel paths this CPU can run, slowest first (generic always)."""
    return list(module().paths())


_POOL = None
_QUEUE = None
_SPIN_US = 1000  # the pool's spin while spinning: what it read from KTFLOW_SPIN_US when made
_SPINNING: bool | None = None  # what set_spinning last told the pool (None: the pool's own start)
_INFLIGHT: list = []  # batches submitted since the last sync: kept alive until it


@atexit.register
def _drain() -> None:
    """Let submitted work finish before the interpreter tears down the tensors it uses."""
    if _QUEUE is not None:
        try:
            _QUEUE.sync()
        except Exception:  # noqa: BLE001 - exiting; the error was the caller's to collect
            pass
        _INFLIGHT.clear()


def default_threads(spare: int = 1) -> int:
    """Every CPU this process may use, less `spare` where there are 8 or more: cores for the
    threads outside the pool that drive it (the Python step loop; under a CUDA graph also the
    driver's host-function thread), which the spinning pinned workers would otherwise starve."""
    n = len(os.sched_getaffinity(0))
    return max(1, n - spare) if n >= 8 else n


def set_spinning(on: bool) -> None:
    """Whether the pool's idle workers (and a caller awaiting a run) spin between runs, for the
    pool's spin time (KTFLOW_SPIN_US, default 1000 us), or sleep at once. Spinning suits steps whose
    CPU work all goes through the pool (a CUDA-graph step rings it every layer, and keeps torch
    off the workers' CPUs); a step that runs its own torch ops on the CPU between the pool's runs
    wants those cores for them: spinning workers took half of a CPU-only decode step's time on the
    2-core dev box (benchmarks/RESULTS.md). Backends call it before their runs; cheap when nothing
    changes."""
    global _SPINNING
    if on is _SPINNING:
        return
    p = pool()
    p.spin_us = _SPIN_US if on else 0
    _SPINNING = on


def pool(spare: int = 1):
    """The process-wide worker pool: KTFLOW_THREADS threads (default: `default_threads(spare)`;
    the first call creates the pool, so the first caller's `spare` holds) in KTFLOW_NUMA_GROUPS
    groups (default: one per NUMA node; more gives virtual groups)."""
    global _POOL
    if _POOL is None:
        threads = env.get("KTFLOW_THREADS") or default_threads(spare)
        groups = env.get("KTFLOW_NUMA_GROUPS")
        _POOL = module().Pool(threads=threads, groups=groups, pin=env.get("KTFLOW_PIN"))
        global _SPIN_US
        _SPIN_US = _POOL.spin_us
    return _POOL


def queue():
    """The process-wide asynchronous queue on `pool()`."""
    global _QUEUE
    if _QUEUE is None:
        _QUEUE = module().Queue(pool())
    return _QUEUE


def _check(t: torch.Tensor, name: str, dtype: torch.dtype | Sequence[torch.dtype], shape: tuple) -> None:
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if t.device.type != "cpu":
        raise ConfigError(f"{name} must be a CPU tensor, got one on {t.device}")
    if t.dtype not in dtypes:
        raise ConfigError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dim() and t.stride(-1) != 1:
        raise ConfigError(f"{name} must be contiguous in its last dimension")


class ExpertOp:
    """Routed experts [experts, hidden, inter] held by this process (those in `held`), packed in
    `fmt`, split over pool groups `groups` by intermediate slices (NUMA tensor parallel; default:
    every group of the pool).

    `forward(x, ids, weights)` computes, for every token t and pick s in `ranks`,
        out[t] += weights[t, s] * down(silu(gate(x[t])) * up(x[t]))   for expert ids[t, s]
    skipping picks of experts not held here and ids of -1.
    """

    def __init__(self, experts: int, hidden: int, inter: int, held: Sequence[int] | None = None, fmt: str = "bf16",
                 group_size: int = 0, groups: Sequence[int] | None = None):
        if fmt not in FORMATS:
            raise ConfigError(f"expert weight format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.experts, self.hidden, self.inter, self.fmt, self.group_size = experts, hidden, inter, fmt, group_size
        self.held = sorted(set(range(experts) if held is None else held))
        bad = [e for e in self.held if not 0 <= e < experts]
        if bad:
            raise ConfigError(f"held experts {bad} are outside [0, {experts})")
        present = [0] * experts
        for e in self.held:
            present[e] = 1
        self.op = module().MoE(pool(), experts, hidden, inter, fmt, group_size, list(groups or []), present)

    # ------------------------------------------------------------------------------ weights
    def pack(self, tensors: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             cache: str | os.PathLike | None = None, fingerprint: str = "") -> str:
        """Pack every held expert from `tensors(e)` = (gate [inter, hidden], up [inter, hidden],
        down [hidden, inter]), float32/float16/bfloat16, or `Fp8Matrix`es (an FP8 checkpoint's
        bytes and block scales: copied as they are into the fp8 format when its group is the
        blocks' width, else dequantized row by row while packing). With `cache` (a directory), the packed
        weights are read from, or else written to, a safetensors file named by `fingerprint`
        plus the format and the split. The cache is optional: a file that cannot be read, or
        whose sizes or sampled-content digest disagree, is removed and the experts packed again;
        a directory that cannot be written is given up for the rest of the process; either with
        one warning. Returns 'cache' or 'packed'. A source value that is NaN or infinite is a
        WeightError naming the expert, the matrix and the index."""
        path = self.cache_file(cache, fingerprint) if cache and not _CACHE_UNWRITABLE else None
        if path is not None and path.exists():
            try:
                self._load_cache(path)
                return "cache"
            except Exception as e:  # noqa: BLE001 - any damage (the cache is optional): pack again
                notices.warn(f"the packed-expert cache file {path} is unusable ({_reason(e)}); packing the experts "
                             "again and rewriting it")
                try:
                    path.unlink()
                except OSError:
                    pass
        keep, gates, ups, downs, scales, dtype, block = [], [], [], [], [], None, None
        for e in self.held:
            mats = tensors(e)
            for t, name, shape in zip(mats, ("gate", "up", "down"), ((self.inter, self.hidden),
                                      (self.inter, self.hidden), (self.hidden, self.inter)), strict=True):
                if t.dtype not in _SRC_DTYPES:
                    raise ConfigError(f"expert {e} {name}: dtype {t.dtype} cannot be packed "
                                      f"({', '.join(map(str, _SRC_DTYPES))})")
                _check(t.data if isinstance(t, Fp8Matrix) else t, f"expert {e} {name}", t.dtype, shape)
                if dtype is None:
                    dtype = t.dtype
                elif t.dtype != dtype:
                    raise ConfigError(f"expert {e} {name}: dtype {t.dtype} differs from the other experts' {dtype}")
                if isinstance(t, Fp8Matrix):  # the grid covers the matrix: the packer reads every scale it names
                    bn, bk = t.block
                    grid = (-(-(t.row0 + shape[0]) // bn), -(-(t.col0 + shape[1]) // bk))
                    if t.scale_inv.dim() != 2 or any(have < need for have, need in zip(t.scale_inv.shape, grid)):
                        raise ConfigError(f"expert {e} {name}: block scales {list(t.scale_inv.shape)} do not cover "
                                          f"the matrix (need at least {list(grid)})")
                    _check(t.scale_inv, f"expert {e} {name} scales", torch.float32, tuple(t.scale_inv.shape))
                    block = block or t.block
                    if t.block != block:
                        raise ConfigError(f"expert {e} {name}: FP8 block {t.block} differs from the other experts' "
                                          f"{block}")
                elif dtype == torch.float8_e4m3fn:
                    raise ConfigError(f"expert {e} {name}: an FP8 tensor needs its block scales (an Fp8Matrix)")
            mats = [replace(t, data=t.data.contiguous()) if isinstance(t, Fp8Matrix) else t.contiguous() for t in mats]
            keep.append(mats)
            g, u, d = (t.data if isinstance(t, Fp8Matrix) else t for t in mats)
            gates.append(g.data_ptr()), ups.append(u.data_ptr()), downs.append(d.data_ptr())
            if isinstance(mats[0], Fp8Matrix):
                scales.append([t.scale_arg() for t in mats])
        if self.held:
            bn, bk = block or (128, 128)
            try:
                self.op.pack(self.held, gates, ups, downs, self.hidden, self.hidden, self.inter, _SRC_DTYPES[dtype],
                             scales, bn, bk)
            except ValueError as e:
                if "non-finite" not in str(e):
                    raise
                raise WeightError(f"routed {e} (of this operator's source tensors): the checkpoint holds a NaN or an "
                                  "infinity there") from None
        if path is not None:
            try:
                self._save_cache(path, fingerprint)
            except Exception as e:  # noqa: BLE001 - a full or read-only disk: go on without the cache
                _give_up_cache(path.parent, e)
        return "packed"

    def cache_file(self, cache: str | os.PathLike, fingerprint: str) -> Path:
        key = json.dumps(dict(fp=fingerprint, fmt=self.fmt, group=self.group_size, slices=self.op.slices,
                              held=self.held, shape=[self.experts, self.hidden, self.inter], layout=LAYOUT_VERSION),
                         sort_keys=True)
        return Path(cache) / f"experts-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"

    def _save_cache(self, path: Path, fingerprint: str) -> None:
        from safetensors.numpy import save_file

        arrays = {}
        for e in self.held:
            for s in range(len(self.op.slices)):
                for which in range(3):
                    data, scales, *_ = self.op.packed_arrays(s, e, which)
                    arrays[f"{e}.{s}.{which}.data"] = np.frombuffer(data, dtype=np.uint8)
                    if scales is not None:
                        arrays[f"{e}.{s}.{which}.scales"] = np.frombuffer(scales, dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            save_file(arrays, str(tmp), metadata=dict(fingerprint=fingerprint, format=self.fmt,
                                                     layout=str(LAYOUT_VERSION), digest=_sample_digest(arrays)))
            with open(tmp, "rb+") as f:  # on disk before it has the name readers look for
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _load_cache(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("layout") != str(LAYOUT_VERSION):
                raise KtflowError("packed with another layout version")
            names = set(f.keys())
            sampled = {}
            for e in self.held:
                parts, arrays = [], []
                for s in range(len(self.op.slices)):
                    for which in range(3):
                        data = f.get_tensor(f"{e}.{s}.{which}.data")
                        key = f"{e}.{s}.{which}.scales"
                        scales = f.get_tensor(key) if key in names else np.zeros(0, np.uint8)
                        sampled[f"{e}.{s}.{which}.data"] = data
                        if key in names:
                            sampled[key] = scales
                        arrays += [data, scales]
                        parts.append((data.ctypes.data, data.nbytes, scales.ctypes.data if scales.nbytes else 0,
                                      scales.nbytes))
                self.op.load_packed(e, parts)
            if sampled.keys() != names or meta.get("digest") != _sample_digest(sampled):
                raise KtflowError("its contents do not match the digest in its header")

    @property
    def packed_bytes(self) -> int:
        return self.op.packed_bytes

    # ------------------------------------------------------------------------------ compute
    # ------------------------------------------------------------------------------ arenas
    def arena(self, slice_: int = 0) -> torch.Tensor:
        """Slice `slice_`'s packed experts as a uint8 CPU tensor over the operator's own memory
        (no copy; valid while the operator lives): held experts in id order, `expert_stride`
        bytes apart (see `layout`). One page-aligned range, so it can be pinned as a whole."""
        import ctypes

        address, nbytes, _ = self.op.arena(slice_)
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def expert_stride(self, slice_: int = 0) -> int:
        return self.op.arena(slice_)[2]

    def arena_block(self, expert: int) -> int:
        """The block index of a held expert in every slice's arena."""
        block = self.op.arena_block(expert)
        if block < 0:
            raise ConfigError(f"expert {expert} is not held by this operator")
        return block

    def layout(self, slice_: int, which: int) -> dict:
        """Where packed matrix `which` (0 gate, 1 up, 2 down) lies in an expert's block, and its
        padded shape: data/scales offsets and bytes, n, k, np, kp, group."""
        keys = ("data_offset", "data_bytes", "scales_offset", "scales_bytes", "n", "k", "np", "kp", "group")
        return dict(zip(keys, self.op.layout(slice_, which), strict=True))

    @property
    def slices(self) -> list[tuple[int, int, int, int]]:
        """(first row, end row, pool group, NUMA node) of each intermediate slice."""
        return list(self.op.slices)

    def _mask_arg(self, mask: torch.Tensor | None) -> int:
        if mask is None:
            return 0
        _check(mask, "expert mask", torch.uint8, (self.experts,))
        return mask.data_ptr()

    def _job_args(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                  ranks: tuple[int, int] | None, path: str) -> tuple:
        t = x.shape[0] if x.dim() == 2 else -1
        _check(x, "x", torch.bfloat16, (t, self.hidden))
        if ids.dim() != 2 or ids.shape[0] != t:
            raise ConfigError(f"ids must have shape [{t}, k], got {list(ids.shape)}")
        k = ids.shape[1]
        _check(ids, "ids", torch.int64, (t, k))
        _check(weights, "weights", torch.float32, (t, k))
        _check(out, "out", (torch.bfloat16, torch.float32), (t, self.hidden))
        for name, v in (("ids", ids), ("weights", weights)):
            if v.stride(0) != k:
                raise ConfigError(f"{name} must be contiguous")
        lo, hi = ranks if ranks is not None else (0, k)
        if not 0 <= lo <= hi <= k:
            raise ConfigError(f"ranks {ranks} are not a range of the {k} picks")
        if path not in PATHS:
            raise ConfigError(f"kernel path {path!r} is not one of {', '.join(PATHS)}")
        return (x.data_ptr(), x.stride(0), ids.data_ptr(), weights.data_ptr(), k, lo, hi, t)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None,
                accumulate: bool = False, ranks: tuple[int, int] | None = None, path: str = "auto",
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Synchronous fused MoE on the pool. x [T, hidden] bf16, ids [T, k] int64, weights [T, k]
        fp32; out [T, hidden] bf16 or fp32 (new fp32 if None), added to when `accumulate`. `mask`
        (uint8 [experts]): compute only the experts it marks non-zero."""
        if out is None:  # every element is written (empty, not zeros: no torch thread-pool fill)
            out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        args = self._job_args(x, ids, weights, out, ranks, path)
        self.op.forward(*args, out.data_ptr(), out.stride(0), out.dtype == torch.float32, accumulate, path,
                        self._mask_arg(mask))
        return out


class Batch:
    """Jobs submitted to the queue together (their tasks share each phase). Keeps the tensors
    it was given alive; `handle` is the address `ktf_submit` takes as its context."""

    def __init__(self, q=None):
        self.queue = q or queue()
        self.native = module().Batch(self.queue)
        self._keep: list[torch.Tensor] = []

    def add(self, op: ExpertOp, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
            accumulate: bool = False, ranks: tuple[int, int] | None = None, path: str = "auto",
            tokens: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        """Add a forward into `out`. With `tokens` (an int32 CPU tensor of one element, pinned for
        a CUDA graph), the token count is read from it each time the batch runs; `mask` as in
        `ExpertOp.forward`."""
        args = op._job_args(x, ids, weights, out, ranks, path)
        tptr = 0
        if tokens is not None:
            _check(tokens, "tokens", torch.int32, (1,))
            tptr = tokens.data_ptr()
        self.native.add(op.op, *args, tptr, out.data_ptr(), out.stride(0), out.dtype == torch.float32, accumulate, path,
                        op._mask_arg(mask))
        self._keep += [x, ids, weights, out] + [t for t in (tokens, mask) if t is not None]

    @property
    def handle(self) -> int:
        return self.native.handle

    def set_done_flag(self, flag: torch.Tensor) -> None:
        """`flag` (one int32 element, pinned for a GPU to read) is set to 0 at each submit and to
        1 once the batch has run, after its outputs are written (also when it failed)."""
        _check(flag, "done flag", torch.int32, (1,))
        self.native.set_done_flag(flag.data_ptr())
        self._keep.append(flag)

    def set_doorbell(self, bell: torch.Tensor) -> None:
        """`bell` (one int32 element, pinned for a GPU to write): a GPU step sets it to 1 to submit
        this batch, while a ring holding it is armed (`Ring`); the dispatcher clears it."""
        _check(bell, "doorbell", torch.int32, (1,))
        self.native.set_doorbell(bell.data_ptr())
        self._keep.append(bell)

    def submit(self) -> None:
        _INFLIGHT.append(self)
        self.queue.submit(self.native)

    def wait(self) -> None:
        """Wait until this batch has run (later batches may still run; errors surface at `sync`)."""
        self.native.wait()


class Ring:
    """Batches with doorbells a GPU step rings, in its order (see ktf/queue.h): `arm()` before each
    launch of the step makes the dispatcher poll them, so the step submits its CPU tasks without
    host functions."""

    def __init__(self, batches: list[Batch]):
        self.batches = list(batches)  # kept alive: the queue holds their addresses
        self.queue = batches[0].queue if batches else queue()
        self.id = self.queue.add_ring([b.native for b in self.batches]) if self.batches else None

    def arm(self) -> None:
        if self.id is not None:
            _INFLIGHT.extend(self.batches)
            self.queue.arm(self.id)

    def disarm(self) -> None:
        """The passes armed on this queue (every ring's) are not coming (the launch that rings
        them failed): the dispatcher drops them, ends the pass it polls without an error before
        its next batch, and sets the done flags of that pass's batches not run. Returns once that
        pass has ended; doorbells rung after it are never run (the caller clears them)."""
        self.queue.disarm()


def sync() -> None:
    """Wait for everything submitted to the process queue; raises the first error a job hit."""
    if _QUEUE is not None:
        try:
            _QUEUE.sync()
        except (ValueError, IndexError, RuntimeError) as e:
            raise KtflowError(f"native CPU task failed: {e}") from None
        finally:
            _INFLIGHT.clear()


def c_entry_points() -> dict[str, int]:
    """Addresses of `void ktf_submit(void* batch)`, `void ktf_sync(void* queue)` and
    `void ktf_wait_batch(void* batch)`, and the queue's context pointer: what cudaLaunchHostFunc
    needs to drive the queue from a stream."""
    m = module()
    return dict(submit=m.submit_fn_ptr(), sync=m.sync_fn_ptr(), wait_batch=m.wait_batch_fn_ptr(), queue=queue().handle)
