"""The memory model: what a step of a plan holds besides weights, on the GPU and in host memory.

A step's activations are its live values (each freed after its last reader) plus, while a node
runs, the temporaries inside its rule (`scratch_bytes`). Prefill plans add the staging of streamed
experts: the plan's `staging` arena and one landing buffer for the packed bytes. `prefill_room` is
what is left for staging once weights, KV caches, workspaces and a step's activations are counted.
Weights held in FP8 (WeightRef.held) count at their stored size with their block scales, and what
their rules dequantize into as scratch (`fp8_dequant_bytes`: a dense weight's matrix in a step over
FP8_FUSED_ROWS rows; `fp8_experts_dequant_bytes`: routed experts, one projection at a time). The
scratch rules mirror the GPU rules of ktflow.backends.kernels.layers (attention),
ktflow.backends.kernels.moe_gpu (grouped routed experts), ktflow.backends.cuda.static_rules
(captured routed experts) and ktflow.backends.kernels.fp8_gpu (FP8 weights); change them together.
"""

from __future__ import annotations

from typing import Callable

from .hw import HwProfile
from ..ir.graph import Graph, Node
from ..ir.ops import Op, fp8_expert_weight
from ..ir.types import FP8_BLOCK, Device, DType

#: rows of logits the GPU holds at once when a prefill asks for every position's logits (they
#: leave for host memory piece by piece; the usual prefill computes the last position's only)
LOGIT_ROWS = 1024

#: rows of a grouped experts' down product weighted and summed in fp32 at a time (bounds that fp32
#: copy; backends.moe_gpu)
SCATTER_ROWS = 32768

#: picks a grouped experts step gathers and multiplies at a time outside a CUDA graph (bounds its
#: temporaries in a long prefill step; backends.moe_gpu)
GROUPED_ROWS = 16384

#: rows of activations up to which a weight held in FP8 is multiplied by the fused kernels; a
#: larger step dequantizes the matrix into a temporary in the activation dtype first, then
#: multiplies with cuBLAS (backends.fp8_gpu)
FP8_FUSED_ROWS = 16

#: GPU streams that run matrix products in a hybrid run: prefill's (the caller's stream) and the
#: decode graph's; each holds its own BLAS workspace
COMPUTE_STREAMS = 2


def gpu_workspace_bytes(hw: HwProfile) -> float:
    """GPU memory the BLAS workspaces take (none without a GPU)."""
    return COMPUTE_STREAMS * hw.gpus[0].workspace_bytes if hw.gpus else 0.0


def value_bytes(n: Node, tokens: int) -> float:
    """Bytes of a node's output in a step of `tokens` tokens (logits: at most LOGIT_ROWS rows)."""
    rows = min(tokens, LOGIT_ROWS) if n.op == Op.LM_HEAD else tokens
    return n.out.numel(rows) * n.out.dtype.itemsize


def _live_peak(g: Graph, tokens: int, counted: Callable[[Node], bool],
               running: Callable[[Node], float | None]) -> float:
    """The largest total, over the graph's nodes in order, of the `counted` values live then
    (each freed after its last reader) plus what `running(node)` adds while the node runs (None:
    the node is not a point to measure at)."""
    users_left = {n.name: len(g.users(n.name)) for n in g.nodes}
    live: dict[str, float] = {}
    total = peak = 0.0
    for n in g.nodes:
        if counted(n):
            live[n.name] = value_bytes(n, tokens)
            total += live[n.name]
        extra = running(n)
        if extra is not None:
            peak = max(peak, total + extra)
        for i in n.inputs:
            users_left[i] -= 1
            if users_left[i] == 0 and i in live:
                total -= live.pop(i)
    return peak


def activation_peak(g: Graph, tokens: int) -> float:
    """Largest total of live activations while the graph runs a step of `tokens` tokens (values
    freed after their last reader), in bytes, on both devices together."""
    return _live_peak(g, tokens, lambda n: True, lambda n: 0.0)


# ------------------------------------------------------------------------------- scratch


def flash_continues(head_dim: int, act: int) -> bool:
    """Whether a GPU step continuing a sequence attends in torch's flash kernel (a lower-right
    causal mask, grouped heads unexpanded: kernels/layers._sdpa): 16-bit activations and a head
    width it takes. Assumes an NVIDIA GPU flash runs on (Ampere or later; kernels/layers warns
    where it cannot run)."""
    return act == 2 and head_dim % 8 == 0 and head_dim <= 256


def _attention_scratch(n: Node, tokens: int, context: int, act: int) -> float:
    a = n.attrs
    keys = context + tokens  # positions attended by the last token of the step
    if a.kind == "gqa":
        q, kv = tokens * a.heads * a.head_dim, tokens * a.kv_heads * a.head_dim
        # projections, roped q/k, the attention output and its [T, heads*d] copy; past keys (a
        # continued prompt or a sliding window) go through a mask, with keys expanded to every
        # head, except a continued prompt in the flash kernel (kernels/layers._sdpa)
        masked = a.window or (context and not flash_continues(a.head_dim, act))
        expanded = 2 * keys * a.heads * a.head_dim if masked else 0
        return act * (3 * q + 3 * kv + expanded)
    qk = a.qk_nope_dim + a.qk_rope_dim
    q = tokens * a.heads * qk
    per_key = a.heads * (a.qk_nope_dim + a.v_head_dim) + 2 * a.heads * qk  # kv_b rows, keys, values padded to qk
    out = tokens * a.heads * (qk + a.v_head_dim)
    return act * (2 * q + keys * per_key + tokens * (a.kv_lora_rank + a.qk_rope_dim) + out)


def _experts_scratch(n: Node, tokens: int, context: int, act: int) -> float:
    """Grouped routed experts on the GPU (moe_gpu.grouped_experts), the largest of its phases
    over a block of at most GROUPED_ROWS picks (any of the step's picks may be the node's):
    each pick's row gathered with its gate and up products; the SiLU product with the down
    product; the down product with a block of it in fp32. Plus the fp32 sum and the sort's
    indices and weights of every pick."""
    a = n.attrs
    lo, hi = a.rank_range
    picks = tokens * (hi - lo)
    block = min(picks, GROUPED_ROWS)
    rows = a.rows[1] - a.rows[0]
    h = a.hidden
    phases = (act * block * (h + 2 * rows), act * block * (rows + h),
              act * block * h + 4 * min(block, SCATTER_ROWS) * h)
    return max(phases) + 4 * tokens * h + 24 * picks


def _mlp_scratch(n: Node, tokens: int, context: int, act: int) -> float:
    return act * tokens * 3 * n.attrs.inter


SCRATCH: dict[Op, Callable[[Node, int, int, int], float]] = {
    Op.ATTENTION: _attention_scratch, Op.ROUTED_EXPERTS: _experts_scratch, Op.MLP: _mlp_scratch,
}


def fp8_dequant_bytes(n: Node, tokens: int, act: int, decode: bool = False) -> float:
    """The dequantized temporaries of `n`'s weights held in FP8 in a step of `tokens` tokens: a
    dense weight's, the largest (one at a time: each is freed after its product), in a step of
    more than FP8_FUSED_ROWS tokens; routed experts' (`fp8_experts_dequant_bytes`)."""
    dense = 0.0
    if tokens > FP8_FUSED_ROWS:
        dense = max((w.numel() * act for w in n.weights if w.held == "fp8" and not w.experts), default=0.0)
    return dense + fp8_experts_dequant_bytes(n, tokens, act, decode)


def _blocks(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of FP8_BLOCK blocks that cover a matrix of `shape` (partial ones whole)."""
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


def fp8_experts_dequant_bytes(n: Node, tokens: int, act: int, decode: bool = False) -> float:
    """Temporaries of the GPU rules of a routed-experts node whose experts are held in FP8, one
    projection at a time (each freed after its product), the largest, its matrices padded to
    whole FP8_BLOCK blocks (backends.fp8_gpu.dequantize_experts). In a `decode` step (the captured
    rule): with 2-byte activations none (the fused kernel, fp8_gpu.picked_linear, reads each
    pick's FP8 bytes in place, as the dense fused kernel does up to FP8_FUSED_ROWS rows; this
    assumes the cuda_graph backend's rule with Triton, which a GPU decode plan runs); else
    every pick's FP8 bytes and scales gathered and its matrix in the activation dtype. In any
    other step (the grouped rule) the node's every expert's matrix in the activation dtype."""
    held = [w for w in n.weights if fp8_expert_weight(w)]
    if not held or n.op != Op.ROUTED_EXPERTS:
        return 0.0
    blocks = max(_blocks(w.shape)[0] * _blocks(w.shape)[1] for w in held)
    padded = blocks * FP8_BLOCK * FP8_BLOCK
    if decode and act == 2:
        return 0.0
    if decode:
        lo, hi = n.attrs.rank_range
        picks = tokens * (hi - lo)
        return picks * (padded * act + max(w.shape[0] * w.shape[1] for w in held) + 4 * blocks)
    return len(n.attrs.ids) * padded * act


def scratch_bytes(n: Node, tokens: int, context: int, act: DType, decode: bool = False) -> float:
    """Temporaries of `n`'s rule while it runs a step of `tokens` new tokens after `context`
    earlier positions (with the dequantized copies of weights held in FP8 it multiplies; `decode`:
    a decode step, whose routed experts run the captured rule)."""
    rule = SCRATCH.get(n.op)
    return ((rule(n, tokens, context, act.itemsize) if rule else 0.0)
            + fp8_dequant_bytes(n, tokens, act.itemsize, decode))


def gpu_activation_peak(g: Graph, tokens: int, context: int = 0, streamed: bool = False,
                        decode: bool = False) -> float:
    """Largest GPU memory a step's activations take: the live GPU values (freed after their last
    reader) plus the scratch of the node running. `streamed`: count CPU routed experts as if
    they ran on the GPU (their scratch), for the room a prefill step could stream into.
    `decode`: a decode step (the captured rules' scratch)."""
    def on_gpu(n: Node) -> bool:
        return n.place is not None and n.place.device == Device.GPU

    def running(n: Node) -> float | None:
        if on_gpu(n) or (streamed and n.op == Op.ROUTED_EXPERTS):
            return scratch_bytes(n, tokens, context, g.act_dtype, decode)
        return None

    # staged weights (fetch outputs) are counted as staging
    return _live_peak(g, tokens, lambda n: on_gpu(n) and n.op != Op.FETCH, running)


# ------------------------------------------------------------------------------- staging


def staging_bytes(g: Graph) -> float:
    """Staging of a plan's streamed experts: its buffers (each as large as the largest fetch that
    fills it; where the buffer pass has run, the staging arena it laid out, which the runtime
    allocates, if larger) and one landing buffer for the largest fetch's packed bytes."""
    buffers: dict[int, float] = {}
    landing = arena = 0.0
    for n in g.nodes:
        if n.op == Op.FETCH:
            size = n.out.numel(0) * n.out.dtype.itemsize
            buffers[n.attrs.staging_buffer] = max(buffers.get(n.attrs.staging_buffer, 0.0), size)
            landing = max(landing, n.attrs.link_bytes)
            if n.buffer is not None and n.buffer.arena == "staging":
                arena = max(arena, n.buffer.offset + n.buffer.bytes)
    return max(sum(buffers.values()), arena) + landing


def streamed_step_bytes(g: Graph, tokens: int, past: int) -> float:
    """GPU bytes a prefill step of `g` (its experts' placement decided) needs beside residency
    and workspaces: its activations with `past` earlier positions, one hidden-state value more
    (a split part's result, which lowering copies back) and its staging. The prefill pass admits
    a streamed step by it and the VRAM plan reserves by it: the two agree."""
    return gpu_activation_peak(g, tokens, past) + tokens * hidden_row_bytes(g) + staging_bytes(g)


def hidden_row_bytes(g: Graph) -> int:
    """Bytes of one token's hidden state (the embedding's output row; 0 without one)."""
    return max((n.out.numel(1) * n.out.dtype.itemsize for n in g.nodes if n.op == Op.EMBED), default=0)


def staging_for(experts: int, buffers: int, hidden: int, inter: int, act_itemsize: int,
                packed_per_weight: float) -> float:
    """GPU bytes of `buffers` staging buffers of `experts` converted experts each, and the landing
    buffer for one buffer's packed bytes (`packed_per_weight` bytes a weight as the CPU holds it)."""
    weights = experts * 3 * hidden * inter
    return buffers * weights * act_itemsize + weights * packed_per_weight


def stream_bytes(layer_experts: int, cap: int, buffers: int, tokens: int, hidden: int, inter: int, act_itemsize: int,
                 packed_per_weight: float) -> float:
    """GPU bytes a prefill step of `tokens` tokens needs, beyond `gpu_activation_peak(...,
    streamed=True)`, to stream a layer of `layer_experts` CPU experts through `buffers` staging
    buffers of `cap` experts: the staging (`staging_for`), and the layer's outputs beside its
    activations: the last group's output and a split's CPU part come back (the float32 running
    sum is one tensor the groups add to in place, counted in the experts' scratch). 0 caps: none."""
    if cap <= 0 or layer_experts <= 0:
        return 0.0
    outputs = tokens * hidden * 2 * act_itemsize
    return staging_for(cap, buffers, hidden, inter, act_itemsize, packed_per_weight) + outputs


def kv_cache_bytes(g: Graph, kv_tokens: int, device: Device | None = None) -> float:
    """KV caches for `kv_tokens` positions (max_seq_len x max_batch) of the attention nodes on
    `device` (None: every one)."""
    return sum(n.attrs.kv_cache_elems_per_token() * kv_tokens * g.act_dtype.itemsize for n in g.nodes
               if n.op == Op.ATTENTION and (device is None or n.place.device == device))


def resident_gpu_bytes(g: Graph, weight_itemsize: int, kv_tokens: int) -> tuple[float, float]:
    """(weights, KV caches) held on the GPU: weights of GPU nodes (not staged ones) and the KV
    caches of GPU attention."""
    weights = sum(n.weight_bytes(weight_itemsize) for n in g.nodes
                  if n.place is not None and n.place.device == Device.GPU and n.op != Op.FETCH)
    return weights, kv_cache_bytes(g, kv_tokens, Device.GPU)


def prefill_room(g: Graph, hw: HwProfile, *, tokens: int, weight_itemsize: int, kv_tokens: int, limit: float,
                 past: int = 0) -> float:
    """GPU bytes left for staging in a prefill step of `tokens` tokens after `past` earlier
    positions: the VRAM limit less the BLAS workspaces, the resident weights and KV caches, and
    the step's activations with every CPU routed-experts node counted as streamed (negative: the
    step does not fit)."""
    weights, kv = resident_gpu_bytes(g, weight_itemsize, kv_tokens)
    act = gpu_activation_peak(g, tokens, past, streamed=True)
    return limit - gpu_workspace_bytes(hw) - weights - kv - act
