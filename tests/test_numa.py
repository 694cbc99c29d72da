"""NUMA split: slices and expert groups, the tp/ep choice, bad counts, and that split plans
compute what unsplit plans compute."""

import pytest
import torch

import ktflow
from ktflow.errors import ConfigError
from ktflow.ir.ops import Op
from ktflow.passes.numa import ep_groups, tp_slices
from conftest import DATA


@pytest.mark.parametrize("inter,nodes,block,want", [
    (2048, 2, 64, [(0, 1024), (1024, 2048)]),
    (1408, 3, 64, [(0, 512), (512, 960), (960, 1408)]),  # 22 blocks: 8, 7, 7
    (100, 2, 64, [(0, 64), (64, 100)]),  # short last block
    (16, 2, 64, [(0, 16)]),  # fewer blocks than nodes
])
def test_tp_slices(inter, nodes, block, want):
    assert tp_slices(inter, nodes, block) == want


def test_ep_groups_balance_expected_load():
    load = {0: 0.9, 1: 0.1, 2: 0.1, 3: 0.1, 4: 0.5, 5: 0.4}
    groups = ep_groups(tuple(load), load, 2)
    assert sorted(e for g in groups for e in g) == list(load)
    sums = [sum(load[e] for e in g) for g in groups]
    assert max(sums) - min(sums) <= 0.11


def test_deepseek_v3_on_two_sockets_is_tensor_parallel():
    c = ktflow.compile(ktflow.load(DATA / "deepseek-v3-config"), hw="paper-a100", expert_format="bf16")
    g = c.decode.ir
    s0, s1 = g.by_name("L30.experts.numa0"), g.by_name("L30.experts.numa1")
    assert (s0.attrs.rows, s1.attrs.rows) == ((0, 1024), (1024, 2048))
    assert (s0.place.numa, s1.place.numa) == (0, 1)
    red = g.by_name("L30.experts")
    assert red.op == Op.REDUCE and "(tp;" in red.place.cause
    one = ktflow.compile(ktflow.load(DATA / "deepseek-v3-config"), hw="paper-a100", numa_nodes=1,
                         expert_format="bf16").decode.ir
    # not split: half of every read crosses the 125 GB/s socket link; split: each socket reads its
    # half locally (180 GB/s each of the 360 GB/s GEMV rate)
    expert_bytes = 8 * 3 * 7168 * 2048 * 2
    assert one.by_name("L30.experts").cost.cpu_s == pytest.approx(expert_bytes / 2 / 125e9, rel=0.01)
    assert s0.cost.cpu_s == pytest.approx(expert_bytes / 2 / 180e9, rel=0.01)


def test_options_choose_the_split(demo_dir):
    model = ktflow.load(demo_dir)
    ep = ktflow.compile(model, hw="cpu", numa_nodes=2, numa="ep").decode.ir
    assert ep.by_name("L1.experts.numa0").attrs.subset and "chosen by option" in ep.by_name("L1.experts").place.cause
    tp = ktflow.compile(model, hw="cpu", numa_nodes=2, numa="tp").decode.ir
    assert tp.by_name("L1.experts.numa1").attrs.inter_slice == (64, 128)


def test_bad_numa_count(demo_dir):
    with pytest.raises(ConfigError, match="numa_nodes"):
        ktflow.compile(ktflow.load(demo_dir), hw="cpu", numa_nodes=0)


@pytest.mark.parametrize("mode,nodes", [("tp", 2), ("tp", 3), ("ep", 3)])
def test_split_plans_equal_unsplit_plans(demo_dir, mode, nodes):
    model = ktflow.load(demo_dir)
    split = ktflow.compile(model, hw="cpu", numa_nodes=nodes, numa=mode, numa_block=32, dtype="float32",
                           max_seq_len=32)
    plain = ktflow.compile(model, hw="cpu", dtype="float32", max_seq_len=32)
    assert sum(n.op == Op.REDUCE for n in split.decode.ir.nodes) == 3
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(4))
    a, sa = ktflow.execute(split, ids)
    b, sb = ktflow.execute(plain, ids)
    a2, _ = ktflow.execute(split, ids[:, :1], sa)
    b2, _ = ktflow.execute(plain, ids[:, :1], sb)
    for x, y in ((a, b), (a2, b2)):
        assert (x - y).abs().max() <= 1e-5 * y.abs().max()
