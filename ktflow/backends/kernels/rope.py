"""Rotary position embedding: inverse frequencies (default, linear, yarn) and application on
'half' or 'interleaved' dimension pairs. Matches transformers' definitions."""

from __future__ import annotations

import math

import torch

from ...ir.ops import RopeAttrs


def inv_freq(r: RopeAttrs) -> torch.Tensor:
    dim, base = r.dim, r.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if r.kind == "default":
        return 1.0 / pos_freqs
    if r.kind == "linear":
        return 1.0 / pos_freqs / r.factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(r.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (r.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def cos_sin(r: RopeAttrs, freqs_inv: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape [len(positions), dim/2], scaled by the rope's attention factor."""
    freqs = positions[:, None].to(torch.float32) * freqs_inv[None, :].to(positions.device)
    return (freqs.cos() * r.attention_factor).to(dtype), (freqs.sin() * r.attention_factor).to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """Rotate x [..., S, heads, dim] with cos/sin [S, r/2] (r <= dim: the first r dimensions
    rotate and the others pass through).

    'half' pairs (x_i, x_{i+d/2}); 'interleaved' pairs (x_{2i}, x_{2i+1}) and returns the rotated
    pairs de-interleaved (evens then odds). Queries and keys get the same layout, so their dot
    products are those of the interleaved form.
    """
    d = 2 * cos.shape[-1]
    if d < x.shape[-1]:  # partial rotary: the first d dimensions rotate, the rest pass through
        return torch.cat([apply(x[..., :d], cos, sin, pairs), x[..., d:]], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    if pairs == "half":
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
