"""The compile options as command-line flags: `add_compile_options` puts them on a parser,
`options` reads them back as ktflow.compile keyword arguments, `pass_edits` the pass-pipeline
edits, `flags_given` the ones set to other than their defaults."""

from __future__ import annotations

import argparse


def options(a: argparse.Namespace) -> dict:
    opts = dict(max_seq_len=a.max_seq_len, max_batch=a.max_batch, dtype=a.dtype, device=a.device, backend=a.backend,
                expert_format=a.expert_format, fp8_on_gpu=a.fp8_on_gpu,
                placement=a.placement, vram_gb=a.vram_gb, vram_budget_gb=a.vram_budget_gb,
                vram_reserve_gb=a.vram_reserve_gb, workload=a.workload, workload_prompt_tokens=a.workload_prompt_tokens,
                workload_output_tokens=a.workload_output_tokens, prefill_reserve=a.prefill_reserve,
                numa=a.numa, numa_nodes=a.numa_nodes,
                prefill_experts=a.prefill_experts, prefill_chunk=a.prefill_chunk, staging_buffers=a.staging_buffers,
                staging_experts=a.staging_experts,
                greedy_steps=a.greedy_steps, allow_oversize=a.allow_oversize, gpus=a.gpus, rank=a.rank)
    if a.prefill_buckets:
        from ktflow.errors import ConfigError

        try:
            opts["prefill_buckets"] = [int(x) for x in a.prefill_buckets.split(",")]
        except ValueError:
            raise ConfigError(f"--prefill-buckets must be a comma list of token counts, got {a.prefill_buckets!r}") from None
    if getattr(a, "routing_profile", None):
        opts["routing_profile"] = a.routing_profile
    if a.refill_every is not None:
        from ktflow.errors import ConfigError

        if not a.expert_cache:
            raise ConfigError("--refill-every sets the expert cache's refill interval: add --expert-cache")
        if a.refill_every < 1:
            raise ConfigError(f"--refill-every takes the decoded tokens between refills (>= 1), got {a.refill_every}")
    if a.expert_cache:
        opts["expert_cache"] = True
    if a.defer is not None:
        from ktflow.errors import ConfigError

        try:
            opts["defer"] = "auto" if a.defer == "auto" else (
                [int(x) for x in a.defer.split(",")] if "," in a.defer else int(a.defer))
        except ValueError:
            raise ConfigError(f"--defer must be a number, a comma list of numbers, or auto; got {a.defer!r}") from None
    if a.speculate != "auto":
        from ktflow.errors import ConfigError

        try:  # (its range: CompileOptions')
            opts["speculate"] = int(a.speculate)
        except ValueError:
            raise ConfigError(f"--speculate takes auto or a number of chained MTP drafts a step (0: off), got "
                              f"{a.speculate!r}") from None
    if a.mtp_acceptance is not None:
        opts["mtp_acceptance"] = a.mtp_acceptance
    edits = pass_edits(a)
    if edits:
        opts["passes"] = edits
    return opts


def pass_edits(a: argparse.Namespace) -> list:
    """--pass MODULE:FN[@after=|before=|replace=PASS] and --drop-pass PASS as pipeline edits."""
    from ktflow.errors import ConfigError
    from ktflow.passes import WHERE, load_pass

    edits = []
    for spec in getattr(a, "passes", None) or []:
        target, _, where = spec.partition("@")
        kind, _, name = where.partition("=") if where else ("before", "=", "lower")
        if kind not in WHERE[:3] or not name:
            raise ConfigError(f"--pass {spec!r}: the position must be @after=PASS, @before=PASS or @replace=PASS")
        edits.append((f"{kind}:{name}", load_pass(target)))
    edits += [(f"drop:{name}", None) for name in getattr(a, "drop_pass", None) or []]
    return edits


def flags_given(a: argparse.Namespace) -> list[str]:
    """The compile options on the command line that differ from their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    add_compile_options(probe)
    return [act.option_strings[0] for act in probe._actions
            if act.option_strings and getattr(a, act.dest, act.default) != act.default]


def add_compile_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compile options")
    g.add_argument("--hw", default=None, help="hardware profile: a preset (cpu, rtx4090-desktop), 'this' "
                   "(detect this machine; the default), or a profile JSON path")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="KV cache length (default: min(4096, max_position_embeddings))")
    g.add_argument("--max-batch", type=int, default=1, help="largest batch planned for (default 1)")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: the checkpoint's)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where GPU-placed nodes run: cuda, or cpu to run a hybrid plan without a GPU "
                   "(default auto: cuda when torch sees one)")
    g.add_argument("--backend", default="auto", help="backend for the plan's instructions: torch_ref, native, cuda_graph "
                   "or null (default auto, for bfloat16 plans where the native module is built: cuda_graph when GPU "
                   "nodes run on CUDA, else native; torch_ref otherwise)")
    g.add_argument("--expert-format", default="auto", choices=["auto", "bf16", "int8", "int4", "fp8"],
                   help="weight format of CPU routed experts in the native backend: bf16, int8, int4, or fp8 (e4m3 "
                   "with 128-column scales); default auto: fp8 for an FP8 checkpoint (its own bytes), else bf16")
    g.add_argument("--fp8-on-gpu", choices=["auto", "keep", "dequantize"], default="auto",
                   help="an FP8 checkpoint's dense weights on the GPU: keep (as stored, 1 byte per weight, FP8 "
                   "kernels), dequantize (to the compute dtype at load: cuBLAS), or auto (dequantize while the dense "
                   "weights fit the VRAM budget that way, else keep them in FP8; default)")
    g.add_argument("--placement", choices=["auto", "cpu", "gpu"], default="auto",
                   help="auto: by the cost model under the VRAM budget (default); cpu / gpu: everything there")
    g.add_argument("--defer", default=None, metavar="D",
                   help="Expert Deferral in decode: a number of deferred picks per MoE layer, a comma list (one per "
                   "MoE layer), or auto")
    g.add_argument("--numa", choices=["auto", "tp", "ep"], default="auto",
                   help="split CPU experts over NUMA nodes: tp (slices of every expert), ep (whole experts), "
                   "auto (the cheaper by the cost model)")
    g.add_argument("--numa-nodes", type=int, default=None, help="NUMA node count (default: the profile's)")
    g.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="spread the plans over N GPUs of the profile (default 1): dense work on every GPU, the GPU "
                   "routed experts divided between them, one all-reduce a MoE layer; `run --gpus N` starts one process "
                   "a GPU (without GPUs: two ranks over gloo on the CPU, with --device cpu and a profile of N GPUs)")
    g.add_argument("--rank", type=int, default=0, metavar="R",
                   help="with --gpus: which rank's plans to compile (default 0; `run` sets each process's)")
    g.add_argument("--vram-gb", type=float, default=None, metavar="GB",
                   help="GPU memory the whole run may use: resident experts and other weights, KV caches, prefill "
                   "staging, activations and BLAS workspaces of every plan fit in it (default: the GPU's memory less "
                   "--vram-reserve-gb). The VRAM plan shares it between decode residency and prefill for the "
                   "--workload; `--explain` shows the trade")
    g.add_argument("--vram-reserve-gb", type=float, default=2.5, metavar="GB",
                   help="GPU memory of --vram-gb no plan allocates: the CUDA context (about 0.8 GB) and the caching "
                   "allocator's slack (default 2.5)")
    g.add_argument("--vram-budget-gb", type=float, default=None, metavar="GB",
                   help="cap decode residency (GPU weights and KV caches) inside --vram-gb (default: what the VRAM "
                   "plan leaves after its prefill reservation)")
    g.add_argument("--workload", choices=["agent", "chat"], default="agent",
                   help="the requests the VRAM plan is priced for: agent (prompts of 8k, 16k and 32k tokens alike, "
                   "500-token answers; default) or chat (1024-token prompts, 300-token answers)")
    g.add_argument("--workload-prompt-tokens", type=int, default=None, metavar="N",
                   help="expected prompt length (overrides the workload's)")
    g.add_argument("--workload-output-tokens", type=int, default=None, metavar="N",
                   help="expected answer length in tokens (overrides the workload's)")
    g.add_argument("--prefill-reserve", choices=["auto", "none", "reserve", "time-share"], default="auto",
                   help="auto: the cost model picks how VRAM is shared for the workload (default); reserve: a "
                   "bucket's activations and staging buffers reserved; time-share: a bucket's activations "
                   "reserved, long prompts stage in resident experts lent to them and restored after; none: "
                   "decode residency first, long prompts get what is left")
    g.add_argument("--prefill-experts", choices=["auto", "cpu", "stream", "split"], default="auto",
                   help="prefill: where the routed experts the decode placement left on the CPU compute: cpu, stream "
                   "(copied to GPU staging buffers), split (both, sized to finish together) or auto (the fastest per "
                   "layer and prompt-length bucket by the cost model; default)")
    g.add_argument("--expert-cache", action="store_true",
                   help="the GPU experts of each layer the placement splits may be a cache that follows the routing "
                   "(run, serve): refilled after each prompt and every few decoded tokens with the experts picked "
                   "most since the last refill, the copies behind the decode steps. The placement pass prices it "
                   "per layer from the routing profile's cache curves (`ktflow profile`): how many GPU rows each layer "
                   "gets, whether a cache beats static experts there, and the refill interval. The CPU holds every "
                   "expert of a cached layer; a long prompt streams such a layer whole to the GPU where the prefill pass "
                   "prices it faster. `run` ends with what the "
                   "cache did: its hit share, the bytes it copied and the host's time a decoded token")
    g.add_argument("--refill-every", type=int, default=None, metavar="N",
                   help="with --expert-cache: the layers the plan caches are refilled every N decoded tokens instead "
                   "of at the plan's intervals (layers it priced static stay static)")
    g.add_argument("--prefill-buckets", default=None, metavar="N,N,...",
                   help="prefill plans for steps of up to these many tokens (default: chosen where the decisions "
                   "change, over powers of two up to max_seq_len)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="most tokens one prefill step runs; longer prompts run as chunks (default: the most whose "
                   "activations and staging fit the GPU)")
    g.add_argument("--staging-buffers", type=int, default=2,
                   help="GPU staging buffers for streamed experts (2 or more: the next layer's copy overlaps this one)")
    g.add_argument("--staging-experts", type=int, default=None, metavar="N",
                   help="most experts one staging buffer holds; a layer with more streams as several fetches through "
                   "the staging buffers (default: the VRAM plan's choice)")
    g.add_argument("--greedy-steps", type=int, default=8, metavar="K",
                   help="greedy decoding runs K steps per call of the decode plan: one CUDA graph launch for K "
                   "tokens on the cuda_graph backend, each step's argmax fed to the next on the GPU (up to K - 1 "
                   "steps past an end-of-sequence token are dropped); 1: a launch per token (default 8)")
    g.add_argument("--speculate", default="auto", metavar="auto|0..4",
                   help="speculative decoding with the checkpoint's multi-token-prediction layer (DeepSeek-V3, "
                   "GLM-4.5): K chained drafts a step, verified in one step; 0 = off; auto = the K the cost model "
                   "predicts fastest, given acceptance rates (`--explain` says why; greedy tokens stay plain "
                   "decoding's, up to float near-ties between step shapes)")
    g.add_argument("--mtp-acceptance", type=float, default=None, metavar="A",
                   help="the MTP drafts' acceptance rate to price speculation with, the same at every depth "
                   "(default: the routing profile's rates by depth, from `ktflow profile --mtp`)")
    g.add_argument("--pass", dest="passes", action="append", default=[], metavar="MODULE:FN[@WHERE=PASS]",
                   help="add a pass of your own, a function (Graph, CompileContext) -> Graph, from an importable "
                   "module or a FILE.py: after=, before= or replace= a pass of the pipeline (default: before=lower); "
                   "repeatable, applied in order (see ktflow.passes.edit_pipeline)")
    g.add_argument("--drop-pass", action="append", default=[], metavar="PASS",
                   help="leave a pass of the pipeline out (repeatable)")
    g.add_argument("--allow-oversize", action="store_true",
                   help="plan even where the predicted GPU or host memory exceeds the hardware profile's (a plan "
                   "for a bigger machine); default: an error with the numbers")
