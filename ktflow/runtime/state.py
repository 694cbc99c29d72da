"""Per-sequence state: the position reached and the static KV caches (one per attention layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class State:
    """Returned by `ktflow.execute`; pass it back to continue the same sequences.

    `kv[layer]` holds that layer's cache tensors, sized for `max_seq_len` positions when first
    used (GQA: keys and values [batch, kv_heads, max_seq_len, head_dim]; MLA: the normalised
    latent [batch, max_seq_len, kv_lora_rank] and the roped key [batch, max_seq_len, rope_dim]).
    """

    fingerprint: str
    batch: int
    max_seq_len: int
    position: int = 0
    kv: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)
    #: how each row selects its tokens on the device (a backends.sampling.Sampler, made by
    #: `runtime.execute.start_sampling`), or None: execute(logits='sample') then refuses
    sampler: Any = field(default=None, repr=False)
    #: set True to have each step keep its hidden states in `hidden_out`, [batch, tokens, hidden]:
    #: the main model's final normalised ones (what the lm_head reads: a multi-token-prediction
    #: layer's input), a multi-token-prediction layer's before its final norm (its next chained step's)
    keep_hidden: bool = False
    hidden_out: Any = field(default=None, repr=False)

    @property
    def remaining(self) -> int:
        return self.max_seq_len - self.position

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.kv.values() for t in ts)

    def row(self, i: int, position: int | None = None) -> "State":
        """Sequence `i` of this batch as a batch-1 state over views of its rows of the caches
        (what it writes lands in this state's caches), at `position` (default: this state's)."""
        kv = {layer: tuple(t[i:i + 1] for t in ts) for layer, ts in self.kv.items()}
        return State(self.fingerprint, 1, self.max_seq_len, self.position if position is None else position, kv)
