"""benchmarks/results.py: the committed benchmarks/RESULTS.md is what the script generates from the
committed JSONL rows; a new row shows up with its commit; a malformed line stops the run with its
file and line and writes nothing. Stdlib only, no GPU, well under a second or two."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCH / "results.py"


def load():
    """benchmarks/results.py as a module (benchmarks/ is not a package); dataclasses need it in sys.modules."""
    name = "ktflow_bench_results"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def copy_bench(tmp: Path, stems: list[str] | None = None) -> Path:
    d = tmp / "bench"
    d.mkdir()
    for p in BENCH.glob("*.jsonl"):
        if stems is None or p.stem in stems:
            shutil.copy(p, d / p.name)
            if (BENCH / f"{p.stem}.py").exists():
                shutil.copy(BENCH / f"{p.stem}.py", d / f"{p.stem}.py")
    shutil.copy(BENCH / "SUMMARY.md", d / "SUMMARY.md")
    return d


def test_committed_results_match_the_rows():
    """Regenerate with `make results` when this fails (new rows, a changed SUMMARY.md or docstring)."""
    text = load().render(BENCH)
    committed = (BENCH / "RESULTS.md").read_text(encoding="utf-8")
    assert committed == text, "benchmarks/RESULTS.md is stale: run `make results`"


def test_render_is_deterministic_and_carries_the_summary():
    mod = load()
    a, b = mod.render(BENCH), mod.render(BENCH)
    assert a == b
    assert (BENCH / "SUMMARY.md").read_text(encoding="utf-8").rstrip("\n") in a
    assert "do not edit by hand" in a.lower() and "make results" in a
    for p in BENCH.glob("*.jsonl"):
        assert f"\n## {p.stem}\n" in a


def test_appended_row_appears_with_its_commit(tmp_path):
    d = copy_bench(tmp_path, ["user_configs", "graph_nodes"])
    row = dict(bench="graph_nodes", commit="abc1234+dirty", machine="vm", cpu="Test CPU",
               gpu="Test GPU 24GB", kind="probe kind", kernels=7, nodes=3, us_per_replay=123.456, us_per_node=4.5)
    with open(d / "graph_nodes.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")
    out = tmp_path / "out" / "R.md"
    out.parent.mkdir()
    r = run("--bench-dir", str(d), "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text(encoding="utf-8")
    assert "### graph_nodes: Test GPU 24GB" in text
    [line] = [x for x in text.splitlines() if x.startswith("| abc1234+dirty |")]
    assert line == "| abc1234+dirty | probe kind | 7 | 3 | 123.5 | 4.5 |"
    # the other machine's table is untouched by the new row, and the unlisted files are not there
    assert "### graph_nodes: NVIDIA H100 80GB HBM3" in text and "## e2e" not in text
    # --check agrees with what was written, and notices a change
    assert run("--bench-dir", str(d), "--out", str(out), "--check").returncode == 0
    out.write_text(text + "edited\n")
    assert run("--bench-dir", str(d), "--out", str(out), "--check").returncode == 1


def test_unknown_benchmark_gets_generic_columns(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    (d / "new_bench.py").write_text('"""A new benchmark. More text here."""\n')
    rows = [dict(commit=f"{i:07x}", cpu="Some CPU", size=i, tok_s=10.0 * i, blob=[1, 2]) for i in range(1, 4)]
    (d / "new_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = load().render(d)
    assert "A new benchmark. (`benchmarks/new_bench.py`" in text
    assert "| commit | size | tok_s |" in text and "| 0000003 | 3 | 30 |" in text
    assert "blob" not in text


def test_large_table_keeps_the_latest_run_and_counts_the_rest(tmp_path):
    mod = load()
    d = tmp_path / "bench"
    d.mkdir()
    rows = [dict(commit="old0001", gpu="G", variant=f"v{i}", decode_tok_s=float(i)) for i in range(mod.MAX_ROWS)]
    rows += [dict(commit="new0002", gpu="G", variant="v", decode_tok_s=99.0)]
    (d / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = mod.render(d)
    assert f"{len(rows)} rows in 2 runs; the latest run (new0002, 1 rows)" in text
    assert "| old0001 | 40 | 0 – 39 |" in text
    assert "| old0001 | v3 |" not in text


def test_malformed_line_names_file_and_line_and_writes_nothing(tmp_path):
    d = copy_bench(tmp_path, ["graph_nodes", "defer_speed"])
    with open(d / "defer_speed.jsonl", "a") as fh:
        fh.write('{"commit": "abc1234", "variant": \n')
    n = sum(1 for _ in open(d / "defer_speed.jsonl"))
    out = tmp_path / "R.md"
    r = run("--bench-dir", str(d), "--out", str(out))
    assert r.returncode != 0
    assert f"defer_speed.jsonl:{n}:" in r.stderr and "malformed JSON" in r.stderr
    assert not out.exists()
    assert list(tmp_path.glob("*.tmp")) == [] and list(tmp_path.glob(".R.md*")) == []
    # an existing output stays as it was
    out.write_text("before\n")
    assert run("--bench-dir", str(d), "--out", str(out)).returncode != 0
    assert out.read_text() == "before\n"


def test_non_object_row_is_an_error(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    (d / "x.jsonl").write_text('{"commit": "a"}\n\n[1, 2]\n')
    with pytest.raises(load().ResultsError, match=r"x\.jsonl:3: a row must be a JSON object"):
        load().render(d)


def test_number_formatting():
    mod = load()
    assert [mod.num(x) for x in (45322.0, 8984.1, 106.52489, 0.9102832, 2.6e-05, 1352552448.0, 3, True)] == \
        ["45322", "8984", "106.5", "0.9103", "2.6e-05", "1.353e+09", "3", "yes"]
    assert mod.cell(mod.PM(1059.3, 80.09)) == "1059 ± 80.1"
    assert mod.cell("a|b") == "a\\|b" and mod.cell(None) == "—" and mod.cell(mod.MISSING) == ""
    assert mod.short_commit("0123456789abcdef0123456789abcdef01234567") == "0123456"
    assert mod.short_commit("43ee0d9+dirty") == "43ee0d9+dirty"
