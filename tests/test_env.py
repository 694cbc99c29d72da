"""One registry of environment variables (ktflow/util/env.py): every KTFLOW_ name the package or
the native library reads is in it, only the registry reads them, docs/env.md lists the table, and
a value that does not parse is an error naming the variable."""

import re
from pathlib import Path

import pytest

import ktflow
from ktflow.errors import ConfigError
from ktflow.util import env

ROOT = Path(ktflow.__file__).parent
REPO = ROOT.parent


def names_in(paths) -> set[str]:
    return {m for p in paths for m in re.findall(r"\bKTFLOW_[A-Z_]+[A-Z]\b", p.read_text())}


def test_every_variable_the_code_reads_is_registered():
    python = names_in(p for p in ROOT.rglob("*.py"))
    native = names_in(p for p in (REPO / "native").rglob("*") if p.suffix in (".cpp", ".h"))
    assert python | native <= set(env.VARIABLES), sorted((python | native) - set(env.VARIABLES))
    assert {"KTFLOW_SPIN_US", "KTFLOW_NATIVE_ISA", "KTFLOW_HUGEPAGES"} <= native  # the reader sees the C++


def test_only_the_registry_reads_the_environment_for_them():
    reads = re.compile(r"(os\.environ|getenv)[^\n]*KTFLOW_")
    found = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.name != "env.py" and reads.search(p.read_text())]
    assert not found


def test_the_docs_list_the_registry():
    assert env.table() in (REPO / "docs" / "env.md").read_text()


def test_values_parse_by_kind(monkeypatch):
    monkeypatch.setenv("KTFLOW_THREADS", "12")
    monkeypatch.setenv("KTFLOW_QUIET", "yes")
    monkeypatch.delenv("KTFLOW_PIN", raising=False)
    assert env.get("KTFLOW_THREADS") == 12 and env.get("KTFLOW_QUIET") is True and env.get("KTFLOW_PIN") is True
    monkeypatch.setenv("KTFLOW_PIN", "0")
    assert env.get("KTFLOW_PIN") is False


@pytest.mark.parametrize("name,value", [("KTFLOW_THREADS", "many"), ("KTFLOW_DEBUG", "2"),
                                        ("KTFLOW_THREADS", "100000"), ("KTFLOW_THREADS", "-3"),
                                        ("KTFLOW_SPIN_US", "-5"), ("KTFLOW_SPIN_US", "abc"),
                                        ("KTFLOW_NATIVE_ISA", "bogus"), ("KTFLOW_RANK_TIMEOUT", "0")])
def test_a_value_that_does_not_parse_or_is_out_of_range_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        env.get(name)


def test_the_native_librarys_variables_are_checked_before_it_runs(demo_dir, tmp_path):
    """The library reads these itself: a bad value is one line and exit 2 before it is used."""
    import os
    import subprocess
    import sys

    for name, value in (("KTFLOW_NATIVE_ISA", "bogus"), ("KTFLOW_SPIN_US", "-5")):
        r = subprocess.run([sys.executable, "-m", "ktflow", "run", str(demo_dir), "--input-ids", "1,2",
                            "--max-new-tokens", "2", "--hw", "cpu"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, name: value})
        assert r.returncode == 2 and f"environment variable {name}=" in r.stderr, r.stderr
