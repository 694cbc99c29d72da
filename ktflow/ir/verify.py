"""Graph invariants, numbered, checked after every pass.

Each rule has an id, the first stage it applies to, and a check that yields (node, message)
for each violation. Stages are ordered: spec < costed < placed < lowered < scheduled < buffered.
`verify(graph, stage)` runs
every rule of that stage and the ones before it and raises `VerifyError` naming the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import KtflowError
from .graph import Graph, Node
from .ops import COLLECTIVE_KINDS, FACTS, Op, fp8_holdable
from .types import ARENAS, DType, Device, FLOAT_DTYPES, STORED_FORMATS, TOKENS

STAGES = ("spec", "costed", "placed", "lowered", "scheduled", "buffered")


class VerifyError(KtflowError):
    def __init__(self, rule: str, node: str | None, message: str):
        self.rule, self.node = rule, node
        where = f" at node {node}" if node else ""
        super().__init__(f"verifier rule {rule} ({RULES[rule].title}){where}: {message}")


@dataclass(frozen=True)
class Rule:
    id: str
    stage: str
    title: str
    check: Callable[[Graph], Iterator[tuple[str | None, str]]]


def _r1_unique_names(g: Graph):
    seen = set()
    for n in g.nodes:
        if not n.name:
            yield n.name, "empty node name"
        if n.name in seen:
            yield n.name, "name used twice"
        seen.add(n.name)


def _r2_topological(g: Graph):
    defined = set()
    for n in g.nodes:
        for i in n.inputs:
            if i not in defined:
                yield n.name, f"input {i!r} is not defined before this node (cycle or missing)"
        defined.add(n.name)


def _r3_arity(g: Graph):
    for n in g.nodes:
        lo, hi = FACTS[n.op].arity
        if not lo <= len(n.inputs) <= hi:
            yield n.name, f"{n.op.value} takes {lo}..{hi} inputs, has {len(n.inputs)}"
        if not isinstance(n.attrs, FACTS[n.op].attrs):
            yield n.name, f"attrs are {type(n.attrs).__name__}, {n.op.value} needs {FACTS[n.op].attrs.__name__}"


def _r4_shapes(g: Graph):
    for n in g.nodes:
        if not all(i in g for i in n.inputs) or not isinstance(n.attrs, FACTS[n.op].attrs):
            continue
        ins = [g.by_name(i).out for i in n.inputs]
        want = FACTS[n.op].shape(n.attrs, ins, g.act_dtype)
        if want != n.out:
            yield n.name, f"output type {n.out} but the shape rule gives {want}"


def _r5_input_types(g: Graph):
    for n in g.nodes:
        if not all(i in g for i in n.inputs):
            continue
        ins = [g.by_name(i).out for i in n.inputs]
        if n.op == Op.EMBED:
            if ins[0].dtype != DType.I64:
                yield n.name, f"embed reads token ids, got {ins[0]}"
            continue
        if n.op == Op.INPUT or FACTS[n.op].pricing != "compute":
            continue
        if n.op == Op.ROUTED_EXPERTS and len(ins) >= 2 and ins[1].dtype != DType.ROUTE:
            yield n.name, f"second input must be a routing ({DType.ROUTE.value}), got {ins[1]}"
        x = ins[0]
        width = getattr(n.attrs, "hidden", None) or getattr(n.attrs, "dim", None) or (
            x.shape[1] if len(x.shape) == 2 else "?")
        if x.dtype not in FLOAT_DTYPES or len(x.shape) != 2 or x.shape[0] != TOKENS or x.shape[1] != width:
            yield n.name, f"first input must be [T,{width}] float, got {x}"
        if n.op == Op.ADD and any(t != x for t in ins[1:]):
            yield n.name, "add inputs differ in type: " + ", ".join(map(str, ins))
        if n.op == Op.PROJECT and (len(ins) != len(n.attrs.parts) or any(
                t.shape != (TOKENS, w) or t.dtype not in FLOAT_DTYPES for t, w in zip(ins, n.attrs.parts))):
            yield n.name, f"project takes [T,{'], [T,'.join(map(str, n.attrs.parts))}] floats, got " + \
                ", ".join(map(str, ins))


def _r6_outputs(g: Graph):
    if not g.outputs:
        yield None, "graph has no outputs"
    for o in g.outputs:
        if o not in g:
            yield None, f"output {o!r} is not a node"
    heads = [n.name for n in g.nodes if n.op == Op.LM_HEAD]
    if len(heads) != 1:
        yield None, f"expected exactly one lm_head, found {len(heads)}"
    elif heads[0] not in g.outputs:
        yield heads[0], "lm_head is not a graph output"
    inputs = [n for n in g.nodes if n.op == Op.INPUT]
    if sum(1 for n in inputs if not n.attrs.hidden) != 1:
        yield None, "expected exactly one input node of token ids"
    if sum(1 for n in inputs if n.attrs.hidden) > 1:
        yield None, "expected at most one input node of hidden vectors"


def _r7_no_dead_nodes(g: Graph):
    live = set(o for o in g.outputs if o in g)
    for n in reversed(g.nodes):
        if n.name in live:
            live.update(n.inputs)
    for n in g.nodes:
        if n.name not in live:
            yield n.name, "result is never used by an output"


def _r8_weights(g: Graph):
    for n in g.nodes:
        roles = set()
        for w in n.weights:
            if w.role in roles:
                yield n.name, f"weight role {w.role!r} listed twice"
            roles.add(w.role)
            if any(d <= 0 for d in w.shape) or w.experts < 0:
                yield n.name, f"weight {w.key} has a non-positive dim {w.shape} or a negative expert count"
            if (w.experts > 0) != ("{e}" in w.key):
                yield n.name, f"weight {w.key}: per-expert keys contain {{e}} exactly when experts > 0"
            if w.fmt and w.fmt not in STORED_FORMATS:
                yield n.name, f"weight {w.key}: stored format {w.fmt!r} is not one of {', '.join(STORED_FORMATS)}"
            if w.fmt == "fp8" and len(w.shape) != 2:
                yield n.name, f"weight {w.key}: fp8 (block-scaled) weights are matrices, got shape {list(w.shape)}"
            if w.held not in ("", "fp8"):
                yield n.name, f"weight {w.key}: held format {w.held!r} is not '' (the activation dtype) or 'fp8'"


def _p2_fp8_held_on_gpu(g: Graph):
    for n in g.nodes:
        for w in n.weights:
            if w.held != "fp8":
                continue
            if not fp8_holdable(n.op, w):
                yield n.name, (f"weight {w.key} ({w.role}) is held in fp8 but is not an fp8-stored matrix the "
                               f"FP8 kernels read for a {n.op.value} node")
            elif n.place is not None and n.place.device != Device.GPU:
                yield n.name, f"weight {w.key} is held in fp8 on the {n.place.device.value}; only GPU nodes hold fp8"
            elif w.experts and n.attrs.cached:
                yield n.name, (f"weight {w.key} is held in fp8 in an expert cache; the runtime refills cached rows "
                               "in the activation dtype")
            elif w.experts and tuple(n.attrs.rows) != (0, n.attrs.inter):
                yield n.name, f"weight {w.key} is held in fp8 for rows {n.attrs.rows} of its experts; only whole ones"


def _r9_one_attention_per_layer(g: Graph):
    seen: dict[int, str] = {}
    for n in g.nodes:
        if n.op == Op.ATTENTION:
            if n.attrs.layer in seen:
                yield n.name, f"layer {n.attrs.layer} already has attention {seen[n.attrs.layer]} (one KV cache each)"
            seen[n.attrs.layer] = n.name


def _r10_expert_subsets_partition(g: Graph):
    """Each expert of a layer is computed once: by one node, or by NUMA shards whose
    intermediate slices tile 0..inter exactly; each token's picks 0..top_k - skip once each."""
    by_layer: dict[int, list] = {}
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS:
            by_layer.setdefault(n.attrs.layer, []).append(n)
    # a layer spread over several GPU ranks: each rank's graph computes its own share of the experts
    spread = {n.attrs.layer for n in g.nodes if n.op == Op.COLLECTIVE and n.attrs.ranks > 1}
    for layer, all_nodes in by_layer.items():
        by_ranks: dict[tuple[int, int], list] = {}
        for n in all_nodes:
            by_ranks.setdefault(n.attrs.rank_range, []).append(n)
        skips = {n.attrs.skip for n in all_nodes}
        k = all_nodes[0].attrs.top_k
        if len(skips) > 1 or not 0 <= min(skips) < k:
            yield all_nodes[0].name, f"layer {layer}: its nodes must agree on a skip in 0..{k - 1}, got {sorted(skips)}"
            continue
        edge, k = 0, k - skips.pop()  # picks past top_k - skip are dropped on purpose (expert skipping)
        for lo, hi in sorted(by_ranks):
            if lo != edge or hi <= lo:
                yield by_ranks[(lo, hi)][0].name, f"layer {layer}: rank ranges must tile 0..{k} once each"
            edge = hi
        if edge != k:
            yield all_nodes[0].name, f"layer {layer}: ranks {edge}..{k} computed by no node"
        for nodes in by_ranks.values():
            yield from _tile_experts(layer, nodes, layer in spread)


def _tile_experts(layer: int, nodes: list, share: bool = False):
    """Within one rank range: each expert computed once, or by shards whose rows tile 0..inter
    (`share`: this GPU rank's share of the layer, so experts other ranks compute are absent)."""
    want = nodes[0].attrs.experts
    if not any(n.attrs.inter_slice for n in nodes) and not share:  # whole experts only: a partition, counted (the common case)
        seen = [e for n in nodes for e in n.attrs.ids]
        if len(seen) == want and len(set(seen)) == want and min(seen) == 0 and max(seen) == want - 1 \
                and all(list(n.attrs.subset) == sorted(set(n.attrs.subset)) for n in nodes):
            return
    slices: dict[int, list[tuple[int, int, str]]] = {}
    for n in nodes:
        a = n.attrs
        if list(a.subset) != sorted(set(a.subset)) or any(not 0 <= e < a.experts for e in a.subset):
            yield n.name, f"subset must be sorted, unique expert ids in 0..{a.experts - 1}"
        lo, hi = a.rows
        if a.inter_slice and (len(a.inter_slice) != 2 or not 0 <= lo < hi <= a.inter):
            yield n.name, f"inter_slice must be (lo, hi) with 0 <= lo < hi <= {a.inter}"
        for e in a.ids:
            slices.setdefault(e, []).append((lo, hi, n.name))
    want, inter = nodes[0].attrs.experts, nodes[0].attrs.inter
    missing = sorted(set(range(want)) - set(slices))[:8]
    if missing and not share:
        yield nodes[0].name, f"layer {layer}: experts {missing} are computed by no node"
    for e, parts in slices.items():
        parts.sort()
        edge = 0
        for lo, hi, name in parts:
            if lo != edge:
                who = ", ".join(p[2] for p in parts)
                yield name, (f"expert {e} of layer {layer}: rows {edge}..{lo} computed by no node or twice "
                             f"(by {who})")
                break
            edge = hi
        else:
            if edge != inter:
                yield parts[-1][2], f"expert {e} of layer {layer}: rows {edge}..{inter} computed by no node"


def _producer(g: Graph, name: str):
    """The node that computed `name`, looking through copies and syncs."""
    n = g.by_name(name)
    while n.op in (Op.COPY, Op.SYNC):
        n = g.by_name(n.inputs[-1])
    return n


def _moe_layers(g: Graph) -> list[int]:
    return sorted({n.attrs.layer for n in g.nodes if n.op == Op.ROUTED_EXPERTS})


def _d1_deferred_edges(g: Graph):
    for n in g.nodes:
        if n.op != Op.DEFER:
            continue
        a = n.attrs
        if a.dst != a.src + 1:
            yield n.name, f"a deferred edge spans exactly one layer, this one goes {a.src} -> {a.dst}"
        for i in n.inputs:
            if i not in g:
                continue
            p = _producer(g, i)
            parts = [g.by_name(x) for x in p.inputs if x in g] if p.op == Op.REDUCE else [p]
            ok = bool(parts) and all(x.op == Op.ROUTED_EXPERTS and x.attrs.layer == a.src and x.attrs.deferred
                                     for x in parts)
            if not ok:
                yield n.name, f"input {i} is not deferred routed-expert output of layer {a.src}"
        users = [g.by_name(u) for u in g.users(n.name)]
        if len(users) != 1 or users[0].op != Op.ADD or users[0].attrs.residual != "ffn" or users[0].attrs.layer != a.dst:
            yield n.name, (f"must be read by layer {a.dst}'s feed-forward residual add alone, is read by "
                           f"{[u.name for u in users]}")


def _d2_last_moe_layer_defers_nothing(g: Graph):
    moe = _moe_layers(g)
    for n in g.nodes:
        if n.op == Op.DEFER and moe and n.attrs.src >= moe[-1]:
            yield n.name, f"layer {n.attrs.src} is the last MoE layer: it defers nothing"
        if n.op == Op.ROUTED_EXPERTS and moe and n.attrs.layer == moe[-1] and n.attrs.rank_range != (0, n.attrs.top_k):
            yield n.name, "the last MoE layer computes all its ranks at once"


def _c1_costed(g: Graph):
    for n in g.nodes:
        if n.cost is None:
            yield n.name, "no cost annotation"


def _p1_placed(g: Graph):
    for n in g.nodes:
        if n.place is None:
            yield n.name, "no placement"


def _s1_fetch_feeds_its_experts(g: Graph):
    """A fetch stages the weights of exactly the experts of the one GPU routed-experts node that
    reads it (as its third input); that node holds no weights of its own. A streamed node with
    `cache_size` (a cached layer streamed whole) computes every expert of its layer."""
    for n in g.nodes:
        if n.op == Op.FETCH:
            readers = [u for u in g.users(n.name) if g.by_name(u).op == Op.ROUTED_EXPERTS]
            if len(readers) != 1 or len(g.users(n.name)) != 1:
                yield n.name, f"must be read by one routed-experts node alone, is read by {list(g.users(n.name))}"
                continue
            r = g.by_name(readers[0])
            if len(r.inputs) < 3 or r.inputs[2] != n.name:
                yield n.name, f"must be the third input of {r.name}"
            elif (r.attrs.layer, r.attrs.ids, r.attrs.rows) != (n.attrs.layer, n.attrs.subset, (0, n.attrs.inter)):
                yield n.name, f"stages layer {n.attrs.layer} experts [{len(n.attrs.subset)}], {r.name} computes layer " \
                              f"{r.attrs.layer} experts [{len(r.attrs.ids)}] rows {r.attrs.rows}"
            if n.place is not None and n.place.device.value != "gpu":
                yield n.name, "a fetch stages weights in GPU memory: it is placed on the GPU"
        if n.op == Op.ROUTED_EXPERTS and len(n.inputs) == 4:  # a streamed group adding to the one before
            prev = g.by_name(n.inputs[3]) if n.inputs[3] in g else None
            if prev is None or prev.op != Op.ROUTED_EXPERTS or not prev.attrs.running \
                    or prev.attrs.layer != n.attrs.layer:
                yield n.name, f"fourth input {n.inputs[3]} is not the running sum of its layer's group before it"
        if n.op == Op.ROUTED_EXPERTS and n.attrs.running:
            readers = [g.by_name(u) for u in g.users(n.name) if g.by_name(u).op != Op.FETCH]  # a fetch: its buffer's wait
            if len(n.inputs) < 3 or len(readers) != 1 or readers[0].op != Op.ROUTED_EXPERTS \
                    or readers[0].inputs[3:] != (n.name,):
                yield n.name, "a running sum is a streamed group's, read as the fourth input of its layer's next group"
        if n.op == Op.ROUTED_EXPERTS and len(n.inputs) >= 3:
            src = g.by_name(n.inputs[2]) if n.inputs[2] in g else None
            if src is None or src.op != Op.FETCH:
                yield n.name, f"third input {n.inputs[2]} is not a fetch"
            if n.weights:
                yield n.name, "streamed experts hold no weights: their fetch does"
            if n.place is not None and n.place.device.value != "gpu":
                yield n.name, "streamed experts run on the GPU"
        if n.op == Op.ROUTED_EXPERTS and n.attrs.cache_size:  # a cached layer streamed whole in a prefill step
            a = n.attrs
            if len(n.inputs) < 3 or a.subset or a.refill_every or not 0 < a.cache_size < a.experts:
                yield n.name, (f"cache_size={a.cache_size} marks a streamed node computing every expert of its layer "
                               f"(a third input, no subset, not itself a cache, fewer rows than its {a.experts} "
                               "experts)")


def _s2_staging_buffers_reused_in_order(g: Graph):
    """A fetch that reuses a staging buffer waits for the buffer's previous user: its input is
    the streamed-experts node that last read a fetch into the same buffer."""
    last: dict[int, str] = {}  # staging buffer -> the streamed-experts node that read it last, in graph order
    buffer_of: dict[str, int] = {}  # fetch -> its staging buffer
    for n in g.nodes:
        if n.op == Op.FETCH:
            want = last.get(n.attrs.staging_buffer)
            got = n.inputs[0] if n.inputs else None
            if got != want:
                yield n.name, f"staging buffer {n.attrs.staging_buffer} was last used by {want}; the fetch must wait for it (input {got})"
            buffer_of[n.name] = n.attrs.staging_buffer
        elif n.op == Op.ROUTED_EXPERTS and len(n.inputs) >= 3 and n.inputs[2] in buffer_of:
            last[buffer_of[n.inputs[2]]] = n.name


def _l1_edges_stay_on_one_device(g: Graph):
    for n in g.nodes:
        if n.place is None:
            continue
        for i in n.inputs:
            src = g.by_name(i).place.device if i in g and g.by_name(i).place else None
            if n.op == Op.COPY:
                if src is not None and (src.value != n.attrs.src or n.place.device.value != n.attrs.dst):
                    yield n.name, f"copy {n.attrs.src}->{n.attrs.dst} reads {i} on {src.value}, lives on {n.place.device.value}"
            elif src is not None and src != n.place.device:
                yield n.name, f"reads {i} from the {src.value} without a copy (it runs on the {n.place.device.value})"


def _l3_host_experts_recorded(g: Graph):
    recorded: dict[int, set[tuple[int, ...]]] = {}
    readers = [n for n in g.nodes if n.place is not None and (n.op == Op.FETCH or (
        n.op == Op.ROUTED_EXPERTS and (n.place.device == Device.CPU or len(n.inputs) >= 3)))]
    for n in readers:
        if not set(n.attrs.ids) <= set(n.attrs.host):
            yield n.name, f"its experts are not all among its layer's host experts ({len(n.attrs.host)} recorded)"
        recorded.setdefault(n.attrs.layer, set()).add(n.attrs.host)
    for layer, sets in recorded.items():
        if len(sets) > 1:
            yield None, f"layer {layer}'s nodes record {len(sets)} different sets of host experts"


def _l4_host_tasks_read_token_ids(g: Graph):
    for n in g.nodes:
        if n.op == Op.SUBMIT and n.attrs.on_host:
            other = [i for i in n.inputs if i not in g or g.by_name(i).op != Op.INPUT or g.by_name(i).attrs.hidden]
            if other or not n.inputs:
                yield n.name, f"a task on the host reads the token ids alone, but this one reads {other or 'nothing'}"
            native = [m for m in n.attrs.members if m in g and g.by_name(m).op in (Op.ROUTED_EXPERTS, Op.REDUCE)]
            if native:
                yield n.name, f"a task on the host runs no routed experts, but this one holds {native}"


def _l2_submit_sync_pairs(g: Graph):
    for n in g.nodes:
        if n.op == Op.SYNC:
            sub, task = (g.by_name(i) if i in g else None for i in n.inputs)
            if sub is None or sub.op != Op.SUBMIT or sub.attrs.task != n.attrs.task or n.inputs[1] != n.attrs.task:
                yield n.name, f"sync must read the submit of {n.attrs.task} and {n.attrs.task} itself"
        if n.op == Op.SUBMIT:
            task = g.by_name(n.attrs.task) if n.attrs.task in g else None
            if task is None or task.place is None or task.place.device.value != "cpu":
                yield n.name, f"submits {n.attrs.task}, which is not a CPU node"
                continue
            members = set(n.attrs.members)
            if not members or n.attrs.members[-1] != task.name or any(
                    m not in g or g.by_name(m).place is None or g.by_name(m).place.device.value != "cpu" for m in members):
                yield n.name, f"members {list(n.attrs.members)} must be CPU nodes ending with the task {task.name}"
                continue
            outside = {i for m in members for i in g.by_name(m).inputs if i not in members}
            if any(g.position(n.name) > g.position(m) for m in members) or set(n.inputs) != outside:
                yield n.name, f"must come before every node of task {task.name} and read exactly its outside inputs"


#: predicted times are rounded to the nanosecond: orderings hold within that
_EPS_US = 1e-3


def _t1_timed_after_inputs(g: Graph) -> Iterator[tuple[str | None, str]]:
    for n in g.nodes:
        t = n.timing
        if t is None:
            yield n.name, "no predicted time (scheduled graphs time every node)"
            continue
        if t.end_us < t.start_us:
            yield n.name, f"ends ({t.end_us} us) before it starts ({t.start_us} us)"
        for i in n.inputs:
            if i not in g:
                continue  # V2 names the missing input
            ti = g.by_name(i).timing
            if ti is not None and t.start_us < ti.end_us - _EPS_US:
                yield n.name, f"starts at {t.start_us} us, before its input {i} ends ({ti.end_us} us)"


def _t2_one_node_per_lane_at_a_time(g: Graph) -> Iterator[tuple[str | None, str]]:
    last: dict[str, Node] = {}
    for n in sorted((n for n in g.nodes if n.timing is not None and n.place is not None),
                    key=lambda n: (n.timing.start_us, g.position(n.name))):
        prev = last.get(n.place.lane)
        if prev is not None and n.timing.start_us < prev.timing.end_us - _EPS_US:
            yield n.name, f"starts at {n.timing.start_us} us on lane {n.place.lane} while {prev.name} runs there " \
                          f"(until {prev.timing.end_us} us)"
        if prev is None or n.timing.end_us >= prev.timing.end_us:
            last[n.place.lane] = n


def needs_buffer(n: Node) -> bool:
    """A value a step writes into memory of its own: not a completion token, not the token-id
    input (the caller's memory), not a sync (its value is its task's)."""
    return n.out.dtype != DType.TOKEN and n.op not in (Op.INPUT, Op.SYNC)


def _b1_buffers_well_formed(g: Graph) -> Iterator[tuple[str | None, str]]:
    for n in g.nodes:
        b = n.buffer
        if b is None:
            if needs_buffer(n):
                yield n.name, "no buffer (the buffer pass gives every value one)"
            continue
        if not needs_buffer(n):
            yield n.name, f"a {n.op.value} node of type {n.out.dtype.value} takes no buffer"
        elif b.arena not in ARENAS:
            yield n.name, f"arena {b.arena!r} is not one of {', '.join(ARENAS)}"
        elif (b.arena == "staging") != (n.op == Op.FETCH) or b.per_token == (b.arena == "staging"):
            yield n.name, "staging buffers (absolute) hold fetched expert weights, per-token buffers everything else"
        elif b.offset < 0 or b.first_instruction < 0 or b.last_instruction < b.first_instruction:
            yield n.name, f"buffer {b} has a negative offset or ends before it starts"
        else:
            need = n.out.numel(0 if not b.per_token else 1) * n.out.dtype.itemsize
            if b.bytes < need:
                yield n.name, f"buffer {b} holds {b.bytes} bytes{'/token' if b.per_token else ''}, the value needs {need}"


def _b2_live_buffers_disjoint(g: Graph) -> Iterator[tuple[str | None, str]]:
    by_arena: dict[str, list[Node]] = {}
    for n in g.nodes:
        if n.buffer is not None:
            by_arena.setdefault(n.buffer.arena, []).append(n)
    for arena, nodes in by_arena.items():  # a sweep over instructions: the buffers live at once, by offset
        live: list[Node] = []
        for n in sorted(nodes, key=lambda n: (n.buffer.first_instruction, n.buffer.offset)):
            b = n.buffer
            live = [m for m in live if m.buffer.last_instruction >= b.first_instruction]
            for m in live:
                o = m.buffer
                if b.bytes and o.bytes and b.offset < o.offset + o.bytes and o.offset < b.offset + b.bytes:
                    yield n.name, f"shares bytes of arena {arena} with {m.name} while both are live"
                    break
            live.append(n)


def _r1_collectives_well_formed(g: Graph) -> Iterator[tuple[str | None, str]]:
    """A collective is a kind the runtime runs, among two or more ranks, for one MoE layer whose
    routed-expert parts it sums; no add reads those parts (it would count them on one rank only).
    (Across ranks the plans must list the same collectives in the same order:
    `ops.collective_signature`, checked by the ranks when they start: no one graph sees the others.)"""
    layers = {}
    for n in g.nodes:
        if n.op != Op.COLLECTIVE:
            continue
        a = n.attrs
        if a.kind not in COLLECTIVE_KINDS:
            yield n.name, f"collective kind {a.kind!r} is not one of {', '.join(COLLECTIVE_KINDS)}"
        if a.ranks < 2:
            yield n.name, f"a collective among {a.ranks} rank(s): needs 2 or more"
        if a.layer is None:
            yield n.name, "a collective names the MoE layer whose parts it sums (layer)"
        elif a.layer in layers:
            yield n.name, f"layer {a.layer} already has collective {layers[a.layer]}"
        else:
            layers[a.layer] = n.name
    if layers:
        for n in g.nodes:
            if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in layers:
                for r in g.nodes:
                    if n.name in r.inputs and r.op == Op.ADD:
                        yield r.name, (f"adds {n.name}, a part of layer {n.attrs.layer}, which its all-reduce "
                                       f"{layers[n.attrs.layer]} sums over the ranks: add the all-reduce")


def _b3_arenas_without_gaps(g: Graph) -> Iterator[tuple[str | None, str]]:
    """A buffer ends within the sum of its arena's buffers (staging: within its staging buffers times
    the largest fetch): a layout never needs a gap larger than everything else in the arena (an
    absurd offset in an edited plan is refused, not allocated)."""
    total: dict[str, int] = {}
    for n in g.nodes:
        if n.buffer is not None:
            total[n.buffer.arena] = total.get(n.buffer.arena, 0) + n.buffer.bytes
    fetches = [n for n in g.nodes if n.op == Op.FETCH and n.buffer is not None]
    if fetches:
        per_buffer = max(n.buffer.bytes for n in fetches) * (max(n.attrs.staging_buffer for n in fetches) + 1)
        total["staging"] = max(total.get("staging", 0), per_buffer)
    for n in g.nodes:
        b = n.buffer
        if b is not None and b.offset + b.bytes > total[b.arena]:
            yield n.name, f"buffer {b} ends past the {total[b.arena]} bytes all buffers of arena {b.arena} need together"


RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("V1", "spec", "node names are unique", _r1_unique_names),
    Rule("V2", "spec", "nodes are in topological order", _r2_topological),
    Rule("V3", "spec", "input count and attrs class match the op", _r3_arity),
    Rule("V4", "spec", "output types follow the shape rules", _r4_shapes),
    Rule("V5", "spec", "input types fit the op", _r5_input_types),
    Rule("V6", "spec", "one token input (and at most one hidden input), one lm_head, outputs exist", _r6_outputs),
    Rule("V7", "spec", "every node feeds an output", _r7_no_dead_nodes),
    Rule("V8", "spec", "weight references are well formed", _r8_weights),
    Rule("V9", "spec", "one attention (KV cache) per layer", _r9_one_attention_per_layer),
    Rule("V10", "spec", "a layer's routed-expert nodes partition its experts", _r10_expert_subsets_partition),
    Rule("R1", "spec", "a collective sums one MoE layer's parts over two or more ranks", _r1_collectives_well_formed),
    Rule("D1", "spec", "a deferred edge carries layer j's deferred experts into layer j+1's add", _d1_deferred_edges),
    Rule("D2", "spec", "nothing is deferred out of the last MoE layer", _d2_last_moe_layer_defers_nothing),
    Rule("C1", "costed", "every node has a cost", _c1_costed),
    Rule("P1", "placed", "every node has a placement", _p1_placed),
    Rule("P2", "placed", "weights held in fp8 are fp8-stored matrices of GPU nodes the FP8 kernels or the "
         "GPU experts rules read (whole experts, no expert cache)",
         _p2_fp8_held_on_gpu),
    Rule("S1", "placed", "a fetch stages the weights of the streamed experts that read it", _s1_fetch_feeds_its_experts),
    Rule("S2", "placed", "a reused staging buffer waits for its previous reader", _s2_staging_buffers_reused_in_order),
    Rule("L1", "lowered", "values cross devices only through copy nodes", _l1_edges_stay_on_one_device),
    Rule("L2", "lowered", "submit/sync pairs wrap a CPU task", _l2_submit_sync_pairs),
    Rule("L3", "lowered", "CPU and streamed expert nodes and fetches name their layer's host experts",
         _l3_host_experts_recorded),
    Rule("L4", "lowered", "a task the host computes before the step reads only token ids and runs no experts",
         _l4_host_tasks_read_token_ids),
    Rule("T1", "scheduled", "every node is timed, starting after its inputs end", _t1_timed_after_inputs),
    Rule("T2", "scheduled", "a lane runs one node at a time", _t2_one_node_per_lane_at_a_time),
    Rule("B1", "buffered", "every value has one well-formed buffer of the right arena", _b1_buffers_well_formed),
    Rule("B2", "buffered", "values live at once do not share bytes of an arena", _b2_live_buffers_disjoint),
    Rule("B3", "buffered", "an arena is no larger than its buffers together", _b3_arenas_without_gaps),
]}


def violations(g: Graph, stage: str = "spec") -> list[tuple[str, str | None, str]]:
    """All violations as (rule id, node, message), for rules up to `stage`."""
    upto = STAGES.index(stage)
    out = []
    for r in RULES.values():
        if STAGES.index(r.stage) <= upto:
            out += [(r.id, node, msg) for node, msg in r.check(g)]
    return out


def verify(g: Graph, stage: str = "spec") -> None:
    found = violations(g, stage)
    if found:
        rule, node, msg = found[0]
        err = VerifyError(rule, node, msg)
        err.all = found  # type: ignore[attr-defined]
        raise err
