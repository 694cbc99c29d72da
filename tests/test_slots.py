"""Ragged decode (sequences at different positions in one batched step) and the SlotPool built on
it: every sequence gets the logits it gets when run alone, on torch_ref, the native backend and
the static-shape rules a CUDA graph captures (run on the CPU here; test_gpu runs the graph)."""

import pytest
import torch

import ktflow
from ktflow.backends.cuda.static_rules import static_rules
from ktflow.backends.torch_ref import TorchRefBackend
from ktflow.errors import ConfigError, InputError
from ktflow.runtime.executor import Executor
from ktflow.runtime.slots import SlotPool, buckets
from test_cuda_graph import FLIP_TOL, FLIPS, TOL, gpu, hybrid


def _alone(c, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """The logits of a sequence run by itself: after its prompt, then after each token of `steps`."""
    out, state = ktflow.execute(c, torch.tensor([prompt]), logits="last")
    got = [out[0, -1]]
    for t in steps:
        out, state = ktflow.execute(c, torch.tensor([[t]]), state, logits="last")
        got.append(out[0, -1])
    return got


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return float((a.float() - b.float()).norm() / b.float().norm()) < tol


@pytest.mark.parametrize("case,backend,defer", [("qwen3_moe", "torch_ref", None), ("deepseek_v3", "torch_ref", None),
                                                ("mixtral_sliding", "torch_ref", None), ("qwen3_moe", "native", None),
                                                ("deepseek_v3", "native", 1)])
@torch.inference_mode()
def test_pool_decodes_each_sequence_as_if_alone(case, backend, defer, tiny_dirs):
    """Three sequences with prompts of different lengths, started at different times, decoded
    together (one step per token for all of them, in a bucket with a padding row): each one's
    logits match running it alone (with Expert Deferral too: both sides run the same plan)."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = ktflow.compile(model, hw="paper-a100", device="cpu", dtype="float32", max_seq_len=48, max_batch=4,
                       backend=backend, defer=defer)
    if defer:
        assert any(n.op.value == "defer" for n in c.decode.ir.nodes)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = {0: torch.randint(0, vocab, (7,), generator=g).tolist(),
               2: torch.randint(0, vocab, (3,), generator=g).tolist(),  # slot 1 left free: a padding row
               3: torch.randint(0, vocab, (12,), generator=g).tolist()}
    feed = {s: torch.randint(0, vocab, (6,), generator=g).tolist() for s in prompts}
    pool = SlotPool(c, 4)
    got: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}
    for s in (0, 2):  # slot 3 joins after two steps
        pool.start(s)
        got[s].append(pool.prefill(s, torch.tensor([prompts[s]]))[0, -1])
    for step in range(6):
        if step == 2:
            pool.start(3)
            got[3].append(pool.prefill(3, torch.tensor([prompts[3]]))[0, -1])
        active = [s for s in prompts if len(got[s]) <= len(feed[s]) and (s != 3 or step >= 2)]
        out = pool.decode(active, [feed[s][len(got[s]) - 1] for s in active])
        assert out.shape == (len(active), vocab)
        for i, s in enumerate(active):
            got[s].append(out[i])
    for s, prompt in prompts.items():
        want = _alone(c, prompt, feed[s][:len(got[s]) - 1])
        for i, (a, b) in enumerate(zip(got[s], want, strict=True)):
            assert _close(a, b, 1e-4), (case, backend, s, i)
    assert pool.position(0) == 7 + 6 and pool.position(3) == 12 + 4


def _packed_matches_alone(c, vocab: int, tol: float) -> None:
    """Slots 0, 2, 3 prefilled in packed steps (a first chunk each, then the second chunk of two
    of them with a new sequence in slot 1), then decoded together: every logit as each sequence
    alone gets it."""
    g = torch.Generator().manual_seed(9)
    prompts = {s: torch.randint(0, vocab, (n,), generator=g).tolist() for s, n in ((0, 11), (2, 5), (3, 9), (1, 4))}
    cut = {0: 6, 2: 5, 3: 4}  # slot 2's prompt is whole in the first step
    pool = SlotPool(c, 4)
    for s in prompts:
        pool.start(s)
    first = pool.prefill_many([0, 2, 3], [prompts[s][:cut[s]] for s in (0, 2, 3)])
    second = pool.prefill_many([3, 1, 0], [prompts[3][cut[3]:], prompts[1], prompts[0][cut[0]:]])
    nxt = pool.decode([0, 1, 2, 3], [7, 8, 9, 10])
    for s in prompts:
        alone, state = ktflow.execute(c, torch.tensor([prompts[s]]), logits="last")
        if s == 2:
            assert _close(first[1], alone[0, -1], tol), s
        else:
            assert _close(second[[3, 1, 0].index(s)], alone[0, -1], tol), s
        step, _ = ktflow.execute(c, torch.tensor([[7 + s]]), state, logits="last")
        assert _close(nxt[s], step[0, -1], tol), s
    assert [pool.position(s) for s in range(4)] == [12, 5, 6, 10]


@pytest.mark.parametrize("case,backend", [("qwen3_moe", "torch_ref"), ("deepseek_v3", "native"),
                                          ("mixtral_sliding", "torch_ref")])
@torch.inference_mode()
def test_packed_prefill_continues_each_sequence_as_if_alone(case, backend, tiny_dirs):
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = ktflow.compile(model, hw="paper-a100", device="cpu", dtype="float32", max_seq_len=32, max_batch=4,
                       backend=backend)
    _packed_matches_alone(c, model.config.vocab_size, 1e-4)


def static_engine(gpu_device: str, dtype: torch.dtype) -> TorchRefBackend:
    """The reference engine with the static-shape rules composed in, as the CUDA backend does."""
    be = TorchRefBackend(gpu_device, dtype)
    be.rules.update(static_rules(be.rules))
    return be


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "mixtral_sliding"])
@torch.inference_mode()
def test_static_rules_ragged_step_matches_torch_ref(case, tiny_dirs):
    """The rules a CUDA graph captures, on a ragged step (a position per row as a tensor): the
    same logits and the same cache entries as torch_ref's row-by-row form."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = ktflow.compile(model, hw="paper-a100", device="cpu", placement="gpu", dtype="float32", max_seq_len=40,
                       max_batch=3, backend="torch_ref")
    pool, twin = SlotPool(c, 3), SlotPool(c, 3)
    g = torch.Generator().manual_seed(5)
    for s, n in enumerate((4, 9, 2)):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        for p in (pool, twin):
            p.start(s)
            p.prefill(s, ids)
    be = static_engine("cpu", torch.float32)
    be.prepare(c.decode.ir, model.weights)
    static = Executor(c.decode, be)
    ref = Executor(c.decode, c.executor(c.decode).backend)
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (3, 1), generator=g)
        pos = pool.positions.clone()
        want = ref.run(ids, pool.state, positions=pos)
        got = static.run(ids, twin.state, position_t=pos, positions=pos)
        assert _close(got, want, 1e-5), case
        pool.positions += 1
        twin.positions += 1
    for layer, caches in pool.state.kv.items():
        for a, b in zip(caches, twin.state.kv[layer], strict=True):
            assert torch.allclose(a, b, atol=1e-5), layer


def test_pool_and_execute_share_a_compiled_model(tiny_dirs):
    """`execute` and a pool on one compiled model, in either order, outside inference mode (the
    backends' buffers made by one are written by the other)."""
    d, _ = tiny_dirs("qwen3_moe")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=16, max_batch=2)
    ids = torch.tensor([[1, 2, 3]])
    want, state = ktflow.execute(c, ids, logits="last")
    pool = SlotPool(c, 2)
    pool.start(1)
    assert _close(pool.prefill(1, ids)[0, -1], want[0, -1], 1e-5)
    got = pool.decode([1], [4])[0]
    want, _ = ktflow.execute(c, torch.tensor([[4]]), state, logits="last")
    assert _close(got, want[0, -1], 1e-5)


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(6) == [1, 2, 4, 6]


@torch.inference_mode()
def test_pool_refuses_what_it_cannot_do(tiny_dirs):
    d, _ = tiny_dirs("qwen3_moe")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=16, max_batch=2,
                       backend="torch_ref")
    with pytest.raises(ConfigError, match="max_batch >= 3"):
        SlotPool(c, 3)
    pool = SlotPool(c, 2)
    with pytest.raises(InputError, match="slot 5 does not exist"):
        pool.start(5)
    pool.start(0)
    with pytest.raises(InputError, match="slot 0 has no prompt yet"):
        pool.decode([0], [1])
    pool.prefill(0, torch.tensor([[1] * 15]))
    with pytest.raises(InputError, match="out of range"):
        pool.decode([0], [10 ** 6])
    pool.decode([0], [2])  # position 16: full
    with pytest.raises(InputError, match="KV cache is full"):
        pool.decode([0], [2])
    with pytest.raises(InputError, match="distinct"):
        pool.decode([0, 0], [1, 1])


def _chunked(pool: SlotPool, slot: int, prompt: list[int], start: int, chunk: int) -> torch.Tensor:
    """`prompt[start:]` prefilled into `slot` in chunks cut at multiples of `chunk`; the last logits."""
    at, out = start, None
    while at < len(prompt):
        end = min((at // chunk + 1) * chunk, len(prompt))
        out = pool.prefill_many([slot], [prompt[at:end]])
        at = end
    return out[0]


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral_sliding"])
@torch.inference_mode()
def test_a_sequence_reuses_the_prefilled_entries_its_slot_holds(case, tiny_dirs):
    """A new prompt sharing its first tokens with what a slot's prefills held: `cached` counts
    them (not the entries decode steps made, not past the prompt's last token), and starting
    after a chunk-aligned part of them gives the logits a prefill from scratch gives, bit for
    bit; more than `cached` is refused."""
    d, _ = tiny_dirs(case)
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=64, max_batch=2,
                       backend="torch_ref")
    vocab = c.vocab_size
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, vocab, (21,), generator=g).tolist()
    fed = torch.randint(0, vocab, (3,), generator=g).tolist()
    pool = SlotPool(c, 2)
    pool.start(1)
    _chunked(pool, 1, first, 0, 8)
    for t in fed:  # decode steps: their entries are held, but not reused
        pool.decode([1], [t])
    later = first + fed + torch.randint(0, vocab, (9,), generator=g).tolist()
    assert pool.cached(1, later) == len(first)
    assert pool.cached(1, first) == len(first) - 1  # the prompt's last token always runs
    assert pool.cached(0, later) == 0
    with pytest.raises(InputError, match="holds 21 of this prompt's first tokens; it cannot start after 22"):
        pool.start(1, prompt=later, reuse=22)
    pool.start(1, prompt=later, reuse=16)  # the chunks [0, 8) and [8, 16)
    assert pool.position(1) == 16 and pool.cached(1, later) == 16
    got = _chunked(pool, 1, later, 16, 8)
    fresh = SlotPool(c, 2)
    fresh.start(1)
    assert torch.equal(got, _chunked(fresh, 1, later, 0, 8))


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v2_lite"])  # both cache layouts: GQA's, MLA's
@torch.inference_mode()
def test_a_sequence_starts_after_a_prefix_another_slot_holds(case, tiny_dirs):
    """`start(slot, reuse=n, source=other)` copies the other slot's first n entries into this
    slot's row (the other slot keeps its own): the rest prefilled gives the logits a prefill from
    scratch gives, bit for bit; more than the source holds is refused."""
    d, _ = tiny_dirs(case)
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=64, max_batch=2,
                       backend="torch_ref")
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(0, c.vocab_size, (19,), generator=g).tolist()
    first, later = (shared + torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (5, 9))
    pool = SlotPool(c, 2)
    pool.start(0)
    _chunked(pool, 0, first, 0, 8)
    assert pool.cached(0, later) == 19 and pool.cached(1, later) == 0
    with pytest.raises(InputError, match="slot 0 holds 19 of this prompt's first tokens; it cannot start after 24"):
        pool.start(1, prompt=later, reuse=24, source=0)
    pool.start(1, prompt=later, reuse=16, source=0)
    assert pool.position(1) == 16 and pool.cached(1, later) == 16 and pool.prefilled(1) == 16
    assert pool.cached(0, first) == len(first) - 1  # the source keeps what it held
    got = _chunked(pool, 1, later, 16, 8)
    fresh = SlotPool(c, 2)
    fresh.start(1)
    assert torch.equal(got, _chunked(fresh, 1, later, 0, 8))


@torch.inference_mode()
def test_a_full_padding_row_gives_up_its_last_entry(tiny_dirs):
    """A free slot at max_seq_len decoded over as padding writes at its last position: that
    entry is no longer reusable."""
    d, _ = tiny_dirs("qwen3_moe")
    c = ktflow.compile(ktflow.load(d), hw="paper-a100", device="cpu", dtype="float32", max_seq_len=16, max_batch=2,
                       backend="torch_ref")
    pool = SlotPool(c, 2)
    pool.start(0)
    pool.prefill(0, torch.tensor([list(range(1, 17))]))
    assert pool.cached(0, list(range(1, 17)) + [5]) == 16
    pool.start(1)
    pool.prefill(1, torch.tensor([[3, 4]]))
    pool.decode([1], [7])  # bucket 2: row 0 pads, at its last position
    assert pool.cached(0, list(range(1, 17)) + [5]) == 15


@gpu
@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "mixtral_sliding"])
@torch.inference_mode()
def test_cuda_graph_ragged_steps_match_each_sequence_alone(case, tiny_dirs):
    """The pool on the cuda_graph backend (hybrid plan: experts on the native queue): three
    sequences at different positions in bucket 4 (slot 1 a padding row), each step's logits as
    the sequence alone gets them (bf16 both sides; a router near-tie may flip a token, as in
    test_cuda_graph), and each bucket's step captured once and replayed."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = hybrid(model, backend="cuda_graph", max_batch=4)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    prompts = {0: 9, 2: 4, 3: 15}
    prompts = {s: torch.randint(0, vocab, (n,), generator=g).tolist() for s, n in prompts.items()}
    feed = {s: torch.randint(0, vocab, (5,), generator=g).tolist() for s in prompts}
    pool = SlotPool(c, 4)
    got = {}
    for s, prompt in prompts.items():
        pool.start(s)
        got[s] = [pool.prefill(s, torch.tensor([prompt]))[0, -1]]
    for step in range(5):
        out = pool.decode(list(prompts), [feed[s][step] for s in prompts])
        for i, s in enumerate(prompts):
            got[s].append(out[i])
    errs = [rel(a, b) for s, prompt in prompts.items()
            for a, b in zip(got[s], _alone(c, prompt, feed[s]), strict=True)]
    assert sum(e > TOL for e in errs) <= FLIPS * len(errs) and max(errs) < FLIP_TOL, (case, errs)
    runner = c.executor(c.decode).runner
    graphs = [bd for (b, _), bd in runner.ragged.items() if b == 4]
    assert len(graphs) == 1 and graphs[0].graph is not None  # bucket 4: bound once, captured, replayed


@gpu
@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3"])
@torch.inference_mode()
def test_cuda_graph_packed_prefill_continues_each_sequence_as_if_alone(case, tiny_dirs):
    """Packed prefill steps through the prefill runner (the GPU lanes), then a ragged decode step
    (the captured graph): as each sequence alone (bf16: within the test_cuda_graph tolerance)."""
    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    c = hybrid(model, backend="cuda_graph", max_batch=4)
    _packed_matches_alone(c, model.config.vocab_size, FLIP_TOL)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())
