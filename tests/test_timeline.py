"""Predicted timeline readers: per-layer busy/overlap arithmetic, Chrome trace, HTML report, and
`compile --explain --trace --report` on every family."""

import json
import subprocess
import sys
from html.parser import HTMLParser

import pytest

import ktflow
from ktflow.plan.artifact import Instruction
from ktflow.plan.report import render_report
from ktflow.plan.timeline import _busy, _overlap, chrome_trace, layer_times, step_utilisation
from small_configs import CONFIGS


def test_busy_and_overlap_arithmetic():
    assert _busy([(0, 2), (1, 3), (5, 6)]) == 4  # merged intervals
    assert _overlap([(0, 4)], [(1, 2), (3, 6)]) == 2
    assert _overlap([(0, 4)], [(1, 3), (1, 3)]) == 2  # two NUMA lanes busy at once count once


@pytest.fixture(scope="module")
def hybrid(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", vram_budget_gb=0.004)


def test_layer_times_of_a_hybrid_plan(hybrid):
    times = {t.layer: t for t in layer_times(hybrid.decode)}
    assert set(times) == {None, 0, 1, 2, 3}
    moe = times[2]
    end = {s.node: s.end_us for s in hybrid.decode.instructions if s.kind not in ("record", "wait")}
    lo, hi = end["L1.ffn_res"], end["L2.ffn_res"]  # layer 2's window
    assert moe.span_us == pytest.approx(hi - lo)
    cpu = [(max(s.start_us, lo), min(s.end_us, hi)) for s in hybrid.decode.instructions
           if s.lane.startswith("cpu") and s.end_us > lo and s.start_us < hi]
    assert moe.cpu_us == pytest.approx(_busy(cpu)) and moe.cpu_us > 0
    assert 0 < moe.overlap_us <= min(moe.cpu_us, moe.gpu_us)
    assert times[0].cpu_us == 0  # the dense first layer runs on the GPU only
    util = step_utilisation(hybrid.decode)
    assert set(util) == {"gpu", "copy", "cpu", "cpu0", "cpu1"} and all(0 < f <= 1 for f in util.values())


def test_chrome_trace_has_one_event_per_instruction(hybrid):
    tr = chrome_trace(hybrid.plans)
    complete = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(p.instructions) for p in hybrid.plans.plans)
    decode = len(hybrid.prefill)  # one process per plan, decode last
    names = {(e["pid"], e["args"]["name"]) for e in tr["traceEvents"] if e.get("name") == "thread_name"}
    assert (decode, "cpu") in names and (decode, "gpu") in names
    e = next(e for e in complete if e["pid"] == decode and e["name"] == "L2.experts")
    s = next(s for s in hybrid.decode.instructions if s.node == "L2.experts")
    assert e["ts"] == s.start_us and e["args"]["device"] == "cpu"
    json.dumps(tr)


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows = 0
        self.text = []

    def handle_starttag(self, tag, attrs):
        self.rows += tag == "tr"

    def handle_data(self, data):
        self.text.append(data)


def test_report_lists_deferral_choices(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", vram_budget_gb=0.004, defer=1)
    html = render_report(c.plans)
    assert "L1.deferred" in html and "fixed by option" in html
    c = ktflow.compile(ktflow.load(demo_dir), hw="paper-a100", vram_budget_gb=0.004, defer=[2, 1, 0])
    assert "L2.deferred" in render_report(c.plans)
    assert "No deferral" in render_report(ktflow.compile(ktflow.load(demo_dir), hw="cpu").plans)


def test_report_renders_memory_timeline_and_placement(hybrid):
    html = render_report(hybrid.plans)
    p = _Collect()
    p.feed(html)
    text = " ".join(p.text)
    assert "peak VRAM" in text and "GPU/CPU overlap" in text and "L2.experts" in text
    assert "over the VRAM budget" in text
    assert p.rows >= len(hybrid.decode.ir) + 2 * 5 + 3


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_explain_trace_report_on_every_family(family, tmp_path):
    d = tmp_path / family
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS[family]))
    trace, report = tmp_path / "t.json", tmp_path / "r.html"
    r = subprocess.run([sys.executable, "-m", "ktflow", "compile", str(d), "--hw", "paper-4080", "--explain",
                        "--trace", str(trace), "--report", str(report)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "placement (decode plan" in r.stdout
    assert json.loads(trace.read_text())["traceEvents"] and report.read_text().startswith("<!doctype html>")


def test_instruction_fields_round_trip():
    ins = Instruction(kind="sync", node="L1.experts.sync", lane="gpu", reads=["a"], writes=["b"], start_us=1.0,
                      end_us=2.0)
    assert Instruction.model_validate_json(ins.model_dump_json()) == ins
    measured = ins.model_copy(update={"issue_us": 0.75})  # a measured run's host issue time
    assert Instruction.model_validate_json(measured.model_dump_json()).issue_us == 0.75


def test_handoffs_of_a_predicted_plan_are_the_profiles_overheads(hybrid):
    """In the predicted timeline each CPU task waits the profile's submit overhead before it
    starts and its sync the sync overhead after it ends; shifting a task's measured start and end
    shows up as that hand-off, and the summary line quotes both."""
    from ktflow.plan.timeline import handoff_summary, handoffs, with_measured_instructions

    o = hybrid.plans.hw.overheads
    h = [x for x in handoffs(hybrid.decode) if x.layer is not None]
    assert h and all(x.to_cpu_us == pytest.approx(o.cpu_submit_us) for x in h)
    assert all(x.to_gpu_us == pytest.approx(o.cpu_sync_us) for x in h)
    first = h[0]
    members = set(next(n for n in hybrid.decode.ir.nodes if n.op.value == "submit"
                       and n.attrs.task == first.task).attrs.members)
    late = [s.model_copy(update={"start_us": s.start_us + 40, "end_us": s.end_us + 40})
            if s.node in members and s.lane.startswith("cpu") else s for s in hybrid.decode.instructions]
    # the sync (and what follows on the GPU lane) moves by 40 + 7 us: 7 us more to see the task done
    at = next(i for i, s in enumerate(late) if s.kind == "sync" and hybrid.decode.ir.by_name(s.node).attrs.task
              == first.task)
    late[at] = late[at].model_copy(update={"end_us": late[at].end_us + 47})
    measured = with_measured_instructions(hybrid.decode, late)
    got = next(x for x in handoffs(measured) if x.task == first.task)
    assert got.to_cpu_us == pytest.approx(o.cpu_submit_us + 40) and got.to_gpu_us == pytest.approx(o.cpu_sync_us + 7)
    assert "predicted" in handoff_summary(measured, hybrid.decode)
