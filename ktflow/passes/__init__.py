"""The pass pipeline.

PIPELINE is a literal tuple of (pass, stage it leaves the graph in); each built-in pass declares
the stage it requires and the one it produces (`infra.compiler_pass`), and the pipeline's order
is checked against them before it runs. `run_pipeline` runs the passes in order, verifies the
graph after each at its stage, calls the instruments it is given around each pass (timing,
`--print-after NAME`, `KTFLOW_DUMP=dir`: `infra`), and on failure raises PassError naming the
pass and the ones that ran before it, with the failing pass's input graph written as a JSON
reproducer. A ConfigError (options or hardware that cannot work, e.g. a VRAM budget nothing
fits) passes through as it is.

`edit_pipeline` applies a caller's edits (compile(..., passes=[(where, pass), ...]), or the CLI's
--pass / --drop-pass through `load_pass`): passes of one's own inserted, replaced or dropped
without editing this file, run and verified like the built-in ones.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import TextIO

from ..errors import ConfigError, PassError
from ..ir.graph import Graph
from ..ir.verify import VerifyError, verify
from ..plan.options import CompileContext
from .annotate_costs import annotate_costs
from .defer import defer_experts
from .infra import DumpEach, Instrument, Pass, PassTimer, PrintAfter, check_stages, compiler_pass
from .lower import lower
from .numa import split_numa
from .place import place_by_intensity
from .prefill import place_prefill_experts
from .schedule import schedule
from .buffers import plan_buffers
from ..util import env

__all__ = ["PIPELINE", "Pass", "Instrument", "PassTimer", "PrintAfter", "DumpEach", "compiler_pass",
           "edit_pipeline", "load_pass", "pass_id", "pass_names", "run_pipeline", "default_instruments"]

PIPELINE: tuple[tuple[Pass, str], ...] = tuple((p, p.produces) for p in (
    annotate_costs,
    place_by_intensity,
    place_prefill_experts,
    defer_experts,
    split_numa,
    lower,
    schedule,
    plan_buffers,
))


#: how compile(..., passes=...) edits the pipeline: (where, pass) pairs, applied in order
WHERE = ("before", "after", "replace", "drop")


def pass_names(pipeline=PIPELINE) -> list[str]:
    return [p.__name__ for p, _ in pipeline]


def pass_id(fn: Pass) -> str:
    """Where a pass comes from, as a plan records it: `module:qualname`."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def edit_pipeline(edits, pipeline=PIPELINE) -> tuple[tuple[Pass, str], ...]:
    """`pipeline` with `edits` applied in order. Each edit is a pair (where, pass):

        ("after:place_by_intensity", fn)   insert fn after that pass
        ("before:lower", fn)               insert fn before it
        ("replace:defer_experts", fn)      run fn instead of it
        ("drop:defer_experts", None)       leave it out

    A pass is any callable `(Graph, CompileContext) -> Graph` with a `__name__` unique in the
    pipeline (the name `print_after`, dumps and failures use). The graph it returns is verified
    at the stage it declares (`compiler_pass(produces=)`), else at the stage of its position: an
    inserted pass leaves the stage the pass before it in the edited pipeline leaves ("spec" at
    the start), a replacement the stage of the pass it replaces. A pass's declared `requires`
    must be reached by the passes before it. Raises ConfigError naming what is wrong."""
    out = list(pipeline)
    for k, edit in enumerate(edits or ()):
        if not (isinstance(edit, (tuple, list)) and len(edit) == 2 and isinstance(edit[0], str)):
            raise ConfigError(f"passes[{k}]: expected a (where, pass) pair such as ('after:place_by_intensity', fn), "
                              f"got {edit!r}")
        where, fn = edit
        kind, _, target = where.partition(":")
        names = pass_names(out)
        if kind not in WHERE or not target:
            raise ConfigError(f"passes[{k}]: where {where!r} must be one of " + ", ".join(f"'{w}:PASS'" for w in WHERE))
        if target not in names:
            raise ConfigError(f"passes[{k}]: no pass {target!r} in the pipeline; passes: {', '.join(names)}")
        at = names.index(target)
        if kind == "drop":
            del out[at]
            continue
        if not callable(fn) or not getattr(fn, "__name__", None):
            raise ConfigError(f"passes[{k}]: the pass for {where!r} must be a named callable (Graph, CompileContext) "
                              f"-> Graph, got {fn!r}")
        if fn.__name__ in names and not (kind == "replace" and fn.__name__ == target):
            raise ConfigError(f"passes[{k}]: a pass named {fn.__name__!r} is already in the pipeline; give it "
                              "another name")
        if kind == "replace":
            out[at] = (fn, getattr(fn, "produces", out[at][1]))
        else:  # an undeclared insertion's stage: the one the pass before it leaves, once every edit is in
            out.insert(at + 1 if kind == "after" else at, (fn, getattr(fn, "produces", None)))
    stage = "spec"
    for k, (fn, produced) in enumerate(out):
        if produced is None:
            out[k] = (fn, stage)
        stage = out[k][1]
    check_stages(out)
    return tuple(out)


def load_pass(target: str) -> Pass:
    """The pass a CLI names: `package.module:function`, or `path/to/file.py:function`."""
    import importlib
    import importlib.util

    module, sep, name = target.rpartition(":")
    if not sep or not module or not name:
        raise ConfigError(f"--pass {target!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    try:
        if module.endswith(".py") or "/" in module:
            path = Path(module)
            if not path.is_file():
                raise ConfigError(f"--pass {target!r}: no file {path}")
            spec = importlib.util.spec_from_file_location(str(path), path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - anything its import raised: one line naming it
        raise ConfigError(f"--pass {target!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"--pass {target!r}: {module} has no function {name!r}")
    return fn


def default_instruments(print_after: str | None = None, out: TextIO | None = None) -> list[Instrument]:
    """What `ktflow compile` runs the pipeline with: `PrintAfter(print_after)` when asked, and
    `DumpEach(KTFLOW_DUMP)` when that variable names a directory."""
    found: list[Instrument] = []
    if print_after is not None:
        found.append(PrintAfter(print_after, out))
    if env.get("KTFLOW_DUMP"):
        found.append(DumpEach(env.get("KTFLOW_DUMP")))
    return found


def run_pipeline(g: Graph, ctx: CompileContext, pipeline=PIPELINE, instruments=()) -> Graph:
    """Run `pipeline` over `g` with `instruments` (infra.Instrument) watching; returns the final
    graph, verified at the last pass's stage."""
    names = [p.__name__ for p, _ in pipeline]
    check_stages(pipeline)
    for ins in instruments:
        ins.start(names, ctx)
    verify(g, "spec")
    from ..util.progress import bar

    # a bar for a big model (seconds a plan), naming the running pass
    steps = bar(list(enumerate(pipeline)), f"compile {ctx.label}", "pass", show=len(g.nodes) > 300)
    for k, (fn, produced) in steps:
        if hasattr(steps, "set_postfix_str"):
            steps.set_postfix_str(fn.__name__, refresh=False)
        for ins in instruments:
            ins.before(fn.__name__, g, ctx)
        t0 = time.perf_counter()
        try:
            new = fn(g, ctx)
            verify(new, produced)
        except ConfigError:
            raise  # the user's input cannot be compiled as asked: the message says what to change
        except Exception as e:
            repro = _write_reproducer(g, fn.__name__)
            before = ", ".join(names[:k]) or "none"
            kind = "left the graph invalid" if isinstance(e, VerifyError) else "failed"
            raise PassError(f"pass {fn.__name__} {kind} ({ctx.label} plan): {e}\n  passes before it: {before}\n"
                            f"  its input graph: {repro}") from e
        seconds = time.perf_counter() - t0
        g = new
        for ins in instruments:
            ins.after(fn.__name__, g, ctx, seconds)
    return g


def _write_reproducer(g: Graph, pass_name: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"ktflow-{pass_name}-input-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(g.to_dict(), f)
    return path
