"""Compile time against model size: DeepSeek-V3-shaped configs with L layers x E routed experts
(config only, no weights), all passes plus the schedule and buffer plan, on a hardware preset;
the two full-size models also with defer=auto. Prints a table and appends JSONL to
benchmarks/compile_scale.jsonl.

    python benchmarks/compile_scale.py [--hw paper-a100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ktflow
from common import append_jsonl, commit, machine

HERE = Path(__file__).parent
V3 = json.loads((HERE.parent / "tests/data/deepseek-v3-config/config.json").read_text())
KIMI = json.loads((HERE.parent / "tests/data/kimi-k2-config/config.json").read_text())


def measure(cfg: dict, hw: str, repeats: int, **options) -> tuple[list[float], int]:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        model = ktflow.load(d)
        times, instrs = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            c = ktflow.compile(model, hw=hw, **options)
            times.append(time.perf_counter() - t0)
            instrs = len(c.prefill.instructions) + len(c.decode.instructions)
    return times, instrs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", default="paper-a100")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "compile_scale.jsonl"))
    a = ap.parse_args()
    cases = [(f"v3-shape L{layers} E{experts}", dict(V3, num_hidden_layers=layers, n_routed_experts=experts))
             for layers in (8, 16, 32, 61) for experts in (64, 256)]
    cases += [("deepseek-v3 (61 x 256)", V3), ("kimi-k2 (61 x 384)", KIMI)]
    cases = [(name, cfg, {}) for name, cfg in cases]
    cases += [("deepseek-v3, defer=auto", V3, {"defer": "auto"}), ("kimi-k2, defer=auto", KIMI, {"defer": "auto"})]
    rows = []
    print(f"{'model':28s} {'layers':>6s} {'experts':>7s} {'instrs':>6s} {'compile s (mean +- sd)':>24s}")
    for name, cfg, options in cases:
        times, instrs = measure(cfg, a.hw, a.repeats, **options)
        mean, sd = statistics.mean(times), statistics.stdev(times) if len(times) > 1 else 0.0
        print(f"{name:28s} {cfg['num_hidden_layers']:6d} {cfg['n_routed_experts']:7d} {instrs:6d} {mean:16.3f} +- {sd:.3f}")
        # the plans' instructions, in the field `steps` the recorded rows (and results.py's table) name
        rows.append(dict(bench="compile_scale", model=name, options=options, layers=cfg["num_hidden_layers"],
                         experts=cfg["n_routed_experts"], steps=instrs, hw=a.hw, seconds_mean=mean, seconds_sd=sd,
                         repeats=a.repeats, **machine(), commit=commit(), ktflow=ktflow.__version__))
    append_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
