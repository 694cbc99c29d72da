"""Predicted Expert Deferral effect: for each model config and defer setting, the compiler's
predicted decode step (batch 1) and the steady-state layer's GPU busy, CPU busy and GPU/CPU
overlap (mean over the middle half of the layers), next to what `defer="auto"` picks. These are
cost-model predictions, not measurements. Prints a table and appends JSONL to
benchmarks/deferral_predicted.jsonl.

    python benchmarks/deferral_predicted.py [--hw paper-a100]
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

import ktflow
from ktflow.ir.ops import Op
from ktflow.plan.timeline import layer_times
from common import append_jsonl, commit

HERE = Path(__file__).parent
DATA = HERE.parent / "tests/data"
MODELS = {"DeepSeek-V3": ("deepseek-v3-config", (0, 1, 2, 3, 4, "auto")),
          "DeepSeek-V2.5": ("deepseek-v2.5-config", (0, 2, 3, 4, "auto")),
          "Qwen2-57B-A14B": ("qwen2-57b-a14b-config", (0, 1, 2, 3, "auto"))}


def chosen(plan) -> str:
    """The deferral counts a plan uses, most common first: '3' or '3; 5 in 1 layer'."""
    k = next(n.attrs.top_k for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS)
    per_layer = {n.attrs.layer: k - n.attrs.ranks[0] for n in plan.ir.nodes
                 if n.op == Op.ROUTED_EXPERTS and ".def" in n.name}
    counts = Counter(per_layer.values()).most_common()
    if not counts:
        return "0"
    return "; ".join([str(counts[0][0])] + [f"{d} in {c} layer{'s' if c > 1 else ''}" for d, c in counts[1:]])


def steady_state(plan) -> dict:
    layers = [lt for lt in layer_times(plan) if lt.layer is not None]
    mid = layers[len(layers) // 4: 3 * len(layers) // 4]
    return dict(layer_us=statistics.mean(lt.span_us for lt in mid),
                gpu_busy=statistics.mean(lt.gpu_busy for lt in mid),
                cpu_busy=statistics.mean(lt.cpu_busy for lt in mid),
                overlap=statistics.mean(lt.overlap_us / lt.span_us for lt in mid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", default="paper-a100")
    ap.add_argument("--out", default=str(HERE / "deferral_predicted.jsonl"))
    a = ap.parse_args()
    rows = []
    print(f"{'model':16s} {'defer':>22s} {'step ms':>8s} {'tok/s':>6s} {'layer us':>9s} {'GPU':>5s} {'CPU':>5s} {'overlap':>7s}")
    for name, (cfg, settings) in MODELS.items():
        model = ktflow.load(DATA / cfg)
        for d in settings:
            plan = ktflow.compile(model, hw=a.hw, defer=d).decode
            s = steady_state(plan)
            label = f"auto ({chosen(plan)})" if d == "auto" else str(d)
            step_ms = plan.predicted_step_us / 1e3
            print(f"{name:16s} {label:>22s} {step_ms:8.1f} {1e3 / step_ms:6.2f} {s['layer_us']:9.0f} "
                  f"{s['gpu_busy']:5.0%} {s['cpu_busy']:5.0%} {s['overlap']:7.0%}")
            rows.append(dict(bench="deferral_predicted", model=name, hw=a.hw, defer=d, chosen=chosen(plan),
                             step_ms=step_ms, **s, commit=commit(), ktflow=ktflow.__version__))
    append_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
