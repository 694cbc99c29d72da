"""Recording real routing: how often each MoE layer's router picks each expert (and each pair of
experts together), counted as a plan runs, written as the `RoutingProfile` the placement pass
reads (`ktflow compile --routing-profile`).

`RoutingRecorder` is attached to executors (`Executor.recorder`): after each router node runs it
adds the step's picks to per-layer counters kept on the device that routed (a bincount, and with
`pairs` a one-hot product), so recording costs a few small kernels per layer and no host sync
until `profile()` reads the counts. A plan a backend runs as a whole (a captured CUDA graph) does
not show its routers' values to the executor: record with backend='native' or 'torch_ref'.
"""

from __future__ import annotations

import torch

from ..cost import RoutingProfile
from ..ir.graph import Graph
from ..ir.ops import Op


def gate_layers(g: Graph) -> dict[str, int]:
    """Each router node of `g` -> the MoE layer whose routed experts read its picks (through
    copies to another device)."""
    out: dict[str, int] = {}
    for n in g.nodes:
        if n.op != Op.ROUTED_EXPERTS:
            continue
        src = g.by_name(n.inputs[1])
        while src.op == Op.COPY:
            src = g.by_name(src.inputs[0])
        if src.op == Op.GATE:
            out[src.name] = n.attrs.layer
    return out


class RoutingRecorder:
    """Per-layer expert pick counts (and, with `pairs`, pair counts) over the steps it sees."""

    def __init__(self, pairs: bool = False):
        self.pairs = pairs
        self.counts: dict[int, torch.Tensor] = {}  # layer -> int64 [experts]
        self.together: dict[int, torch.Tensor] = {}  # layer -> float32 [experts, experts]
        self.tokens: dict[int, int] = {}

    def add(self, layer: int, ids: torch.Tensor, experts: int) -> None:
        """One step's picks of `layer`'s router: ids [tokens, top_k]."""
        ids = ids.reshape(-1, ids.shape[-1])
        if layer not in self.counts:
            self.counts[layer] = torch.zeros(experts, dtype=torch.int64, device=ids.device)
            self.tokens[layer] = 0
        self.counts[layer] += torch.bincount(ids.reshape(-1), minlength=experts)
        self.tokens[layer] += ids.shape[0]
        if self.pairs:
            hot = torch.zeros(ids.shape[0], experts, dtype=torch.float32, device=ids.device)
            hot.scatter_(1, ids.long(), 1.0)
            add = hot.T @ hot
            self.together[layer] = self.together[layer] + add if layer in self.together else add

    def profile(self, model_type: str | None = None) -> RoutingProfile:
        """What was counted, as fractions of each layer's tokens."""
        if not self.counts:
            raise ValueError("no routing was recorded: did the plans run a router (an MoE model, backend native "
                             "or torch_ref)?")
        layers = {layer: [round(float(c) / self.tokens[layer], 6) for c in counts.cpu()]
                  for layer, counts in sorted(self.counts.items())}
        pairs = None
        if self.pairs:
            pairs = {layer: [[round(float(v) / self.tokens[layer], 6) for v in row] for row in m.cpu()]
                     for layer, m in sorted(self.together.items())}
        return RoutingProfile(layers=layers, model_type=model_type, tokens=min(self.tokens.values()), pairs=pairs)


def record_routing(compiled, prompts: list[list[int]], decode: int = 0, pairs: bool = False, progress: bool = True):
    """Run each prompt (token ids) through `compiled`, then `decode` greedy tokens after it, with
    a RoutingRecorder on every plan; returns the RoutingProfile of all the tokens it routed."""
    from ..progress import bar
    from .execute import execute

    rec = RoutingRecorder(pairs)
    plans = [compiled.decode, *compiled.prefill]
    for plan in plans:
        compiled.executor(plan).recorder = rec
    try:
        for ids in bar(prompts, "profile", "prompt", show=progress and len(prompts) > 1):
            nxt, state = execute(compiled, torch.tensor([ids]), logits="argmax")
            for _ in range(min(decode, compiled.max_seq_len - len(ids))):
                nxt, state = execute(compiled, nxt.view(1, 1), state, logits="argmax")
    finally:
        for plan in plans:
            compiled.executor(plan).recorder = None
    model = compiled.model
    return rec.profile(model.config.model_type if model is not None else None)
