"""benchmarks/cache_prefill.py: long-prompt prefill through static and cached plans (here on the
CPU, where the GPU lane runs on the CPU too: the code path and the plans' decisions, not a speed)."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent / "benchmarks"


def run(demo_dir, out, *extra):
    return subprocess.run([sys.executable, str(BENCH / "cache_prefill.py"), str(demo_dir), "--device", "cpu",
                           "--backend", "native", "--hw", "rtx4090-desktop", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


def test_each_length_times_the_four_plans_and_names_the_layers_streamed_whole(demo_dir, tmp_path):
    out = tmp_path / "p.jsonl"
    p = run(demo_dir, out, "--share", "0.1", "--tokens", "8,1024", "--rounds", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    short, long = [json.loads(line) for line in out.read_text().splitlines()]
    assert (short["tokens"], long["tokens"]) == (8, 1024)
    for r in (short, long):
        assert all(r[f"{name}_tok_s"] > 0 for name in ("static", "static_cpu", "cache", "cache_cpu"))
    # the cache plan has a cached layer, kept for a short prompt and streamed whole for a long one
    assert long["cached_layers"] and short["whole_layers"] == []
    assert long["whole_layers"] and set(long["whole_layers"]) <= set(long["cached_layers"])
    assert "cached layers streamed whole: [" in p.stdout


def test_bad_lengths_are_one_line_and_write_nothing(demo_dir, tmp_path):
    out = tmp_path / "p.jsonl"
    p = run(demo_dir, out, "--tokens", "8,x")
    assert p.returncode == 2 and "--tokens takes a comma list" in p.stderr and not out.exists()
