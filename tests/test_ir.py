"""IR: golden printed graphs per family, verifier rules (each one made to fire), JSON round trip."""

import dataclasses
import os
from pathlib import Path

import pytest

from ktflow.ir import Graph, print_graph, verify, violations, VerifyError, RULES
from ktflow.ir.ops import RMSNormAttrs
from ktflow.ir.types import DType, TensorType, WeightRef
from small_configs import CONFIGS, graph_of

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_printed_spec_graph_matches_golden(family):
    text = print_graph(graph_of(family))
    path = GOLDEN / f"spec_{family}.txt"
    if os.environ.get("KTFLOW_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_printer_is_deterministic_and_one_line_per_node():
    a, b = print_graph(graph_of("deepseek_v3")), print_graph(graph_of("deepseek_v3"))
    assert a == b
    g = graph_of("deepseek_v3")
    assert len(a.splitlines()) == len(g) + 1


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_json_round_trip_is_exact(family):
    g = graph_of(family)
    assert Graph.from_dict(g.to_dict()) == g


def test_networkx_view_and_users():
    g = graph_of("mixtral")
    nx = g.nx()
    assert nx.number_of_nodes() == len(g)
    assert set(nx.successors("L0.gate")) == {"L0.experts"}
    assert set(g.users("L0.ffn_norm")) == {"L0.gate", "L0.experts"}
    import networkx

    assert list(networkx.topological_sort(nx))[0] == "tokens"


def test_layer_structure_follows_config():
    g = graph_of("deepseek_v3")  # first_k_dense_replace=1
    assert g.by_name("L0.mlp").attrs.kind == "dense"
    assert "L0.experts" not in g and "L1.experts" in g
    assert g.by_name("L1.ffn_res").inputs == ("L1.attn_res", "L1.experts", "L1.shared")
    q2 = graph_of("qwen2_moe")
    assert q2.by_name("L0.shared").attrs.sigmoid_gate


# --------------------------------------------------------------------- verifier: each rule fires


def _replace(g: Graph, name: str, **changes) -> Graph:
    return g.replace_nodes(dataclasses.replace(n, **changes) if n.name == name else n for n in g.nodes)


def _fired(g: Graph, stage="spec") -> set[str]:
    return {r for r, _, _ in violations(g, stage)}


def test_valid_graphs_pass_every_rule():
    for fam in CONFIGS:
        verify(graph_of(fam), "spec")


def test_v1_duplicate_name():
    g = graph_of("mixtral")
    n = g.by_name("L0.attn_norm")
    g2 = g.replace_nodes(list(g.nodes) + [n])
    assert "V1" in _fired(g2)


def test_v2_input_used_before_defined():
    g = graph_of("mixtral")
    g2 = _replace(g, "L0.attn_norm", inputs=("L0.attn",))
    assert "V2" in _fired(g2)
    with pytest.raises(VerifyError) as e:
        verify(g2)
    assert e.value.rule in ("V2",) and "L0.attn_norm" in str(e.value)


def test_v3_wrong_arity_and_attrs():
    g = graph_of("mixtral")
    assert "V3" in _fired(_replace(g, "L0.experts", inputs=("L0.ffn_norm",)))
    assert "V3" in _fired(_replace(g, "L0.attn_res", attrs=RMSNormAttrs(32, 1e-6)))


def test_v4_output_type_disagrees_with_shape_rule():
    g = graph_of("mixtral")
    assert _fired(_replace(g, "L0.attn", out=TensorType(("T", 31), DType.BF16))) >= {"V4"}


def test_v5_routed_experts_needs_a_routing():
    g = graph_of("mixtral")
    assert "V5" in _fired(_replace(g, "L0.experts", inputs=("L0.ffn_norm", "L0.attn_norm")))


def test_v6_lm_head_must_be_an_output():
    g = graph_of("mixtral")
    assert "V6" in _fired(Graph(g.nodes, ("norm",), g.act_dtype))


def test_v7_dead_node():
    g = graph_of("mixtral")
    n = dataclasses.replace(g.by_name("L0.attn_res"), name="dangling")
    nodes = list(g.nodes)
    nodes.insert(g.position("L0.attn_res") + 1, n)
    assert _fired(g.replace_nodes(nodes)) == {"V7"}


def test_v8_malformed_weight_refs():
    g = graph_of("mixtral")
    n = g.by_name("L0.experts")
    bad = (WeightRef("gate", "model.layers.0.block_sparse_moe.experts.0.w1.weight", (48, 32), experts=4),) + n.weights[1:]
    assert "V8" in _fired(_replace(g, "L0.experts", weights=bad))
    zero = (WeightRef("weight", "model.norm.weight", (0,)),)
    assert "V8" in _fired(_replace(g, "norm", weights=zero))


def test_v9_two_attentions_share_a_layer():
    g = graph_of("mixtral")
    a1 = g.by_name("L1.attn")
    g2 = _replace(g, "L1.attn", attrs=dataclasses.replace(a1.attrs, layer=0))
    assert _fired(g2) == {"V9"}


def test_v10_expert_subsets_must_partition_the_layer():
    g = graph_of("mixtral")  # 4 experts per layer
    n = g.by_name("L0.experts")
    hot = dataclasses.replace(n, name="L0.experts.hot", attrs=dataclasses.replace(n.attrs, subset=(0, 1)))
    rest = dataclasses.replace(n, attrs=dataclasses.replace(n.attrs, subset=(2, 3)))
    res = g.by_name("L0.ffn_res")
    res2 = dataclasses.replace(res, inputs=res.inputs + ("L0.experts.hot",))

    def build(hot_node, rest_node):
        nodes = []
        for m in g.nodes:
            if m.name == "L0.experts":
                nodes += [hot_node, rest_node]
            else:
                nodes.append(res2 if m.name == "L0.ffn_res" else m)
        return g.replace_nodes(nodes)

    assert _fired(build(hot, rest)) == set()
    overlap = dataclasses.replace(rest, attrs=dataclasses.replace(n.attrs, subset=(1, 2, 3)))
    assert _fired(build(hot, overlap)) == {"V10"}
    gap = dataclasses.replace(rest, attrs=dataclasses.replace(n.attrs, subset=(3,)))
    assert _fired(build(hot, gap)) == {"V10"}
    unsorted = dataclasses.replace(rest, attrs=dataclasses.replace(n.attrs, subset=(3, 2)))
    assert "V10" in _fired(build(hot, unsorted))


def test_stage_rules_only_apply_from_their_stage():
    g = graph_of("mixtral")
    assert _fired(g, "spec") == set()
    assert _fired(g, "costed") == {"C1"}
    assert _fired(g, "placed") == {"C1", "P1"}
    assert _fired(g, "lowered") == {"C1", "P1"}  # L1, L2 skip unplaced nodes


def test_every_rule_has_a_test():
    tested = {"V1", "V2", "V3", "V4", "V5", "V6", "V7", "V8", "V9", "V10", "C1", "P1",
              "L1", "L2", "L3", "L4", "D1", "D2", "S1", "S2", "P2", "T1", "T2", "B1", "B2", "B3", "R1"}  # L1-L4:
    # test_lower.py; D1, D2: test_defer.py; S1, S2: test_prefill.py; P2: test_fp8.py; T1, T2: test_plan.py;
    # B1, B2: test_buffers.py; B3: test_error_boundary.py; R1: test_multi_gpu.py
    assert set(RULES) == tested
