"""The Triton kernels of attention_gpu (imported only where a decode step runs them: Triton is
optional). Module-level, so that the kernels can call the shared pieces (`token_at`, `rope_at`,
`online_softmax`, `finish`) as jit functions."""

import triton
import triton.language as tl


@triton.jit
def token_at(t, pos, seq, RAGGED: tl.constexpr):
    """Token t's cache row and position: a ragged step's rows each at their own position,
    otherwise `seq` tokens a row from the step's position."""
    if RAGGED:
        b = t
        p = tl.load(pos + t)
    else:
        b = t // seq
        p = tl.load(pos) + t % seq
    return b, p


@triton.jit
def rope_at(cos, sin, t, rope_rows, i, pair, HALF: tl.constexpr):
    """Token t's cos/sin (row t % rope_rows of the step's rows), in float32."""
    k = (t % rope_rows) * HALF
    return (tl.load(cos + k + i, mask=pair, other=0.0).to(tl.float32),
            tl.load(sin + k + i, mask=pair, other=0.0).to(tl.float32))


@triton.jit
def online_softmax(m_i, l_i, acc, scores, keep, values):
    """One block of keys into the running max, sum and weighted values (the probabilities
    rounded to the values' dtype for their product, as flash attention does)."""
    scores = tl.where(keep[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(values.dtype, fp_downcast_rounding="rtne"), values)
    return m_new, l_i, acc


@triton.jit
def finish(acc, m_i, l_i, out, part_acc, part_m, part_l, rows, cols, live, split,
           W: tl.constexpr, SPLITS: tl.constexpr):
    """The output rows (token * heads + head) [.., W]: normalised into `out` when the cache is
    one split, else this split's unnormalised sums for `combine`."""
    both = live[:, None] & (cols[None, :] < W)
    if SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out + rows[:, None] * W + cols[None, :], o.to(out.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=both)
    else:  # an empty split (past the position: most of a long cache early on) stores no sums
        at = rows * SPLITS + split
        tl.store(part_acc + at[:, None] * W + cols[None, :], acc, mask=both & (l_i[:, None] > 0))
        tl.store(part_m + at, m_i, mask=live)
        tl.store(part_l + at, l_i, mask=live)


@triton.jit
def qkv_rope_cache(qkv, qkv_row, q_norm, k_norm, cos, sin, rope_rows, pos, q_out, k_cache, v_cache,
                   c_b, c_h, c_l, seq, heads, kv_heads, eps,
                   D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                   BLOCK_REST: tl.constexpr, QK_NORM: tl.constexpr, INTERLEAVED: tl.constexpr,
                   RAGGED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b, p = token_at(t, pos, seq, RAGGED)
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
    c, s = rope_at(cos, sin, t, rope_rows, i, pair, HALF)
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
    b, p = token_at(t, pos, seq, RAGGED)
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
        vt = tl.load(vb + n[:, None] * c_l + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = online_softmax(m_i, l_i, acc, tl.dot(qv, tl.trans(kt)) * scale, nm, vt)
    finish(acc, m_i, l_i, out, part_acc, part_m, part_l, t * heads + hq, d, live, split, D, SPLITS)


@triton.jit
def combine(part_acc, part_m, part_l, out, D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
            BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
    """The splits' sums merged, CHUNK splits at a time (a [CHUNK, D] tile: a cache of 128 splits
    and MLA's 512-wide latent in one tile would spill); the sums of an empty split (m = -inf,
    stored by no one) are never read, so a long cache early in a sequence costs its live splits."""
    th = tl.program_id(0).to(tl.int64)  # token * heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(part_m + th * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(m, axis=0)  # split 0 always holds the first key: finite
    w = tl.exp(m - top)  # empty splits (m = -inf) weigh 0
    total = tl.sum(w * tl.load(part_l + th * SPLITS + s, mask=s < SPLITS, other=0.0), axis=0)
    o = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        c = s0 + tl.arange(0, CHUNK)
        mc = tl.load(part_m + th * SPLITS + c, mask=c < SPLITS, other=float("-inf"))
        full = (c < SPLITS) & (mc != float("-inf"))
        acc = tl.load(part_acc + (th * SPLITS + c)[:, None] * D + d[None, :],
                      mask=full[:, None] & (d[None, :] < D), other=0.0)
        o += tl.sum(acc * tl.exp(mc - top)[:, None], axis=0)
    o = o / total
    tl.store(out + th * D + d, o.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=d < D)


@triton.jit
def mla_rope_cache(q, q_row, kv, kv_row, kv_norm, cos, sin, rope_rows, pos, q_rope, cache, c_b, c_l,
                   seq, heads, eps, NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, INTERLEAVED: tl.constexpr,
                   RAGGED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b, p = token_at(t, pos, seq, RAGGED)
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
    cv, sv = rope_at(cos, sin, t, rope_rows, i, pair, HALF)
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
    b, p = token_at(t, pos, seq, RAGGED)
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
        scores = (tl.dot(ql, tl.trans(lat)) + tl.dot(qr, tl.trans(kr))) * scale
        m_i, l_i, acc = online_softmax(m_i, l_i, acc, scores, nm, lat)
    finish(acc, m_i, l_i, out, part_acc, part_m, part_l, t * heads + h, c, live, split, RANK, SPLITS)
