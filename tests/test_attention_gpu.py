"""The decode attention kernels (backends/attention_gpu) against the torch forms they replace and
against attention computed in float64, on the GPU."""

import math
from dataclasses import replace

import pytest
import torch

from ktflow.backends.kernels import rope
from ktflow.ir.ops import AttentionAttrs, RopeAttrs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels are Triton's)")


def attrs(heads=8, kv=2, dim=64, rdim=64, pairs="half", norm=True, window=0):
    return AttentionAttrs(kind="gqa", layer=0, hidden=96, heads=heads, kv_heads=kv, head_dim=dim,
                          rope=RopeAttrs(dim=rdim, theta=10000.0, pairs=pairs), softmax_scale=1 / math.sqrt(dim),
                          qk_norm=norm, window=window, norm_eps=1e-6)


def weights(a, g):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = {r: torch.randn(n * a.head_dim, a.hidden, generator=g, device="cuda").to(torch.bfloat16) / 10
         for r, n in (("q", a.heads), ("k", a.kv_heads), ("v", a.kv_heads))}
    w["q_norm"], w["k_norm"] = ((1 + torch.randn(a.head_dim, generator=g, device="cuda") / 5).to(**bf) for _ in "qk")
    w["o"] = torch.randn(a.hidden, a.heads * a.head_dim, generator=g, device="cuda").to(**bf) / 10
    return w


def steps(batch, seq, pos, ragged):
    """Each token's (cache row, position), and the position tensor the kernels read."""
    if ragged:
        p = [pos + 3 * i for i in range(batch)]
        return [(i, p[i]) for i in range(batch)], torch.tensor(p, device="cuda")
    return [(b, pos + s) for b in range(batch) for s in range(seq)], torch.tensor([pos], device="cuda")


@pytest.mark.parametrize("a, batch, seq, ragged", [
    (attrs(), 2, 1, False),
    (attrs(pairs="interleaved", rdim=32), 2, 1, False),   # partial rotary, DeepSeek's pair layout
    (attrs(norm=False), 1, 3, False),                      # no q/k norm, three tokens a row
    (attrs(heads=32, kv=4, dim=128, rdim=128), 3, 1, True),  # Qwen3's heads, a ragged step
])
def test_project_writes_what_the_torch_form_computes(a, batch, seq, ragged):
    """q/k norms, rotation and cache writes in one kernel: the same values as the torch form
    (layers.rms_norm and layers.rotate, fused_gpu's kernels on the GPU) from the same projections,
    and nothing else in the caches changes."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import attention_gpu, layers

    g = torch.Generator(device="cuda").manual_seed(1)
    w = weights(a, g)
    tokens, pos = steps(batch, seq, 17, ragged)
    x = torch.randn(len(tokens), a.hidden, generator=g, device="cuda").to(torch.bfloat16)
    rows = pos if ragged else pos + torch.arange(seq, device="cuda")
    cos, sin = rope.cos_sin(a.rope, rope.inv_freq(a.rope), rows, torch.bfloat16)
    kc = torch.randn(batch, a.kv_heads, 40, a.head_dim, generator=g, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    want_k, want_v = kc.clone(), vc.clone()
    attention_gpu.fuse_qkv(w)
    qkv = torch.nn.functional.linear(x, w["qkv"])
    shape = (1, batch) if ragged else (batch, seq)
    q, k, v = (t.reshape(*shape, -1, a.head_dim) for t in qkv.split([a.heads * a.head_dim] + [a.kv_heads * a.head_dim] * 2, -1))
    if a.qk_norm:
        q, k = layers.rms_norm(q, w["q_norm"], a.norm_eps), layers.rms_norm(k, w["k_norm"], a.norm_eps)
    q, k = layers.rotate(q, cos, sin, a.rope.pairs), layers.rotate(k, cos, sin, a.rope.pairs)
    for i, (b, p) in enumerate(tokens):
        want_k[b, :, p] = k.reshape(-1, a.kv_heads, a.head_dim)[i]
        want_v[b, :, p] = v.reshape(-1, a.kv_heads, a.head_dim)[i]
    got_q = attention_gpu.project(a, qkv, w, cos, sin, pos, kc, vc, 1 if ragged else seq, ragged)
    torch.testing.assert_close(got_q, q.reshape(got_q.shape), rtol=0, atol=0)
    torch.testing.assert_close(kc, want_k, rtol=0, atol=0)
    torch.testing.assert_close(vc, want_v, rtol=0, atol=0)


def reference(a, q, kc, vc, tokens):
    """Attention in float64 over each token's keys 0..position (from its window's start)."""
    out = []
    group = a.heads // a.kv_heads
    for i, (b, p) in enumerate(tokens):
        lo = max(0, p - a.window + 1) if a.window else 0
        k = kc[b, :, lo:p + 1].double().repeat_interleave(group, 0)
        v = vc[b, :, lo:p + 1].double().repeat_interleave(group, 0)
        s = torch.einsum("hd,hnd->hn", q[i].double(), k) * a.softmax_scale
        out.append(torch.einsum("hn,hnd->hd", s.softmax(-1), v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("a, length, pos, batch, seq, ragged", [
    (attrs(), 40, 17, 2, 1, False),                                    # one split, keys 0..17 of 40
    (attrs(), 40, 0, 1, 1, False),                                     # the first position: one key
    (attrs(heads=32, kv=4, dim=128, rdim=128), 168, 150, 1, 1, False),  # the e2e benchmark's Qwen3 step
    (attrs(heads=7, kv=1, dim=128, rdim=128), 600, 550, 2, 1, False),   # a group of 7, three splits
    (attrs(heads=32, kv=4, dim=128, rdim=128, window=300), 1100, 1000, 2, 1, False),  # a window over splits
    (attrs(), 40, 30, 1, 3, False),                                    # three tokens a row, causal
    (attrs(heads=16, kv=16, dim=64), 2000, 1700, 3, 1, True),          # no grouping, ragged, splits
    (attrs(heads=32, kv=4, dim=128, rdim=128), 8192, 100, 1, 1, False),  # a long cache early: 31 empty splits
])
def test_attend_matches_float64_attention(a, length, pos, batch, seq, ragged):
    """The kernel's error against float64 attention is that of bf16 attention: no more than
    twice torch's own (scaled_dot_product_attention in bf16 over the same keys), and it reads
    no key past a token's position (the keys there are NaN)."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import attention_gpu

    g = torch.Generator(device="cuda").manual_seed(2)
    tokens, pos_t = steps(batch, seq, pos, ragged)
    kc = torch.randn(batch, a.kv_heads, length, a.head_dim, generator=g, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    for b, p in tokens:  # poison what lies past each row's last position
        last = max(q for r, q in tokens if r == b)
        kc[b, :, last + 1:] = float("nan")
        vc[b, :, last + 1:] = float("nan")
    q = (torch.randn(len(tokens), a.heads, a.head_dim, generator=g, device="cuda") * 2).to(torch.bfloat16)
    got = attention_gpu.attend(a, q, kc, vc, pos_t, 1 if ragged else seq, ragged)
    want = reference(a, q, kc, vc, tokens)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    group = a.heads // a.kv_heads
    torch_err = []
    for i, (b, p) in enumerate(tokens):
        lo = max(0, p - a.window + 1) if a.window else 0
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i][None, :, None], kc[b:b + 1, :, lo:p + 1].repeat_interleave(group, 1),
            vc[b:b + 1, :, lo:p + 1].repeat_interleave(group, 1), scale=a.softmax_scale)
        torch_err.append(o.reshape(-1))
    base = ((torch.stack(torch_err).double() - want).norm() / want.norm()).item()
    assert err <= 2 * base + 1e-4, (err, base)


def test_decode_rule_runs_the_kernels_and_matches_the_torch_form(monkeypatch):
    """static_rules.gqa on a CUDA step with fused weights goes through attention_gpu, and gives
    what the torch form gives on the same caches (within bf16 attention's rounding)."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import attention_gpu
    from ktflow.backends.cuda import static_rules
    from ktflow.backends.base import StepContext

    a = attrs(heads=32, kv=4, dim=128, rdim=128)
    g = torch.Generator(device="cuda").manual_seed(3)
    w = weights(a, g)
    x = torch.randn(1, a.hidden, generator=g, device="cuda").to(torch.bfloat16)
    kc0 = torch.randn(1, a.kv_heads, 64, a.head_dim, generator=g, device="cuda").to(torch.bfloat16)

    class Be:
        dtype = torch.bfloat16  # the rope tables are kept per dtype (static_rules._rope_rows)

        def __init__(self):
            self.caches = (kc0.clone(), kc0.clone() * 0.5)

        def cache(self, ctx, a, dev):
            return self.caches

    class State:
        max_seq_len = 64

    def step():
        return StepContext(batch=1, seq=1, position=0, state=State(), token_ids=torch.zeros(1),
                           position_t=torch.tensor([20], device="cuda"))

    torch_be, fused_be = Be(), Be()
    want = static_rules.gqa(torch_be, a, dict(w), x, step(), "cuda")
    calls = []
    real = attention_gpu.attend
    monkeypatch.setattr(attention_gpu, "attend", lambda *args: calls.append(1) or real(*args))
    attention_gpu.fuse_qkv(w)
    got = static_rules.gqa(fused_be, a, w, x, step(), "cuda")
    assert calls == [1]
    # the projections' GEMMs may round differently as one matrix: the caches agree to bf16's rounding
    torch.testing.assert_close(fused_be.caches[0], torch_be.caches[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_be.caches[1], torch_be.caches[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_fuse_qkv_keeps_the_three_as_views_of_one_matrix():
    from ktflow.backends.kernels import attention_gpu

    w = {r: torch.randn(n, 8, device="cuda").to(torch.bfloat16) for r, n in (("q", 16), ("k", 4), ("v", 4))}
    w.update({r + "_bias": torch.randn(n, device="cuda").to(torch.bfloat16) for r, n in (("q", 16), ("k", 4), ("v", 4))})
    q = w["q"].clone()
    attention_gpu.fuse_qkv(w)
    assert w["qkv"].shape == (24, 8) and w["qkv_bias"].shape == (24,)
    assert w["q"].data_ptr() == w["qkv"].data_ptr() and torch.equal(w["q"], q)
    assert w["k"].data_ptr() == w["qkv"][16:].data_ptr()
    before = w["qkv"]
    attention_gpu.fuse_qkv(w)  # once only
    assert w["qkv"] is before


def mla_attrs(heads=16, nope=32, rdim=16, rank=64, vdim=32, q_lora=0):
    return AttentionAttrs(kind="mla", layer=0, hidden=96, heads=heads,
                          rope=RopeAttrs(dim=rdim, theta=10000.0, pairs="interleaved"),
                          softmax_scale=1 / math.sqrt(nope + rdim), q_lora_rank=q_lora, kv_lora_rank=rank,
                          qk_nope_dim=nope, qk_rope_dim=rdim, v_head_dim=vdim, norm_eps=1e-6)


@pytest.mark.parametrize("a, batch, seq, ragged", [
    (mla_attrs(), 2, 1, False),
    (mla_attrs(), 1, 3, False),
    (mla_attrs(heads=16, nope=128, rdim=64, rank=512, vdim=128), 3, 1, True),  # DeepSeek-V2-Lite's shape, ragged
])
def test_mla_project_writes_what_the_torch_form_computes(a, batch, seq, ragged):
    """The latent's norm, the rotations and the cache writes in one kernel: the torch form's values
    (layers.mla_project's norm and rotation, fused_gpu's kernels) from the same projections; the
    rest of the cache unchanged."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import attention_gpu, layers

    g = torch.Generator(device="cuda").manual_seed(4)
    tokens, pos = steps(batch, seq, 17, ragged)
    t, width = len(tokens), a.kv_lora_rank + a.qk_rope_dim
    bf = dict(device="cuda", dtype=torch.bfloat16)
    first = torch.randn(t, a.heads * (a.qk_nope_dim + a.qk_rope_dim) + width, generator=g, device="cuda").to(**bf)
    q, kv = first[:, :-width], first[:, -width:]
    norm = (1 + torch.randn(a.kv_lora_rank, generator=g, device="cuda") / 5).to(**bf)
    rows = pos if ragged else pos + torch.arange(seq, device="cuda")
    cos, sin = rope.cos_sin(a.rope, rope.inv_freq(a.rope), rows, torch.bfloat16)
    cache = torch.randn(batch, 40, width, generator=g, device="cuda").to(**bf)
    want = cache.clone()
    shape = (1, batch) if ragged else (batch, seq)  # as the rule sees the tokens: rope row = sequence index
    q_rope = layers.rotate(q.reshape(*shape, a.heads, -1)[..., a.qk_nope_dim:], cos, sin, a.rope.pairs)
    latent = layers.rms_norm(kv[:, :a.kv_lora_rank], norm, a.norm_eps)
    k_rope = layers.rotate(kv[:, a.kv_lora_rank:].reshape(*shape, 1, -1), cos, sin, a.rope.pairs)
    for i, (b, p) in enumerate(tokens):
        want[b, p] = torch.cat([latent[i], k_rope.reshape(t, -1)[i]])
    got = attention_gpu.mla_project(a, q, kv, norm, cos, sin, pos, cache, 1 if ragged else seq, ragged)
    torch.testing.assert_close(got, q_rope.reshape(got.shape), rtol=0, atol=0)
    torch.testing.assert_close(cache, want, rtol=0, atol=0)


@pytest.mark.parametrize("a, length, pos, batch, seq, ragged", [
    (mla_attrs(), 40, 17, 2, 1, False),
    (mla_attrs(), 40, 0, 1, 1, False),
    (mla_attrs(heads=16, nope=128, rdim=64, rank=512, vdim=128), 168, 150, 1, 1, False),  # the e2e step
    (mla_attrs(heads=16, nope=128, rdim=64, rank=512, vdim=128), 1200, 1100, 2, 1, False),  # splits
    (mla_attrs(heads=40, rank=128), 700, 650, 3, 1, True),  # heads in three blocks, ragged, splits
    (mla_attrs(), 40, 30, 1, 3, False),                     # three tokens a row, causal
])
def test_attend_latent_matches_float64_attention(a, length, pos, batch, seq, ragged):
    """Absorbed attention over the latent cache: the error against float64 is no more than twice
    the torch form's (static_rules.mla: scores in float32, probabilities rounded to bf16, one
    bmm with the latent), and no key past a token's position is read (NaN there)."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import attention_gpu

    g = torch.Generator(device="cuda").manual_seed(5)
    tokens, pos_t = steps(batch, seq, pos, ragged)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    rank = a.kv_lora_rank
    cache = torch.randn(batch, length, rank + a.qk_rope_dim, generator=g, device="cuda").to(**bf)
    for b in range(batch):
        last = max(p for r, p in tokens if r == b)
        cache[b, last + 1:] = float("nan")
    # a strided q_lat, as the einsum leaves it: [heads, T, rank] seen as [T, heads, rank]
    q_lat = (torch.randn(a.heads, len(tokens), rank, generator=g, device="cuda") * 2).to(**bf).transpose(0, 1)
    q_rope = (torch.randn(len(tokens), a.heads, a.qk_rope_dim, generator=g, device="cuda") * 2).to(**bf)
    got = attention_gpu.attend_latent(a, q_lat, q_rope, cache, pos_t, 1 if ragged else seq, ragged)
    want, torch_form = [], []
    for i, (b, p) in enumerate(tokens):
        q = torch.cat([q_lat[i], q_rope[i]], -1)
        keys = cache[b, :p + 1]
        s = (q.double() @ keys.double().T) * a.softmax_scale
        want.append(s.softmax(-1) @ keys[:, :rank].double())
        s32 = torch.mm(q, keys.T, out_dtype=torch.float32) * a.softmax_scale
        torch_form.append(torch.mm(s32.softmax(-1).to(torch.bfloat16), keys[:, :rank]))
    want, torch_form = torch.stack(want), torch.stack(torch_form)
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    base = ((torch_form.double() - want).norm() / want.norm()).item()
    assert err <= 2 * base + 1e-4, (err, base)


def reference_attention(q, k, v, position, scale):
    """float64 attention of queries at position.. over keys 0..L-1, causal (query i sees 0..position+i)."""
    q, k, v = (t.double() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s, L = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    visible = torch.arange(L, device=q.device)[None, :] <= torch.arange(position, position + s, device=q.device)[:, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("heads, kv, dim, position, seq", [
    (32, 4, 128, 300, 256),   # Qwen3's heads, a serving chunk after a reused prefix
    (32, 4, 128, 1, 7),       # one earlier key
    (8, 8, 192, 513, 64),     # MLA's padded width, heads not grouped
])
def test_a_continued_chunk_attends_in_the_flash_kernel_as_float64_attention(heads, kv, dim, position, seq, monkeypatch):
    """A prompt chunk after `position` earlier keys takes the flash kernel's lower-right causal
    mask (no mask tensor, grouped keys not expanded) and equals float64 attention, as the masked
    path it replaces does."""
    from ktflow.backends.kernels import layers

    g = torch.Generator(device="cuda").manual_seed(3)
    L = position + seq
    q = torch.randn(2, heads, seq, dim, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, kv, L, dim, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    a = replace(attrs(heads=heads, kv=kv, dim=dim, rdim=dim), softmax_scale=1 / math.sqrt(dim))
    assert layers._flash_continues(q, k, v, heads != kv)
    want = reference_attention(q, k, v, position, a.softmax_scale)
    flash = layers._sdpa(q, k, v, a, position)
    monkeypatch.setattr(layers, "_flash_continues", lambda *args: False)
    masked = layers._sdpa(q, k, v, a, position)
    for got in (flash, masked):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max().item() < 2e-2
    assert (flash.double() - masked.double()).abs().max().item() < 2e-2


def test_a_short_step_attends_without_cudnn():
    """A step of at most UNPLANNED_ROWS queries runs no cuDNN kernel (cuDNN builds a plan per
    new shape, which each new prompt length would pay) and equals float64 attention."""
    from torch.profiler import ProfilerActivity, profile

    from ktflow.backends.kernels import layers

    g = torch.Generator(device="cuda").manual_seed(4)
    a = attrs(heads=32, kv=4, dim=128, rdim=128)
    for s in (1, 137, layers.UNPLANNED_ROWS):
        q = torch.randn(1, 32, s, 128, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(1, 4, s, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            got = layers._sdpa(q, k, v, a, 0)
            torch.cuda.synchronize()
        kernels = [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert kernels and not any("cudnn" in n.lower() for n in kernels), (s, kernels[:5])
        assert (got.double() - reference_attention(q, k, v, 0, a.softmax_scale)).abs().max().item() < 2e-2
