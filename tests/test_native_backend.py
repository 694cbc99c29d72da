"""The native backend runs whole models: CPU routed experts on the C++ operator, everything else
on torch. Its logits match torch_ref on the same plan (bf16) for the six families, with NUMA
shards and Expert Deferral in the plan; packed weights come back from the disk cache."""

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.backends.base import node_key
from ktflow.ir.ops import Op
from compare import assert_close_but_for_flips, closer_reference, per_token_errors

pytestmark = pytest.mark.skipif(not native.available(), reason="native module not built")

FAMILIES = ["deepseek_v3", "deepseek_v2_lite", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe"]
TOL = {"bf16": 2e-2, "int8": 5e-2}  # of a token's logits norm (tokens a routing near-tie flips aside)


def logits(compiled, ids, decode_tokens=None, steps=3):
    """Prefill then `steps` decode steps (greedy, or the given tokens); logits concatenated, and
    the decode tokens used."""
    out, state = ktflow.execute(compiled, ids)
    got, fed = [out], []
    for i in range(steps):
        nxt = out[:, -1:].argmax(-1) if decode_tokens is None else decode_tokens[i]
        fed.append(nxt)
        out, state = ktflow.execute(compiled, nxt, state)
        got.append(out)
    return torch.cat(got, dim=1), fed


def compare(d, fmt="bf16", **options):
    """(native logits, reference logits): the reference per token is torch_ref on the same plan in
    bf16 or in float32, whichever is closer (compare.closer_reference: a routing near-tie may flip
    in either rounding of the reference itself)."""
    model = ktflow.load(d)
    ref, ref32 = (ktflow.compile(model, hw="cpu", dtype=dt, max_seq_len=32, backend="torch_ref", **options)
                  for dt in ("bfloat16", "float32"))
    nat = ktflow.compile(model, hw="cpu", dtype="bfloat16", max_seq_len=32, backend="native", expert_format=fmt,
                         **options)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    a, fed = logits(ref, ids)
    a32, _ = logits(ref32, ids, fed)
    b, _ = logits(nat, ids, fed)  # the same decode tokens on all
    assert nat.executor("decode").backend.name == "native"
    assert nat.executor("decode").backend.experts.ops, "no node ran natively"
    return b, closer_reference(b, [a, a32])


@pytest.mark.parametrize("case", FAMILIES)
def test_native_matches_torch_ref_bf16(case, tiny_dirs):
    d, _ = tiny_dirs(case)
    assert_close_but_for_flips(*compare(d), TOL["bf16"])


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen3_moe"])
def test_native_int8_and_int4(case, tiny_dirs, capsys):
    d, _ = tiny_dirs(case)
    assert_close_but_for_flips(*compare(d, "int8"), TOL["int8"])
    err = per_token_errors(*compare(d, "int4")).median().item()
    with capsys.disabled():
        print(f"\n  {case}: int4 experts, median relative logits error per token {err:.3f} (reported, no bound)")


def test_native_with_numa_shards_and_deferral(tiny_dirs):
    d, _ = tiny_dirs("deepseek_v3")
    assert_close_but_for_flips(*compare(d, numa_nodes=2, defer=1), TOL["bf16"])
    nat = ktflow.compile(ktflow.load(d), hw="cpu", dtype="bfloat16", max_seq_len=32, backend="native",
                         numa_nodes=2, defer=1)
    g = nat.decode.ir
    assert any(n.op == Op.ROUTED_EXPERTS and n.place.numa == 1 for n in g.nodes)
    assert any(n.op == Op.ROUTED_EXPERTS and n.attrs.rank_range[0] > 0 for n in g.nodes)
    be = nat.executor("decode").backend
    deferred = [n for n in g.nodes if n.op == Op.ROUTED_EXPERTS and n.attrs.rank_range[0] > 0]
    immediate = {(n.attrs.layer, n.place.numa): n for n in g.nodes if n.op == Op.ROUTED_EXPERTS
                 and n.attrs.rank_range[0] == 0}
    assert deferred and all(be.experts.ops[node_key(n)] is be.experts.ops[node_key(immediate[n.attrs.layer, n.place.numa])]
                            for n in deferred)  # packed once
    assert {be.loaded[n.name] for n in deferred} == {"shared"}


def test_packed_weights_come_back_from_the_cache(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("KTFLOW_CACHE_DIR", str(tmp_path))
    d, _ = tiny_dirs("qwen3_moe")
    model = ktflow.load(d)
    first = ktflow.compile(model, hw="cpu", dtype="bfloat16", max_seq_len=32, backend="native")
    first.prepare()
    assert set(first.executor("decode").backend.loaded.values()) == {"packed"}
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files and not list(tmp_path.glob("*.tmp*"))
    second = ktflow.compile(model, hw="cpu", dtype="bfloat16", max_seq_len=32, backend="native")
    second.prepare()
    assert set(second.executor("decode").backend.loaded.values()) == {"cache"}
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(ktflow.execute(first, ids)[0], ktflow.execute(second, ids)[0])  # bit for bit


def test_auto_backend_is_native_for_bf16_plans(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=16)
    assert c.executor("decode").backend.name == "native"
    f32 = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=16, dtype="float32")
    assert f32.executor("decode").backend.name == "torch_ref"


def test_a_cpu_only_step_keeps_the_pool_from_spinning(demo_dir):
    """A plan whose torch ops run on the CPU tells the pool to sleep between its runs (spinning
    workers would take those ops' cores); a CUDA-graph step lets it spin again, for the pool's own
    spin time (KTFLOW_SPIN_US)."""
    pool = native.pool()
    native.set_spinning(True)
    spin = pool.spin_us
    assert spin > 0
    model = ktflow.load(demo_dir)
    cpu = ktflow.compile(model, hw="cpu", max_seq_len=16)
    logits, state = ktflow.execute(cpu, torch.tensor([[1, 2, 3]]))
    assert cpu.executor("decode").backend.torch_on_cpu and pool.spin_us == 0
    if torch.cuda.is_available():
        from ktflow.costmodel.hw import PRESETS, with_this_gpus_memory

        gpu = ktflow.compile(model, hw=with_this_gpus_memory(PRESETS["rtx4090-desktop"]), device="cuda",
                             backend="cuda_graph", max_seq_len=16)
        _, st = ktflow.execute(gpu, torch.tensor([[1, 2, 3]]))
        ktflow.execute(gpu, torch.tensor([[4]]), st)
        assert pool.spin_us == spin
    native.set_spinning(True)
    assert pool.spin_us == spin
