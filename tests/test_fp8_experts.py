"""Routed experts of an FP8 checkpoint held in FP8 on the GPU (e4m3 bytes and 128 x 128 block
scales, about 1 byte a weight): the placement that takes about twice as many under a binding
VRAM budget, the decode rule and the grouped rule over FP8 stacks against the same rules over
the dequantized stacks, whole plans against fp8_on_gpu='dequantize', and on CUDA the captured
decode and the memory model's prediction."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import ktflow
from ktflow.backends.kernels import moe_gpu
from ktflow.backends.cuda import static_rules
from ktflow.backends.kernels.fp8_gpu import Fp8Weight, dequantize_experts
from ktflow.costmodel.roofline import held_weight_bytes
from ktflow.ir.ops import Op
from ktflow.frontend.quant import config_entry, quantize, scale_key, stored_fp8
from test_place import A100_NO_OVERHEAD

DATA = Path(__file__).parent / "data"

#: a Qwen3-MoE small enough to run on this CPU, large enough that its experts are worth a GPU under
#: A100_NO_OVERHEAD; moe_intermediate_size 192: gate and up end in a partial 128-row block, down
#: in a partial column block (the padded dequantization)
TINY = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "hidden_act": "silu"}


def _held_experts(plan) -> list:
    """The plan's GPU routed-experts nodes holding their experts in FP8."""
    return [n for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS and any(w.held == "fp8" for w in n.weights)]


def _gpu_experts(plan) -> int:
    """Experts resident on the GPU (not those a prefill step streams there: their nodes hold no weights)."""
    return sum(len(n.attrs.ids) for n in plan.ir.nodes
               if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu" and n.weights)


def write_fp8_checkpoint(directory: Path, config: dict, seed: int = 0) -> Path:
    """A random checkpoint of `config` in the published FP8 layout: every tensor an FP8 release
    stores in e4m3 (`quant.stored_fp8`: linear weights, routed experts one per expert) quantized
    in 128 x 128 blocks with its `_scale_inv` beside it, config.json with quantization_config."""
    from safetensors.torch import load_file, save_file

    from ktflow.frontend.checkpoint import write_random_checkpoint
    from ktflow.models import family

    fam = family(config["model_type"])
    cfg = fam.config(config, "test config")
    plain = write_random_checkpoint(directory.with_name(directory.name + "-bf16"), config,
                                    fam.build(cfg, cfg.weight_dtype), seed=seed)
    tensors = {}
    for name, t in load_file(str(plain / "model.safetensors")).items():
        if stored_fp8(name, tuple(t.shape)):
            tensors[name], tensors[scale_key(name)] = quantize(t.float() * 4)  # larger weights: scales not tiny
        else:
            tensors[name] = t
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": config_entry((128, 128))}))
    shutil.rmtree(plain)
    return directory


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    return ktflow.load(write_fp8_checkpoint(tmp_path_factory.mktemp("fp8x") / "ckpt", TINY))


# ------------------------------------------------------------------------------ (a) placement


@pytest.fixture(scope="module")
def qwen3_30b_fp8(tmp_path_factory):
    """The Qwen3-30B-A3B config (48 layers, 128 experts a layer) as an FP8 release declares itself."""
    d = tmp_path_factory.mktemp("qwen3-30b-fp8")
    cfg = json.loads((DATA / "qwen3-30b-a3b-config" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": config_entry((128, 128))}))
    return ktflow.load(d)


def test_a_binding_budget_holds_gpu_experts_in_fp8_and_places_about_twice_as_many(qwen3_30b_fp8):
    """At a 24 GB VRAM limit on an H100 the Qwen3-30B-A3B experts do not all fit: under 'auto'
    the GPU experts are held in FP8 (their causes say so, their CPU parts hold none) and the
    placement takes 1.8-2.1x as many as 'dequantize', each counted at its stored size with its
    scales; 'keep' holds them in FP8 too; the memory model counts the FP8 bytes."""
    opts = dict(hw="h100", vram_gb=24, device="cpu")
    auto, deq, keep = (ktflow.compile(qwen3_30b_fp8, fp8_on_gpu=m, **opts) for m in ("auto", "dequantize", "keep"))
    n_auto, n_deq, n_keep = (_gpu_experts(c.decode) for c in (auto, deq, keep))
    print(f"\n  GPU experts: auto {n_auto}, dequantize {n_deq}, keep {n_keep} ({n_auto / n_deq:.2f}x)")
    assert 0 < n_deq < 48 * 128 and 1.8 <= n_auto / n_deq <= 2.1, (n_auto, n_deq)
    assert 1.8 <= n_keep / n_deq <= 2.1
    assert not _held_experts(deq.decode)
    g = auto.decode.ir
    gpu = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]
    assert gpu and all(w.held == "fp8" for n in gpu for w in n.weights)
    assert all("routed experts held in fp8" in n.place.cause for n in gpu)
    assert "fp8 routed experts dequantized (fp8_on_gpu=dequantize)" in next(
        n for n in deq.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu").place.cause
    cpu = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu"]
    assert cpu and not any(w.held for n in cpu for w in n.weights)
    lent = set(auto.decode.lent_experts)  # whole layers a long prompt's step stages in (time-share)
    for p in auto.prefill:  # the prefill plans place (and hold) as the decode plan, but for the lent layers
        kept = [n for n in gpu if not (p.borrows and n.name in lent)]
        assert _gpu_experts(p) == sum(len(n.attrs.ids) for n in kept)
        assert {n.name for n in _held_experts(p)} == {n.name for n in kept}
    # one expert at its stored size: 3 matrices of 768 x 2048 bytes and a float32 scale per 128 x 128 block
    a = gpu[0].attrs
    per = 3 * (a.inter * a.hidden + 4 * (a.inter // 128) * (a.hidden // 128))
    assert gpu[0].weight_bytes(2) == pytest.approx(len(a.ids) * per)
    mem_gpu = sum(n.weight_bytes(2) for n in g.nodes if n.place.device.value == "gpu")
    mem_cpu = sum(held_weight_bytes(n, n.place.device, 2, "fp8") for n in g.nodes if n.place.device.value == "cpu")
    assert auto.decode.memory.weight_bytes == pytest.approx(mem_gpu + mem_cpu, rel=1e-6)
    bf16 = sum(n.weight_elems() * 2 for n in gpu)
    assert 0.5 < sum(n.weight_bytes(2) for n in gpu) / bf16 < 0.52  # 1 byte a weight and its scales


def test_verifier_p2_refuses_experts_held_in_fp8_where_no_rule_reads_them(qwen3_30b_fp8):
    """P2: FP8-held experts only on GPU nodes holding whole experts, never in an expert cache."""
    from dataclasses import replace

    from ktflow.ir.verify import VerifyError, _p2_fp8_held_on_gpu, verify

    c = ktflow.compile(qwen3_30b_fp8, hw="h100", vram_gb=24, device="cpu")
    g = c.decode.ir
    n = _held_experts(c.decode)[0]
    verify(g, "placed")

    def edit(fn):
        return g.replace_nodes([fn(m) if m.name == n.name else m for m in g.nodes])

    on_cpu = edit(lambda m: replace(m, place=replace(m.place, device=type(m.place.device)("cpu"))))
    cached = edit(lambda m: replace(m, attrs=replace(m.attrs, refill_every=32)))
    sliced = edit(lambda m: replace(m, attrs=replace(m.attrs, inter_slice=(0, 384))))
    for bad in (on_cpu, cached):
        with pytest.raises(VerifyError, match="P2"):
            verify(bad, "placed")
    assert not list(_p2_fp8_held_on_gpu(g))
    assert [name for name, _ in _p2_fp8_held_on_gpu(sliced)] == [n.name] * 3  # (rule V10 fails first in verify)


def test_auto_dequantizes_the_experts_where_every_one_fits(qwen3_30b_fp8):
    """auto with room for every expert in bf16 holds none in FP8 (and says why); expert_cache
    keeps them in bf16 under 'keep' too (the cache refills its rows in the activation dtype)."""
    roomy = ktflow.compile(qwen3_30b_fp8, hw="h100", device="cpu", max_seq_len=4096)  # 80 GB
    gpu = [n for n in roomy.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]
    assert _gpu_experts(roomy.decode) == 48 * 128 and not _held_experts(roomy.decode)
    assert all("fp8 routed experts dequantized: every expert fits the budget" in n.place.cause for n in gpu)
    cached = ktflow.compile(qwen3_30b_fp8, hw="h100", vram_gb=24, device="cpu", fp8_on_gpu="keep",
                            expert_cache=True)
    assert not _held_experts(cached.decode)
    assert any("expert_cache refills the GPU experts in the activation dtype" in n.place.cause
               for n in cached.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu")


def test_gpu_experts_held_in_fp8_are_priced_at_half_the_bytes(qwen3_30b_fp8):
    """The cost model reads a GPU expert held in FP8 at its stored size (about half the bf16
    bytes) and the same expert on the CPU at its packed size whatever it is held as."""
    from dataclasses import replace

    from ktflow.costmodel.roofline import node_cost
    from ktflow.costmodel.hw import PRESETS
    from ktflow.ir.ops import Work

    c = ktflow.compile(qwen3_30b_fp8, hw="h100", vram_gb=24, device="cpu")
    g = c.decode.ir
    n = _held_experts(c.decode)[0]
    plain = replace(n, weights=tuple(replace(w, held="") for w in n.weights))
    hw, w = PRESETS["h100"], Work(tokens=1, context=100, batch=1)
    fp8, bf16 = node_cost(n, g, w, hw, 2, expert_format="fp8"), node_cost(plain, g, w, hw, 2, expert_format="fp8")
    assert 0.49 < fp8.bytes / bf16.bytes < 0.53, (fp8.bytes, bf16.bytes)
    assert fp8.cpu_s == pytest.approx(bf16.cpu_s)


# ------------------------------------------------------------------------------ (b) (c) the rules


def _stacks(e: int, hidden: int, inter: int, seed: int = 0) -> dict:
    """FP8 stacks of `e` random experts: role -> Fp8Weight [e, n, k]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for role, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        pairs = [quantize(torch.randn(n, k, generator=g) * 0.05) for _ in range(e)]
        out[role] = Fp8Weight(torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs]))
    return out


class _Backend:
    """What static_rules.routed_experts reads of a backend: `stacked(node)`."""

    def __init__(self, st):
        self.st = st

    def stacked(self, node):
        return self.st


def _node(ids, experts, hidden, inter, top_k):
    from ktflow.ir.graph import Node
    from ktflow.ir.ops import RoutedExpertsAttrs
    from ktflow.ir.types import DType, TensorType

    attrs = RoutedExpertsAttrs(0, hidden, inter, experts, top_k, subset=tuple(ids))
    return Node("L0.experts", Op.ROUTED_EXPERTS, ("x", "r"), attrs, TensorType(("T", hidden), DType.BF16))


SHAPES = [(256, 384), (256, 192), (200, 72)]  # whole blocks; a partial block of rows; partial both ways


@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_decode_rule_over_fp8_stacks_equals_it_over_the_dequantized_stacks(hidden, inter, dtype):
    """static_rules.routed_experts on FP8 stacks (the picks gathered and dequantized) gives
    exactly what it gives on the same stacks dequantized at load: the dequantization rounds each
    weight once, as loading does; a pick of an expert held elsewhere adds nothing."""
    from ktflow.backends.base import StepContext

    experts, ids = 8, (0, 2, 3, 5, 6, 7)  # experts 1 and 4 held elsewhere
    fp8 = _stacks(len(ids), hidden, inter)
    local = moe_gpu.expert_map(ids, experts, "cpu")
    plain = {r: dequantize_experts(w, dtype) for r, w in fp8.items()}
    node = _node(ids, experts, hidden, inter, 3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    pick = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(5)])
    wts = torch.rand(5, 3, generator=g)
    ctx = StepContext(batch=5, seq=1, position=0, state=None, token_ids=torch.zeros(5, dtype=torch.long))
    got = static_rules.routed_experts(_Backend(dict(local=local, **fp8)), node, {}, [x, (pick, wts)], ctx, "cpu")
    want = static_rules.routed_experts(_Backend(dict(local=local, **plain)), node, {}, [x, (pick, wts)], ctx, "cpu")
    assert got.dtype == dtype and torch.equal(got, want)
    # and the dequantized stacks are the checkpoint's weights (float32 product, one rounding)
    from ktflow.frontend.quant import dequantize

    for r, w in fp8.items():
        for i in range(len(ids)):
            assert torch.equal(plain[r][i], dequantize(w.data[i], w.scale_inv[i], (128, 128)).to(dtype))
    held = pick.apply_(lambda e: e if e in ids else 0)  # every pick held: the output changes
    moved = static_rules.routed_experts(_Backend(dict(local=local, **fp8)), node, {}, [x, (held, wts)], ctx, "cpu")
    assert not torch.equal(moved, got)


@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_the_grouped_rule_over_fp8_stacks_equals_it_over_the_dequantized_stacks(hidden, inter):
    """moe_gpu.grouped_experts (the prefill rule) on FP8 stacks, each projection dequantized in
    turn, against the same rule on the dequantized stacks, in bf16: equal; and against a float64
    reference within bf16 rounding."""
    experts, ids = 8, (1, 2, 3, 4, 6, 7)
    fp8 = _stacks(len(ids), hidden, inter, seed=3)
    local = moe_gpu.expert_map(ids, experts, "cpu")
    plain = {r: dequantize_experts(w, torch.bfloat16) for r, w in fp8.items()}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, hidden, generator=g).to(torch.bfloat16)
    pick = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(40)])
    wts = torch.rand(40, 2, generator=g)
    got = moe_gpu.grouped_experts(x, pick, wts, local, fp8["gate"], fp8["up"], fp8["down"])
    want = moe_gpu.grouped_experts(x, pick, wts, local, plain["gate"], plain["up"], plain["down"])
    assert torch.equal(got, want)
    exact = {r: dequantize_experts(w, torch.float64) for r, w in fp8.items()}
    ref = torch.zeros(40, hidden, dtype=torch.float64)
    for t in range(40):
        for j in range(2):
            row = int(local[pick[t, j]])
            if row < 0:
                continue
            xt = x[t].double()
            h = torch.nn.functional.silu(exact["gate"][row] @ xt) * (exact["up"][row] @ xt)
            ref[t] += wts[t, j].double() * (exact["down"][row] @ h)
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err


# ------------------------------------------------------------------------------ (d) whole plans


def _budget(model, experts: float, dtype_size: int) -> float:
    """A VRAM budget (GB) for the dense units and KV caches and `experts` experts in the activation dtype."""
    probe = ktflow.compile(model, hw=A100_NO_OVERHEAD, vram_budget_gb=1.0, device="cpu", max_seq_len=64,
                           fp8_on_gpu="dequantize", numa_nodes=1)
    dense = sum(n.weight_elems() * dtype_size for n in probe.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    a = next(n for n in probe.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS).attrs
    return (dense + probe.decode.memory.kv_cache_bytes + experts * 3 * a.hidden * a.inter * dtype_size) / 1e9


def _steps(compiled, ids, nxt) -> torch.Tensor:
    """The last position's logits of a prompt step and of a decode step after it, [batch, 2, vocab]."""
    got, state = ktflow.execute(compiled, ids)
    more, _ = ktflow.execute(compiled, nxt, state=state)
    return torch.cat([got[:, -1:], more[:, -1:]], 1)


BACKENDS = ["torch_ref", "native"]


def _backend_here(backend):
    from ktflow.backends.native import binding as native

    if backend == "native" and not native.available():
        pytest.skip("native module not built")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_experts_compute_exactly_what_the_dequantized_ones_do(fp8_tiny, backend):
    """Every expert on the "GPU" (device='cpu': GPU nodes run on this CPU) either way, held in FP8
    ('keep') or dequantized at load: the same logits, bit for bit (the rules dequantize each
    weight with the one rounding loading does; torch_ref: per expert, native: the grouped rule
    over the stacks), in the prompt step and a decode step; the FP8 stacks are held as such."""
    _backend_here(backend)
    opts = dict(hw=A100_NO_OVERHEAD, device="cpu", max_seq_len=64, dtype="bfloat16", backend=backend, numa_nodes=1,
                vram_budget_gb=_budget(fp8_tiny, 3 * 16 + 1, 2))
    keep, deq = (ktflow.compile(fp8_tiny, fp8_on_gpu=m, **opts) for m in ("keep", "dequantize"))
    assert _gpu_experts(keep.decode) == _gpu_experts(deq.decode) == 3 * 16
    held = _held_experts(keep.decode)
    assert len(held) == 3 and not _held_experts(deq.decode)
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(0, TINY["vocab_size"], (2, 1), generator=torch.Generator().manual_seed(5))
    a, b = _steps(keep, ids, nxt), _steps(deq, ids, nxt)
    assert torch.equal(a, b)
    st = keep.executor("decode").backend.stacked(held[0])
    assert isinstance(st["gate"], Fp8Weight) and st["gate"].data.dtype == torch.float8_e4m3fn
    assert st["gate"].data.shape == (16, 192, 256) and st["gate"].scale_inv.shape == (16, 2, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_binding_budget_runs_fp8_experts_on_the_gpu_and_matches_the_dequantized_plan(fp8_tiny, backend):
    """A hybrid plan for device='cpu' whose budget holds 20 of the 48 experts on the "GPU" in bf16:
    under 'auto' they are held in FP8 and about twice as many fit (a layer split between the
    devices among them); its logits (prompt: the grouped rule or torch_ref's per expert; a decode
    step) are the 'dequantize' plan's within the bf16 tolerance (the experts the two plans place
    differently sum in other orders, on the native backend in other kernels)."""
    from compare import assert_close_but_for_flips

    _backend_here(backend)
    opts = dict(hw=A100_NO_OVERHEAD, device="cpu", max_seq_len=64, dtype="bfloat16", backend=backend, numa_nodes=1,
                vram_budget_gb=_budget(fp8_tiny, 20.5, 2))
    auto, deq = (ktflow.compile(fp8_tiny, fp8_on_gpu=m, **opts) for m in ("auto", "dequantize"))
    held = _held_experts(auto.decode)
    assert held and not _held_experts(deq.decode)
    n_auto, n_deq = _gpu_experts(auto.decode), _gpu_experts(deq.decode)
    assert 16 <= n_deq <= 24 and 1.8 * n_deq <= n_auto < 48, (n_auto, n_deq)
    assert any(n.name.endswith(".gpu") for n in held)  # a split layer among them
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(0, TINY["vocab_size"], (2, 1), generator=torch.Generator().manual_seed(5))
    assert_close_but_for_flips(_steps(auto, ids, nxt), _steps(deq, ids, nxt))


# ------------------------------------------------------------------------------ (e) CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_pick_kernel_equals_the_picks_dequantized_then_multiplied(hidden, inter, dtype):
    """fp8_gpu.picked_linear (one kernel: each pick's bytes read, scaled and rounded as loading
    rounds them, multiplied in float32) against the picks dequantized (dequantize_experts) and
    multiplied in float64: within one rounding of the output, for every projection's shape
    (partial blocks too), rows of x shared by a token's picks (xdiv) or one per pick; and
    static_rules.routed_experts, which takes it on CUDA, equals its gather-and-dequantize path."""
    from ktflow.backends.kernels.fp8_gpu import picked_linear, picks_fused

    dev = torch.device("cuda")
    fp8 = {r: Fp8Weight(w.data.to(dev), w.scale_inv.to(dev)) for r, w in _stacks(6, hidden, inter, seed=5).items()}
    g = torch.Generator().manual_seed(6)
    stack_rows = torch.tensor([0, 5, 2, 2, 4, 1, 3, 0, 5], device=dev)  # 3 tokens x 3 picks, repeats
    for role, xdiv in (("gate", 3), ("up", 3), ("down", 1)):
        w = fp8[role]
        k = w.data.shape[2]
        x = torch.randn(len(stack_rows) // xdiv, k, generator=g).to(dev, dtype)
        assert picks_fused(x)
        got = picked_linear(x, w, stack_rows, xdiv)
        mats = dequantize_experts(w, dtype, stack_rows).double()
        want = torch.bmm(mats, x.double().repeat_interleave(xdiv, dim=0)[:, :, None])[:, :, 0]
        assert got.shape == want.shape and got.dtype == dtype
        err = (got.double() - want).abs()
        assert (err <= want.abs() * 2**-7 + 1e-4).all(), f"{role}: max error {err.max().item():.3g}"
    # the decode rule on CUDA (the fused kernel) against the same rule's reference path on the CPU
    from ktflow.backends.base import StepContext

    experts, ids = 8, (0, 2, 3, 5, 6, 7)
    node = _node(ids, experts, hidden, inter, 3)
    local = moe_gpu.expert_map(ids, experts, "cpu")
    x = torch.randn(3, hidden, generator=g).to(dtype)
    pick = torch.stack([torch.randperm(experts, generator=g)[:3] for _ in range(3)])
    wts = torch.rand(3, 3, generator=g)
    ctx = StepContext(batch=3, seq=1, position=0, state=None, token_ids=torch.zeros(3, dtype=torch.long))
    cpu = {r: Fp8Weight(w.data.cpu(), w.scale_inv.cpu()) for r, w in fp8.items()}
    want = static_rules.routed_experts(_Backend(dict(local=local, **cpu)), node, {}, [x, (pick, wts)], ctx, "cpu")
    got = static_rules.routed_experts(_Backend(dict(local=local.to(dev), **fp8)), node, {},
                                      [x.to(dev), (pick.to(dev), wts.to(dev))], ctx, dev)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-3)


@cuda
def test_cuda_graph_with_fp8_experts_matches_the_dequantized_plan(fp8_tiny):
    """On CUDA with the cuda_graph backend: the captured decode over FP8 experts (the picks
    gathered and dequantized inside the graph) and the prompt step (the grouped rule, the stacks
    dequantized by the Triton kernel where it runs) give the logits of the 'dequantize' plan
    within the bf16 tolerance."""
    from compare import assert_close_but_for_flips
    from ktflow.backends.native import binding as native
    from test_cuda_graph import hw_here, run_steps

    if not native.available():
        pytest.skip("native module not built")
    hw = hw_here()
    probe = ktflow.compile(fp8_tiny, hw=hw, vram_budget_gb=1.0, device="cuda", max_seq_len=64,
                           fp8_on_gpu="dequantize")
    dense = sum(n.weight_elems() * 2 for n in probe.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    a = next(n for n in probe.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS).attrs
    budget = (dense + probe.decode.memory.kv_cache_bytes + 20.5 * 3 * a.hidden * a.inter * 2) / 1e9
    opts = dict(hw=hw, device="cuda", max_seq_len=64, max_batch=2, dtype="bfloat16", backend="cuda_graph",
                vram_budget_gb=budget)
    auto, deq = (ktflow.compile(fp8_tiny, fp8_on_gpu=m, **opts) for m in ("auto", "dequantize"))
    assert _held_experts(auto.decode) and not _held_experts(deq.decode)
    ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    got, want = run_steps(auto, ids, 6), run_steps(deq, ids, 6)
    assert auto.executor("decode").runner.bound[2].graph is not None
    assert_close_but_for_flips(torch.cat([x[:, -1:] for x in got], 1), torch.cat([x[:, -1:] for x in want], 1))


@pytest.fixture(scope="module")
def qwen3_small_fp8(tmp_path_factory):
    """test_vram_gpu's Qwen3-30B-A3B layer shape (hidden 2048, 32 experts of 768 rows, top 8, 4
    layers) as an FP8 release: weights, not the allocator's slack, dominate what a run holds."""
    from test_vram_gpu import CONFIG

    return ktflow.load(write_fp8_checkpoint(tmp_path_factory.mktemp("qwen3-small-fp8") / "ckpt", CONFIG))


@cuda
def test_the_memory_model_predicts_a_plan_with_fp8_experts(qwen3_small_fp8):
    """A run at a VRAM limit that holds the dense work and about one layer of experts in bf16
    holds its GPU experts in FP8 (about two layers' worth); its measured peaks (the weights
    loaded, a prompt, decode steps) are within 10% of the plans' predictions."""
    from ktflow.backends.native import binding as native
    from test_vram_gpu import CONFIG, compiled_for, limit_for, run

    if not native.available():
        pytest.skip("native module not built")
    limit = limit_for(qwen3_small_fp8)
    c = compiled_for(qwen3_small_fp8, limit, prefill_reserve="none")
    assert _held_experts(c.decode)
    prompt = 1000
    predicted_prompt = c.prefill_plan(prompt).memory.gpu_bytes
    prompt_peak, decode_peak = run(c, CONFIG["vocab_size"], prompt, 8)
    predicted_decode = c.decode.memory.gpu_bytes
    print(f"\n  {_gpu_experts(c.decode)} GPU experts in fp8; prompt peak {prompt_peak / 1e9:.3f} GB, predicted "
          f"{predicted_prompt / 1e9:.3f}; decode peak {decode_peak / 1e9:.3f} GB, "
          f"predicted {predicted_decode / 1e9:.3f}")
    assert abs(prompt_peak - predicted_prompt) <= 0.1 * prompt_peak
    assert abs(decode_peak - predicted_decode) <= 0.1 * decode_peak
