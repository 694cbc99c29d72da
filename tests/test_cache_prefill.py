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
    # the cache plans' refill from the prompt is timed apart too, and is part of their total
    for r in (short, long):
        assert r["routing_profile"] is None
        for name in ("cache", "cache_cpu"):
            assert 0 <= r[f"{name}_refill_ms"] < 1e3 * r["tokens"] / r[f"{name}_tok_s"]


def test_a_routing_profile_places_every_plan(demo_dir, tmp_path):
    """With --routing-profile every plan is placed by it: the static plan keeps each layer's most
    picked expert on the GPU (a few prompts make a profile far from uniform)."""
    import ktflow
    from ktflow.runtime.routing import record_routing

    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="cpu", device="cpu", backend="native", placement="cpu", max_seq_len=64)
    prof = record_routing(c, [[5, 9, 2, 7, 1, 1, 3, 8]] * 2, decode=4, progress=False)
    path = tmp_path / "routing.json"
    path.write_text(prof.model_dump_json() + "\n")
    out = tmp_path / "p.jsonl"
    p = run(demo_dir, out, "--share", "0.1", "--tokens", "8", "--rounds", "1", "--routing-profile", str(path))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["routing_profile"] == str(path) and row["static_tok_s"] > 0
    assert row["static_gpu"]
    for layer, ids in row["static_gpu"].items():
        fr = prof.layers[int(layer)]
        assert max(range(len(fr)), key=fr.__getitem__) in ids


def test_bad_lengths_are_one_line_and_write_nothing(demo_dir, tmp_path):
    out = tmp_path / "p.jsonl"
    p = run(demo_dir, out, "--tokens", "8,x")
    assert p.returncode == 2 and "--tokens takes a comma list" in p.stderr and not out.exists()
