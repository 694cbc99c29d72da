"""The package's layering, read from the source's imports (every import, also those inside
functions): compiling never touches hardware or runs anything (the IR, the passes and the plan
modules import no backend, no runtime, no native module and no torch); backends run plans and do
not plan (they import no pass, but for the one exception named below); the runtime and the
public API do not import each other."""

import ast
from pathlib import Path

import ktflow
from ktflow.backends import BACKENDS
from ktflow.options import BACKEND_NAMES

ROOT = Path(ktflow.__file__).parent
COMPILER = [*(ROOT / "ir").glob("*.py"), *(ROOT / "passes").glob("*.py"),
            *(ROOT / f for f in ("cost.py", "memory.py", "plan.py", "plan_check.py", "timeline.py", "diff.py",
                                 "options.py", "vram_plan.py"))]
RUNNING = ("ktflow.backends", "ktflow.runtime", "ktflow.native", "ktflow._native", "ktflow.api", "torch")


def imported(path: Path) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved against its package)."""
    package = list(path.relative_to(ROOT.parent).parts[:-1])  # a module's package; an __init__'s own
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


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_compiling_imports_nothing_that_runs():
    bad = {p.name: sorted(i for i in imported(p) if under(i, RUNNING)) for p in COMPILER}
    assert not {k: v for k, v in bad.items() if v}


def test_backends_do_not_plan():
    found = {(p.name, i) for p in (ROOT / "backends").glob("*.py") for i in imported(p) if under(i, ("ktflow.passes",))}
    found = {(f, i.rsplit(".", 1)[0] if i.count(".") > 2 else i) for f, i in found}
    assert not found, found


def test_runtime_and_api_do_not_import_each_other():
    for p in (ROOT / "runtime").glob("*.py"):
        assert not any(under(i, ("ktflow.api",)) for i in imported(p)), p.name


def test_the_hardware_profiles_run_nothing():
    """ktflow.hw describes machines; the probe that times kernels on this one is ktflow.tools.probe."""
    assert not sorted(i for i in imported(ROOT / "hw.py") if under(i, RUNNING[:-1] + ("ktflow.tools",)))
    assert "ktflow.backends.handoff_probe.round_trip_us" in imported(ROOT / "tools" / "probe.py")


def test_the_reader_sees_imports_inside_functions():
    """The rules above would pass vacuously if lazy imports went unseen."""
    assert "ktflow.backends.BACKENDS" not in imported(ROOT / "options.py")  # moved out this way
    assert "ktflow.ir.verify.violations" in imported(ROOT / "plan_check.py")  # inside plan_problems
    assert "ktflow.native" in imported(ROOT / "backends" / "__init__.py")  # inside resolve_backend


def test_backend_names_match_the_registered_backends():
    assert set(BACKEND_NAMES) == set(BACKENDS)


def test_the_compiler_imports_without_torch():
    """`import ktflow.ir` (and the passes, the plan, the profiles) needs no torch: the package face
    loads what runs things on first use."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import ktflow, ktflow.ir.graph, ktflow.passes, ktflow.plan, ktflow.hw, ktflow.options\n"
            "assert 'ktflow.api' not in sys.modules and 'ktflow.backends' not in sys.modules\n"
            "assert ktflow.HwProfile and ktflow.KtflowError and ktflow.__version__\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
