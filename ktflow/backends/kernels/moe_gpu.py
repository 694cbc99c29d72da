"""Routed experts on the GPU for long steps, and the conversion of streamed packed experts.

- `grouped_experts`: every pick of a step as one grouped matrix product per projection: picks
  sorted by expert and offsets computed on the device (no host sync), over stacked resident
  weights or the weights a fetch staged. Resident experts held in FP8 (fp8_gpu.Fp8Weight stacks)
  are dequantized one projection of the stack at a time into a temporary in the activation dtype
  just before its product (memory.fp8_experts_dequant_bytes counts it).
- `unpack_matrix`: packed CPU experts (the native layouts: 16-row blocks with K pairs, quads or
  octets side by side, int8/int4/fp8 with fp32 group scales) converted to plain [n, k] matrices
  on the device they were copied to (int8/int4/fp8 on a GPU: `dequant_gpu`'s one-pass kernel).

memory.SCRATCH mirrors the temporaries of `grouped_experts`; change them together.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ...costmodel.memory import GROUPED_ROWS, SCATTER_ROWS
from ...util.notices import warn
from . import dequant_gpu
from .fp8_gpu import Fp8Weight, dequantize_experts, stack_rows


_GROUPED_OK: dict[str, bool] = {}  # device type -> whether torch's grouped matmul runs there
#: device type -> why torch's grouped matmul did not run there (the loop runs instead)
GROUPED_FALLBACK: dict[str, str] = {}


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """Rows offs[g-1]..offs[g] of a [R, K] times b[g] [K, N] -> [R, N] (rows past offs[-1]
    undefined): torch's grouped matmul where this torch and device run it, else a loop over the
    groups (their sizes: `counts` where the caller has them on the host, else `offs` read there,
    one sync). The first refusal on a device type is warned about once and kept in
    GROUPED_FALLBACK."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    kind = a.device.type
    if fn is not None and _GROUPED_OK.get(kind, True):
        try:
            out = fn(a, b, offs=offs)
            _GROUPED_OK[kind] = True
            return out
        except torch.OutOfMemoryError:
            raise  # the memory's, not the product's: the caller reports it
        except (RuntimeError, NotImplementedError) as e:
            _GROUPED_OK[kind] = False
            GROUPED_FALLBACK[kind] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if kind != "cpu":  # on a GPU the loop costs a launch a group (and a sync without host counts)
                warn(f"torch's grouped matmul refused a {kind} product ({GROUPED_FALLBACK[kind]}); routed experts "
                     "run as a loop over their experts instead", key=f"grouped_mm {kind}")
    elif fn is None:
        GROUPED_FALLBACK.setdefault(kind, f"torch {torch.__version__} has no grouped matmul")
    out = torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
    lo = 0
    for g, end in enumerate(itertools.accumulate(counts) if counts is not None else offs.tolist()):
        if end > lo:
            out[lo:end] = a[lo:end] @ b[g]
        lo = end
    return out


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, local: torch.Tensor, gate, up, down,
                    addend: torch.Tensor | None = None, running: bool = False) -> torch.Tensor:
    """sum over each token's picks of weight * down(silu(gate x) * up x), for the picks whose
    expert has a row in the stacked weights (`local[id]` >= 0; others add nothing). x [T, H];
    ids, wts [T, k]; gate, up [n, I, H]; down [n, H, I] (tensors, or fp8_gpu.Fp8Weight stacks:
    each dequantized to x's dtype for its product) -> [T, H] in x's dtype (summed in fp32).
    Picks are sorted by expert, those held elsewhere last; outside a CUDA graph capture only the
    held picks' rows are gathered, multiplied and summed, GROUPED_ROWS at a time (`_sum_blocks`),
    so a long step's temporaries stay bounded (where the node holds only some of the layer's
    experts, their count is read here: a sync; a layer's parts use `LayerPicks` and
    `grouped_part` instead); while capturing, every pick's row is (masked). `addend` (float32
    [T, H]): a running sum the picks are added to, in place (the caller hands it over);
    `running`: return the float32 sum (a streamed group's partial sum) rather than x's dtype."""
    t, k = ids.shape
    n = stack_rows(gate)
    row = local[ids].reshape(-1)
    key = torch.where(row < 0, n, row)
    order = torch.argsort(key, stable=True)
    per_row = counts_of(key, n + 1)[:n]  # picks a stacked expert, on the device
    offs = torch.cumsum(per_row, 0).to(torch.int32)
    out = _running_sum(x, addend)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # every pick's row; rows past the groups (picks held elsewhere) come out undefined: their
        # weight is 0 and they are zeroed
        weight = torch.where(key[order] < n, wts.reshape(-1)[order], 0.0)
        _rows(x, order // k, weight, gate, up, down, offs, None, out, masked=True)
        return out if running else out.to(x.dtype)
    # every expert of the layer held (a resident layer): every pick, no need to read the count
    held = t * k if n == local.numel() else (int(offs[-1]) if n else 0)
    _sum_blocks(x, k, wts, order, offs, None, held, gate, up, down, out)
    return out if running else out.to(x.dtype)


def _running_sum(x: torch.Tensor, addend: torch.Tensor | None) -> torch.Tensor:
    """The float32 [T, H] the picks are added into: `addend` itself (a running sum has one reader,
    the layer's next group, verifier rule S1: no copy a group), else zeros."""
    return addend.float() if addend is not None else torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32,
                                                                 device=x.device)


def _sum_blocks(x: torch.Tensor, k: int, wts: torch.Tensor, picks: torch.Tensor, offs: torch.Tensor,
                counts: list[int] | None, held: int, gate, up, down, out: torch.Tensor) -> None:
    """The first `held` of `picks` (flat pick indices sorted by stacked row; `offs` per row on the
    device, `counts` on the host where known: the loop that stands in for torch's grouped matmul
    then reads nothing back) through `_rows` into `out`, GROUPED_ROWS at a time (memory.SCRATCH
    bounds the temporaries so); a block that cuts the rows shifts its offsets."""
    ends = list(itertools.accumulate(counts)) if counts is not None else None
    flat = wts.reshape(-1)
    for lo in range(0, held, GROUPED_ROWS):
        hi = min(lo + GROUPED_ROWS, held)
        whole = lo == 0 and hi == held
        offs_b = offs if whole else (offs - lo).clamp_(0, hi - lo)
        counts_b = counts if whole or counts is None else [
            min(max(e - lo, 0), hi - lo) - min(max(e - c - lo, 0), hi - lo) for e, c in zip(ends, counts)]
        block = picks[lo:hi]
        _rows(x, block // k, flat[block], gate, up, down, offs_b, counts_b, out, masked=False)


class LayerPicks:
    """One step's picks of a MoE layer sorted by expert once, for all the layer's parts on the
    GPU (a split layer's resident part, its streamed groups): `order` [T * k] (the flat pick
    indices by expert, stable), `counts` each expert's picks (host), `starts` where each
    expert's picks begin in `order` (host), `device_counts` the same counts on the device. A
    part then takes its picks as slices of `order` (one for each run of consecutive expert ids
    it holds) with no sort and no host read of its own."""

    def __init__(self, ids: torch.Tensor, experts: int):
        self.k = ids.shape[1]
        self.order = torch.argsort(ids.reshape(-1), stable=True)
        self.device_counts = counts_of(ids, experts)
        self.counts = self.device_counts.tolist()  # the layer's one read of the device
        self.starts = [0, *itertools.accumulate(self.counts)][:-1]

    def part(self, held: tuple[int, ...], held_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(the picks of experts `held` (sorted; `held_ids` the same ids on the device), in their
        stacked rows' order; their offsets for grouped_mm, int32 on the device; their counts on
        the host)."""
        runs, first = [], 0
        for i in range(1, len(held) + 1):  # runs of consecutive ids: one slice of `order` each
            if i == len(held) or held[i] != held[i - 1] + 1:
                lo, last = self.starts[held[first]], held[i - 1]
                runs.append(self.order[lo:self.starts[last] + self.counts[last]])
                first = i
        picks = runs[0] if len(runs) == 1 else torch.cat(runs)
        offs = torch.cumsum(self.device_counts[held_ids], 0).to(torch.int32)
        return picks, offs, [self.counts[e] for e in held]


def grouped_part(x: torch.Tensor, k: int, wts: torch.Tensor, picks: torch.Tensor, offs: torch.Tensor,
                 counts: list[int], gate, up, down, addend: torch.Tensor | None = None,
                 running: bool = False) -> torch.Tensor:
    """`grouped_experts` for a part of a layer whose picks are sorted already (`LayerPicks.part`:
    `picks` the flat pick indices of its experts in stacked-row order, `offs` / `counts` per row):
    the same sums, GROUPED_ROWS picks at a time, without the part's own sort and counts."""
    out = _running_sum(x, addend)
    _sum_blocks(x, k, wts, picks, offs, counts, sum(counts), gate, up, down, out)
    return out if running else out.to(x.dtype)


def counts_of(values: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of 0..size-1 occurs in `values` (int64, every value < size), on their device
    with no host read: torch.bincount reads the values' min and max back on CUDA (two syncs)."""
    flat = values.reshape(-1)
    ones = torch.ones(flat.shape, dtype=torch.int64, device=flat.device)
    return torch.zeros(size, dtype=torch.int64, device=flat.device).index_add_(0, flat, ones)


def _rows(x: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
          down: torch.Tensor, offs: torch.Tensor, counts: list[int] | None, out: torch.Tensor,
          masked: bool) -> None:
    """Picks (their tokens and routing weights, sorted by expert: offs, and the host's counts where
    known) through the grouped
    SwiGLU, weighted and added into `out` (fp32) a block of SCATTER_ROWS rows at a time; `masked`:
    rows of weight 0 (held elsewhere) zeroed first (they come out undefined)."""
    xs = x.index_select(0, token)
    h = grouped_mm(xs, _matrices(gate, x.dtype).transpose(1, 2), offs, counts)
    u = grouped_mm(xs, _matrices(up, x.dtype).transpose(1, 2), offs, counts)
    del xs
    h = F.silu(h, inplace=True).mul_(u)
    del u
    y = grouped_mm(h, _matrices(down, x.dtype).transpose(1, 2), offs, counts)
    del h
    if masked:
        y.masked_fill_((weight == 0)[:, None], 0.0)
    for lo in range(0, y.shape[0], SCATTER_ROWS):  # weighted and summed in fp32, a block of rows at a time
        hi = lo + SCATTER_ROWS
        out.index_add_(0, token[lo:hi], y[lo:hi].float().mul_(weight[lo:hi, None]))


def _matrices(stack, dtype: torch.dtype) -> torch.Tensor:
    """A stacked projection as matrices in `dtype`: itself, or one held in FP8 dequantized (a
    temporary, freed after the product that reads it)."""
    return dequantize_experts(stack, dtype) if isinstance(stack, Fp8Weight) else stack


def stack_experts(w: dict, ids: tuple[int, ...], experts: int) -> dict:
    """A GPU routed-experts node's weights {role: {expert: tensor}} as stacked gate, up, down
    (row i: expert ids[i]) and `local`, each of the layer's `experts` ids' row (-1: held elsewhere)."""
    stacked = {r: torch.stack([w[r][e] for e in ids]) for r in ("gate", "up", "down")}
    return dict(local=expert_map(ids, experts, stacked["gate"].device), **stacked)


def expert_map(ids: tuple[int, ...], experts: int, device) -> torch.Tensor:
    """[experts] int64: each held expert's row in the stacked weights, -1 for the others."""
    local = torch.full((experts,), -1, dtype=torch.int64)
    local[list(ids)] = torch.arange(len(ids))
    return local.to(device)


def unpack_matrix(fmt: str, data: torch.Tensor, scales: torch.Tensor | None, np_: int, kp: int, group: int,
                  out: torch.Tensor) -> None:
    """Packed matrices [n_experts, bytes] (uint8, one row per expert, as the native operator
    lays them out; see native/include/ktf/common.h) into `out` [n_experts, n, k] (n <= np_,
    k <= kp), in out's dtype."""
    e = data.shape[0]
    n, k = out.shape[1], out.shape[2]
    if fmt == "bf16":  # [np/16][kp/2][16][2]
        w = data.view(torch.bfloat16).view(e, np_ // 16, kp // 2, 16, 2).permute(0, 1, 3, 2, 4)
        if (n, k) == (np_, kp):  # no padding: one strided copy, no temporary
            try:
                out.view(e, np_ // 16, 16, kp // 2, 2).copy_(w)
                return
            except RuntimeError:  # a target whose rows cannot be split into blocks: through a temporary
                pass
        out.copy_(w.reshape(e, np_, kp)[:, :n, :k])
        return
    if dequant_gpu.available(data.device):  # int8/int4/fp8 in one pass
        dequant_gpu.dequantize(fmt, data, scales, np_, kp, group, out)
        return
    if fmt == "fp8":  # [np/16][kp/2][16][2] e4m3 bytes
        q = data.view(torch.float8_e4m3fn).view(e, np_ // 16, kp // 2, 16, 2).permute(0, 1, 3, 2, 4).reshape(e, np_, kp)
    elif fmt == "int8":  # [np/16][kp/4][16][4], value + 128
        q = data.view(e, np_ // 16, kp // 4, 16, 4).permute(0, 1, 3, 2, 4).reshape(e, np_, kp).to(torch.int16) - 128
    else:  # int4: [np/16][kp/8][16][4] bytes; byte i holds k = 8q + i (low nibble), 8q + 4 + i (high); value + 8
        b = data.view(e, np_ // 16, kp // 8, 16, 4)
        q = torch.stack([b & 15, b >> 4], dim=4)  # [.., 16, 2, 4]: k order within the octet
        q = q.permute(0, 1, 3, 2, 4, 5).reshape(e, np_, kp).to(torch.int16) - 8
    s = scales.view(torch.float32).view(e, np_ // 16, kp // group, 16).permute(0, 1, 3, 2).reshape(e, np_, kp // group)
    w = q.float().view(e, np_, kp // group, group) * s[..., None]
    out.copy_(w.reshape(e, np_, kp)[:, :n, :k])
