"""Runtime: execute's contract (prefill, decode, continuation), bad token input, generation."""

import pytest
import torch

import ktflow
from ktflow.errors import InputError
from ktflow.runtime.generate import generate_with_stats


@pytest.fixture(scope="module")
def compiled(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=32, dtype="float32")


def ids(*rows):
    return torch.tensor(rows)


def test_decode_continuation_equals_one_long_prefill(compiled):
    seq = ids([3, 9, 27, 81, 243, 729, 100, 200])
    full, _ = ktflow.execute(compiled, seq)
    part, st = ktflow.execute(compiled, seq[:, :5])
    steps = [part]
    for t in range(5, 8):
        lg, st = ktflow.execute(compiled, seq[:, t:t + 1], st)
        steps.append(lg)
    got = torch.cat(steps, 1)
    assert got.shape == (1, 8, 2048)
    assert (got - full).abs().max() <= 1e-4 * full.abs().max()


def test_chunked_prefill_through_state(compiled):
    seq = ids([1, 2, 3, 4, 5, 6])
    full, _ = ktflow.execute(compiled, seq)
    a, st = ktflow.execute(compiled, seq[:, :3])
    b, st = ktflow.execute(compiled, seq[:, 3:], st)
    assert st.position == 6
    assert (torch.cat([a, b], 1) - full).abs().max() <= 1e-4 * full.abs().max()


def test_batch_rows_are_independent(compiled):
    a, b = [5, 6, 7, 8], [40, 41, 42, 43]
    both, _ = ktflow.execute(compiled, ids(a, b))
    single, _ = ktflow.execute(compiled, ids(b))
    assert (both[1] - single[0]).abs().max() <= 1e-4 * single.abs().max()


@pytest.mark.parametrize("bad", [-1, 2048, 10**6])
def test_token_id_out_of_range(compiled, bad):
    with pytest.raises(InputError, match=f"token id {bad} is out of range"):
        ktflow.execute(compiled, ids([1, bad, 2]))


def test_bad_input_shapes(compiled):
    with pytest.raises(InputError, match="shape"):
        ktflow.execute(compiled, torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="integer"):
        ktflow.execute(compiled, torch.tensor([[1.0, 2.0]]))


def test_prompt_longer_than_max_seq_len(compiled):
    with pytest.raises(InputError, match="33 tokens, more than max_seq_len 32"):
        ktflow.execute(compiled, torch.zeros(1, 33, dtype=torch.long))


def test_decode_past_max_seq_len(compiled):
    _, st = ktflow.execute(compiled, torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(InputError, match="passes max_seq_len 32"):
        ktflow.execute(compiled, ids([1]), st)
    assert st.position == 32


def test_state_batch_mismatch(compiled):
    _, st = ktflow.execute(compiled, ids([1, 2]))
    with pytest.raises(InputError, match="holds 1 sequences"):
        ktflow.execute(compiled, ids([1], [2]), st)


def test_kv_cache_is_static_size(compiled):
    _, st = ktflow.execute(compiled, ids([1, 2, 3]))
    for latent, rope, both in st.kv.values():
        assert latent.shape == (1, 32, 64) and rope.shape == (1, 32, 16) and both.shape == (1, 32, 80)
        assert latent.data_ptr() == both.data_ptr()  # views of one buffer: the absorbed rule's keys


def test_greedy_generation_follows_argmax(compiled):
    prompt = ids([7, 8, 9])
    out = ktflow.generate(compiled, prompt, 4)
    assert out.shape == (1, 7) and torch.equal(out[:, :3], prompt)
    seq = prompt
    for _ in range(4):
        lg, _ = ktflow.execute(compiled, seq)
        seq = torch.cat([seq, lg[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_argmax_mode_returns_the_greedy_next_ids(compiled):
    """logits='argmax' gives the argmax of the last position's logits, prefill and decode, batch 2."""
    ids = torch.randint(0, compiled.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    logits, s1 = ktflow.execute(compiled, ids, logits="last")
    nxt, s2 = ktflow.execute(compiled, ids, logits="argmax")
    assert nxt.dtype == torch.int64 and nxt.shape == (2, 1)
    assert torch.equal(nxt, logits.argmax(-1))
    logits, _ = ktflow.execute(compiled, nxt, s1)
    again, _ = ktflow.execute(compiled, nxt, s2, logits="argmax")
    assert torch.equal(again, logits[:, -1:].argmax(-1))


@pytest.mark.parametrize("backend", ["torch_ref", "native"])
def test_greedy_steps_per_call_change_nothing_generated(demo_dir, backend):
    """generate with greedy_steps = 4 (decode_greedy runs of 4, the last 2 tokens one at a time,
    an end-of-sequence token inside a run) returns what one step a call returns."""
    model = ktflow.load(demo_dir)
    one, four = (ktflow.compile(model, hw="cpu", max_seq_len=32, dtype="float32", backend=backend,
                                greedy_steps=k) for k in (1, 4))
    p = ids([5, 6, 7], [9, 10, 11])
    a, b = ktflow.generate(one, p, 11), ktflow.generate(four, p, 11)
    assert a.shape == (2, 14) and torch.equal(a, b)
    eos = int(a[0, 8])  # a token greedy decoding reaches inside the second run
    assert torch.equal(ktflow.generate(one, p, 11, eos_token_id=eos), ktflow.generate(four, p, 11, eos_token_id=eos))


def test_greedy_runs_leave_a_callers_state_at_the_last_token(demo_dir):
    """A caller's own state, continued by generate with an end-of-sequence token, holds exactly the
    tokens returned (greedy runs, which may go past the token, are not used for it)."""
    from ktflow.runtime.generate import generate_with_stats

    model = ktflow.load(demo_dir)
    one, four = (ktflow.compile(model, hw="cpu", max_seq_len=32, dtype="float32", greedy_steps=k) for k in (1, 4))
    p = ids([5, 6, 7])
    eos = int(ktflow.generate(one, p, 11)[0, 8])
    _, st = ktflow.execute(four, p[:, :1])
    out, _ = generate_with_stats(four, p[:, 1:], 11, eos_token_id=eos, state=st)
    assert int(out[0, -1]) == eos and out.shape[1] < 2 + 11
    assert st.position == 1 + out.shape[1] - 1  # every token but the last was fed


def test_sampling_is_reproducible_with_a_seed(compiled):
    p = ids([7, 8, 9])
    a = ktflow.generate(compiled, p, 6, temperature=1.5, seed=11)
    b = ktflow.generate(compiled, p, 6, temperature=1.5, seed=11)
    assert torch.equal(a, b)
    others = {tuple(ktflow.generate(compiled, p, 6, temperature=1.5, seed=s)[0].tolist()) for s in range(6)}
    assert len(others) > 1


def test_generation_stops_at_eos_and_pads(compiled):
    p = ids([7, 8, 9], [1, 2, 3])
    free = ktflow.generate(compiled, p, 5)
    eos = int(free[0, 4])  # the second token row 0 generates
    out = ktflow.generate(compiled, p, 5, eos_token_id=eos)
    row0 = out[0, 3:].tolist()
    assert row0[1] == eos and all(t == eos for t in row0[1:])


def test_generation_that_cannot_fit_is_refused_up_front(compiled):
    with pytest.raises(InputError, match="needs 40 positions"):
        ktflow.generate(compiled, torch.zeros(1, 10, dtype=torch.long), 31)


def test_generation_stats(compiled):
    out, st = generate_with_stats(compiled, ids([1, 2, 3, 4]), 5)
    assert out.shape == (1, 9)
    assert st.prompt_tokens == 4 and st.new_tokens == 4
    assert st.prefill_tokens_per_s > 0 and st.decode_tokens_per_s > 0


def test_null_backend_records_every_step(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=16, backend="null")
    logits, st = ktflow.execute(c, ids([1, 2, 3]))
    be = c.executor("prefill").backend
    assert [name for name, _, _ in be.calls] == [s.node for s in c.prefill[0].instructions]
    assert logits.shape == (1, 3, 2048) and st.position == 3
    assert ("L1.gate", "gate", (3, 4)) in be.calls


def test_bf16_execution_runs_and_stays_close_to_float32(demo_dir, compiled):
    bf = ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=32)
    assert bf.prefill[0].ir.act_dtype.value == "bf16"
    p = ids([11, 12, 13, 14, 15])
    a, _ = ktflow.execute(bf, p)
    b, _ = ktflow.execute(compiled, p)
    assert ((a - b).norm() / b.norm()) < 5e-2
