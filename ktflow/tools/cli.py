"""The `ktflow` command line: compile, run, serve, inspect, demo."""

from __future__ import annotations

import argparse
import os
import sys
import time
from ..util import env
from pathlib import Path

EPILOG = """examples:
  ktflow demo                                   small DeepSeek-V3-shaped model, compiled and run
  ktflow compile ./DeepSeek-V3 -o v3.plan.json  compile (config.json alone is enough)
  ktflow compile ./DeepSeek-V3 --hw paper-a100 --explain     where each node runs, and why (prefill buckets too)
  ktflow compile ./model --prefill-experts stream --prefill-buckets 2048,32768   force streamed experts
  ktflow compile ./model --print-after place_by_intensity
  ktflow run ./model --input-ids "1 2 3" --max-new-tokens 16
  ktflow run ./model --prompt "Hello" --temperature 0.7 --top-p 0.9 --seed 1
  ktflow inspect v3.plan.json --text
  ktflow hw show paper-a100                     a hardware preset; `ktflow hw probe -o me.json` measures this one
  ktflow calibrate ./model -o me.json           fit the profile to this machine's measured decode step
  ktflow serve ./model --port 8000              an OpenAI-compatible HTTP server (needs tokenizer.json)
  ktflow profile ./model --prompts p.txt -o routing.json   record routing; compile --routing-profile reads it
"""


def _add_compile_options(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--backend", default="auto", help="backend for the plan's steps: torch_ref, native, cuda_graph "
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
    g.add_argument("--prefill-reserve", choices=["auto", "none"], default="auto",
                   help="auto: the cost model reserves VRAM for prefill staging and a bucket's activations where "
                   "that shortens the workload's requests (default); none: decode residency first, long prompts "
                   "get what is left")
    g.add_argument("--prefill-experts", choices=["auto", "cpu", "stream", "split"], default="auto",
                   help="prefill: where the routed experts the decode placement left on the CPU compute: cpu, stream "
                   "(copied to GPU staging slots), split (both, sized to finish together) or auto (the fastest per "
                   "layer and prompt-length bucket by the cost model; default)")
    g.add_argument("--expert-cache", action="store_true",
                   help="the GPU experts of each layer the placement splits may be a cache that follows the routing "
                   "(run, serve): refilled after each prompt and every few decoded tokens with the experts picked "
                   "most since the last refill, the copies behind the decode steps. The placement pass prices it "
                   "per layer from the routing profile's cache curves (`ktflow profile`): how many slots each layer "
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
    g.add_argument("--staging-slots", type=int, default=2,
                   help="GPU staging slots for streamed experts (2 or more: the next layer's copy overlaps this one)")
    g.add_argument("--staging-experts", type=int, default=None, metavar="N",
                   help="most experts one staging slot holds; a layer with more streams as several fetches through "
                   "the slots (default: the VRAM plan's choice)")
    g.add_argument("--greedy-steps", type=int, default=8, metavar="K",
                   help="greedy decoding runs K steps per call of the decode plan: one CUDA graph launch for K "
                   "tokens on the cuda_graph backend, each step's argmax fed to the next on the GPU (up to K - 1 "
                   "steps past an end-of-sequence token are dropped); 1: a launch per token (default 8)")
    g.add_argument("--pass", dest="passes", action="append", default=[], metavar="MODULE:FN[@WHERE=PASS]",
                   help="add a pass of your own, a function (Graph, CompileContext) -> Graph, from an importable "
                   "module or a FILE.py: after=, before= or replace= a pass of the pipeline (default: before=lower); "
                   "repeatable, applied in order (see ktflow.passes.edit_pipeline)")
    g.add_argument("--drop-pass", action="append", default=[], metavar="PASS",
                   help="leave a pass of the pipeline out (repeatable)")
    g.add_argument("--allow-oversize", action="store_true",
                   help="plan even where the predicted GPU or host memory exceeds the hardware profile's (a plan "
                   "for a bigger machine); default: an error with the numbers")


def _options(a: argparse.Namespace) -> dict:
    opts = dict(max_seq_len=a.max_seq_len, max_batch=a.max_batch, dtype=a.dtype, device=a.device, backend=a.backend,
                expert_format=a.expert_format, fp8_on_gpu=a.fp8_on_gpu,
                placement=a.placement, vram_gb=a.vram_gb, vram_budget_gb=a.vram_budget_gb,
                vram_reserve_gb=a.vram_reserve_gb, workload=a.workload, workload_prompt_tokens=a.workload_prompt_tokens,
                workload_output_tokens=a.workload_output_tokens, prefill_reserve=a.prefill_reserve,
                numa=a.numa, numa_nodes=a.numa_nodes,
                prefill_experts=a.prefill_experts, prefill_chunk=a.prefill_chunk, staging_slots=a.staging_slots,
                staging_experts=a.staging_experts,
                greedy_steps=a.greedy_steps, allow_oversize=a.allow_oversize)
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
    edits = _pass_edits(a)
    if edits:
        opts["passes"] = edits
    return opts


def _pass_edits(a: argparse.Namespace) -> list:
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


def cmd_compile(a: argparse.Namespace) -> int:
    import ktflow

    t0 = time.perf_counter()
    model = ktflow.load(a.model)
    compiled = ktflow.compile(model, hw=a.hw, print_after=a.print_after, **_options(a))
    if a.output:
        compiled.save(a.output)
    if a.trace:
        from ktflow.plan.timeline import write_chrome_trace

        write_chrome_trace(compiled.plans, a.trace)
    if a.report:
        from ktflow.plan.report import write_report

        write_report(compiled.plans, a.report)
    elapsed = time.perf_counter() - t0
    print(compiled.summary(), end="")
    if a.explain:
        from ktflow.plan.artifact import placement_table, prefill_table

        print(placement_table(compiled.decode), end="")
        print(prefill_table(compiled.plans), end="")
        if compiled.plans.vram is not None:
            print(compiled.plans.vram.table(), end="")
    if a.text:
        print(compiled.as_text(), end="")
    where = "".join(f", wrote {f}" for f in (a.output, a.trace, a.report) if f)
    weights = "" if model.weights else " (config only, no weights)"
    print(f"compiled {model.model_type}{weights} in {elapsed:.2f} s{where}")
    return 0


def _token_ids(a: argparse.Namespace, model_dir: Path):
    import torch

    from ktflow.errors import InputError

    if (a.input_ids is None) == (a.prompt is None):
        raise InputError("give exactly one of --input-ids \"1 2 3\" or --prompt TEXT")
    if a.input_ids is not None:
        try:
            ids = [int(t) for t in a.input_ids.replace(",", " ").split()]
        except ValueError:
            raise InputError(f"--input-ids must be integers separated by spaces, got {a.input_ids!r}") from None
        if not ids:
            raise InputError("--input-ids is empty")
        return torch.tensor([ids]), None
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.exists():
        raise InputError(f"--prompt needs {tok_file}; this checkpoint has none, use --input-ids instead")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        from ktflow.errors import CheckpointError, first_line

        first = first_line(e) or type(e).__name__
        raise CheckpointError(f"{tok_file} cannot be loaded as a tokenizer ({first}); fix or remove it, or use "
                              "--input-ids") from None
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise InputError("the prompt encodes to no tokens")
    return torch.tensor([ids]), tok


def _compile_flags_given(a: argparse.Namespace) -> list[str]:
    """The compile options on the command line that differ from their defaults."""
    probe = argparse.ArgumentParser(add_help=False)
    _add_compile_options(probe)
    return [act.option_strings[0] for act in probe._actions
            if act.option_strings and getattr(a, act.dest, act.default) != act.default]


def _compiled(a: argparse.Namespace, model, allowed: tuple[str, ...] = ()):
    """The model's plans: loaded from --plan (no other compile flag but `allowed` beside it), or
    compiled with the flags given."""
    import ktflow
    from ktflow.errors import ConfigError

    if not a.plan:
        return ktflow.compile(model, hw=a.hw, **_options(a))
    given = [f for f in _compile_flags_given(a) if f not in allowed]
    if given:
        verb = "was" if len(given) == 1 else "were"
        raise ConfigError(f"--plan fixes the compile options, but {', '.join(given)} {verb} given too: drop "
                          "them, or leave out --plan to compile with them")
    return ktflow.Compiled.load(a.plan, model)


def _add_record_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-routing", metavar="JSON", default=None,
                   help="count every router's picks as the model runs (on the GPU inside the captured decode step: "
                   "a few small kernels a layer) and write them as a routing profile at the end (serve: at shutdown), "
                   "which `compile --routing-profile` reads: per-layer expert frequencies for placement. The expert "
                   "cache's curves need `ktflow profile`, which decodes each prompt on its own")


def _record_routing(a: argparse.Namespace, compiled):
    """--record-routing: a recorder counting every plan's routing from now on (None without it)."""
    if not getattr(a, "record_routing", None):
        return None
    from ktflow.runtime.routing import RoutingRecorder, attach

    rec = RoutingRecorder()
    attach(compiled, rec)
    return rec


def _write_recorded(a: argparse.Namespace, compiled, rec) -> None:
    """The recorded routing written (atomically) as a routing profile, with a line saying so."""
    if rec is None:
        return
    from ktflow.util.fsutil import write_atomic
    from ktflow.runtime.routing import detach

    detach(compiled, rec)
    model = compiled.model
    try:
        prof = rec.profile(model.config.model_type if model is not None else None)
    except ValueError as e:
        print(f"--record-routing {a.record_routing}: nothing written ({e})", flush=True)
        return
    write_atomic(a.record_routing, prof.model_dump_json(indent=None) + "\n")
    print(f"recorded the routing of {prof.tokens} tokens over {len(prof.layers)} MoE layers: wrote "
          f"{a.record_routing} (compile with --routing-profile {a.record_routing})", flush=True)


def _follow_routing(a: argparse.Namespace, compiled):
    """--expert-cache: the cache refilled from the routing (at the plan's intervals, or every
    --refill-every tokens), returned; where the placement pass priced every split layer static, a
    line says so (None)."""
    if not a.expert_cache:
        return None
    from ktflow.ir.ops import Op
    from ktflow.runtime.expert_cache import ExpertCache

    parts = [n for n in compiled.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS]
    split = {n.attrs.layer for n in parts if n.place.device.value == "gpu"} & \
        {n.attrs.layer for n in parts if n.place.device.value == "cpu"}
    if split and not any(n.attrs.cached for n in parts):
        print(f"expert cache: off; the placement pass priced static experts above a cache in every split layer "
              f"({', '.join(map(str, sorted(split)))}): the routing profile's cache curves gain less than the copies "
              "cost (`ktflow compile --explain` shows each layer's cause)", flush=True)
        return None
    cache = ExpertCache(compiled)
    cache.follow(a.refill_every)
    print(f"expert cache: layers {', '.join(map(str, sorted(cache.layers)))}, "
          f"{', '.join(str(len(c.resident)) for _, c in sorted(cache.layers.items()))} GPU slots; refilled after "
          f"each prompt and every {', '.join(str(cache.every[layer]) for layer in sorted(cache.layers))} decoded "
          "tokens", flush=True)
    return cache


def _cache_summary(cache) -> None:
    """What the expert cache did in a run: its hit share, bytes copied and host time a token."""
    cache.stop()
    tokens = max(cache.tokens, 1)
    hits = f"{100 * cache.served / cache.picked:.0f}% of the decoded picks on GPU slots" if cache.picked else \
        "no refill after a decode step yet (no hit share)"
    print(f"expert cache: {hits}, {cache.copied} experts copied in ({cache.copied_bytes / tokens / 1e6:.2f} MB a "
          f"decoded token), the host {1e3 * cache.host_seconds / tokens:.2f} ms a decoded token at step ends", flush=True)


def cmd_run(a: argparse.Namespace) -> int:
    import ktflow
    from ktflow.runtime.generate import generate_with_stats

    model = ktflow.load(a.model)
    ids, tok = _token_ids(a, model.path)
    compiled = _compiled(a, model)
    compiled.check_finite = a.check_finite
    eos = None if a.ignore_eos else list(model.config.eos_ids) or None
    _print_ready(compiled)
    cache = _follow_routing(a, compiled)
    rec = _record_routing(a, compiled)
    if a.trace:  # the prompt's (first) step and the first decode step run instrumented
        prompt_plan = compiled.prefill_plan(min(ids.numel(), compiled.chunk_tokens))
        compiled.executor(prompt_plan).trace = compiled.executor(compiled.decode).trace = 1
    out, st = generate_with_stats(compiled, ids, a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                                  seed=a.seed, eos_token_id=eos, top_k=a.top_k, min_p=a.min_p,
                                  repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                                  frequency_penalty=a.frequency_penalty)
    _print_generation(ids, out, st, tok)
    _write_recorded(a, compiled, rec)
    if cache is not None:
        _cache_summary(cache)
    if a.trace:
        _write_measured_trace(compiled, a.trace)
    return 0


def _write_measured_trace(compiled, path: str) -> None:
    from ktflow.plan.timeline import with_measured_steps, write_chrome_trace

    def measured(plan):
        steps = compiled.executor(plan).measured
        return with_measured_steps(plan, steps) if steps else plan.model_copy(update={"steps": []})

    plans = dict(prefill=[measured(p) for p in compiled.prefill], decode=measured(compiled.decode))
    write_chrome_trace(compiled.plans.model_copy(update=plans), path, label="measured")
    ran = [f"{p.phase} ({p.step_tokens}-token plan)" if p.phase == "prefill" else p.phase
           for p in compiled.plans.plans if compiled.executor(p).measured]
    print(f"wrote {path}: measured {' and '.join(ran)} step (compare with `ktflow compile --trace`)")
    if compiled.executor(compiled.decode).measured:
        from ktflow.plan.timeline import handoff_summary

        print(handoff_summary(plans["decode"], compiled.decode))


def _print_ready(compiled) -> None:
    seconds = compiled.prepare()
    be = compiled.executor(compiled.decode).backend.name
    print(f"weights ready in {seconds:.2f} s ({be} on {compiled.decode.device})")


def _print_generation(ids, out, st, tok=None, note: str = "") -> None:
    new = out[0, ids.shape[1]:].tolist()
    print(f"prompt ids    {ids[0].tolist()}")
    print(f"generated ids {new}{note}")
    if tok is not None:
        print(f"generated text {tok.decode(new)!r}")
    print(f"prefill: {st.prompt_tokens} tokens in {st.prefill_seconds:.3f} s = {st.prefill_tokens_per_s:.1f} tokens/s")
    print(f"decode:  {st.new_tokens} tokens in {st.decode_seconds:.3f} s = {st.decode_tokens_per_s:.1f} tokens/s")


def cmd_inspect(a: argparse.Namespace) -> int:
    from ktflow.plan.artifact import PlanFile

    from ktflow.plan.timeline import layer_times

    pf = PlanFile.load(a.plan)
    print(pf.summary(), end="")
    for plan in pf.plans:
        moe = [t for t in layer_times(plan) if t.layer is not None]
        if moe:
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            label = f"prefill{plan.step_tokens}" if plan.phase == "prefill" else plan.phase
            print(f"{label:8s}  per layer (mean): {mean([t.span_us for t in moe]):.1f} us, GPU busy "
                  f"{100 * mean([t.gpu_busy for t in moe]):.0f}%, CPU busy {100 * mean([t.cpu_busy for t in moe]):.0f}%, "
                  f"PCIe busy {100 * mean([t.copy_us / t.span_us for t in moe if t.span_us]):.0f}%, "
                  f"overlap {mean([t.overlap_us for t in moe]):.1f} us")
    if a.text:
        print("\n".join(p.as_text() for p in pf.plans), end="")
    return 0


def cmd_diff(a: argparse.Namespace) -> int:
    from ktflow.plan.diff import plan_diff
    from ktflow.plan.artifact import PlanFile

    print(plan_diff(PlanFile.load(a.a), PlanFile.load(a.b)).text(), end="")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    import torch

    import ktflow
    from ktflow.tools.demo import ensure_demo_checkpoint
    from ktflow.runtime.generate import generate_with_stats

    d, written = ensure_demo_checkpoint(Path(a.dir) if a.dir else None)
    print(f"{'wrote' if written else 'using'} demo checkpoint {d}")
    model = ktflow.load(d)
    t0 = time.perf_counter()
    compiled = ktflow.compile(model, hw=a.hw, max_seq_len=256)
    print(f"compiled in {time.perf_counter() - t0:.2f} s")
    print(compiled.summary(), end="")
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(0))
    _print_ready(compiled)
    # warm-up: first-call costs (a greedy run's capture too) stay out of the timings below
    ktflow.generate(compiled, ids[:, :4], 2 + compiled.plans.options.greedy_steps)
    out, st = generate_with_stats(compiled, ids, a.max_new_tokens)
    _print_generation(ids, out, st, note="  (random weights: the tokens mean nothing)")
    return 0


def cmd_hw_show(a: argparse.Namespace) -> int:
    from ktflow.costmodel.hw import PRESETS, resolve_hw

    if a.profile is None:
        for name, hw in PRESETS.items():
            print(f"{name:16s} {hw.description}")
        print(f"{'this':16s} this machine as the OS and torch describe it (throughputs guessed)")
        return 0
    print(resolve_hw(a.profile).summary(), end="")
    return 0


def cmd_hw_probe(a: argparse.Namespace) -> int:
    from ktflow.util.fsutil import write_atomic
    from ktflow.tools.probe import probe

    hw = probe(quick=a.quick, log=lambda s: print(s, flush=True))
    if a.name:
        hw = hw.model_copy(update=dict(name=a.name))
    print(hw.summary(), end="")
    if a.output:
        write_atomic(a.output, hw.model_dump_json(indent=1) + "\n")
        print(f"wrote {a.output} (use it with --hw {a.output})")
    return 0


def _model_with_weights(path: str, what: str):
    """The checkpoint at `path`, or a ConfigError if it has no weights (`what` runs the model)."""
    import ktflow
    from ktflow.errors import ConfigError

    model = ktflow.load(path)
    if model.weights is None:
        raise ConfigError(f"{path} has no weights (config.json only): {what} runs the model, so it needs the "
                          "checkpoint's *.safetensors")
    return model


def cmd_calibrate(a: argparse.Namespace) -> int:
    from ktflow.tools.calibrate import calibrate
    from ktflow.errors import ConfigError
    from ktflow.util.fsutil import write_atomic

    if a.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {a.steps}")
    model = _model_with_weights(a.model, "calibrate")
    opts = _options(a)
    hw = a.hw
    print(f"calibrating {model.path.name}: {a.steps} decode steps a plan (at least 16 where replayed)", flush=True)
    cal = calibrate(model, hw, steps=a.steps, **opts)
    print("\n".join(cal.lines()))
    if a.output:
        write_atomic(a.output, cal.profile.model_dump_json(indent=1) + "\n")
        print(f"wrote {a.output} (compile with --hw {a.output})")
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    import ktflow
    from ktflow.errors import ConfigError, InputError
    from ktflow.util.fsutil import write_atomic
    from ktflow.runtime.routing import record_routing

    if a.decode < 0:
        raise ConfigError(f"--decode must be at least 0, got {a.decode}")
    model = _model_with_weights(a.model, "profiling")
    try:
        lines = [ln.strip() for ln in Path(a.prompts).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {a.prompts}: cannot read it as UTF-8 text ({e})") from None
    lines = [ln for ln in lines if ln]
    if not lines:
        raise InputError(f"--prompts {a.prompts} has no prompts (one per line)")
    tok_file = model.path / "tokenizer.json"
    if not tok_file.exists():
        raise InputError(f"{tok_file} does not exist: ktflow profile tokenizes the prompts with the checkpoint's "
                         "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    opts = _options(a)
    compiled = ktflow.compile(model, hw=a.hw, **opts)
    prompts = []
    for i, text in enumerate(lines):
        ids = tok.encode(text).ids[:compiled.max_seq_len]
        if not ids:
            raise InputError(f"--prompts {a.prompts}, line {i + 1}: no tokens")
        prompts.append(ids)
    prof = record_routing(compiled, prompts, a.decode, pairs=a.pairs)
    write_atomic(a.output, prof.model_dump_json(indent=None) + "\n")
    top = []
    for layer, fr in list(prof.layers.items())[:3]:
        k = sum(fr)
        hot = sorted(fr, reverse=True)[:max(1, len(fr) // 10)]
        top.append(f"layer {layer}: the busiest 10% of experts take {100 * sum(hot) / k:.0f}% of the picks")
    print(f"recorded {prof.tokens} tokens over {len(prof.layers)} MoE layers ({len(prompts)} prompts, {a.decode} "
          f"decoded tokens each); " + "; ".join(top))
    if prof.cache:
        every = 32 if 32 in prof.cache else min(prof.cache)

        def quarter_hit(c) -> float:  # what a quarter of the layer's experts as slots served
            return c.hits[max(1, round(0.25 * (len(c.hits) + 1))) - 1]

        quarter = {layer: quarter_hit(c) for layer, c in prof.cache[every].items()}
        static = {layer: sum(sorted(prof.layers[layer], reverse=True)[:max(1, round(0.25 * len(prof.layers[layer])))])
                  / sum(prof.layers[layer]) for layer in quarter}
        print(f"an expert cache of a quarter of each layer's experts, refilled every {every} decoded tokens, served "
              f"{100 * sum(quarter.values()) / len(quarter):.0f}% of the decoded picks (the quarter picked most overall: "
              f"{100 * sum(static.values()) / len(static):.0f}%)")
        for b, table in sorted((prof.cache_batched or {}).items()):
            if every in table:
                q = [quarter_hit(c) for c in table[every].values()]
                print(f"  {b} conversations decoded together: it served {100 * sum(q) / len(q):.0f}% of the steps' "
                      "expert reads")
    print(f"wrote {a.output} (compile with --routing-profile {a.output})")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import ktflow
    from ktflow.errors import ConfigError, ResourceError

    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ResourceError(f"ktflow serve needs {e.name}, which is not installed: pip install 'ktflow[serve]'") from None
    from ktflow.serve.server import build, run
    from ktflow.serve.tokenizer import ServeTokenizer

    for flag, v, least in (("--port", a.port, 0), ("--max-batch", a.max_batch, 1), ("--max-queue", a.max_queue, 0)):
        if v < least:
            raise ConfigError(f"{flag} must be at least {least}, got {v}")
    if a.port > 65535:
        raise ConfigError(f"--port must be at most 65535, got {a.port}")
    model_dir = Path(a.model)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a directory (give the checkpoint dir with config.json, the weights "
                          "and tokenizer.json)")
    tok = ServeTokenizer.from_dir(model_dir)  # first: a dir without a tokenizer fails before any loading
    model = ktflow.load(model_dir)
    if model.weights is None:
        raise ConfigError(f"{model_dir} has no weights (config.json only): serving runs the model, so it needs the "
                          "checkpoint's *.safetensors")
    compiled = _compiled(a, model, allowed=("--max-batch",))
    if tok.vocab_size > compiled.vocab_size:
        raise ConfigError(f"{model_dir}/tokenizer.json has {tok.vocab_size} tokens but the model's vocabulary has "
                          f"{compiled.vocab_size}: the tokenizer belongs to another model")
    _print_ready(compiled)
    _follow_routing(a, compiled)
    rec = _record_routing(a, compiled)
    served = build(compiled, tok, a.model_name or model_dir.resolve().name, max_batch=a.max_batch,
                   max_queue=a.max_queue, api_key=a.api_key or None, prefill_tokens=a.prefill_step)
    if tok.chat_template is None:
        print("note: tokenizer_config.json has no chat_template: /v1/chat/completions answers 400, "
              "/v1/completions works", flush=True)
    try:
        run(served, a.host, a.port, shutdown_timeout=a.shutdown_timeout)
    finally:
        _write_recorded(a, compiled, rec)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: `ktflow compile: error: <what> (see ktflow compile
    --help)`, exit 2 (the default prints the whole usage block first)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    from ktflow.passes import pass_names
    from ktflow.version import __version__

    p = _Parser(prog="ktflow", description="Compile and run huge MoE models on one GPU + big-CPU "
                                "workstation.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ktflow {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, the Python traceback too (or KTFLOW_DEBUG=1)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal anyway; or "
                   "KTFLOW_QUIET=1)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a model into a plan file",
                       description="Run the pass pipeline for a model (an HF checkpoint dir; config.json alone is "
                       "enough) and print the plan summary.")
    c.add_argument("model", help="HF checkpoint dir (config.json [+ *.safetensors])")
    c.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    c.add_argument("--print-after", metavar="PASS", help=f"print the graph after this pass ({', '.join(pass_names())})")
    c.add_argument("--text", action="store_true", help="also print both plans in full")
    c.add_argument("--explain", action="store_true", help="print where each node runs and why, the prefill buckets, "
                   "and the VRAM plan: what the prefill reservation costs decode and buys prefill, against the "
                   "candidates the cost model priced")
    c.add_argument("--trace", metavar="JSON", help="write the predicted timelines as a Chrome trace (open in Perfetto)")
    c.add_argument("--report", metavar="HTML", help="write an HTML report: memory, per-layer timeline, placement")
    c.add_argument("--routing-profile", metavar="JSON", help="per-layer expert frequencies: hot experts go to the GPU")
    _add_compile_options(c)
    c.set_defaults(fn=cmd_compile)

    r = sub.add_parser("run", help="generate tokens with a model",
                       description="Prefill a prompt, decode new tokens, print them and the prefill/decode speed.")
    r.add_argument("model", help="HF checkpoint dir with weights")
    r.add_argument("--input-ids", help='prompt token ids, e.g. "1 2 3"')
    r.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model dir)")
    r.add_argument("--plan", help="use this compiled plan file instead of compiling")
    r.add_argument("--max-new-tokens", type=int, default=32)
    s = r.add_argument_group("token selection", "made on the device that computes the logits (inside the captured "
                             "decode step on a GPU); the defaults are greedy")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens holding this share of the mass")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: no limit)")
    s.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this share of the most likely's "
                   "probability")
    s.add_argument("--repetition-penalty", type=float, default=1.0, help="divide (x > 0) or multiply the logits of "
                   "tokens in the prompt or generated by this (1: none)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from each generated token's logit")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times each generated token's "
                   "count")
    s.add_argument("--seed", type=int, default=None, help="seed of the random stream (default: a random one)")
    r.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos token")
    r.add_argument("--check-finite", action="store_true", help="check every step's values for NaN and infinity and "
                   "name the first node that made one (slower; KTFLOW_CHECK_FINITE=1 does the same)")
    _add_record_option(r)
    r.add_argument("--trace", metavar="JSON", help="run the prompt step and the first decode step instrumented "
                   "(CUDA events per GPU step, the CPU queue's timestamps) and write their measured timelines "
                   "as a Chrome trace, in the format of `ktflow compile --trace`")
    _add_compile_options(r)
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("inspect", help="print a plan file's summary", description="Print a plan file's summary.")
    i.add_argument("plan", help="plan JSON written by `ktflow compile -o`")
    i.add_argument("--text", action="store_true", help="print both plans in full (graph and steps)")
    i.set_defaults(fn=cmd_inspect)

    df = sub.add_parser("diff", help="what changed between two plan files",
                        description="What changed from plan A to plan B: options and pipeline, then per plan "
                        "(decode, prefill buckets): predicted step time, memory per device, Expert Deferral per "
                        "layer, nodes placed elsewhere (with B's cause), per-layer predicted times.")
    df.add_argument("a", help="plan JSON (before)")
    df.add_argument("b", help="plan JSON (after)")
    df.set_defaults(fn=cmd_diff)

    d = sub.add_parser("demo", help="write, compile and run a small DeepSeek-V3-shaped model",
                       description="Write a small random-weight DeepSeek-V3-shaped checkpoint into the cache dir "
                       "(once), compile it and generate tokens. Needs no network.")
    d.add_argument("--dir", help="checkpoint dir (default: <cache>/demo-deepseek-v3)")
    d.add_argument("--hw", default=None, help="hardware profile (default: this machine)")
    d.add_argument("--prompt-tokens", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=32)
    d.set_defaults(fn=cmd_demo)
    h = sub.add_parser("hw", help="hardware profiles: show presets, measure this machine",
                       description="Hardware profiles tell the compiler what the machine can do.")
    hsub = h.add_subparsers(dest="hw_command", required=True, metavar="HW_COMMAND")
    hs = hsub.add_parser("show", help="list presets, or print one profile",
                         description="Without an argument, list the presets; with one, print that profile.")
    hs.add_argument("profile", nargs="?", help="a preset, 'this', or a profile JSON path")
    hs.set_defaults(fn=cmd_hw_show)
    hp = hsub.add_parser("probe", help="measure this machine and write a profile JSON",
                         description="Measure DRAM bandwidth, CPU bf16 GEMM/GEMV and, with a GPU, its HBM "
                         "bandwidth, bf16 GEMM, PCIe both ways and launch overhead (about a minute).")
    hp.add_argument("-o", "--output", help="write the profile JSON here (atomically)")
    hp.add_argument("--name", help="profile name (default 'probed')")
    hp.add_argument("--quick", action="store_true",
                    help="fewer repeats and smaller CPU compute sizes: seconds instead of a minute, lower CPU FLOP "
                    "rates (bandwidths still read past the caches; GPU rates at full size)")
    hp.set_defaults(fn=cmd_hw_probe)
    cal = sub.add_parser("calibrate", help="fit a hardware profile to a model's measured decode step",
                         description="Compile MODEL for --hw, run its decode plan here with the measured trace, "
                         "fit what the roofline misses (the GPU's efficiency and fixed time per op, the CPU's rate "
                         "and fixed time per op, the CPU task hand-off each way: ktflow.tools.calibrate) and write the "
                         "profile, which later compiles use with --hw PROFILE.json. On a GPU with CPU experts the "
                         "exact plan is measured first, then the plan deferring --defer picks a layer (2 when "
                         "--defer is not a number), for the deferred task's extra time.")
    cal.add_argument("model", help="HF checkpoint dir with weights")
    cal.add_argument("-o", "--output", help="write the fitted profile JSON here (atomically)")
    cal.add_argument("--steps", type=int, default=3, help="traced decode steps (the median of each op is fitted)")
    _add_compile_options(cal)
    cal.set_defaults(fn=cmd_calibrate)
    pr = sub.add_parser("profile", help="record which experts a model's routers pick on some prompts",
                        description="Run each prompt of --prompts (one per line, tokenized with the checkpoint's "
                        "tokenizer.json) through MODEL, then --decode greedy tokens after it, counting per MoE layer "
                        "how often each expert is picked (and with --pairs each pair of experts together), and "
                        "write the routing profile JSON that `ktflow compile --routing-profile` places hot experts "
                        "by. The counters live on the device each router runs on; on the cuda_graph backend the captured decode "
                        "step adds to them as it replays.")
    pr.add_argument("model", help="HF checkpoint dir with weights and tokenizer.json")
    pr.add_argument("--prompts", required=True, help="text file, one prompt per line")
    pr.add_argument("-o", "--output", required=True, help="routing profile JSON to write (atomically)")
    pr.add_argument("--decode", type=int, default=128,
                    help="greedy tokens decoded after each prompt (default 128): the expert cache's curves replay its "
                    "refills on them (every 8..64 tokens), so the placement pass can price a cache")
    pr.add_argument("--pairs", action="store_true",
                    help="also count pairs of experts picked by one token (experts^2 numbers per layer)")
    _add_compile_options(pr)
    pr.set_defaults(fn=cmd_profile)
    sv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Compile MODEL (or load --plan) and serve it over HTTP with the OpenAI API:\n"
                        "  POST /v1/chat/completions, /v1/completions  (\"stream\": true for server-sent events)\n"
                        "  GET  /v1/models, /health, /metrics           (/metrics: Prometheus text format)\n"
                        "Up to --max-batch sequences run at once, each in its own slot, decoded together in one\n"
                        "batched step per token; new ones join between tokens (continuous batching), prompts that\n"
                        "arrive together are prefilled in one step, up to --max-queue wait, past that 429.\n"
                        "SIGTERM stops admitting, lets requests in flight finish (--shutdown-timeout), exits 0.",
                        epilog="""examples:
  ktflow serve ./model --hw this --port 8000
  ktflow serve ./model --plan model.plan.json --max-batch 8 --api-key $KEY
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "model", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'

MODEL must hold tokenizer.json (and tokenizer_config.json with a chat_template for the chat endpoint).""")
    sv.add_argument("model", help="HF checkpoint dir with weights and tokenizer.json")
    sv.add_argument("--plan", help="use this compiled plan file instead of compiling")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                    "0.0.0.0 for every interface, with --api-key)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument("--model-name", default=None, help="the model name clients send (default: MODEL's dir name)")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests that may wait for a slot; more get HTTP 429 with Retry-After (default 64)")
    sv.add_argument("--api-key", default=env.get("KTFLOW_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $KTFLOW_API_KEY; none: open)")
    sv.add_argument("--prefill-step", type=int, default=None, metavar="TOKENS",
                    help="most prompt tokens prefilled per scheduler iteration (the chunks of every waiting prompt "
                    "that fit, in one packed step), so a long prompt delays running sequences by one such chunk "
                    "per token (default: min(256, the largest prefill bucket))")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                    help="on SIGTERM, seconds requests in flight get to finish before they are cancelled (default 30)")
    _add_record_option(sv)
    _add_compile_options(sv)
    sv.set_defaults(fn=cmd_serve, max_batch=4)
    for act in sv._actions:
        if act.dest == "max_batch":
            act.help = "sequences served at once, each with its own KV cache slot, decoded together in one batched " \
                       "step (default 4); also the batch the compiled plan's memory is planned for (a --plan must " \
                       "have been compiled with max_batch at least this)"
    for sp in [*sub.choices.values(), *hsub.choices.values()]:  # also after the command: `ktflow run ... --debug`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, the Python traceback too (or KTFLOW_DEBUG=1)")
        sp.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """The error boundary: every failure ends in one line on stderr and an exit code (see
    ktflow.errors): 2 bad input, 1 the environment or an internal error, 130 Ctrl-C, 141 a
    closed output pipe (quiet). --debug (or KTFLOW_DEBUG=1) re-raises for the traceback."""
    args = parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or env.get("KTFLOW_DEBUG")
    where = f"ktflow {args.command}"
    if getattr(args, "quiet", False):
        from ktflow.util import progress

        progress.QUIET = True
    try:
        return args.fn(args)
    except BrokenPipeError:  # `ktflow inspect plan --text | head`: the reader is gone, say nothing
        _quiet_stdout()
        return 141
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the boundary: one line for anything, the traceback on request
        if debug:
            raise
        code, message = describe(e)
        print(f"{where}: error: {message}", file=sys.stderr)
        return code


def describe(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached the CLI."""
    from ktflow.errors import KtflowError, first_line

    if isinstance(e, KtflowError):
        return e.exit_code, str(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
            isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        first = first_line(e) or "host memory"
        return 1, f"out of memory ({first}); use a smaller --vram-gb, --max-seq-len or --max-batch"
    if isinstance(e, OSError):
        what = f" {e.filename}" if e.filename else ""
        reason = e.strerror or str(e) or type(e).__name__
        return 1, f"{reason}:{what}" if what else reason
    text = first_line(e)
    return 1, (f"internal error: {type(e).__name__}{': ' + text if text else ''} (a bug in ktflow: rerun with "
               "--debug for the traceback and report it)")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
