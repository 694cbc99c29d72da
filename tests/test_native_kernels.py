"""The native kernels against float64 references: every weight format on every kernel path this
CPU has (forced), shapes that are not multiples of the tile sizes, 1 to 600 tokens, the fused
MoE with masked experts, deferral rank ranges, accumulate, and NUMA slices (virtual groups);
fp8 packed from an FP8 checkpoint's own bytes and block scales, and quantized from floats."""

import pytest
import torch

from ktflow.backends.native import binding as native

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

FORMATS = [("bf16", 0), ("int8", 0), ("int8", 64), ("int4", 0), ("int4", 32), ("fp8", 0), ("fp8", 32)]
# relative error of the result against float64 math on the unquantized weights
TOL = {"bf16": 1e-2, "int8": 3e-2, "int4": 0.3, "fp8": 6e-2}  # int4: two quantized products compound


def paths():
    return native.kernel_paths()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("path", ["generic", "avx512", "amx"])
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_matmul_matches_float64(path, fmt, group):
    if path not in paths():
        pytest.skip(f"this CPU has no {path} path")
    g = torch.Generator().manual_seed(hash((path, fmt, group)) % 1000)
    n, k = 100, 200  # neither a multiple of 16 nor of 32 (k is padded to a multiple of 64 for group 64)
    w = torch.randn(n, k, generator=g)
    pw = native.module().PackedWeight(w.data_ptr(), n, k, k, "float32", fmt, group)
    for m in (1, 3, 8, 9, 17, 33, 40):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = torch.empty(m, n)
        pw.matmul(x.data_ptr(), k, m, y.data_ptr(), n, path)
        ref = x.double() @ w.double().T
        assert rel(y, ref) < TOL[fmt], (m, rel(y, ref))


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_paths_agree_on_the_same_packed_weights(fmt, group):
    """Every path computes the same product of the same quantized weights (up to fp32 summation order)."""
    g = torch.Generator().manual_seed(3)
    n, k = 48, 160
    w = torch.randn(n, k, generator=g)
    pw = native.module().PackedWeight(w.data_ptr(), n, k, k, "float32", fmt, group)
    x = torch.randn(37, k, generator=g).bfloat16()
    outs = {}
    for p in paths():
        y = torch.empty(37, n)
        pw.matmul(x.data_ptr(), k, 37, y.data_ptr(), n, p)
        outs[p] = y
    for p, y in outs.items():
        assert rel(y, outs["generic"]) < 2e-3, p  # AMX/bf16 dequantization rounds the weights to bf16


def dequantized(pw, n, k):
    """The packed weights as the generic path sees them (fp32 scale * integer), [n, k]."""
    eye = torch.eye(k).bfloat16()
    y = torch.empty(k, n)
    pw.matmul(eye.data_ptr(), k, k, y.data_ptr(), n, "generic")
    return y.T


def quantize_activations(x, group, kp):
    """int8 per (row, K group): q = round_half_even(x * 127 / amax) in fp32, scale amax / 127."""
    xf = torch.nn.functional.pad(x.float(), (0, kp - x.shape[1]))
    groups = xf.view(x.shape[0], -1, group)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    q = torch.round(groups * inv)
    return (q * (amax / 127)).view(x.shape[0], kp)[:, :x.shape[1]]


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int8", 64), ("int4", 0), ("int4", 32)])
def test_integer_path_is_int8_activations_times_packed_weights(fmt, group):
    """Few rows on AVX-512: exactly the int8-quantized activations (per row and weight group) times
    the packed weights, including K past one 2048-long integer span (per-channel int8)."""
    if "avx512" not in paths():
        pytest.skip("this CPU has no avx512 path")
    g = torch.Generator().manual_seed(11)
    n, k = 40, 2100
    w = torch.randn(n, k, generator=g)
    pw = native.module().PackedWeight(w.data_ptr(), n, k, k, "float32", fmt, group)
    wq = dequantized(pw, n, k).double()
    kp = -(-k // 32) * 32 if group == 0 and fmt == "int8" else -(-k // (group or 128)) * (group or 128)
    qgroup = kp if fmt == "int8" and group == 0 else (group or 128)
    for m in (1, 2, 5, 8):
        x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 3, k)).bfloat16()
        y = torch.empty(m, n)
        pw.matmul(x.data_ptr(), k, m, y.data_ptr(), n, "avx512")
        ref = quantize_activations(x, qgroup, kp).double() @ wq.T
        assert rel(y, ref) < 1e-6, (m, rel(y, ref))
        assert rel(y, x.double() @ w.double().T) < TOL[fmt]


def reference_moe(x, ids, wts, gate, up, down, held, ranks):
    """float64 fused MoE on the bf16-rounded inputs."""
    lo, hi = ranks
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for s in range(lo, hi):
            e = int(ids[t, s])
            if e < 0 or e not in held:
                continue
            h = torch.nn.functional.silu(gate[e].double() @ xd[t]) * (up[e].double() @ xd[t])
            out[t] += float(wts[t, s]) * (down[e].double() @ h)
    return out


def make_experts(E, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H ** 0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    return gate, up, down


def routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).long()
    wts = torch.rand(T, k, generator=g)
    return ids, wts


CASES = [  # (T, k, E, path, format, group)
    (1, 1, 4, "avx512", "bf16", 0), (1, 8, 16, "auto", "bf16", 0), (2, 6, 16, "auto", "int8", 0),
    (7, 2, 8, "generic", "bf16", 0), (16, 8, 16, "avx512", "int4", 32), (33, 6, 12, "avx512", "int8", 64),
    (64, 8, 16, "amx", "bf16", 0), (130, 2, 8, "amx", "int8", 0), (250, 6, 16, "auto", "int4", 0),
    (600, 8, 16, "amx", "bf16", 0), (600, 8, 16, "avx512", "bf16", 0), (600, 1, 4, "auto", "int8", 0),
    (1, 8, 16, "auto", "fp8", 0), (5, 6, 16, "avx512", "fp8", 32), (130, 2, 8, "amx", "fp8", 0),
    (250, 6, 16, "auto", "fp8", 0),
]


@pytest.mark.parametrize("T,k,E,path,fmt,group", CASES)
@pytest.mark.parametrize("groups", [[0], "all"])
def test_fused_moe_matches_float64(T, k, E, path, fmt, group, groups):
    if path not in ("auto", *paths()):
        pytest.skip(f"this CPU has no {path} path")
    H, I = 200, 72  # not multiples of 16/32: padded inside
    gate, up, down = make_experts(E, H, I, seed=T * 31 + k)
    held = set(range(E)) - {1, E - 2}  # two experts live elsewhere (masked)
    pool_groups = None if groups == "all" else groups
    op = native.ExpertOp(E, H, I, held=held, fmt=fmt, group_size=group, groups=pool_groups)
    op.pack(lambda e: (gate[e], up[e], down[e]))
    ids, wts = routing(T, E, k, seed=T + k)
    if T > 1:
        ids[0, 0] = -1  # a padding pick
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).bfloat16()
    ranks = (0, k) if k < 3 else (1, k)  # a deferral-style slice of the picks
    ref = reference_moe(x, ids, wts, gate, up, down, held, ranks)
    out = op.forward(x, ids, wts, ranks=ranks, path=path)
    assert rel(out, ref) < TOL[fmt]
    # accumulate adds into what is there; bf16 output works too
    base = torch.randn(T, H).bfloat16()
    acc = base.clone()
    op.forward(x, ids, wts, out=acc, accumulate=True, ranks=ranks, path=path)
    assert rel(acc.double() - base.double(), ref) < TOL[fmt] + 1e-2


@pytest.mark.parametrize("path", ["auto", "avx512"])
def test_an_expert_most_tokens_pick_is_computed_in_runs_of_rows(path):
    """A skewed router (one expert in every token's first pick: 700 rows, cut into runs of at
    most 256 rows, the last one short) gives the float64 answer."""
    if path not in ("auto", *paths()):
        pytest.skip(f"this CPU has no {path} path")
    T, E, H, I, k = 700, 8, 200, 72, 2
    gate, up, down = make_experts(E, H, I, seed=3)
    op = native.ExpertOp(E, H, I)
    op.pack(lambda e: (gate[e], up[e], down[e]))
    ids, wts = routing(T, E, k, seed=5)
    ids[:, 0] = 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = op.forward(x, ids, wts, path=path)
    assert rel(out, reference_moe(x, ids, wts, gate, up, down, set(range(E)), (0, k))) < TOL["bf16"]


@pytest.mark.parametrize("fmt,group", [("bf16", 0), ("int8", 0), ("int4", 32)])
@pytest.mark.parametrize("T", [1, 3])
def test_single_rows_read_in_place_from_a_strided_input(T, fmt, group):
    """Experts with one row read it from x itself (hidden needs no K padding): right rows, right
    stride, unaffected by what lies between the rows."""
    E, H, I, k = 32, 128, 64, 4
    gate, up, down = make_experts(E, H, I, seed=9)
    op = native.ExpertOp(E, H, I, fmt=fmt, group_size=group)
    op.pack(lambda e: (gate[e], up[e], down[e]))
    ids, wts = routing(T, E, k, seed=4)
    wide = torch.randn(T, H + 48).bfloat16()
    wide[:, H:] = float("nan")  # must never be read
    x = wide[:, :H]
    out = op.forward(x, ids, wts)
    ref = reference_moe(x, ids, wts, gate, up, down, set(range(E)), (0, k))
    assert rel(out, ref) < TOL[fmt]


def test_numa_slices_sum_to_the_whole(monkeypatch):
    """Splitting over two groups (intermediate slices + reduce) gives the unsplit result."""
    pool = native.pool()
    if pool.groups < 2:
        pytest.skip("pool has one group (set KTFLOW_NUMA_GROUPS=2 to exercise the split)")
    E, H, I = 8, 96, 100
    gate, up, down = make_experts(E, H, I, seed=5)
    one = native.ExpertOp(E, H, I, groups=[0])
    two = native.ExpertOp(E, H, I, groups=[0, 1])
    assert len(two.op.slices) == 2 and two.op.slices[0][1] % 32 == 0  # slice boundary on a 32-row block
    for op in (one, two):
        op.pack(lambda e: (gate[e], up[e], down[e]))
    ids, wts = routing(20, E, 3, seed=1)
    x = torch.randn(20, H).bfloat16()
    a, b = one.forward(x, ids, wts), two.forward(x, ids, wts)
    assert rel(b, a) < 1e-5


def test_bad_arguments_name_the_tensor():
    op = native.ExpertOp(4, 64, 32)
    gate, up, down = make_experts(4, 64, 32, seed=0)
    op.pack(lambda e: (gate[e], up[e], down[e]))
    x = torch.randn(3, 64).bfloat16()
    ids, wts = routing(3, 4, 2, seed=0)
    with pytest.raises(Exception, match="x must be torch.bfloat16"):
        op.forward(x.float(), ids, wts)
    with pytest.raises(Exception, match=r"weights must have shape \[3, 2\]"):
        op.forward(x, ids, wts[:, :1].contiguous())
    with pytest.raises(Exception, match="ids must be torch.int64"):
        op.forward(x, ids.int(), wts)
    with pytest.raises(Exception, match="outside"):
        op.forward(x, torch.full((3, 2), 9, dtype=torch.int64), wts)
    with pytest.raises(Exception, match="format"):
        native.ExpertOp(4, 64, 32, fmt="fp4")
    with pytest.raises(Exception, match="multiple of 32"):
        native.ExpertOp(4, 64, 32, fmt="int8", group_size=48).pack(lambda e: (gate[e], up[e], down[e]))


# ------------------------------------------------------------------------------------------ fp8

def pack_fp8(w8, scale, block, group):
    """A PackedWeight from an FP8 checkpoint tensor's bytes and block scales."""
    n, k = w8.shape
    return native.module().PackedWeight(w8.data_ptr(), n, k, k, "float8_e4m3fn", "fp8", group,
                                        (scale.data_ptr(), scale.stride(0), 0, 0), *block)


EXACT_FP8 = {"generic": 1e-5, "avx512": 1e-5}  # the few-rows kernels: e4m3 widened exactly, fp32 sums


@pytest.fixture(params=["byte-tables", "binary16"])
def fp8_widening(request):
    """Each way the AVX-512 fp8 kernel widens e4m3 (byte tables need VBMI)."""
    tables = request.param == "byte-tables"
    if tables and not native.cpu_features().get("avx512_vbmi"):
        pytest.skip("this CPU has no AVX-512 VBMI")
    was = native.module().set_fp8_byte_tables(tables)
    yield request.param
    native.module().set_fp8_byte_tables(was)


@pytest.mark.parametrize("path", ["generic", "avx512", "amx"])
@pytest.mark.parametrize("block", [(128, 128), (16, 32), (32, 64)])
def test_fp8_checkpoint_bytes_are_packed_as_they_are(path, block, fp8_widening):
    """An FP8 source packed as fp8 over its own column blocks keeps its bytes and scales: the packed
    matrix is the checkpoint's dequantized weight exactly, and each path multiplies by it within
    fp32 summation (few rows: widened in registers) or bf16 rounding of the scaled weights (many
    rows: dequantized tiles)."""
    if path not in paths():
        pytest.skip(f"this CPU has no {path} path")
    from ktflow.frontend.quant import dequantize, quantize

    g = torch.Generator().manual_seed(block[0] + block[1])
    n, k = 100, 300  # partial blocks at both edges
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k)  # small values: e4m3 subnormals
    w8, scale = quantize(w, block)
    wd = dequantize(w8, scale, block)
    pw = pack_fp8(w8, scale, block, block[1])
    assert pw.group == block[1]
    assert torch.equal(dequantized(pw, n, k), wd)
    for m in (1, 2, 5, 8, 9, 33):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = torch.empty(m, n)
        pw.matmul(x.data_ptr(), k, m, y.data_ptr(), n, path)
        exact = path == "generic" or (path == "avx512" and m <= 8)
        assert rel(y, x.double() @ wd.double().T) < (1e-5 if exact else 4e-3), (m, rel(y, x.double() @ wd.double().T))


def test_fp8_from_floats_rounds_like_torch():
    """Floats packed as fp8: per row and 128 columns, scale amax / 448 and the nearest e4m3 (ties to
    even, subnormals included), exactly what torch's float8_e4m3fn conversion gives."""
    from ktflow.frontend.quant import dequantize, quantize

    g = torch.Generator().manual_seed(4)
    n, k = 48, 384
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, k)
    pw = native.module().PackedWeight(w.data_ptr(), n, k, k, "float32", "fp8", 0)
    assert torch.equal(dequantized(pw, n, k), dequantize(*quantize(w, (1, 128)), (1, 128)))


def test_fp8_source_requantized_to_other_formats():
    """An FP8 source packed as bf16, int8 or int4 (or as fp8 over other groups) is its dequantized
    weight re-quantized: bf16 within bf16 rounding of the dequantized values."""
    from ktflow.frontend.quant import dequantize, quantize

    g = torch.Generator().manual_seed(5)
    n, k, block = 64, 256, (128, 128)
    w8, scale = quantize(torch.randn(n, k, generator=g), block)
    wd = dequantize(w8, scale, block)
    for fmt, group, tol in (("bf16", 0, 3e-3), ("int8", 0, 2e-2), ("int4", 32, 0.2), ("fp8", 64, 5e-2)):
        pw = native.module().PackedWeight(w8.data_ptr(), n, k, k, "float8_e4m3fn", fmt, group,
                                          (scale.data_ptr(), scale.stride(0), 0, 0), *block)
        got = dequantized(pw, n, k)
        if fmt == "bf16":
            assert torch.equal(got, wd.bfloat16().float())
        assert rel(got, wd) <= tol + 1e-7, fmt


def test_fused_moe_from_fp8_checkpoint_bytes():
    """Experts packed from FP8 sources (row and column slices carry their offsets into the block
    scales; a scale grid with a partial edge block) against float64 on the dequantized weights,
    decode and prefill, split over intermediate slices where the pool has several groups."""
    from ktflow.frontend.quant import Fp8Matrix, dequantize, quantize

    E, H, I, block = 8, 256, 320, (128, 128)
    gate, up, down = make_experts(E, H, I, seed=8)
    q = {}
    for e in range(E):
        q[e] = [Fp8Matrix(*quantize(t[e].float(), block), block) for t in (gate, up, down)]
    deq = [torch.stack([dequantize(q[e][i].data, q[e][i].scale_inv, block) for e in range(E)]) for i in range(3)]
    op = native.ExpertOp(E, H, I, fmt="fp8", group_size=128)
    op.pack(lambda e: tuple(q[e]))
    for T in (1, 4, 40):
        ids, wts = routing(T, E, 4, seed=T)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).bfloat16()
        ref = reference_moe(x, ids, wts, *deq, set(range(E)), (0, 4))
        assert rel(op.forward(x, ids, wts), ref) < 1e-2, T  # the bf16 products of the SwiGLU
    # a shard of the rows (a NUMA slice from the plan): its scales are read from its offset
    lo, hi = 128, 320
    shard = native.ExpertOp(E, H, hi - lo, fmt="fp8", group_size=128)
    shard.pack(lambda e: (native.rows_of(q[e][0], lo, hi), native.rows_of(q[e][1], lo, hi),
                          native.cols_of(q[e][2], lo, hi)))
    ids, wts = routing(3, E, 4, seed=1)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = reference_moe(x, ids, wts, deq[0][:, lo:hi], deq[1][:, lo:hi], deq[2][:, :, lo:hi], set(range(E)), (0, 4))
    assert rel(shard.forward(x, ids, wts), ref) < 1e-2


def test_fp8_nan_and_missing_scales_are_named():
    from ktflow.errors import WeightError
    from ktflow.frontend.quant import Fp8Matrix, quantize

    E, H, I, block = 2, 128, 128, (128, 128)
    gate, up, down = make_experts(E, H, I, seed=2)
    q = {e: [Fp8Matrix(*quantize(t[e].float(), block), block) for t in (gate, up, down)] for e in range(E)}
    q[1][2].data.view(torch.uint8)[5, 7] = 0x7F  # e4m3's NaN
    op = native.ExpertOp(E, H, I, fmt="fp8")
    with pytest.raises(WeightError, match=r"expert 1 down: non-finite value at \[5, 7\]"):
        op.pack(lambda e: tuple(q[e]))
    q[1][2].data.view(torch.uint8)[5, 7] = 0
    q[0][0].scale_inv[0, 0] = float("inf")
    with pytest.raises(WeightError, match=r"expert 0 gate: non-finite value at \[0, 0\]"):
        native.ExpertOp(E, H, I, fmt="int8").pack(lambda e: tuple(q[e]))
    with pytest.raises(Exception, match="block scales"):
        native.ExpertOp(E, H, I, fmt="fp8").pack(lambda e: tuple(m.data for m in q[e]))
    short = {e: [m if i else Fp8Matrix(m.data, m.scale_inv[:, :0], block) for i, m in enumerate(q[e])] for e in q}
    with pytest.raises(Exception, match=r"expert 0 gate: block scales \[1, 0\] do not cover"):
        native.ExpertOp(E, H, I, fmt="fp8").pack(lambda e: tuple(short[e]))
