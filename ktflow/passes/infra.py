"""What a pass declares, and the instruments the pipeline runner calls around each pass.

A pass is a function `(Graph, CompileContext) -> Graph`. `@compiler_pass(requires=, produces=)`
declares the stage it needs its input graph in and the stage its output is verified at (stages
in order: spec < costed < placed < lowered < scheduled < buffered, `ir.verify.STAGES`). The pipeline is checked against
those declarations before anything runs: a pass that needs a placed graph cannot sit before the
placement (`edit_pipeline` raises a ConfigError naming both). An undeclared pass (a researcher's
plain function) requires "spec" and is verified at the stage its position leaves the graph in.

An instrument watches the pipeline without being part of it (printing, dumping, timing, or a
researcher's own measurement): the runner calls `start(names, ctx)` once, then `before(name, g,
ctx)` and `after(name, g, ctx, seconds)` around each pass, the graph `after` sees already verified.
The built-ins: `PassTimer` (seconds per pass, what a plan records), `PrintAfter` (the printed
graph after one pass: `--print-after`), `DumpEach` (every pass's printed graph into a directory:
KTFLOW_DUMP).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, TextIO

from ..errors import PassError
from ..util.fsutil import write_atomic
from ..ir.graph import Graph
from ..ir.printer import print_graph
from ..ir.verify import STAGES
from ..plan.options import CompileContext

Pass = Callable[[Graph, CompileContext], Graph]


def compiler_pass(requires: str, produces: str) -> Callable[[Pass], Pass]:
    """Declare a pass's input and output stages (see the module doc)."""
    for what, stage in (("requires", requires), ("produces", produces)):
        if stage not in STAGES:
            raise ValueError(f"compiler_pass({what}={stage!r}): stages are {', '.join(STAGES)}")

    def mark(fn: Pass) -> Pass:
        fn.requires, fn.produces = requires, produces
        return fn

    return mark


def requires(fn: Pass) -> str:
    """The stage `fn` needs its input graph in ("spec" where it declares none)."""
    return getattr(fn, "requires", "spec")


def check_stages(pipeline) -> None:
    """A ConfigError naming the first pass whose required stage the passes before it do not reach."""
    from ..errors import ConfigError

    stage, before = "spec", "the start"
    for fn, produced in pipeline:
        need = requires(fn)
        if STAGES.index(need) > STAGES.index(stage):
            raise ConfigError(f"pass {fn.__name__} requires a {need!r} graph, but at its place in the pipeline the "
                              f"graph is only {stage!r} (after {before}); move it after the pass that makes it {need!r}")
        stage, before = produced, fn.__name__


class Instrument:
    """Hooks the pipeline runner calls (see the module doc); each does nothing unless overridden."""

    def start(self, names: list[str], ctx: CompileContext) -> None:
        pass

    def before(self, name: str, g: Graph, ctx: CompileContext) -> None:
        pass

    def after(self, name: str, g: Graph, ctx: CompileContext, seconds: float) -> None:
        pass


class PassTimer(Instrument):
    """Seconds each pass took (`seconds`, by pass name), as the plan's pass_seconds records them."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def start(self, names: list[str], ctx: CompileContext) -> None:
        self.seconds = {}

    def after(self, name: str, g: Graph, ctx: CompileContext, seconds: float) -> None:
        self.seconds[name] = seconds


class PrintAfter(Instrument):
    """Writes the printed graph after pass `name` to `out` (stdout by default)."""

    def __init__(self, name: str, out: TextIO | None = None):
        self.name, self.out = name, out

    def start(self, names: list[str], ctx: CompileContext) -> None:
        if self.name not in names:
            raise PassError(f"--print-after {self.name!r}: no such pass; passes: {', '.join(names)}")

    def after(self, name: str, g: Graph, ctx: CompileContext, seconds: float) -> None:
        if name == self.name:
            (self.out or sys.stdout).write(f"# {ctx.label} graph after {name}\n" + print_graph(g))


class DumpEach(Instrument):
    """Writes the printed graph after every pass to `directory`/<plan>.<NN>.<pass>.txt."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.k = 0

    def start(self, names: list[str], ctx: CompileContext) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.k = 0

    def after(self, name: str, g: Graph, ctx: CompileContext, seconds: float) -> None:
        self.k += 1
        write_atomic(self.dir / f"{ctx.label}.{self.k:02d}.{name}.txt", print_graph(g))
