"""Checks a plan read from a file before anything runs it: its graph rebuilt into the typed IR
and verified at its stage (ktflow.ir.verify), then its schedule and buffers (rules K1-K8
below), so that an edited or damaged plan is refused at load with the rule it breaks instead of
failing midway through a run.

K1  every instruction names a node of the graph; an instruction that runs it reads the node's
    inputs and writes its value, a record or wait instruction neither
K2  an instruction's kind fits its node's op (fetch/copy/submit/sync instructions run those ops,
    launch the rest)
K3  every node has exactly one instruction that runs it
K4  a node runs after the nodes it reads
K5  every wait follows the record of its event; events are recorded once
K6  lanes are gpu, copy, fetch, cpu or cpu<k>; CPU nodes run on cpu lanes, GPU nodes on the others
K7  every value's buffer (rules B1, B2) is live over the instructions that write and
    read it, inside the plan
K8  captured instruction ranges lie inside the plan
K9  (the file) every plan has the file's max_seq_len, prefill steps fit it, the decode step is
    max_batch tokens, and each plan's predicted KV-cache bytes are those of max_seq_len x max_batch
"""

from __future__ import annotations

import dataclasses
import re

from ..costmodel.memory import kv_cache_bytes
from ..errors import KtflowError
from ..ir.ops import Op
from ..ir.types import Device
from ..ir.verify import violations

# `plan` below is a ktflow.plan.artifact.Plan (not imported: the artifact imports this module)

_OP_OF_KIND = {"fetch": Op.FETCH, "copy": Op.COPY, "submit": Op.SUBMIT, "sync": Op.SYNC}
_LANE = re.compile(r"^(gpu|copy|fetch|cpu\d*)$")


def plan_problems(plan: "Plan") -> list[str]:
    """Every broken rule of `plan` as 'rule: message' (the IR verifier's first, then K1-K8);
    empty for a sound plan."""
    try:
        g = plan.ir  # built once: the loader, the runners and this check read the same graph
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, RecursionError, KtflowError) as e:
        return [f"graph: cannot be rebuilt ({type(e).__name__}: {e})"]
    try:
        found = violations(g, "buffered")
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            MemoryError) as e:
        return [f"graph: the verifier cannot read it ({type(e).__name__}: {e})"]
    if found:
        return [f"{rule}: {str(node) + ': ' if node else ''}{msg}" for rule, node, msg in found]
    return _schedule_problems(plan, g)


def _schedule_problems(plan: "Plan", g) -> list[str]:
    out: list[str] = []
    names = {n.name for n in g.nodes}
    ran_at: dict[str, int] = {}
    recorded: set[str] = set()
    for i, s in enumerate(plan.instructions):
        where = f"instruction {i} ({s.kind} {s.node} on {s.lane})"
        if s.node not in names:
            out.append(f"K1: {where} names no node of the graph")
            continue
        bad = [v for v in (*s.reads, *s.writes) if v not in names]
        if bad:
            out.append(f"K1: {where} reads or writes {bad}, not values of the graph")
        if not _LANE.match(s.lane):
            out.append(f"K6: {where}: lane {s.lane!r} is not gpu, copy, fetch, cpu or cpu<k>")
        node = g.by_name(s.node)
        if s.kind in ("record", "wait"):
            if s.reads or s.writes:
                out.append(f"K1: {where} reads or writes values; a {s.kind} instruction only orders lanes")
            if not s.event:
                out.append(f"K5: {where} has no event")
            elif s.kind == "record":
                if s.event in recorded:
                    out.append(f"K5: {where} records event {s.event!r} a second time")
                recorded.add(s.event)
            elif s.event not in recorded:
                out.append(f"K5: {where} waits for event {s.event!r} before any instruction records it")
            continue
        if s.reads != list(node.inputs) or s.writes != [node.name]:
            out.append(f"K1: {where} reads {s.reads} and writes {s.writes}; its node reads {list(node.inputs)} "
                       f"and writes [{node.name!r}]")
        want = _OP_OF_KIND.get(s.kind)
        if (want is not None and node.op != want) or (want is None and node.op in _OP_OF_KIND.values()):
            out.append(f"K2: {where}: a {s.kind} instruction cannot run a {node.op.value} node")
        if s.node in ran_at:
            out.append(f"K3: {where} runs node {s.node} again (instruction {ran_at[s.node]} ran it)")
            continue
        ran_at[s.node] = i
        missing = [v for v in node.inputs if v not in ran_at]
        if missing:
            out.append(f"K4: {where} reads {missing} before the instructions that compute them")
        on_cpu = node.place is not None and node.place.device == Device.CPU
        if s.kind == "launch" and on_cpu != s.lane.startswith("cpu"):
            out.append(f"K6: {where}: a {'CPU' if on_cpu else 'GPU'} node on lane {s.lane}")
    not_run = sorted(names - ran_at.keys())
    if not_run:
        out.append(f"K3: nodes {not_run[:5]}{' ...' if len(not_run) > 5 else ''} have no instruction that runs them")
    out += _buffer_problems(plan, g)
    count = len(plan.instructions)
    out += [f"K8: captured instructions {a}..{b} are not inside the plan's {count} instructions"
            for a, b in plan.capture if not 0 <= a <= b < count]
    return out


def _buffer_problems(plan: "Plan", g) -> list[str]:
    """K7: each buffer (rules B1, B2 checked its shape and overlaps) is live over the plan's
    instructions that write and read its value: a buffer freed before a reader would let another value
    overwrite it."""
    out: list[str] = []
    count = len(plan.instructions)
    home = {n.name: n.inputs[1] for n in g.nodes if n.op == Op.SYNC}
    for i, s in enumerate(plan.instructions):
        for v in s.writes + s.reads:
            while v in home:
                v = home[v]
            b = plan.buffers.get(v)
            if b is not None and not b.first_instruction <= i <= b.last_instruction:
                out.append(f"K7: instruction {i} ({s.kind} {s.node}) uses {v}, whose buffer is live over "
                           f"instructions {b.first_instruction}..{b.last_instruction} only")
    for v, b in plan.buffers.items():
        if b.last_instruction >= count:
            out.append(f"K7: buffer of {v} is live until instruction {b.last_instruction}, past the plan's "
                       f"{count} instructions")
    return out


#: attrs fields passes rewrite (which experts and rows a node computes, which its layer holds in
#: host memory, whether its experts are a cache or stand in for one): left out of the comparison
#: with the model's spec
_PLACED_FIELDS = ("subset", "inter_slice", "ranks", "skip", "refill_every", "cache_size", "running", "host")


def spec_mismatches(plan: "Plan", spec) -> list[str]:
    """Nodes of `plan` whose op, attrs or weight references differ from the node of the same name
    in the model's spec graph (a plan edited by hand, or compiled from another config that
    happens to share the fingerprint): a plan only ever adds nodes and re-places experts."""

    out = []
    by_name = {n.name: n for n in spec.nodes}
    for n in plan.ir.nodes:
        s = by_name.get(n.name)
        if s is None or s.op != n.op:  # a pass's node (a NUMA reduce takes the experts' name)
            continue
        a, b = n.attrs, s.attrs
        if dataclasses.is_dataclass(a) and any(f in {x.name for x in dataclasses.fields(a)} for f in _PLACED_FIELDS):
            a = dataclasses.replace(a, **{f: getattr(b, f) for f in _PLACED_FIELDS if hasattr(b, f)})
        if a != b:
            diff = [f"{f.name} {getattr(n.attrs, f.name)!r} (model: {getattr(s.attrs, f.name)!r})"
                    for f in dataclasses.fields(b) if f.name not in _PLACED_FIELDS
                    and getattr(n.attrs, f.name, None) != getattr(s.attrs, f.name)]
            out.append(f"node {n.name}'s attrs differ from the model's: {', '.join(diff) or 'attrs'}")
        streamed = n.op == Op.ROUTED_EXPERTS and len(n.inputs) >= 3 and not n.weights  # a fetch holds them
        if [(w.role, w.key, w.shape, w.experts) for w in n.weights] != \
                [(w.role, w.key, w.shape, w.experts) for w in s.weights] \
                and not streamed:
            out.append(f"node {n.name}'s weight references differ from the model's")
    return out


def file_problems(pf) -> list[str]:
    """Rule K9 over a plan file's plans and options (see the module doc)."""

    out = []
    seqs = {p.max_seq_len for p in pf.plans}
    want = pf.options.max_seq_len
    if len(seqs) != 1 or (want is not None and seqs != {want}) or min(seqs) < 1:
        out.append(f"K9: the plans' max_seq_len {sorted(seqs)} disagree with each other or with the options' {want}")
        return out
    seq = seqs.pop()
    batch = pf.options.max_batch
    if pf.decode.step_tokens != batch:
        out.append(f"K9: the decode plan runs {pf.decode.step_tokens} tokens a step; max_batch is {batch}")
    for p in pf.plans:
        where = f"the {p.phase} plan ({p.step_tokens} tokens/step)"
        if p.phase == "prefill" and not 1 <= p.step_tokens <= seq:
            out.append(f"K9: {where} steps past max_seq_len {seq}")
        try:
            kv = kv_cache_bytes(p.ir, seq * batch)
        except (AttributeError, TypeError, ValueError):
            continue  # the IR rules report the graph
        if abs(kv - p.memory.kv_cache_bytes) > 1e-6 * max(kv, 1.0):
            out.append(f"K9: {where} predicts {p.memory.kv_cache_bytes:.0f} bytes of KV cache; {seq} positions x "
                       f"{batch} sequences need {kv:.0f}")
    return out
