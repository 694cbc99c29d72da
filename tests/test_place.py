"""Placement by the cost model under a VRAM budget: what lands where and why, memory
accounting, hot experts from a routing profile, forced modes, errors, and that a hybrid plan
(GPU placements run on the CPU here) computes what the all-CPU plan computes."""

import json

import pytest
import torch

import ktflow
from ktflow.errors import ConfigError
from ktflow.costmodel.hw import PRESETS, Overheads
from ktflow.ir.ops import Op
from ktflow.ir.types import Device
from ktflow.costmodel.memory import activation_peak
from ktflow.plan.artifact import placement_table
from conftest import DATA

GiB = 2**30
#: the paper's A100 machine without fixed overheads: at toy sizes they would decide everything
A100_NO_OVERHEAD = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0,
                                                                                   cpu_sync_us=0)})


def devices(plan):
    return {n.name: n.place.device for n in plan.ir.nodes}


@pytest.fixture(scope="module")
def v3():
    return ktflow.load(DATA / "deepseek-v3-config")


def test_without_a_gpu_everything_runs_on_the_cpu(v3):
    c = ktflow.compile(v3, hw="cpu")
    assert set(devices(c.decode).values()) == {Device.CPU}
    assert "has no GPU" in c.decode.ir.by_name("L5.attn").place.cause
    assert c.decode.memory.gpu_bytes == 0


def test_deepseek_v3_on_the_papers_a100(v3):
    c = ktflow.compile(v3, hw="paper-a100", max_seq_len=4096)
    g = c.decode.ir
    for n in g.nodes:
        if n.op in (Op.ATTENTION, Op.GATE, Op.MLP, Op.RMSNORM, Op.ADD, Op.LM_HEAD):
            assert n.place.device == Device.GPU, n.name
    cpu_experts = [n for n in g.nodes if n.op == Op.REDUCE]  # the sum of each layer's NUMA shards
    # held in FP8 on the GPU, the first MoE layer's 256 experts fit whole; the other 57 keep (most
    # of) theirs in DRAM
    assert len(cpu_experts) == 57 and g.by_name("L3.experts").place.device == Device.GPU
    assert "held in fp8" in g.by_name("L3.experts").place.cause
    assert "decode intensity 1.00 FLOP/B" in cpu_experts[-1].place.cause
    assert "2 NUMA shards (tp" in cpu_experts[-1].place.cause
    m = c.decode.memory
    assert m.gpu_bytes <= 40 * GiB
    gpu_w = sum(n.weight_bytes(2) for n in g.nodes if n.place.device == Device.GPU)  # FP8-held ones at their size
    # no host copy of GPU weights (host activations: the live values, no GPU rule's scratch)
    assert m.host_bytes == pytest.approx(m.weight_bytes - gpu_w + activation_peak(g, c.decode.step_tokens))


def test_a_smaller_gpu_keeps_the_most_valuable_work(v3):
    """DeepSeek-V3's dense weights dequantized to bf16 overflow a 16 GB GPU: the routers and
    some attention stay; held in FP8 as the release stores them (auto, since they do not fit
    dequantized), every attention fits."""
    c = ktflow.compile(v3, hw="paper-4080", max_seq_len=4096, fp8_on_gpu="dequantize")
    g = c.decode.ir
    assert c.decode.memory.gpu_bytes <= 16 * GiB
    gates = [n for n in g.nodes if n.op == Op.GATE]
    assert all(n.place.device == Device.GPU for n in gates)  # small and read by every token
    attn = [n for n in g.nodes if n.op == Op.ATTENTION]
    assert 0 < sum(n.place.device == Device.GPU for n in attn) < len(attn)
    assert any("over the VRAM budget" in n.place.cause for n in attn)
    # a 2k cache, decode first: at 4k, or with the default VRAM plan (which trades two attention
    # layers for a 2k prefill step's activations), the prefill steps' MLA activations leave no room
    fp8 = ktflow.compile(v3, hw="paper-4080", max_seq_len=2048, prefill_reserve="none", vram_reserve_gb=1)
    attn = [n for n in fp8.decode.ir.nodes if n.op == Op.ATTENTION]
    assert fp8.decode.memory.gpu_bytes <= 16 * GiB
    assert all(n.place.device == Device.GPU and "held in fp8" in n.place.cause for n in attn)


def test_prefill_and_decode_place_identically(v3):
    """Placement is decided once, for decode; prefill plans differ only where they stream CPU
    experts to the GPU (place_prefill_experts), so with prefill_experts='cpu' they are identical."""
    c = ktflow.compile(v3, hw="paper-4080", prefill_experts="cpu")
    assert all(devices(p) == devices(c.decode) for p in c.prefill)
    c = ktflow.compile(v3, hw="paper-4080")
    dense = {k: v for k, v in devices(c.decode).items() if ".experts" not in k}
    for p in c.prefill:
        assert {k: v for k, v in devices(p).items() if k in dense} == dense


def test_hot_experts_from_a_routing_profile_go_first(demo_dir, tmp_path):
    model = ktflow.load(demo_dir)  # 32 experts, top-4, MoE layers 1..3
    hot = [0.0] * 32
    for e in (3, 17, 21, 30):
        hot[e] = 0.9
    rest = (4 - sum(hot)) / 28
    probs = [p or rest for p in hot]
    prof = tmp_path / "routing.json"
    prof.write_text(json.dumps({"layers": {"2": probs}}))
    expert_bytes = 3 * 256 * 128 * 2
    dense = ktflow.compile(model, hw=A100_NO_OVERHEAD, placement="auto", vram_budget_gb=1.0)
    dense_bytes = sum(n.weight_elems() * 2 for n in dense.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    kv = dense.decode.memory.kv_cache_bytes
    budget = (dense_bytes + kv + 4.5 * expert_bytes) / 1e9  # the dense part and four experts
    c = ktflow.compile(model, hw=A100_NO_OVERHEAD, vram_budget_gb=budget, routing_profile=str(prof), numa_nodes=1)
    g = c.decode.ir
    hot_node = g.by_name("L2.experts.gpu")
    assert hot_node.attrs.subset == (3, 17, 21, 30) and hot_node.place.device == Device.GPU
    assert "routing profile" in hot_node.place.cause
    assert "expected 90% of the layer's picks" in hot_node.place.cause  # 4 x 0.9 of the 4 a token makes
    assert g.by_name("L2.experts").attrs.subset == tuple(e for e in range(32) if e not in (3, 17, 21, 30))
    assert g.by_name("L2.ffn_res").inputs[-1] == "L2.experts.gpu"


def test_hybrid_plan_with_split_experts_computes_the_same_logits(demo_dir):
    model = ktflow.load(demo_dir)
    opts = dict(hw=A100_NO_OVERHEAD, dtype="float32", device="cpu", max_seq_len=64)
    dense = ktflow.compile(model, vram_budget_gb=1.0, **opts)
    # a float32 plan holds the bf16 checkpoint's weights in float32: 4 bytes each
    dense_bytes = sum(n.weight_elems() * 4 for n in dense.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    budget = (dense_bytes + dense.decode.memory.kv_cache_bytes + 40.5 * 3 * 256 * 128 * 4) / 1e9
    hybrid = ktflow.compile(model, vram_budget_gb=budget, **opts)  # all of layer 1's experts, some of layer 2's
    g = hybrid.decode.ir
    assert g.by_name("L1.experts").place.device == Device.GPU and "L1.experts.gpu" not in g
    hot = g.by_name("L2.experts.gpu").attrs.subset
    assert 0 < len(hot) < 32 and hot == tuple(range(len(hot)))  # uniform routing: ties in expert order
    assert f"expected {len(hot) / 32:.0%} of the layer's picks (uniform routing)" in g.by_name("L2.experts.gpu").place.cause
    assert g.by_name("L2.experts").place.device == Device.CPU and g.by_name("L3.experts").place.device == Device.CPU
    assert g.by_name("L1.attn").place.device == Device.GPU
    ref = ktflow.compile(model, hw="cpu", dtype="float32", max_seq_len=64)
    ids = torch.randint(0, 2048, (2, 10), generator=torch.Generator().manual_seed(1))
    a, sa = ktflow.execute(hybrid, ids)
    b, sb = ktflow.execute(ref, ids)
    nxt = torch.tensor([[5], [6]])
    a2, _ = ktflow.execute(hybrid, nxt, sa)
    b2, _ = ktflow.execute(ref, nxt, sb)
    for x, y in ((a, b), (a2, b2)):
        assert (x - y).abs().max() <= 1e-5 * y.abs().max()


def test_forced_placements(demo_dir):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="paper-a100", placement="gpu", device="cpu")
    assert set(devices(c.decode).values()) == {Device.GPU}
    c = ktflow.compile(model, hw="paper-a100", placement="cpu")
    assert set(devices(c.decode).values()) == {Device.CPU}
    with pytest.raises(ConfigError, match="placement='gpu' but hardware profile 'cpu' has no GPU"):
        ktflow.compile(model, hw="cpu", placement="gpu")
    with pytest.raises(ConfigError, match="placement='gpu' needs .* GB"):
        ktflow.compile(model, hw="paper-a100", placement="gpu", vram_budget_gb=0.001)


def test_nothing_fits_says_what_to_change(v3):
    with pytest.raises(ConfigError, match="nothing fits on the GPU: the smallest placement unit"):
        ktflow.compile(v3, hw="paper-a100", vram_budget_gb=0.000001)
    with pytest.raises(ConfigError, match="nothing fits in vram_gb: .* prefill step.s activations .* lower prefill_tokens"):
        ktflow.compile(v3, hw="paper-4080", prefill_tokens=2_000_000, max_seq_len=2_000_000)


def test_placement_table_explains_every_node(v3):
    c = ktflow.compile(v3, hw="paper-a100")
    text = placement_table(c.decode)
    assert len(text.splitlines()) == len(c.decode.ir) + 3
    assert "L10.experts" in text and "GPU ridge" in text and "predicted peak VRAM" in text
