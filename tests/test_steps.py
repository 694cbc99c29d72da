"""The one step loop (ktflow/backends/steps.py) that every runner walks a plan's steps through."""

import pytest

import ktflow
from ktflow.backends.steps import run_steps


@pytest.fixture(scope="module")
def plan(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), "rtx4090-desktop", device="cpu").decode


def test_every_step_goes_to_its_kinds_handler_in_plan_order(plan):
    seen = []
    handlers = {k: (lambda kind: lambda i, step, values: seen.append((i, kind, step.kind)))(k)
                for k in ("launch", "copy", "fetch", "submit", "sync", "record", "wait")}
    run_steps(plan, handlers)
    assert [i for i, _, _ in seen] == list(range(len(plan.steps)))
    assert all(kind == step_kind for _, kind, step_kind in seen)


def test_values_are_dropped_after_their_last_reader_unless_kept(plan):
    def write(i, step, values):
        for w in step.writes:
            values[w] = i

    handlers = dict.fromkeys(("launch", "copy", "fetch", "submit", "sync", "record", "wait"), write)
    freed = run_steps(plan, handlers)
    kept = run_steps(plan, handlers, free=False)
    dropped = {name for names in plan.frees for name in names}
    assert dropped and not dropped & set(freed)
    assert set(plan.ir.outputs) <= set(freed)
    assert dropped <= set(kept)


def test_a_kind_without_a_handler_is_named(plan):
    with pytest.raises(KeyError, match="launch"):
        run_steps(plan, {})


def test_the_watcher_sees_each_step_before_and_after_it_runs(plan):
    log = []

    class Watch:
        def before(self, i, step):
            log.append(("before", i))

        def after(self, i, step, values):
            log.append(("after", i))

    handlers = dict.fromkeys(("launch", "copy", "fetch", "submit", "sync", "record", "wait"),
                             lambda i, step, values: log.append(("run", i)))
    run_steps(plan, handlers, watcher=Watch())
    assert log == [(what, i) for i in range(len(plan.steps)) for what in ("before", "run", "after")]
