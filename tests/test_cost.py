"""The cost model: rooflines per device, experts priced from routing, PCIe transfers, routing
profiles. Expected values are computed by hand from the hardware numbers."""

import json

import pytest

import ktflow
from ktflow.costmodel.roofline import node_cost, roof, transfer_seconds
from ktflow.costmodel.routing import RoutingProfile
from ktflow.errors import ConfigError
from ktflow.costmodel.hw import PRESETS
from ktflow.ir.ops import Work
from ktflow.ir.types import Device, DType
from conftest import DATA

A100 = PRESETS["paper-a100"]


@pytest.fixture(scope="module")
def v3():
    return ktflow.load(DATA / "deepseek-v3-config").graph()


def test_decode_expert_layer_is_memory_bound_on_the_cpu(v3):
    n = v3.by_name("L10.experts")
    c = node_cost(n, v3, Work(tokens=1, context=1024), A100, weight_itemsize=2)
    expert_bytes = 3 * 7168 * 2048 * 2  # gate, up, down of one expert in bf16
    assert c.bytes == pytest.approx(8 * expert_bytes, rel=1e-3)  # 8 of 256 experts read
    # not NUMA-split on two sockets: half of every read crosses the 125 GB/s socket link
    assert c.cpu_s == pytest.approx(8 * expert_bytes / 2 / 125e9 + 2e-6, rel=1e-3)
    # the preset GPU reaches 45% of its 1555 GB/s roofline (calibrated on the paper's figure 10)
    assert c.gpu_s == pytest.approx(8 * expert_bytes / (0.45 * 1555e9) + 5e-6, rel=1e-3)


def test_prefill_expert_layer_is_compute_bound_on_the_cpu(v3):
    n = v3.by_name("L10.experts")
    desktop = PRESETS["rtx4090-desktop"]  # one socket, 1.5 TFLOPS bf16
    c = node_cost(n, v3, Work(tokens=4096, context=2048), desktop, weight_itemsize=2)
    flops = 6 * 4096 * 8 * 7168 * 2048
    assert c.flops == flops
    assert c.cpu_s == pytest.approx(flops / 1.5e12 + 2e-6, rel=1e-6)


def test_grouped_experts_on_the_gpu_take_the_longer_of_their_work_and_launches(v3):
    """A prefill step's GPU routed experts take the longer of their work and a launch for each op
    of the grouped rule (GROUPED_NODE_OPS a node, GROUPED_BLOCK_OPS a block of GROUPED_ROWS picks):
    a large node is bound by its work, a few picks (or slow launches) by the launches."""
    from ktflow.costmodel.memory import GROUPED_ROWS
    from ktflow.costmodel.roofline import GROUPED_BLOCK_OPS, GROUPED_NODE_OPS

    n = v3.by_name("L10.experts")

    def with_launch(us):
        return A100.model_copy(update={"overheads": A100.overheads.model_copy(update={"gpu_launch_us": us})})

    bound = {"work": 0, "launches": 0}
    for us in (5.0, 200.0):
        for tokens in (2, 512, 2048, 2049, 4096):  # 16384 picks: one block; 16392: two
            launches = (GROUPED_NODE_OPS + GROUPED_BLOCK_OPS * -(-tokens * 8 // GROUPED_ROWS)) * us * 1e-6
            work = node_cost(n, v3, Work(tokens=tokens, context=0), with_launch(0.0), weight_itemsize=2).gpu_s
            got = node_cost(n, v3, Work(tokens=tokens, context=0), with_launch(us), weight_itemsize=2).gpu_s
            assert got == pytest.approx(max(work, launches))
            bound["work" if work > launches else "launches"] += 1
    assert bound["work"] and bound["launches"]  # both sides of the max are exercised
    # a decode step (captured per-pick rule) pays one launch
    d = node_cost(n, v3, Work(tokens=1, context=1024), A100, weight_itemsize=2)
    gpu = roof(A100, Device.GPU, DType.BF16)
    assert d.gpu_s == pytest.approx(d.bytes / gpu.bandwidth + A100.overheads.gpu_launch_us * 1e-6, rel=1e-3)


@pytest.fixture
def grouped_ops(monkeypatch):
    """(ops, case): ops(fn) counts the ops fn issues as the grouped rules' launches are priced
    (torch.profiler on the CPU, top-level aten ops, views aside, torch's grouped matmul one op a
    product); case holds a small layer's inputs, 8 of its 32 experts stacked (staged rows)."""
    import torch
    import torch.nn.functional as F

    from ktflow.backends.base import staged

    products = []
    monkeypatch.setattr(F, "grouped_mm", lambda a, b, offs: products.append(1) or torch.empty(a.shape[0], b.shape[-1],
                                                                                              dtype=a.dtype))
    views = {"aten::slice", "aten::reshape", "aten::transpose", "aten::unsqueeze", "aten::view", "aten::select",
             "aten::unbind", "aten::alias", "aten::detach", "aten::expand", "aten::as_strided", "aten::empty",
             "aten::_reshape_alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg"}
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 32, 16, 8, 64, 4
    held = tuple(range(8))
    gate, up, down = staged(torch.randn(len(held), 3 * H * I, generator=g).to(torch.bfloat16), H, I)
    case = dict(E=E, T=T, H=H, held=held, x=torch.randn(T, H, generator=g).to(torch.bfloat16),
                ids=torch.rand(T, E, generator=g).argsort(dim=1)[:, :k], wts=torch.rand(T, k, generator=g),
                gate=gate, up=up, down=down)

    def ops(fn) -> int:
        products.clear()
        with torch.profiler.profile() as prof:
            fn()
        top = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        return len([n for n in top if n not in views]) + len(products)

    return ops, case


def test_the_grouped_rules_ops_are_what_the_cost_model_counts(grouped_ops, monkeypatch):
    """GROUPED_NODE_OPS / GROUPED_BLOCK_OPS / GROUPED_CUT_OPS hold the ops moe_gpu.grouped_experts
    issues for a node and a block of picks (a block that cuts the rows shifts its offsets): change
    them together."""
    import torch

    from ktflow.backends.kernels import moe_gpu
    from ktflow.costmodel.roofline import GROUPED_BLOCK_OPS, GROUPED_CUT_OPS, GROUPED_NODE_OPS

    ops, c = grouped_ops
    local = moe_gpu.expert_map(c["held"], c["E"], "cpu")
    picks = sum(moe_gpu.LayerPicks(c["ids"], c["E"]).counts[e] for e in c["held"])

    def node(rows: int) -> int:
        monkeypatch.setattr(moe_gpu, "GROUPED_ROWS", rows)
        addend = torch.zeros(c["T"], c["H"])
        return ops(lambda: moe_gpu.grouped_experts(c["x"], c["ids"], c["wts"], local, c["gate"], c["up"], c["down"],
                                                   addend=addend, running=True))

    assert node(picks) == GROUPED_NODE_OPS + GROUPED_BLOCK_OPS
    assert node(-(-picks // 2)) == GROUPED_NODE_OPS + 2 * (GROUPED_BLOCK_OPS + GROUPED_CUT_OPS)


def test_a_parts_ops_are_what_the_cost_model_counts(grouped_ops, monkeypatch):
    """GROUPED_LAYER_OPS / GROUPED_PART_OPS hold the ops of a layer's one sort and count
    (moe_gpu.LayerPicks) and of a part's own (`part`, `grouped_part`), its blocks as a node's:
    change them together."""
    import torch

    from ktflow.backends.kernels import moe_gpu
    from ktflow.costmodel.roofline import GROUPED_BLOCK_OPS, GROUPED_CUT_OPS, GROUPED_LAYER_OPS, GROUPED_PART_OPS

    ops, c = grouped_ops
    assert ops(lambda: moe_gpu.LayerPicks(c["ids"], c["E"])) == GROUPED_LAYER_OPS
    layer = moe_gpu.LayerPicks(c["ids"], c["E"])
    addend, held_ids = torch.zeros(c["T"], c["H"]), torch.tensor(c["held"])

    def part(rows: int) -> int:
        monkeypatch.setattr(moe_gpu, "GROUPED_ROWS", rows)
        return ops(lambda: moe_gpu.grouped_part(c["x"], layer.k, c["wts"], *layer.part(c["held"], held_ids), c["gate"],
                                                c["up"], c["down"], addend=addend, running=True))

    picks = sum(layer.counts[e] for e in c["held"])
    assert part(picks) == GROUPED_PART_OPS + GROUPED_BLOCK_OPS
    assert part(-(-picks // 2)) == GROUPED_PART_OPS + 2 * (GROUPED_BLOCK_OPS + GROUPED_CUT_OPS)


def test_routing_profile_skew_reads_fewer_experts(v3):
    n = v3.by_name("L10.experts")
    hot = [0.9] * 8 + [0.0] * 248  # every token picks among the same 8 hot experts... almost
    skew = Work(tokens=16, context=64, expert_probs=tuple(hot))
    uniform = Work(tokens=16, context=64)
    a = node_cost(n, v3, skew, A100, 2)
    b = node_cost(n, v3, uniform, A100, 2)
    expert_bytes = 3 * 7168 * 2048 * 2
    hit_uniform = 256 * (1 - (1 - 8 / 256) ** 16)
    hit_skew = 8 * (1 - 0.1 ** 16)
    io = b.bytes - hit_uniform * expert_bytes
    assert b.bytes == pytest.approx(hit_uniform * expert_bytes + io, rel=1e-9)
    assert a.bytes == pytest.approx(hit_skew * expert_bytes + io, rel=1e-9)


def test_no_gpu_time_without_a_gpu(v3):
    c = node_cost(v3.by_name("L0.attn"), v3, Work(tokens=1, context=100), PRESETS["cpu"], 2)
    assert c.gpu_s is None and c.cpu_s > 0
    with pytest.raises(ValueError):
        c.on(Device.GPU)


def test_float32_halves_the_compute_peak():
    assert roof(A100, Device.GPU, DType.F32).flops == roof(A100, Device.GPU, DType.BF16).flops / 2


def test_pcie_transfer():
    assert transfer_seconds(32e9, A100, "h2d") == pytest.approx(1.0 + 5e-6)
    with pytest.raises(ConfigError, match="no GPU"):
        transfer_seconds(1, PRESETS["cpu"], "d2h")


def _profile(tmp_path, layers, **extra):
    p = tmp_path / "routing.json"
    p.write_text(json.dumps({"layers": layers, **extra}))
    return p


def test_compile_with_a_routing_profile(demo_dir, tmp_path):
    model = ktflow.load(demo_dir)  # 32 experts, top-4, MoE layers 1..3
    hot = [0.5] * 8 + [0.0] * 24
    p = _profile(tmp_path, {"1": hot, "2": hot, "3": hot})
    skewed = ktflow.compile(model, hw="cpu", routing_profile=str(p), prefill_buckets=[512])
    plain = ktflow.compile(model, hw="cpu", prefill_buckets=[512])
    a = skewed.prefill[0].ir.by_name("L2.experts").cost.bytes
    b = plain.prefill[0].ir.by_name("L2.experts").cost.bytes
    assert a < 0.5 * b  # only 8 of 32 experts are ever read


@pytest.mark.parametrize("layers,message", [
    ({"1": [0.125] * 16}, "lists 16 experts, the model has 32"),
    ({"1": [0.5] * 32}, "sum to 16.000, expected top_k = 4"),
    ({"1": [1.5] + [0.1] * 31}, "must be in \\[0, 1\\]"),
])
def test_bad_routing_profiles(demo_dir, tmp_path, layers, message):
    p = _profile(tmp_path, layers)
    with pytest.raises(ConfigError, match=message):
        ktflow.compile(ktflow.load(demo_dir), hw="cpu", routing_profile=str(p))


@pytest.mark.parametrize("field", ["cache", "cache_batched"])
def test_a_cache_curve_of_the_wrong_size_is_refused(demo_dir, tmp_path, field):
    from ktflow.costmodel.routing import CacheCurve

    curves = {16: {1: CacheCurve(hits=[0.5] * 15, copies=[0.1] * 15)}}  # 16 sizes; the model's layers have 32 experts
    prof = RoutingProfile(layers={1: [0.125] * 32}, **{field: curves if field == "cache" else {4: curves}})
    p = tmp_path / "r.json"
    p.write_text(prof.model_dump_json())
    where = "every 16 tokens" + (", batch 4" if field == "cache_batched" else "")
    with pytest.raises(ConfigError, match=f"cache curve of layer 1 \\({where}\\) has 15 sizes"):
        ktflow.compile(ktflow.load(demo_dir), hw="cpu", routing_profile=str(p))


def test_batched_cache_curves_are_for_two_or_more_conversations():
    from ktflow.costmodel.routing import CacheCurve

    curves = {16: {1: CacheCurve(hits=[0.5] * 31, copies=[0.1] * 31)}}
    with pytest.raises(ValueError, match="batches of 2 or more"):
        RoutingProfile(layers={1: [0.125] * 32}, cache_batched={1: curves})


def test_routing_profile_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        RoutingProfile.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RoutingProfile.load(bad)


def test_cpu_experts_are_priced_and_held_at_their_packed_size():
    """int8/int4 experts: the CPU reads about 1 / 0.5 bytes per weight (scales included), so a
    DRAM-bound decode step is predicted faster (its expert reads shrink), and the plan's host memory holds the
    experts at that size; the dense weights stay at the activation dtype's size."""
    import ktflow
    from conftest import DATA
    from ktflow.ir.ops import Op

    model = ktflow.load(DATA / "qwen3-30b-a3b-config")
    plans = {fmt: ktflow.compile(model, hw="cpu", max_seq_len=256, expert_format=fmt).decode
             for fmt in ("bf16", "int8", "int4")}
    experts = sum(n.weight_elems() for n in plans["bf16"].ir.nodes if n.op == Op.ROUTED_EXPERTS)
    dense = model.graph().weight_elems() - experts
    for fmt, per in (("bf16", 2.0), ("int8", 1.0), ("int4", 0.5)):
        # nominal bytes per weight; the group scales add up to 6% (int4: 4 bytes per 128 weights)
        assert plans[fmt].memory.weight_bytes == pytest.approx(dense * 2 + experts * per, rel=0.06), fmt
    step = {fmt: p.predicted_step_us for fmt, p in plans.items()}
    # the expert reads halve; attention and the dense weights do not (before: the same for all three)
    assert 0.5 < step["int8"] / step["bf16"] < 0.8 and step["int4"] < 0.85 * step["int8"]


def test_neighbouring_tokens_read_the_experts_they_share_once():
    """A verification step's consecutive tokens (Work.neighbour_probs c_e): two tokens hit expert
    e with probability 2 p_e - c_e (independent ones: 2 p_e - p_e^2), never below p_e; without
    neighbour co-picks the independent count stands."""
    from ktflow.ir.ops import RoutedExpertsAttrs, experts_hit_fraction

    a = RoutedExpertsAttrs(layer=1, hidden=8, inter=8, experts=4, top_k=2)
    p = (0.9, 0.5, 0.4, 0.2)
    c = (0.85, 0.1, 0.4, 0.0)
    independent = experts_hit_fraction(a, Work(tokens=2, context=1, expert_probs=p))
    assert independent == pytest.approx(sum(2 * q - q * q for q in p) / 4)
    near = experts_hit_fraction(a, Work(tokens=2, context=1, expert_probs=p, neighbour_probs=c))
    # c_e below p_e^2 (expert 1, 3) counts as independent; c_e of p_e (expert 2): hit as by one token
    assert near == pytest.approx(((2 * .9 - .85) + (2 * .5 - .25) + .4 + (2 * .2 - .04)) / 4)
    assert experts_hit_fraction(a, Work(tokens=1, context=1, expert_probs=p, neighbour_probs=c)) == \
        pytest.approx(sum(p) / 4)


def test_neighbour_copicks_count_consecutive_decoded_pairs():
    import torch

    from ktflow.runtime.routing import neighbour_copicks

    steps = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 0, 1]], dtype=torch.uint8)  # 3 steps, 3 experts
    other = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.uint8)
    got = neighbour_copicks([{5: (torch.zeros(3), steps)}, {5: (torch.zeros(3), other)}])
    # pairs: (s0, s1), (s1, s2), (o0, o1): expert 0 in both twice, expert 1 once, expert 2 twice
    assert got == {5: [pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(2 / 3)]}
    assert neighbour_copicks([{5: (torch.zeros(3), steps[:1])}]) is None
