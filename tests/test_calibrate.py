"""`ktflow calibrate`: the fit recovers the terms a measured step was made with (fabricated
measurements on real plans), and the command runs the demo model here, writes a profile the
compiler takes, and refuses bad input with one line."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import ktflow
from ktflow.tools.calibrate import (Replayed, _edge_syncs, median_instructions, calibrate, deferred_tasks, fit,
    fit_replayed, measure, predicted_tasks)
from ktflow.costmodel.hw import PRESETS, Overheads, resolve_hw
from ktflow.ir.ops import Op
from ktflow.ir.types import Device
from ktflow.backends.native.binding import available as native_available


def fabricate(plan, hw, gpu=None, cpu=None):
    """The plan's instructions with the durations a machine would give: GPU ops gpu(x) and CPU ops
    cpu(x) of their roofline seconds at peak (without the fixed cost) under profile `hw`; the
    rest as predicted. Instructions back to back."""
    o = hw.overheads
    out, t = [], 0.0
    g = plan.ir
    for s in plan.instructions:
        d = s.end_us - s.start_us
        if s.kind == "launch":
            n = g.by_name(s.node)
            if n.place.device == Device.GPU and gpu:
                d = gpu((n.cost.gpu_s - o.gpu_launch_us * 1e-6) * hw.gpus[0].efficiency) * 1e6
            elif n.place.device == Device.CPU and cpu:
                d = cpu(n.cost.cpu_s - o.cpu_op_us * 1e-6) * 1e6
        out.append(s.model_copy(update={"start_us": t, "end_us": t + d}))
        t += d
    return out


def test_fit_recovers_gpu_efficiency_and_fixed_time(demo_dir):
    hw = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(gpu_launch_us=5.0)})
    c = ktflow.compile(ktflow.load(demo_dir), hw=hw, vram_budget_gb=0.004, max_seq_len=64)
    assert sum(n.place.device == Device.GPU for n in c.decode.ir.nodes) >= 3
    measured = fabricate(c.decode, c.plans.hw, gpu=lambda x: x / 0.5 + 3e-6)  # half the peak, 3 us per op
    profile, fitted = fit(c.decode, measured, c.plans.hw)
    assert profile.gpus[0].efficiency == pytest.approx(0.5, rel=1e-6)
    assert profile.overheads.gpu_launch_us == pytest.approx(3.0, rel=1e-6)
    terms = {f.term for f in fitted}
    assert {"gpus[0].efficiency", "overheads.gpu_launch_us"} <= terms
    assert profile.name == "paper-a100+calibrated"


def test_fit_recovers_the_cpu_rate_and_fixed_time(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=64)
    measured = fabricate(c.decode, c.plans.hw, cpu=lambda x: 4 * x + 10e-6)  # a quarter of the rate, 10 us per op
    profile, fitted = fit(c.decode, measured, c.plans.hw)
    assert profile.cpu.gemv_gbps == pytest.approx(c.plans.hw.cpu.gemv_gbps / 4, rel=1e-6)
    assert profile.cpu.gemm_tflops == pytest.approx(c.plans.hw.cpu.gemm_tflops / 4, rel=1e-6)
    assert profile.overheads.cpu_op_us == pytest.approx(10.0, rel=1e-6)
    again = ktflow.compile(ktflow.load(demo_dir), hw=profile, max_seq_len=64)  # the fitted profile prices it so
    want = sum(s.end_us - s.start_us for s in measured if s.kind == "launch")
    got = sum(s.end_us - s.start_us for s in again.decode.instructions if s.kind == "launch")
    assert got == pytest.approx(want, rel=1e-3)


def test_a_replayed_step_fits_the_cpu_rate_the_gpu_fixed_time_and_the_step_edges(demo_dir):
    """fit_replayed on a hybrid plan (CPU experts between GPU layers) and a replayed step made
    from its prediction: tasks twice as long, 10 us more per GPU op in each gap, 500 us more at
    the step's edges than the plan's ops there."""
    hw = PRESETS["paper-a100"]
    c = ktflow.compile(ktflow.load(demo_dir), hw=hw, vram_budget_gb=0.004, max_seq_len=64)
    plan = c.decode
    tasks, gaps, in_gap, edge_ops = predicted_tasks(plan)
    assert len(tasks) >= 2 and len(gaps) == len(tasks) - 1 and all(k > 0 for k in in_gap) and edge_ops > 0
    meas_tasks = [2 * t for t in tasks]
    meas_gaps = [g + 10.0 * k for g, k in zip(gaps, in_gap)]
    wall = plan.predicted_step_us + sum(tasks) + 10.0 * (sum(in_gap) + edge_ops) + 500.0
    during = sum(1 for ins in plan.instructions if ins.kind in ("launch", "copy") and not ins.lane.startswith("cpu")) \
        - sum(in_gap) - edge_ops
    assert during > 0  # the shared experts run during the tasks: neither in a gap nor at an edge
    profile, fitted = fit_replayed(plan, Replayed(wall, meas_tasks, meas_gaps), c.plans.hw)
    assert profile.cpu.gemv_gbps == pytest.approx(c.plans.hw.cpu.gemv_gbps / 2, rel=1e-6)
    assert profile.overheads.gpu_launch_us == pytest.approx(c.plans.hw.overheads.gpu_launch_us + 10.0, rel=1e-6)
    assert profile.overheads.graph_step_us == pytest.approx(500.0, rel=1e-6)
    # (the replay times one step a launch: so does this plan's prediction)
    after = ktflow.compile(ktflow.load(demo_dir), hw=profile, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=1)
    assert after.decode.predicted_step_us == pytest.approx(wall, rel=0.1)  # the fitted profile prices it so
    assert fit_replayed(plan, Replayed(wall, meas_tasks[:-1], meas_gaps[:-1]), c.plans.hw) is None  # tasks differ
    # with greedy runs of 8 steps a launch 350 us a step faster: 400 us of the edge is the launch's, 100 the step's
    rep = Replayed(wall, meas_tasks, meas_gaps, greedy_us=wall - 350.0, greedy_k=8)
    profile, fitted = fit_replayed(plan, rep, c.plans.hw)
    assert profile.overheads.graph_step_us == pytest.approx(400.0, rel=1e-6)
    assert profile.overheads.decode_step_us == pytest.approx(100.0, rel=1e-6)
    assert "overheads.decode_step_us" in {f.term for f in fitted}
    for k, want in ((1, wall), (8, wall - 350.0)):  # the fitted profile prices both ways of running it
        again = ktflow.compile(ktflow.load(demo_dir), hw=profile, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=k)
        assert again.decode.predicted_step_us == pytest.approx(want, rel=0.1)


def test_a_gap_shorter_than_its_ops_takes_the_rest_off_the_hand_off(demo_dir):
    """A probe that met a busy host prices the hand-off far too long: the replayed gaps come out
    shorter than the plan's. The GPU ops' fixed time goes to zero and the rest of the difference
    comes off `overheads.cpu_sync_us` (one round trip a gap), so the fitted plan's gaps match."""
    base = PRESETS["paper-a100"]
    hw = base.model_copy(update={"overheads": base.overheads.model_copy(update={"cpu_sync_us": 300.0})})
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw=hw, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=1)
    tasks, gaps, in_gap, _ = predicted_tasks(c.decode)
    meas_gaps = [g - 280.0 for g in gaps]  # the round trip was 20 us: in every gap and at the edges' syncs
    launch = hw.overheads.gpu_launch_us
    wall = c.decode.predicted_step_us - 280.0 * (len(gaps) + _edge_syncs(c.decode))
    profile, fitted = fit_replayed(c.decode, Replayed(wall, tasks, meas_gaps), hw)
    assert profile.overheads.gpu_launch_us == 0.0
    k = sorted(in_gap)[len(in_gap) // 2]
    assert profile.overheads.cpu_sync_us == pytest.approx(300.0 - 280.0 + k * launch, rel=1e-6)
    assert {"overheads.cpu_sync_us", "overheads.gpu_launch_us"} <= {f.term for f in fitted}
    _, again, _, _ = predicted_tasks(ktflow.compile(model, hw=profile, vram_budget_gb=0.004, max_seq_len=64,
                                                    greedy_steps=1).decode)
    for want, got in zip(meas_gaps, again):
        assert got == pytest.approx(want, abs=2.0 + k * launch)  # within the zeroed fixed time of the gap's ops
    # the edges' syncs moved with it: no edge left over for the launch or the step, none kept from the profile
    assert profile.overheads.graph_step_us < 2 * k * launch and profile.overheads.decode_step_us == 0.0


def test_a_deferred_plans_replay_fits_the_rate_and_the_deferred_tasks_extra_time(demo_dir):
    """In a deferred plan each MoE layer but the last runs two CPU tasks (the picks needed now, the
    deferred ones): the rate comes from the first kind, and what the deferred ones take beyond
    their bytes at that rate becomes `overheads.cpu_deferred_us`, which the cost model then adds to
    every deferred part; an exact plan's replay fits the rate alone."""
    base = PRESETS["paper-a100"]  # a CPU 100x slower: the demo's small experts' tasks priced by their bytes
    hw = base.model_copy(update={"cpu": base.cpu.model_copy(update={"gemv_gbps": base.cpu.gemv_gbps / 100})})
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw=hw, vram_budget_gb=0.004, max_seq_len=64, defer=1, greedy_steps=1)
    tasks, gaps, _, _ = predicted_tasks(c.decode)
    late = deferred_tasks(c.decode)
    assert any(late) and not all(late)
    meas = [1.25 * t + (40.0 if d else 0.0) for t, d in zip(tasks, late)]  # 1.25x slower, deferred +40 us
    profile, fitted = fit_replayed(c.decode, Replayed(c.decode.predicted_step_us + sum(meas), meas, gaps), c.plans.hw)
    assert profile.cpu.gemv_gbps == pytest.approx(c.plans.hw.cpu.gemv_gbps / 1.25, rel=1e-6)
    assert profile.overheads.cpu_deferred_us == pytest.approx(40.0, rel=1e-6)
    assert any(f.term == "overheads.cpu_deferred_us" for f in fitted)
    # its gaps are not the GPU's chain (the next doorbell rings during the deferred task): nothing fitted from them
    assert not {"overheads.gpu_launch_us", "overheads.graph_step_us"} & {f.term for f in fitted}
    again = ktflow.compile(model, hw=profile, vram_budget_gb=0.004, max_seq_len=64, defer=1, greedy_steps=1)
    got, _, _, _ = predicted_tasks(again.decode)
    for t, g, d in zip(meas, got, deferred_tasks(again.decode)):
        assert g == pytest.approx(t, rel=0.05, abs=1.0), (d, t, g)  # the fitted profile prices both kinds so
    exact = ktflow.compile(model, hw=hw, vram_budget_gb=0.004, max_seq_len=64)
    tasks, gaps, _, _ = predicted_tasks(exact.decode)
    assert not any(deferred_tasks(exact.decode))
    profile, fitted = fit_replayed(exact.decode, Replayed(exact.decode.predicted_step_us, tasks, gaps), exact.plans.hw)
    assert profile.overheads.cpu_deferred_us == 0.0 and not any(f.term == "overheads.cpu_deferred_us" for f in fitted)


def test_a_launch_of_k_greedy_steps_shares_the_fixed_step_time(demo_dir):
    """`overheads.graph_step_us` is the host's work around one launch: a plan run K greedy steps a
    launch adds 1/K of it to its predicted step."""
    hw = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(graph_step_us=800.0)})
    model = ktflow.load(demo_dir)
    one = ktflow.compile(model, hw=hw, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=1).decode
    eight = ktflow.compile(model, hw=hw, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=8).decode
    assert one.capture and one.predicted_step_us - eight.predicted_step_us == pytest.approx(700.0, rel=1e-6)
    # every step's own fixed time is not shared
    hw2 = PRESETS["paper-a100"].model_copy(update={"overheads": Overheads(graph_step_us=800.0, decode_step_us=300.0)})
    eight2 = ktflow.compile(model, hw=hw2, vram_budget_gb=0.004, max_seq_len=64, greedy_steps=8).decode
    assert eight2.predicted_step_us - eight.predicted_step_us == pytest.approx(300.0, rel=1e-6)


@pytest.mark.skipif(not native_available(), reason="needs the native module")
def test_calibrating_here_fits_the_measured_ops_and_reports_the_step(demo_dir):
    """On the native backend the fit is a least-squares line through the traced ops (rate and fixed
    time per op), so the fitted profile prices the traced ops at their measured total. (Whether
    that brings the untraced step closer depends on the host: on the 16-core GPU host a traced
    CPU op ran several times slower than untraced, session 33.)"""
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="cpu", max_seq_len=64, backend="native")
    traced, walls = measure(c, steps=2)
    med = median_instructions(traced)
    profile, _ = fit(c.decode, med, c.plans.hw)
    again = ktflow.compile(model, hw=profile, max_seq_len=64, backend="native").decode
    cpu_ops = lambda instrs: sum(s.end_us - s.start_us for s in instrs  # noqa: E731
                                if s.kind == "launch" and c.decode.ir.by_name(s.node).place.device == Device.CPU)
    assert cpu_ops(again.instructions) == pytest.approx(cpu_ops(med), rel=0.05)
    assert len(walls) >= 3 and all(w > 0 for w in walls)
    cal = calibrate(model, "cpu", steps=2, max_seq_len=64, backend="native")
    (s,) = cal.steps  # no GPU: no deferred plan to measure
    assert s.plan == "exact" and s.measured_step_us > 0 and len(s.walls_us) >= 3
    assert any(f.term == "cpu.gemv_gbps" for f in cal.fitted) and "decode step (exact): measured" in cal.lines()[-1]


@pytest.mark.skipif(not native_available(), reason="needs the native module")
def test_a_model_that_cannot_defer_is_calibrated_on_its_exact_plan(tiny_dirs):
    d, _ = tiny_dirs("mixtral")  # top-2: no room for two deferred picks
    cal = calibrate(ktflow.load(d), "cpu", steps=2, max_seq_len=64, backend="native", dtype="float32")
    assert [s.plan for s in cal.steps] == ["exact"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "ktflow", *map(str, args)], capture_output=True, text=True)


def test_the_command_writes_a_profile_the_compiler_takes(demo_dir, tmp_path):
    out = tmp_path / "me.json"
    r = cli("calibrate", demo_dir, "--hw", "cpu", "--max-seq-len", 64, "--steps", 2, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "cpu.gemv_gbps" in r.stdout and f"wrote {out}" in r.stdout
    hw = resolve_hw(out)
    assert hw.name == "cpu+calibrated" and json.loads(out.read_text())["overheads"]["cpu_op_us"] >= 0
    r = cli("compile", demo_dir, "--hw", out, "--max-seq-len", 64)
    assert r.returncode == 0, r.stderr


def test_bad_calibrate_input_is_one_line(demo_dir, tmp_path):
    r = cli("calibrate", demo_dir, "--steps", 0)
    assert r.returncode == 2 and "--steps must be at least 1" in r.stderr and "Traceback" not in r.stderr
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    shutil.copy(demo_dir / "config.json", config_only / "config.json")
    r = cli("calibrate", config_only, "--hw", "cpu")
    assert r.returncode == 2 and "needs the checkpoint's *.safetensors" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not (torch.cuda.is_available() and native_available()), reason="needs CUDA and the native module")
def test_calibrating_a_replayed_hybrid_plan_measures_the_exact_plan_then_a_deferred_one(demo_dir):
    """On a GPU with CPU experts: the exact plan fits the rate, the GPU's fixed time and the step's
    edge; the plan deferring 1 pick a layer then adds the deferred task's extra time; both plans'
    predictions are reported beside their measured steps."""
    model = ktflow.load(demo_dir)
    base = PRESETS["paper-a100"]  # the dense work on this GPU (its memory), the experts on the CPU
    hw = base.model_copy(update={"gpus": [base.gpus[0].model_copy(
        update={"memory_bytes": float(torch.cuda.get_device_properties(0).total_memory)})]})
    opts = dict(max_seq_len=128, device="cuda", backend="cuda_graph", numa_nodes=1)  # one task a layer: one record
    probe = ktflow.compile(model, hw=hw, vram_budget_gb=1.0, **opts).decode
    dense = sum(n.weight_elems() * 2 for n in probe.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    cal = calibrate(model, hw, steps=16, vram_budget_gb=(dense + probe.memory.kv_cache_bytes) / 1e9, defer=1, **opts)
    assert [s.plan for s in cal.steps] == ["exact", "defer 1"]
    assert all(s.measured_step_us > 0 for s in cal.steps)
    terms = [f.term for f in cal.fitted]
    assert {"overheads.graph_step_us", "overheads.decode_step_us"} <= set(terms)
    assert terms[-1] == "overheads.cpu_deferred_us"
    assert cal.profile.overheads.cpu_deferred_us == cal.fitted[-1].after
    assert "decode step (defer 1)" in cal.lines()[-1]
