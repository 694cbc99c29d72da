"""Example script: compile one model two ways and compare the plans.

    python examples/compare_plans.py MODEL_DIR [--hw paper-a100]

Compiles MODEL_DIR as ktflow would by default and with the two example passes (the first MoE
layer's experts pinned to the GPU, deferral by depth), then prints what changed
(`ktflow.plan.diff.plan_diff`: placements with their causes, deferral per layer, memory, predicted
step and per-layer times). The demo checkpoint works: `ktflow demo` writes it.
"""

import argparse
import sys
from pathlib import Path

import ktflow
from ktflow.plan.diff import plan_diff

sys.path.insert(0, str(Path(__file__).parent))
from defer_by_depth import defer_by_depth  # noqa: E402
from pin_experts import pin_first_moe_layer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--hw", default="paper-a100")
    ap.add_argument("--vram-budget-gb", type=float, default=None)
    a = ap.parse_args(argv)
    model = ktflow.load(a.model)
    opts = dict(hw=a.hw, vram_budget_gb=a.vram_budget_gb)
    base = ktflow.compile(model, **opts)
    tried = ktflow.compile(model, **opts, passes=[("after:place_by_intensity", pin_first_moe_layer),
                                                  ("replace:defer_experts", defer_by_depth)])
    print(plan_diff(base.plans, tried.plans).text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
