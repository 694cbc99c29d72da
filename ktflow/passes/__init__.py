"""The pass pipeline.

PIPELINE is a literal tuple of (pass, stage it leaves the graph in). `run_pipeline` runs them in
order, verifies the graph after each, dumps the printed graph after a pass when asked
(`print_after=NAME` / `--print-after NAME`, or `KTFLOW_DUMP=dir` for every pass), and on failure
raises PassError naming the pass and the ones that ran before it, with the failing pass's input
graph written as a JSON reproducer. A ConfigError (options or hardware that cannot work, e.g. a
VRAM budget nothing fits) passes through as it is.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TextIO

from ..errors import ConfigError, PassError
from ..ir.graph import Graph
from ..ir.printer import print_graph
from ..ir.verify import VerifyError, verify
from ..options import CompileContext
from .costs import annotate_costs
from .defer import defer_experts
from .lower import lower
from .numa import split_numa
from .place import place_by_intensity
from .prefill import place_prefill_experts

Pass = Callable[[Graph, CompileContext], Graph]

PIPELINE: tuple[tuple[Pass, str], ...] = (
    (annotate_costs, "costed"),
    (place_by_intensity, "placed"),
    (place_prefill_experts, "placed"),
    (defer_experts, "placed"),
    (split_numa, "placed"),
    (lower, "lowered"),
)


def pass_names() -> list[str]:
    return [p.__name__ for p, _ in PIPELINE]


def run_pipeline(g: Graph, ctx: CompileContext, print_after: str | None = None,
                 out: TextIO | None = None, pipeline=PIPELINE) -> tuple[Graph, dict[str, float]]:
    """Run `pipeline` over `g`; returns the final graph and seconds spent per pass."""
    names = [p.__name__ for p, _ in pipeline]
    if print_after is not None and print_after not in names:
        raise PassError(f"--print-after {print_after!r}: no such pass; passes: {', '.join(names)}")
    dump_dir = os.environ.get("KTFLOW_DUMP")
    verify(g, "spec")
    timings: dict[str, float] = {}
    from ..progress import bar

    # a bar for a big model (seconds a plan), naming the running pass
    steps = bar(list(enumerate(pipeline)), f"compile {ctx.label}", "pass", show=len(g.nodes) > 300)
    for k, (fn, stage) in steps:
        if hasattr(steps, "set_postfix_str"):
            steps.set_postfix_str(fn.__name__, refresh=False)
        t0 = time.perf_counter()
        try:
            new = fn(g, ctx)
            verify(new, stage)
        except ConfigError:
            raise  # the user's input cannot be compiled as asked: the message says what to change
        except Exception as e:
            repro = _write_reproducer(g, fn.__name__)
            before = ", ".join(names[:k]) or "none"
            kind = "left the graph invalid" if isinstance(e, VerifyError) else "failed"
            raise PassError(f"pass {fn.__name__} {kind} ({ctx.label} plan): {e}\n  passes before it: {before}\n"
                            f"  its input graph: {repro}") from e
        timings[fn.__name__] = time.perf_counter() - t0
        g = new
        if dump_dir:
            d = Path(dump_dir)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{ctx.label}.{k + 1:02d}.{fn.__name__}.txt").write_text(print_graph(g))
        if print_after == fn.__name__:
            (out or sys.stdout).write(f"# {ctx.label} graph after {fn.__name__}\n" + print_graph(g))
    return g, timings


def _write_reproducer(g: Graph, pass_name: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"ktflow-{pass_name}-input-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(g.to_dict(), f)
    return path
