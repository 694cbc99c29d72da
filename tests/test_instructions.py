"""The one instruction loop (ktflow/backends/instructions.py) that every runner walks a plan's
instructions through."""

import pytest

import ktflow
from ktflow.backends.instructions import run_instructions


@pytest.fixture(scope="module")
def plan(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), "rtx4090-desktop", device="cpu").decode


def test_every_instruction_goes_to_its_kinds_handler_in_plan_order(plan):
    seen = []
    handlers = {k: (lambda kind: lambda i, ins, values: seen.append((i, kind, ins.kind)))(k)
                for k in ("launch", "copy", "fetch", "submit", "sync", "record", "wait")}
    run_instructions(plan, handlers)
    assert [i for i, _, _ in seen] == list(range(len(plan.instructions)))
    assert all(kind == ins_kind for _, kind, ins_kind in seen)


def test_values_are_dropped_after_their_last_reader_unless_kept(plan):
    def write(i, ins, values):
        for w in ins.writes:
            values[w] = i

    handlers = dict.fromkeys(("launch", "copy", "fetch", "submit", "sync", "record", "wait"), write)
    freed = run_instructions(plan, handlers)
    kept = run_instructions(plan, handlers, free=False)
    dropped = {name for names in plan.frees for name in names}
    assert dropped and not dropped & set(freed)
    assert set(plan.ir.outputs) <= set(freed)
    assert dropped <= set(kept)


def test_a_kind_without_a_handler_is_named(plan):
    with pytest.raises(KeyError, match="launch"):
        run_instructions(plan, {})


def test_the_watcher_sees_each_instruction_before_and_after_it_runs(plan):
    log = []

    class Watch:
        def before(self, i, ins):
            log.append(("before", i))

        def after(self, i, ins, values):
            log.append(("after", i))

    handlers = dict.fromkeys(("launch", "copy", "fetch", "submit", "sync", "record", "wait"),
                             lambda i, ins, values: log.append(("run", i)))
    run_instructions(plan, handlers, watcher=Watch())
    assert log == [(what, i) for i in range(len(plan.instructions)) for what in ("before", "run", "after")]
