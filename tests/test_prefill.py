"""Long-prompt prefill: the placement pass (cpu / stream / split per layer), its verifier rules,
buckets and chunking, the memory it plans, and that streamed and split prefill compute what the
all-CPU prefill computes (here on the CPU: GPU placements run on the CPU, the packed experts are
copied from the native arenas and unpacked as on a GPU)."""

from dataclasses import replace

import os

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.ir.types import DTYPE_BY_NAME
from ktflow.errors import ConfigError
from ktflow.costmodel.hw import PRESETS, Overheads
from ktflow.ir import verify
from ktflow.ir.ops import Op
from ktflow.ir.types import Device
from ktflow.ir.verify import VerifyError, violations
from ktflow.plan.artifact import prefill_decisions
from compare import assert_close_but_for_flips, per_token_errors

FAMILIES = ["deepseek_v3", "deepseek_v2_lite", "qwen2_moe", "qwen3_moe", "mixtral_sliding", "glm4_moe"]
needs_native = pytest.mark.skipif(not native.available(), reason="native module not built")


def machine(pcie_gbps: float = 32.0, memory_gb: float = 40.0, gemm_tflops: float | None = None):
    """The paper's A100 machine without fixed overheads (they would decide everything at toy
    sizes), with a chosen PCIe rate, GPU memory and CPU GEMM rate."""
    base = PRESETS["paper-a100"]
    gpu = base.gpus[0].model_copy(update=dict(pcie_h2d_gbps=pcie_gbps, pcie_d2h_gbps=pcie_gbps,
                                              memory_bytes=memory_gb * 2**30))
    cpu = base.cpu if gemm_tflops is None else base.cpu.model_copy(update=dict(gemm_tflops=gemm_tflops))
    return base.model_copy(update=dict(gpus=[gpu], cpu=cpu, overheads=Overheads(gpu_launch_us=0, cpu_submit_us=0, cpu_op_us=0,
                                                                                 cpu_sync_us=0)))


def streamed(plan):
    return [n for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS and len(n.inputs) == 3]


def hybrid(model, budget_experts: float = 0.0, **options):
    """Dense work on the GPU and about `budget_experts` experts per MoE layer resident there."""
    opts = dict(hw=machine(), device="cpu", max_seq_len=64)
    opts.update({k: v for k, v in options.items() if k in ("hw", "device", "max_seq_len", "dtype")})
    probe = ktflow.compile(model, vram_budget_gb=1.0, **dict(opts, hw=machine()))
    nodes = probe.decode.ir.nodes
    # weights are held in the plan's dtype
    size = (DTYPE_BY_NAME[opts["dtype"]] if "dtype" in opts else model.config.weight_dtype).itemsize
    dense = sum(n.weight_elems() * size for n in nodes if n.op != Op.ROUTED_EXPERTS)
    per_expert = max(n.weight_elems() / n.attrs.experts for n in nodes if n.op == Op.ROUTED_EXPERTS) * size
    layers = sum(1 for n in nodes if n.op == Op.ROUTED_EXPERTS)
    budget = dense + probe.decode.memory.kv_cache_bytes + (budget_experts + 0.5) * layers * per_expert
    rest = {k: v for k, v in options.items() if k not in opts}
    return ktflow.compile(model, vram_budget_gb=budget / 1e9, **opts, **rest)


# ------------------------------------------------------------------------------- the pass


def test_short_prompts_stay_on_the_cpu_long_ones_stream(demo_dir):
    """Copying a layer's experts costs the same at any length, computing them on the CPU grows
    with it: with a slow link the compiler keeps short prompts' experts on the CPU, streams long
    ones', and splits in between; every decision names the times it compared."""
    model = ktflow.load(demo_dir)
    c = hybrid(model, hw=machine(pcie_gbps=0.5, gemm_tflops=0.05), max_seq_len=8192, prefill_buckets=[16, 512, 8192])
    modes = [prefill_decisions(p) for p in c.prefill]
    assert modes[0] == "L1-3 cpu" and modes[-1] == "L1-3 stream", modes
    assert "split" in modes[1], modes
    cause = c.prefill[0].ir.by_name("L2.experts").place.cause
    assert "prefill 16 tokens: cpu (fastest; cpu " in cause and "stream " in cause
    long = c.prefill[-1]
    assert all(n.place.device.value == "gpu" and not n.weights for n in streamed(long))
    fetches = [n for n in long.ir.nodes if n.op == Op.FETCH]
    assert [f.attrs.layer for f in fetches] == [1, 2, 3] and all(f.place.stream == "fetch" for f in fetches)
    assert [f.attrs.staging_buffer for f in fetches] == [0, 1, 0] and fetches[2].inputs == ("L1.experts",)
    instrs = {s.node: s for s in long.instructions if s.kind != "record" and s.kind != "wait"}
    assert instrs["L2.experts.fetch"].kind == "fetch" and instrs["L2.experts.fetch"].lane == "fetch"
    # the copy of layer 2's experts runs while layer 1 computes (two slots), layer 3's waits for slot 0
    assert instrs["L2.experts.fetch"].start_us < instrs["L1.experts"].end_us
    assert instrs["L3.experts.fetch"].start_us >= instrs["L1.experts"].end_us
    assert long.memory.staging_bytes > 0 and long.arena_bytes()["staging"] >= 2 * fetches[0].out.numel(0) * 2


def test_auto_buckets_merge_where_decisions_agree(demo_dir):
    model = ktflow.load(demo_dir)
    c = hybrid(model, hw=machine(pcie_gbps=0.5, gemm_tflops=0.05), max_seq_len=8192)
    bounds = [p.step_tokens for p in c.prefill]
    assert bounds == sorted(bounds) and bounds[-1] == 8192 and set(bounds) <= {256, 512, 1024, 2048, 4096, 8192}
    decisions = [prefill_decisions(p) for p in c.prefill]
    assert len(set(decisions)) == len(decisions)  # neighbours with one decision are one bucket
    assert c.prefill_plan(1).step_tokens == bounds[0] and c.prefill_plan(bounds[0] + 1).step_tokens == bounds[1]
    assert c.prefill_plan(10**6) is c.prefill[-1]


def test_forced_modes_and_no_room(demo_dir):
    model = ktflow.load(demo_dir)
    for mode, word in (("cpu", "cpu"), ("stream", "stream"), ("split", "split")):
        c = hybrid(model, prefill_experts=mode, prefill_buckets=[64])
        assert word in prefill_decisions(c.prefill[0]), (mode, prefill_decisions(c.prefill[0]))
    # a GPU with room for the step's weights and activations but not for staging: the layers stay
    # on the CPU and say why, or stream is refused with the sizes
    opts = dict(prefill_buckets=[64], prefill_chunk=64, vram_reserve_gb=0.0)
    cpu = hybrid(model, prefill_experts="cpu", **opts).prefill[0].memory
    tiny_gpu = machine(memory_gb=cpu.gpu_bytes / 2**30)
    c = hybrid(model, hw=tiny_gpu, **opts)
    assert prefill_decisions(c.prefill[0]) == "L1-3 cpu"
    assert "no GPU room for staging" in c.prefill[0].ir.by_name("L1.experts").place.cause
    # stream forced: the VRAM plan reserves staging out of residency; decode first, it is refused
    forced = hybrid(model, hw=tiny_gpu, prefill_experts="stream", **opts)
    assert forced.plans.vram.design == "reserve" and "stream" in prefill_decisions(forced.prefill[0])
    with pytest.raises(ConfigError, match="prefill_experts='stream' at [0-9]+ tokens needs .* of GPU staging"):
        hybrid(model, hw=tiny_gpu, prefill_experts="stream", prefill_reserve="none", **opts)


def test_one_staging_slot_still_streams_without_prefetch(demo_dir):
    c = hybrid(ktflow.load(demo_dir), prefill_experts="stream", staging_buffers=1, prefill_buckets=[64])
    fetches = [n for n in c.prefill[0].ir.nodes if n.op == Op.FETCH]
    assert [f.attrs.staging_buffer for f in fetches] == [0, 0, 0]
    assert fetches[1].inputs == ("L1.experts",) and fetches[2].inputs == ("L2.experts",)


@pytest.mark.parametrize("numa", ["tp", "ep"])
def test_each_fetch_names_the_host_packs_the_decode_plan_computes_on(numa, demo_dir, tmp_path):
    """On two NUMA nodes, the decode plan splits each layer's CPU experts into shards; a streamed
    layer's fetch copies from those packs (tp: one per row slice, tiling the rows; ep: the first
    whole-expert shard), recorded on the fetch and kept through the plan file."""
    from ktflow.plan.artifact import PlanFile

    model = ktflow.load(demo_dir)
    c = hybrid(model, max_seq_len=8192, prefill_buckets=[8192], prefill_experts="stream", numa=numa)
    fetches = [n for n in c.prefill[-1].ir.nodes if n.op == Op.FETCH]
    assert fetches
    for f in fetches:
        parts = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu"
                 and n.attrs.layer == f.attrs.layer]
        shards = sorted((*n.attrs.rows, n.place.numa) for n in parts)
        assert len(shards) == 2
        want = tuple(shards) if numa == "tp" else (shards[0],)
        assert f.attrs.packs == want and f.attrs.packs[0][:2] == (0, shards[0][1])
    path = tmp_path / "plan.json"
    c.plans.save(path)
    again = [n for n in PlanFile.load(path).prefill[-1].ir.nodes if n.op == Op.FETCH]
    assert [f.attrs.packs for f in again] == [f.attrs.packs for f in fetches]


def test_decode_plans_are_unchanged_by_the_prefill_pass(demo_dir):
    model = ktflow.load(demo_dir)
    a = hybrid(model, prefill_experts="cpu")
    b = hybrid(model, prefill_experts="stream")
    assert a.decode.ir == b.decode.ir and a.decode.instructions == b.decode.instructions
    assert not any(n.op == Op.FETCH for n in b.decode.ir.nodes)


def test_chunk_limit_follows_the_gpu_memory(demo_dir):
    """The largest prefill step is the largest bucket whose activations fit next to the weights,
    KV caches and staging; longer prompts run as chunks of it."""
    model = ktflow.load(demo_dir)
    roomy = hybrid(model, max_seq_len=4096)
    small = hybrid(model, max_seq_len=4096, hw=machine(memory_gb=0.1), vram_reserve_gb=0.0)
    assert roomy.chunk_tokens == 4096 and 256 <= small.chunk_tokens < 4096
    assert all(p.memory.gpu_bytes <= 0.1 * 2**30 for p in small.prefill)
    assert hybrid(model, max_seq_len=4096, prefill_chunk=100).chunk_tokens == 100


def test_nothing_fits_a_prefill_step(demo_dir):
    with pytest.raises(ConfigError, match="nothing fits in vram_gb: .* less than the BLAS workspaces"):
        hybrid(ktflow.load(demo_dir), max_seq_len=64, hw=machine(memory_gb=0.06), vram_reserve_gb=0.0)


# ------------------------------------------------------------------------------- verifier


def _stream_graph(demo_dir):
    c = hybrid(ktflow.load(demo_dir), prefill_experts="stream", prefill_buckets=[64])
    return c.prefill[0].ir


def test_s1_fetch_must_feed_its_experts(demo_dir):
    g = _stream_graph(demo_dir)
    fired = lambda graph: {rule for rule, _, _ in violations(graph, "placed")}  # noqa: E731
    assert not fired(g)
    other = g.replace_nodes(replace(n, attrs=replace(n.attrs, layer=2)) if n.name == "L1.experts.fetch" else n
                            for n in g.nodes)
    assert "S1" in fired(other)  # stages another layer's experts
    on_cpu = g.replace_nodes(replace(n, place=replace(n.place, device=Device.CPU)) if n.name == "L1.experts" else n
                             for n in g.nodes)
    assert "S1" in fired(on_cpu)  # streamed experts run on the GPU
    weighty = g.replace_nodes(replace(n, weights=g.by_name("L1.experts.fetch").weights) if n.name == "L1.experts"
                              else n for n in g.nodes)
    assert "S1" in fired(weighty)  # and hold no weights of their own


def test_s2_reused_slot_waits_for_its_reader(demo_dir):
    g = _stream_graph(demo_dir)
    bad = g.replace_nodes(replace(n, inputs=()) if n.name == "L3.experts.fetch" else n for n in g.nodes)
    with pytest.raises(VerifyError, match="S2"):
        verify(bad, "placed")


# ------------------------------------------------------------------------------- running


def _run(compiled, ids, steps=3):
    logits, state = ktflow.execute(compiled, ids)
    out = [logits]
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        nxt = torch.randint(0, compiled.vocab_size, (ids.shape[0], 1), generator=g)
        logits, state = ktflow.execute(compiled, nxt, state)
        out.append(logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("case", FAMILIES)
def test_streamed_and_split_prefill_match_the_cpu_prefill_float32(case, tiny_dirs):
    """torch_ref in float32: the staged weights are the checkpoint's, the chunks continue the
    caches; streamed, split and chunked prefill equal the all-CPU prefill to rounding."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    want = _run(ktflow.compile(model, hw="cpu", dtype="float32", max_seq_len=32), ids)
    for mode in ("stream", "split"):
        c = hybrid(model, budget_experts=1, dtype="float32", max_seq_len=32, prefill_experts=mode, prefill_chunk=5)
        assert streamed(c.prefill[-1]), mode
        got = _run(c, ids)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), mode


@needs_native
@pytest.mark.parametrize("case", FAMILIES)
def test_streamed_and_split_prefill_match_the_cpu_prefill_native(case, tiny_dirs):
    """The native backend in bf16: experts streamed from the packed arenas (copied, unpacked,
    computed as one grouped matmul) and split with the CPU part masked, chunked in pieces of 4
    tokens (positions past 0 go through the masked attention path), against all-CPU prefill."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    ref = hybrid(model, budget_experts=1, dtype="bfloat16", max_seq_len=32, prefill_experts="cpu")
    want = _run(ref, ids)
    for mode in ("stream", "split"):
        c = hybrid(model, budget_experts=1, dtype="bfloat16", max_seq_len=32, prefill_experts=mode, prefill_chunk=4)
        plan = c.prefill[-1]
        assert streamed(plan) and c.chunk_tokens == 4
        if mode == "split":
            assert any(n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu" for n in plan.ir.nodes)
        got = _run(c, ids)
        assert c.executor(plan).backend.name == "native"
        assert_close_but_for_flips(got, want)


def test_last_logits_equal_the_last_row_of_all(demo_dir):
    c = hybrid(ktflow.load(demo_dir), prefill_chunk=3)
    ids = torch.randint(0, 2048, (2, 8), generator=torch.Generator().manual_seed(4))
    every, _ = ktflow.execute(c, ids)
    last, state = ktflow.execute(c, ids, logits="last")
    assert every.shape == (2, 8, 2048) and last.shape == (2, 1, 2048) and state.position == 8
    assert torch.allclose(last, every[:, -1:], atol=1e-2, rtol=1e-2)
    with pytest.raises(ktflow.InputError, match="logits='most'"):
        ktflow.execute(c, ids, logits="most")


# ------------------------------------------------------------------------------- kernels


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8"])
def test_staged_experts_unpack_to_the_weights_the_cpu_computes_with(fmt):
    """Experts packed in the native layouts, copied out of the arenas of two operators that hold
    halves of the rows (NUMA shards), unpacked: the same matrices the CPU kernels multiply by
    (bf16 exactly; int8/int4 as dequantized by the CPU: compared through one expert's output)."""
    from ktflow.backends.native.staging import ExpertStager, pieces_of
    from ktflow.backends.base import staged

    E, H, I = 6, 64, 96
    g = torch.Generator().manual_seed(0)
    w = {e: tuple(torch.randn(*s, generator=g).bfloat16() * 0.1 for s in ((I, H), (I, H), (H, I))) for e in range(E)}
    held = [0, 2, 3, 5]
    halves = []
    for lo, hi in ((0, 32), (32, I)):
        op = native.ExpertOp(E, H, hi - lo, held=held, fmt=fmt)
        op.pack(lambda e, lo=lo, hi=hi: (w[e][0][lo:hi], w[e][1][lo:hi], w[e][2][:, lo:hi].contiguous()))
        halves.append((lo, op))
    stager = ExpertStager(pieces_of([op for _, op in halves], [lo for lo, _ in halves]), fmt, H, I,
                          torch.device("cpu"))
    subset = (2, 3, 5)
    out = stager.stage(subset)
    gate, up, down = staged(out, H, I)
    if fmt == "bf16":
        for i, e in enumerate(subset):
            assert torch.equal(gate[i], w[e][0]) and torch.equal(up[i], w[e][1]) and torch.equal(down[i], w[e][2])
        return
    x = torch.randn(3, H, generator=g).bfloat16()
    for i, e in enumerate(subset):  # the unpacked expert against the CPU operator on the same packed bytes
        ids = torch.full((3, 1), e, dtype=torch.int64)
        ones = torch.ones(3, 1)
        cpu = sum(op.forward(x, ids, ones) for _, op in halves)
        from ktflow.backends.kernels.layers import swiglu

        gpu_side = swiglu(x.float(), gate[i].float(), up[i].float(), down[i].float())
        assert ((gpu_side - cpu).norm() / cpu.norm()) < 3e-2, (fmt, e)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("inter", [96, 1408])  # 1408: the packed K is not a multiple of the kernel's tile
def test_one_pass_dequant_kernel_matches_the_torch_unpack(fmt, inter, monkeypatch):
    """The Triton dequant kernel against the torch unpack on the same packed bytes, exactly
    (both compute q * scale in float32 and round once), into strided targets (the rows of one
    NUMA shard of a staged layer), on the GPU; on a CPU through Triton's interpreter where
    Triton is installed (float32 targets only there: the interpreter truncates to bf16)."""
    pytest.importorskip("triton")
    from ktflow.backends.kernels import dequant_gpu
    from ktflow.backends.kernels.moe_gpu import unpack_matrix

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("no GPU: set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter")
    E, H = 3, 64
    g = torch.Generator().manual_seed(3)
    op = native.ExpertOp(E, H, inter, fmt=fmt)
    w = {e: tuple(torch.randn(*s, generator=g).bfloat16() for s in ((inter, H), (inter, H), (H, inter))) for e in range(E)}
    op.pack(lambda e: w[e])
    stride = op.op.arena(0)[2]
    rows = op.arena(0)[:E * stride].view(E, stride).to(device)
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    for which, dtype in ((which, dtype) for which in range(3) for dtype in dtypes):
        L = op.layout(0, which)
        n, k = L["n"], L["k"]
        data = rows[:, L["data_offset"]:L["data_offset"] + L["data_bytes"]]
        scales = rows[:, L["scales_offset"]:L["scales_offset"] + L["scales_bytes"]]
        # targets inside a wider buffer: the kernel writes through the output's strides, only there
        want_buf = torch.full((E, n + 3, k + 5), 7.0, dtype=dtype, device=device)
        got_buf = want_buf.clone()
        with monkeypatch.context() as m:
            m.setattr(dequant_gpu, "available", lambda dev: False)
            unpack_matrix(fmt, data, scales, L["np"], L["kp"], L["group"], want_buf[:, 1:n + 1, 2:k + 2])
        dequant_gpu.dequantize(fmt, data, scales, L["np"], L["kp"], L["group"], got_buf[:, 1:n + 1, 2:k + 2])
        assert torch.equal(got_buf, want_buf), (fmt, which, dtype)
        assert (want_buf[:, 1:n + 1, 2:k + 2] != 7.0).any()


def test_counts_of_equals_bincount():
    """moe_gpu.counts_of, the device count of each value that reads nothing back (CUDA's bincount
    reads the values' min and max): bincount's answer, also for values that never occur."""
    from ktflow.backends.kernels.moe_gpu import LayerPicks, counts_of

    ids = torch.tensor([[3, 1, 3], [0, 3, 7]])
    assert torch.equal(counts_of(ids, 9), torch.bincount(ids.reshape(-1), minlength=9))
    assert LayerPicks(ids, 8).counts == [1, 1, 0, 3, 0, 0, 0, 1]


def _layer_case(seed: int, E: int, H: int, I: int, T: int, k: int):
    """(generator, gate, up, down, x, ids, wts): a random MoE layer of E experts and T tokens' k picks each."""
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return g, gate, up, down, x, ids, torch.rand(T, k, generator=g)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("block", [16384, 7, 1])
def test_grouped_experts_match_the_reference_loop(block, grouped, monkeypatch):
    """Held picks only, in blocks of GROUPED_ROWS (here also 7 and 1: blocks that cut an
    expert's picks), equal the per-pick loop, through torch's grouped matmul or the loop over
    experts that stands in where it does not run; added to a running sum, returned as its
    float32."""
    from ktflow.backends.kernels import moe_gpu
    from ktflow.backends.kernels.layers import swiglu
    from ktflow.backends.kernels.moe_gpu import expert_map, grouped_experts

    monkeypatch.setattr(moe_gpu, "GROUPED_ROWS", block)
    if not grouped:
        monkeypatch.setitem(moe_gpu._GROUPED_OK, "cpu", False)

    E, H, T, k = 8, 32, 40, 3
    g, gate, up, down, x, ids, wts = _layer_case(2, E, H, 48, T, k)
    held = (1, 2, 5, 6)  # the others are held elsewhere: they add nothing here
    got = grouped_experts(x, ids, wts, expert_map(held, E, "cpu"), gate[list(held)], up[list(held)], down[list(held)])
    want = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            e = int(ids[t, s])
            if e in held:
                want[t] += wts[t, s] * swiglu(x[t:t + 1], gate[e], up[e], down[e])[0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    before = torch.randn(T, H, generator=g)
    running = grouped_experts(x, ids, wts, expert_map(held, E, "cpu"), gate[list(held)], up[list(held)],
                              down[list(held)], addend=before.clone(), running=True)
    assert running.dtype == torch.float32 and torch.allclose(running, before + want, atol=1e-4, rtol=1e-4)
    handed = before.clone()  # the addend is the running sum, added to in place (its one reader is this node)
    assert grouped_experts(x, ids, wts, expert_map(held, E, "cpu"), gate[list(held)], up[list(held)],
                           down[list(held)], addend=handed, running=True) is handed
    none = grouped_experts(x, ids, wts, expert_map((), E, "cpu"), gate[:0], up[:0], down[:0])
    assert torch.equal(none, torch.zeros_like(x))


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("block", [16384, 7])
def test_a_layers_parts_sorted_once_match_the_reference_loop(block, grouped, monkeypatch):
    """A layer's picks sorted and counted once (LayerPicks: one host read), then each part (a
    run of ids, two runs, one expert) summing its own from slices of that order: what
    grouped_experts sums for the part, with no host read of the part's own, also in blocks that
    cut an expert's picks and through the loop that stands in for torch's grouped matmul."""
    from ktflow.backends.kernels import moe_gpu
    from ktflow.backends.kernels.moe_gpu import LayerPicks, expert_map, grouped_experts, grouped_part

    monkeypatch.setattr(moe_gpu, "GROUPED_ROWS", block)
    if not grouped:
        monkeypatch.setitem(moe_gpu._GROUPED_OK, "cpu", False)
    E, H, T, k = 10, 16, 50, 3
    _, gate, up, down, x, ids, wts = _layer_case(3, E, H, 24, T, k)
    layer = LayerPicks(ids, E)
    assert layer.counts == torch.bincount(ids.reshape(-1), minlength=E).tolist()
    total = torch.zeros(T, H)
    for held in ((0, 1, 2), (4, 5, 8, 9), (7,), (3, 6)):
        stack = [list(held)]
        want = grouped_experts(x, ids, wts, expert_map(held, E, "cpu"), gate[stack[0]], up[stack[0]], down[stack[0]])
        picks, offs, counts = layer.part(held, torch.tensor(held))
        with monkeypatch.context() as m, torch.profiler.profile() as prof:
            if not grouped:  # the loop over experts has the counts on the host: no read of the device
                m.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("read counts off the device"))
            got = grouped_part(x, layer.k, wts, picks, offs, counts, gate[stack[0]], up[stack[0]], down[stack[0]])
            total = grouped_part(x, layer.k, wts, picks, offs, counts, gate[stack[0]], up[stack[0]], down[stack[0]],
                                 addend=total, running=True)
        if not grouped:  # no value read back to the host (on a GPU each would be a sync; torch's grouped
            # matmul on the CPU reads its offsets, on a GPU it does not)
            reads = [e.name for e in prof.events() if e.name in ("aten::item", "aten::_local_scalar_dense",
                                                                 "aten::is_nonzero")]
            assert not reads, reads
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), held
    whole = grouped_experts(x, ids, wts, expert_map(tuple(range(E)), E, "cpu"), gate, up, down, running=True)
    assert torch.allclose(total, whole, atol=1e-4, rtol=1e-4)  # the parts add up to the layer


# ------------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and native.available()),
                         reason="needs a CUDA GPU and the native module")


@gpu
def test_torch_grouped_matmul_runs_over_stacked_and_staged_experts():
    """On this GPU the grouped experts go through torch's grouped matmul, not the loop over
    experts that stands in where it refuses (a launch an expert, and a sync without host counts):
    over a resident layer's stacked weights and over a fetch's staged rows (views into one buffer
    an expert), both against the loop; a group whose layer's picks were sorted and counted once
    (`LayerPicks`, `grouped_part`) syncs nowhere (torch's sync debug mode raises on any)."""
    from ktflow.backends.kernels import moe_gpu
    from ktflow.backends.kernels.moe_gpu import LayerPicks, expert_map, grouped_experts, grouped_part
    from ktflow.backends.base import staged

    g = torch.Generator(device="cuda").manual_seed(5)
    E, H, I, T, k, bf = 16, 256, 128, 512, 4, torch.bfloat16
    x = torch.randn(T, H, generator=g, device="cuda").to(bf)
    ids = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :k]
    wts = torch.rand(T, k, generator=g, device="cuda")
    stacked = [(torch.randn(E, *s, generator=g, device="cuda") * 0.05).to(bf) for s in ((I, H), (I, H), (H, I))]
    held = tuple(range(3, 11))  # a fetch of 8 experts, in the layout a stager writes them
    buf = torch.cat([w[list(held)].reshape(len(held), -1) for w in stacked], dim=1).contiguous()
    layer = LayerPicks(ids, E)  # the layer's one read of its counts
    part = layer.part(held, torch.tensor(held, device="cuda"))
    whole = expert_map(tuple(range(E)), E, "cuda")
    cases = [(lambda gate, up, down: grouped_experts(x, ids, wts, whole, gate, up, down), stacked, False),
             (lambda gate, up, down: grouped_part(x, k, wts, *part, gate, up, down), list(staged(buf, H, I)), True)]
    for run, (gate, up, down), quiet in cases:
        moe_gpu._GROUPED_OK.pop("cuda", None)
        moe_gpu.GROUPED_FALLBACK.pop("cuda", None)
        run(gate, up, down)  # first call: may probe the product
        torch.cuda.synchronize()
        if quiet:  # its counts on the host, a group reads nothing back: no sync stops the host
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = run(gate, up, down)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert moe_gpu._GROUPED_OK.get("cuda") is True, moe_gpu.GROUPED_FALLBACK.get("cuda")
        moe_gpu._GROUPED_OK["cuda"] = False  # the loop, for the reference
        want = run(gate, up, down)
        moe_gpu._GROUPED_OK.pop("cuda", None)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _gpu_machine():
    """The paper's machine with this GPU's memory and no fixed overheads."""
    return machine(memory_gb=torch.cuda.get_device_properties(0).total_memory / 2**30)


@gpu
@pytest.mark.parametrize("case", FAMILIES)
def test_prefill_on_the_gpu_lanes_matches_torch_ref(case, tiny_dirs):
    """The cuda_graph backend's prefill runner: streamed experts copied from the pinned arenas on
    the fetch stream and unpacked there, split layers' CPU parts as host-node tasks with done
    flags, chunks of 5 tokens; against torch_ref on the same plans, then decode steps on top."""
    from ktflow.backends.cuda.prefill import PrefillRunner
    from ktflow.backends.native.staging import _PINNED

    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    for mode in ("stream", "split", "cpu"):
        c = hybrid(model, budget_experts=1, hw=_gpu_machine(), device="cuda", dtype="bfloat16", max_seq_len=32,
                   prefill_experts=mode, prefill_chunk=5, backend="cuda_graph")
        ref = ktflow.Compiled(c.plans.model_copy(update={"options": c.plans.options.model_copy(
            update={"backend": "torch_ref"})}), model)
        got, want = _run(c, ids), _run(ref, ids)
        runner = c.executor(c.prefill[-1]).runner
        assert isinstance(runner, PrefillRunner) and runner.bound is not None, mode
        if mode != "cpu":
            assert streamed(c.prefill[-1]) and _PINNED, mode  # the arenas streamed from are page-locked
        assert_close_but_for_flips(got, want)


@gpu
def test_prefill_runner_overlaps_the_next_layers_fetch(tiny_dirs):
    """Traced: layer 2's fetch starts before layer 1's streamed experts end (two staging buffers)."""
    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    c = hybrid(model, hw=_gpu_machine(), device="cuda", dtype="bfloat16", max_seq_len=64, prefill_experts="stream",
               prefill_buckets=[64], backend="cuda_graph")
    plan = c.prefill[0]
    ex = c.executor(plan)
    ex.trace = 1
    ktflow.execute(c, torch.randint(0, model.config.vocab_size, (1, 64)))
    instrs = {s.node: s for s in ex.measured if s.kind not in ("record", "wait")}
    fetches = [n.name for n in plan.ir.nodes if n.op == Op.FETCH]
    experts = [n.name for n in streamed(plan)]
    assert instrs[fetches[1]].start_us < instrs[experts[0]].end_us


# ------------------------------------------------------------------------------- the runner's logic, on the CPU


class _Stream:
    """A stand-in CUDA stream: work runs in host order, so there is nothing to wait for."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Driver:
    """Host functions and flag waits done at once on the host: a submit enqueues the batch, a
    wait waits for every batch submitted."""

    submit_fn, wait_fn = "submit", "wait"

    def __init__(self):
        self.batches = {}

    def device_address(self, t):
        return t.data_ptr()

    def launch_host(self, stream, fn, handle):
        batch = self.batches[handle]
        batch.submit() if fn == "submit" else batch.wait()

    def wait_value(self, stream, address, value):
        for batch in self.batches.values():
            batch.wait()


@needs_native
@pytest.mark.parametrize("mode", ["stream", "split", "cpu"])
def test_prefill_runner_issues_what_the_executor_runs(mode, tiny_dirs, monkeypatch):
    """The prefill runner's issue logic (lanes, pinned slots, native tasks through submit and
    wait, a CPU embedding run on the host, fetches into the staging arena, chunks) with its CUDA
    calls replaced by host-order stand-ins: the same logits as the executor on the same plans."""
    import contextlib

    import ktflow.backends.cuda.prefill as prefill_runner
    from ktflow.backends.native.backend import NativeBackend
    from ktflow.backends.cuda.prefill import PrefillRunner

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _Stream())
    real_zeros, real_batches = torch.zeros, prefill_runner.native_batches
    monkeypatch.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: real_zeros(*a, **k))

    class HostLanes(NativeBackend):
        wait = "flag"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gpu_stream = self.copy_stream = self.fetch_stream = _Stream()
            self.driver = _Driver()

        def staging_buffers(self, staging, landing):
            return torch.empty(max(staging, 1), dtype=torch.uint8), torch.empty(landing, dtype=torch.uint8)

    def batches(be, *args, **kwargs):
        out = real_batches(be, *args, **kwargs)
        be.driver.batches.update({b.handle: b for b in out})
        return out

    monkeypatch.setattr(prefill_runner, "native_batches", batches)
    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    opts = dict(budget_experts=1, dtype="bfloat16", max_seq_len=32, prefill_experts=mode, prefill_chunk=5,
                backend="native")
    c, ref = hybrid(model, **opts), hybrid(model, **opts)
    assert any(n.op == Op.COPY for n in c.prefill[-1].ir.nodes)  # the embedding crosses from the CPU
    c._backend = HostLanes("cpu", torch.bfloat16, options=c.plans.options)
    c.prepare()
    for plan in c.prefill:
        c.executor(plan).runner = PrefillRunner(plan, c._backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    got, _ = ktflow.execute(c, ids)
    want, _ = ktflow.execute(ref, ids)
    assert per_token_errors(got, want).max() <= 1e-2  # the same plan's arithmetic: no token may flip
