"""The package's layering, read from the source's imports (every import, also those inside
functions and under TYPE_CHECKING): one rule per folder says which folders its modules may import,
the folders stand on floors along the data path (frontend -> ir -> costmodel -> plan -> passes ->
backends -> runtime -> api -> serve -> tools), and no two modules import each other, directly or
round a loop."""

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

import ktflow

ROOT = Path(ktflow.__file__).parent

#: folder (or loose module) -> the folders its modules may import besides itself; "ktflow" is the
#: package face, "_native" the C++ extension. The compiler (ir, frontend's parse, costmodel, plan,
#: passes) imports nothing that runs: no backend, runtime, torch-using API or native module.
MAY_IMPORT = {
    "errors": set(),
    "version": set(),
    "util": {"errors"},
    "ir": {"errors", "util"},
    "frontend": {"errors", "util", "ir", "models"},
    "models": {"ir", "frontend"},
    "costmodel": {"errors", "util", "ir"},
    "plan": {"errors", "util", "version", "ir", "costmodel"},
    "passes": {"errors", "util", "ir", "costmodel", "plan"},
    "backends.kernels": {"errors", "util", "ir", "costmodel", "frontend"},
    "backends": {"errors", "util", "ir", "costmodel", "frontend", "plan", "backends.kernels", "backends.native",
                 "backends.cuda"},
    "backends.native": {"errors", "util", "ir", "costmodel", "frontend", "plan", "backends", "backends.kernels",
                        "_native", "ktflow"},
    "backends.cuda": {"errors", "util", "ir", "costmodel", "frontend", "plan", "backends", "backends.kernels",
                      "backends.native"},
    "runtime": {"errors", "util", "ir", "costmodel", "frontend", "plan", "backends", "backends.native"},
    "api": {"errors", "util", "ir", "costmodel", "frontend", "plan", "passes", "backends", "runtime"},
    "serve": {"errors", "util", "backends", "runtime", "api"},
    "tools": {"errors", "util", "version", "ir", "frontend", "costmodel", "plan", "passes", "backends",
              "backends.kernels", "backends.native", "backends.cuda", "runtime", "api", "serve", "models", "ktflow"},
    "ktflow": {"errors", "version", "costmodel"},
    "__main__": {"tools"},
}
#: the backends folder's own modules: its face registers the subfolders' backends; they build on its
#: reference backend and base types, never on the face
BACKENDS_FACE = "ktflow.backends"


def module_of(path: Path) -> tuple[str, list[str]]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), parts[:-1]
    return ".".join(parts), parts[:-1]


def imported(path: Path) -> set[str]:
    """Every module or name `path` imports, absolute (relative imports resolved)."""
    _, package = module_of(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def folder(name: str) -> str | None:
    """The rule a ktflow module or name falls under (None: not ktflow's)."""
    parts = name.split(".")
    if parts[0] == "torch":
        return "torch"
    if parts[0] != "ktflow":
        return None
    if len(parts) == 1:
        return "ktflow"
    if parts[1] == "backends" and len(parts) > 2 and parts[2] in ("native", "cuda", "kernels"):
        return f"backends.{parts[2]}"
    return parts[1]


MODULES = {module_of(p)[0]: p for p in ROOT.rglob("*.py")}


def test_every_module_falls_under_a_rule():
    assert not sorted(m for m in MODULES if folder(m) not in MAY_IMPORT)


def test_each_folder_imports_only_what_its_rule_allows():
    bad = set()
    for mod, path in MODULES.items():
        own = folder(mod)
        for name in imported(path):
            other = folder(name)
            if other in (None, own, "torch") or (other == "ktflow" and name.count(".") == 1 and own != "ktflow"):
                continue  # not ktflow's, the same folder, or `from .. import errors`-like names checked below
            if other not in MAY_IMPORT[own]:
                bad.add((mod, name))
    assert not sorted(bad)


#: the one compiler module that may import torch, inside a function: describing this machine
#: (hw='this') reads its CUDA device's name and memory where torch is installed
READS_THIS_MACHINE = {("ktflow.costmodel.hw", "torch")}


def test_the_compiler_imports_nothing_that_runs():
    """ir, costmodel, plan and passes: no torch, no backend, runtime or native module (also lazily)."""
    compiler = ("ir", "costmodel", "plan", "passes")
    found = {(m, n) for m, p in MODULES.items() if folder(m) in compiler for n in imported(p)
             if (m, n) not in READS_THIS_MACHINE
             if folder(n) in ("torch", "backends", "backends.native", "backends.cuda", "backends.kernels", "runtime",
                              "api") or n.startswith("ktflow._native")}
    assert not sorted(found)


def test_no_module_imports_the_backends_face_from_inside_backends():
    found = {m for m, p in MODULES.items() if folder(m).startswith("backends") and m != BACKENDS_FACE
             and any(n == BACKENDS_FACE or n.startswith(BACKENDS_FACE + ".") and n.count(".") == 2
                     and n.rsplit(".", 1)[1] in ("BACKENDS", "resolve_backend", "make_backend") for n in imported(p))}
    assert not sorted(found)


def test_no_import_circle():
    """No module reaches itself through imports (inside functions and TYPE_CHECKING blocks too)."""
    g = nx.DiGraph()
    for mod, path in MODULES.items():
        for name in imported(path):
            # a name's module: the longest prefix that is a module
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                target = ".".join(parts[:i])
                if target in MODULES:
                    break
            else:
                continue
            if target != mod and not (target == "ktflow" and mod != "ktflow.__main__"):
                g.add_edge(mod, target)
    circles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not circles


def test_the_reader_sees_imports_inside_functions():
    """The rules above would pass vacuously if lazy imports went unseen."""
    assert "ktflow.ir.verify.violations" in imported(ROOT / "plan" / "check.py")  # inside plan_problems
    assert "ktflow.backends.native.binding" in imported(ROOT / "backends" / "__init__.py")  # resolve_backend


def test_the_probe_that_runs_kernels_is_a_tool():
    """ktflow.costmodel.hw describes machines (a compiler folder: the rule above keeps it from running
    anything); the probe that times kernels on this one is ktflow.tools.probe."""
    assert "ktflow.tools.handoff_probe.round_trip_us" in imported(ROOT / "tools" / "probe.py")


def test_backend_names_match_the_registered_backends():
    from ktflow.backends import BACKENDS
    from ktflow.plan.options import BACKEND_NAMES

    assert set(BACKEND_NAMES) == set(BACKENDS)


def test_at_most_eight_modules_stand_loose_at_the_top():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(loose) <= 8, loose


def test_the_compiler_imports_without_torch():
    """`import ktflow.ir` (and the passes, the plan, the profiles) needs no torch: the package face
    loads what runs things on first use."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import ktflow, ktflow.ir.graph, ktflow.passes, ktflow.plan.artifact, ktflow.costmodel.hw\n"
            "import ktflow.plan.options, ktflow.frontend.config\n"
            "assert 'ktflow.api' not in sys.modules and 'ktflow.backends' not in sys.modules\n"
            "assert ktflow.HwProfile and ktflow.KtflowError and ktflow.__version__\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
