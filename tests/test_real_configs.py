"""Specs at real scale: the public config.json of real checkpoints, compiled from the config
alone. The parameter count of the spec's weight references must equal the published total of
each model (a wrong projection shape, shared-expert size or dense/MoE layer choice shows here)."""

import pytest

import ktflow
from conftest import DATA

#: config dir -> (published total parameters, relative tolerance)
PUBLISHED = {
    "deepseek-v3-config": (671_026_419_200, 0),  # 671B without the 14B MTP layer
    "deepseek-v2-lite-config": (15_706_484_224, 0),  # 15.7B
    "mixtral-8x7b-config": (46_702_792_704, 0),  # 46.7B
    "qwen3-30b-a3b-config": (30_532_122_624, 0),  # 30.5B
    "qwen1.5-moe-a2.7b-config": (14.3e9, 0.005),  # 14.3B
    "kimi-k2-config": (1.03e12, 0.01),  # about 1T
    # published 355B and 106B, rounded; their MTP layer (model.layers.<n>) is not in the graph
    "glm-4.5-config": (355e9, 0.01),  # 352.8B
    "glm-4.5-air-config": (106e9, 0.01),  # 106.9B
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published_total(name):
    model = ktflow.load(DATA / name)
    total, tol = PUBLISHED[name]
    assert model.graph().weight_elems() == pytest.approx(total, rel=tol)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_config_compiles_without_weights(name):
    model = ktflow.load(DATA / name)
    c = ktflow.compile(model, hw="cpu", max_seq_len=4096, expert_format="bf16", allow_oversize=True)
    assert c.decode.memory.weight_bytes == model.graph().weight_elems() * 2  # every weight in bf16
    assert c.decode.predicted_step_us > 0 and len(c.decode.instructions) == len(c.decode.ir)


def test_decode_reads_only_the_active_experts():
    """Qwen3-30B-A3B is 'A3B': 3.3B activated parameters, a count that takes in the whole
    embedding table; a decoded token reads one row of it (cost model), so add the rest back."""
    c = ktflow.compile(ktflow.load(DATA / "qwen3-30b-a3b-config"), hw="cpu")
    from ktflow.ir.ops import FACTS, Work

    w = Work(tokens=1, context=1)
    active = sum(n.weight_elems() * FACTS[n.op].weight_fraction(n.attrs, w) for n in c.decode.ir.nodes)
    embed = c.decode.ir.by_name("embed").weight_elems()
    assert active + embed * (1 - 1 / 151936) == pytest.approx(3.3e9, rel=0.03)
    assert active < 0.11 * c.decode.ir.weight_elems()  # 8 of 128 experts
