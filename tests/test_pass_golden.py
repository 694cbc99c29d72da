"""Golden text of the graph after every pass of the pipeline (small DeepSeek-V3-shaped model of
three layers, the paper's A100 preset with two NUMA nodes, one deferred expert in decode; decode
and prefill). Regenerate with KTFLOW_UPDATE_GOLDEN=1 and review."""

import os
from pathlib import Path

import pytest

from ktflow.costmodel.hw import PRESETS, Overheads
from ktflow.ir import print_graph, verify
from ktflow.plan.options import CompileContext, CompileOptions
from ktflow.passes import PIPELINE
from ktflow.models import family
from small_configs import CONFIGS


def golden_graph():
    raw = dict(CONFIGS["deepseek_v3"], num_hidden_layers=3)
    fam = family("deepseek_v3")
    cfg = fam.config(raw, "golden")
    return fam.build(cfg, cfg.weight_dtype)

GOLDEN = Path(__file__).parent / "golden"


def contexts():
    """The paper's A100 machine without fixed overheads (at this tiny size they would decide
    everything) and a VRAM budget that holds the dense work and 5 of the 8 experts."""
    hw = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0,
                                                                         cpu_sync_us=0)})
    opts = CompileOptions(vram_budget_gb=80e-6, defer=1)
    yield "decode", CompileContext(hw=hw, options=opts, phase="decode", tokens=1, batch=1, context=64,
                                   weight_itemsize=2, max_seq_len=128, device="cuda")
    yield "prefill", CompileContext(hw=hw, options=opts, phase="prefill", tokens=128, batch=1,
                                    context=64, weight_itemsize=2, max_seq_len=128, device="cuda")


@pytest.mark.parametrize("phase,ctx", list(contexts()))
@pytest.mark.parametrize("index", range(len(PIPELINE)))
def test_graph_after_pass_matches_golden(phase, ctx, index):
    g = golden_graph()
    for fn, stage in PIPELINE[: index + 1]:
        g = fn(g, ctx)
        verify(g, stage)
    name = PIPELINE[index][0].__name__
    path = GOLDEN / f"pass_{index + 1:02d}_{name}_{phase}.txt"
    text = print_graph(g)
    if os.environ.get("KTFLOW_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
