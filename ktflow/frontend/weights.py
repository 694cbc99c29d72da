"""Lazy, memory-mapped access to the tensors of an HF safetensors checkpoint.

A checkpoint dir holds one `*.safetensors` file, or shards listed by
`model.safetensors.index.json`. Only headers are read when the source opens; a tensor is a
zero-copy view into a private (copy-on-write) memory map of its file, so pages are read from
disk when first touched and no tensor is ever held twice. Routed-expert weights are found either
per expert as `save_pretrained` writes them (`...experts.<e>.gate_proj.weight`) or in fused
transformers-5 tensors (`...experts.gate_up_proj [E, 2I, H]`, `...experts.down_proj [E, H, I]`).
Tensors the model spec does not reference (e.g. DeepSeek-V3's MTP layer) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import WeightError
from ..ir.graph import Graph
from ..ir.types import DType, WeightRef
from .quant import FP8_DTYPES, Fp8Matrix, QuantConfig, check_pair, dequantize, scale_key

#: torch dtype of each floating IR dtype
TORCH_DTYPE = {DType.F32: torch.float32, DType.BF16: torch.bfloat16, DType.F16: torch.float16}

ST_DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
             "F64": (torch.float64, 8), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
             "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
             "F8_E4M3": (torch.float8_e4m3fn, 1)}
ITEMSIZE = {"F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, **{k: v[1] for k, v in ST_DTYPES.items()}}
FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32")
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    file: "SafetensorsFile"
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One safetensors file: header parsed and checked at open, data mapped on first use."""

    def __init__(self, path: Path):
        self.path = path
        self._mm: mmap.mmap | None = None
        if not path.is_file():
            raise WeightError(f"{path} is not a regular file (a directory, FIFO or device where a safetensors file "
                              "belongs)")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightError(f"{path}: corrupt safetensors file: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise WeightError(f"{path}: corrupt safetensors header: header length {n} exceeds file size {size}")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            header = None
        if not isinstance(header, dict):
            raise WeightError(f"{path}: corrupt safetensors header: not a JSON object")
        self.data_start = 8 + n
        self.header_digest = hashlib.sha256(raw).hexdigest()  # the file's identity beside its inode (packed caches)
        data_len = size - self.data_start
        self.entries: dict[str, Entry] = {}
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise WeightError(f"{path}: corrupt safetensors header: __metadata__ must map names to strings")
        for name, e in header.items():
            if name != "__metadata__":
                self.entries[name] = Entry(self, *_header_entry(path, name, e, data_len))
        # the tensors' byte ranges tile the data section: no overlap, no gap, nothing after
        at = 0
        for name, e in sorted(self.entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
            if e.begin != at:
                what = "overlaps the tensor before it" if e.begin < at else f"leaves bytes {at}..{e.begin} unused"
                raise WeightError(f"{path}: corrupt safetensors header: tensor {name!r} at [{e.begin}, {e.end}] {what}")
            at = e.end
        if at != data_len:
            raise WeightError(f"{path}: corrupt safetensors file: its tensors end at byte {at} of a {data_len}-byte "
                              "data section (truncated, or bytes appended)")

    def tensor(self, e: Entry) -> torch.Tensor:
        if e.dtype not in ST_DTYPES:
            raise WeightError(f"{self.path}: tensor dtype {e.dtype} cannot be read as a torch tensor")
        tdt, _ = ST_DTYPES[e.dtype]
        if e.end == e.begin:
            return torch.empty(e.shape, dtype=tdt)
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        t = torch.frombuffer(self._mm, dtype=tdt, count=(e.end - e.begin) // ITEMSIZE[e.dtype],
                             offset=self.data_start + e.begin)
        return t.view(e.shape)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _header_entry(path: Path, name: str, e, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field's type and range checked."""
    def bad(why: str) -> WeightError:
        return WeightError(f"{path}: corrupt safetensors header entry for tensor {name!r}: {why}")

    if not isinstance(e, dict):
        raise bad("not a JSON object")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise bad(f"dtype {dtype!r} is not a safetensors dtype ({', '.join(ITEMSIZE)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise bad(f"data_offsets {offsets!r} is not a pair of integers")
    b, en = offsets
    if not 0 <= b <= en <= data_len or en - b != math.prod(shape) * ITEMSIZE[dtype]:
        raise bad(f"dtype {dtype} shape {shape} offsets [{b}, {en}] do not fit the {data_len}-byte data section")
    return dtype, tuple(shape), b, en


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of a sharded checkpoint's index: tensor name -> shard file name (a plain name
    in the checkpoint dir)."""
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightError(f"{index}: unreadable index ({e}); expected a JSON object with 'weight_map'") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise WeightError(f"{index}: 'weight_map' must be a JSON object mapping tensor names to shard file names")
    for v in set(weight_map.values()):
        if Path(v).name != v or v in (".", ".."):
            raise WeightError(f"{index}: shard {v!r} is not a file name in the checkpoint dir")
    return weight_map


class WeightSource:
    """All tensors of a checkpoint dir, by name. With `quant` (an FP8 checkpoint), block-scaled
    FP8 weights are read as float32, one tensor at a time (`ktflow.frontend.quant`)."""

    def __init__(self, directory: str | os.PathLike, quant: QuantConfig | None = None):
        d = Path(directory)
        self.dir = d
        self.quant = quant
        index = d / INDEX_FILE
        if index.exists():
            weight_map = _read_index(index)
            names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            names = sorted(p.name for p in d.glob("*.safetensors"))
        files = {}
        for name in names:
            p = d / name
            if not p.exists():
                raise WeightError(f"{index}: lists shard {name!r} which is not in {d}")
            files[name] = SafetensorsFile(p)
        self.files = files
        self.entries: dict[str, Entry] = {}
        for f in files.values():
            twice = sorted(set(f.entries) & set(self.entries))
            if twice:
                raise WeightError(f"{d}: tensor {twice[0]!r} is in both {self.entries[twice[0]].file.path.name} and "
                                  f"{f.path.name}")
            self.entries.update(f.entries)
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in files[fname].entries:
                    raise WeightError(f"{index}: maps tensor {key!r} to {fname}, which does not hold it")

    @staticmethod
    def present(directory: str | os.PathLike) -> bool:
        d = Path(directory)
        return (d / INDEX_FILE).exists() or any(d.glob("*.safetensors"))

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> torch.Tensor:
        """The tensor as stored (FP8 ones without their scales: see `read`)."""
        e = self.entries.get(key)
        if e is None:
            raise WeightError(f"checkpoint {self.dir} has no tensor {key!r}")
        return e.file.tensor(e)

    def read(self, key: str) -> torch.Tensor:
        """The tensor's values: as stored, or an FP8 weight times its block scales (float32; the
        pair was checked by `validate` at load)."""
        e = self.entries.get(key)
        if e is not None and e.dtype in FP8_DTYPES:
            return dequantize(self.get(key), self.get(scale_key(key)), self.quant.block)
        return self.get(key)

    def _fp8_problem(self, key: str, e: Entry) -> str | None:
        s = self.entries.get(scale_key(key))
        return check_pair(key, e.dtype, e.shape, (s.dtype, s.shape) if s else None, self.quant)

    # ---------------------------------------------------------------------- references
    def _fused(self, ref: WeightRef) -> tuple[str, slice] | None:
        """The fused tensor holding all experts of `ref`, and the row slice of one expert."""
        prefix = ref.key.split(".{e}.")[0]
        inter = ref.shape[0] if ref.role in ("gate", "up") else None
        for p in (prefix, prefix.replace(".block_sparse_moe.", ".mlp.")):
            if ref.role in ("gate", "up") and f"{p}.gate_up_proj" in self.entries:
                rows = slice(0, inter) if ref.role == "gate" else slice(inter, 2 * inter)
                return f"{p}.gate_up_proj", rows
            if ref.role == "down" and f"{p}.down_proj" in self.entries:
                return f"{p}.down_proj", slice(None)
        return None

    def check(self, ref: WeightRef) -> str | None:
        """None if `ref` resolves to tensors of the right shape and a float dtype, else why not."""
        if ref.experts:
            first = ref.key.format(e=0)
            if first in self.entries:
                return next((p for p in (self._check_one(ref.key.format(e=e), ref.shape) for e in range(ref.experts))
                             if p), None)
            fused = self._fused(ref)
            if fused is None:
                return f"missing tensor {first!r} (nor a fused experts tensor for it)"
            key, _ = fused
            if self.entries[key].dtype in FP8_DTYPES:
                return (f"tensor {key!r} holds every expert fused in {self.entries[key].dtype}; ktflow reads "
                        "FP8 experts stored one tensor per expert (with weight_scale_inv), as published")
            h_or_i = ref.shape[1]
            want = (ref.experts, 2 * ref.shape[0], h_or_i) if ref.role in ("gate", "up") else (ref.experts, *ref.shape)
            return self._check_one(key, want)
        return self._check_one(ref.key, ref.shape)

    def _check_one(self, key: str, shape: tuple[int, ...]) -> str | None:
        e = self.entries.get(key)
        if e is None:
            return f"missing tensor {key!r} (expected shape {list(shape)})"
        if e.shape != tuple(shape):
            return f"tensor {key!r} has shape {list(e.shape)}, expected {list(shape)}"
        if e.dtype in FP8_DTYPES:
            return self._fp8_problem(key, e)
        if e.dtype not in FLOAT_WEIGHT_DTYPES:
            return (f"tensor {key!r} has dtype {e.dtype}; ktflow reads {', '.join(FLOAT_WEIGHT_DTYPES)} "
                    "(convert the checkpoint first)")
        return None

    def validate(self, graph: Graph) -> None:
        """Raise WeightError listing every reference of `graph` that does not resolve."""
        problems = []
        seen = set()
        for n in graph.nodes:
            for ref in n.weights:
                if ref.key in seen:
                    continue
                seen.add(ref.key)
                p = self.check(ref)
                if p:
                    problems.append(f"{p} (node {n.name})")
        if problems:
            more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise WeightError(f"checkpoint {self.dir} does not match the model spec:\n  "
                              + "\n  ".join(problems[:10]) + more)

    def load(self, ref: WeightRef) -> torch.Tensor:
        """The tensor of a plain (non-expert) reference."""
        return self.read(ref.key)

    def stored_fp8(self, ref: WeightRef) -> bool:
        """Whether the checkpoint stores `ref` (expert 0's tensor, for a per-expert one) in FP8."""
        e = self.entries.get(ref.key.format(e=0) if ref.experts else ref.key)
        return e is not None and e.dtype in FP8_DTYPES

    def load_expert_stored(self, ref: WeightRef, e: int) -> torch.Tensor | Fp8Matrix:
        """Expert `e`'s tensor as stored, for the native packer: an FP8 one as its bytes and block
        scales (float32), with no float copy; any other as `load_expert`."""
        key = ref.key.format(e=e)
        entry = self.entries.get(key)
        if entry is not None and entry.dtype in FP8_DTYPES:
            return Fp8Matrix(self.get(key), self.get(scale_key(key)).float().contiguous(), self.quant.block)
        return self.load_expert(ref, e)

    def load_expert(self, ref: WeightRef, e: int) -> torch.Tensor:
        """Expert `e`'s tensor of a per-expert reference: a view, per-expert or into the fused tensor."""
        key = ref.key.format(e=e)
        if key in self.entries:
            return self.read(key)
        fused = self._fused(ref)
        if fused is None:
            raise WeightError(f"checkpoint {self.dir} has no tensor {key!r} (nor a fused experts tensor)")
        name, rows = fused
        return self.get(name)[e, rows]


def first_non_finite(t: torch.Tensor) -> tuple[list[int], float] | None:
    """(index, value) of the first NaN or infinity in float tensor t, or None: one min/max
    reduction, which NaN propagates through; the search for the index only on failure."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    lo, hi = (float(v) for v in torch.aminmax(t))
    if math.isfinite(lo) and math.isfinite(hi):
        return None
    at = [int(i) for i in (~torch.isfinite(t)).nonzero()[0]]
    return at, float(t[tuple(at)])


def check_finite(t: torch.Tensor, what: str) -> None:
    """A WeightError naming `what` and the first NaN or infinity in t, if it holds one."""
    bad = first_non_finite(t)
    if bad is not None:
        raise WeightError(f"{what}: non-finite value ({bad[1]}) at {bad[0]}: the checkpoint is damaged, or was "
                          "saved from a diverged run")
