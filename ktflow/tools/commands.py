"""What each `ktflow` subcommand does (`cmd_<name>`, given the parsed arguments; returns the
exit status). The parser and the entry point are cli.py's."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .compile_flags import flags_given, options


def cmd_compile(a: argparse.Namespace) -> int:
    import ktflow

    t0 = time.perf_counter()
    model = ktflow.load(a.model)
    compiled = ktflow.compile(model, hw=a.hw, print_after=a.print_after, **options(a))
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
        if compiled.plans.speculation is not None:
            print(compiled.plans.speculation.table(), end="")
    if a.text:
        print(compiled.as_text(), end="")
    where = "".join(f", wrote {f}" for f in (a.output, a.trace, a.report) if f)
    weights = "" if model.weights else " (config only, no weights)"
    print(f"compiled {model.model_type}{weights} in {elapsed:.2f} s{where}")
    return 0


def _token_ids(a: argparse.Namespace, model_dir: Path, vocab: int):
    import re

    import torch

    from ktflow.errors import InputError

    if (a.input_ids is None) == (a.prompt is None):
        raise InputError("give exactly one of --input-ids \"1 2 3\" or --prompt TEXT")
    if a.input_ids is not None:
        if not a.input_ids.strip():
            raise InputError("--input-ids is empty")
        if not re.fullmatch(r"\s*\d+(\s*[,\s]\s*\d+)*\s*", a.input_ids):
            raise InputError(f"--input-ids must be token ids (integers >= 0) separated by one comma or spaces, got "
                             f"{a.input_ids!r}")
        ids = [int(t) for t in re.split(r"[,\s]+", a.input_ids.strip())]
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InputError(f"--input-ids has token id {bad}, outside the model's vocabulary (ids 0..{vocab - 1})")
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


def _compiled(a: argparse.Namespace, model, allowed: tuple[str, ...] = ()):
    """The model's plans: loaded from --plan (no other compile flag but `allowed` beside it), or
    compiled with the flags given."""
    import ktflow
    from ktflow.errors import ConfigError

    if not a.plan:
        return ktflow.compile(model, hw=a.hw, **options(a))
    given = [f for f in flags_given(a) if f not in allowed]
    if given:
        verb = "was" if len(given) == 1 else "were"
        raise ConfigError(f"--plan fixes the compile options, but {', '.join(given)} {verb} given too: drop "
                          "them, or leave out --plan to compile with them")
    return ktflow.Compiled.load(a.plan, model)


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
          f"{', '.join(str(len(c.resident)) for _, c in sorted(cache.layers.items()))} GPU rows; refilled after "
          f"each prompt and every {', '.join(str(cache.every[layer]) for layer in sorted(cache.layers))} decoded "
          "tokens", flush=True)
    return cache


def _cache_summary(cache) -> None:
    """What the expert cache did in a run: its hit share, bytes copied and host time a token."""
    cache.stop()
    tokens = max(cache.tokens, 1)
    hits = f"{100 * cache.served / cache.picked:.0f}% of the decoded picks on GPU rows" if cache.picked else \
        "no refill after a decode step yet (no hit share)"
    print(f"expert cache: {hits}, {cache.copied} experts copied in ({cache.copied_bytes / tokens / 1e6:.2f} MB a "
          f"decoded token), the host {1e3 * cache.host_seconds / tokens:.2f} ms a decoded token at step ends", flush=True)


def cmd_run(a: argparse.Namespace) -> int:
    if a.gpus > 1:
        return _on_ranks(a, _run_rank)
    return _run(a)


def _on_ranks(a: argparse.Namespace, target) -> int:
    """`run` / `serve` with --gpus N: under torchrun, this process is one rank (its rank from the
    environment); else N processes are started here, one a rank, `target(rank, a)` in each. With
    CUDA, rank r runs on GPU r (under torchrun: LOCAL_RANK) and the ranks meet over NCCL; where the
    plans' GPU nodes run on the CPU (--device cpu), over gloo: the correctness mode."""
    import os

    from ktflow.errors import ConfigError
    from ktflow.runtime import ranks

    import torch

    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started this process
        rank, world = ranks.join_from_env(cuda)
        ok = False
        try:
            if world != a.gpus:
                raise ConfigError(f"--gpus {a.gpus} but torchrun started {world} process(es): give the same number")
            code = target(rank, a)
            ok = True
            return code
        finally:
            ranks.leave_group(ok)
    ranks.run_ranks(a.gpus, target, a, cuda=cuda)
    return 0


def _run_rank(rank: int, a: argparse.Namespace) -> int:
    """One rank of `run --gpus N`: its plans compiled (checked against the other ranks'), the
    prompt generated; rank 0 alone prints."""
    import contextlib
    import io

    from ktflow.runtime.ranks import common_seed

    # every rank must select the same tokens: one seed for all (rank 0's); rank 0 alone records and traces
    seed = common_seed(a.seed)
    a = argparse.Namespace(**{**vars(a), "rank": rank, "seed": seed,
                              **({"record_routing": None, "trace": None} if rank else {})})
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
    with quiet:
        return _run(a)


def _run(a: argparse.Namespace) -> int:
    import ktflow
    from ktflow.runtime.generate import generate_with_stats

    model = ktflow.load(a.model)
    ids, tok = _token_ids(a, model.path, model.config.vocab_size)
    compiled = _compiled(a, model)
    ranked = compiled.plans.options.gpus > 1
    if ranked:
        from ktflow.runtime.ranks import all_ready, check_plans_agree

        check_plans_agree(compiled.plans.plans)
    compiled.check_finite = a.check_finite
    eos = None if a.ignore_eos else list(model.eos_ids) or None
    _print_ready(compiled)
    if ranked:
        all_ready()  # rank 0 may pack its CPU experts for long: the others wait here, not in a step
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
    from ktflow.plan.timeline import with_measured_plans, write_chrome_trace

    measured = with_measured_plans(compiled.plans, lambda plan: compiled.executor(plan).measured)
    write_chrome_trace(measured, path, label="measured")
    ran = [f"{p.phase} ({p.step_tokens}-token plan)" if p.phase == "prefill" else p.phase
           for p in compiled.plans.plans if compiled.executor(p).measured]
    print(f"wrote {path}: measured {' and '.join(ran)} step (compare with `ktflow compile --trace`)")
    if compiled.executor(compiled.decode).measured:
        from ktflow.plan.timeline import handoff_summary

        print(handoff_summary(measured.decode, compiled.decode))


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
    sp = st.speculative
    if sp is not None:
        print(f"speculative: {sp.steps} verification steps, {sp.acceptance:.0%} of the drafts accepted, "
              f"{sp.tokens_per_step:.2f} tokens a step")


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
    if not (d / "tokenizer.json").exists():  # so `ktflow serve` takes the demo model too
        from ktflow.serve.demo_tokenizer import write_demo_tokenizer

        write_demo_tokenizer(d)
    model = ktflow.load(d)
    t0 = time.perf_counter()
    compiled = ktflow.compile(model, hw=a.hw, max_seq_len=256)
    print(f"compiled in {time.perf_counter() - t0:.2f} s")
    print(compiled.summary(), end="")
    ids = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(0))
    _print_ready(compiled)
    # warm-up: first-call costs (a greedy run's capture too) stay out of the timings below
    ktflow.generate(compiled, ids[:, :4], 2 + compiled.plans.options.greedy_steps, eos_token_id=None)
    out, st = generate_with_stats(compiled, ids, a.max_new_tokens, eos_token_id=None)  # timed: every token
    _print_generation(ids, out, st, note="  (random weights: the tokens mean nothing)")
    hw = f" --hw {a.hw}" if a.hw else ""
    print(f"serve it: ktflow serve {d}{hw}  (the OpenAI API on http://127.0.0.1:8000/v1)")
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
    opts = options(a)
    hw = a.hw
    print(f"calibrating {model.path.name}: {a.steps} decode steps a plan (at least 16 where replayed)", flush=True)
    cal = calibrate(model, hw, steps=a.steps, **opts)
    print("\n".join(cal.lines()))
    if a.output:
        write_atomic(a.output, cal.profile.model_dump_json(indent=1) + "\n")
        print(f"wrote {a.output} (compile with --hw {a.output})")
    return 0


def cmd_profile(a: argparse.Namespace) -> int:
    import torch

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
    opts = options(a)
    if a.mtp and not model.has_mtp:
        raise ConfigError(f"--mtp measures the checkpoint's multi-token-prediction layer; {model.path} declares none "
                          "(num_nextn_predict_layers)")
    if a.mtp and a.decode < 1:
        raise ConfigError("--mtp measures the MTP drafts on each prompt's decoded tokens: give --decode >= 1")
    compiled = ktflow.compile(model, hw=a.hw, **opts)
    if a.mtp and compiled.decode.device == "cuda" and a.backend not in ("native", "torch_ref"):
        raise ConfigError("--mtp runs the MTP layer on the main model's hidden states, which the captured CUDA-graph "
                          "step does not keep yet: add --backend native (or torch_ref)")
    prompts = []
    for i, text in enumerate(lines):
        ids = tok.encode(text).ids[:compiled.max_seq_len]
        if not ids:
            raise InputError(f"--prompts {a.prompts}, line {i + 1}: no tokens")
        prompts.append(ids)
    continuations = None
    if a.mtp:  # the greedy continuations, decoded once: routed as decode steps, and drafted on
        continuations = [ktflow.generate(compiled, torch.tensor([ids]), min(a.decode, compiled.max_seq_len - len(ids)),
                                         eos_token_id=None)[0, len(ids):].tolist() for ids in prompts]
    prof = record_routing(compiled, prompts, a.decode, pairs=a.pairs, continuations=continuations)
    if a.mtp:  # the MTP drafts' acceptance by depth, which prices speculative decoding
        from ktflow.costmodel.speculation import MAX_DRAFTS
        from ktflow.runtime.speculative import acceptance_rates

        draft = ktflow.compile(model.mtp(), hw=a.hw, **{**opts, "speculate": 0})
        rates, per_step, counted = acceptance_rates(compiled, draft, prompts, continuations, MAX_DRAFTS)
        prof = prof.model_copy(update=dict(mtp_acceptance=[round(r, 6) for r in rates],
                                           mtp_tokens_per_step=[round(t, 6) for t in per_step]))
        print(f"the MTP layer's chained greedy drafts were kept at {'/'.join(f'{r:.1%}' for r in rates)} by depth, "
              f"over {counted} decoded positions; a run of k = 1..{len(per_step)} drafts a step would yield "
              f"{'/'.join(f'{t:.2f}' for t in per_step)} tokens a step")
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

        def quarter_hit(c) -> float:  # what a quarter of the layer's experts as GPU rows served
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
    from ktflow.errors import ConfigError, ResourceError

    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ResourceError(f"ktflow serve needs {e.name}, which is not installed: pip install 'ktflow[serve]'") from None
    for flag, v, least in (("--port", a.port, 0), ("--max-batch", a.max_batch, 1), ("--max-queue", a.max_queue, 0),
                           ("--max-connections", a.max_connections, 1)):
        if v < least:
            raise ConfigError(f"{flag} must be at least {least}, got {v}")
    if a.port > 65535:
        raise ConfigError(f"--port must be at most 65535, got {a.port}")
    _check_serve_limits(a)
    model_dir = Path(a.model)
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir} is not a directory (give the checkpoint dir with config.json, the weights "
                          "and tokenizer.json)")
    if a.gpus > 1:
        return _on_ranks(a, _serve_rank)
    return _serve(a)


def _check_serve_limits(a: argparse.Namespace) -> None:
    """serve's numeric options in range, and a server reachable from other machines only with an
    API key (or --insecure-no-auth)."""
    import ipaddress
    import math

    from ktflow.errors import ConfigError

    if a.prefill_step is not None and a.prefill_step < 1:
        raise ConfigError(f"--prefill-step must be at least 1 token, got {a.prefill_step}")
    for flag, v in (("--shutdown-timeout", a.shutdown_timeout), ("--keep-alive-timeout", a.keep_alive_timeout)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{flag} must be a finite number of seconds >= 0, got {v}")
    for flag, v in (("--step-timeout", a.step_timeout), ("--request-timeout", a.request_timeout)):
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be a finite number of seconds > 0, got {v}")
    if not (math.isfinite(a.max_body_mb) and a.max_body_mb > 0):
        raise ConfigError(f"--max-body-mb must be a finite number > 0, got {a.max_body_mb}")
    try:
        loopback = a.host == "localhost" or ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may reach other machines
    if not loopback and not a.api_key and not a.insecure_no_auth:
        raise ConfigError(f"--host {a.host} serves beyond this machine, and no API key is set: give --api-key KEY (or "
                          "KTFLOW_API_KEY), or --insecure-no-auth to serve it open to anyone who reaches the port")


def _serve_rank(rank: int, a: argparse.Namespace) -> int:
    """One rank of `serve --gpus N`: rank 0 serves (its Runner calls sent to the others), every
    other rank follows them (serve/ranks.py)."""
    from ktflow.serve.ranks import Channel

    a = argparse.Namespace(**{**vars(a), "rank": rank, **({"record_routing": None} if rank else {})})
    channel = Channel()  # every rank makes the group, in the same order
    if rank == 0:
        return _serve(a, channel)
    import ktflow
    from ktflow.runtime.ranks import check_plans_agree
    from ktflow.serve.ranks import follow
    from ktflow.serve.runner import PoolRunner

    compiled = _compiled(a, ktflow.load(Path(a.model)), allowed=("--max-batch",))
    check_plans_agree(compiled.plans.plans)
    compiled.prepare()
    channel.barrier()  # rank 0 may pack its CPU experts for long
    follow(PoolRunner(compiled, a.max_batch, prefix_cache=a.prefix_cache), channel)
    return 0


def _serve(a: argparse.Namespace, channel=None) -> int:
    """Serve on this process (with `channel`: rank 0 of several, the others following it)."""
    import ktflow
    from ktflow.errors import ConfigError
    from ktflow.serve.server import build, run
    from ktflow.serve.tokenizer import ServeTokenizer

    model_dir = Path(a.model)
    # first: a dir without a tokenizer fails before any loading
    tok = ServeTokenizer.from_dir(model_dir, special_in_messages=a.special_tokens_in_messages,
                                  chat_template=a.chat_template)
    model = ktflow.load(model_dir)
    if model.weights is None:
        raise ConfigError(f"{model_dir} has no weights (config.json only): serving runs the model, so it needs the "
                          "checkpoint's *.safetensors")
    compiled = _compiled(a, model, allowed=("--max-batch",))
    if tok.vocab_size > compiled.vocab_size:
        raise ConfigError(f"{model_dir}/tokenizer.json has {tok.vocab_size} tokens but the model's vocabulary has "
                          f"{compiled.vocab_size}: the tokenizer belongs to another model")
    runner = None
    if channel is not None:
        from ktflow.runtime.ranks import check_plans_agree
        from ktflow.serve.ranks import RanksRunner
        from ktflow.serve.runner import PoolRunner

        check_plans_agree(compiled.plans.plans)
    _print_ready(compiled)
    _follow_routing(a, compiled)
    rec = _record_routing(a, compiled)
    if channel is not None:
        channel.barrier()
        runner = RanksRunner(PoolRunner(compiled, a.max_batch, prefix_cache=a.prefix_cache), channel)
        runner.warm()
    try:
        served = build(compiled, tok, a.model_name or model_dir.resolve().name, max_batch=a.max_batch,
                       max_queue=a.max_queue, api_key=a.api_key or None, prefill_tokens=a.prefill_step, runner=runner,
                       max_body_bytes=int(a.max_body_mb * 2**20), tool_parser=a.tool_parser,
                       reasoning_parser=a.reasoning_parser, step_timeout=a.step_timeout,
                       prefix_cache=a.prefix_cache, request_timeout_s=a.request_timeout)
        if tok.chat_template is None:
            print("note: tokenizer_config.json has no chat_template: /v1/chat/completions answers 400, "
                  "/v1/completions works", flush=True)
        try:
            if a.insecure_no_auth and not a.api_key:
                print(f"warning: serving on {a.host} with no API key (--insecure-no-auth): anyone who reaches the "
                      "port may use it", flush=True)
            run(served, a.host, a.port, shutdown_timeout=a.shutdown_timeout, max_connections=a.max_connections,
                keep_alive_s=a.keep_alive_timeout, request_timeout_s=a.request_timeout)
        finally:
            _write_recorded(a, compiled, rec)
    finally:
        if runner is not None:
            runner.stop()
    return 0


def add_record_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record-routing", metavar="JSON", default=None,
                   help="count every router's picks as the model runs (on the GPU inside the captured decode step: "
                   "a few small kernels a layer) and write them as a routing profile at the end (serve: at shutdown), "
                   "which `compile --routing-profile` reads: per-layer expert frequencies for placement. The expert "
                   "cache's curves need `ktflow profile`, which decodes each prompt on its own")
