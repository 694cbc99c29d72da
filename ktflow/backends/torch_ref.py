"""The reference backend: every op in plain torch, on any device. It is the correctness oracle
the other backends are tested against, so it is written for clarity, one rule per op (RULES).

Activations are [tokens, features] with tokens = batch * seq (row-major over batch). Weights are
taken from the checkpoint's memory map as they are when dtype and device already match (no copy),
else converted once in `prepare`. A node runs on the torch device of its placement (GPU-placed
nodes on `gpu_device`, which is "cpu" where no GPU is present); inputs produced on the other
device arrive through the plan's copy nodes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .kernels import rope as rope_mod
from .lending import LentRegion
from ..errors import InputError, KtflowError, WeightError
from ..ir.graph import Graph, Node
from ..ir.ops import AttentionAttrs, GateAttrs, Op
from ..ir.types import Device
from ..frontend.quant import scale_key
from ..frontend.weights import WeightSource, check_finite
from .kv import StaticCaches, cache_of
from .kernels import fused_gpu
from .base import StepContext, node_key, staged
from .kernels.dequant_gpu import available as triton_on
from .kernels.fp8_gpu import Fp8Weight, nan_bytes
from .kernels.layers import attention, matmul, rms_norm, swiglu
from .kernels.moe_gpu import expert_map, stack_experts

Weights = dict[str, Any]


class TorchRefBackend:
    name = "torch_ref"

    def __init__(self, gpu_device: str = "cpu", dtype: torch.dtype = torch.float32, options: Any = None, *,
                 static_kv: StaticCaches | None = None):
        """`static_kv`: the KV caches are lent from it (a captured graph's) instead of owned by
        each sequence's state."""
        self.devices = {Device.CPU: torch.device("cpu"), Device.GPU: torch.device(gpu_device)}
        self.dtype = dtype
        self.weights: dict[str, Weights] = {}
        self._inv_freq: dict[Any, torch.Tensor] = {}
        #: op -> rule(engine, node, weights, inputs, ctx, device); a backend composed over this
        #: engine puts its own rules in (the native side's, the CUDA backend's static ones)
        self.rules: dict[Op, Callable] = dict(RULES)
        self._stacked: dict[tuple, dict] = {}
        self.static_kv = static_kv
        #: the resident experts lent to long prompts as staging (lending.LentRegion), or None
        self.lent = None

    def device_of(self, node: Node) -> torch.device:
        return self.devices[node.place.device] if node.place is not None else self.devices[Device.CPU]

    # ------------------------------------------------------------------------------ weights
    def _ready(self, t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        if t.dtype == self.dtype and t.device == dev:
            return t
        return t.to(device=dev, dtype=self.dtype)

    def prepare(self, graph: Graph, weights: WeightSource | None) -> None:
        todo = [n for n in graph.nodes if n.weights and node_key(n) not in self.weights]
        if todo and weights is None:
            raise KtflowError("this model was loaded without weights (config.json only): it can be compiled "
                              "but not run; point ktflow at a checkpoint dir with *.safetensors")
        from ..util.progress import bar

        # a bar (on stderr) when there is enough to copy to be worth watching
        copying = sum(n.weight_elems() for n in todo if self.device_of(n).type != "cpu") > 2e8
        for n in bar(todo, "weights", "node", show=copying):
            w: Weights = {}
            # a fetch's experts stay in host memory: it copies them to the GPU at each step
            dev = self.devices[Device.CPU] if n.op == Op.FETCH else self.device_of(n)
            stacks: dict[str, torch.Tensor] = {}
            for ref in n.weights:
                if ref.experts and ref.held == "fp8":  # as stored, stacked: e4m3 bytes and block scales
                    stacks[ref.role] = _fp8_experts(weights, ref, n, dev)
                    w[ref.role] = {e: Fp8Weight(stacks[ref.role].data[i], stacks[ref.role].scale_inv[i])
                                   for i, e in enumerate(n.attrs.ids)}
                elif ref.experts:  # only the experts (and the intermediate rows) this node holds
                    rows = slice(*n.attrs.rows)
                    index = (slice(None), rows) if ref.role == "down" else (rows,)
                    w[ref.role] = {}
                    for i, e in enumerate(n.attrs.ids):
                        t = self._ready(weights.load_expert(ref, e)[index], dev)
                        check_finite(t, f"tensor {ref.key.format(e=e)} (node {n.name})")
                        if dev.type == "cuda":  # one stacked copy; each expert a view of its row
                            if ref.role not in stacks:
                                stacks[ref.role] = torch.empty((len(n.attrs.ids), *t.shape), dtype=t.dtype, device=dev)
                            t = stacks[ref.role][i].copy_(t)
                        w[ref.role][e] = t
                elif ref.held == "fp8":  # as stored: e4m3 bytes and block scales
                    w[ref.role] = _fp8_weight(weights, ref, dev, n.name)
                else:
                    w[ref.role] = self._ready(weights.load(ref), dev)
                    check_finite(w[ref.role], f"tensor {ref.key} (node {n.name})")
            self.weights[node_key(n)] = w
            if {"gate", "up", "down"} <= stacks.keys():
                self._stacked[node_key(n)] = dict(local=expert_map(n.attrs.ids, n.attrs.experts, dev),
                                                  **{r: stacks[r] for r in ("gate", "up", "down")})

    # ------------------------------------------------------------------------------ dispatch
    def run(self, node: Node, inputs: list[Any], ctx: StepContext) -> Any:
        dev = self.device_of(node)
        return self.rules[node.op](self, node, self.weights.get(node_key(node), {}), inputs, ctx, dev)

    def stacked(self, node: Node) -> dict:
        """A GPU routed-experts node's resident weights stacked for the batched rules (made when
        they load, the per-expert weights views of its rows: held once; captured graphs and the
        grouped prefill rule read the same copy). A projection held in FP8 (WeightRef.held) is an
        Fp8Weight over the stack: e4m3 bytes [E, n, k] and float32 block scales [E, n/128, k/128]."""
        key = node_key(node)
        if key not in self._stacked:
            self._stacked[key] = stack_experts(self.weights[key], node.attrs.ids, node.attrs.experts)
        return self._stacked[key]

    def lend(self, nodes: list[Node]) -> None:
        """Lend GPU routed-experts nodes `nodes`' stacked weights as prefill staging (once, before
        any graph is captured; lending.LentRegion)."""
        if self.lent is None and nodes:
            self.lent = LentRegion(self, nodes)

    # -------------------------------------------- the experts interface (runtime.expert_cache's)
    def place_experts(self, node: Node, moves: dict[int, int | None]) -> None:
        """GPU routed-experts node `node`'s resident experts change: expert e now sits in row
        `moves[e]` of its stacks (the caller has copied it there), or nowhere (None). The stacks'
        map and the per-expert views follow; nothing is copied here."""
        st = self.stacked(node)
        held = self.weights.get(node_key(node))
        gone = [e for e, row in moves.items() if row is None]
        came = {e: row for e, row in moves.items() if row is not None}
        if gone:
            st["local"][torch.tensor(gone, device=st["local"].device)] = -1
        if came:
            st["local"][torch.tensor(list(came), device=st["local"].device)] = \
                torch.tensor(list(came.values()), device=st["local"].device)
        if held is not None:  # the per-expert views the stacks were made from, kept in step with them
            for role in ("gate", "up", "down"):
                for e in gone:
                    held[role].pop(e, None)
                for e, row in came.items():
                    held[role][e] = st[role][row]

    def cpu_expert_mask(self, node: Node) -> torch.Tensor | None:
        """The mask of the experts a CPU routed-experts node computes, where its operator holds
        more (a cached layer's CPU part: 1 = computed here); None where it computes all it holds.
        The reference backend has no native operator: None."""
        return None

    def rope_tables(self, attrs: AttentionAttrs, ctx: StepContext, dev: torch.device):
        key = (attrs.rope, dev)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_mod.inv_freq(attrs.rope).to(dev)
        pos = torch.arange(ctx.position, ctx.position + ctx.seq, device=dev)
        return rope_mod.cos_sin(attrs.rope, self._inv_freq[key], pos, self.dtype)

    def cache(self, ctx: StepContext, attrs: AttentionAttrs, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """This layer's KV cache (backends/kv.py): the sequence state's own, or lent from the
        static caches."""
        if self.static_kv is not None:
            return self.static_kv.lend(ctx.state, attrs, ctx.batch, dev)
        return cache_of(ctx.state, attrs, ctx.batch, self.dtype, dev)


def _fp8_weight(weights: WeightSource, ref, dev: torch.device, node: str) -> Fp8Weight:
    """A weight held in FP8 on `dev`: its stored bytes and block scales, checked (an e4m3 NaN
    byte or a non-finite scale is a WeightError naming the tensor)."""
    w8, scale = weights.get(ref.key), weights.get(scale_key(ref.key))
    bad = nan_bytes(w8).nonzero()
    if len(bad):
        at = [int(i) for i in bad[0]]
        raise WeightError(f"tensor {ref.key} (node {node}): e4m3 NaN byte at {at}: the checkpoint is damaged")
    check_finite(scale, f"tensor {scale_key(ref.key)} (node {node})")
    return Fp8Weight(w8.to(dev), scale.to(device=dev, dtype=torch.float32).contiguous())


def _fp8_experts(weights: WeightSource, ref, n: Node, dev: torch.device) -> Fp8Weight:
    """The experts of routed-experts node `n` of per-expert reference `ref`, held in FP8 on
    `dev`: one stack of their stored bytes [E, n, k] (float8_e4m3fn) and one of their block
    scales [E, ceil(n/128), ceil(k/128)] (float32), row i expert n.attrs.ids[i]; each checked as
    `_fp8_weight` checks a dense one. Whole experts only (verifier rule P2)."""
    data = scales = None
    for i, e in enumerate(n.attrs.ids):
        key = ref.key.format(e=e)
        one = _fp8_weight(weights, replace(ref, key=key, experts=0), torch.device("cpu"), n.name)
        if data is None:
            data = torch.empty((len(n.attrs.ids), *one.data.shape), dtype=torch.float8_e4m3fn, device=dev)
            scales = torch.empty((len(n.attrs.ids), *one.scale_inv.shape), dtype=torch.float32, device=dev)
        data[i].view(torch.uint8).copy_(one.data.view(torch.uint8))
        scales[i].copy_(one.scale_inv)
    return Fp8Weight(data, scales)


# ------------------------------------------------------------------------------------ op rules


def _to(v: Any, dev: torch.device) -> Any:
    """A value on `dev` (routings are (ids, weights) pairs)."""
    if isinstance(v, tuple):
        return tuple(_to(t, dev) for t in v)
    return v if v.device == dev else v.to(dev)


def _copy(be, node, w, ins, ctx, dev):
    return _to(ins[0], dev)


def _submit(be, node, w, ins, ctx, dev):
    return None  # the task's members run as their own instructions; an asynchronous backend enqueues it here


def _sync(be, node, w, ins, ctx, dev):
    return ins[1]


def _input(be, node, w, ins, ctx, dev):
    if node.attrs.hidden:
        if ctx.hidden is None or ctx.hidden.shape != (ctx.token_ids.numel(), node.attrs.hidden):
            got = "none" if ctx.hidden is None else list(ctx.hidden.shape)
            raise InputError(f"{node.name}: this graph reads {node.attrs.hidden}-wide hidden vectors, one a token "
                              f"({ctx.token_ids.numel()}), and the step was given {got}")
        return ctx.hidden.to(dev, be.dtype)
    return ctx.token_ids.to(dev)


def _project(be, node, w, ins, ctx, dev):
    return F.linear(torch.cat(ins, dim=-1), w["weight"])


def _embed(be, node, w, ins, ctx, dev):
    return F.embedding(ins[0], w["weight"])


def _rmsnorm(be, node, w, ins, ctx, dev):
    return rms_norm(ins[0], w["weight"], node.attrs.eps)


def route(a: GateAttrs, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Router math shared by all families: (ids [T,k] int64, weights [T,k] f32), by weight desc."""
    logits = F.linear(x.float(), weight.float())
    scores = logits.sigmoid() if a.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    if a.select != "greedy":
        t = x.shape[0]
        grouped = choice.view(t, a.groups, a.experts // a.groups)
        if a.select == "group_max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(a.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(a.experts // a.groups, dim=1), float("-inf"))
    ids = choice.topk(a.top_k, dim=-1).indices
    wts = scores.gather(1, ids)
    if a.renormalize:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    wts = wts * a.scale
    order = wts.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(1, order), wts.gather(1, order)


def _gate(be, node, w, ins, ctx, dev):
    x = ins[0]
    if x.is_cuda and fused_gpu.route_fusable(node.attrs) and isinstance(w["weight"], torch.Tensor) \
            and triton_on(x.device):
        return fused_gpu.route(node.attrs, x, w["weight"])  # the same picks in two kernels
    return route(node.attrs, x, w["weight"], w.get("correction_bias"))


def _mlp(be, node, w, ins, ctx, dev):
    x = ins[0]
    y = swiglu(x, w["gate"], w["up"], w["down"])
    if node.attrs.sigmoid_gate:
        y = torch.sigmoid(matmul(x, w["sigmoid_gate"])) * y
    return y


def _routed_experts(be, node, w, ins, ctx, dev):
    x, (ids, wts) = ins[:2]
    a = node.attrs
    lo, hi = a.rank_range  # the gate sorts each token's picks by weight: column = rank
    ids, wts = ids[:, lo:hi], wts[:, lo:hi]
    # a streamed group after the first adds to its layer's running sum (float32)
    out = ins[3].float().clone() if len(ins) == 4 else torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if len(ins) >= 3:  # streamed: the weights its fetch staged, expert i of the subset in row i
        gate, up, down = staged(ins[2], a.hidden, a.inter)
        w = {"gate": dict(zip(a.ids, gate)), "up": dict(zip(a.ids, up)), "down": dict(zip(a.ids, down))}
    held = w["gate"]
    for e in ids.unique().tolist():
        if e not in held:
            continue  # another node (placed elsewhere) computes this expert
        rows, rank = torch.where(ids == e)
        y = swiglu(x[rows], w["gate"][e], w["up"][e], w["down"][e])
        out.index_add_(0, rows, y.float() * wts[rows, rank, None])
    return out if a.running else out.to(x.dtype)


def _fetch(be, node, w, ins, ctx, dev):
    """The subset's weights, from their host copies, stacked in the staged layout on the GPU."""
    a = node.attrs
    rows = [torch.cat([w["gate"][e].reshape(-1), w["up"][e].reshape(-1), w["down"][e].reshape(-1)]) for e in a.subset]
    if ctx.staging and node.name in ctx.staging:  # a borrowing step: straight into the lent region
        return ctx.staging[node.name].copy_(torch.stack(rows))
    return torch.stack(rows).to(device=dev, dtype=be.dtype)


def _add(be, node, w, ins, ctx, dev):
    out = ins[0]
    for t in ins[1:]:
        out = out + t
    return out


def _reduce(be, node, w, ins, ctx, dev):
    out = ins[0].float()
    for t in ins[1:]:
        out = out + t.float()
    return out.to(ins[0].dtype)


def _collective(be, node, w, ins, ctx, dev):
    """An all-reduce among the plan's ranks: this rank's parts summed in float32 (none: zeros),
    summed over torch.distributed's default group (one process a rank: NCCL for a CUDA rank, on the
    step's stream, so a captured step holds it; gloo for CPU tensors), in the activation dtype."""
    import torch.distributed as dist

    a = node.attrs
    ready = dist.is_available() and dist.is_initialized()
    if not ready or dist.get_world_size() != a.ranks:
        got = f"{dist.get_world_size()} rank(s) in the process group" if ready else "no process group"
        raise KtflowError(f"{node.name}: the plan spreads over {a.ranks} GPU ranks and this process has {got}: run "
                          f"each rank's plan in its own process, all {a.ranks} together (`ktflow run --gpus {a.ranks}`)")
    out = torch.zeros(ctx.token_ids.numel(), a.hidden, dtype=torch.float32, device=dev)
    for t in ins:
        out += t.float()
    dist.all_reduce(out)
    return out.to(be.dtype)


def _lm_head(be, node, w, ins, ctx, dev):
    return F.linear(ins[0], w["weight"]).float()


RULES: dict[Op, Callable] = {
    Op.INPUT: _input, Op.EMBED: _embed, Op.RMSNORM: _rmsnorm, Op.ATTENTION: attention, Op.GATE: _gate,
    Op.MLP: _mlp, Op.ROUTED_EXPERTS: _routed_experts, Op.ADD: _add, Op.LM_HEAD: _lm_head,
    Op.COPY: _copy, Op.SUBMIT: _submit, Op.SYNC: _sync, Op.REDUCE: _reduce, Op.DEFER: _reduce, Op.FETCH: _fetch,
    Op.COLLECTIVE: _collective, Op.PROJECT: _project,
}
