"""torch_ref on a CUDA GPU (skipped where torch sees no GPU): the same plans run on the device
and match HF transformers (run on the CPU) within the parity tolerance."""

import pytest
import torch

import ktflow
from test_hf_parity import assert_close, hf_and_ktflow_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2_grouped_yarn", "qwen2_moe", "qwen3_moe", "mixtral_sliding"])
def test_torch_ref_on_gpu_matches_hf(case, tiny_dirs):
    d, hf = tiny_dirs(case)
    model = ktflow.load(d)
    compiled = ktflow.compile(model, hw=None, device="cuda", max_seq_len=64)
    assert compiled.decode.device == "cuda"
    assert all(n.place.device.value == "gpu" for n in compiled.decode.ir.nodes)
    assert compiled.executor("prefill").backend.device.type == "cuda"
    ref, got = hf_and_ktflow_logits(hf, compiled, model.config.vocab_size)
    assert_close(ref, got)


def test_bf16_demo_on_gpu_close_to_cpu(demo_dir):
    model = ktflow.load(demo_dir)
    gpu = ktflow.compile(model, hw=None, device="cuda", max_seq_len=64)
    cpu = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32")
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    a, _ = ktflow.execute(gpu, ids)
    b, _ = ktflow.execute(cpu, ids)
    assert ((a - b).norm() / b.norm()) < 5e-2
    on_gpu, _ = ktflow.execute(gpu, ids.cuda())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), a)  # logits come back where input_ids live
    out = ktflow.generate(gpu, ids, 8)
    assert out.shape == (2, 24)
