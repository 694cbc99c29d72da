"""Grouped-query attention of a captured decode step in two Triton kernels (three past 512 cache
positions), after one GEMM for q, k and v together.

The torch form of a decode layer's attention (static_rules.gqa) is three projection GEMMs, two
q/k norms, two rotations, two cache writes, a mask turned into an additive bias and cuDNN's
attention over the whole static cache: about 14 kernels and 45 us of GPU time a layer on the
GPU host (Qwen3-30B-A3B shape, benchmarks/RESULTS.md), all of it on the critical path of exact
decode, where the CPU's experts wait for it. Here:

- `project`: q, k and v of every token from one projection (the layer's q/k/v weights concatenated
  once, `fuse_qkv`), then one kernel, `qkv_rope_cache`, with a program per (token, head): a q or k
  head is RMS-normalised (when the layer has q/k norms) and rotated, a q head stored for attention,
  a k head written into the key cache at its position, a v head into the value cache. The
  arithmetic and its roundings are `layers.gqa_project`'s with fused_gpu's norm and rotation (the
  norm rounded to the activation dtype before the weight, the weight's product rounded, the
  rotation in float32 rounded once), so the cache holds what the torch form writes.
- `attend`: one program per (token, key/value head, split of the cache): the query heads that share
  the key head as the rows of one tile, an online softmax over the split's keys in blocks (scores
  and sums in float32, the probabilities rounded to the activation dtype for the product with the
  values, as flash attention does), reading keys up to the token's own position only (and from its
  window's start): the step's cost follows the position, not the cache's length. Caches up to 512
  positions are one split and the kernel writes the output; longer ones are split every 256
  positions (splits past the position return at once) and `combine` merges the splits' partial
  sums by their maxima.

Positions come from a tensor on the GPU (the captured graph's), one per step or one per row (a
ragged step); a token's cache row and position follow the static rules' convention. The torch
form stays the reference: tests/test_fused_gpu.py compares the two on the GPU.
"""

from __future__ import annotations

import functools

import torch

#: caches longer than this are attended in splits of SPLIT_KEYS positions, merged by `combine`
ONE_SPLIT_MAX = 512
SPLIT_KEYS = 256


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_rope_cache(qkv, qkv_row, q_norm, k_norm, cos, sin, rope_rows, pos, q_out, k_cache, v_cache,
                       c_b, c_h, c_l, seq, heads, kv_heads, eps,
                       D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_REST: tl.constexpr, QK_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                       RAGGED: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if RAGGED:  # a token per row, each at its own position
            b = t
            p = tl.load(pos + t)
        else:
            b = t // seq
            p = tl.load(pos) + t % seq
        src = qkv + t * qkv_row + h * D
        d = tl.arange(0, BLOCK_D)
        if h >= heads + kv_heads:  # a value head: into the value cache as it is
            v = tl.load(src + d, mask=d < D)
            tl.store(v_cache + b * c_b + (h - heads - kv_heads) * c_h + p * c_l + d, v, mask=d < D)
            return
        ty = src.dtype.element_ty
        i = tl.arange(0, BLOCK_I)
        pair = i < HALF
        if INTERLEAVED:
            at1, at2 = 2 * i, 2 * i + 1
        else:
            at1, at2 = i, HALF + i
        x1 = tl.load(src + at1, mask=pair, other=0.0).to(tl.float32)
        x2 = tl.load(src + at2, mask=pair, other=0.0).to(tl.float32)
        if BLOCK_REST > 0:  # partial rotary: the dims past 2 * HALF pass through
            j = 2 * HALF + tl.arange(0, BLOCK_REST)
            rest = j < D
            xr = tl.load(src + j, mask=rest, other=0.0).to(tl.float32)
        if QK_NORM:  # RMSNorm over the head: rounded to the activation dtype, times the weight, rounded
            whole = tl.load(src + d, mask=d < D, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(whole * whole, axis=0) / D + eps)
            w = q_norm if h < heads else k_norm
            x1 = (tl.load(w + at1, mask=pair, other=0.0).to(tl.float32)
                  * (x1 * r).to(ty, fp_downcast_rounding="rtne").to(tl.float32)).to(ty, fp_downcast_rounding="rtne").to(tl.float32)
            x2 = (tl.load(w + at2, mask=pair, other=0.0).to(tl.float32)
                  * (x2 * r).to(ty, fp_downcast_rounding="rtne").to(tl.float32)).to(ty, fp_downcast_rounding="rtne").to(tl.float32)
            if BLOCK_REST > 0:
                xr = (tl.load(w + j, mask=rest, other=0.0).to(tl.float32)
                      * (xr * r).to(ty, fp_downcast_rounding="rtne").to(tl.float32)).to(ty, fp_downcast_rounding="rtne").to(tl.float32)
        row = (t % rope_rows) * HALF
        c = tl.load(cos + row + i, mask=pair, other=0.0).to(tl.float32)
        s = tl.load(sin + row + i, mask=pair, other=0.0).to(tl.float32)
        o1 = (x1 * c - x2 * s).to(ty, fp_downcast_rounding="rtne")
        o2 = (x2 * c + x1 * s).to(ty, fp_downcast_rounding="rtne")
        if h < heads:
            dst = q_out + (t * heads + h) * D
        else:
            dst = k_cache + b * c_b + (h - heads) * c_h + p * c_l
        tl.store(dst + i, o1, mask=pair)
        tl.store(dst + HALF + i, o2, mask=pair)
        if BLOCK_REST > 0:
            tl.store(dst + j, xr.to(ty, fp_downcast_rounding="rtne"), mask=rest)

    @triton.jit
    def attend(q, k_cache, v_cache, c_b, c_h, c_l, pos, out, part_acc, part_m, part_l,
               seq, heads, group, scale, window, split_keys,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
               RAGGED: tl.constexpr, SPLITS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        split = tl.program_id(2)
        if RAGGED:
            b = t
            p = tl.load(pos + t)
        else:
            b = t // seq
            p = tl.load(pos) + t % seq
        rows = tl.arange(0, BLOCK_G)
        hq = g * group + rows
        live = rows < group
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        qv = tl.load(q + (t * heads + hq)[:, None] * D + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        lo = split.to(tl.int64) * split_keys
        hi = tl.minimum(lo + split_keys, p + 1)
        if window > 0:
            lo = tl.maximum(lo, p - window + 1)
        kb = k_cache + b * c_b + g * c_h
        vb = v_cache + b * c_b + g * c_h
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < hi
            kt = tl.load(kb + n[:, None] * c_l + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            sc = tl.dot(qv, tl.trans(kt)) * scale
            sc = tl.where(nm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            vt = tl.load(vb + n[:, None] * c_l + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pr.to(vt.dtype, fp_downcast_rounding="rtne"), vt)
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(out + (t * heads + hq)[:, None] * D + d[None, :], o.to(out.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=live[:, None] & dm[None, :])
        else:  # this split's unnormalised sums, merged by `combine`
            at = (t * heads + hq) * SPLITS + split
            tl.store(part_acc + at[:, None] * D + d[None, :], acc, mask=live[:, None] & dm[None, :])
            tl.store(part_m + at, m_i, mask=live)
            tl.store(part_l + at, l_i, mask=live)

    @triton.jit
    def combine(part_acc, part_m, part_l, out, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
                BLOCK_S: tl.constexpr):
        th = tl.program_id(0).to(tl.int64)  # token * heads + head
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        m = tl.load(part_m + th * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
        top = tl.max(m, axis=0)  # split 0 always holds the first key: finite
        w = tl.exp(m - top)  # empty splits (m = -inf) weigh 0
        total = tl.sum(w * tl.load(part_l + th * SPLITS + s, mask=s < SPLITS, other=0.0), axis=0)
        acc = tl.load(part_acc + (th * SPLITS + s)[:, None] * D + d[None, :],
                      mask=(s[:, None] < SPLITS) & (d[None, :] < D), other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / total
        tl.store(out + th * D + d, o.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=d < D)

    @triton.jit
    def mla_rope_cache(q, q_row, kv, kv_row, kv_norm, cos, sin, rope_rows, pos, q_rope, cache, c_b, c_l,
                       seq, heads, eps, NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, INTERLEAVED: tl.constexpr,
                       RAGGED: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if RAGGED:
            b = t
            p = tl.load(pos + t)
        else:
            b = t // seq
            p = tl.load(pos) + t % seq
        row = cache + b * c_b + p * c_l  # the cache's [latent | roped key] row at the position
        if h < heads:  # a query head's rope part
            src = q + t * q_row + h * (NOPE + 2 * HALF) + NOPE
            dst = q_rope + (t * heads + h) * 2 * HALF
        else:  # the latent, normalised, and the key's rope part
            src = kv + t * kv_row + RANK
            dst = row + RANK
            c = tl.arange(0, BLOCK_R)
            x = tl.load(kv + t * kv_row + c, mask=c < RANK, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, axis=0) / RANK + eps)
            y = (x * r).to(kv.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
            wv = tl.load(kv_norm + c, mask=c < RANK, other=0.0).to(tl.float32)
            tl.store(row + c, (wv * y).to(cache.dtype.element_ty, fp_downcast_rounding="rtne"), mask=c < RANK)
        i = tl.arange(0, BLOCK_I)
        pair = i < HALF
        if INTERLEAVED:
            x1 = tl.load(src + 2 * i, mask=pair, other=0.0).to(tl.float32)
            x2 = tl.load(src + 2 * i + 1, mask=pair, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(src + i, mask=pair, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + i, mask=pair, other=0.0).to(tl.float32)
        k = (t % rope_rows) * HALF
        cv = tl.load(cos + k + i, mask=pair, other=0.0).to(tl.float32)
        sv = tl.load(sin + k + i, mask=pair, other=0.0).to(tl.float32)
        ty = dst.dtype.element_ty
        tl.store(dst + i, (x1 * cv - x2 * sv).to(ty, fp_downcast_rounding="rtne"), mask=pair)
        tl.store(dst + HALF + i, (x2 * cv + x1 * sv).to(ty, fp_downcast_rounding="rtne"), mask=pair)

    @triton.jit
    def attend_latent(q_lat, ql_t, ql_h, q_rope, cache, c_b, c_l, pos, out, part_acc, part_m, part_l,
                      seq, heads, scale, split_keys, RANK: tl.constexpr, ROPE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, RAGGED: tl.constexpr, SPLITS: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        if RAGGED:
            b = t
            p = tl.load(pos + t)
        else:
            b = t // seq
            p = tl.load(pos) + t % seq
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        live = h < heads
        c = tl.arange(0, BLOCK_R)
        cm = c < RANK
        e = tl.arange(0, BLOCK_P)
        em = e < ROPE
        ql = tl.load(q_lat + t * ql_t + h[:, None] * ql_h + c[None, :], mask=live[:, None] & cm[None, :], other=0.0)
        qr = tl.load(q_rope + (t * heads + h)[:, None] * ROPE + e[None, :], mask=live[:, None] & em[None, :],
                     other=0.0)
        lo = split.to(tl.int64) * split_keys
        hi = tl.minimum(lo + split_keys, p + 1)
        base = cache + b * c_b
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < hi
            lat = tl.load(base + n[:, None] * c_l + c[None, :], mask=nm[:, None] & cm[None, :], other=0.0)
            kr = tl.load(base + n[:, None] * c_l + RANK + e[None, :], mask=nm[:, None] & em[None, :], other=0.0)
            sc = (tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(kr))) * scale
            sc = tl.where(nm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(lat.dtype, fp_downcast_rounding="rtne"), lat)
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            tl.store(out + (t * heads + h)[:, None] * RANK + c[None, :],
                     o.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=live[:, None] & cm[None, :])
        else:
            at = (t * heads + h) * SPLITS + split
            tl.store(part_acc + at[:, None] * RANK + c[None, :], acc, mask=live[:, None] & cm[None, :])
            tl.store(part_m + at, m_i, mask=live)
            tl.store(part_l + at, l_i, mask=live)

    return triton, qkv_rope_cache, attend, combine, mla_rope_cache, attend_latent


def fusable(a, w: dict, x: torch.Tensor) -> bool:
    """Whether this GQA layer's decode attention runs here: on a CUDA device with Triton, weights
    held in the activation dtype (not FP8) and q/k/v concatenated (`fuse_qkv`), heads that share a
    key head at most 64."""
    from .dequant_gpu import available

    return (x.is_cuda and "qkv" in w and a.kind == "gqa" and a.heads % a.kv_heads == 0
            and a.heads // a.kv_heads <= 64 and 2 * (a.rope.dim // 2) <= a.head_dim and available(x.device))


def fuse_qkv(w: dict, kind: str = "gqa") -> None:
    """Concatenate the projections an attention layer applies to its input into one matrix, in
    place, each left as a view of it (no second copy): a GQA layer's q, k, v (and their biases)
    into `qkv`; an MLA layer's q (or q_a, with a query LoRA) and kv_a into `q_kv_a`. Nothing
    where one is held in another form (FP8), on the CPU, has a bias of its own, or is fused already."""
    fused, roles = ("qkv", ("q", "k", "v")) if kind == "gqa" else \
        ("q_kv_a", ("q_a" if "q_a" in w else "q", "kv_a"))
    if fused in w or not all(isinstance(w.get(r), torch.Tensor) for r in roles):
        return
    parts = [w[r] for r in roles]
    if len({(t.dtype, t.device) for t in parts}) != 1 or parts[0].device.type != "cuda":
        return
    biases = [w.get(r + "_bias") for r in roles]
    if any(b is not None for b in biases) and not all(isinstance(b, torch.Tensor) for b in biases):
        return
    rows = [len(t) for t in parts]
    whole = torch.cat(parts)
    w[fused] = whole
    w.update(zip(roles, torch.split(whole, rows)))
    if biases[0] is not None:
        bias = torch.cat(biases)
        w[fused + "_bias"] = bias
        w.update(zip((r + "_bias" for r in roles), torch.split(bias, rows)))


def project(a, qkv: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, seq: int, ragged: bool) -> torch.Tensor:
    """From qkv [T, (heads + 2 kv_heads) * head_dim] (T = batch * seq tokens): the keys and values
    written into the caches [B, kv_heads, L, head_dim] at each token's position, the roped queries
    returned [T, heads, head_dim]. cos/sin [rows, rope_dim / 2]: token t's rotation is row t % rows."""
    triton, kernel, *_ = _kernels()
    t = qkv.shape[0]
    D, half = a.head_dim, cos.shape[-1]
    q = torch.empty(t, a.heads, D, dtype=qkv.dtype, device=qkv.device)
    rest = D - 2 * half
    norm = a.qk_norm
    kernel[(t, a.heads + 2 * a.kv_heads)](
        qkv, qkv.stride(0), w["q_norm"] if norm else qkv, w["k_norm"] if norm else qkv, cos.contiguous(),
        sin.contiguous(), cos.shape[0], pos, q, k_cache, v_cache, *k_cache.stride()[:3], seq, a.heads, a.kv_heads,
        float(a.norm_eps), D=D, HALF=half, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_I=triton.next_power_of_2(max(half, 1)), BLOCK_REST=triton.next_power_of_2(rest) if rest > 0 else 0,
        QK_NORM=norm, INTERLEAVED=a.rope.pairs != "half", RAGGED=ragged, num_warps=1)
    return q


def attend(a, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, seq: int,
           ragged: bool) -> torch.Tensor:
    """Attention of the queries q [T, heads, head_dim] over the caches up to each token's position
    (and from its window's start); returns [T, heads * head_dim] in q's dtype."""
    triton, _, kernel, merge, *_ = _kernels()
    t, length = q.shape[0], k_cache.shape[2]
    D, group = a.head_dim, a.heads // a.kv_heads
    splits = 1 if length <= ONE_SPLIT_MAX else triton.cdiv(length, SPLIT_KEYS)
    split_keys = length if splits == 1 else SPLIT_KEYS
    out = torch.empty(t, a.heads * D, dtype=q.dtype, device=q.device)
    if splits == 1:
        part_acc = part_m = part_l = out
    else:
        part_acc = torch.empty(t * a.heads * splits, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(t * a.heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    block_d = triton.next_power_of_2(D)
    kernel[(t, a.kv_heads, splits)](
        q, k_cache, v_cache, *k_cache.stride()[:3], pos, out, part_acc, part_m, part_l, seq, a.heads, group,
        float(a.softmax_scale), int(a.window), split_keys, D=D, BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64 if block_d <= 128 else 32, RAGGED=ragged,
        SPLITS=splits, num_warps=4)
    if splits > 1:
        merge[(t * a.heads,)](part_acc, part_m, part_l, out, D=D, BLOCK_D=block_d, SPLITS=splits,
                              BLOCK_S=triton.next_power_of_2(splits))
    return out


def mla_fusable(a, w: dict, x: torch.Tensor) -> bool:
    """Whether this MLA layer's decode attention runs here (CUDA with Triton, the first projections
    concatenated by `fuse_qkv`)."""
    from .dequant_gpu import available

    return (x.is_cuda and "q_kv_a" in w and a.kind == "mla" and a.qk_rope_dim % 2 == 0
            and a.kv_lora_rank <= 1024 and available(x.device))


def mla_project(a, q: torch.Tensor, kv: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor, cache: torch.Tensor, seq: int, ragged: bool) -> torch.Tensor:
    """From q [T, heads * (nope + rope)] and kv [T, rank + rope] (rows may be strided): the latent
    normalised and the key's rope part rotated, both written into the cache [B, L, rank + rope]
    at each token's position; the queries' rope parts returned rotated [T, heads, rope]."""
    triton, *_, kernel, _ = _kernels()
    t = q.shape[0]
    half = a.qk_rope_dim // 2
    q_rope = torch.empty(t, a.heads, a.qk_rope_dim, dtype=q.dtype, device=q.device)
    kernel[(t, a.heads + 1)](
        q, q.stride(0), kv, kv.stride(0), kv_norm, cos.contiguous(), sin.contiguous(), cos.shape[0], pos, q_rope, cache,
        cache.stride(0), cache.stride(1), seq, a.heads, float(a.norm_eps), NOPE=a.qk_nope_dim, RANK=a.kv_lora_rank,
        HALF=half, BLOCK_R=triton.next_power_of_2(a.kv_lora_rank), BLOCK_I=triton.next_power_of_2(half),
        INTERLEAVED=a.rope.pairs != "half", RAGGED=ragged, num_warps=4)
    return q_rope


def attend_latent(a, q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor, seq: int,
                  ragged: bool) -> torch.Tensor:
    """Absorbed MLA attention: queries in the latent space q_lat [T, heads, rank] (heads and tokens
    may be strided) beside their rope parts q_rope [T, heads, rope], over the cache [B, L, rank + rope]
    (one key head every query head shares; its latent part is also the value) up to each token's
    position. Returns the latent outputs [T, heads, rank] in q_lat's dtype."""
    triton, _, _, merge, _, kernel = _kernels()
    t, length = q_lat.shape[0], cache.shape[1]
    rank, heads = a.kv_lora_rank, a.heads
    splits = 1 if length <= ONE_SPLIT_MAX else triton.cdiv(length, SPLIT_KEYS)
    out = torch.empty(t, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if splits == 1:
        part_acc = part_m = part_l = out
    else:
        part_acc = torch.empty(t * heads * splits, rank, dtype=torch.float32, device=q_lat.device)
        part_m = torch.empty(t * heads * splits, dtype=torch.float32, device=q_lat.device)
        part_l = torch.empty_like(part_m)
    block_h = 16
    kernel[(t, triton.cdiv(heads, block_h), splits)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_rope, cache, cache.stride(0), cache.stride(1), pos, out, part_acc,
        part_m, part_l, seq, heads, float(a.softmax_scale), length if splits == 1 else SPLIT_KEYS, RANK=rank,
        ROPE=a.qk_rope_dim, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=max(16, triton.next_power_of_2(a.qk_rope_dim)),
        BLOCK_H=block_h, BLOCK_N=32, RAGGED=ragged, SPLITS=splits, num_warps=4)
    if splits > 1:
        merge[(t * heads,)](part_acc, part_m, part_l, out, D=rank, BLOCK_D=triton.next_power_of_2(rank), SPLITS=splits,
                            BLOCK_S=triton.next_power_of_2(splits))
    return out
