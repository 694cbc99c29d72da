"""benchmarks/copy_stall.py: decode steps beside copies to the GPU, a bare DMA and the expert
cache's own refills (what the placement pass prices an expert-cache copy at). The measurement
needs CUDA; without it the benchmark says so."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def run(demo_dir, out, *extra):
    return subprocess.run([sys.executable, str(BENCH / "copy_stall.py"), str(demo_dir), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


def test_a_refill_variant_swaps_n_experts_and_fills_empty_rows():
    from copy_stall import swapped

    rng = random.Random(1)
    resident = [3, 7, -1, 0]
    new = swapped(resident, 10, 1, rng)
    assert len(new) == 4 and len(set(new)) == 4 and all(0 <= e < 10 for e in new)
    assert new[2] not in resident  # the empty row filled from outside
    kept = [s for s in (0, 1, 3) if new[s] == resident[s]]
    assert len(kept) == 2  # one held expert swapped, the other two kept in their rows
    assert all(new[s] not in resident for s in (0, 1, 3) if s not in kept)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_says_what_it_needs(demo_dir, tmp_path):
    p = run(demo_dir, tmp_path / "s.jsonl")
    assert p.returncode == 2 and "needs a CUDA device" in p.stderr
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_each_variant_gets_a_row_against_the_baseline(demo_dir, tmp_path, device):
    """Every variant runs and is reported against the baseline; the refill variant's bytes are what
    the cache copied in (on the CPU the copies are host memory copies: the mechanics, not a
    measurement)."""
    out = tmp_path / "s.jsonl"
    p = run(demo_dir, out, "--mb", "2", "--piece-mb", "0.5", "--refill", "1", "--seqs", "2", "--prompt", "4",
            "--decode", "6", "--rounds", "1", "--device", device, *(["--backend", "native"] if device == "cpu" else []))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["kind"], r["mb"] if r["kind"] == "dma" else r["experts"]) for r in rows] == \
        [("dma", 0.0), ("dma", 2.0), ("refill", 1)]  # the baseline always runs
    base, dma, refill = rows
    assert base["ms_per_token"] > 0.0 and base["host_ms_per_token"] == 0.0
    assert dma["link_gbps"] > 0.0 and dma["piece_mb"] == 0.5 and dma["host_ms_per_token"] > 0.0
    assert refill["mb"] > 0.0 and refill["host_ms_per_token"] > 0.0  # the cache copied experts in
    for r in (dma, refill):
        assert r["stall"] == pytest.approx(r["added_ms_per_mb"] / r["link_ms_per_mb"], rel=0.01, abs=0.01)


def test_profile_says_where_a_step_ends_host_time_goes(demo_dir, tmp_path):
    """--profile K: each variant but the baseline gets a profile row, the step end's whole time
    first, then what no op took, then the ops by host time; a refill's ops include the copies
    into its rows."""
    out = tmp_path / "s.jsonl"
    p = run(demo_dir, out, "--mb", "1", "--refill", "1", "--seqs", "1", "--prompt", "4", "--decode", "6",
            "--rounds", "1", "--profile", "2", "--device", "cpu", "--backend", "native")
    assert p.returncode == 0, p.stderr[-2000:]
    profiles = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "profile"}
    assert sorted(profiles) == ["dma", "refill"] and profiles["refill"]["experts"] == 1
    for r in profiles.values():
        names = [o["op"] for o in r["ops"]]
        assert names[:2] == ["step end", "outside the ops"] and r["ops"][0]["us"] > 0
        ranked = [o["us"] for o in r["ops"][2:]]
        assert ranked == sorted(ranked, reverse=True) and sum(ranked) <= r["ops"][0]["us"]
    assert "aten::index_copy_" in [o["op"] for o in profiles["refill"]["ops"]]
    assert "refill 1: the host's time at a step end" in p.stdout
