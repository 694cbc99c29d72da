"""torch_ref on a CUDA GPU (skipped where torch sees no GPU): the same plans run on the device
and match HF transformers (run on the CPU) within the parity tolerance."""

import pytest
import torch

import ktflow
from ktflow.ir.types import Device
from test_hf_parity import assert_close, hf_and_ktflow_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2_grouped_yarn", "qwen2_moe", "qwen3_moe", "mixtral_sliding"])
def test_torch_ref_on_gpu_matches_hf(case, tiny_dirs):
    d, hf = tiny_dirs(case)
    model = ktflow.load(d)
    compiled = ktflow.compile(model, hw=None, device="cuda", placement="gpu", max_seq_len=64)
    assert compiled.decode.device == "cuda"
    assert all(n.place.device.value == "gpu" for n in compiled.decode.ir.nodes)
    assert compiled.executor("prefill").backend.devices[Device.GPU].type == "cuda"
    ref, got = hf_and_ktflow_logits(hf, compiled, model.config.vocab_size)
    assert_close(ref, got)


def test_bf16_demo_on_gpu_close_to_cpu(demo_dir):
    model = ktflow.load(demo_dir)
    gpu = ktflow.compile(model, hw=None, device="cuda", placement="gpu", max_seq_len=64)
    cpu = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32")
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    a, _ = ktflow.execute(gpu, ids)
    b, _ = ktflow.execute(cpu, ids)
    assert ((a - b).norm() / b.norm()) < 5e-2
    on_gpu, _ = ktflow.execute(gpu, ids.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), a)  # logits come back where input_ids live
    out = ktflow.generate(gpu, ids, 8, eos_token_id=None)  # all eight steps
    assert out.shape == (2, 24)


def test_hybrid_plan_on_gpu_and_cpu_matches_hf(tiny_dirs):
    """Attention and dense work on the GPU, experts split between the GPU and the CPU."""
    from ktflow.ir.ops import Op
    from test_cuda_graph import hw_here

    hw = hw_here()
    d, hf = tiny_dirs("deepseek_v3")
    model = ktflow.load(d)
    opts = dict(hw=hw, device="cuda", max_seq_len=64)
    probe = ktflow.compile(model, vram_budget_gb=1.0, **opts)
    dense = sum(n.weight_elems() * 4 for n in probe.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    expert = 3 * 64 * 32 * 4
    compiled = ktflow.compile(model, vram_budget_gb=(dense + probe.decode.memory.kv_cache_bytes + 8.5 * expert) / 1e9,
                              **opts)
    g = compiled.decode.ir
    split = [n for n in g.nodes if n.name.endswith(".experts.gpu")]
    assert split and any(n.op == Op.ROUTED_EXPERTS and n.place.device.value == "cpu" for n in g.nodes)
    assert g.by_name("L1.attn").place.device.value == "gpu"
    assert_close(*hf_and_ktflow_logits(hf, compiled, model.config.vocab_size))


def test_deferral_on_a_hybrid_gpu_plan_matches_the_papers_formula(tiny_dirs):
    from ktflow.ir.ops import Op
    from test_cuda_graph import hw_here
    from test_defer import assert_deferred_decode_matches

    hw = hw_here()
    d, hf = tiny_dirs("deepseek_v3")
    model = ktflow.load(d)
    probe = ktflow.compile(model, hw=hw, vram_budget_gb=1.0, max_seq_len=64)
    dense = sum(n.weight_elems() * 4 for n in probe.decode.ir.nodes if n.op != Op.ROUTED_EXPERTS)
    budget = (dense + probe.decode.memory.kv_cache_bytes + 8.5 * 3 * 64 * 32 * 4) / 1e9
    c = ktflow.compile(model, hw=hw, device="cuda", vram_budget_gb=budget, defer=2, max_seq_len=64)
    g = c.decode.ir
    assert "L1.deferred" in g and any(n.op == Op.SYNC for n in g.nodes) and "L1.experts.gpu" in g
    assert_deferred_decode_matches(hf, c, 2, seed=9, steps=4)
