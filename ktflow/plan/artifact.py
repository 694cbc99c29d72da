"""The plan artifact: a versioned pydantic model, saved as JSON.

A `Plan` is one phase (prefill or decode): the placed, costed graph, its ordered instructions
with predicted times, the hardware profile and options it was compiled for, and a memory estimate.
A plan file holds the prefill and the decode plan of one model. Loading checks the file format,
the ktflow version and the model fingerprint, and verifies every plan (ktflow.plan.check: the
graph's IR rules up to lowering, the schedule's and the buffers'), before anything runs it.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..errors import PlanError
from ..util.fsutil import write_atomic
from ..costmodel.hw import HwProfile
from ..costmodel.speculation import SpeculationChoice
from ..ir.graph import Graph
from ..ir.printer import print_graph
from ..ir.types import Buffer
from .check import file_problems, plan_problems
from .options import CompileOptions
from ..version import PLAN_FORMAT, __version__

FILE_FORMAT = "ktflow-plan"


def lane_order(lane: str) -> tuple[int, str]:
    """A sort key for a plan's lanes: GPU compute, copies, fetches, the CPU, then CPU shards by name."""
    return ({"gpu": 0, "copy": 1, "fetch": 2, "cpu": 3}.get(lane, 4), lane)


class Instruction(BaseModel):
    """One instruction on one lane. launch/copy/fetch/submit/sync run their node; record marks
    `event` on its lane after the node that produced a value another lane reads; wait holds its
    lane until `event` is recorded, before the node that reads it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["launch", "copy", "fetch", "submit", "sync", "record", "wait"]
    node: str
    lane: str
    reads: list[str]
    writes: list[str]
    start_us: float
    end_us: float
    event: str | None = None
    #: a measured run's (GPU lane runners): the host's time issuing it, us; the lane's work cannot
    #: start before its issue ends, so issue near the measured span means the host held it back
    issue_us: float | None = None


class ModelInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model_type: str
    fingerprint: str
    path: str
    layers: int


class MemoryEstimate(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    weight_bytes: float  # all weights, both devices
    kv_cache_bytes: float  # for max_seq_len x max_batch, both devices
    activation_bytes: float  # largest live activation set of one step
    workspace_bytes: float = 0.0  # BLAS workspaces: one per GPU compute stream (prefill's, decode's)
    staging_bytes: float = 0.0  # streamed experts: GPU staging buffers and the landing buffer
    #: predicted peak VRAM the run allocates: GPU weights + GPU KV caches + activations + staging + workspaces
    gpu_bytes: float
    host_bytes: float  # predicted host RAM: CPU weights + CPU KV caches + activations


class VramCandidate(BaseModel):
    """One way of sharing the VRAM limit the VRAM plan priced (ktflow.passes.vram_plan)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    design: Literal["none", "reserve", "time-share"]  # decode first; (a) reserved; (b) time-shared
    chunk_tokens: int  # the largest prefill step
    stage_experts: int  # experts a staging buffer holds (0: no staging)
    reserved_bytes: float  # the prefill reservation: activations of the largest step + staging
    residency_bytes: float  # decode residency budget (GPU weights + KV caches)
    decode_us: float  # predicted decode step
    prefill_s: float  # predicted prefill, the mean over the workload's prompts
    prompt_s: dict[int, float] = {}  # predicted prefill of each workload prompt length
    extra_s: float = 0.0  # time-share: the lent experts' restore after a prompt, per request
    request_s: float  # prefill + extra + answer tokens x decode step
    runnable: bool = True
    note: str = ""  # why not runnable (a candidate the options refuse: why)


class VramPlan(BaseModel):
    """How the compile shared the VRAM limit between decode residency and prefill, for which
    workload, against which candidates (the cost model's decision, ktflow.passes.vram_plan)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    limit_bytes: float
    limit_cause: str
    workload: str
    prompts: list[int]  # the workload's prompt lengths, equally likely
    output_tokens: int
    chosen: str
    design: str
    reserved_bytes: float
    residency_bytes: float
    workspace_bytes: float
    chunk_tokens: int
    stage_experts: int
    decode_us: float  # the decode step with the reservation
    decode_us_without: float  # the decode step of the decode-first placement
    prefill_s: dict[int, float]  # each workload prompt's prefill seconds with the reservation
    prefill_s_without: dict[int, float]  # with the decode-first placement
    candidates: list[VramCandidate]
    cause: str

    @property
    def decode_cost(self) -> float:
        """The fraction the reservation lengthens the decode step by."""
        return self.decode_us / self.decode_us_without - 1.0 if self.decode_us_without else 0.0

    def rates(self, seconds: dict[int, float]) -> str:
        """Tokens/s of each workload prompt, "/"-separated ("-" where it was not priced)."""
        return "/".join(f"{p / seconds[p]:.0f}" if seconds.get(p) else "-" for p in self.prompts)

    def table(self) -> str:
        """The decision and its candidates, as `ktflow compile --explain` prints them."""
        gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
        lengths = "/".join(map(str, self.prompts))
        w = max(36, *(len(c.name) + 1 for c in self.candidates))
        chosen = next((c for c in self.candidates if c.name == self.chosen), None)
        refined = f" (refined from {gb(chosen.reserved_bytes)} GB estimated: what its plans need)" \
            if chosen is not None and self.reserved_bytes < chosen.reserved_bytes else ""
        lines = [f"VRAM plan: limit {gb(self.limit_bytes)} GB ({self.limit_cause}); workload {self.workload}",
                 f"  chose {self.chosen}: prefill reservation {gb(self.reserved_bytes)} GB{refined} (staging "
                 f"{self.stage_experts} experts a staging buffer, steps up to {self.chunk_tokens} tokens), decode residency "
                 f"{gb(self.residency_bytes)} GB, workspaces {gb(self.workspace_bytes)} GB",
                 f"  decode step {self.decode_us / 1e3:.2f} ms against {self.decode_us_without / 1e3:.2f} ms decode "
                 f"first ({self.decode_cost:+.1%}, the compiled plans); prefill of {lengths} tokens "
                 f"{self.rates(self.prefill_s)} tok/s against {self.rates(self.prefill_s_without)} (as priced; "
                 "benchmarks/vram_plan.py measures both)",
                 f"  {'candidate (* chosen, - priced only)':{w}s} {'reserve GB':>10s} {'decode ms':>9s} "
                 f"{'prefill tok/s ' + lengths:>22s} {'request s':>9s}"]
        for c in self.candidates:
            mark = "*" if c.name == self.chosen else " " if c.runnable else "-"
            note = ""
            if c.note:
                note = (f"  (copy-back {c.extra_s:.3f} s a prompt; " if c.extra_s else "  (") + c.note + ")"
            request = f"{c.request_s:9.2f}" if c.prefill_s else f"{'-':>9s}"
            lines.append(f"  {mark + c.name:{w}s} {gb(c.reserved_bytes):>10s} {c.decode_us / 1e3:9.2f} "
                         f"{self.rates(c.prompt_s):>22s} {request}{note}")
        return "\n".join(lines) + "\n"


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    phase: Literal["prefill", "decode"]
    device: Literal["cpu", "cuda"]  # the torch device GPU-placed nodes run on (cpu: no GPU present)
    max_seq_len: int
    step_tokens: int  # tokens per step the predictions are for; a prefill plan runs steps of up to this many
    graph: dict
    instructions: list[Instruction]
    predicted_step_us: float
    memory: MemoryEstimate
    pass_seconds: dict[str, float]
    #: (first, last) instruction indices captured as one CUDA graph each: decode, every instruction of
    #: a plan with GPU work; prefill runs eagerly
    capture: list[tuple[int, int]]
    #: decode: the GPU routed-experts nodes whose stacked weights long prompts borrow as their staging
    #: (the VRAM plan's time-share design, backends/lending.py); empty: nothing lent
    lent_experts: tuple[str, ...] = ()
    #: prefill: its staging and landing buffers are the lent experts' memory (restored before the
    #: next plan that does not borrow runs)
    borrows: bool = False

    @cached_property
    def ir(self) -> Graph:
        return Graph.from_dict(self.graph)

    @classmethod
    def of_graph(cls, g: Graph, **fields) -> "Plan":
        """The plan of graph `g` (its JSON form in `graph`), with `ir` already `g` (not read back)."""
        plan = cls(graph=g.to_dict(), **fields)
        plan.__dict__["ir"] = g
        return plan

    def with_graph(self, g: Graph) -> "Plan":
        """This plan over graph `g` (the same nodes with other attrs: its instructions still hold)."""
        plan = self.model_copy(update=dict(graph=g.to_dict()))
        for cached in ("ir", "buffers", "frees"):
            plan.__dict__.pop(cached, None)
        plan.__dict__["ir"] = g
        return plan

    @cached_property
    def buffers(self) -> dict[str, Buffer]:
        """Where each value of the step lives (the buffer pass's `Node.buffer`), in graph order."""
        return {n.name: n.buffer for n in self.ir.nodes if n.buffer is not None}

    def arena_bytes(self, tokens: int | None = None) -> dict[str, int]:
        """Bytes of each arena in a step of `tokens` tokens (default: the plan's step_tokens)."""
        t = self.step_tokens if tokens is None else tokens
        out: dict[str, int] = {}
        for buf in self.buffers.values():
            off, size = buf.span(t)
            out[buf.arena] = max(out.get(buf.arena, 0), off + size)
        return out

    @cached_property
    def frees(self) -> list[list[str]]:
        """The values no instruction reads after instruction i (graph outputs are kept): what a runner
        drops then."""
        last: dict[str, int] = {}
        for i, s in enumerate(self.instructions):
            for r in s.reads:
                last[r] = i
        out: list[list[str]] = [[] for _ in self.instructions]
        outputs = set(self.ir.outputs)
        for name, i in last.items():
            if name not in outputs:
                out[i].append(name)
        return out

    def as_text(self) -> str:
        lines = [f"plan {self.phase} (GPU nodes on {self.device}): {len(self.instructions)} instructions, "
                 f"{self.step_tokens} tokens/step, predicted {self.predicted_step_us:.1f} us/step, "
                 f"max_seq_len {self.max_seq_len}"
                 + (f"; lends {', '.join(self.lent_experts)} as long prompts' staging" if self.lent_experts else "")
                 + ("; stages in the lent experts' memory" if self.borrows else "")]
        lines.append(print_graph(self.ir).rstrip("\n"))
        lines.append("instructions:")
        for i, s in enumerate(self.instructions):
            ev = f"  [{s.event}]" if s.event else ""
            lines.append(f"  {i:4d} {s.kind:6s} {s.lane:5s} {s.node:28s} {s.start_us:12.1f} .. {s.end_us:12.1f} us{ev}")
        lines.append("buffers: " + ", ".join(f"{a} {n / 1e6:.2f} MB" for a, n in sorted(self.arena_bytes().items()))
                     + f"; capture regions: {self.capture or 'none (eager)'}")
        return "\n".join(lines) + "\n"


def rank_summary(plan: "Plan", rank: int, ranks: int) -> str:
    """One line: this rank's share of a plan over several GPU ranks (its routed experts on the GPU
    and on the CPU, which it drives) and what its all-reduces cost the step, predicted."""
    gpu = cpu = 0
    reduces, us = 0, 0.0
    for n in plan.ir.nodes:
        if n.op.value == "routed_experts":
            if n.place.device.value == "gpu":
                gpu += len(n.attrs.ids)
            elif n.place.numa in (None, 0) or not n.attrs.inter_slice:
                cpu += len(n.attrs.ids)
        elif n.op.value == "collective":
            reduces += 1
            us += n.timing.end_us - n.timing.start_us if n.timing else 0.0
    return (f"ranks: rank {rank} of {ranks}: {gpu} routed experts on its GPU, {cpu} on the CPU (driven here); "
            f"{reduces} all-reduces, {us / 1e3:.3f} ms of the {plan.predicted_step_us / 1e3:.3f} ms step")


def prefill_decisions(plan: "Plan") -> str:
    """Where a prefill plan computes each MoE layer's CPU-side routed experts, compactly: runs of
    layers with the same decision (cpu, stream, split with n of N streamed, or gpu where every
    expert of the layer is resident there)."""
    from ..ir.ops import Op

    g = plan.ir
    per_layer: dict[int, list] = {}
    for n in g.nodes:
        if n.op == Op.ROUTED_EXPERTS:
            per_layer.setdefault(n.attrs.layer, []).append(n)
    words = []
    for layer, nodes in sorted(per_layer.items()):
        cpu = sum(len(n.attrs.ids) for n in nodes if n.place.device.value == "cpu" and n.attrs.rows[0] == 0)
        streamed = sum(len(n.attrs.ids) for n in nodes if len(n.inputs) >= 3)
        words.append((layer, "gpu" if not cpu and not streamed else "cpu" if not streamed
                      else "stream" if not cpu else f"split {streamed}/{cpu + streamed}"))
    runs: list[list] = []
    for layer, w in words:
        if runs and runs[-1][2] == w and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, w])
    return ", ".join(f"L{a}{'' if a == b else f'-{b}'} {w}" for a, b, w in runs) or "no routed experts"


def prefill_table(pf: "PlanFile") -> str:
    """Per prefill bucket: its predicted step, and for each routed-experts node and fetch where
    it runs and why (the times the compiler compared)."""
    from ..ir.ops import Op

    lines = ["prefill buckets (routed experts; longer prompts run as chunks of the last bucket)"]
    for plan in pf.prefill:
        rate = plan.step_tokens / plan.predicted_step_us * 1e6 if plan.predicted_step_us else 0.0
        lines.append(f"  up to {plan.step_tokens} tokens: predicted {plan.predicted_step_us / 1e3:.3f} ms/step "
                     f"({rate:.0f} tokens/s); {prefill_decisions(plan)}")
        for n in plan.ir.nodes:
            if n.op in (Op.ROUTED_EXPERTS, Op.FETCH, Op.REDUCE) and n.place.cause:
                lines.append(f"    {n.name:24s} {n.place.device.value:4s} {n.place.cause}")
    return "\n".join(lines) + "\n"


def placement_table(plan: "Plan") -> str:
    """One row per node: where it runs, its weights, its predicted time there, and why."""
    from ..ir.types import _si

    g = plan.ir
    rows = [("node", "op", "device", "weights", "time", "cause")]
    for n in g.nodes:
        t = n.cost.on(n.place.device) if n.cost is not None else 0.0
        rows.append((n.name, n.op.value, n.place.device.value, f"{_si(n.weight_elems())}", f"{_si(t)}s",
                     n.place.cause))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"placement ({plan.phase} plan; weights in elements, time per {plan.step_tokens}-token step on its device)"]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths, strict=True)) + "  " + r[5])
    m = plan.memory
    lines.append(f"  predicted peak VRAM {m.gpu_bytes / 1e9:.2f} GB, host RAM {m.host_bytes / 1e9:.2f} GB")
    return "\n".join(lines) + "\n"


class PlanFile(BaseModel):
    """What `ktflow compile -o plan.json` writes: prefill plans for buckets of prompt length
    (ascending step_tokens; a longer prompt runs as chunks of the last) and the decode plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    format: Literal["ktflow-plan"] = FILE_FORMAT
    format_version: int = PLAN_FORMAT
    ktflow_version: str = __version__
    model: ModelInfo
    hw: HwProfile
    options: CompileOptions
    prefill: list[Plan]
    decode: Plan
    #: the passes that made the plans, in order, as `module:function` (custom ones included)
    pipeline: list[str] = []
    #: how the VRAM limit was shared between decode residency and prefill (None: no GPU to share)
    vram: VramPlan | None = None
    #: the decision on speculative decoding (None: the model has no MTP layer, or speculate=0)
    speculation: SpeculationChoice | None = None
    #: the MTP layer's own plans, the draft of speculative decoding (where speculation.k >= 1)
    draft: "PlanFile | None" = None

    @property
    def plans(self) -> list[Plan]:
        return [*self.prefill, self.decode]

    def prefill_for(self, tokens: int) -> Plan:
        """The plan of the smallest bucket holding a step of `tokens` tokens (else the largest)."""
        for plan in self.prefill:
            if tokens <= plan.step_tokens:
                return plan
        return self.prefill[-1]

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.model_dump_json(indent=1))

    @staticmethod
    def load(path: str | os.PathLike, fingerprint: str | None = None) -> "PlanFile":
        p = Path(path)
        if p.exists() and not p.is_file() and not p.is_dir():
            raise PlanError(f"plan file {p} is not a regular file (a FIFO or device); give the JSON file "
                            "`ktflow compile -o` wrote")
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise PlanError(f"plan file {p} does not exist") from None
        except IsADirectoryError:
            raise PlanError(f"plan file {p} is a directory; give the JSON file `ktflow compile -o` wrote") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise PlanError(f"plan file {p} is not JSON ({str(e) or type(e).__name__})") from None
        if not isinstance(raw, dict) or raw.get("format") != FILE_FORMAT:
            raise PlanError(f"{p} is not a ktflow plan file")
        if raw.get("format_version") != PLAN_FORMAT or raw.get("ktflow_version") != __version__:
            raise PlanError(f"{p} was written by ktflow {raw.get('ktflow_version')} (plan format "
                            f"{raw.get('format_version')}); this is ktflow {__version__} (plan format {PLAN_FORMAT}). "
                            "Recompile it with `ktflow compile`.")
        try:
            pf = PlanFile.model_validate(raw)
        except Exception as e:
            raise PlanError(f"plan file {p} is malformed: {e}") from None
        if not pf.prefill or [b.step_tokens for b in pf.prefill] != sorted({b.step_tokens for b in pf.prefill}):
            raise PlanError(f"plan file {p} is malformed: its prefill plans must have ascending, distinct step_tokens")
        for part, plans in (("", pf), ("draft's ", pf.draft)):
            for plan in plans.plans if plans is not None else ():
                problems = plan_problems(plan)
                if problems:
                    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                    raise PlanError(f"plan file {p}: its {part}{plan.phase} plan ({plan.step_tokens} tokens/step) fails "
                                    f"verification: {problems[0]}{more}. Recompile it with `ktflow compile`.")
        if (pf.draft is None) != (pf.speculation is None or pf.speculation.k == 0):
            raise PlanError(f"plan file {p} is malformed: its draft plans and its speculation disagree (a plan file "
                            "holds the MTP layer's plans exactly where its speculation keeps k >= 1)")
        problems = (file_problems(pf) + file_problems(pf.draft)) if pf.draft is not None else file_problems(pf)
        if problems:
            raise PlanError(f"plan file {p} fails verification: {problems[0]}. Recompile it with `ktflow compile`.")
        if fingerprint is not None:
            pf.require_model(fingerprint, p)
        return pf

    def require_model(self, fingerprint: str, where: str | os.PathLike) -> None:
        """A PlanError unless the plan was compiled for the model with this config fingerprint."""
        if self.model.fingerprint != fingerprint:
            raise PlanError(f"{where} was compiled for another model ({self.model.model_type} at {self.model.path}, "
                            f"config fingerprint {self.model.fingerprint}); this model's fingerprint is {fingerprint}. "
                            "Recompile the plan for this model.")

    def summary(self) -> str:
        m = self.model
        out = [f"ktflow plan (format {self.format_version}, ktflow {self.ktflow_version})",
               f"model     {m.model_type}, {m.layers} layers, fingerprint {m.fingerprint}, from {m.path}",
               f"hardware  {self.hw.name}: {self.hw.cpu.name}"
               + (f" + {', '.join(g.name for g in self.hw.gpus)}" if self.hw.gpus else ""),
               "options   " + ", ".join(f"{k}={v}" for k, v in self.options.model_dump().items())]
        if self.vram is not None:
            v = self.vram
            out.append(f"vram      limit {v.limit_bytes / 1e9:.2f} GB ({v.limit_cause}); {v.chosen}: prefill reserve "
                       f"{v.reserved_bytes / 1e9:.2f} GB, decode residency {v.residency_bytes / 1e9:.2f} GB; decode "
                       f"{v.decode_cost:+.1%}, prefill of {'/'.join(map(str, v.prompts))} tokens "
                       f"{v.rates(v.prefill_s)} tok/s against {v.rates(v.prefill_s_without)} decode first (workload "
                       f"{v.workload.split(':')[0]}; --explain shows the candidates)")
        if self.speculation is not None:
            sp = self.speculation
            draft = f"; draft (MTP layer) decode step {self.draft.decode.predicted_step_us / 1e3:.2f} ms" \
                if self.draft is not None else ""
            out.append(f"speculate k={sp.k}: {sp.cause}{draft}")
        builtin = all(p.startswith("ktflow.passes.") for p in self.pipeline)
        if self.pipeline and not builtin:  # a plan made with custom passes says so
            out.append("pipeline  " + " -> ".join(self.pipeline))
        for plan in self.plans:
            g = plan.ir
            ops: dict[str, int] = {}
            for n in g.nodes:
                ops[n.op.value] = ops.get(n.op.value, 0) + 1
            mem = plan.memory
            on_gpu = sum(1 for n in g.nodes if n.place.device.value == "gpu")
            n_ins = len(plan.instructions)
            out.append(f"{plan.phase:8s}  {n_ins} instructions, {len(g.nodes)} nodes ({on_gpu} GPU, "
                       f"{len(g.nodes) - on_gpu} CPU; GPU nodes "
                       f"run on {plan.device}), max_seq_len {plan.max_seq_len}, {plan.step_tokens} tokens/step, "
                       f"predicted {plan.predicted_step_us / 1e3:.3f} ms/step "
                       f"({plan.step_tokens / max(plan.predicted_step_us, 1e-9) * 1e6:.1f} tokens/s)")
            out.append(f"          memory: weights {mem.weight_bytes / 1e9:.2f} GB, KV cache {mem.kv_cache_bytes / 1e9:.3f} GB, "
                       f"activations {mem.activation_bytes / 1e6:.1f} MB, BLAS workspaces {mem.workspace_bytes / 1e6:.0f} MB"
                       + (f", staging {mem.staging_bytes / 1e9:.2f} GB" if mem.staging_bytes else "")
                       + f"; peak VRAM {mem.gpu_bytes / 1e9:.2f} GB, host RAM {mem.host_bytes / 1e9:.2f} GB")
            if plan.phase == "prefill":
                out.append("          experts: " + prefill_decisions(plan)
                           + ("; staging in the lent experts' memory (time-share)" if plan.borrows else ""))
            if plan.lent_experts:
                out.append(f"          lends {', '.join(plan.lent_experts)} to long prompts' staging, restored after them")
            if self.options.gpus > 1:
                out.append("          " + rank_summary(plan, self.options.rank, self.options.gpus))
            out.append("          ops: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
        return "\n".join(out) + "\n"
