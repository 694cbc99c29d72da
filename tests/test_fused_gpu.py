"""The one-kernel RMSNorm and rotary embedding (backends/fused_gpu) against the torch forms they
replace on the GPU."""

import pytest
import torch

from ktflow.backends.kernels import rope
from ktflow.backends.kernels import layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel is Triton's)")


@pytest.mark.parametrize("shape, xdt, wdt", [
    ((1, 2048), torch.bfloat16, torch.bfloat16),      # a decode token's hidden state
    ((3, 5, 32, 128), torch.bfloat16, torch.bfloat16),  # per-head q norm of a prompt
    ((7, 7168), torch.bfloat16, torch.float32),      # a float32 weight: a float32 result
    ((4, 100), torch.float32, torch.float32),        # a width that is no power of two
    ((0, 512), torch.bfloat16, torch.bfloat16),      # no rows
])
def test_rmsnorm_kernel_matches_the_torch_form(shape, xdt, wdt):
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(xdt)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, device="cuda")).to(wdt)
    want = layers.rms_norm_torch(x, w, 1e-6)
    got = fused_gpu.rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    eps = torch.finfo(want.dtype).eps
    # only the reduction order differs: at most one rounding of the output dtype apart
    assert ((got.float() - want.float()).abs() <= 2 * eps * want.float().abs() + 1e-6).all()


def test_rmsnorm_kernel_reads_a_strided_slice():
    """A column slice (MLA's latent part of kv_a's output) normalised as the torch form does."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu

    kv = torch.randn(2, 3, 512 + 64, device="cuda").to(torch.bfloat16)
    w = torch.rand(512, device="cuda").to(torch.bfloat16)
    latent = kv[..., :512]
    torch.testing.assert_close(fused_gpu.rms_norm(latent, w, 1e-6), layers.rms_norm_torch(latent, w, 1e-6),
                               rtol=2 ** -7, atol=1e-6)


def test_layers_rms_norm_uses_the_kernel_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu

    calls = []
    real = fused_gpu.rms_norm
    monkeypatch.setattr(fused_gpu, "rms_norm", lambda *a: calls.append(1) or real(*a))
    layers.rms_norm(torch.randn(2, 64, device="cuda"), torch.ones(64, device="cuda"), 1e-5)
    assert calls == [1]


@pytest.mark.parametrize("shape, half, pairs", [
    ((1, 1, 32, 128), 64, "half"),         # a Qwen3 decode token's queries
    ((2, 5, 4, 128), 64, "half"),          # a batch of prompts' keys
    ((1, 3, 16, 64), 32, "interleaved"),   # DeepSeek's rope part, de-interleaved
    ((2, 1, 8, 128), 32, "half"),          # partial rotary: 64 of 128 dims rotate
    ((1, 4, 20, 96), 48, "half"),          # heads past one block of 16
])
def test_rope_kernel_matches_the_torch_form(shape, half, pairs):
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    ang = torch.rand(shape[1], half, generator=g, device="cuda") * 6
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    want = rope.apply(x, cos, sin, pairs)
    got = fused_gpu.rotate(x, cos, sin, pairs)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the torch form rounds both products and the result to bf16, the kernel only the result
    bound = 2 ** -8 * (x.float().abs().amax(-1, keepdim=True) * 2 + want.float().abs())
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_rope_kernel_reads_a_strided_slice():
    """MLA's rope part of the queries: a column slice of each head."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu

    q = torch.randn(2, 3, 16, 128 + 64, device="cuda").to(torch.bfloat16)
    ang = torch.rand(3, 32, device="cuda")
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    got = fused_gpu.rotate(q[..., 128:], cos, sin, "interleaved")
    torch.testing.assert_close(got, rope.apply(q[..., 128:], cos, sin, "interleaved"), rtol=2 ** -7, atol=2 ** -5)


@pytest.mark.parametrize("experts, k, scoring, renormalize, scale, t", [
    (128, 8, "softmax", True, 1.0, 1),     # Qwen3-30B-A3B
    (60, 4, "softmax", False, 1.0, 3),     # Qwen2-MoE: no renormalisation, not a power of two
    (8, 2, "softmax", True, 1.0, 5),       # Mixtral
    (160, 8, "sigmoid", True, 2.5, 2),     # a sigmoid router with a scale
])
def test_route_kernel_picks_what_torch_ref_picks(experts, k, scoring, renormalize, scale, t):
    pytest.importorskip("triton")
    from ktflow.backends.kernels import fused_gpu
    from ktflow.backends import torch_ref
    from ktflow.ir.ops import GateAttrs

    a = GateAttrs(hidden=256, experts=experts, top_k=k, scoring=scoring, renormalize=renormalize, scale=scale)
    assert fused_gpu.route_fusable(a)
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(t, 256, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(experts, 256, generator=g, device="cuda") * 0.2).to(torch.bfloat16)
    ids, wts = fused_gpu.route(a, x, w)
    want_ids, want_wts = torch_ref.route(a, x, w, None)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(wts, want_wts, rtol=1e-5, atol=1e-6)
    assert (wts[:, :-1] >= wts[:, 1:]).all()  # by weight, descending
