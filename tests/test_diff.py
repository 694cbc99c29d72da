"""`ktflow diff` / `plan_diff`: placements, deferral per layer, memory and predicted times that
differ between two plans, and nothing for a plan against itself."""

import pytest

import ktflow
from ktflow.plan.diff import plan_diff


@pytest.fixture(scope="module")
def plans(demo_dir):
    model = ktflow.load(demo_dir)
    base = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004)
    deferred = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004, defer=2)
    cpu = ktflow.compile(model, hw="paper-a100", placement="cpu")
    return base, deferred, cpu


def test_a_plan_against_itself_has_no_differences(plans):
    base, _, _ = plans
    d = plan_diff(base.plans, base.plans)
    assert not d.options and d.pipeline is None and not d.only_a and not d.only_b
    assert all(not p.placements and not p.deferral for p in d.pairs)
    assert "layer" not in d.text() and "->" in d.text()  # step times listed, unchanged


def test_deferral_and_its_time_show_per_layer(plans):
    base, deferred, _ = plans
    d = plan_diff(base.plans, deferred.plans)
    assert d.options["defer"] == (None, 2)
    dec = next(p for p in d.pairs if p.label == "decode")
    moe = sorted(dec.deferral)
    assert moe and all(dec.deferral[layer] == (0, 2) for layer in moe)
    assert dec.step_us[1] != dec.step_us[0]
    assert any(c.node.endswith(".def") and c.before == "-" for c in dec.placements)  # the deferred parts are new
    text = d.text()
    assert "option defer: None -> 2" in text and f"layer {moe[0]}: deferred picks 0 -> 2" in text


def test_placements_and_memory_moved_to_the_cpu(plans, tmp_path, capsys):
    from ktflow.tools import cli

    base, _, cpu = plans
    d = plan_diff(base.plans, cpu.plans)
    dec = next(p for p in d.pairs if p.label == "decode")
    moved = {c.node: c for c in dec.placements}
    assert moved["L0.attn"].before == "gpu" and moved["L0.attn"].after == "cpu"
    assert "placement=cpu" in moved["L0.attn"].cause
    assert dec.memory["GPU memory"][1] == 0 < dec.memory["GPU memory"][0]
    base.save(tmp_path / "a.json")
    cpu.save(tmp_path / "b.json")
    assert cli.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "L0.attn: gpu -> cpu" in out and "GPU memory:" in out and "option placement: auto -> cpu" in out


def test_deferral_holds_no_second_copy_of_the_cpu_experts(plans):
    """The deferred part of a layer's CPU experts computes from the immediate part's pack (the
    native backend shares it): the memory plan counts it once, so deferral changes no memory."""
    base, deferred, _ = plans
    dec = next(p for p in plan_diff(base.plans, deferred.plans).pairs if p.label == "decode")
    assert dec.memory["weights"][0] == dec.memory["weights"][1]
    assert dec.memory["host memory"][0] == dec.memory["host memory"][1]
