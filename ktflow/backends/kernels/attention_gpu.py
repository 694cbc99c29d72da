"""A captured decode step's attention in Triton kernels (attention_kernels): one GEMM for the
layer's input projections, one kernel for norms, rotation and cache writes, one for attention
(and a merge past ONE_SPLIT_MAX cache positions), for GQA and for DeepSeek's MLA.

- `project` / `mla_project` write into the caches what the torch forms write (static_rules,
  `layers.gqa_project`): the same arithmetic and roundings, after `fuse_qkv` joined the weights.
- `attend` / `attend_latent` read keys only up to each token's own position (and from its window's
  start): scores and sums in float32, probabilities rounded to the activation dtype for the
  product with the values, as flash attention does. MLA's output stays in the latent space (the
  caller applies W_uv).
- Positions come from a tensor on the GPU, one per step or one per row (a ragged step); a token's
  cache row and position follow the static rules' convention.
The torch forms stay the reference: tests/test_attention_gpu.py compares them on the GPU.
"""

from __future__ import annotations

import torch

#: caches longer than this are attended in splits of SPLIT_KEYS positions, merged by `combine`
ONE_SPLIT_MAX = 512
SPLIT_KEYS = 256
#: `combine` loads every split's float32 sums as one tile where splits x width (powers of two) is
#: at most COMBINE_ONE_TILE values (GQA's 128-wide heads over a 32k cache; MLA's 512-wide latent up
#: to 64 splits), else COMBINE_TILE values a chunk (MLA past 16k positions: 8 splits, where one
#: tile spills); the splits past a token's position are not read (timings: docs/results-history.md,
#: session 47)
COMBINE_ONE_TILE = 32768
COMBINE_TILE = 4096


def _kernels():
    """The kernels (attention_kernels), imported on first use: Triton is optional."""
    from . import attention_kernels

    return attention_kernels


def _splits(length: int) -> tuple[int, int]:
    """(splits, keys per split) for a cache of `length` positions."""
    if length <= ONE_SPLIT_MAX:
        return 1, length
    return -(-length // SPLIT_KEYS), SPLIT_KEYS


def _attended(rows: int, width: int, splits: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """The output [rows, width] (rows: token * heads + head) and, past one split, each split's
    unnormalised sums, maxima and sums of exponentials for `combine` (else the output again)."""
    out = torch.empty(rows, width, dtype=dtype, device=device)
    if splits == 1:
        return out, out, out, out
    part_m = torch.empty(rows * splits, dtype=torch.float32, device=device)
    return out, torch.empty(rows * splits, width, dtype=torch.float32, device=device), part_m, torch.empty_like(part_m)


def _combine(k, out, part_acc, part_m, part_l, width: int, splits: int) -> None:
    if splits > 1:
        block_d, block_s = k.triton.next_power_of_2(width), k.triton.next_power_of_2(splits)
        chunk = block_s if block_s * block_d <= COMBINE_ONE_TILE else max(1, COMBINE_TILE // block_d)
        k.combine[(out.shape[0],)](part_acc, part_m, part_l, out, D=width, BLOCK_D=block_d, SPLITS=splits,
                                   BLOCK_S=block_s, CHUNK=chunk)


#: the matrix `fuse_qkv` concatenates an attention kind's input projections into
FUSED = {"gqa": "qkv", "mla": "q_kv_a"}


def fusable(a, w: dict, x: torch.Tensor) -> bool:
    """Whether this layer's decode attention runs here: on a CUDA device with Triton, its input
    projections concatenated by `fuse_qkv` (held in the activation dtype, not FP8); for GQA heads
    that share a key head at most 64 and a rotary part within the head, for MLA a latent of at
    most 1024."""
    from .dequant_gpu import available

    if not (x.is_cuda and FUSED.get(a.kind) in w):
        return False
    if a.kind == "gqa":
        shape_ok = a.heads % a.kv_heads == 0 and a.heads // a.kv_heads <= 64 and 2 * (a.rope.dim // 2) <= a.head_dim
    else:
        shape_ok = a.qk_rope_dim % 2 == 0 and a.kv_lora_rank <= 1024
    return shape_ok and available(x.device)


def fuse_qkv(w: dict, kind: str = "gqa") -> None:
    """Concatenate the projections an attention layer applies to its input into one matrix, in
    place, each left as a view of it (no second copy): a GQA layer's q, k, v (and their biases)
    into `qkv`; an MLA layer's q (or q_a, with a query LoRA) and kv_a into `q_kv_a`. Nothing
    where one is held in another form (FP8), on the CPU, has a bias of its own, or is fused already."""
    fused = FUSED[kind]
    roles = ("q", "k", "v") if kind == "gqa" else ("q_a" if "q_a" in w else "q", "kv_a")
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
    k = _kernels()
    triton = k.triton
    t = qkv.shape[0]
    D, half = a.head_dim, cos.shape[-1]
    q = torch.empty(t, a.heads, D, dtype=qkv.dtype, device=qkv.device)
    rest = D - 2 * half
    norm = a.qk_norm
    k.qkv_rope_cache[(t, a.heads + 2 * a.kv_heads)](
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
    k = _kernels()
    triton = k.triton
    t = q.shape[0]
    D, group = a.head_dim, a.heads // a.kv_heads
    splits, split_keys = _splits(k_cache.shape[2])
    out, part_acc, part_m, part_l = _attended(t * a.heads, D, splits, q.dtype, q.device)
    block_d = triton.next_power_of_2(D)
    k.attend[(t, a.kv_heads, splits)](
        q, k_cache, v_cache, *k_cache.stride()[:3], pos, out, part_acc, part_m, part_l, seq, a.heads, group,
        float(a.softmax_scale), int(a.window), split_keys, D=D, BLOCK_D=block_d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=64 if block_d <= 128 else 32, RAGGED=ragged,
        SPLITS=splits, num_warps=4)
    _combine(k, out, part_acc, part_m, part_l, D, splits)
    return out.view(t, a.heads * D)


def mla_project(a, q: torch.Tensor, kv: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                pos: torch.Tensor, cache: torch.Tensor, seq: int, ragged: bool) -> torch.Tensor:
    """From q [T, heads * (nope + rope)] and kv [T, rank + rope] (rows may be strided): the latent
    normalised and the key's rope part rotated, both written into the cache [B, L, rank + rope]
    at each token's position; the queries' rope parts returned rotated [T, heads, rope]."""
    k = _kernels()
    triton = k.triton
    t = q.shape[0]
    half = a.qk_rope_dim // 2
    q_rope = torch.empty(t, a.heads, a.qk_rope_dim, dtype=q.dtype, device=q.device)
    k.mla_rope_cache[(t, a.heads + 1)](
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
    k = _kernels()
    triton = k.triton
    t = q_lat.shape[0]
    rank, heads = a.kv_lora_rank, a.heads
    splits, split_keys = _splits(cache.shape[1])
    out, part_acc, part_m, part_l = _attended(t * heads, rank, splits, q_lat.dtype, q_lat.device)
    block_h = 16
    k.attend_latent[(t, triton.cdiv(heads, block_h), splits)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_rope, cache, cache.stride(0), cache.stride(1), pos, out, part_acc,
        part_m, part_l, seq, heads, float(a.softmax_scale), split_keys, RANK=rank, ROPE=a.qk_rope_dim,
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=max(16, triton.next_power_of_2(a.qk_rope_dim)),
        BLOCK_H=block_h, BLOCK_N=32, RAGGED=ragged, SPLITS=splits, num_warps=4)
    _combine(k, out, part_acc, part_m, part_l, rank, splits)
    return out.view(t, heads, rank)
