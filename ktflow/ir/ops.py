"""Ops, their attributes, and the per-op facts table.

Each op has one frozen attrs dataclass and one `OpFacts` row: how many inputs it takes, the
shape rule for its output, and its FLOPs and memory traffic for a step of `Work(tokens,
context)`. Passes and the cost model read this table; they never branch on op names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any, Callable

from .types import TOKENS, DType, TensorType, WeightRef


class Op(str, Enum):
    INPUT = "input"
    EMBED = "embed"
    RMSNORM = "rmsnorm"
    ATTENTION = "attention"
    GATE = "gate"
    MLP = "mlp"
    ROUTED_EXPERTS = "routed_experts"
    ADD = "add"
    LM_HEAD = "lm_head"
    REDUCE = "reduce"
    DEFER = "defer"
    # lowering ops
    COPY = "copy"
    SUBMIT = "submit"
    SYNC = "sync"
    FETCH = "fetch"
    # several GPUs
    COLLECTIVE = "collective"
    # a linear map of its inputs concatenated (the MTP layer's eh_proj)
    PROJECT = "project"


# ---------------------------------------------------------------------------------------- attrs


@dataclass(frozen=True)
class InputAttrs:
    """The step's token ids, flattened over batch and sequence; with `hidden` > 0, the step's
    hidden vectors instead ([tokens, hidden] in the activation dtype: what a multi-token-prediction
    graph reads of the main model, its final normalised hidden state at each position)."""

    hidden: int = 0


@dataclass(frozen=True)
class ProjectAttrs:
    """out = W . concat(inputs) with W [out, sum(parts)]: input i holds `parts[i]` features."""

    parts: tuple[int, ...]
    out: int


@dataclass(frozen=True)
class EmbedAttrs:
    vocab: int
    hidden: int


@dataclass(frozen=True)
class RMSNormAttrs:
    dim: int
    eps: float


@dataclass(frozen=True)
class RopeAttrs:
    """Rotary position embedding, resolved from the config (both config styles) at spec time.

    kind: default | linear | yarn. pairs: 'half' rotates (x_i, x_{i+d/2}) (Llama/Qwen/Mixtral),
    'interleaved' rotates (x_{2i}, x_{2i+1}) (DeepSeek). `attention_factor` multiplies cos/sin.
    """

    dim: int
    theta: float
    kind: str = "default"
    pairs: str = "half"
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class AttentionAttrs:
    """Self-attention with its projections, rope and KV cache for one layer.

    kind 'gqa': q/k/v/o projections with `kv_heads` shared key/value heads (optional qkv bias,
    per-head q/k RMSNorm, sliding window). kind 'mla': DeepSeek multi-head latent attention;
    the KV cache holds the normalised latent (kv_lora_rank) and the roped key (qk_rope_dim).
    """

    kind: str
    layer: int
    hidden: int
    heads: int
    rope: RopeAttrs
    softmax_scale: float
    kv_heads: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    window: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    norm_eps: float = 1e-6

    def kv_cache_elems_per_token(self) -> int:
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class GateAttrs:
    """Router: scores over `experts`, picks `top_k` per token.

    scoring: softmax | sigmoid. select: greedy (top-k of all scores) | group_max (groups ranked by
    their best score; DeepSeek-V2 group_limited_greedy) | group_top2sum (groups ranked by the sum
    of their two best biased scores; DeepSeek-V3). `correction_bias` adds a per-expert bias for
    the choice only. Weights are renormalised over the chosen k when `renormalize`, then
    multiplied by `scale`. Output: ids and weights, sorted by weight, descending.
    """

    hidden: int
    experts: int
    top_k: int
    scoring: str = "softmax"
    select: str = "greedy"
    groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    renormalize: bool = False
    scale: float = 1.0


@dataclass(frozen=True)
class MLPAttrs:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). kind: dense | shared (a shared expert).
    `sigmoid_gate`: output scaled by sigmoid(x . w) (Qwen2-MoE's shared_expert_gate)."""

    kind: str
    hidden: int
    inter: int
    sigmoid_gate: bool = False


@dataclass(frozen=True)
class RoutedExpertsAttrs:
    """The routed experts of one MoE layer: sum over the token's top-k experts of
    weight * down(silu(gate(x)) * up(x)). Inputs: hidden states and the gate's routing.
    `subset`: the expert ids this node computes and holds (sorted); empty = all of them.
    Placement splits a layer's experts into nodes with disjoint subsets (hot ones on the GPU).
    `inter_slice` (lo, hi): only intermediate rows lo..hi of gate/up and the matching columns of
    down (a NUMA tensor-parallel shard: it yields a partial sum a reduce completes); empty = all.
    `ranks` (lo, hi): only each token's picks ranked lo..hi by routing weight (Expert Deferral
    splits the immediate top picks from the deferred rest); empty = all top_k.
    `skip`: the layer drops each token's `skip` lowest-weight picks (expert skipping: an
    approximation a pass must ask for; no built-in pass does), so its nodes' ranks cover
    0..top_k - skip.
    `refill_every` > 0: on a split layer's GPU part, its subset is only the first filling of a
    cache of that many expert rows, which the runtime refills after each prompt and every
    `refill_every` decoded tokens (`runtime.expert_cache`); the layer's CPU parts then hold every
    expert and compute those not in the cache. 0: the subset is fixed.
    `cache_size` > 0: a prefill step's streamed node standing in for a cached layer's parts (it
    computes every expert from its fetch); the decode plan's cache of that many GPU rows stays
    resident beside it, unread by this step.
    `running`: a streamed group of a layer fetched in several (not its last): its output is the
    layer's running sum so far in float32, read by the next group as a fourth input, which adds
    its own picks to it; the last group outputs the total in the activation dtype (one rounding,
    as one node computing the layer would).
    `host` (set by `lower` on CPU and streamed parts): the layer's experts packed in host memory,
    which the native operator holds (rule L3)."""

    layer: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    subset: tuple[int, ...] = ()
    inter_slice: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    skip: int = 0
    refill_every: int = 0
    cache_size: int = 0
    running: bool = False
    host: tuple[int, ...] = ()

    @property
    def cached(self) -> bool:
        """A cache's GPU part (`refill_every`)."""
        return self.refill_every > 0

    @property
    def rank_range(self) -> tuple[int, int]:
        """Which of each token's top_k picks (0 = highest weight) this node computes."""
        return (self.ranks[0], self.ranks[1]) if self.ranks else (0, self.top_k)

    @property
    def deferred(self) -> bool:
        """A deferred part (Expert Deferral): its picks start past each token's first."""
        return self.rank_range[0] > 0

    @property
    def rank_fraction(self) -> float:
        lo, hi = self.rank_range
        return (hi - lo) / self.top_k

    @property
    def ids(self) -> tuple[int, ...]:
        return self.subset or tuple(range(self.experts))

    @property
    def rows(self) -> tuple[int, int]:
        return (self.inter_slice[0], self.inter_slice[1]) if self.inter_slice else (0, self.inter)

    @property
    def slice_fraction(self) -> float:
        lo, hi = self.rows
        return (hi - lo) / self.inter


@dataclass(frozen=True)
class ReduceAttrs:
    """Sum of partial outputs (NUMA shards of one routed-experts node), into one [T, hidden]."""

    hidden: int


@dataclass(frozen=True)
class DeferAttrs:
    """The deferred edge: routed-expert output of layer `src` (summed over its inputs, e.g. the
    CPU and GPU parts) that lands in layer `dst` = src + 1's residual add (Expert Deferral)."""

    hidden: int
    src: int
    dst: int


@dataclass(frozen=True)
class AddAttrs:
    """Elementwise sum of all inputs (residual stream and MoE partial outputs). A residual add
    says which: `residual` "attn" (after layer `layer`'s attention) or "ffn" (after its
    feed-forward, the end of the layer); "" for another sum."""

    layer: int | None = None
    residual: str = ""


@dataclass(frozen=True)
class LMHeadAttrs:
    hidden: int
    vocab: int


@dataclass(frozen=True)
class CopyAttrs:
    """Move a value across the PCIe link: src and dst are 'cpu' or 'gpu'."""

    src: str
    dst: str


@dataclass(frozen=True)
class SubmitAttrs:
    """Enqueue CPU task `task` (its root node) from the GPU stream (returns at once). `members`:
    the task's CPU nodes in graph order, the root last (e.g. NUMA shards and their reduce).
    Inputs: what the members read from outside the task, already on the CPU. Output: a token
    the matching sync waits on. `on_host`: the task reads the token ids alone (an embedding
    lowered as a task): a runner on the GPU lanes has the host compute it before the step, and
    the submit and sync only order it."""

    task: str
    members: tuple[str, ...] = ()
    on_host: bool = False


@dataclass(frozen=True)
class SyncAttrs:
    """Wait in the GPU stream until CPU node `task` (second input) is done; its value passes
    through (still in host memory: a copy brings it to the GPU). First input: the submit token."""

    task: str


#: the collectives the runtime runs (costmodel.collectives prices these and others)
COLLECTIVE_KINDS = ("all_reduce",)


@dataclass(frozen=True)
class CollectiveAttrs:
    """A collective among the plan's `ranks` GPU ranks (one process each, torch.distributed):
    `kind` all_reduce sums, over the ranks, each rank's sum of this node's inputs (none: zeros),
    so every rank gets the total [T, hidden]. Placement puts one after each MoE layer's routed
    experts when the plan spreads over several GPUs (`layer`): each rank's inputs are its own
    parts of the layer (its GPU experts; on the driver rank, the CPU ones too). Every rank's
    plan has the same collectives in the same order (`collective_signature`)."""

    kind: str
    hidden: int
    ranks: int
    layer: int | None = None


def host_packs(parts, inter: int) -> tuple[tuple[int, int, int | None], ...]:
    """The packs a copy of a layer's host experts reads, from that layer's CPU routed-experts
    nodes `parts` (placed, all holding the same host experts): their (rows, NUMA node) in row
    order where they tile 0..inter (tp shards, or one unsplit part; of whole-expert shards, which
    each span every row, the first), else one pack over every row (0, inter, None)."""
    edge, out = 0, []
    for lo, hi, numa in sorted({(*n.attrs.rows, n.place.numa) for n in parts}, key=lambda p: (p[0], p[1], p[2] or 0)):
        if lo == edge and hi > lo:
            out.append((lo, hi, numa))
            edge = hi
    return tuple(out) if edge == inter and out else ((0, inter, None),)


#: bytes per weight of a packed expert format over the PCIe link: data, plus the fp32 scales of its
#: quantization groups (int8: one per output channel of K = hidden; int4, fp8: one per 128 weights)
def packed_weight_bytes(fmt: str, k: int) -> float:
    return {"bf16": 2.0, "int8": 1.0 + 4.0 / max(k, 1), "int4": 0.5 + 4.0 / 128, "fp8": 1.0 + 4.0 / 128}[fmt]


def expert_weight_bytes(fmt: str, hidden: int, inter: int) -> float:
    """Bytes per weight of a routed expert packed as `fmt` (gate and up have `hidden` columns,
    down `inter`), scales included: what the CPU holds and reads, and a fetch copies."""
    return (packed_weight_bytes(fmt, hidden) * 2 + packed_weight_bytes(fmt, inter)) / 3


@dataclass(frozen=True)
class FetchAttrs:
    """Stream routed experts to the GPU for a prefill step: copy the packed weights of experts
    `subset` of layer `layer` (`experts` in all; each hidden x inter, packed as `fmt`) from host
    memory into GPU staging buffer `staging_buffer` and convert them there to the GPU layout (gate and up
    [inter, hidden], down [hidden, inter] per expert, in the activation dtype). The output is the
    converted weights, read by one GPU routed-experts node as its third input. The optional input
    is the routed-experts node that used the same staging buffer before: the copy waits until it is done.
    `host` (set by `lower`): the layer's experts packed in host memory, which it copies from.
    `packs` (set by the compile driver): the host packs holding them, (first row, end row, NUMA
    node or None) each, tiling the rows: the decode plan's CPU parts of the layer where they hold
    the same experts (one pack per NUMA shard), else one pack over every row."""

    layer: int
    hidden: int
    inter: int
    experts: int
    subset: tuple[int, ...]
    fmt: str = "bf16"
    staging_buffer: int = 0
    host: tuple[int, ...] = ()
    packs: tuple[tuple[int, int, int | None], ...] = ()

    @property
    def ids(self) -> tuple[int, ...]:
        return self.subset

    @property
    def rows(self) -> tuple[int, int]:
        return (0, self.inter)

    @property
    def link_bytes(self) -> float:
        """Bytes copied over the PCIe link: the packed experts as the CPU holds them."""
        return len(self.subset) * 3 * self.hidden * self.inter * expert_weight_bytes(self.fmt, self.hidden, self.inter)


# ---------------------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class Work:
    """One step's size: `tokens` processed (all rows), `context` positions each token attends to
    (average), `batch` independent sequences (each reads its own KV cache)."""

    tokens: int
    context: int
    batch: int = 1
    #: per-expert pick probabilities of this layer (a routing profile); None = uniform k/E
    expert_probs: tuple[float, ...] | None = None
    #: where the tokens are one sequence's consecutive ones (a speculative verification step): per
    #: expert, the chance that two neighbouring tokens both pick it (a routing profile's); None:
    #: the tokens' picks are independent
    neighbour_probs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class OpFacts:
    attrs: type
    arity: tuple[int, int]  # min, max number of inputs
    shape: Callable[[Any, list[TensorType], DType], TensorType]
    flops: Callable[[Any, Work], float]
    #: fraction of the node's weights read in one step (routed experts read only those hit)
    weight_fraction: Callable[[Any, Work], float] = lambda a, w: 1.0
    #: elements of non-weight state read per step (KV cache)
    state_elems: Callable[[Any, Work], float] = lambda a, w: 0.0
    #: fraction of the node's weight references it holds (a routed-expert subset holds its experts only)
    held_fraction: Callable[[Any], float] = lambda a: 1.0
    #: how the cost model prices it: compute (roofline), copy (PCIe), fetch (PCIe + conversion on the
    #: GPU), submit / sync (fixed overheads), collective (the GPU link: costmodel.collectives)
    pricing: str = "compute"


def _hidden(a, ins, act):
    return TensorType((TOKENS, a.hidden), act)


def _experts_out(a, ins, act):
    """[T, hidden] in the activation dtype; a running group's partial sum in float32."""
    return TensorType((TOKENS, a.hidden), DType.F32 if a.running else act)


def _same_as_first(a, ins, act):
    return ins[0]


def _attention_flops(a: AttentionAttrs, w: Work) -> float:
    t, ctx = w.tokens, w.context
    if a.kind == "gqa":
        proj = 2 * t * a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim
        out = 2 * t * a.heads * a.head_dim * a.hidden
        attn = 4 * t * ctx * a.heads * a.head_dim
        return proj + out + attn
    qk = a.qk_nope_dim + a.qk_rope_dim
    if a.q_lora_rank:
        q = 2 * t * (a.hidden * a.q_lora_rank + a.q_lora_rank * a.heads * qk)
    else:
        q = 2 * t * a.hidden * a.heads * qk
    kv_a = 2 * t * a.hidden * (a.kv_lora_rank + a.qk_rope_dim)
    # absorbed form: queries folded into the latent space, attention over the latent cache
    absorb = 2 * t * a.heads * a.kv_lora_rank * (a.qk_nope_dim + a.v_head_dim)
    attn = 2 * t * ctx * a.heads * (2 * a.kv_lora_rank + a.qk_rope_dim)
    out = 2 * t * a.heads * a.v_head_dim * a.hidden
    return q + kv_a + absorb + attn + out


def _expert_probs(a: RoutedExpertsAttrs, w: Work) -> list[float]:
    """Chance a token picks each expert of the node's subset within the node's ranks (k/E each
    when routing is uniform; a rank range of r picks takes r/k of that)."""
    share = a.rank_fraction
    if w.expert_probs is None:
        return [a.top_k / a.experts * share] * len(a.ids)
    return [min(w.expert_probs[e], 1.0) * share for e in a.ids]


def experts_hit_fraction(a: RoutedExpertsAttrs, w: Work) -> float:
    """Expected fraction of the node's experts hit by `tokens` tokens: mean over its experts
    of 1 - (1 - p_e)^T. Neighbouring tokens (`neighbour_probs`, c_e) share an expert more often
    than independent ones (p_e^2): each of the T - 1 neighbour pairs takes c_e - p_e^2 off (exact
    for T = 2; never below p_e)."""
    if w.expert_probs is None:  # uniform: every expert alike (the common case, priced often)
        return 1.0 - (1.0 - a.top_k / a.experts * a.rank_fraction) ** w.tokens
    p = _expert_probs(a, w)
    if w.neighbour_probs is None or w.tokens < 2:
        return sum(1.0 - (1.0 - q) ** w.tokens for q in p) / len(p)
    c = [min(w.neighbour_probs[e], 1.0) * a.rank_fraction ** 2 for e in a.ids]  # both neighbours' picks in range
    t = w.tokens
    return sum(max(q, 1.0 - (1.0 - q) ** t - (t - 1) * max(0.0, ce - q * q)) for q, ce in zip(p, c)) / len(p)


def _experts_flops(a: RoutedExpertsAttrs, w: Work) -> float:
    """6 FLOPs per weight for each (token, expert) pair routed into the node's subset and slice."""
    if w.expert_probs is None:
        picked = (len(a.subset) or a.experts) * a.top_k / a.experts * a.rank_fraction
    else:
        picked = sum(_expert_probs(a, w))
    return 6.0 * w.tokens * picked * a.hidden * a.inter * a.slice_fraction


FACTS: dict[Op, OpFacts] = {
    Op.INPUT: OpFacts(InputAttrs, (0, 0), lambda a, ins, act: TensorType((TOKENS, a.hidden), act) if a.hidden
                      else TensorType((TOKENS,), DType.I64), lambda a, w: 0.0),
    Op.EMBED: OpFacts(EmbedAttrs, (1, 1), _hidden, lambda a, w: 0.0,
                      weight_fraction=lambda a, w: min(1.0, w.tokens / a.vocab)),
    Op.RMSNORM: OpFacts(RMSNormAttrs, (1, 1), _same_as_first, lambda a, w: 4.0 * w.tokens * a.dim),
    Op.ATTENTION: OpFacts(AttentionAttrs, (1, 1), _hidden, _attention_flops,
                          state_elems=lambda a, w: float(w.batch * w.context * a.kv_cache_elems_per_token())),
    Op.GATE: OpFacts(GateAttrs, (1, 1), lambda a, ins, act: TensorType((TOKENS, a.top_k), DType.ROUTE),
                     lambda a, w: 2.0 * w.tokens * a.hidden * a.experts),
    Op.MLP: OpFacts(MLPAttrs, (1, 1), _hidden,
                    lambda a, w: 6.0 * w.tokens * a.hidden * a.inter + (2.0 * w.tokens * a.hidden if a.sigmoid_gate else 0)),
    Op.ROUTED_EXPERTS: OpFacts(RoutedExpertsAttrs, (2, 4), _experts_out, _experts_flops,
                               weight_fraction=experts_hit_fraction,
                               held_fraction=lambda a: len(a.ids) / a.experts * a.slice_fraction),
    Op.REDUCE: OpFacts(ReduceAttrs, (1, 16), _hidden, lambda a, w: float(w.tokens * a.hidden)),
    Op.DEFER: OpFacts(DeferAttrs, (1, 4), _hidden, lambda a, w: float(w.tokens * a.hidden)),
    Op.ADD: OpFacts(AddAttrs, (2, 64), _same_as_first, lambda a, w: 0.0),
    Op.LM_HEAD: OpFacts(LMHeadAttrs, (1, 1), lambda a, ins, act: TensorType((TOKENS, a.vocab), DType.F32),
                        lambda a, w: 2.0 * w.tokens * a.hidden * a.vocab),
    Op.COPY: OpFacts(CopyAttrs, (1, 1), _same_as_first, lambda a, w: 0.0, pricing="copy"),
    Op.SUBMIT: OpFacts(SubmitAttrs, (1, 16), lambda a, ins, act: TensorType((), DType.TOKEN), lambda a, w: 0.0,
                       pricing="submit"),
    Op.SYNC: OpFacts(SyncAttrs, (2, 2), lambda a, ins, act: ins[1], lambda a, w: 0.0, pricing="sync"),
    Op.FETCH: OpFacts(FetchAttrs, (0, 1), lambda a, ins, act: TensorType((len(a.subset), 3 * a.hidden * a.inter), act),
                      lambda a, w: 0.0, held_fraction=lambda a: len(a.subset) / a.experts, pricing="fetch"),
    Op.COLLECTIVE: OpFacts(CollectiveAttrs, (0, 16), _hidden, lambda a, w: float(w.tokens * a.hidden),
                           pricing="collective"),
    Op.PROJECT: OpFacts(ProjectAttrs, (1, 8), lambda a, ins, act: TensorType((TOKENS, a.out), act),
                        lambda a, w: 2.0 * w.tokens * sum(a.parts) * a.out),
}


# ------------------------------------------------------------------------------------- text


def format_attrs(attrs: Any) -> str:
    """Deterministic `k=v` text of the attrs; defaults (zero, False, empty) are left out."""
    parts = []
    for f in fields(attrs):
        v = getattr(attrs, f.name)
        if is_dataclass(v):
            parts.append(f"{f.name}({format_attrs(v)})")
        elif v == f.default and f.name not in ("kind",):
            continue
        elif isinstance(v, float):
            parts.append(f"{f.name}={v:.6g}")
        elif isinstance(v, tuple):
            parts.append(f"{f.name}=[{_ranges(v) if all(isinstance(x, int) for x in v) else ','.join(v)}]")
        else:
            parts.append(f"{f.name}={v}")
    return " ".join(parts)


def _ranges(ids: tuple[int, ...]) -> str:
    """Sorted ints as compact ranges: (0, 1, 2, 5) -> '0-2,5'."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


#: ops whose GPU rules multiply every weight matrix through one linear helper (backends/layers.py),
#: which also takes weights held in FP8; the roles a rule reads as plain matrices are excluded
#: (MLA's kv_b: the absorbed decode splits it per head)
FP8_KERNEL_OPS: dict[Op, frozenset[str]] = {Op.ATTENTION: frozenset({"kv_b"}), Op.MLP: frozenset()}


def fp8_holdable(op: Op, w: WeightRef) -> bool:
    """Whether a node of `op` can hold weight `w` in FP8 on the GPU: stored in FP8 and either a
    dense matrix the FP8 kernels read, or a routed expert's projection (the GPU experts rules
    dequantize the picked experts' rows, or one projection of the layer, into a temporary)."""
    if w.fmt != "fp8":
        return False
    if w.experts:
        return op == Op.ROUTED_EXPERTS and w.role in EXPERT_ROLES
    return op in FP8_KERNEL_OPS and w.role not in FP8_KERNEL_OPS[op]


#: the per-expert projections of a routed-experts node (what its GPU rules stack and read)
EXPERT_ROLES = frozenset({"gate", "up", "down"})


def fp8_expert_weight(w: WeightRef) -> bool:
    """Whether `w` is a routed expert's projection held in FP8."""
    return w.held == "fp8" and w.experts > 0


def sums_parts(n) -> bool:
    """Whether `n` sums the routed-expert parts it reads (a residual add, or an all-reduce over the
    ranks): the node a pass that splits or replaces a part rewires to read the new parts."""
    return n.op in (Op.ADD, Op.COLLECTIVE)


def collective_signature(g) -> list[tuple[str, str, int, str]]:
    """The collectives of a plan's graph in issue order, as every rank's plan must have them:
    (name, kind, ranks, output type). Ranks that disagree here would wait on each other forever."""
    return [(n.name, n.attrs.kind, n.attrs.ranks, str(n.out)) for n in g.nodes if n.op == Op.COLLECTIVE]


def ffn_residual(g, layer: int):
    """The add that ends layer `layer` (its feed-forward's residual add)."""
    for n in g.nodes:
        if n.op == Op.ADD and n.attrs.residual == "ffn" and n.attrs.layer == layer:
            return n
    raise KeyError(f"the graph has no feed-forward residual add for layer {layer}")
