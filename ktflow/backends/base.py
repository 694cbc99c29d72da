"""What every backend shares: the per-step context and the Backend protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..ir.graph import Graph, Node
from ..costmodel.memory import LOGIT_ROWS
from ..frontend.weights import WeightSource


@dataclass
class StepContext:
    """What one step of execution needs beyond a node's inputs."""

    batch: int
    seq: int  # new tokens per row
    position: int  # absolute position of the first new token
    state: Any  # ktflow.runtime.state.State: KV caches
    token_ids: torch.Tensor  # [batch * seq] int64
    #: the position as a one-element int64 tensor on the GPU device: set for steps run with
    #: static shapes (captured as CUDA graphs), where rules must not read `position`; for a
    #: ragged step (below), one element per row
    position_t: torch.Tensor | None = None
    #: a ragged decode step (seq 1, sequences at different positions, e.g. a server's slots): each
    #: row's position, int64 [batch] on the host; `position` is then 0 and not to be read
    positions: torch.Tensor | None = None
    #: a packed prefill step: the step's tokens (batch 1) are several sequences' prompt chunks one
    #: after another, each (row of the state's caches, its first position, its token count);
    #: `position` is then 0 and not to be read, and logits='last' means each segment's last
    segments: tuple[tuple[int, int, int], ...] | None = None
    #: which positions' logits the step computes: all, last (each sequence's last), none
    logits: str = "all"
    #: a graph with a hidden-vector input (a multi-token-prediction layer's): the step's vectors,
    #: [batch * seq, hidden], one a token
    hidden: torch.Tensor | None = None
    #: a step that borrows lent experts' memory (Plan.borrows, eager): each fetch's staging buffer
    #: by node name and the landing buffer, views of the lent region (backends/lending.py)
    staging: dict | None = None
    landing: torch.Tensor | None = None
    #: values every layer of the step would compute alike (the rope rows at the position, the
    #: cache rows written, the mask of visible positions), made by the first rule that needs them
    #: and reused by the rest: in a captured graph their kernels run once per step, not per layer
    shared: dict = field(default_factory=dict)

    def once(self, key: tuple, make):
        """`make()` the first time `key` is asked for in this step, the same value after."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]


def staged(t: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fetch's output [n, 3 * hidden * inter] as gate, up [n, inter, hidden] and down [n, hidden, inter]."""
    n, hi = t.shape[0], hidden * inter
    return t[:, :hi].view(n, inter, hidden), t[:, hi:2 * hi].view(n, inter, hidden), t[:, 2 * hi:].view(n, hidden, inter)


def node_key(n: Node) -> tuple:
    """What a backend keys a node's prepared state by: plans of one model reuse node names for
    different work (a layer's experts on the CPU in decode, streamed or split in a prefill
    bucket), so the key is the name with what the node computes and where."""
    place = (n.place.device, n.place.numa) if n.place is not None else None
    return (n.name, n.op, n.attrs, place, len(n.inputs))


class Backend(Protocol):
    name: str

    def __init__(self, gpu_device: str, dtype: torch.dtype, options: Any = None) -> None:
        """GPU-placed nodes run on torch device `gpu_device` ("cuda", or "cpu" without a GPU);
        `options` are the plan's CompileOptions (backends read what concerns them)."""

    def prepare(self, graph: Graph, weights: WeightSource | None) -> None:
        """Make the weights of `graph`'s nodes ready (once; later calls with the same nodes are free)."""

    def run(self, node: Node, inputs: list[Any], ctx: StepContext) -> Any:
        """Compute `node` from its input values."""


def lm_head_rows(backend: Any, node: Node, x: torch.Tensor, ctx: StepContext) -> torch.Tensor | None:
    """The lm_head over the rows the step asks for (ctx.logits): every row (on a GPU in pieces
    of LOGIT_ROWS rows gathered in host memory, so a long prompt's logits never sit on the GPU
    at once), each sequence's last row, or none."""
    if ctx.logits == "none":
        return None
    if ctx.logits == "last":
        if ctx.segments:
            ends = torch.tensor([n for _, _, n in ctx.segments]).cumsum(0) - 1
            return backend.run(node, [x.view(-1, x.shape[-1])[ends.to(x.device)]], ctx)
        return backend.run(node, [x.view(ctx.batch, ctx.seq, -1)[:, -1]], ctx)
    if x.device.type != "cuda" or x.shape[0] <= LOGIT_ROWS:
        return backend.run(node, [x], ctx)
    out = torch.empty(x.shape[0], node.attrs.vocab, dtype=torch.float32, pin_memory=True)
    for lo in range(0, x.shape[0], LOGIT_ROWS):
        out[lo:lo + LOGIT_ROWS].copy_(backend.run(node, [x[lo:lo + LOGIT_ROWS]], ctx), non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return out


def step_output(out: torch.Tensor, b: int, s: int, logits: str, segments) -> torch.Tensor:
    """A step's logits as [batch, seq, vocab] (logits='all'), [batch, 1, vocab] (each sequence's
    last), or for a packed step's 'last' [segments, 1, vocab]."""
    if logits != "all" and segments:
        return out.view(len(segments), 1, -1)
    return out.view(b, s if logits == "all" else 1, -1)
