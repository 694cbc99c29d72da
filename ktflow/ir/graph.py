"""Nodes, the immutable graph, and the builder the model specs use.

A `Graph` is a topologically ordered tuple of frozen `Node`s plus the names of its outputs.
It is never mutated: passes build a new graph (`graph.replace_nodes(...)`). `nx()` gives a
networkx view for graph algorithms and DOT output; the tuple of nodes is the storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable

import networkx as nx

from .ops import FACTS, Op
from .serialize import attrs_from_dict, attrs_to_dict, dataclass_from, typed
from .types import Cost, DType, Placement, Buffer, TensorType, Timing, WeightRef


@dataclass(frozen=True)
class Node:
    name: str
    op: Op
    inputs: tuple[str, ...]
    attrs: Any
    out: TensorType
    weights: tuple[WeightRef, ...] = ()
    place: Placement | None = None
    cost: Cost | None = None
    timing: Timing | None = None  # set by the schedule pass
    buffer: Buffer | None = None  # set by the buffer pass

    def weight_elems(self) -> int:
        """Elements of the weights this node holds (a routed-expert subset: its experts only)."""
        return round(sum(w.numel() for w in self.weights) * FACTS[self.op].held_fraction(self.attrs))

    def weight_bytes(self, itemsize: int) -> float:
        """Bytes of the weights this node holds: `itemsize` per element, weights held in FP8 at
        their stored size (WeightRef.held_bytes)."""
        return sum(w.held_bytes(itemsize) for w in self.weights) * FACTS[self.op].held_fraction(self.attrs)

    def weight(self, role: str) -> WeightRef:
        for w in self.weights:
            if w.role == role:
                return w
        raise KeyError(f"node {self.name} has no weight with role {role!r}")

    # ------------------------------------------------------------------ JSON (plans, reproducers)
    def to_dict(self) -> dict:
        d: dict[str, Any] = {
            "name": self.name,
            "op": self.op.value,
            "inputs": list(self.inputs),
            "attrs": attrs_to_dict(self.attrs),
            "out": {"shape": list(self.out.shape), "dtype": self.out.dtype.value},
            "weights": [{"role": w.role, "key": w.key, "shape": list(w.shape), "experts": w.experts}
                        | ({"fmt": w.fmt} if w.fmt else {}) | ({"held": w.held} if w.held else {})
                        for w in self.weights],
        }
        if self.place is not None:
            d["place"] = {"device": self.place.device.value, "cause": self.place.cause,
                          "numa": self.place.numa, "stream": self.place.stream}
        if self.cost is not None:
            d["cost"] = {"tokens": self.cost.tokens, "flops": self.cost.flops, "bytes": self.cost.bytes,
                         "cpu_s": self.cost.cpu_s, "gpu_s": self.cost.gpu_s}
        if self.timing is not None:
            d["timing"] = {"start_us": self.timing.start_us, "end_us": self.timing.end_us}
        if self.buffer is not None:
            b = self.buffer
            d["buffer"] = {"arena": b.arena, "offset": b.offset, "bytes": b.bytes,
                           "first_instruction": b.first_instruction, "last_instruction": b.last_instruction,
                           "per_token": b.per_token}
        return d

    @staticmethod
    def from_dict(d: dict) -> "Node":
        """A node from its JSON dict (as to_dict writes it), every field's type checked: a
        ValueError names the node and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"a node must be a JSON object, got {d!r}")
        where = f"node {d.get('name')!r}"
        op = typed(Op, d.get("op"), f"{where}.op")
        out = d.get("out")
        if not isinstance(out, dict):
            raise ValueError(f"{where}.out must be a JSON object")
        place, cost, timing, buffer = d.get("place"), d.get("cost"), d.get("timing"), d.get("buffer")
        return Node(
            name=typed(str, d.get("name"), "node name"),
            op=op,
            inputs=typed(tuple[str, ...], d.get("inputs"), f"{where}.inputs"),
            attrs=attrs_from_dict(op, d.get("attrs")),
            out=TensorType(typed(tuple[int | str, ...], out.get("shape"), f"{where}.out.shape"),
                           typed(DType, out.get("dtype"), f"{where}.out.dtype")),
            weights=typed(tuple[WeightRef, ...], d.get("weights", []), f"{where}.weights"),
            place=None if place is None else dataclass_from(Placement, place, f"{where}.place"),
            cost=None if cost is None else dataclass_from(Cost, cost, f"{where}.cost"),
            timing=None if timing is None else dataclass_from(Timing, timing, f"{where}.timing"),
            buffer=None if buffer is None else dataclass_from(Buffer, buffer, f"{where}.buffer"),
        )


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]
    #: compute dtype of activations; the graph's float tensors use it
    act_dtype: DType = DType.BF16
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n.name: i for i, n in enumerate(self.nodes)})

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def by_name(self, name: str) -> Node:
        try:
            return self.nodes[self._index[name]]
        except KeyError:
            raise KeyError(f"graph has no node named {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def position(self, name: str) -> int:
        return self._index[name]

    @cached_property
    def _users(self) -> dict[str, tuple[str, ...]]:
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                if i in users:
                    users[i].append(n.name)
        return {k: tuple(v) for k, v in users.items()}

    def users(self, name: str) -> tuple[str, ...]:
        return self._users[name]

    def nx(self) -> nx.DiGraph:
        """A networkx view: node name -> {'node': Node}; edges input -> user."""
        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, node=n)
            for i in n.inputs:
                g.add_edge(i, n.name)
        return g

    def without_unread(self) -> "Graph":
        """The graph less the nodes no output depends on (a GPU rank that holds none of a layer's
        experts has no reader for that layer's router)."""
        live = set(o for o in self.outputs if o in self)
        for n in reversed(self.nodes):
            if n.name in live:
                live.update(n.inputs)
        return self.replace_nodes(n for n in self.nodes if n.name in live)

    def replace_nodes(self, nodes: Iterable[Node]) -> "Graph":
        return Graph(tuple(nodes), self.outputs, self.act_dtype)

    def map(self, fn) -> "Graph":
        """New graph with `fn(node)` applied to every node (same names, same order)."""
        return self.replace_nodes(fn(n) for n in self.nodes)

    def weight_elems(self) -> int:
        return sum(n.weight_elems() for n in self.nodes)

    def to_dict(self) -> dict:
        return {"act_dtype": self.act_dtype.value, "outputs": list(self.outputs),
                "nodes": [n.to_dict() for n in self.nodes]}

    @staticmethod
    def from_dict(d: dict) -> "Graph":
        if not isinstance(d, dict) or not isinstance(d.get("nodes"), list):
            raise ValueError("a graph must be a JSON object with a list of nodes")
        return Graph(tuple(Node.from_dict(n) for n in d["nodes"]), typed(tuple[str, ...], d.get("outputs"), "outputs"),
                     typed(DType, d.get("act_dtype"), "act_dtype"))


class GraphBuilder:
    """Appends nodes in order; output types come from the facts table's shape rules."""

    def __init__(self, act_dtype: DType):
        self.act_dtype = act_dtype
        self._nodes: list[Node] = []
        self._types: dict[str, TensorType] = {}

    def add(self, name: str, op: Op, inputs: Iterable[str], attrs: Any,
            weights: Iterable[WeightRef] = ()) -> str:
        inputs = tuple(inputs)
        if name in self._types:
            raise ValueError(f"duplicate node name {name!r}")
        missing = [i for i in inputs if i not in self._types]
        if missing:
            raise ValueError(f"node {name!r} reads undefined values {missing}")
        out = FACTS[op].shape(attrs, [self._types[i] for i in inputs], self.act_dtype)
        self._nodes.append(Node(name, op, inputs, attrs, out, tuple(weights)))
        self._types[name] = out
        return name

    def build(self, outputs: Iterable[str]) -> Graph:
        return Graph(tuple(self._nodes), tuple(outputs), self.act_dtype)


def with_place(node: Node, place: Placement) -> Node:
    return replace(node, place=place)
