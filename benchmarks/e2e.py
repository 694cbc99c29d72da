"""End-to-end prefill and decode speed of hybrid execution (GPU machine).

Writes a random-weight checkpoint of a real model's shape (Qwen3-30B-A3B: 48 layers, 128
experts top-8, H 2048, I 768; DeepSeek-V2-Lite: 27 layers, 64 experts top-6 + 2 shared, H 2048,
I 1408, MLA) tensor by tensor: the key names and shapes come from ktflow's own spec of that
config (the names the HF checkpoints use), each tensor's bytes are streamed into safetensors
shards, and no module is ever built. Then, llama-bench style (random token ids, mean +- sd over
`--reps` rounds), for these variants of one model; the graph variants and llama.cpp's decode (with
`--llama`) run in rounds, each round every one of them once, so that the machine's drift (this
VM's DRAM read moves by 2x within minutes) falls on all of them alike, and their ratios compare
like with like:

  cpu          every node on the CPU, native experts
  eager        GPU dense work (torch ops, one launch per op) + native CPU experts, synchronous
  graph        the cuda_graph backend: each decode step one CUDA graph, experts through host-node
               submits and a wait on each task's done flag (cuStreamWaitValue32)
  graph+hostwait  the same with the other wait: a host node blocking until the task has run
  graph+hostsubmit  the graph submitting each CPU task through a host node instead of the default
               doorbell (a word the stream writes and the armed native dispatcher polls); `+bell`
               forces the doorbell
  graph+d<k>   the graph with Expert Deferral, k deferred picks per token (and d=auto)
  graph+run<K> greedy decoding K steps per graph launch (the `greedy_steps` option, default 8: each
               step's argmax fed to the next on the GPU; graph+run1 is one step per launch); combines
               with +d<k>, e.g. graph+d4+run1
  graph+onestream  an experiment kept for its RESULTS row: the copy lane issued on the compute
               stream (one stream, a straight-line graph)

prefill tokens/s for each `--prompts` length (cpu and eager: the prefill of the executor path) and
decode tokens/s for `--decode` tokens after a 32-token prompt. For each
decode variant also: CPU busy % (the native queue's task times over the wall time), GPU busy %
and API launches per token (torch.profiler over 16 steps), predicted vs measured per-layer time,
peak VRAM vs the plan, the hand-off of each layer's CPU task to the CPU and back (graph variants: one
traced step, `ktflow.plan.timeline.handoffs`), and the roofline: routed-expert bytes per token over the
DRAM read measured (the native pool streaming 1 GiB on every CPU) at the start of each round, the
fraction being the mean of the rounds' own fractions; exact variants also print their CPU task's
expert bytes per second (replayed) against it. Every routed expert stays on the CPU (the VRAM budget holds the dense weights
and the KV cache only), as on a machine whose GPU cannot hold the experts.

    python benchmarks/e2e.py --model dsv2lite             # the full table for one model
    python benchmarks/e2e.py --model qwen3 --layers 24    # fewer layers where the disk is small

Long-prompt prefill side by side with llama.cpp (`--prefill LENGTHS`): ktflow's prefill plans
(benchmarks/prefill.py: the compiler's choice per layer and bucket, and cpu / stream / split
forced) and, with `--llama`, the same checkpoint converted to GGUF and timed with llama-bench in
its modes (benchmarks/llama_cpp.py), llama.cpp first so the two never share the machine:

    python benchmarks/e2e.py --model qwen3 --layers 12 --prefill 512,2048,8192,32768 \
        --llama .carry/llama --llama-src .carry/llama-conv.tgz --tools .carry --variants graph,graph+d4

DeepSeek-V2-Lite side by side: all 27 layers (llama.cpp reads a deepseek2 GGUF of another depth
as full V2 and refuses it), with 8-bit experts on both sides so the checkpoint and the GGUF fit a
64 GB disk together:

    python benchmarks/e2e.py --model dsv2lite --prefill 512,2048,8192,32768 --gguf-type q8_0 \
        --expert-format int8 --llama .carry/llama --llama-src .carry/llama-conv.tgz --tools .carry

`--fp8` writes the checkpoint as an FP8 release instead (e4m3 linear weights with 128 x 128
block scales and quantization_config), which ktflow loads as published; its experts are packed in
`--expert-format`.

`--calibrate` fits the hardware profile to the graph variants run one step a launch
(`graph+run1`: their replayed steps are timed one by one; a greedy run's are not;
`ktflow.tools.calibrate.fit_replayed`): the first (exact) fits every term but the deferred task's extra
time, the first deferred one (`graph+run1+d2`) that term; then every variant's prediction with the
fitted profile is printed beside its measured step, its rounds' mean (the fitting variants' own
rows record the replayed step too).
A `graph+dauto` variant after the fit compiles with the fitted profile, so its choice is the
calibrated cost model's.

With `--vram-gb GB` this runs `user_configs.py` instead (its options): ktflow at a VRAM limit the
size of a consumer GPU (the allocator capped there), greedy and sampled decode, the decode-only
placement beside it; `llama_user.py` holds llama.cpp to the same limit, `user_configs.sh` runs both
on the GPU machine and `user_report.py` prints the targets.

Rows go to benchmarks/e2e.jsonl. The checkpoint dir (--dir, default /tmp/ktflow-e2e/<model>) is
reused when it exists and matches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402

MODELS = {
    "qwen3": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16",
        tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "dsv2lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.0, scoring_func="softmax", max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        rms_norm_eps=1e-6, torch_dtype="bfloat16", tie_word_embeddings=False),
}
SHARD_BYTES = 4 << 30


# ------------------------------------------------------------------------------------ checkpoint


def ready_checkpoint(model: str, cfg: dict, layers: int, fp8: bool, where: str | None) -> Path:
    """The random checkpoint of `cfg` (model `model`, cut to `layers` where nonzero) in `where`
    (default /tmp/ktflow-e2e/<model>[-<layers>l][-fp8]), written unless there, its pages flushed:
    the kernel writes a fresh checkpoint's dirty pages back for a minute or more after, and that
    writeback would compete with the CPU rows and the probe."""
    name = model + (f"-{layers}l" if layers else "") + ("-fp8" if fp8 else "")
    d = Path(where or f"/tmp/ktflow-e2e/{name}")
    t0 = time.perf_counter()
    write_checkpoint(cfg, d, fp8=fp8)
    os.sync()
    print(f"checkpoint {d} ready in {time.perf_counter() - t0:.1f} s (on disk)", flush=True)
    return d


def add_checkpoint_args(ap: argparse.ArgumentParser) -> None:
    """The options of a serving benchmark's model (`bench_checkpoint`) and of its plan: --model,
    --demo, --layers, --fp8, --dir, --vram-gb, --hw."""
    ap.add_argument("--model", default="qwen3", help="e2e.py's model shapes (qwen3, dsv3, ...)")
    ap.add_argument("--demo", action="store_true", help="the bundled demo model instead (CPU-sized)")
    ap.add_argument("--layers", type=int, default=12, help="cut the model to this many layers (0: all)")
    ap.add_argument("--fp8", action="store_true", help="an FP8 checkpoint (experts kept in FP8)")
    ap.add_argument("--dir", default=None, help="checkpoint dir (default under /tmp/ktflow-e2e)")
    ap.add_argument("--vram-gb", type=float, default=None, help="the VRAM limit the plan fits")
    ap.add_argument("--hw", default="this")


def bench_checkpoint(demo: bool, model: str, layers: int, fp8: bool, where: str | None) -> tuple[Path, str, int | None]:
    """(checkpoint dir, model name, layers) a serving benchmark runs on: the bundled demo model
    (`demo`), else `model`'s random checkpoint cut to `layers` (0: all; `ready_checkpoint`)."""
    if demo:
        import tempfile

        from ktflow.tools.demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint(Path(tempfile.gettempdir()) / "ktflow-demo")[0], "demo", None
    cfg = dict(MODELS[model], **({"num_hidden_layers": layers} if layers else {}))
    return ready_checkpoint(model, cfg, layers, fp8, where), model, cfg["num_hidden_layers"]


def write_checkpoint(cfg: dict, directory: Path, fp8: bool = False) -> None:
    """config.json, then bf16 safetensors shards of every tensor ktflow's spec of this config reads
    (ktflow.frontend.checkpoint's streaming writer, one tensor at a time), and the shard index. Large
    tensors are cut from a pool of random values (fast enough for 30+ GB); norms, biases and
    routers come from `random_tensor`. `fp8`: the layout of an FP8 release instead (linear
    weights in e4m3 with 128 x 128 block scales, quantization_config in config.json)."""
    import ktflow
    from ktflow.frontend.checkpoint import checkpoint_entries, random_tensor, write_safetensors
    from ktflow.frontend.quant import config_entry, scale_key, stored_fp8

    marker = directory / ".complete"
    if fp8:
        cfg = dict(cfg, quantization_config=config_entry())
    if marker.exists() and json.loads((directory / "config.json").read_text()) == cfg:
        print(f"using checkpoint {directory}")
        return
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    entries = checkpoint_entries(ktflow.load(directory).graph(None), torch.bfloat16)
    if fp8:  # each e4m3 weight followed by its block scales
        entries = [x for k, shape, dt in entries for x in (
            [(k, shape, torch.float8_e4m3fn), (scale_key(k), (-(-shape[0] // 128), -(-shape[1] // 128)), torch.float32)]
            if stored_fp8(k, shape) else [(k, shape, dt)])]
    rng = np.random.default_rng(0)
    pool = torch.from_numpy(rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).bfloat16()
    gen = torch.Generator().manual_seed(0)

    pool8 = (pool.float() * (448 / 0.125)).clamp_(-448, 448).to(torch.float8_e4m3fn) if fp8 else None

    def make(key: str) -> torch.Tensor:
        shape = shapes[key]
        if fp8 and key.endswith("_scale_inv"):  # e4m3's 448 covers the pool's values (sd 0.02, at most ~0.12)
            return torch.full(shape, 0.125 / 448)
        if fp8 and dtypes[key] == torch.float8_e4m3fn:
            if int(np.prod(shape)) > 1 << 20:  # cut from the pool made e4m3 once (no conversion per tensor)
                return cut(pool8, shape)
            return (make_values(key, shape).float() * (448 / 0.125)).clamp_(-448, 448).to(torch.float8_e4m3fn)
        return make_values(key, shape)

    def make_values(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if int(np.prod(shape)) <= 1 << 20:
            return random_tensor(key, shape, gen)
        return cut(pool, shape)

    def cut(src: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        parts, pos, left = [], int(rng.integers(0, len(src))), int(np.prod(shape))
        while left:  # the pool repeated from a random start
            take = min(left, len(src) - pos)
            parts.append(src[pos:pos + take])
            left, pos = left - take, 0
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)

    shapes = {k: s for k, s, _ in entries}
    dtypes = {k: dt for k, _, dt in entries}
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        nbytes = int(np.prod(e[1])) * e[2].itemsize
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    index, t0, written = {}, time.perf_counter(), 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / name, shard, make)
        index.update({k: name for k, _, _ in shard})
        written += sum(int(np.prod(sh)) * dt.itemsize for _, sh, dt in shard)
        print(f"  wrote {name} ({written / 1e9:.1f} GB, {written / 1e9 / (time.perf_counter() - t0):.2f} GB/s)",
              flush=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    marker.write_text("ok")


# ------------------------------------------------------------------------------------ measuring


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _sync():
    torch.cuda.synchronize()


def prefill_rate(compiled, vocab: int, tokens: int, reps: int) -> list[float]:
    import ktflow

    g = torch.Generator().manual_seed(tokens)
    ktflow.execute(compiled, torch.randint(0, vocab, (1, min(tokens, 16)), generator=g))  # warm
    out = []
    for _ in range(reps):
        ids = torch.randint(0, vocab, (1, tokens), generator=g)
        _sync()
        t0 = time.perf_counter()
        ktflow.execute(compiled, ids)
        _sync()
        out.append(tokens / (time.perf_counter() - t0))
    return out


def decode_run(compiled, vocab: int, new: int, seed: int, records: bool = False):
    """32-token prompt, then `new` greedy decode steps (logits='argmax': only the next ids reach
    the host, as `generate` runs greedy decoding); returns (tokens/s, CPU busy fraction, the
    replayed step's split)."""
    import ktflow
    from ktflow.backends.native import binding as native
    from ktflow.runtime.execute import decode_greedy

    g = torch.Generator().manual_seed(seed)
    logits, state = ktflow.execute(compiled, torch.randint(0, vocab, (1, 32), generator=g))
    nxt = logits[:, -1:].argmax(-1)
    if records:
        native.queue().set_recording(True)
    _sync()
    now = native.module().now_ns  # the native queue's clock (its records' timestamps)
    runner = compiled.executor(compiled.decode).runner if records else None
    bound = getattr(runner, "bound", {}).get(nxt.shape[0])
    host = []  # per step: replay called, replay returned, wait returned (graph variants)
    run = compiled.plans.options.greedy_steps  # steps per call (a +run<K> variant: one launch per K)
    run = run if new >= run else 1
    if run == 1 and bound is not None and bound.graph is not None:
        bound.graph, runner._wait = _Stamped(bound.graph, host, now), _stamped_wait(runner._wait, host, now)
    t0 = time.perf_counter_ns()
    n0 = now()
    calls = []  # per step: execute called, execute returned
    for _ in range(new // run):  # greedy, the argmax taken where the step runs (on the GPU in a captured graph)
        c0 = now()
        if run > 1:
            nxt = decode_greedy(compiled, nxt, state, run)[:, -1:]
        else:
            nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
        calls.append((c0, now()))
    new = run * (new // run)
    _sync()
    wall = time.perf_counter_ns() - t0
    if bound is not None and isinstance(bound.graph, _Stamped):
        bound.graph, runner._wait = bound.graph.graph, runner._wait.inner  # as they were
    busy, split = None, None
    if records:
        recs = native.queue().take_records()
        native.queue().set_recording(False)
        spans = sorted((max(s, n0), f) for _, _, s, f in recs)
        merged, end = 0, 0
        for s, f in spans:  # union of the task intervals
            if f > end:
                merged += f - max(s, end)
                end = f
        busy = merged / wall
        split = replay_split(recs, new, calls if run == 1 else None)
        if split is not None and run == 1:
            from ktflow.tools.calibrate import Replayed

            split["replayed"] = Replayed.from_records(recs, new, [(b - a) / 1e3 for a, b in calls])
        if split and len(host) == new:
            med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
            split.update(host_before_launch_us=med([(h[0] - c[0]) / 1e3 for h, c in zip(host, calls)]),
                         host_launch_us=med([(h[1] - h[0]) / 1e3 for h in host]),
                         host_after_wait_us=med([(c[1] - h[2]) / 1e3 for h, c in zip(host, calls)]))
    return new / (wall * 1e-9), busy, split


def fit_from_variant(plan, replayed, hw, calibrated, row: dict):
    """With --calibrate: a graph variant run one step a launch fits the profile from its replayed
    steps (`ktflow.tools.calibrate.fit_replayed`): the first, exact, every term but the deferred task's
    extra time; then the first deferred one only that term, on top (its gaps are not the GPU's
    chain), as `ktflow.tools.calibrate.calibrate` does. Returns the profile (`calibrated` where the
    variant adds nothing)."""
    from ktflow.tools.calibrate import deferred_tasks, fit_replayed

    deferred = any(deferred_tasks(plan))
    if calibrated is not None and (not deferred or calibrated.overheads.cpu_deferred_us > 0):
        return calibrated
    got = fit_replayed(plan, replayed, calibrated or hw, keep_rate=calibrated is not None)
    if got is None:
        print("  calibrate: this variant's tasks do not match its plan one to one; nothing fitted", flush=True)
        return calibrated
    profile, fitted = got  # after the exact variant's fit: its profile with the deferred term added (keep_rate)
    if calibrated is None and deferred:
        print("  calibrate: the first variant defers, so its gaps fit nothing; put graph+run1 (exact) first", flush=True)
    row["calibrated_from"] = row["variant"]
    for f in fitted:
        print(f"  calibrate: {f.term} {f.before:.4g} -> {f.after:.4g} ({f.note})", flush=True)
    return profile


def calibrated_prediction(model, opts: dict, plan, replayed, calibrated, row: dict) -> None:
    """With --calibrate: the variant compiled again with the fitted profile, its prediction printed
    beside the measured step: its replayed median (one step a launch) or, for a variant run K
    steps a launch (`replayed` None), its rounds' mean step."""
    again = compile_cpu_experts(model, dict(opts, hw=calibrated)).decode.predicted_step_us
    row["calibrated_predicted_step_us"] = round(again, 1)
    if replayed is not None:
        measured, how = replayed.wall_us, "replayed"
        row["replayed_step_us"] = round(measured, 1)
    else:
        measured, how = row["measured_step_us"], "rounds"
    print(f"  {row['variant']}: step {measured:.0f} us measured ({how}), predicted {plan.predicted_step_us:.0f} us, "
          f"{again:.0f} us calibrated ({100 * (again / measured - 1):+.1f}%)", flush=True)


def host_profile(compiled, vocab: int, steps: int = 32) -> None:
    """Where the host's time goes in replayed decode steps (cProfile; its own overhead inflates
    the Python-heavy lines)."""
    import cProfile
    import io
    import pstats

    import ktflow

    logits, state = ktflow.execute(compiled, torch.randint(0, vocab, (1, 32)))
    nxt = logits[:, -1:].argmax(-1)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        nxt, state = ktflow.execute(compiled, nxt, state, logits="argmax")
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print("\n".join("      " + line for line in out.getvalue().splitlines() if line.strip()), flush=True)


class _Stamped:
    """A captured graph whose replay() notes the clock before and after (benchmark only)."""

    def __init__(self, graph, host: list, now):
        self.graph, self.host, self.now = graph, host, now

    def replay(self):
        t = self.now()
        self.graph.replay()
        self.host.append([t, self.now()])


def _stamped_wait(wait, host: list, now):
    """The runner's end-of-step wait, noting when it returned (benchmark only)."""
    def stamped():
        wait()
        host[-1].append(now())
    stamped.inner = wait
    return stamped


def replay_split(recs: list, steps: int, calls: list | None) -> dict | None:
    """Where a replayed step's time goes, from the native queue's timestamps and the host's
    around each `execute` (one clock; no trace, no eager issue). Per CPU task: `cpu task` = from
    the dispatcher seeing it (doorbell or host submit) to its outputs written and done flag set
    (`first` the step's first task, `rest` the others); `between tasks` = from one task's done
    flag to the next task of the same step being seen: the GPU's wait on the flag, the copy back,
    the GPU work up to the next task's inputs, their copy to the host and the submit. Per step:
    `to first task` = from execute called to the first task seen (the host's work before the
    launch, the launch, the first layer's GPU work); `last task to return` = the last task's done
    flag to execute returning (the GPU's last layer and lm_head, the logits' copy, the host's
    wait and bookkeeping); `outside execute` = the caller's time between steps (its sampling).
    Medians in us (and the mean CPU task, whose slow outliers the median hides). Without `calls`
    (greedy runs, K steps a launch) only the per-task medians."""
    if not recs or len(recs) % steps or (calls is not None and len(calls) != steps):
        return None
    per = len(recs) // steps
    first, rest, between, lead, tail = [], [], [], [], []
    for n, i in enumerate(range(0, len(recs), per)):
        step = recs[i:i + per]
        took = [(f - s) / 1e3 for _, s, _, f in step]
        first.append(took[0])
        rest += took[1:]
        between += [(b[1] - a[3]) / 1e3 for a, b in zip(step, step[1:])]
        if calls is not None:
            lead.append((step[0][1] - calls[n][0]) / 1e3)
            tail.append((calls[n][1] - step[-1][3]) / 1e3)
    outside = [(b[0] - a[1]) / 1e3 for a, b in zip(calls, calls[1:])] if calls is not None else []
    med = lambda xs: round(statistics.median(xs), 1) if xs else None  # noqa: E731
    return dict(tasks_per_step=per, replay_cpu_task_us=med(first + rest),
                replay_cpu_task_mean_us=round(statistics.mean(first + rest), 1),
                replay_first_task_us=med(first), replay_other_tasks_us=med(rest),
                replay_between_tasks_us=med(between), replay_to_first_task_us=med(lead),
                replay_last_task_to_return_us=med(tail), replay_outside_execute_us=med(outside))


def profile_decode(compiled, vocab: int, steps: int = 16) -> dict:
    """GPU busy fraction and CUDA API launches per token over `steps` decode steps."""
    import ktflow
    from torch.profiler import ProfilerActivity, profile

    logits, state = ktflow.execute(compiled, torch.randint(0, vocab, (1, 32)))
    nxt = logits[:, -1:].argmax(-1)
    for _ in range(2):
        logits, state = ktflow.execute(compiled, nxt, state)
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            logits, state = ktflow.execute(compiled, nxt, state)
        _sync()
        wall = time.perf_counter() - t0
    launches = {"cudaGraphLaunch": 0, "cudaLaunchKernel": 0, "cuLaunchKernel": 0, "cudaMemcpyAsync": 0,
                "cuLaunchHostFunc": 0, "cudaLaunchKernelExC": 0}
    spans, kernels_in_order = [], []
    for e in prof.events():
        if e.name in launches:
            launches[e.name] += 1
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
            kernels_in_order.append((e.time_range.start, e.time_range.end, e.name))
    busy, end = 0.0, float("-inf")
    for s, f in sorted(spans):
        if f > end:
            busy += f - max(s, end)
            end = f
    total = sum(launches.values())
    kernels = {}  # GPU activity by name: (count, total us)
    for k in prof.key_averages():
        if k.device_type == torch.autograd.DeviceType.CUDA and k.count:
            kernels[k.key] = (k.count, k.self_device_time_total)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return dict(gpu_busy=busy * 1e-6 / wall, launches_per_token=total / steps, gpu_chain_us=gpu_chain(kernels_in_order),
                graph_launches_per_token=launches["cudaGraphLaunch"] / steps,
                gpu_ops_per_token=round(sum(c for c, _ in kernels.values()) / steps, 1),
                gpu_busy_us_per_token=round(busy / steps, 1),
                gpu_top_ops=[dict(name=n[:90], per_token=round(c / steps, 1), us_per_token=round(t / steps, 1))
                             for n, (c, t) in top])


def gpu_chain(kernels: list[tuple[float, float, str]], idle_us: float = 30.0) -> float | None:
    """The GPU's own work between two CPU tasks of a replayed step: the GPU timeline cut where
    it idles longer than `idle_us` (a CPU task, or the host between launches), each stretch from
    its first kernel (the copy of a task's result back) to the end of its last pinned copy (the
    next task's inputs; the doorbell is rung after it, and GPU work the plan puts after the
    submit, a shared expert, runs beside the task); median over the stretches, most of them one
    layer's. Between tasks (the native queue's records) minus this is the hand-off, both ways."""
    chains, stretch, end = [], [], float("-inf")
    for k in sorted(kernels) + [(float("inf"), float("inf"), "")]:
        if stretch and k[0] - end > idle_us:
            copies = [f for _, f, n in stretch if n == "copy_words"]
            if copies:
                chains.append(max(copies) - stretch[0][0])
            stretch = []
        stretch.append(k)
        end = max(end, k[1])
    return round(statistics.median(chains), 1) if chains else None


def traced_handoffs(compiled, vocab: int) -> dict:
    """Median hand-off per layer's CPU task, each way (timeline.handoffs), from one decode step
    run with the trace (issued eagerly with CUDA events around each GPU instruction: the launches add to
    what a replayed graph spends), beside the plan's prediction."""
    import ktflow
    from ktflow.plan.timeline import handoffs, with_measured_instructions

    logits, state = ktflow.execute(compiled, torch.randint(0, vocab, (1, 32)))
    nxt = logits[:, -1:].argmax(-1)
    logits, state = ktflow.execute(compiled, nxt, state)
    ex = compiled.executor(compiled.decode)
    ex.trace = 1
    ktflow.execute(compiled, nxt, state)

    def med(plan, way):
        h = [getattr(x, way) for x in handoffs(plan) if x.layer is not None]
        return round(statistics.median(h), 1) if h else None

    measured = with_measured_instructions(compiled.decode, ex.measured)
    return dict(handoff_to_cpu_us=med(measured, "to_cpu_us"), handoff_to_gpu_us=med(measured, "to_gpu_us"),
                predicted_handoff_to_cpu_us=med(compiled.decode, "to_cpu_us"),
                predicted_handoff_to_gpu_us=med(compiled.decode, "to_gpu_us"))


def expert_bytes_per_token(plan, fmt: str) -> float:
    """Routed-expert weight bytes one decode token reads on the CPU: each CPU part's picks (its
    rank range) that land on its experts, routing taken as uniform (random weights route about
    so; every pick where a part holds the whole layer), at the packed size of `fmt`."""
    from ktflow.ir.ops import Op, expert_weight_bytes

    total = 0.0
    for n in plan.ir.nodes:
        if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu":
            a = n.attrs
            lo, hi = a.rank_range
            rows = a.rows[1] - a.rows[0]
            total += (hi - lo) * len(a.ids) / a.experts * 3 * a.hidden * rows * expert_weight_bytes(fmt, a.hidden, rows)
    return total


# ------------------------------------------------------------------------------------ prefill


_SHARED = None


def shared_backend(compiled):
    """One cuda_graph backend for every variant (benchmark only): packed experts, their pinning
    and GPU weights made once."""
    global _SHARED
    from ktflow.backends.cuda.backend import CudaGraphBackend

    if _SHARED is None:
        _SHARED = CudaGraphBackend("cuda", torch.bfloat16, options=compiled.plans.options)
    return _SHARED


def budget_without_experts(wide_plan) -> float:
    """A VRAM budget (GB) for the dense nodes the cost model puts on the GPU when everything fits
    (`wide_plan`; an embedding lookup stays on the CPU) and the KV cache, where no routed expert fits."""
    from ktflow.ir.ops import Op

    nodes = wide_plan.ir.nodes
    dense = sum(n.weight_bytes(2) for n in nodes  # FP8-held weights at their stored size
                if n.op != Op.ROUTED_EXPERTS and n.place.device.value == "gpu")
    per_expert = min(n.weight_elems() / n.attrs.experts for n in nodes if n.op == Op.ROUTED_EXPERTS) * 2
    return (dense + wide_plan.memory.kv_cache_bytes + 0.5 * per_expert) / 1e9


def compile_cpu_experts(model, opts: dict):
    """Compile with every routed expert on the CPU: the cost model may leave a dense node (the
    embedding) on the CPU, and its room in the budget then takes experts; lower the budget by
    them until none is on the GPU."""
    import ktflow
    from ktflow.ir.ops import Op

    opts = dict(opts)
    while True:
        c = ktflow.compile(model, **opts)
        on_gpu = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]
        if not on_gpu:
            return c
        # each resident expert once (a deferred node holds the same experts as its immediate twin)
        # (at their held size: an FP8 checkpoint's experts may be held in FP8 at a tight budget)
        opts["vram_budget_gb"] -= sum(n.weight_bytes(2) for n in on_gpu if n.attrs.rank_range[0] == 0) / 1e9
        if opts["vram_budget_gb"] <= 0:
            raise SystemExit("compile_cpu_experts: no budget keeps every routed expert off the GPU "
                             f"({len(on_gpu)} expert nodes still there); pass placement options instead")


@dataclass
class Variant:
    """A decode variant compiled, prepared and warmed (its graphs captured), and its runs
    (tok/s, CPU busy, replayed split) as the rounds make them."""

    name: str
    c: Any
    opts: dict
    row: dict
    wait: str
    submit: str
    peak_vram_gb: float | None
    weights_gb: float
    runs: list = field(default_factory=list)

    def apply(self) -> None:
        """The shared backend's waits and submits as this variant runs them."""
        be = shared_backend(None)
        be.wait, be.submit = self.wait, self.submit


_DEFAULTS: dict = {}  # the shared backend's own wait and submit, before any variant changed them
ALL_CPUS = os.sched_getaffinity(0)  # before the cuda_graph backend confines this thread (keep_off_workers)


def prepare_variant(v: str, model, opts: dict, vocab: int) -> Variant:
    """Compile `v` with every routed expert on the CPU, prepare it on the shared backend and warm
    it (its step's graph and a greedy run's captured). The first variant's peak VRAM is the
    process's (later variants share its weights and staging: theirs is not told apart)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    c = compile_cpu_experts(model, opts)
    shared = shared_backend(c)
    if not _DEFAULTS:
        _DEFAULTS.update(wait=shared.wait, submit=shared.submit, weights=None)
    wait = "host" if v == "graph+hostwait" else _DEFAULTS["wait"]
    submit = "host" if "+hostsubmit" in v else "doorbell" if "+bell" in v else _DEFAULTS["submit"]
    c._backend = shared  # one backend for every variant (benchmark only): packed experts and GPU weights once
    if "+onestream" in v:  # experiment: the copy lane issued on the compute stream (a straight-line graph)
        c.executor(c.decode).runner.copy = shared.gpu_stream
    t1 = time.perf_counter()
    c.prepare()
    if _DEFAULTS["weights"] is None:
        _DEFAULTS["weights"] = torch.cuda.memory_allocated() - before  # the weights every variant shares
    print(f"  {v}: compiled, weights ready in {time.perf_counter() - t1:.1f} s", flush=True)
    assert not [n for n in c.decode.ir.nodes if n.op.value == "routed_experts" and n.place.device.value == "gpu"], \
        "a routed expert landed on the GPU: the budget is meant to hold none"
    x = Variant(v, c, opts, dict(variant=v), wait, submit, None, _DEFAULTS["weights"] / 1e9)
    x.apply()
    first = "peak" not in _DEFAULTS
    decode_run(c, vocab, max(4, 2 * c.plans.options.greedy_steps), seed=99)  # capture (a greedy run's too) and warm
    if first:  # the process's peak is this plan's alone only while it is the first (later ones share its buffers)
        x.peak_vram_gb = _DEFAULTS["peak"] = torch.cuda.max_memory_allocated() / 1e9
    return x


def gguf_made(a, ckpt: Path) -> bool:
    import llama_cpp

    return llama_cpp.gguf_for(ckpt, a.gguf_type).exists()


def llama_cpp_decode(a, ckpt: Path):
    """llama.cpp's decode in rounds beside ktflow's: (run round r, round r's best as text, the
    rows per thread count over every round). One llama-bench call a round times each thread count
    once (its own warm-up first)."""
    import llama_cpp

    binary = llama_cpp.llama_bench(Path(a.llama))
    gguf = llama_cpp.gguf_for(ckpt, a.gguf_type)
    threads = len(ALL_CPUS)
    tried = sorted({t for t in (threads - 2, threads - 1, threads) if t > 0})
    got: dict[int, list[dict]] = {}
    quiet = lambda s: None  # noqa: E731

    def run(r: int) -> None:  # on every CPU: the cuda_graph backend confined this thread to the pool's spare ones
        got[r] = llama_cpp.decode(binary, gguf, a.decode, 1, tried, quiet, cpus=ALL_CPUS)

    def best(r: int) -> str:
        ok = [x for x in got.get(r, []) if "decode_tok_s" in x]
        return max((f"{x['decode_tok_s']:.1f} ({x['threads']})" for x in ok), default="failed",
                   key=lambda t: float(t.split()[0]) if t != "failed" else -1)

    def rows() -> list[dict]:
        info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model,
                    layers=json.loads((ckpt / "config.json").read_text())["num_hidden_layers"], gguf=a.gguf_type)
        out = []
        for t in tried:
            rates = [x["decode_tok_s"] for r in sorted(got) for x in got[r] if x.get("threads") == t]
            if not rates:
                continue
            m, sd = mean_sd(rates)
            one = next(x for r in sorted(got) for x in got[r] if x.get("threads") == t)
            out.append(dict(one, decode_tok_s=round(m, 2), decode_sd=round(sd, 2), rounds=len(rates),
                            per_round=rates))
            print(f"  llama.cpp decode, {t:2d} threads: {m:7.2f} +- {sd:5.2f} tok/s over {len(rates)} rounds "
                  f"({one.get('model_type')})", flush=True)
        append_jsonl(a.out, [dict(info, table="decode", **r) for r in out])
        return out

    return run, best, rows


def finish_variant(a, x: Variant, vocab: int, cfg: dict, info: dict, dram: list[float]) -> dict:
    """Variant x's row from its rounds (tok/s mean +- sd, CPU busy, the last round's replayed
    split), what auto chose, the prediction, the roofline, memory, and the one-step diagnostics:
    the GPU's kernels (profiled), the hand-off (replayed; and from a traced, eagerly issued step).

    `dram`: the DRAM read measured in each round (one figure: for every run). The roofline fraction
    is the mean over the rounds of the round's tok/s over the round's own bound (routed-expert bytes
    per token at that round's DRAM read): this VM's DRAM read drifts by 10-30% within minutes."""
    from ktflow.ir.ops import Op
    from ktflow.plan.timeline import layer_times

    v, c, row = x.name, x.c, dict(info, **x.row)
    x.apply()
    if a.host_profile:
        host_profile(c, vocab)
    m, sd = mean_sd([r[0] for r in x.runs])
    busy = [r[1] for r in x.runs if r[1] is not None]
    split = dict(x.runs[-1][2] or {})
    replayed = split.pop("replayed", None)
    plan = c.decode
    split.update(tasks_by_kind(plan, replayed))
    if x.opts.get("defer") == "auto":  # what auto chose, and the candidates' predicted steps
        row["defer_cause"] = next((n.place.cause for n in plan.ir.nodes if n.op == Op.DEFER), "no deferral")
        print(f"  {v}: {row['defer_cause']}", flush=True)
    layers = [t for t in layer_times(plan) if t.layer is not None]
    predicted_layer = statistics.mean(t.span_us for t in layers)
    bpt = expert_bytes_per_token(plan, info["expert_format"])
    per_round = dram if len(dram) == len(x.runs) else [statistics.mean(dram)] * len(x.runs)
    bound = statistics.mean(per_round) * 1e9 / bpt
    fraction = statistics.mean(r[0] * bpt / (g * 1e9) for r, g in zip(x.runs, per_round))
    row.update(decode_tok_s=round(m, 2), decode_sd=round(sd, 2), rounds=len(x.runs),
               per_round=[round(r[0], 2) for r in x.runs],
               cpu_busy=round(statistics.mean(busy), 3) if busy else None,
               predicted_step_us=round(plan.predicted_step_us, 1), measured_step_us=round(1e6 / m, 1),
               predicted_layer_us=round(predicted_layer, 1),
               measured_layer_us=round(1e6 / m / cfg["num_hidden_layers"], 1),
               expert_bytes_per_token=bpt, roofline_tok_s=round(bound, 2), roofline_fraction=round(fraction, 3),
               dram_gbps_rounds=[round(g, 1) for g in per_round],
               peak_vram_gb=round(x.peak_vram_gb, 3) if x.peak_vram_gb is not None else None,
               allocated_after_prepare_gb=round(x.weights_gb, 3), wait=x.wait,
               predicted_gpu_weights_gb=round(sum(n.weight_bytes(2) for n in plan.ir.nodes
                                                  if n.place.device.value == "gpu") / 1e9, 3),
               fp8_held_weights=sum(w.held == "fp8" for n in plan.ir.nodes for w in n.weights),
               predicted_kv_gb=round(plan.memory.kv_cache_bytes / 1e9, 3),
               predicted_activation_mb=round(plan.memory.activation_bytes / 1e6, 2),
               # the decode runs' 32-token prompts run a prefill plan whose staging stays allocated:
               # the run's peak is the larger of the two plans' predictions
               predicted_vram_gb=round(max(plan.memory.gpu_bytes, c.prefill_plan(32).memory.gpu_bytes) / 1e9, 3),
               predicted_decode_plan_vram_gb=round(plan.memory.gpu_bytes / 1e9, 3),
               defer=str(c.plans.options.defer))
    row.update(split)
    if "+run" not in v:  # (a +run variant's single steps are its base variant's)
        row.update(profile_decode(c, vocab))
        row["gpu_us_per_layer"] = round(row["gpu_busy_us_per_token"] / cfg["num_hidden_layers"], 1)
        for t in row["gpu_top_ops"]:
            print(f"      {t['per_token']:7.1f}/token {t['us_per_token']:8.1f} us/token  {t['name']}")
        row.update(traced_handoffs(c, vocab))
    if row.get("gpu_chain_us") is not None and row.get("replay_between_tasks_us") is not None \
            and c.plans.options.defer is None:  # (deferred tasks overlap the GPU's work: no plain chain)
        row["replay_handoff_us"] = round(row["replay_between_tasks_us"] - row["gpu_chain_us"], 1)
    tasks = sum(n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu" for n in plan.ir.nodes)
    if c.plans.options.defer is None and tasks and row.get("replay_cpu_task_mean_us"):
        # one CPU task per MoE layer: its expert bytes over its mean replayed time, against the DRAM read
        row["replay_cpu_task_gbps"] = round(bpt / tasks / row["replay_cpu_task_mean_us"] / 1e3, 1)
        row["replay_cpu_task_dram_fraction"] = round(row["replay_cpu_task_gbps"] / statistics.mean(per_round), 3)
    print_variant(row, bound)
    return row


def tasks_by_kind(plan, replayed) -> dict:
    """A replayed run's CPU tasks (one step a launch) split by kind: those running a layer's picks
    needed now and the deferred ones, each kind's median measured and predicted time (us), so a
    deferred task's time can be read beside the other's (and its picks: top_k - d against d)."""
    from ktflow.tools.calibrate import deferred_tasks, predicted_tasks

    if replayed is None:
        return {}
    kinds, predicted = deferred_tasks(plan), predicted_tasks(plan)[0]
    if len(kinds) != len(replayed.tasks_us):
        return {}
    out = {}
    for name, want in (("now", False), ("deferred", True)):
        got = [(m, p) for m, p, d in zip(replayed.tasks_us, predicted, kinds) if d == want]
        if got:
            out[f"replay_task_{name}_us"] = round(statistics.median(m for m, _ in got), 1)
            out[f"predicted_task_{name}_us"] = round(statistics.median(p for _, p in got), 1)
    if "replay_task_deferred_us" in out:
        print(f"      replayed tasks (medians): now "
              f"{out['replay_task_now_us']} us (predicted {out['predicted_task_now_us']}), deferred "
              f"{out['replay_task_deferred_us']} us (predicted {out['predicted_task_deferred_us']})", flush=True)
    return out


def print_variant(row: dict, bound: float) -> None:
    v, m, sd = row["variant"], row["decode_tok_s"], row["decode_sd"]
    print(f"  {v:12s} decode: {m:7.2f} +- {sd:5.2f} tok/s ({100 * row['roofline_fraction']:.0f}% of the roofline, "
          f"{bound:.1f} at the rounds' mean DRAM read); "
          + (f"CPU task {row['replay_cpu_task_gbps']} GB/s of experts ({100 * row['replay_cpu_task_dram_fraction']:.0f}% "
             "of the DRAM read); " if "replay_cpu_task_gbps" in row else "") +
          f"step {1e6 / m:.0f} us vs predicted {row['predicted_step_us']:.0f} us; "
          f"CPU busy {row['cpu_busy']}, GPU busy {row.get('gpu_busy')}, launches/token "
          f"{row.get('launches_per_token')}; peak VRAM {row['peak_vram_gb']} GB vs plan {row['predicted_vram_gb']} GB"
          + (f"; hand-off per layer, replayed: {row['replay_handoff_us']} us both ways (between tasks "
             f"{row['replay_between_tasks_us']} us, the GPU's own work between them {row['gpu_chain_us']} us)"
             if "replay_handoff_us" in row else "")
          + (f"; hand-off per layer to the CPU {row['handoff_to_cpu_us']} us, back {row['handoff_to_gpu_us']} us "
             f"(traced step, issued eagerly; predicted {row['predicted_handoff_to_cpu_us']} / "
             f"{row['predicted_handoff_to_gpu_us']})" if "handoff_to_cpu_us" in row else "")
          + (f"; replayed (medians, us): CPU task {row['replay_cpu_task_us']} (mean {row['replay_cpu_task_mean_us']}, "
             f"first {row['replay_first_task_us']}, others {row['replay_other_tasks_us']}), between tasks "
             f"{row['replay_between_tasks_us']}, execute to first task {row.get('replay_to_first_task_us')}, last task to "
             f"return {row.get('replay_last_task_to_return_us')}, outside execute {row.get('replay_outside_execute_us')}; "
             f"host: execute to launch {row.get('host_before_launch_us')}, launch {row.get('host_launch_us')}, wait "
             f"returned to execute returning {row.get('host_after_wait_us')} "
             f"(GPU kernels {row.get('gpu_us_per_layer')} us per layer, {row.get('gpu_ops_per_token')} GPU ops/token)"
             if row.get("replay_cpu_task_us") is not None else ""), flush=True)


def own_variant(a, v: str, model, opts: dict, prompts: list[int], vocab: int, cfg: dict, info: dict,
                dram: list[float]) -> dict:
    """The cpu and eager variants, measured on their own after the rounds (their prefill rows too):
    all-CPU (torch's CPU attention with every thread) and the decode plan run op by op."""
    import ktflow

    if v == "cpu":
        opts = dict(opts, device="cpu", placement="cpu", backend="native")
        # CPU attention runs in torch: every CPU (the cuda_graph backend confined this thread and set one)
        os.sched_setaffinity(0, ALL_CPUS)
        torch.set_num_threads(len(ALL_CPUS))
        c = ktflow.compile(model, **opts)
    else:
        c = compile_cpu_experts(model, opts)
        c._backend = shared_backend(c)
    c.prepare()
    if v == "eager":  # the decode plan runs op by op: no graph runner
        c.executor("decode").runner = None
    row = dict(variant=v)
    for p in prompts if v == "cpu" or a.prompts else []:
        if v == "cpu" and p > 2048:
            continue  # torch_ref's CPU attention materialises [heads, p, p] scores: minutes per rep
        rates = prefill_rate(c, vocab, p, a.reps)
        m, sd = mean_sd(rates)
        row[f"prefill_{p}_tok_s"], row[f"prefill_{p}_sd"] = round(m, 1), round(sd, 1)
        print(f"  {v:12s} prefill {p:5d}: {m:9.1f} +- {sd:6.1f} tok/s", flush=True)
    if v != "cpu":
        decode_run(c, vocab, 4, seed=99)
    x = Variant(v, c, opts, row, shared_backend(None).wait, shared_backend(None).submit, 0.0, 0.0)
    torch.cuda.reset_peak_memory_stats()
    x.runs = [decode_run(c, vocab, a.decode, seed=r) for r in range(a.reps)]
    x.peak_vram_gb = torch.cuda.max_memory_allocated() / 1e9
    return finish_variant(a, x, vocab, cfg, info, dram)


def run_llama(a, ckpt: Path, lengths: list[int]) -> list[dict]:
    """The checkpoint as GGUF, prompt processing in llama.cpp's modes (rows also to the JSONL)."""
    import llama_cpp

    layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    if a.model == "dsv2lite" and layers not in (26, 27):
        # llama.cpp's loader reads a deepseek2 GGUF of other depths as full V2 and asks for q_lora_rank
        print(f"llama.cpp skipped: it loads a DeepSeek-V2-Lite GGUF only with 26 or 27 layers, not {layers} "
              "(to fit the disk, use all 27 with --gguf-type q8_0 --expert-format int8)", flush=True)
        return []
    binary = llama_cpp.llama_bench(Path(a.llama))
    gguf = llama_cpp.gguf_for(ckpt, a.gguf_type)
    secs = llama_cpp.convert(ckpt, gguf, a.gguf_type, Path(a.llama_src), Path(a.tools), binary)
    print(f"GGUF {gguf} ({gguf.stat().st_size / 1e9:.1f} GB{f', converted in {secs:.0f} s' if secs else ''})", flush=True)
    threads = len(os.sched_getaffinity(0))
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = llama_cpp.bench(binary, gguf, lengths, a.prefill_reps, threads, log) if lengths else []
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model, layers=layers,
                gguf=a.gguf_type)
    append_jsonl(a.out, [dict(info, table="prefill", **r) for r in rows])
    return rows  # (decode: in rounds beside ktflow's, llama_cpp_decode)


def run_prefill(a, model, base: dict, budget: float, lengths: list[int], info: dict, vocab: int, llama_rows, hw) -> None:
    """ktflow's prefill variants at every length, then the side-by-side table."""
    from prefill import measure

    rows = []
    layers = info["layers"]
    for v in a.prefill_variants.split(","):
        # one bucket per measured length: each length runs the plan predicted for it
        c = compile_cpu_experts(model, dict(base, device="cuda", vram_budget_gb=budget, backend="cuda_graph",
                                            prefill_experts=v, prefill_buckets=lengths))
        c._backend = shared_backend(c)
        t1 = time.perf_counter()
        c.prepare()
        print(f"  prefill {v}: buckets {[p.step_tokens for p in c.prefill]}, ready in {time.perf_counter() - t1:.1f} s",
              flush=True)
        for n in lengths:
            row = dict(info, table="prefill", system=f"ktflow {v}", **measure(c, vocab, n, a.prefill_reps, hw, layers))
            instrs = row.pop("instructions")
            if a.trace_dir:  # the traced step, for reading the timeline
                Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
                (Path(a.trace_dir) / f"prefill-{v}-{n}.json").write_text(json.dumps(instrs))
            rows.append(row)
            print(f"  ktflow {v:6s} prefill {n:6d}: {row['tok_s']:9.1f} +- {row['sd']:6.1f} tok/s (bucket "
                  f"{row['bucket']}, {row['decisions']}); predicted {row['predicted_tok_s']}; PCIe bound "
                  f"{row['pcie_bound_fraction']}; busy {row['busy']}; layer {row['step_layer_us']} us (traced {row['measured_layer_us']}) vs predicted "
                  f"{row['predicted_layer_us']}; VRAM {row['peak_vram_gb']} / plan {row['planned_vram_gb']} GB", flush=True)
            append_jsonl(a.out, [row])
        del c
        shared_backend(None).release_staging()  # the next variant's peak VRAM is its own
        gc.collect()
        torch.cuda.empty_cache()
    print_prefill_table(rows, llama_rows, lengths)


def print_prefill_table(rows: list[dict], llama_rows: list[dict], lengths: list[int]) -> None:
    """tok/s per system and length; ratios of ktflow auto to llama.cpp's best mode."""
    systems = list(dict.fromkeys([r["system"] for r in rows] + [r["system"] for r in llama_rows if "prompt" in r]))
    at = {(r["system"], r["prompt"]): r for r in rows + llama_rows if "prompt" in r}
    print("\n| prefill tok/s | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for sysname in systems:
        cells = [f"{at[sysname, n]['tok_s']:.0f} +- {at[sysname, n]['sd']:.0f}" if (sysname, n) in at else "—"
                 for n in lengths]
        print(f"| {sysname} | " + " | ".join(cells) + " |")
    best = []
    for n in lengths:
        modes = [r for r in llama_rows if r.get("prompt") == n and "whole model" not in r["system"]]
        auto = at.get(("ktflow auto", n))
        if modes and auto:
            top = max(modes, key=lambda r: r["tok_s"])
            best.append(f"{n}: {auto['tok_s'] / top['tok_s']:.2f}x {top['system']}")
    if best:
        print("ktflow auto / llama.cpp's best mode: " + "; ".join(best))


# ------------------------------------------------------------------------------------ main


def main() -> int:
    if any(x == "--vram-gb" or x.startswith("--vram-gb=") for x in sys.argv[1:]):
        import user_configs  # a VRAM limit: the user-configuration benchmark, with its own options

        return user_configs.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), required=True)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the real model (0: all)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prompts", default="32,512,2048,8192", help="prefill lengths of the cpu and eager variants")
    ap.add_argument("--prefill", default="", help="long-prompt prefill lengths (comma list): the side-by-side table")
    ap.add_argument("--prefill-variants", default="auto,cpu,stream,split")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--llama", default="", help="llama-bench: a build dir, or a dir with the prebuilt tarball's parts")
    ap.add_argument("--llama-src", default="", help="llama.cpp converter: a .tgz of convert_hf_to_gguf.py, "
                    "conversion/ and gguf-py/")
    ap.add_argument("--tools", default="", help="dir with gguf-convert.py and tiny-tokenizer.py")
    ap.add_argument("--gguf-type", default="bf16")
    ap.add_argument("--trace-dir", default="", help="write each traced prefill step's measured instructions here")
    ap.add_argument("--variants",
                    default="cpu,eager,graph,graph+hostwait,graph+d1,graph+d2,graph+d3,graph+d4,graph+dauto")
    ap.add_argument("--expert-format", default="auto", choices=["auto", "bf16", "int8", "int4", "fp8"],
                    help="CPU experts' format (auto: fp8 for an --fp8 checkpoint, else bf16)")
    ap.add_argument("--fp8", action="store_true", help="write the checkpoint as an FP8 release (e4m3 linear weights "
                    "with 128 x 128 block scales) instead of bf16")
    ap.add_argument("--fp8-on-gpu", default="auto", choices=["auto", "keep", "dequantize"],
                    help="an FP8 checkpoint's dense weights on the GPU (compile option fp8_on_gpu)")
    ap.add_argument("--calibrate", action="store_true",
                    help="fit the profile to the first graph variant's replayed steps (ktflow.tools.calibrate.fit_replayed) "
                         "and print, for every variant after it, its prediction with the fitted profile beside the "
                         "measured step (out of sample: fitted on another variant)")
    ap.add_argument("--host-profile", action="store_true",
                    help="graph variants: cProfile over 32 replayed decode steps, the host's top functions printed")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the checkpoint (and with --llama its GGUF) and stop: a later run times them")
    ap.add_argument("--out", default=str(HERE / "e2e.jsonl"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("e2e.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import ktflow
    from ktflow.backends.native import binding as native
    from ktflow.tools.probe import probe

    cfg = dict(MODELS[a.model], **({"num_hidden_layers": a.layers} if a.layers else {}))
    d = ready_checkpoint(a.model, cfg, a.layers, a.fp8, a.dir)
    lengths = [int(x) for x in a.prefill.split(",") if x]
    if a.prepare_only:
        if a.llama:
            import llama_cpp

            gguf = llama_cpp.gguf_for(d, a.gguf_type)
            llama_cpp.convert(d, gguf, a.gguf_type, Path(a.llama_src), Path(a.tools), llama_cpp.llama_bench(Path(a.llama)))
            print(f"GGUF {gguf} ready", flush=True)
        return 0
    llama_rows = run_llama(a, d, lengths) if a.llama else []  # before ktflow's pool spins up
    native.pool(spare=2)  # the pool the cuda_graph backend makes (the first caller sizes it): probe with it
    hw = probe(log=lambda line: print(f"  probe: {line}", flush=True))  # full sizes: the rates must come from past the caches
    # the physical limit: DRAM read bandwidth with every CPU (a one-off pool; the workers' pool leaves two)
    dram_pool = native.module().Pool(threads=0, groups=0, pin=True)
    dram = native.module().stream_read_gbps(dram_pool)
    prompts = [int(p) for p in a.prompts.split(",") if p]
    max_seq = max(prompts + lengths + [32 + a.decode]) + 8
    model = ktflow.load(d)
    base = dict(hw=hw, max_seq_len=max_seq, expert_format=a.expert_format, fp8_on_gpu=a.fp8_on_gpu)
    probe_compiled = ktflow.compile(model, device="cuda", vram_budget_gb=1000, allow_oversize=True, **base)
    fmt = probe_compiled.plans.options.expert_format  # auto resolved by the checkpoint
    budget = budget_without_experts(probe_compiled.decode)
    info = dict(commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), model=a.model,
                checkpoint="fp8" if a.fp8 else "bf16",
                layers=cfg["num_hidden_layers"], expert_format=fmt, dram_gbps=round(dram, 1),
                threads=native.pool().threads, probed_expert_gbps=round(hw.cpu.gemv_gbps, 1))
    print(f"{a.model}, {cfg['num_hidden_layers']} layers, experts {fmt}; DRAM {dram:.1f} GB/s; "
          f"VRAM budget {budget:.2f} GB (dense weights + KV cache)", flush=True)
    vocab = cfg["vocab_size"]
    if lengths:
        run_prefill(a, model, base, budget, lengths, info, vocab, llama_rows, hw)
    variants = [v for v in a.variants.split(",") if v]
    decoded: list[dict] = []
    calibrated = None  # --calibrate: the profile fitted to the first graph variant
    ready: list[Variant] = []
    for v in variants:
        if v in ("cpu", "eager"):  # measured on their own (their prefill rows too), after the interleaved ones
            continue
        opts = dict(base, device="cuda", vram_budget_gb=budget, backend="cuda_graph")
        if "+run" in v:  # greedy decode runs of K steps per launch
            opts["greedy_steps"] = int(v.split("+run")[1].split("+")[0])
        if "+d" in v:
            k = v.split("+d")[1].split("+")[0]
            opts["defer"] = "auto" if k == "auto" else int(k)
            if k == "auto" and calibrated is not None:  # auto decides from the fitted profile
                opts["hw"] = calibrated
        x = prepare_variant(v, model, opts, vocab)
        ready.append(x)
        if a.calibrate and x.c.plans.options.greedy_steps == 1:  # fit now, so that a later auto variant uses it
            from ktflow.tools.calibrate import measure_replayed

            replayed = measure_replayed(x.c, 32)  # as `ktflow calibrate` measures: with greedy runs of 8
            if replayed is not None:
                calibrated = fit_from_variant(x.c.decode, replayed, hw, calibrated, x.row)
                x.row["fit_replayed_step_us"] = round(replayed.wall_us, 1)
        elif a.calibrate and calibrated is None:
            print(f"  calibrate: {v} runs {x.c.plans.options.greedy_steps} steps a launch, whose steps are not "
                  "timed one by one; put graph+run1 (and graph+run1+d2) first to fit from them", flush=True)
    # llama.cpp's decode in the same rounds, where run_llama made its GGUF
    llama_decode = llama_cpp_decode(a, d) if a.llama and ready and a.decode and gguf_made(a, d) else []
    round_dram: list[float] = []
    for r in range(a.reps):  # rounds: every system once per round, so a machine's drift falls on all alike
        round_dram.append(native.module().stream_read_gbps(dram_pool, 1 << 30, 3))
        if llama_decode:
            llama_decode[0](r)
        for x in ready:
            x.apply()
            x.runs.append(decode_run(x.c, vocab, a.decode, seed=r, records=True))
        print(f"  round {r + 1} of {a.reps} (DRAM read {round_dram[-1]:.1f} GB/s): "
              + ", ".join(f"{x.name} {x.runs[-1][0]:.1f}" for x in ready)
              + (f"; llama.cpp {llama_decode[1](r)}" if llama_decode else "") + " tok/s", flush=True)
    if llama_decode:
        rows = llama_decode[2]()
        llama_rows += rows
    for x in ready:
        decoded.append(finish_variant(a, x, vocab, cfg, info, round_dram))
        if a.calibrate and calibrated is not None:
            replayed = (x.runs[-1][2] or {}).get("replayed")
            calibrated_prediction(model, x.opts, x.c.decode, replayed, calibrated, decoded[-1])
        append_jsonl(a.out, [decoded[-1]])  # row by row: a run cut short keeps what it measured
    for v in [v for v in variants if v in ("cpu", "eager")]:
        opts = dict(base, device="cuda", vram_budget_gb=budget, backend="native")
        decoded.append(own_variant(a, v, model, opts, prompts, vocab, cfg, info, [dram]))
        append_jsonl(a.out, [decoded[-1]])
    print_decode_table(decoded, [r for r in llama_rows if "decode_tok_s" in r])
    return 0


def print_decode_table(rows: list[dict], llama_rows: list[dict]) -> None:
    """Decode tok/s of each variant beside llama.cpp's best thread count measured in this run."""
    best = max(llama_rows, key=lambda r: r["decode_tok_s"]) if llama_rows else None
    print("\ndecode, one run: variant, tok/s, x llama.cpp best"
          + (f" ({best['decode_tok_s']} +- {best['decode_sd']} tok/s at {best['threads']} threads)" if best else ""))
    for r in rows:
        ratio = f"{r['decode_tok_s'] / best['decode_tok_s']:.2f}x" if best else "-"
        print(f"  {r['variant']:18s} {r['decode_tok_s']:7.2f} +- {r['decode_sd']:5.2f}  {ratio}  "
              f"roofline {100 * r['roofline_fraction']:.0f}%")


if __name__ == "__main__":
    raise SystemExit(main())
