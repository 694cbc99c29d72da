"""The examples in examples/ run as documented: each pass does what it says on the demo model,
through the Python API and the CLI, and the comparison script prints the differences."""

import subprocess
import sys
from pathlib import Path

import pytest

import ktflow
from ktflow.ir.ops import Op

EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

from defer_by_depth import defer_by_depth  # noqa: E402
from pin_experts import pin_layers  # noqa: E402


@pytest.fixture(scope="module")
def model(demo_dir):
    return ktflow.load(demo_dir)


def test_pin_layers_puts_those_experts_on_the_gpu(model):
    budget = dict(hw="paper-a100", vram_budget_gb=0.004)  # no expert fits by itself
    base = ktflow.compile(model, **budget)
    assert all(n.place.device.value == "cpu" for n in base.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS)
    c = ktflow.compile(model, **budget, allow_oversize=True, passes=[("after:place_by_intensity", pin_layers({2}))])
    experts = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS]
    on_gpu = {n.attrs.layer for n in experts if n.place.device.value == "gpu"}
    assert on_gpu == {2} and all("pinned to the GPU" in n.place.cause for n in experts if n.attrs.layer == 2)
    assert c.decode.memory.gpu_bytes > base.decode.memory.gpu_bytes  # the pinned experts are counted


def test_defer_by_depth_defers_more_in_deeper_layers(model):
    from ktflow.plan.diff import _deferred

    c = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004,
                       passes=[("replace:defer_experts", defer_by_depth)])
    moe = sorted({n.attrs.layer for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS})
    d = _deferred(c.decode.ir)
    want = {layer: (1 if i < len(moe) // 2 else 2) for i, layer in enumerate(moe[:-1])}
    assert d == want
    assert any(p.endswith("defer_by_depth") for p in c.plans.pipeline)


def test_the_examples_run_from_the_command_line(demo_dir, tmp_path):
    env_py = sys.executable
    out = tmp_path / "p.json"
    r = subprocess.run([env_py, "-m", "ktflow.tools.cli", "compile", str(demo_dir), "--hw", "paper-a100",
                        "--vram-budget-gb", "0.004", "--allow-oversize",
                        "--pass", f"{EXAMPLES / 'pin_experts.py'}:pin_first_moe_layer@after=place_by_intensity",
                        "--pass", f"{EXAMPLES / 'defer_by_depth.py'}:defer_by_depth@replace=defer_experts",
                        "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pf = ktflow.Compiled.load(out, demo_dir).plans
    assert [p.rsplit(":", 1)[1] for p in pf.pipeline] == ["annotate_costs", "place_by_intensity", "pin_first_moe_layer",
                                                         "place_prefill_experts", "defer_by_depth", "split_numa",
                                                         "lower", "schedule", "plan_buffers"]
    r = subprocess.run([env_py, str(EXAMPLES / "compare_plans.py"), str(demo_dir), "--vram-budget-gb", "0.004"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "pinned to the GPU" in r.stdout and "deferred picks 0 -> 1" in r.stdout and "predicted step" in r.stdout
