"""benchmarks/copy_stall.py: decode steps beside copies to the GPU (what the placement pass prices
an expert-cache copy at). The measurement needs CUDA; without it the benchmark says so."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent / "benchmarks"


def run(demo_dir, out, *extra):
    return subprocess.run([sys.executable, str(BENCH / "copy_stall.py"), str(demo_dir), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_says_what_it_needs(demo_dir, tmp_path):
    p = run(demo_dir, tmp_path / "s.jsonl")
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_size_gets_a_row_against_the_baseline(demo_dir, tmp_path):
    out = tmp_path / "s.jsonl"
    p = run(demo_dir, out, "--mb", "2", "--piece-mb", "0.5", "--seqs", "2", "--prompt", "4", "--decode", "6",
            "--rounds", "1")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mb"] for r in rows] == [0.0, 2.0]  # the baseline always runs
    base, copied = rows
    assert base["added_ms_per_mb"] == 0.0 and base["ms_per_token"] > 0.0
    assert copied["link_ms_per_mb"] > 0.0 and copied["link_gbps"] > 0.0 and copied["piece_mb"] == 0.5
    assert copied["host_issue_ms_per_token"] > 0.0 and base["host_issue_ms_per_token"] == 0.0
    assert copied["stall"] == pytest.approx(copied["added_ms_per_mb"] / copied["link_ms_per_mb"], rel=0.01, abs=0.01)
