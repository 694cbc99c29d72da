"""Lowering: explicit copies at device crossings, submit/sync around CPU work the GPU waits on, and
each layer's experts packed in host memory recorded on the nodes that read them."""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, Node
from ..ir.ops import FACTS, CopyAttrs, Op, SubmitAttrs, SyncAttrs
from ..ir.types import Device, Placement
from ..plan.options import CompileContext
from .annotate_costs import recost_changed
from .infra import compiler_pass


@compiler_pass(requires="placed", produces="lowered")
def lower(g: Graph, ctx: CompileContext) -> Graph:
    """Make every device crossing and every CPU/GPU hand-off a node.

    Algorithm, in graph order: an input produced on the other device is read through a copy
    node `<value>.to_<device>` (one per value and destination; placed on the destination, lane
    'copy'). A CPU compute node whose result the GPU reads gets `<node>.submit` just before it
    (in the GPU stream: enqueue the CPU task, return at once) and `<node>.sync` after it (in the
    GPU stream: wait for the task); GPU readers take the sync's value through a copy. GPU work
    that does not depend on the task (the shared expert) sits between the two in graph order, so
    it runs while the CPU computes. A task that reads another task's result is submitted after
    that task's sync. A task that reads the token ids alone, with no routed experts among its members, is marked
    `on_host` on its submit.
    Plans with one device get no copies or tasks.
    First, per MoE layer, the experts held in host memory (`host_experts`) go into the `host`
    attr of the layer's CPU parts, streamed parts and fetches: the native backend packs those.
    Requires: placed, costed graph. Guarantees: values cross devices only through copy nodes
    (rule L1), submit/sync pairs wrap exactly one CPU task each (rule L2), a task on the host
    reads only token ids (rule L4), every CPU or streamed
    routed-experts node and every fetch names its layer's host experts (rule L3), new nodes are
    costed.
    """
    g = _with_host_experts(g)
    if len({n.place.device for n in g.nodes}) == 1:
        return g
    device = {n.name: n.place.device for n in g.nodes}
    gpu_readers = {i for n in g.nodes for i in n.inputs if device[i] == Device.CPU and device[n.name] == Device.GPU}
    task_of = _task_groups(g, gpu_readers)  # CPU node -> the task (root) it is part of
    members: dict[str, list[str]] = {}
    for m, root in sorted(task_of.items(), key=lambda kv: g.position(kv[0])):  # graph order: the root last
        members.setdefault(root, []).append(m)
    out: list[Node] = []
    copies: dict[tuple[str, Device], str] = {}
    synced: dict[str, str] = {}  # CPU node -> its sync, the value GPU readers copy
    pending: dict[str, str] = {}  # CPU node -> its submit, until a GPU reader needs the sync
    waited: set[str] = set()  # task results a later task reads, through their sync

    def emit(n: Node) -> str:
        out.append(n)
        device[n.name] = n.place.device
        return n.name

    def settle(value: str) -> str:
        """The value of a submitted task once the GPU stream has waited for it (its sync)."""
        if value in pending:  # as late as possible: GPU work before this point overlaps the task
            sub, task = pending.pop(value), g.by_name(value)
            synced[value] = emit(Node(f"{value}.sync", Op.SYNC, (sub, value), SyncAttrs(value), task.out,
                                      place=Placement(Device.CPU, cause="GPU stream waits for the CPU task",
                                                      stream="gpu")))
        return synced.get(value, value)

    def on(value: str, dev: Device) -> str:
        if device[value] == dev:
            return synced[value] if value in waited else value
        src = settle(value)
        key = (src, dev)
        if key not in copies:
            node = Node(f"{value}.to_{dev.value}", Op.COPY, (src,), CopyAttrs(device[src].value, dev.value),
                        _type_of(out, src), place=Placement(dev, cause="device crossing", stream="copy"))
            copies[key] = emit(node)
        return copies[key]

    submitted: set[str] = set()
    for n in g.nodes:
        dev = n.place.device
        root = task_of.get(n.name)
        if root is not None and root not in submitted:  # before the task's first node
            submitted.add(root)
            # another task's result it reads: the GPU stream submits this one after that one is done
            ext = _external_inputs(g, members[root])
            for i in ext:
                if i in pending:
                    settle(i)
                    waited.add(i)  # the task's nodes read it through the sync
            sub = emit(Node(f"{root}.submit", Op.SUBMIT, tuple(on(i, Device.CPU) for i in ext),
                            SubmitAttrs(root, tuple(members[root]), on_host=_on_host(g, members[root], ext)),
                            FACTS[Op.SUBMIT].shape(None, [], g.act_dtype),
                            place=Placement(Device.CPU, cause="enqueue CPU work from the GPU stream", stream="gpu")))
            pending[root] = sub
        ins = tuple(on(i, dev) for i in n.inputs)
        emit(replace(n, inputs=ins))
    return recost_changed(g, g.replace_nodes(out), ctx)


def _on_host(g: Graph, members: list[str], ext: tuple[str, ...]) -> bool:
    """Whether a task is one the host computes before the step: it reads the token ids alone
    and none of its members is routed experts or their reduce (those run on the native pool)."""
    return bool(ext) and all(g.by_name(i).op == Op.INPUT and not g.by_name(i).attrs.hidden for i in ext) and \
        not any(g.by_name(m).op in (Op.ROUTED_EXPERTS, Op.REDUCE) for m in members)


def host_experts(g: Graph) -> dict[int, tuple[int, ...]]:
    """Per MoE layer, the experts held in host memory: those of CPU parts and of streamed ones
    (a fetch copies from host memory), and every expert of a layer whose GPU part is a cache (an
    expert it gives up runs on the CPU)."""
    held: dict[int, set[int]] = {}
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS and (n.place.device == Device.CPU or streamed(n)):
            held.setdefault(n.attrs.layer, set()).update(n.attrs.ids)
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS and n.attrs.cached and n.attrs.layer in held:
            held[n.attrs.layer].update(range(n.attrs.experts))
    return {layer: tuple(sorted(ids)) for layer, ids in held.items()}


def streamed(n: Node) -> bool:
    """A GPU routed-experts node computing experts a fetch staged (its third input)."""
    return n.op == Op.ROUTED_EXPERTS and len(n.inputs) >= 3


def _with_host_experts(g: Graph) -> Graph:
    held = host_experts(g)
    out = []
    for n in g.nodes:
        reads = n.op == Op.FETCH or (n.op == Op.ROUTED_EXPERTS and (n.place.device == Device.CPU or streamed(n)))
        if reads and n.attrs.host != held[n.attrs.layer]:
            n = replace(n, attrs=replace(n.attrs, host=held[n.attrs.layer]))
        out.append(n)
    return g.replace_nodes(out)


def _task_groups(g: Graph, roots: set[str]) -> dict[str, str]:
    """CPU compute nodes the GPU waits on (roots), each with the CPU compute nodes that feed it
    only through the CPU (e.g. NUMA shards feeding their reduce): one submitted task each.

    A task is submitted before its first node, so everything it reads from the GPU must exist by
    then. A node that comes before a value the rest of its task reads from the GPU (the CPU
    experts deferred from layer j, feeding a CPU residual add of layer j + 1 whose other inputs
    the GPU makes later) becomes the root of a task of its own; the native queue runs tasks in
    submission order, so the later task still finds its result."""
    roots = set(roots)
    while True:
        task_of = _grow_tasks(g, roots)
        early = _submitted_too_early(g, task_of)
        if not early:
            return task_of
        roots |= early


def _submitted_too_early(g: Graph, task_of: dict[str, str]) -> set[str]:
    """Members that come before a GPU-made value their task reads (empty when every task can be
    submitted before its first node)."""
    members: dict[str, list[str]] = {}
    for m, root in task_of.items():
        members.setdefault(root, []).append(m)
    early: set[str] = set()
    for ms in members.values():
        made_late = max((g.position(i) for i in _external_inputs(g, ms)
                         if g.by_name(i).place.device != Device.CPU), default=-1)
        before = {m for m in ms if g.position(m) < made_late}
        # the new roots: those of them read by a member that comes later (each pulls its own feeders)
        early |= {m for m in before if any(u in ms and u not in before for u in g.users(m))}
    return early


def _grow_tasks(g: Graph, roots: set[str]) -> dict[str, str]:
    task_of: dict[str, str] = {}
    for n in g.nodes:
        if n.name not in roots or n.place.device != Device.CPU or FACTS[n.op].pricing != "compute" \
                or n.op == Op.INPUT:
            continue
        todo = [n.name]
        while todo:
            m = todo.pop()
            if m in task_of:
                continue
            task_of[m] = n.name
            for i in g.by_name(m).inputs:
                src = g.by_name(i)
                if src.place.device == Device.CPU and FACTS[src.op].pricing == "compute" and src.op != Op.INPUT \
                        and i not in roots:
                    todo.append(i)
    return task_of


def _external_inputs(g: Graph, members: list[str]) -> tuple[str, ...]:
    """Inputs of a task's nodes produced outside the task, in first-use order."""
    inside, out = set(members), []
    for n in g.nodes:
        if n.name in inside:
            out += [i for i in n.inputs if i not in inside and i not in out]
    return tuple(out)


def _type_of(nodes: list[Node], name: str):
    for n in reversed(nodes):
        if n.name == name:
            return n.out
    raise KeyError(name)
