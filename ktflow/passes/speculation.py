"""The compile's decision on speculative decoding with the checkpoint's multi-token-prediction (MTP)
layer (`decide`): how many drafts a step, priced by the cost model (ktflow.costmodel.speculation).

Algorithm: where the options ask for it (speculate 'auto' or k) and the model declares an MTP
layer, the decision is refused with its cause (k = 0, or an error where speculate=k asked for it)
while any precondition fails, the cheap ones first: one sequence a step (max_batch 1 and one
rank: the speculative loop is built for that); a backend that runs the steps eagerly (the
captured CUDA-graph step takes no hidden states yet); for 'auto', acceptance rates by depth (the
option, else the routing profile's, measured by `ktflow profile --mtp`); the layer's weights in
the checkpoint; its plans fitting the memory the main plans leave. The MTP layer is compiled as a
plan file of its own (`compile_part`: the same options, its VRAM what the main plans leave), the
verification step is compiled as a prefill bucket of k + 1 tokens at decode's attention length,
its tokens consecutive (`verify_plan`: routed experts priced with the routing profile's neighbour
co-picks where it has them), and `costmodel.speculation.choose` keeps the k of the largest
predicted gain among k = 1..MAX_DRAFTS (0 unless it passes 1 + MARGIN; speculate=k prices and keeps
that k).

Guarantees: where k >= 1, the returned draft plan file is the compiled MTP layer and the returned
verification plan the bucket the verification steps run on (the compile adds it to the prefill
plans); the choice names every number it compared (`ktflow compile --explain` prints it).
"""

from __future__ import annotations

from typing import Any, Callable

from ..costmodel.speculation import MAX_DRAFTS, SpeculationChoice, choose, off
from ..errors import ConfigError, KtflowError
from ..ir.types import Device
from ..plan.artifact import Plan, PlanFile
from ..plan.options import CompileOptions
from ..util import notices


def decide(model: Any, opts: CompileOptions, device: str, decode: Plan, routing, verify_plan: Callable[[int], Plan],
           compile_part: Callable[[Any, CompileOptions], PlanFile], gpu_left_gb: float | None,
           host_left_gb: float | None = None) -> tuple[SpeculationChoice | None, PlanFile | None, Plan | None]:
    """(the choice, the MTP layer's plan file and the verification plan where k >= 1); all None
    where the model has no MTP layer and speculate is 'auto', or speculate is 0. `verify_plan(t)`
    compiles the verification step over t tokens; `compile_part(model, options)` compiles a part;
    `gpu_left_gb` / `host_left_gb` are the VRAM / host memory the main plans leave (None: no
    limit to share)."""
    asked = opts.speculate
    if asked == 0:
        return None, None, None
    if not model.has_mtp:
        if asked != "auto":
            raise ConfigError(f"speculate={asked}, but {model.path} declares no multi-token-prediction layer "
                              "(num_nextn_predict_layers); leave speculate out")
        return None, None, None

    def refuse(cause: str, *numbers) -> tuple[SpeculationChoice, None, None]:
        if asked != "auto":
            raise ConfigError(f"speculate={asked} cannot be followed: {cause}")
        return off(cause, *numbers), None, None

    if opts.gpus > 1:
        return refuse(f"gpus={opts.gpus}: speculative decoding is built for one rank")
    if opts.max_batch > 1:
        return refuse(f"max_batch {opts.max_batch}: speculative decoding is built for one sequence a step")
    runs_on_gpu = device == "cuda" and any(n.place.device == Device.GPU for n in decode.ir.nodes)
    if runs_on_gpu and opts.backend not in ("native", "torch_ref"):  # (auto there: cuda_graph, as a rule)
        return refuse("the captured CUDA-graph decode step takes no hidden states yet: speculation runs on the "
                      "eager backends (backend='native' or 'torch_ref')")
    if opts.mtp_acceptance is not None:
        acceptance, source = [opts.mtp_acceptance], "the mtp_acceptance option, the same at every depth"
    elif routing is not None and routing.mtp_acceptance:
        acceptance, source = list(routing.mtp_acceptance), "the routing profile"
        if routing.mtp_tokens_per_step:
            source += ", tokens a step from its replayed runs"
    elif asked == "auto":
        return refuse("no acceptance rate to price it with: measure them (`ktflow profile --mtp`, then "
                      "--routing-profile) or give --mtp-acceptance")
    else:  # forced: run without a price
        acceptance, source = None, "none"
    try:
        mtp = model.mtp()
    except KtflowError as e:
        return refuse(f"the checkpoint's MTP layer cannot be read ({e})")
    # the part's VRAM: what the main plans leave (already net of the reserve: none held back again)
    vram = {} if gpu_left_gb is None else dict(vram_gb=max(gpu_left_gb, 1e-3), vram_budget_gb=None, vram_reserve_gb=0.0)
    part_opts = opts.model_copy(update=dict(speculate=0, prefill_buckets=None, routing_profile=None, **vram))
    try:
        draft = compile_part(mtp, part_opts)
    except ConfigError as e:
        return refuse(f"the MTP layer does not fit beside the main plans ({e})", acceptance, source)
    host = max(p.memory.host_bytes for p in draft.plans) / 1e9
    if host_left_gb is not None and host > host_left_gb and not opts.allow_oversize:
        return refuse(f"the MTP layer's plans need {host:.1f} GB of host memory; the main plans leave "
                      f"{max(host_left_gb, 0.0):.1f} GB", acceptance, source)
    ks = range(1, MAX_DRAFTS + 1) if asked == "auto" else (asked,)
    verify = {k: verify_plan(k + 1) for k in ks}
    if acceptance is None:
        choice = SpeculationChoice(k=asked, acceptance=None, acceptance_source=source,
                                   decode_us=decode.predicted_step_us, draft_us=draft.decode.predicted_step_us,
                                   verify_us={asked: verify[asked].predicted_step_us},
                                   cause=f"speculate={asked} asked for it; not priced (no acceptance rate)")
        return choice, draft, verify[asked]
    measured = routing.mtp_tokens_per_step if routing is not None and opts.mtp_acceptance is None else None
    choice = choose(acceptance, source, decode.predicted_step_us, {k: p.predicted_step_us for k, p in verify.items()},
                    draft.decode.predicted_step_us, measured)
    if asked != "auto" and choice.k != asked:
        choice = choice.model_copy(update=dict(k=asked, cause=f"speculate={asked} asked for it; the cost model: "
                                                              f"{choice.cause}"))
    if asked == "auto" and choice.k:
        notices.warn(f"speculative decoding is on: {choice.k} MTP draft(s) a step, {choice.cause} (from {source}); "
                     "plain greedy requests only (no penalty or logit_bias), their tokens plain decoding's; the "
                     "others decode plainly. "
                     "speculate=0 (--speculate 0) turns it off", key="speculate")
    return choice, (draft if choice.k else None), verify.get(choice.k)

