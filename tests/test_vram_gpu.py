"""The VRAM plan on a CUDA GPU (skipped without one and the native module): a run compiled for a
small limit allocates what its plans predict (within 10% above, at least half) through a long
prompt and its decode, and does not run out of memory when the process may allocate no more than
the limit; the runtime's staging buffers are the plans'; a time-shared prompt stages in lent
experts and leaves them as they were, bit for bit.

A random checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048, experts of 768 rows, 32 of them,
top 8, 4 layers, about 1.3 GB) is written once per session: big enough that weights, staging and
activations dominate what the CUDA allocator holds."""

import gc

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.ir.ops import Op

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and native.available()),
                                reason="needs a CUDA GPU and the native module")

CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=16384, hidden_size=2048,
              intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
              num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=8, norm_topk_prob=True,
              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, torch_dtype="bfloat16",
              tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
PROMPT = 6000  # > the chunk: a chunked prompt, its later chunks attending the earlier ones


@pytest.fixture(scope="module")
def qwen3_small(tmp_path_factory):
    from ktflow.frontend.checkpoint import write_random_checkpoint
    from ktflow.models import family

    fam = family("qwen3_moe")
    cfg = fam.config(CONFIG, "vram-gpu")
    d = tmp_path_factory.mktemp("qwen3-small") / "ckpt"
    write_random_checkpoint(d, CONFIG, fam.build(cfg, cfg.weight_dtype))
    return ktflow.load(d)


def compiled_for(model, vram_gb: float, **options):
    """Compiled for the h100 preset (the GPU machine's CPU and PCIe, where streaming a long
    prompt's experts pays) with this GPU's memory."""
    from ktflow.costmodel.hw import PRESETS, with_this_gpus_memory

    return ktflow.compile(model, hw=with_this_gpus_memory(PRESETS["h100"]), device="cuda", max_seq_len=8192,
                          vram_gb=vram_gb, vram_reserve_gb=0,  # the plans' own bytes: what torch allocates
                          workload_prompt_tokens=PROMPT, workload_output_tokens=64, **options)


def limit_for(model) -> float:
    """A limit (GB) holding the dense work, the KV cache and about one layer of experts decode first."""
    probe = compiled_for(model, 20.0, prefill_reserve="none")
    nodes = probe.decode.ir.nodes
    dense = sum(n.weight_bytes(2) for n in nodes if n.op != Op.ROUTED_EXPERTS and n.place.device.value == "gpu")
    layer = max(n.weight_elems() * 2 for n in nodes if n.op == Op.ROUTED_EXPERTS)
    act = max(p.memory.activation_bytes for p in probe.prefill)
    return (dense + probe.decode.memory.kv_cache_bytes + probe.decode.memory.workspace_bytes + act + 1.3 * layer) / 1e9


def run(c, vocab: int, prompt: int, new: int) -> tuple[int, int]:
    """(peak bytes allocated during the prompt, during the decode steps after it), above what the
    process held before (what earlier tests left alive is not this run's)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    c.prepare()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    logits, state = ktflow.execute(c, ids, logits="last")
    torch.cuda.synchronize()
    prompt_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tok = logits[:, -1].argmax(-1, keepdim=True).cpu()
    for _ in range(new):
        logits, state = ktflow.execute(c, tok, state)
        tok = logits[:, -1].argmax(-1, keepdim=True).cpu()
    torch.cuda.synchronize()
    return prompt_peak - base, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("reserve", ["reserve", "time-share", "none"])
def test_peak_vram_is_the_planned_peak(qwen3_small, reserve):
    """Measured peaks within [0.5, 1.10] x the plans' predicted peaks, and under the limit, in
    each design (time-share: the long prompt's staging inside the lent experts' memory)."""
    limit = limit_for(qwen3_small)
    c = compiled_for(qwen3_small, limit, prefill_reserve=reserve)
    if reserve != "none":
        assert c.plans.vram.design == reserve and any(n.op == Op.FETCH for n in c.prefill_plan(PROMPT).ir.nodes)
    ran = {c.prefill_plan(min(PROMPT - i, c.chunk_tokens)).step_tokens for i in range(0, PROMPT, c.chunk_tokens)}
    predicted_prompt = max(p.memory.gpu_bytes for p in c.prefill if p.step_tokens in ran)
    prompt_peak, decode_peak = run(c, CONFIG["vocab_size"], PROMPT, 8)
    print(f"limit {limit:.2f} GB; prompt peak {prompt_peak / 1e9:.3f} GB, predicted {predicted_prompt / 1e9:.3f}; "
          f"decode peak {decode_peak / 1e9:.3f} GB, predicted {c.decode.memory.gpu_bytes / 1e9:.3f}")
    assert 0.5 * predicted_prompt <= prompt_peak <= 1.10 * predicted_prompt
    assert 0.5 * c.decode.memory.gpu_bytes <= decode_peak <= 1.10 * c.decode.memory.gpu_bytes
    assert max(p.memory.gpu_bytes for p in c.plans.plans) <= limit * 1e9


def test_no_out_of_memory_at_the_limit(qwen3_small):
    """The process may allocate the limit (and 5% slack for the allocator's rounding) and no
    more: a chunked long prompt and its decode run."""
    limit = limit_for(qwen3_small)
    c = compiled_for(qwen3_small, limit)
    total = torch.cuda.get_device_properties(0).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()  # what earlier tests left alive in this process
    torch.cuda.set_per_process_memory_fraction(min(1.0, (held + limit * 1e9 * 1.05) / total))
    try:
        run(c, CONFIG["vocab_size"], PROMPT, 8)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_the_runtime_stages_into_the_plans_buffers(qwen3_small):
    """The backend's staging and landing buffers are the size the plans count (the largest
    bucket's staging arena, one landing buffer for the largest fetch)."""
    c = compiled_for(qwen3_small, limit_for(qwen3_small), prefill_reserve="reserve")
    run(c, CONFIG["vocab_size"], PROMPT, 1)
    be = c.executor(c.prefill[-1]).backend
    fetches = [n for p in c.prefill for n in p.ir.nodes if n.op == Op.FETCH]
    assert fetches and be._staging is not None
    staging = max(p.arena_bytes().get("staging", 0) for p in c.prefill)
    landing = max(f.attrs.link_bytes for f in fetches)
    assert be._staging.numel() <= staging and be._landing.numel() <= landing * 1.01
    held = max(p.memory.staging_bytes for p in c.prefill)
    assert be._staging.numel() + be._landing.numel() <= held * 1.01


def test_gpu_experts_are_held_once(qwen3_small):
    """A GPU routed-experts node's per-expert weights are views of the stacked copy the batched
    rules read (one copy in VRAM, not two)."""
    from ktflow.backends.base import node_key

    c = compiled_for(qwen3_small, 20.0, prefill_reserve="none")
    c.prepare()
    be = c.executor(c.decode).backend
    gpu = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu"]
    assert gpu
    for n in gpu:
        st, w = be.stacked(n), be.weights[node_key(n)]
        for role in ("gate", "up", "down"):
            base = st[role].untyped_storage().data_ptr()
            assert all(w[role][e].untyped_storage().data_ptr() == base for e in n.attrs.ids), (n.name, role)


def test_a_time_shared_prompt_leaves_the_lent_experts_as_they_were(qwen3_small):
    """The time-share design on the GPU lanes: the chunked prompt's steps stage in the lent
    experts' region (overwritten after the prompt), the first decode step restores it bit for bit
    (its captured graph reads the lent stacks), and the logits are the reserve design's within
    bf16 tolerance (other experts streamed, other grouping)."""
    limit = limit_for(qwen3_small)
    c = compiled_for(qwen3_small, limit, prefill_reserve="time-share")
    assert c.decode.lent_experts and c.prefill_plan(c.chunk_tokens).borrows
    c.prepare()
    lent = c.executor(c.decode).backend.lent
    ids = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    got, state = ktflow.execute(c, ids, logits="last")
    torch.cuda.synchronize()
    assert lent.dirty and not torch.equal(lent.region[:lent.used].cpu(), lent.host[:lent.used])
    tok = got[:, -1].argmax(-1, keepdim=True).cpu()
    more, _ = ktflow.execute(c, tok, state)
    assert not lent.dirty and torch.equal(lent.region.cpu(), lent.host)
    r = compiled_for(qwen3_small, limit, prefill_reserve="reserve")
    want, rstate = ktflow.execute(r, ids, logits="last")
    wmore, _ = ktflow.execute(r, tok, rstate)
    for a, b in ((got[:, -1], want[:, -1]), (more[:, -1], wmore[:, -1])):
        a, b = a.float().cpu(), b.float().cpu()
        assert (a - b).norm() <= 5e-2 * b.norm()
