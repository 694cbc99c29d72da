"""The static-shape rules (position as a tensor: what a CUDA graph captures) against torch_ref,
on the CPU: GQA over a masked static cache with sdpa, MLA in the absorbed form, GPU-resident
routed experts by gathering, for each family's tiny model, over several decode steps."""

import copy

import pytest
import torch

import ktflow
from ktflow.backends.cuda.static_rules import static_rules
from ktflow.backends.torch_ref import TorchRefBackend
from ktflow.runtime.executor import Executor


def static_engine(gpu_device: str, dtype: torch.dtype) -> TorchRefBackend:
    """The reference engine with the static-shape rules composed in, as the CUDA backend does."""
    be = TorchRefBackend(gpu_device, dtype)
    be.rules.update(static_rules(be.rules))
    return be


@pytest.mark.parametrize("case", ["deepseek_v3", "deepseek_v2_grouped_yarn", "qwen2_moe", "qwen3_moe",
                                  "mixtral_sliding"])
@torch.inference_mode()
def test_static_decode_rules_match_torch_ref(case, tiny_dirs):
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = ktflow.compile(model, hw="paper-a100", device="cpu", placement="gpu", dtype="float32", max_seq_len=40,
                       backend="torch_ref")
    ops = {n.op.value for n in c.decode.ir.nodes if n.place.device.value == "gpu"}
    assert {"attention", "routed_experts"} <= ops  # both static rules are exercised
    be = static_engine("cpu", torch.float32)
    be.prepare(c.decode.ir, model.weights)
    for p in c.prefill:
        be.prepare(p.ir, model.weights)
    ref = Executor(c.decode, be)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    _, state = ktflow.execute(c, ids)  # prefill with torch_ref: the caches both paths continue
    static_state = copy.deepcopy(state)
    for step in range(4):
        nxt = torch.randint(0, model.config.vocab_size, (2, 1), generator=g)
        want = ref.run(nxt, state)
        pos = torch.tensor([static_state.position])
        got = ref.run(nxt, static_state, position_t=pos)
        err = (got - want).norm() / want.norm()
        assert err < 1e-5, (case, step, float(err))
    for layer, caches in state.kv.items():
        for a, b in zip(caches, static_state.kv[layer], strict=True):
            assert torch.allclose(a, b, atol=1e-5), layer  # the cache rows written at the position
