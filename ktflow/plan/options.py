"""Compile options and the context passes receive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..costmodel.routing import RoutingProfile
from ..costmodel.hw import HwProfile
from ..costmodel.speculation import MAX_DRAFTS


#: the backends a plan may name (backends.BACKENDS registers one class for each: a test checks
#: the two agree), so that options are checked without importing the backends and torch
BACKEND_NAMES = ("torch_ref", "native", "cuda_graph", "null")


class CompileOptions(BaseModel):
    """What `ktflow.compile(model, hw, **options)` accepts. Unknown options are an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int | None = Field(None, gt=0, description="KV cache length; default min(4096, max_position_embeddings)")
    max_batch: int = Field(1, gt=0, description="largest batch the memory budget is planned for")
    greedy_steps: int = Field(8, ge=1, le=64, description="greedy decode steps `generate` runs per call of the "
                              "decode plan: a CUDA-graph plan runs them as one graph launch, each step's argmax "
                              "fed to the next on the GPU (the host's turnaround and the launch, about 0.4-0.6 ms "
                              "a token on the GPU machine, paid once per that many tokens; up to that many - 1 "
                              "steps run past an end-of-sequence token); 1: one step per launch")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="activation/compute dtype; default the checkpoint's")
    backend: str = Field("auto", description="backend that runs the plan's instructions: torch_ref, native (CPU experts "
                         "on the C++ kernels), cuda_graph (native experts, each decode step one CUDA graph) or null; "
                         "auto = cuda_graph (GPU on CUDA) or native (no GPU) for bfloat16 plans where the native "
                         "module is built, else torch_ref")
    expert_format: Literal["auto", "bf16", "int8", "int4", "fp8"] = Field(
        "auto", description="weight format of CPU routed experts in the native backend: bf16, int8 (per output "
        "channel), int4 (groups of 128), fp8 (e4m3 in 128-column groups: an FP8 release's own bytes and scales); "
        "auto = fp8 for an FP8 checkpoint, else bf16 (compile writes the one it chose into the plan)")
    fp8_on_gpu: Literal["auto", "keep", "dequantize"] = Field(
        "auto", description="an FP8 checkpoint's weights on the GPU, dense ones (attention, dense and "
        "shared-expert MLPs) and routed experts: keep (as stored, 1 byte per weight with 128x128 block scales: "
        "the FP8 kernels multiply dense ones, experts are dequantized into a temporary per step), dequantize (to "
        "the activation dtype at load: cuBLAS, faster at most shapes) or auto (dense weights: dequantize while "
        "they fit the VRAM budget that way, else keep them all in FP8; routed experts: dequantize where every one "
        "fits the budget that way, else keep the GPU ones in FP8, about twice as many in the same VRAM); with "
        "expert_cache the experts are dequantized; the plan records the choice per weight")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where GPU-placed nodes run: cuda, or cpu (the same hybrid plan on a machine without "
        "a GPU); auto = cuda when torch sees one")
    placement: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="auto: by the cost model under the VRAM budget; cpu / gpu: every node there "
        "(baselines; gpu must fit the budget)")
    defer: int | list[int] | Literal["auto"] | None = Field(
        None, description="Expert Deferral in decode plans: deferred picks per token for every MoE layer but "
        "the last, a list with one entry per MoE layer, or 'auto' (the candidate the cost model predicts fastest); None = no deferral")
    numa: Literal["auto", "tp", "ep"] = Field(
        "auto", description="how CPU experts split over NUMA nodes: tp (each node a slice of every expert), "
        "ep (whole experts per node), auto (the cheaper by the cost model; ties go to tp)")
    numa_nodes: int | None = Field(None, gt=0, description="NUMA node count (default: the profile's)")
    numa_block: int = Field(64, gt=0, description="tp slices are multiples of this many intermediate rows")
    vram_gb: float | None = Field(None, gt=0, description="GPU memory the whole run may use, as the card counts it: "
                                  "the CUDA context and the allocator's slack (vram_reserve_gb) and every plan's "
                                  "resident weights, KV caches, prefill staging, activations and BLAS workspaces fit "
                                  "in it; default the profile GPU's memory")
    vram_budget_gb: float | None = Field(None, gt=0, description="a cap on decode residency (GPU weights and KV caches) "
                                         "inside vram_gb; default: what vram_gb leaves after the VRAM plan's prefill "
                                         "reservation and the BLAS workspaces")
    vram_reserve_gb: float = Field(2.5, ge=0, description="GPU memory of vram_gb no plan uses (the CUDA context, "
                                   "about 0.8 GB, and the caching allocator's slack: up to 1.4 GB above the "
                                   "allocated peak measured at a 24 GB limit): the plans' tensors get vram_gb less "
                                   "this")
    prefill_tokens: int = Field(512, gt=0, description="the smallest prefill step the VRAM plan always leaves "
                                "activations room for (prefill_reserve='none' reserves this and nothing more)")
    prefill_reserve: Literal["auto", "none", "reserve", "time-share"] = Field(
        "auto", description="how VRAM is shared between decode residency and prefill (ktflow.passes.vram_plan): auto = the "
        "cost model chooses between decode first and the two designs where that shortens the declared workload's "
        "requests; reserve = a bucket's activations and staging buffers reserved; time-share = a bucket's "
        "activations reserved, long prompts staging in resident experts lent to them and restored after; none = "
        "decode residency first, prefill gets what is left (long prompts may stay on the CPU)")
    workload: Literal["agent", "chat"] = Field(
        "agent", description="the requests the VRAM plan is priced for: agent = prompts of 8k, 16k and 32k tokens "
        "alike and 500-token answers, chat = 1024-token prompts and 300-token answers (prompts capped at max_seq_len "
        "less the answer)")
    workload_prompt_tokens: int | None = Field(None, gt=0, description="expected prompt length; overrides the "
                                               "workload's prompts")
    workload_output_tokens: int | None = Field(None, ge=0, description="expected answer length (decoded tokens); "
                                               "overrides the workload's")
    prefill_buckets: list[int] | None = Field(
        None, description="upper bounds (tokens per step) of the prefill plans; None: chosen where the compiler's "
        "decisions change, over powers of two up to max_seq_len")
    prefill_experts: Literal["auto", "cpu", "stream", "split"] = Field(
        "auto", description="where prefill computes the routed experts the decode placement left on the CPU: cpu, "
        "stream (weights copied to GPU staging buffers, computed there), split (some streamed, the rest on the "
        "CPU, sized to finish together) or auto (per layer and bucket, the fastest by the cost model)")
    prefill_chunk: int | None = Field(
        None, gt=0, description="most tokens one prefill step processes (longer prompts run as chunks); None: the "
        "most whose activations fit the GPU")
    staging_buffers: int = Field(2, ge=1, le=8, description="GPU staging buffers for streamed experts: with 2 or more "
                               "the copy of layer j+1's experts overlaps layer j's compute")
    staging_experts: int | None = Field(None, gt=0, description="most experts one staging buffer holds (a layer with "
                                        "more streams as several fetches); None: the VRAM plan's choice")
    routing_profile: str | None = Field(None, description="routing profile JSON (per-layer expert frequencies)")
    expert_cache: bool = Field(False, description="a split layer's GPU experts are a cache: the runtime refills "
                               "them from recent routing (ktflow.runtime.expert_cache), so the layer's CPU part "
                               "holds every expert, computing those the cache does not")
    gpus: int = Field(1, ge=1, description="GPUs the plans spread over (gpu:0..gpus-1 of the hardware profile, one "
                      "process each: `ktflow run --gpus N` starts them): dense work replicated on every rank, the GPU "
                      "routed experts divided between the ranks (expert parallel, the most valuable first, each on "
                      "the rank with the most room), one all-reduce a MoE layer sums the ranks' parts; rank 0 drives "
                      "the CPU experts (one copy in host memory). vram_gb and the budgets are per GPU")
    rank: int = Field(0, ge=0, description="the rank (0..gpus-1) whose plans these are: every rank's plans are the "
                      "same graph with its own experts and the same collectives")
    speculate: Literal["auto"] | int = Field(
        "auto", description="speculative decoding with the checkpoint's multi-token-prediction (MTP) layer: k chained "
        "MTP drafts a step, verified in one step of the model (0: off; 1..4) or auto (the k the cost model predicts "
        "fastest, where the MTP layer, acceptance rates and a runtime that runs it are there; `--explain` says why). "
        "Plain greedy requests only (no penalty or logit_bias), their tokens plain decoding's (the others "
        "decode plainly: the rejection rule's work is not priced)")
    mtp_acceptance: float | None = Field(None, gt=0, lt=1, description="the MTP drafts' acceptance rate the "
                                         "speculation is priced with, the same at every depth; default: the "
                                         "routing profile's rates by depth (`ktflow profile --mtp` measures them)")
    allow_oversize: bool = Field(False, description="compile even where a plan's predicted GPU or host memory "
                                 "exceeds the hardware profile's (a plan for another machine); default: an error "
                                 "with the numbers")

    @model_validator(mode="after")
    def _rank_in_range(self):
        if self.rank >= self.gpus:
            raise ValueError(f"rank={self.rank} is not one of the {self.gpus} ranks (0..{self.gpus - 1})")
        return self

    @field_validator("speculate")
    @classmethod
    def _drafts(cls, v):
        if v != "auto" and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DRAFTS):
            raise ValueError(f"speculate must be 'auto', 0 (off) or 1..{MAX_DRAFTS} (chained MTP drafts a step), "
                             f"got {v!r}")
        return v

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v != "auto" and v not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {v!r}; available: auto, {', '.join(BACKEND_NAMES)}")
        return v


#: the workloads `CompileOptions.workload` names: (prompt lengths, equally likely; answer tokens)
WORKLOADS = {"agent": ((8192, 16384, 32768), 500), "chat": ((1024,), 300)}


@dataclass(frozen=True)
class VramShare:
    """The VRAM plan's decision as the passes read it: the limit every plan fits in, the bytes of
    it decode residency (GPU weights and KV caches) may take, the most experts one staging buffer
    holds (None: no cap) and the most tokens one prefill step takes."""

    limit: float
    residency: float
    stage_experts: int | None
    chunk_tokens: int
    #: time-share (design b): prefill steps of at least `lend_tokens` tokens take these layers'
    #: resident experts (whole layers decode holds, `lend_bytes` of VRAM) as their staging: they
    #: stream those layers, and the runtime restores the experts after (backends/lending.py)
    lend_layers: tuple[int, ...] = ()
    lend_tokens: int = 0
    lend_bytes: float = 0.0


def vram_limit(options: CompileOptions, hw: HwProfile) -> float:
    """Bytes of GPU memory a run's plans may allocate: option vram_gb (the run's VRAM, as the card
    counts it; default the profile GPU's memory) less vram_reserve_gb, which the CUDA context and
    the allocator's slack take (0 without a GPU)."""
    if not hw.gpus:
        return 0.0
    card = options.vram_gb * 1e9 if options.vram_gb is not None else hw.gpus[0].memory_bytes
    return card - options.vram_reserve_gb * 1e9


@dataclass(frozen=True)
class CompileContext:
    """Read-only inputs of every pass: hardware, options, and the step the plan is for."""

    hw: HwProfile
    options: CompileOptions
    phase: Literal["prefill", "decode"]
    tokens: int  # tokens per step (all rows)
    batch: int
    context: int  # average attended positions per token
    weight_itemsize: int
    max_seq_len: int
    device: Literal["cpu", "cuda"]
    routing: RoutingProfile | None = None
    fp8_block: tuple[int, int] | None = None  # an FP8 checkpoint's scale block (quantization_config)
    #: why this deferral (compile's defer="auto" search names the candidates it compared); the
    #: defer pass writes it into its nodes' causes
    defer_choice: str = ""
    #: how the compile driver shared the VRAM limit between phases (ktflow.passes.vram_plan); None: a
    #: context built by hand, whose passes fall back to the options (`residency_budget`)
    vram: VramShare | None = None
    #: the step's tokens are one sequence's consecutive ones (a speculative verification step):
    #: routed experts are priced with the routing profile's neighbour co-picks where it has them
    consecutive: bool = False

    @property
    def lends(self) -> bool:
        """A prefill step that takes the VRAM plan's lent layers' resident experts as staging (not a
        speculative verification step: it runs between decode steps)."""
        v = self.vram
        return (self.phase == "prefill" and not self.consecutive and v is not None and bool(v.lend_layers)
                and self.tokens >= v.lend_tokens)

    @property
    def label(self) -> str:
        """The plan's name in messages and dumps: decode, or prefill<tokens> (one per bucket)."""
        return "decode" if self.phase == "decode" else f"prefill{self.tokens}"

    @property
    def expert_format(self) -> str:
        """The CPU experts' format (compile resolves "auto" by the checkpoint; a context built by
        hand with "auto" gets bf16)."""
        fmt = self.options.expert_format
        return "bf16" if fmt == "auto" else fmt

    @property
    def numa_nodes(self) -> int:
        return self.options.numa_nodes or len(self.hw.cpu.numa)
