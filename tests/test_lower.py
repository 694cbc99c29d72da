"""Lowering (copies, submit/sync) and the multi-lane schedule, with the lowered-stage verifier
rules made to fire."""

import dataclasses


import ktflow
from ktflow.costmodel.hw import PRESETS, Overheads
from ktflow.ir import verify, violations
from ktflow.ir.ops import Op
from ktflow.plan.options import CompileContext, CompileOptions
from ktflow.passes import run_pipeline
from small_configs import graph_of

HW = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0, cpu_sync_us=0)})


def lowered(budget=66e-6, hw=HW):
    ctx = CompileContext(hw=hw, options=CompileOptions(vram_budget_gb=budget), phase="decode", tokens=1, batch=1,
                         context=64, weight_itemsize=2, max_seq_len=128, device="cuda")
    return run_pipeline(graph_of("deepseek_v3"), ctx)


def names(g):
    return [n.name for n in g.nodes]


def test_cpu_experts_are_wrapped_in_submit_and_sync():
    g = lowered()
    order = names(g)
    for n in ("L1.ffn_norm.to_cpu", "L1.gate.to_cpu", "L1.experts.submit", "L1.experts", "L1.experts.sync",
              "L1.experts.to_gpu"):
        assert n in g, n
    # two NUMA shards and their reduce form one task: submitted before the first shard
    assert order.index("L1.experts.submit") < order.index("L1.experts.numa0") < order.index("L1.experts")
    assert order.index("L1.experts") < order.index("L1.experts.sync")
    assert order.index("L1.experts.submit") < order.index("L1.shared") < order.index("L1.experts.sync")
    assert g.by_name("L1.experts.submit").inputs == ("L1.ffn_norm.to_cpu", "L1.gate.to_cpu")
    assert g.by_name("L1.experts.numa1").inputs == ("L1.ffn_norm.to_cpu", "L1.gate.to_cpu")
    assert g.by_name("L1.experts").inputs == ("L1.experts.numa0", "L1.experts.numa1")
    assert "L1.experts.to_gpu" in g.by_name("L1.ffn_res").inputs
    assert g.by_name("L1.experts.to_gpu").inputs == ("L1.experts.sync",)
    assert g.by_name("L1.experts.sync").place.stream == "gpu"
    verify(g, "lowered")


def test_one_copy_per_value_and_destination():
    g = lowered()
    copies = [n for n in g.nodes if n.op == Op.COPY]
    assert len({(n.inputs[0], n.attrs.dst) for n in copies}) == len(copies)
    # the token ids (host memory) reach the GPU layers through one copy: of the ids, or of the embedding
    crossing = {"tokens.to_gpu", "embed.to_gpu"} & set(names(g))
    assert len(crossing) == 1 and g.by_name(crossing.pop()).attrs.dst == "gpu"


def test_single_device_plans_are_not_changed():
    assert not any(n.op in (Op.COPY, Op.SUBMIT, Op.SYNC) for n in lowered(hw=PRESETS["cpu"]).nodes)
    all_gpu = lowered(budget=1.0)  # only the token ids cross, from host memory
    assert [n.name for n in all_gpu.nodes if n.op in (Op.COPY, Op.SUBMIT, Op.SYNC)] == ["tokens.to_gpu"]


def test_l1_fires_on_a_crossing_without_a_copy():
    g = lowered()
    add = g.by_name("L1.ffn_res")
    bad = tuple("L1.experts" if i == "L1.experts.to_gpu" else i for i in add.inputs)
    g2 = g.replace_nodes(dataclasses.replace(n, inputs=bad) if n.name == "L1.ffn_res" else n for n in g.nodes)
    assert {r for r, _, _ in violations(g2, "lowered")} >= {"L1"}


def test_l2_fires_on_a_broken_pair():
    g = lowered()
    sync = g.by_name("L1.experts.sync")
    g2 = g.replace_nodes(dataclasses.replace(n, attrs=dataclasses.replace(sync.attrs, task="L1.shared"))
                         if n.name == sync.name else n for n in g.nodes)
    assert "L2" in {r for r, _, _ in violations(g2, "lowered")}
    sub = g.by_name("L1.experts.submit")
    assert sub.attrs.members == ("L1.experts.numa0", "L1.experts.numa1", "L1.experts")
    g3 = g.replace_nodes(dataclasses.replace(n, attrs=dataclasses.replace(sub.attrs, members=sub.attrs.members[:-1]))
                         if n.name == sub.name else n for n in g.nodes)
    assert "L2" in {r for r, _, _ in violations(g3, "lowered")}  # the task's root missing from its members
    nodes = list(g.nodes)
    i, j = names(g).index("L1.experts.submit"), names(g).index("L1.experts")
    nodes[i], nodes[j] = nodes[j], nodes[i]  # submit after its task
    assert "L2" in {r for r, _, _ in violations(g.replace_nodes(nodes), "lowered")}


def test_lowering_records_each_layers_host_experts_and_l3_fires_without_them():
    """The experts a CPU part holds (its NUMA shards and their reduce alike) are its layer's host
    experts, recorded on each node that reads host memory; a node missing some, or a layer whose
    nodes disagree, breaks rule L3."""
    g = lowered()
    shards = [g.by_name(f"L1.experts.numa{i}") for i in (0, 1)]
    cpu = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu" and n.attrs.layer == 1]
    assert cpu and all(n.attrs.host == tuple(sorted({e for m in cpu for e in m.attrs.ids})) for n in cpu)
    assert all(set(n.attrs.ids) <= set(n.attrs.host) for n in shards)
    assert "L3" not in {r for r, _, _ in violations(g, "lowered")}
    first = cpu[0]
    short = dataclasses.replace(first.attrs, host=first.attrs.host[1:])
    g2 = g.replace_nodes(dataclasses.replace(n, attrs=short) if n.name == first.name else n for n in g.nodes)
    assert "L3" in {r for r, _, _ in violations(g2, "lowered")}


def test_a_task_marked_on_host_reads_only_token_ids_or_l4_fires():
    """The CPU experts' task reads the GPU's activations: lowering leaves it off the host, and
    marking it so breaks rule L4."""
    g = lowered()
    sub = g.by_name("L1.experts.submit")
    assert not sub.attrs.on_host and "L4" not in {r for r, _, _ in violations(g, "lowered")}
    marked = dataclasses.replace(sub, attrs=dataclasses.replace(sub.attrs, on_host=True))
    g2 = g.replace_nodes(marked if n.name == sub.name else n for n in g.nodes)
    assert "L4" in {r for r, _, _ in violations(g2, "lowered")}


def test_schedule_overlaps_cpu_experts_with_the_shared_expert(demo_dir):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004)  # dense on the GPU, experts on the CPU
    instrs = {s.node: s for s in c.decode.instructions if s.kind not in ("record", "wait")}
    assert {s.kind for s in c.decode.instructions} == {"launch", "copy", "submit", "sync", "record", "wait"}
    assert {s.lane for s in c.decode.instructions} == {"gpu", "copy", "cpu", "cpu0", "cpu1"}  # two sockets
    task, shared, sub, sync = (instrs[n] for n in ("L2.experts", "L2.shared", "L2.experts.submit", "L2.experts.sync"))
    s0, s1 = instrs["L2.experts.numa0"], instrs["L2.experts.numa1"]
    assert (s0.lane, s1.lane, task.lane, shared.lane) == ("cpu0", "cpu1", "cpu", "gpu")
    assert min(s0.start_us, s1.start_us) >= sub.end_us and s0.start_us < s1.end_us  # both sockets at once
    assert task.start_us >= max(s0.end_us, s1.end_us) and sync.end_us >= task.end_us
    assert shared.start_us < s0.end_us  # the GPU works while the CPU computes the experts


def test_a_task_that_reads_an_earlier_tasks_result_runs_after_it(tiny_dirs):
    """At a budget so small that the residual adds run on the CPU, layer 1's deferred experts
    feed layer 2's CPU residual add, whose task also reads values the GPU makes later: the
    deferred experts become a task of their own (submitted in layer 1), and layer 2's task is
    submitted after their sync (this compile used to fail in lowering with a KeyError). The plan
    computes what a plan with room for the dense nodes computes. Both run on the CPU
    (device='cpu'): the test is about the lowered tasks, and paper-a100's plans are placed for
    its 40 GB, which a GPU of another size refuses to run (`check_gpu`)."""
    import torch

    d, _ = tiny_dirs("deepseek_v3")
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    outs = {}
    for budget in (1e-5, 1.0):
        c = ktflow.compile(model, hw="paper-a100", device="cpu", vram_budget_gb=budget, vram_reserve_gb=0, defer=1,
                           max_seq_len=32, allow_oversize=True, dtype="float32")
        g = c.decode.ir
        if budget < 1:  # the case: a submit that reads another task's sync
            syncs = {n.name for n in g.nodes if n.op == Op.SYNC}
            assert any(i in syncs for n in g.nodes if n.op == Op.SUBMIT for i in n.inputs)
        out, state = ktflow.execute(c, ids)
        nxt, _ = ktflow.execute(c, out[:, -1:].argmax(-1), state)
        outs[budget] = torch.cat([out, nxt], 1)
    assert torch.allclose(outs[1e-5], outs[1.0], atol=1e-5, rtol=1e-5)


def test_a_task_holding_experts_is_not_one_the_host_computes(tiny_dirs):
    """With the embedding and all of layer 0 on the CPU, one task reads only the token ids but
    holds layer 0's routed experts: lowering does not mark it on_host (the native pool runs them,
    not the host before the step), and marking it so breaks rule L4."""
    from dataclasses import replace

    from ktflow.ir.types import Device, Placement

    def layer0_on_cpu(g, ctx):  # every node before layer 1's first
        first = next(i for i, n in enumerate(g.nodes) if getattr(n.attrs, "layer", None) == 1)
        before = {n.name for n in g.nodes[:first]}
        return g.map(lambda n: replace(n, place=Placement(Device.CPU, cause="test: layer 0 on the CPU"))
                     if n.name in before else n)

    d, _ = tiny_dirs("qwen3_moe")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", backend="torch_ref", max_seq_len=32,
                       passes=[("after:place_by_intensity", layer0_on_cpu)])
    g = c.decode.ir
    subs = [n for n in g.nodes if n.op == Op.SUBMIT]
    holding = [s for s in subs if any(g.by_name(m).op == Op.ROUTED_EXPERTS for m in s.attrs.members)]
    reads_ids = [s for s in holding if all(g.by_name(i).op == Op.INPUT for i in s.inputs)]
    assert reads_ids, "the test needs a task of layer 0 that reads only the token ids"
    assert not any(s.attrs.on_host for s in holding)
    assert "L4" not in {r for r, _, _ in violations(g, "lowered")}
    sub = reads_ids[0]
    marked = dataclasses.replace(sub, attrs=dataclasses.replace(sub.attrs, on_host=True))
    g2 = g.replace_nodes(marked if n.name == sub.name else n for n in g.nodes)
    assert any(r == "L4" and "runs no routed experts" in m for r, _, m in violations(g2, "lowered"))
