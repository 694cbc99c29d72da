"""KV caches: their one layout (`new_cache`) and their owners.

A sequence's `State` owns its caches (`cache_of` makes a layer's on first use), except where a
captured graph has baked cache addresses in: there `StaticCaches` owns one set per batch size and
lends it to the state that ran last (`owner` says which; an earlier state of that batch size has
lost its caches). Nothing else allocates a KV cache.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..ir.ops import AttentionAttrs


def new_cache(attrs: AttentionAttrs, batch: int, max_seq_len: int, dtype: torch.dtype,
              dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A zeroed cache of attention layer `attrs`: keys and values [batch, kv_heads, max_seq_len,
    head_dim] (GQA), or the latent and the roped key as views of one [batch, max_seq_len, rank +
    rope] buffer, the buffer third (MLA)."""
    kw = dict(device=dev, dtype=dtype)
    if attrs.kind == "mla":
        both = torch.zeros(batch, max_seq_len, attrs.kv_lora_rank + attrs.qk_rope_dim, **kw)
        return both[..., :attrs.kv_lora_rank], both[..., attrs.kv_lora_rank:], both
    return (torch.zeros(batch, attrs.kv_heads, max_seq_len, attrs.head_dim, **kw),
            torch.zeros(batch, attrs.kv_heads, max_seq_len, attrs.head_dim, **kw))


def copy_positions(caches: tuple[torch.Tensor, ...], src: int, dst: int, n: int) -> None:
    """Positions 0..n-1 of row `src` of one layer's cache (`new_cache`'s layout) written into row
    `dst`, on the caches' device (stream-ordered: the caller syncs before another stream reads)."""
    if len(caches) == 3:  # MLA: the latent and the roped key are views of the third
        caches[2][dst, :n] = caches[2][src, :n]
        return
    for t in caches:
        t[dst, :, :n] = t[src, :, :n]


def cache_of(state: Any, attrs: AttentionAttrs, batch: int, dtype: torch.dtype,
             dev: torch.device) -> tuple[torch.Tensor, ...]:
    """The cache of layer attrs.layer in `state` (a runtime State), made there with `batch` rows
    on first use."""
    if attrs.layer not in state.kv:
        state.kv[attrs.layer] = new_cache(attrs, batch, state.max_seq_len, dtype, dev)
    return state.kv[attrs.layer]


class StaticCaches:
    """One set of caches per batch size (and length and device), each lent to the state that
    last asked for it: a captured graph reads and writes the same addresses at every replay."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.sets: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (layer, batch, device, max_seq_len) -> caches
        self.owners: dict[int, Any] = {}  # batch -> weakref to the state the caches are lent to

    def lend(self, state: Any, attrs: AttentionAttrs, batch: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """Layer attrs.layer's cache of batch size `batch`, lent to `state` if it has none."""
        if attrs.layer not in state.kv:
            key = (attrs.layer, batch, str(dev), state.max_seq_len)
            if key not in self.sets:
                self.sets[key] = new_cache(attrs, batch, state.max_seq_len, self.dtype, dev)
            state.kv[attrs.layer] = self.sets[key]
            self.owners[batch] = weakref.ref(state)
        return state.kv[attrs.layer]

    def owner(self, batch: int) -> Any:
        """The state this batch size's caches are lent to (None: none, or it is gone)."""
        ref = self.owners.get(batch)
        return None if ref is None else ref()
