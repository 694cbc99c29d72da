"""Pipeline and plan file: passes verify, dumps, failures name the pass; save/load round trip
with version and fingerprint refusal; atomic writes."""

import io
import json
import shutil

import pytest
import torch

import ktflow
from ktflow.errors import PassError, PlanError
from ktflow.ir.types import Device
from ktflow.ir.printer import print_graph
from ktflow.plan.options import CompileContext, CompileOptions
from ktflow.passes import PIPELINE, PassTimer, PrintAfter, default_instruments, run_pipeline
from ktflow.plan.artifact import PlanFile
from ktflow.costmodel.hw import PRESETS
from small_configs import graph_of


@pytest.fixture(scope="module")
def compiled(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=64)


def ctx(phase="decode"):
    return CompileContext(hw=PRESETS["cpu"], options=CompileOptions(), phase=phase, tokens=1, batch=1, context=32,
                          weight_itemsize=2, max_seq_len=64, device="cpu")


def test_pipeline_places_and_costs_every_node():
    timer = PassTimer()
    g = run_pipeline(graph_of("deepseek_v3"), ctx(), instruments=[timer])
    assert set(timer.seconds) == {p.__name__ for p, _ in PIPELINE}
    for n in g.nodes:
        assert n.place.device == Device.CPU and "no GPU" in n.place.cause
        assert n.cost.cpu_s > 0 and n.cost.gpu_s is None


def test_the_schedule_pass_times_every_node_and_t1_t2_catch_a_broken_schedule(capsys):
    """The pipeline ends scheduled: every node timed on its lane (printed with `t=`), the plan's
    instructions made from those times; T1 fires on a node timed before its input ends or not timed,
    T2 on two nodes of one lane at once."""
    from dataclasses import replace

    from ktflow.ir.types import Timing
    from ktflow.ir.verify import violations
    from ktflow.passes.schedule import instructions_of

    g = run_pipeline(graph_of("deepseek_v3"), ctx("decode"), instruments=default_instruments("schedule"))
    assert "graph after schedule" in capsys.readouterr().out
    assert all(n.timing is not None for n in g.nodes) and not violations(g, "scheduled")
    instrs = [s for s in instructions_of(g) if s.kind not in ("record", "wait")]
    assert [s.node for s in instrs] == [n.name for n in g.nodes]
    assert all((s.start_us, s.end_us) == (n.timing.start_us, n.timing.end_us) for s, n in zip(instrs, g.nodes))

    def fired(nodes):
        return {r for r, _, _ in violations(g.replace_nodes(nodes), "scheduled")}

    k = next(i for i, n in enumerate(g.nodes) if n.inputs and g.by_name(n.inputs[0]).timing.end_us > 0)
    n = g.nodes[k]
    early = replace(n, timing=Timing(0.0, n.timing.end_us))
    assert "T1" in fired([*g.nodes[:k], early, *g.nodes[k + 1:]])
    assert "T1" in fired([*g.nodes[:k], replace(n, timing=None), *g.nodes[k + 1:]])
    lane = [i for i, m in enumerate(g.nodes) if m.place.lane == n.place.lane and m.timing.end_us > m.timing.start_us]
    a, b = g.nodes[lane[0]], g.nodes[lane[1]]
    overlapping = replace(b, timing=Timing(a.timing.start_us, b.timing.end_us))
    nodes = list(g.nodes)
    nodes[lane[1]] = overlapping
    assert "T2" in fired(nodes)


def test_routed_expert_cost_reads_only_experts_hit():
    g = run_pipeline(graph_of("deepseek_v3"), ctx("decode"))
    n = g.by_name("L1.experts")
    all_bytes = n.weight_elems() * 2
    assert n.cost.bytes < 0.5 * all_bytes  # decode: 2 of 8 experts hit
    assert n.cost.flops == 6 * 1 * 2 * 32 * 16


def test_print_after_and_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("KTFLOW_DUMP", str(tmp_path))
    out = io.StringIO()
    run_pipeline(graph_of("mixtral"), ctx(), instruments=default_instruments("place_by_intensity", out))
    text = out.getvalue()
    assert text.startswith("# decode graph after place_by_intensity")
    assert "@cpu" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.01.annotate_costs.txt", "decode.02.place_by_intensity.txt", "decode.03.place_prefill_experts.txt",
        "decode.04.defer_experts.txt", "decode.05.split_numa.txt", "decode.06.lower.txt", "decode.07.schedule.txt",
        "decode.08.plan_buffers.txt"]
    with pytest.raises(PassError, match="no such pass"):
        run_pipeline(graph_of("mixtral"), ctx(), instruments=[PrintAfter("nope")])


def test_failing_pass_is_named_with_the_passes_before_it():
    def broken_pass(g, c):
        return g.replace_nodes(g.nodes[:-1])  # drops lm_head: verifier must catch it

    pipeline = PIPELINE[:1] + ((broken_pass, "placed"),)
    with pytest.raises(PassError) as e:
        run_pipeline(graph_of("mixtral"), ctx(), pipeline=pipeline)
    msg = str(e.value)
    assert "pass broken_pass left the graph invalid" in msg and "passes before it: annotate_costs" in msg
    repro = msg.split("its input graph: ")[1].strip()
    assert json.loads(open(repro).read())["nodes"]


def test_plan_round_trip(compiled, tmp_path):
    p = tmp_path / "plan.json"
    compiled.save(p)
    back = ktflow.Compiled.load(p, compiled.model)
    assert back.plans == compiled.plans
    assert [p.ir for p in back.prefill] == [p.ir for p in compiled.prefill]
    assert [f.name for f in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_loaded_plan_runs_like_the_original(compiled, tmp_path):
    p = tmp_path / "plan.json"
    compiled.save(p)
    back = ktflow.Compiled.load(p)  # model from the recorded path
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(ktflow.execute(back, ids)[0], ktflow.execute(compiled, ids)[0])


def test_plan_from_another_model_is_refused(compiled, demo_dir, tmp_path):
    p = tmp_path / "plan.json"
    compiled.save(p)
    other = tmp_path / "other"
    shutil.copytree(demo_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="compiled for another model"):
        ktflow.Compiled.load(p, ktflow.load(other))


@pytest.mark.parametrize("field,value", [("ktflow_version", "0.0.1"), ("format_version", 0)])
def test_plan_from_another_version_is_refused(compiled, tmp_path, field, value):
    p = tmp_path / "plan.json"
    compiled.save(p)
    raw = json.loads(p.read_text())
    raw[field] = value
    p.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="Recompile"):
        PlanFile.load(p)


def test_not_a_plan_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    with pytest.raises(PlanError, match="not a ktflow plan"):
        PlanFile.load(p)
    p.write_text("{oops")
    with pytest.raises(PlanError, match="not JSON"):
        PlanFile.load(p)


def test_failed_save_leaves_the_old_file(compiled, tmp_path, monkeypatch):
    p = tmp_path / "plan.json"
    p.write_text("old")
    monkeypatch.setattr(PlanFile, "model_dump_json", lambda self, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        compiled.save(p)
    assert p.read_text() == "old" and [f.name for f in tmp_path.iterdir()] == ["plan.json"]


def test_schedule_orders_steps_and_predicts_times(compiled):
    for plan in compiled.plans.plans:
        names = [s.node for s in plan.instructions]
        assert names == [n.name for n in plan.ir.nodes]
        assert all(s.end_us >= s.start_us for s in plan.instructions)
        assert plan.predicted_step_us == plan.instructions[-1].end_us
    assert compiled.prefill[0].predicted_step_us > compiled.decode.predicted_step_us
    text = compiled.decode.as_text()
    assert "plan decode (GPU nodes on cpu)" in text and "L1.experts" in text


def test_unknown_compile_option_is_an_error(demo_dir):
    with pytest.raises(ktflow.ConfigError, match="max_seq_lenn"):
        ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_lenn=5)
    with pytest.raises(ktflow.ConfigError, match="unknown hardware profile"):
        ktflow.compile(ktflow.load(demo_dir), hw="cray-1")


def test_full_size_deepseek_v3_compiles_from_config_alone():
    from conftest import DATA

    model = ktflow.load(DATA / "deepseek-v3-config")
    assert model.weights is None
    c = ktflow.compile(model, hw="cpu", allow_oversize=True)
    g = c.decode.ir
    assert sum(1 for n in g.nodes if n.op.value == "routed_experts") == 58
    # the config is an FP8 release's: its linear weights are stored fp8, and the routed experts
    # (653.5B weights) stay fp8 on the CPU (1 byte + a float scale per 128); the rest widens to bf16
    assert c.plans.options.expert_format == "fp8"
    experts = next(n for n in g.nodes if n.op.value == "routed_experts")
    assert {w.fmt for w in experts.weights} == {"fp8"} and ":fp8" in print_graph(g)
    assert all(w.fmt == "" for n in g.nodes for w in n.weights if "norm" in w.key or "embed" in w.key)
    routed = 58 * 256 * 3 * 7168 * 2048
    assert c.decode.memory.weight_bytes == pytest.approx(routed * (1 + 4 / 128) + (671.0e9 - routed) * 2, rel=0.01)
    bf16 = ktflow.compile(model, hw="cpu", expert_format="bf16", allow_oversize=True)
    assert bf16.decode.memory.weight_bytes == pytest.approx(1.342e12, rel=0.01)  # 671B params in bf16
    assert c.decode.memory.kv_cache_bytes == 61 * (512 + 64) * 4096 * 2
    assert "deepseek_v3, 61 layers" in c.summary()
