"""An agent-like conversation through the serving engine, with prefix reuse and without (issue 45).

    python benchmarks/prefix_cache.py --model qwen3 --layers 12 --fp8 --vram-gb 24 --turns 16 --grow 2048
    python benchmarks/prefix_cache.py --demo --turns 6 --grow 96          # the bundled demo model, on the CPU

Each turn's prompt is the previous turn's prompt, the previous answer and `--grow` new tokens
(random ids: a tool result or a user message); each turn answers `--answer` greedy tokens (the
next prompt carries an answer of that length as random ids: a decoded answer's entries are never
reused, so which ids it holds changes nothing measured). The same
conversation runs twice in one process on one compiled model, on two fresh slot pools: every
prompt prefilled whole (`prefix_cache=False`), then reusing what the slot's cache holds. Each turn's
time to first token is measured from its submission to the engine (no HTTP), after a two-turn
warm-up (the prefill steps' first uses). Where that time goes is recorded per turn: until the
runner starts the sequence, in the runner's start, in its prefill steps (their count and the
longest), and the rest. Prints a table per turn and the totals' ratio; appends one row per mode to
--out. The target: total time to first token with reuse <= 0.2x without.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import add_checkpoint_args, bench_checkpoint  # noqa: E402


def timed_runner(compiled, slots: int, prefix_cache: bool):
    """A PoolRunner recording when it starts a sequence and how long its start and prefill calls
    take (`log`: (what, start, seconds) since the last `log.clear()`)."""
    from ktflow.serve.runner import PoolRunner

    class Timed(PoolRunner):
        def start(self, *args, **kw):
            t = time.perf_counter()
            try:
                return super().start(*args, **kw)
            finally:
                self.log.append(("start", t, time.perf_counter() - t))

        def prefill(self, items):
            t = time.perf_counter()
            try:
                return super().prefill(items)
            finally:
                self.log.append(("prefill", t, time.perf_counter() - t))

    runner = Timed(compiled, slots, prefix_cache=prefix_cache)
    runner.log = []
    return runner


def breakdown(log: list, t0: float, ttft: float) -> dict:
    """Where a turn's time to first token went, from its runner log (calls after submission t0)."""
    starts = [(t, d) for what, t, d in log if what == "start"]
    fills = [d for what, _, d in log if what == "prefill"]
    wait = starts[0][0] - t0 if starts else 0.0
    start = sum(d for _, d in starts)
    return dict(wait_s=wait, start_s=start, prefill_calls=len(fills), prefill_s=sum(fills),
                longest_prefill_s=max(fills, default=0.0), other_s=ttft - wait - start - sum(fills))


def conversation(compiled, slots: int, prefix_cache: bool, turns: int, grow: int, answer: int, step: int,
                 seed: int) -> list[dict]:
    """One conversation on a fresh pool: per turn, its prompt length, the tokens reused, the
    time to first token (and where it went: `breakdown`) and the whole turn's time."""
    from ktflow.serve.engine import Delta, Engine, Failed, Finished, GenRequest

    runner = timed_runner(compiled, slots, prefix_cache)
    runner.warm()
    engine = Engine(runner, lambda ids: "", prefill_tokens=step)
    engine.start()
    g = torch.Generator().manual_seed(seed)
    vocab = compiled.vocab_size
    prompt: list[int] = []
    rows = []
    try:
        for turn in range(turns):
            prompt = prompt + torch.randint(0, vocab, (grow,), generator=g).tolist()
            done, first, out = threading.Event(), [], {}

            def emit(ev, first=first, out=out, done=done):
                if isinstance(ev, Delta) and not first:
                    first.append(time.perf_counter())
                if isinstance(ev, (Finished, Failed)):
                    out["ev"] = ev
                    done.set()

            runner.log.clear()
            t0 = time.perf_counter()
            req = GenRequest(list(prompt), answer, emit, ignore_eos=True)
            engine.submit(req)
            done.wait()
            ev = out["ev"]
            if isinstance(ev, Failed):
                raise RuntimeError(f"turn {turn} failed: {ev.message}")
            t1 = time.perf_counter()
            rows.append(dict(turn=turn, prompt=len(prompt), cached=ev.cached_tokens, ttft_s=first[0] - t0,
                             turn_s=t1 - t0, **breakdown([x for x in runner.log if x[1] < first[0]], t0,
                                                         first[0] - t0)))
            # the answer back into the conversation: ids of the answer's length (a decoded answer's
            # entries are never reused, so which ids they are changes nothing measured here)
            prompt = prompt + torch.randint(0, vocab, (answer,), generator=g).tolist()
    finally:
        engine.stop()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--grow", type=int, default=2048, help="new tokens a turn")
    ap.add_argument("--answer", type=int, default=32, help="tokens answered a turn")
    ap.add_argument("--step", type=int, default=None, help="prefill tokens a scheduler iteration, as `ktflow serve "
                    "--prefill-step` (default: the server's, min(256, the largest prefill bucket))")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "prefix_cache.jsonl"))
    ap.add_argument("--run-id", default=time.strftime("%Y%m%d-%H%M%S"))
    a = ap.parse_args(argv)
    import ktflow

    need = a.turns * (a.grow + a.answer) + 64
    ckpt, name, layers = bench_checkpoint(a.demo, a.model, a.layers, a.fp8, a.dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    opts = dict(hw=a.hw, device=device, max_seq_len=need, max_batch=a.slots)
    if a.vram_gb:
        opts["vram_gb"] = a.vram_gb
    compiled = ktflow.compile(ktflow.load(ckpt), **opts)
    step = min(a.step or 256, compiled.chunk_tokens)
    info = dict(bench="prefix_cache", run_id=a.run_id, commit=commit(), **machine(),
                gpu=torch.cuda.get_device_name(0) if device == "cuda" else None, model=name, layers=layers,
                checkpoint="fp8" if a.fp8 else "bf16", vram_gb=a.vram_gb, turns=a.turns, grow=a.grow, answer=a.answer,
                step=step, slots=a.slots)
    conversation(compiled, a.slots, False, min(2, a.turns), a.grow, a.answer, step, seed=2)  # warm: first uses
    runs = {}
    for mode in (False, True):
        runs[mode] = conversation(compiled, a.slots, mode, a.turns, a.grow, a.answer, step, seed=1)
    off, on = runs[False], runs[True]
    print(f"\n{name} ({layers or 'all'} layers), {device}, {a.turns} turns of +{a.grow} tokens, answers of {a.answer}, "
          f"prefill step {step}, commit {info['commit']}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT whole':>11} {'TTFT reuse':>11} {'ratio':>6}")
    for x, y in zip(off, on):
        print(f"{x['turn']:>4} {x['prompt']:>7} {y['cached']:>7} {x['ttft_s'] * 1e3:>9.1f}ms {y['ttft_s'] * 1e3:>9.1f}ms "
              f"{y['ttft_s'] / x['ttft_s']:>6.3f}")
    print(f"\nwhere the reuse run's time to first token went (ms): wait for the runner, its start, its prefill "
          "calls (count, longest), the rest")
    for y in on:
        print(f"{y['turn']:>4} {y['wait_s'] * 1e3:>8.1f} {y['start_s'] * 1e3:>8.1f} {y['prefill_s'] * 1e3:>9.1f} "
              f"({y['prefill_calls']:>3}, {y['longest_prefill_s'] * 1e3:>7.1f}) {y['other_s'] * 1e3:>8.1f}")
    total = {m: sum(r["ttft_s"] for r in runs[m]) for m in runs}
    print(f"total time to first token: {total[False]:.2f} s whole, {total[True]:.2f} s with reuse: "
          f"{total[True] / total[False]:.3f}x (target <= 0.2x)")
    append_jsonl(a.out, [dict(info, prefix_cache=m, total_ttft_s=round(total[m], 4),
                              turns_detail=[{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                            for r in runs[m]]) for m in runs])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
