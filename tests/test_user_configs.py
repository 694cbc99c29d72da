"""benchmarks/user_configs.py (ktflow at a VRAM limit, greedy and sampled decode), llama_user.py
(llama.cpp held to the same limit), gguf_synth.py and user_report.py: the whole mode on a tiny
model on the CPU (the plans' GPU lane runs on the CPU: the code path and the rows, not a speed),
llama.cpp's side through a stand-in llama-bench, and the arithmetic each side relies on."""

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

LIMIT = 0.08  # GB: the tiny Qwen3 shape's dense weights, workspaces and some of its experts (no reserve)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from e2e import write_checkpoint
    from user_configs import MODELS

    d = tmp_path_factory.mktemp("uc") / "qwen3-tiny"
    write_checkpoint(MODELS["qwen3-tiny"], d)
    return d


def run_uc(ckpt, out, model="qwen3-tiny", limit=LIMIT, *extra):
    return subprocess.run([sys.executable, str(BENCH / "user_configs.py"), "--model", model, "--dir", str(ckpt),
                           "--device", "cpu", "--hw", "rtx4090-desktop", "--vram-gb", str(limit),
                           "--options", '{"vram_reserve_gb": 0}', "--prefill", "32,64", "--prefill-reps", "1",
                           "--decode", "4", "--rounds", "1", "--dram-mib", "16", "--run-id", "t", "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=900)


def test_every_phase_writes_its_rows_on_the_cpu(tiny_qwen3, tmp_path):
    """user (prefill at each length, greedy / one step a launch / sampled decode, VRAM), the
    decode-only placement beside it, experts on the CPU with VRAM free; then the report's ratios."""
    out = tmp_path / "uc.jsonl"
    p = run_uc(tiny_qwen3, out)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["run_id"] for r in rows} == {"t"} and all(r["vram_gb"] == LIMIT for r in rows)
    pre = {(r["variant"], r["prompt"]): r for r in rows if r["table"] == "prefill"}
    assert sorted(pre) == [("cpu-experts", 32), ("cpu-experts", 64), ("user", 32), ("user", 64)]
    assert all(r["tok_s"] > 0 and r["decisions"] for r in pre.values())
    dec = {r["variant"]: r for r in rows if r["table"] == "decode"}
    assert sorted(dec) == ["greedy", "greedy, one step a launch", "sampled"]
    assert dec["greedy, one step a launch"]["greedy_steps"] == 1 and dec["greedy"]["greedy_steps"] > 1
    assert (dec["sampled"]["temperature"], dec["sampled"]["top_p"]) == (0.7, 0.95)
    assert dec["greedy, one step a launch"]["same_placement_as_greedy"] is True
    assert all(r["decode_tok_s"] > 0 and len(r["dram_gbps_rounds"]) == 1 for r in dec.values())
    # the physical limit beside each rate: the CPU's expert bytes a token at the round's DRAM read
    assert all(r["cpu_expert_bytes_per_token"] > 0 and r["cpu_roofline_fraction"] > 0 for r in dec.values())
    ab = {r["variant"]: r for r in rows if r["table"] == "decode_ab"}
    assert sorted(ab) == ["decode-only greedy", "greedy"]
    # nothing reserved for prefill: the decode-only placement holds at least the experts of the
    # user's plan in the same limit (as many where the VRAM plan itself chose decode first)
    assert ab["decode-only greedy"]["gpu_experts"] >= ab["greedy"]["gpu_experts"] == dec["greedy"]["gpu_experts"]
    assert ab["greedy"]["vs_decode_only"] > 0
    vram = {r["variant"]: r for r in rows if r["table"] == "vram"}
    assert sorted(vram) == ["cpu-experts", "user"]
    assert vram["user"]["predicted_gb"] <= LIMIT * 1.0005  # every plan the user phase ran fits the limit
    assert "decode" in vram["user"]["plans"] and any(p.startswith("prefill") for p in vram["user"]["plans"])
    limited = [r for r in rows if r["table"] in ("prefill", "decode") and r["variant"] != "cpu-experts"]
    assert all(r.get("vram_option") for r in limited)
    from user_report import report

    lines = []
    got = report(rows, out=lines.append)[("qwen3-tiny", LIMIT)]
    assert got["prefill32_vs_free"] > 0 and got["sampled_vs_one_step"] > 0 and got["oom"] is False
    assert got["prefill32_vs_llama"] is None and got["greedy_vs_llama"] is None  # no llama.cpp rows in this run
    assert any("decode-only" in line for line in lines)


def test_decode_after_a_long_prompt_is_measured_and_reported(tiny_qwen3, tmp_path):
    """--decode-depth: greedy and sampled decode after a prompt of that length, beside the short
    prompt's rows, and the report's rows for that depth."""
    out = tmp_path / "uc.jsonl"
    p = run_uc(tiny_qwen3, out, "qwen3-tiny", LIMIT, "--phases", "user", "--decode-depth", "96")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    deep = {r["variant"]: r for r in rows if r["table"] == "decode" and r["decode_depth"] == 96}
    assert sorted(deep) == ["greedy", "sampled"] and all(r["decode_tok_s"] > 0 for r in deep.values())
    assert len([r for r in rows if r["table"] == "decode" and r["decode_depth"] == 0]) == 3
    from user_report import report

    lines = []
    report(rows, out=lines.append)
    assert any("greedy after 96 tokens" in line for line in lines)


def test_a_traced_prompt_writes_its_trace_and_busy_time_per_lane(tiny_qwen3, tmp_path):
    """--trace-dir: one prompt of each length runs instrumented; its Chrome trace is written and a
    row gives each lane's measured busy time beside the plan's predicted one."""
    out = tmp_path / "uc.jsonl"
    p = run_uc(tiny_qwen3, out, "qwen3-tiny", LIMIT, "--phases", "user", "--trace-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if '"prefill_trace"' in line]
    assert sorted(r["prompt"] for r in rows) == [32, 64]
    for r in rows:
        trace = json.loads(Path(r["trace"]).read_text())
        assert trace["traceEvents"] if isinstance(trace, dict) else trace
        assert r["span_us"] > 0 and r["predicted_us"] > 0
        assert r["busy_us"] and set(r["busy_us"]) <= set(r["predicted_busy_us"]) | {"host"}
        # the GPU side by kind (lane:op), measured beside predicted, the most measured first
        kinds = r["gpu_kinds_us"]
        assert kinds and all(k.split(":")[0] in ("gpu", "fetch") for k in kinds)
        measured = [m for m, _, _ in kinds.values()]
        assert measured == sorted(measured, reverse=True) and any(p > 0 for _, p, _ in kinds.values())
    assert "traced prefill 64" in p.stdout and "GPU-side kinds" in p.stdout and "grouped experts through" in p.stdout
    assert all(r["grouped_matmul"] for r in rows)


def test_deepseek_v2_lite_shape_runs_the_user_phase(tmp_path):
    out = tmp_path / "uc.jsonl"
    p = run_uc(tmp_path / "ds", out, "dsv2lite-tiny", 0.075, "--phases", "user")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["table"] for r in rows) == ["decode", "decode", "decode", "prefill", "prefill", "vram"]
    assert all(r["model"] == "dsv2lite-tiny" for r in rows)


def test_the_limit_is_met_by_the_plans_that_must_fit(tiny_qwen3):
    """Under vram_gb the plans that must fit do, and a decode-only placement fills the limit with
    at least the experts of the one that may reserve room for prefill."""
    import ktflow
    from user_configs import compile_limited, resident

    def peak_gb(plans) -> float:
        return max(p.memory.gpu_bytes for p in plans) / 1e9

    model = ktflow.load(tiny_qwen3)
    base = dict(hw="rtx4090-desktop", device="cpu", backend="native", max_seq_len=132, vram_reserve_gb=0)
    user, _, how = compile_limited(model, base, LIMIT, False)
    only, _, how_d = compile_limited(model, base, LIMIT, True)
    assert peak_gb([user.decode, *user.prefill]) <= LIMIT * 1.0005
    assert peak_gb([only.decode]) <= LIMIT * 1.0005
    assert resident(only.decode)["gpu_experts"] >= resident(user.decode)["gpu_experts"]
    assert how == "vram_gb" and how_d == "vram_gb+prefill_reserve=none"


def test_ncmoe_leaves_the_fewest_blocks_experts_on_the_cpu():
    from llama_user import buffers, choose_ncmoe, expert_bytes_by_block

    sizes = [("token_embd.weight", 99), ("blk.0.ffn_gate_inp.weight", 5), ("output.weight", 7)]
    sizes += [(f"blk.{b}.ffn_{k}_exps.weight", 10) for b in range(1, 4) for k in ("gate", "up", "down")]
    sizes += [(f"blk.{b}.attn_q.weight", 3) for b in range(4)]
    per = expert_bytes_by_block(sizes)
    assert per == {1: 30, 2: 30, 3: 30}  # a leading dense block holds none
    assert [choose_ncmoe(per, 4, room) for room in (1e9, 90, 89, 60, 30, 29, 0)] == [0, 0, 2, 2, 3, 4, 4]
    log = ("load_tensors:        CUDA0 model buffer size =  1234.50 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size = 30000.00 MiB\n"
           "llama_kv_cache:      CUDA0 KV buffer size =   768.00 MiB\n"
           "llama_context:      CUDA0 compute buffer size =   300.25 MiB\n"
           "llama_context:  CUDA_Host compute buffer size =    40.00 MiB\n"
           "llama_context:      CUDA0 compute buffer size =   512.00 MiB\n")
    assert buffers(log) == {"model": 1234.5, "KV": 768.0, "compute": 512.0}


FAKE_BENCH = r'''
import json, sys
a = sys.argv[1:]
val = lambda f, d=None: a[a.index(f) + 1] if f in a else d
blocks, grow = 4, float(sys.argv[0].endswith("grow"))
gpu = 0 if "-ot" in a else blocks - int(val("-ncmoe", 0))
compute = 200 + (600 * grow if gpu else 0)  # (grow: more compute buffer once any experts are on the GPU)
print(f"load_tensors: CUDA0 model buffer size = {1000 + 500 * gpu:.2f} MiB", file=sys.stderr)
print(f"llama_kv_cache: CUDA0 KV buffer size = {100 + (int(val('-p', 0)) + int(val('-d', 0))) / 64:.2f} MiB",
      file=sys.stderr)
print(f"llama_context: CUDA0 compute buffer size = {compute:.2f} MiB", file=sys.stderr)
if val("-r") != "0":
    for t in val("-t").split(","):
        print(json.dumps(dict(avg_ts=50.0 + gpu, stddev_ts=1.0, n_threads=int(t), build_commit="fake")))
'''


@pytest.mark.parametrize("grow", [False, True])
def test_llama_side_probes_chooses_and_keeps_to_the_limit(tmp_path, monkeypatch, grow):
    """A stand-in llama-bench whose buffers follow -ncmoe: the probe (every expert on the CPU)
    prices the rest, N leaves room for what fits, and a run over the limit (its compute buffer
    grew) is run again with N raised."""
    import llama_user

    monkeypatch.setattr(llama_user, "card", lambda field="memory.used": None)  # no nvidia-smi: from the buffers
    fake = tmp_path / ("llama-bench-grow" if grow else "llama-bench")
    fake.write_text(FAKE_BENCH)
    binary = tmp_path / "run"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    binary.chmod(0o755)
    sizes = [(f"blk.{b}.ffn_{k}_exps.weight", 500 * 2**20 // 3) for b in range(4) for k in ("gate", "up", "down")]
    a = types.SimpleNamespace(vram_gb=3.5, reps=1, out=str(tmp_path / "l.jsonl"), llama_commit="")
    ll = llama_user.Llama(a, binary, Path("model.gguf"), sizes, dict(run_id="t"))
    rows = ll.run("prefill", 512, 2048, "16", "ncmoe")
    # probe: 1300 MiB of buffers + 0.6 GB guessed context = 1.96 GB; 1.54 GB left: two blocks' experts
    (row,) = rows
    assert row["n_cpu_moe"] == (3 if grow else 2) and row["within_limit"] and row["tok_s"] > 50
    assert row["gpu_expert_blocks"] == 4 - row["n_cpu_moe"] and row["prompt"] == 512 and row["ub"] == 2048
    (dec,) = ll.run("decode", 16, 0, "16", "ncmoe")
    assert dec["decode_tokens"] == 16 and dec["threads"] == 16 and dec["decode_depth"] == 0
    # after 65536 tokens (-d) its KV cache takes another GiB: a block's experts fewer on the GPU
    (deep,) = ll.run("decode", 16, 0, "16", "ncmoe", 65536)
    assert deep["decode_depth"] == 65536 and deep["n_cpu_moe"] > dec["n_cpu_moe"] and deep["within_limit"]
    written = [json.loads(line) for line in Path(a.out).read_text().splitlines()]
    assert [r["table"] for r in written] == ["llama_prefill", "llama_decode", "llama_decode"]


def test_llama_side_as_one_server_configuration_holds_the_longest_prompts_ncmoe(tmp_path, monkeypatch):
    """The server configuration's -ncmoe, the longest prompt's test's (its KV cache that long), is
    more than decode's own test chose, and a test run at it keeps that N (no probe of its own),
    marked as such."""
    import llama_user

    monkeypatch.setattr(llama_user, "card", lambda field="memory.used": None)
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_BENCH)
    calls = tmp_path / "calls"
    binary = tmp_path / "run"
    binary.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexec {sys.executable} {fake} \"$@\"\n")
    binary.chmod(0o755)
    sizes = [(f"blk.{b}.ffn_{k}_exps.weight", 500 * 2**20 // 3) for b in range(4) for k in ("gate", "up", "down")]
    a = types.SimpleNamespace(vram_gb=3.5, reps=1, out=str(tmp_path / "l.jsonl"), llama_commit="")
    ll = llama_user.Llama(a, binary, Path("model.gguf"), sizes, dict(run_id="t", dram_gbps=100.0))
    ll.pick_share = 0.25
    (own,) = ll.run("decode", 16, 0, "16", "ncmoe")
    # its CPU blocks' expert bytes, a token's share of each, at the DRAM read
    assert own["cpu_expert_bytes_per_token"] == round(sum(ll.per_block[i] for i in range(own["n_cpu_moe"])) * 0.25)
    assert own["cpu_roofline_fraction"] == round(own["tok_s"] * own["cpu_expert_bytes_per_token"] / 100e9, 3)
    (longest,) = ll.run("prefill", 32768, 2048, "16", "ncmoe")  # the server's -ncmoe: this test's
    n = longest["n_cpu_moe"]
    assert n == own["n_cpu_moe"] + 1  # its KV cache another 512 MiB: a block fewer on the GPU
    calls.unlink()
    (dec,) = ll.run("decode", 16, 0, "16", "server", ncmoe=n)
    assert dec["n_cpu_moe"] == n and dec["placement"] == "server" and "one server configuration" in dec["system"]
    assert dec["tok_s"] < own["tok_s"]  # fewer experts on the GPU than its own test chose
    assert len(calls.read_text().splitlines()) == 1  # timed at N, no probe


def test_gguf_synth_repeats_the_last_block_with_random_q8_0(tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf_synth import q8_0_pool, synthesize, tensor_sizes
    from llama_user import expert_bytes_by_block

    tpl = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(tpl, arch="qwen3moe")
    w.add_block_count(1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("blk.0.attn_norm.weight", np.full(64, 2.0, dtype=np.float32))
    exps = q8_0_pool(2 * 4 * 2, 5).reshape(2, 4, 2 * 34)  # [experts, rows, bytes of 64 columns]
    w.add_tensor("blk.0.ffn_gate_exps.weight", exps, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "o.gguf"
    synthesize(tpl, out, 3, pool_blocks=64, log=lambda s: None)
    r = gguf.GGUFReader(out)
    assert r.fields["qwen3moe.block_count"].contents() == 3
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    t = {x.name: x for x in r.tensors}
    assert list(t) == ["token_embd.weight", "blk.0.attn_norm.weight", "blk.0.ffn_gate_exps.weight",
                       "blk.1.attn_norm.weight", "blk.1.ffn_gate_exps.weight", "blk.2.attn_norm.weight",
                       "blk.2.ffn_gate_exps.weight", "output_norm.weight"]
    for b in (1, 2):
        assert np.array_equal(t[f"blk.{b}.attn_norm.weight"].data, t["blk.0.attn_norm.weight"].data)
        e = t[f"blk.{b}.ffn_gate_exps.weight"]
        assert e.tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert list(e.shape) == list(t["blk.0.ffn_gate_exps.weight"].shape)
        blocks = np.asarray(e.data).reshape(-1, 34)
        assert (blocks[:, :2].copy().view(np.float16) == np.float16(0.02 / 73.3)).all()
        assert not np.array_equal(e.data, t["blk.0.ffn_gate_exps.weight"].data)  # new random bytes
    assert expert_bytes_by_block(tensor_sizes(out)) == {0: exps.nbytes, 1: exps.nbytes, 2: exps.nbytes}


def test_report_reads_each_target_off_the_rows():
    from user_report import report

    info = dict(bench="user_configs", run_id="r", model="qwen3", vram_gb=24.0, gpu="H100", layers=48, commit="c")
    rows = [dict(info, table="prefill", variant="user", prompt=8192, tok_s=9000.0, sd=1.0, decisions="L0-47 split"),
            dict(info, table="prefill", variant="cpu-experts", prompt=8192, tok_s=12000.0, sd=1.0, decisions="x"),
            dict(info, table="llama_prefill", system="llama.cpp -ncmoe 20, -ub 2048", prompt=8192, tok_s=2000.0,
                 sd=1.0),
            dict(info, table="llama_prefill", system="llama.cpp -ncmoe 21, -ub 4096", prompt=8192, tok_s=3000.0,
                 sd=1.0),
            dict(info, table="llama_decode", system="llama.cpp -ncmoe 14", threads=16, tok_s=100.0, sd=1.0,
                 cpu_expert_bytes_per_token=5.6e8, cpu_roofline_fraction=0.53),
            dict(info, table="llama_sampler", sampler_ms=0.5, sampled_estimate_tok_s=95.24),
            dict(info, table="decode", variant="greedy", decode_tok_s=131.0, decode_sd=1.0,
                 cpu_expert_bytes_per_token=9.2e8, cpu_roofline_fraction=0.61),
            dict(info, table="decode", variant="greedy, one step a launch", decode_tok_s=120.0, decode_sd=1.0),
            dict(info, table="decode", variant="sampled", decode_tok_s=114.0, decode_sd=1.0),
            dict(info, table="decode_ab", variant="greedy", decode_tok_s=131.0, gpu_experts=3000,
                 vs_decode_only=0.98, vs_decode_only_paired=0.975),
            dict(info, table="decode_ab", variant="decode-only greedy", decode_tok_s=133.7, gpu_experts=3300),
            dict(info, table="vram", variant="user", plans=["decode"], predicted_gb=23.9, max_allocated_gb=22.0,
                 err_allocated=-0.04, process_gb=23.0, err_process=-0.038)]
    # llama.cpp as one server configuration (-ncmoe of the longest prompt); a row's noise above the
    # per-test best must not become the targets' denominator
    server = dict(placement="server", system="llama.cpp -ncmoe 23, -ub 4096 (one server configuration)")
    # (the server rows faster than the per-test best, as noise can make them: the targets' ratios
    # must stay against the per-test rows)
    rows += [dict(info, table="llama_prefill", prompt=8192, tok_s=3100.0, sd=1.0, **server),
             dict(info, table="llama_decode", threads=16, tok_s=131.0, sd=1.0, **server),
             dict(info, table="llama_decode", threads=16, tok_s=60.0, sd=1.0, decode_depth=32768, **server),
             dict(info, table="llama_decode", system="llama.cpp -ncmoe 20", threads=16, tok_s=50.0, sd=1.0,
                  decode_depth=32768),
             dict(info, table="decode", variant="greedy", decode_tok_s=90.0, decode_sd=1.0, decode_depth=32768)]
    lines = []
    got = report(rows, out=lines.append)[("qwen3", 24.0)]
    assert got["prefill8192_vs_llama_server"] == pytest.approx(9000 / 3100)
    assert got["greedy_vs_llama_server"] == pytest.approx(1.0) and got["sampled_vs_llama_server"] == pytest.approx(114 / 131)
    assert got["greedy_vs_llama_at_32768"] == pytest.approx(90 / 50)  # the per-test row at that depth
    assert got["greedy_vs_llama_server_at_32768"] == pytest.approx(90 / 60)
    assert got["prefill8192_vs_llama"] == pytest.approx(3.0) and got["prefill8192_vs_free"] == pytest.approx(0.75)
    assert got["greedy_vs_llama"] == pytest.approx(1.31) and got["sampled_vs_llama"] == pytest.approx(1.14)
    assert got["sampled_vs_one_step"] == pytest.approx(0.95)
    assert got["reservation_cost"] == pytest.approx(0.025) and got["vram_worst_error"] == pytest.approx(0.04)
    text = "\n".join(lines)
    assert "3.00x **met**" in text and "1.14x not met" in text and "-ub 4096" in text
    assert "61% of its CPU roofline: 0.92 GB a token on the CPU" in text and "53% of its CPU roofline" in text
    got = report(rows + [dict(info, table="error", phase="user", error="OOM", message="CUDA out of memory")],
                 out=lambda s: None)
    assert got[("qwen3", 24.0)]["oom"] is True
