"""Custom passes without editing ktflow: compile(passes=...) inserts, replaces or drops passes of
the pipeline, each verified at its position and named in failures and dumps; the plan file records
the pipeline; the CLI loads passes from a module or a file."""

import json
from dataclasses import replace

import pytest

import ktflow
from ktflow.errors import ConfigError, PassError
from ktflow.ir.ops import Op
from ktflow.ir.types import Device, Placement
from ktflow.passes import Instrument, compiler_pass, edit_pipeline, pass_names


def every_expert_on_the_cpu(g, ctx):
    """A replacement placement: routed experts on the CPU, the rest on the GPU."""
    dev = lambda n: Device.CPU if n.op in (Op.ROUTED_EXPERTS, Op.INPUT) else Device.GPU  # noqa: E731
    return g.map(lambda n: replace(n, place=Placement(dev(n), cause="every_expert_on_the_cpu")))


def tag_causes(g, ctx):
    """An inserted pass: marks every placed node's cause."""
    return g.map(lambda n: replace(n, place=replace(n.place, cause=n.place.cause + " [seen by tag_causes]")))


def forget_placements(g, ctx):
    return g.map(lambda n: replace(n, place=None))


def test_edit_pipeline_inserts_replaces_and_drops_in_order():
    p = edit_pipeline([("after:place_by_intensity", tag_causes), ("drop:defer_experts", None),
                       ("before:annotate_costs", forget_placements)])
    assert pass_names(p) == ["forget_placements", "annotate_costs", "place_by_intensity", "tag_causes",
                             "place_prefill_experts", "split_numa", "lower", "schedule", "plan_buffers"]
    stages = dict((fn.__name__, stage) for fn, stage in p)
    assert stages["tag_causes"] == "placed" and stages["forget_placements"] == "spec"
    assert pass_names(edit_pipeline([("replace:place_by_intensity", every_expert_on_the_cpu)]))[1] == \
        "every_expert_on_the_cpu"


@pytest.mark.parametrize("edit,message", [
    (("sideways:lower", tag_causes), "must be one of 'before:PASS'"),
    (("after:no_such_pass", tag_causes), "no pass 'no_such_pass' in the pipeline; passes: annotate_costs"),
    (("after:lower", 42), "must be a named callable"),
    (("after:lower", edit_pipeline), None),
    ("after:lower", "expected a \\(where, pass\\) pair"),
])
def test_bad_pipeline_edits_are_named(edit, message):
    if message is None:  # a pass whose name is taken
        from ktflow.passes import lower

        with pytest.raises(ConfigError, match="a pass named 'lower' is already in the pipeline"):
            edit_pipeline([("after:split_numa", lower)])
        return
    with pytest.raises(ConfigError, match=message):
        edit_pipeline([edit])


def test_compile_runs_custom_passes_and_the_plan_records_them(demo_dir, tmp_path):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004, defer=1,
                       passes=[("after:place_by_intensity", tag_causes), ("drop:defer_experts", None)])
    g = c.decode.ir
    assert all("[seen by tag_causes]" in n.place.cause for n in g.nodes if n.op in (Op.ATTENTION, Op.GATE, Op.MLP))
    assert not any(".def" in n.name for n in g.nodes)  # deferral dropped, though asked for
    assert "tag_causes" in c.decode.pass_seconds and "defer_experts" not in c.decode.pass_seconds
    assert any(p.endswith(":tag_causes") for p in c.plans.pipeline)
    assert not any(p.endswith(":defer_experts") for p in c.plans.pipeline)
    c.save(tmp_path / "p.json")
    assert ktflow.Compiled.load(tmp_path / "p.json", model).plans.pipeline == c.plans.pipeline
    assert "pipeline  " in c.summary() and "tag_causes" in c.summary()
    plain = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004)
    assert "pipeline  " not in plain.summary() and len(plain.plans.pipeline) == 8


def test_a_replaced_pass_decides_and_a_broken_one_is_named(demo_dir):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="paper-a100", passes=[("replace:place_by_intensity", every_expert_on_the_cpu)])
    experts = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS]
    assert experts and all(n.place.device == Device.CPU for n in experts)
    assert c.decode.ir.by_name("L0.attn").place.device == Device.GPU
    with pytest.raises(PassError, match="pass forget_placements left the graph invalid.*P1"):
        ktflow.compile(model, hw="paper-a100", passes=[("after:place_by_intensity", forget_placements)])


def test_print_after_names_a_custom_pass(demo_dir, capsys):
    model = ktflow.load(demo_dir)
    ktflow.compile(model, hw="paper-a100", print_after="tag_causes", passes=[("after:split_numa", tag_causes)])
    assert "graph after tag_causes" in capsys.readouterr().out


@compiler_pass(requires="placed", produces="placed")
def gpu_attention_only(g, ctx):
    """A declared pass: needs placements (it reads them), leaves a placed graph."""
    return g.map(lambda n: n if n.op != Op.MLP else replace(n, place=Placement(Device.CPU, cause="gpu_attention_only")))


def test_an_inserted_pass_takes_the_stage_of_the_pass_before_it_after_every_edit():
    from ktflow.passes import PIPELINE

    without_schedule = PIPELINE[:-2]  # (the schedule needs the lowered graph, the buffer pass the scheduled one)
    p = edit_pipeline([("after:lower", tag_causes), ("drop:lower", None)], pipeline=without_schedule)
    assert dict((fn.__name__, stage) for fn, stage in p)["tag_causes"] == "placed"  # lower is gone


def test_a_declared_pass_is_checked_against_its_place_before_anything_runs():
    p = edit_pipeline([("after:place_by_intensity", gpu_attention_only)])
    assert dict((fn.__name__, stage) for fn, stage in p)["gpu_attention_only"] == "placed"
    with pytest.raises(ConfigError, match="pass gpu_attention_only requires a 'placed' graph, but at its place in "
                                          "the pipeline the graph is only 'costed' \\(after annotate_costs\\)"):
        edit_pipeline([("before:place_by_intensity", gpu_attention_only)])
    with pytest.raises(ConfigError, match="pass place_by_intensity requires a 'costed' graph.*only 'spec'"):
        edit_pipeline([("drop:annotate_costs", None)])
    with pytest.raises(ValueError, match="stages are spec, costed, placed, lowered, scheduled"):
        compiler_pass(requires="routed", produces="placed")


def test_instruments_watch_every_pass_from_outside_the_pipeline(demo_dir):
    """An instrument handed to compile sees each pass's name and verified output graph (here:
    how many nodes each pass leaves on the GPU), the decode plan's and the largest prefill
    bucket's; timing is an instrument too (what the plan's pass_seconds hold)."""
    class GpuNodes(Instrument):
        def __init__(self):
            self.seen = []

        def start(self, names, ctx):
            self.names = names

        def after(self, name, g, ctx, seconds):
            assert seconds >= 0
            self.seen.append((ctx.label, name, sum(n.place is not None and n.place.device == Device.GPU
                                                   for n in g.nodes)))

    watch = GpuNodes()
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="paper-a100", vram_budget_gb=0.004, instruments=[watch])
    decode = [(name, gpu) for label, name, gpu in watch.seen if label == "decode"]
    assert [name for name, _ in decode] == pass_names() == watch.names
    assert decode[0][1] == 0 and decode[1][1] > 0  # costed: nothing placed yet; placed: dense work on the GPU
    labels = {label for label, _, _ in watch.seen}
    assert "decode" in labels and len(labels) == 2  # and one prefill plan: the largest bucket's
    assert set(c.decode.pass_seconds) == set(pass_names())


def test_cli_loads_passes_from_a_file_and_a_module(demo_dir, tmp_path, monkeypatch, capsys):
    from ktflow.tools import cli

    f = tmp_path / "mypasses.py"
    f.write_text("from dataclasses import replace\n\n"
                 "def mark(g, ctx):\n"
                 "    return g.map(lambda n: replace(n, place=replace(n.place, cause='marked by mark')))\n")
    out = tmp_path / "plan.json"
    assert cli.main(["compile", str(demo_dir), "--hw", "paper-a100", "--pass", f"{f}:mark@after=split_numa",
                     "--drop-pass", "defer_experts", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert any(p.endswith(":mark") for p in plan["pipeline"]) and not any("defer_experts" in p for p in plan["pipeline"])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["compile", str(demo_dir), "--hw", "paper-a100", "--pass", "mypasses:mark", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["pipeline"][-4].endswith("mypasses:mark")  # default: before lower
    capsys.readouterr()
    for bad, message in ((f"{f}:nothing", "has no function 'nothing'"), ("no_such_module_x:f", "importing no_such"),
                         (f"{f}:mark@under=lower", "@after=PASS, @before=PASS or @replace=PASS")):
        assert cli.main(["compile", str(demo_dir), "--hw", "paper-a100", "--pass", bad, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
