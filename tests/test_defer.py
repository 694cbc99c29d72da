"""Expert Deferral: the paper's formula computed independently (HF transformers' own DeepSeek-V3
modules, patched) against ktflow's decode plans; d=0 is the plain plan; prefill never defers;
choices and bad input; rules D1 and D2."""

import dataclasses

import pytest
import torch

import ktflow
from ktflow.errors import ConfigError
from ktflow.ir import violations
from ktflow.ir.ops import Op
from conftest import DATA

MOE_LAYERS = (1, 2)  # the tiny deepseek_v3 case: 3 layers, the first dense


def hf_with_deferral(hf, d: int):
    """Patch every DeepseekV3MoE of `hf` so that, while state['on'], each token's top k-d experts
    by weight are immediate and the other d land in the next MoE layer's output:
    O_j = I_j + S_j(I_j) + R_imm_j(I_j) + R_def_{j-1}(I_{j-1}); the last MoE layer defers none."""
    state = {"on": False, "prev": None}
    k = hf.config.num_experts_per_tok

    def make(block, layer):
        def forward(hidden_states):
            shape = hidden_states.shape
            _, w, idx = block.gate(hidden_states)
            order = w.argsort(dim=-1, descending=True, stable=True)
            w, idx = w.gather(1, order), idx.gather(1, order)
            flat = hidden_states.view(-1, shape[-1])
            dj = d if state["on"] and layer != MOE_LAYERS[-1] else 0
            out = block.experts(flat, idx[:, :k - dj], w[:, :k - dj]).view(shape) + block.shared_experts(hidden_states)
            if state["on"] and state["prev"] is not None:
                out = out + state["prev"]
            state["prev"] = block.experts(flat, idx[:, k - dj:], w[:, k - dj:]).view(shape) if dj else None
            return out
        return forward

    for i in MOE_LAYERS:
        block = hf.model.layers[i].mlp
        block.forward = make(block, i)
    return state


def assert_deferred_decode_matches(hf, compiled, d, seed, steps):
    """Prefill 12 tokens (no deferral on either side), then `steps` decode steps with the patched
    HF model as the reference; float32, max |diff| <= 1e-5 * max |logit|."""
    import copy

    hf = copy.deepcopy(hf)
    state = hf_with_deferral(hf, d)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 12), generator=g)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
    logits, st = ktflow.execute(compiled, ids)
    assert (logits.cpu() - out.logits).abs().max() <= 1e-5 * out.logits.abs().max()
    past = out.past_key_values
    for _ in range(steps):
        nxt = torch.randint(0, 96, (2, 1), generator=g)
        state.update(on=True, prev=None)
        with torch.no_grad():
            o = hf(nxt, past_key_values=past, use_cache=True)
        state["on"] = False
        past = o.past_key_values
        got, st = ktflow.execute(compiled, nxt, st)
        assert (got - o.logits).abs().max() <= 1e-5 * o.logits.abs().max()


@pytest.mark.parametrize("d", [1, 2, 3])
def test_deferral_matches_the_papers_formula(tiny_dirs, d):
    path, hf = tiny_dirs("deepseek_v3")
    model = ktflow.load(path)
    c = ktflow.compile(model, hw="paper-a100", device="cpu", defer=d, max_seq_len=64)
    assert "L1.deferred" in c.decode.ir and all("L1.deferred" not in p.ir for p in c.prefill)
    assert_deferred_decode_matches(hf, c, d, seed=5, steps=6)


def test_deferral_changes_the_result(tiny_dirs):
    """Guard against a vacuous comparison: with d=3 the logits differ from the plain model's."""
    path, hf = tiny_dirs("deepseek_v3")
    model = ktflow.load(path)
    plain = ktflow.compile(model, hw="cpu", max_seq_len=32)
    late = ktflow.compile(model, hw="cpu", max_seq_len=32, defer=3)
    ids = torch.tensor([[1, 2, 3, 4]])
    _, s1 = ktflow.execute(plain, ids)
    _, s2 = ktflow.execute(late, ids)
    a, _ = ktflow.execute(plain, torch.tensor([[7]]), s1)
    b, _ = ktflow.execute(late, torch.tensor([[7]]), s2)
    assert (a - b).abs().max() > 1e-3 * a.abs().max()


def test_d0_is_exactly_the_plain_plan(demo_dir):
    model = ktflow.load(demo_dir)
    a = ktflow.compile(model, hw="paper-a100", defer=0)
    b = ktflow.compile(model, hw="paper-a100")
    assert a.decode.ir == b.decode.ir and a.decode.instructions == b.decode.instructions


def test_prefill_never_defers(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", defer=2)
    assert not any(n.op == Op.DEFER for p in c.prefill for n in p.ir.nodes)
    assert [n.name for n in c.decode.ir.nodes if n.op == Op.DEFER] == ["L1.deferred", "L2.deferred"]


def test_per_layer_list_and_the_last_layer(demo_dir):
    model = ktflow.load(demo_dir)  # MoE layers 1, 2, 3
    g = ktflow.compile(model, hw="cpu", defer=[1, 3, 0]).decode.ir
    assert g.by_name("L1.experts.def").attrs.ranks == (3, 4) and g.by_name("L2.experts.def").attrs.ranks == (1, 4)
    assert "L3.experts.def" not in g and g.by_name("L3.ffn_res").inputs[-1] == "L2.deferred"
    with pytest.raises(ConfigError, match="defer list has 2 entries; the model has 3 MoE layers"):
        ktflow.compile(model, hw="cpu", defer=[1, 0])
    with pytest.raises(ConfigError, match="last MoE layer \\(3\\) defers nothing"):
        ktflow.compile(model, hw="cpu", defer=[1, 1, 1])


@pytest.mark.parametrize("d", [4, 9, -1])
def test_defer_must_leave_an_immediate_expert(demo_dir, d):
    with pytest.raises(ConfigError, match=f"defer={d} is not possible: each token has top_k=4"):
        ktflow.compile(ktflow.load(demo_dir), hw="cpu", defer=d)


def test_auto_on_the_papers_machine():
    """DeepSeek-V3 bf16 on the paper's A100 machine: auto compares the candidates' predicted steps
    and keeps d = 3 for every MoE layer but the last, as the paper chose (section 4.2); the
    per-layer rule predicts about the same step with more deferral (d = 5 in layer 3, which keeps
    only 154 experts on the CPU), and the least deferral within 1% wins."""
    m = ktflow.load(DATA / "deepseek-v3-config")
    paper = dict(hw="paper-a100", expert_format="bf16", fp8_on_gpu="dequantize")  # the paper's bf16 experts
    auto = ktflow.compile(m, defer="auto", **paper)
    plain = ktflow.compile(m, **paper)
    g = auto.decode.ir
    d = {n.attrs.layer: 8 - n.attrs.ranks[0] for n in g.nodes
         if n.op == Op.ROUTED_EXPERTS and n.attrs.rank_range[0] > 0 and n.place.numa == 0}
    assert d == {j: 3 for j in range(3, 60)}
    cause = g.by_name("L10.deferred").place.cause
    assert "auto: d=3 predicted" in cause and "d=0 " in cause and "the per-layer rule " in cause
    assert auto.decode.predicted_step_us < 0.9 * plain.decode.predicted_step_us


def test_the_per_layer_rule_covers_the_gpu_gap():
    """The defer pass's own "auto" (the per-layer rule, one of compile's candidates): each layer
    defers as few picks as keep the CPU busy through the next layer's GPU work. Layer 3 keeps
    only 154 of its experts on the CPU (102 hot ones fit the A100), so each deferred pick is
    less CPU work there and it needs d = 5; the last MoE layer defers none."""
    from ktflow.costmodel.hw import PRESETS
    from ktflow.plan.options import CompileContext, CompileOptions
    from ktflow.passes import run_pipeline

    m = ktflow.load(DATA / "deepseek-v3-config")
    opts = CompileOptions(defer="auto", expert_format="bf16", vram_reserve_gb=1.0)  # the A100's room as sized here
    ctx = CompileContext(hw=PRESETS["paper-a100"], options=opts, phase="decode", tokens=1, batch=1, context=2048,
                         weight_itemsize=2, max_seq_len=4096, device="cuda")
    g = run_pipeline(m.graph(m.config.weight_dtype), ctx)
    d = {n.attrs.layer: 8 - n.attrs.ranks[0] for n in g.nodes
         if n.op == Op.ROUTED_EXPERTS and n.attrs.rank_range[0] > 0 and n.place.numa == 0}
    assert d == {**{j: 3 for j in range(4, 60)}, 3: 5}
    assert "auto: deferred CPU work" in g.by_name("L10.deferred").place.cause


def test_auto_on_deepseek_v25_defers_all_but_two():
    """DeepSeek-V2.5 (160 experts, top-6) on the paper's machine: its next-layer GPU work outlasts
    3 deferred experts, so auto defers 4, the most that keeps 2 immediate (the paper's choice)."""
    g = ktflow.compile(ktflow.load(DATA / "deepseek-v2.5-config"), hw="paper-a100", defer="auto").decode.ir
    assert {6 - n.attrs.ranks[0] for n in g.nodes
            if n.op == Op.ROUTED_EXPERTS and n.name.endswith(".def.numa0")} == {4}


def test_d1_and_d2_fire():
    m = ktflow.load(DATA / "deepseek-v3-config")
    g = ktflow.compile(m, hw="cpu", defer=2).decode.ir
    assert {r for r, _, _ in violations(g, "lowered")} == set()
    d = g.by_name("L5.deferred")
    bad = g.replace_nodes(dataclasses.replace(n, attrs=dataclasses.replace(d.attrs, dst=7)) if n.name == d.name else n
                          for n in g.nodes)
    assert "D1" in {r for r, _, _ in violations(bad, "lowered")}
    last = g.by_name("L60.experts")
    assert last.attrs.rank_range == (0, 8)
    bad = g.replace_nodes(dataclasses.replace(n, attrs=dataclasses.replace(n.attrs, ranks=(0, 6)))
                          if n.name == "L60.experts" else n for n in g.nodes)
    assert "D2" in {r for r, _, _ in violations(bad, "lowered")}
