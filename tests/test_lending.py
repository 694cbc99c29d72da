"""Resident experts lent to long prompts as staging (backends/lending.py): the lent stacks move into
one region and compute what they did, a borrow overwrites them, and the executor restores them bit
for bit before the next plan that does not borrow. On this CPU (device='cpu': the GPU nodes run
here), both engines, experts held in FP8 and dequantized."""

import pytest
import torch

import ktflow
from ktflow.backends.kernels.fp8_gpu import Fp8Weight
from ktflow.errors import ConfigError
from ktflow.ir.ops import Op
from test_fp8_experts import TINY, write_fp8_checkpoint
from test_place import A100_NO_OVERHEAD

BACKENDS = ["torch_ref", "native"]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    return ktflow.load(write_fp8_checkpoint(tmp_path_factory.mktemp("lend") / "ckpt", TINY))


def _compiled(model, backend, held):
    if backend == "native":
        from ktflow.backends.native import binding as native

        if not native.available():
            pytest.skip("native module not built")
    return ktflow.compile(model, hw=A100_NO_OVERHEAD, device="cpu", max_seq_len=64, dtype="bfloat16", backend=backend,
                          numa_nodes=1, vram_budget_gb=1.0, fp8_on_gpu=held)


def _gpu_experts(plan):
    return [n for n in plan.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value == "gpu" and n.weights]


def _bytes(stack) -> torch.Tensor:
    parts = (stack.data, stack.scale_inv) if isinstance(stack, Fp8Weight) else (stack,)
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def _steps(compiled, ids, nxt):
    logits, state = ktflow.execute(compiled, ids)
    more, state = ktflow.execute(compiled, nxt, state=state)
    return torch.cat([logits[:, -1:], more], 1), state


@pytest.mark.parametrize("held", ["keep", "dequantize"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lent_experts_compute_what_they_did_and_come_back_bit_for_bit(fp8_model, backend, held):
    ref, lent = _compiled(fp8_model, backend, held), _compiled(fp8_model, backend, held)
    nodes = _gpu_experts(lent.decode)
    assert len(nodes) == 3  # every layer's experts on the "GPU"
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(0, TINY["vocab_size"], (2, 1), generator=torch.Generator().manual_seed(5))
    want, _ = _steps(ref, ids, nxt)

    be = lent.executor("decode").backend
    before = {n.name: {r: _bytes(be.stacked(n)[r]).clone() for r in ("gate", "up", "down")} for n in nodes}
    be.lend(nodes)
    region = be.lent.region
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    for n in nodes:
        st = be.stacked(n)
        assert isinstance(st["gate"], Fp8Weight) == (held == "keep")
        for r in ("gate", "up", "down"):
            t = st[r].data if isinstance(st[r], Fp8Weight) else st[r]
            assert lo <= t.data_ptr() < hi  # the stack is a view of the region
            assert torch.equal(_bytes(st[r]), before[n.name][r])
            one = be.weights[be_key(n)][r][n.attrs.ids[1]]  # an expert's own weights: a row of the stack
            assert (one.data if isinstance(one, Fp8Weight) else one).data_ptr() >= lo
    got, state = _steps(lent, ids, nxt)
    assert torch.equal(got, want)

    be.lent.borrow(be.lent.nbytes).fill_(0xFF)  # a long prompt's staging overwrites every lent byte
    assert be.lent.dirty
    assert not torch.equal(_bytes(be.stacked(nodes[0])["gate"]), before[nodes[0].name]["gate"])
    again, _ = ktflow.execute(lent, nxt, state=state)  # decode: restored first
    ref_state = _steps(ref, ids, nxt)[1]
    want_again, _ = ktflow.execute(ref, nxt, state=ref_state)
    assert not be.lent.dirty
    assert torch.equal(again, want_again)
    for n in nodes:
        for r in ("gate", "up", "down"):
            assert torch.equal(_bytes(be.stacked(n)[r]), before[n.name][r])


def be_key(n):
    from ktflow.backends.base import node_key

    return node_key(n)


def test_a_borrowing_plan_leaves_the_region_borrowed_and_too_much_is_refused(fp8_model):
    from ktflow.runtime.executor import Executor

    c = _compiled(fp8_model, "torch_ref", "keep")
    be = c.executor("decode").backend
    be.lend(_gpu_experts(c.decode))
    be.lent.borrow(64).fill_(0)
    borrower = Executor(c.prefill[0].model_copy(update=dict(borrows=True)), be)
    assert borrower.plan.borrows and be.lent.dirty
    borrower._reclaim_lent()
    assert be.lent.dirty  # a borrower does not restore: its staging is the region
    c.executor(c.prefill[0])._reclaim_lent()
    assert not be.lent.dirty
    with pytest.raises(ConfigError, match="lends"):
        be.lent.borrow(be.lent.nbytes + 1)


def test_the_plan_file_keeps_what_is_lent_and_who_borrows(fp8_model, tmp_path):
    c = _compiled(fp8_model, "torch_ref", "keep")
    names = tuple(n.name for n in _gpu_experts(c.decode))
    pf = c.plans.model_copy(update=dict(decode=c.decode.model_copy(update=dict(lent_experts=names)),
                                        prefill=[p.model_copy(update=dict(borrows=True)) for p in c.prefill]))
    path = tmp_path / "plan.json"
    pf.save(path)
    back = type(pf).load(path)
    assert back.decode.lent_experts == names and all(p.borrows for p in back.prefill)


def test_a_region_that_cannot_be_had_puts_the_stacks_back_and_says_so(fp8_model, monkeypatch):
    from ktflow.errors import ResourceError

    c = _compiled(fp8_model, "native", "keep")
    be = c.executor("decode").backend
    nodes = _gpu_experts(c.decode)
    before = {n.name: _bytes(be.stacked(n)["down"]).clone() for n in nodes}
    real = torch.empty

    def refuse(*a, **kw):  # the region is the one allocation made on a device
        if "device" in kw:
            raise torch.OutOfMemoryError("no block that large")
        return real(*a, **kw)

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ResourceError, match="prefill_reserve='reserve'"):
        be.lend(nodes)
    monkeypatch.undo()
    assert be.lent is None
    for n in nodes:
        assert torch.equal(_bytes(be.stacked(n)["down"]), before[n.name])
        assert isinstance(be.weights[be_key(n)]["down"][n.attrs.ids[0]], Fp8Weight)
    ids = torch.randint(0, TINY["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(4))
    ktflow.execute(c, ids)
