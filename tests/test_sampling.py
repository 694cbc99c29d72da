"""Token selection (ktflow.backends.sampling) against a reference written from the definitions:
same support, the same distribution by a chi-square test at a fixed seed count, top_k=1 equal to
greedy, a seed that reproduces, penalties and logit_bias as HF and OpenAI define them, and bad
parameters named. On CUDA (where present) the GPU selects what the CPU selects."""

from __future__ import annotations

import math

import pytest
import torch

from ktflow.backends.sampling import ALL_STAGES, MAX_LOGIT_BIAS, Sampler, SamplingParamError, SamplingParams, uniform
from ktflow.errors import InputError

CUDA = torch.cuda.is_available()


def reference(logits: torch.Tensor, p: SamplingParams, generated=(), prompt=()) -> torch.Tensor:
    """The distribution a row with params `p` draws from, in float64, written from the
    definitions one token at a time (not vectorised like the sampler)."""
    x = logits.double().clone()
    for tok, b in p.logit_bias:
        x[tok] += b
    counts = torch.bincount(torch.tensor(list(generated), dtype=torch.int64), minlength=len(x)).double()
    for tok in range(len(x)):
        if counts[tok] > 0 or tok in prompt:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        x[tok] -= p.frequency_penalty * counts[tok] + p.presence_penalty * (counts[tok] > 0)
    probs = torch.softmax(x / p.temperature, 0)
    order = probs.argsort(descending=True).tolist()
    k = p.top_k or len(x)
    top_mass = sum(probs[t] for t in order[:k])
    kept, before = [], 0.0
    for rank, t in enumerate(order):
        if rank >= k or before >= p.top_p * top_mass or probs[t] < p.min_p * probs[order[0]]:
            break
        kept.append(t)
        before += float(probs[t])
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def chi2_limit(dof: int) -> float:
    """The chi-square quantile at p = 0.999 (Wilson-Hilferty)."""
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def draws(logits: torch.Tensor, p: SamplingParams, n: int, device="cpu", captured=False) -> torch.Tensor:
    """n draws from one row's logits: n rows with seeds 0..n-1 (every row its own stream)."""
    s = Sampler(n, logits.shape[-1], device)
    for r in range(n):
        s.set_row(r, SamplingParams(**{**p.__dict__, "seed": 1000 + r}))
    return s.select(logits.to(device).expand(n, -1).contiguous(), ALL_STAGES if captured else None).cpu()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=6),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, logit_bias=((3, 2.5), (7, -100.0))),
]


@pytest.mark.parametrize("captured", [False, True], ids=["host-stages", "every-stage"])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.__dict__.items()
                                                                    if v != SamplingParams.__dataclass_fields__[k].default))
def test_draws_follow_the_reference_distribution(params, captured):
    torch.manual_seed(0)
    logits = torch.randn(40) * 1.5
    n = 12000
    got = torch.bincount(draws(logits, params, n, captured=captured), minlength=40).double()
    ref = reference(logits, params)
    support = ref > 0
    assert got[~support].sum() == 0, "a token outside the kept set was drawn"
    expected = ref * n
    big = support & (expected >= 5)  # the chi-square cells; the rare ones pooled
    cells = torch.cat([got[big], got[support & ~big].sum()[None]])
    exp = torch.cat([expected[big], expected[support & ~big].sum()[None]])
    keep = exp > 0
    chi2 = float(((cells[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    if dof == 0:
        assert got[support].sum() == n
    else:
        assert chi2 < chi2_limit(dof), (chi2, dof)


def test_the_draws_are_not_one_token_everywhere():
    """The chi-square test above would pass a sampler stuck on a one-token support only where the
    reference is one token: here it is not."""
    logits = torch.zeros(10)
    got = draws(logits, SamplingParams(temperature=1.0), 2000)
    assert len(set(got.tolist())) == 10


def test_top_k_one_and_temperature_zero_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 100)
    s = Sampler(64, 100, "cpu")
    for r in range(64):
        s.set_row(r, SamplingParams(temperature=1.7, top_k=1, seed=r) if r % 2 else SamplingParams())
    assert torch.equal(s.select(logits), logits.argmax(-1))
    assert torch.equal(s.select(logits, ALL_STAGES), logits.argmax(-1))



def _bitmask(allowed: list[int], vocab: int) -> bytes:
    """llguidance's layout: token i is bit i % 32 of little-endian 32-bit word i // 32."""
    words = [0] * (-(-vocab // 32))
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


@pytest.mark.parametrize("captured", [False, True], ids=["host-stages", "every-stage"])
def test_a_grammar_row_selects_only_the_tokens_its_bitmask_allows(captured):
    """Greedy: the argmax over the allowed tokens; sampled (with truncation): only allowed tokens,
    in proportion to the model's probabilities among them; a row without a grammar is not masked
    by a bitmask written into it; tokens at bit 31 (a negative word) count."""
    torch.manual_seed(3)
    vocab, n = 300, 6000
    allowed = [5, 31, 63, 64, 200, 299]
    logits = torch.randn(vocab) * 2
    s = Sampler(n + 2, vocab, "cpu")
    for r in range(n):
        s.set_row(r, SamplingParams(temperature=1.0, top_p=0.99, seed=r, grammar="g"))
        s.set_allowed(r, _bitmask(allowed, vocab))
    s.set_row(n, SamplingParams(grammar="g"))  # greedy
    s.set_allowed(n, _bitmask(allowed, vocab))
    s.set_row(n + 1, SamplingParams())  # no grammar: its bitmask is not read
    s.set_allowed(n + 1, _bitmask([7], vocab))
    assert s.stages().grammar
    ids = s.select(logits.expand(n + 2, -1).contiguous(), ALL_STAGES if captured else None)
    sub = torch.full((vocab,), float("-inf"))
    sub[allowed] = logits[allowed]
    assert int(ids[n]) == int(sub.argmax()) and int(ids[n + 1]) == int(logits.argmax())
    got = torch.bincount(ids[:n], minlength=vocab).double()
    assert set(torch.nonzero(got).flatten().tolist()) <= set(allowed)
    p = torch.softmax(sub, -1)
    keep = p * n >= 5
    chi2 = float(((got[keep] - p[keep] * n) ** 2 / (p[keep] * n)).sum())
    assert chi2 < chi2_limit(int(keep.sum()) - 1) + 10, chi2  # (top_p 0.99 trims the rarest few)


def test_a_bitmask_shorter_than_the_vocabulary_allows_none_past_it_and_a_longer_one_is_cut():
    s = Sampler(2, 100, "cpu")
    for r in range(2):
        s.set_row(r, SamplingParams(grammar="g"))
    s.set_allowed(0, _bitmask([3], 32))  # one word for four
    s.set_allowed(1, _bitmask([90], 200))  # seven words for four
    logits = torch.zeros(2, 100)
    logits[:, 95] = 10.0  # the best token is past the first word
    assert s.select(logits).tolist() == [3, 90]


def test_a_draw_never_lands_on_a_token_of_weight_zero():
    """Where rounding leaves no prefix sum above the target (target at or past the total), the
    draw takes the last token of positive weight, never a masked or truncated one after it."""
    from ktflow.backends.sampling import CHUNK, _first_passing

    w = torch.zeros(3, 3 * CHUNK + 7)
    w[:, [4, CHUNK + 9, 2 * CHUNK + 1]] = torch.tensor([0.3, 0.5, 0.2])
    total = w.sum(-1)
    got = _first_passing(w, torch.stack([total[0] * 2, total[1] * (1 + 1e-7), total[2] * 0.5]))
    assert got.tolist() == [2 * CHUNK + 1, 2 * CHUNK + 1, CHUNK + 9]
    # targets at chunk boundaries, over sparse weights of mixed magnitudes: the mass before a
    # chunk taken as ends - sums can round above the previous chunk's end, letting a chunk's
    # zero-weight first token pass
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        w = torch.zeros(64, 4 * CHUNK)
        for r in range(64):
            n = int(torch.randint(2, 12, (), generator=g))
            idx = torch.randperm(4 * CHUNK, generator=g)[:n]
            w[r, idx] = torch.rand(n, generator=g) * 10.0 ** torch.randint(-9, 1, (n,), generator=g).float()
        ends = w.view(64, 4, CHUNK).sum(-1).cumsum(-1)
        target = ends.gather(1, torch.randint(0, 3, (64, 1), generator=g)).squeeze(1)
        target = torch.where(torch.rand(64, generator=g) < 0.5, target, torch.nextafter(target, torch.zeros_like(target)))
        picked = _first_passing(w, target)
        assert bool((w.gather(1, picked[:, None]) > 0).all())


def test_a_seed_reproduces_and_the_stream_moves_on():
    logits = torch.zeros(1, 1000)

    def run(seed):
        s = Sampler(1, 1000, "cpu")
        s.set_row(0, SamplingParams(temperature=1.0, seed=seed))
        return [int(s.select(logits)) for _ in range(8)]

    a, b, c = run(5), run(5), run(6)
    assert a == b and a != c
    assert len(set(a)) > 1  # each step draws afresh


def test_host_stages_and_every_stage_select_the_same_tokens():
    """Every stage run, or only those the rows need (the host's choice, and a captured run's key): the same
    ids either way, so a seed gives the same tokens on every backend."""
    torch.manual_seed(2)
    logits = torch.randn(16, 300)
    for p in CASES:
        picks = []
        for captured in (False, True):
            s = Sampler(16, 300, "cpu")
            for r in range(16):
                s.set_row(r, SamplingParams(**{**p.__dict__, "seed": r}))
            picks.append(torch.stack([s.select(logits, ALL_STAGES if captured else None) for _ in range(3)]))
        assert torch.equal(*picks), p


def test_penalties_follow_their_definitions():
    """Repetition (HF: prompt and generated, x / r where x > 0 else x * r), frequency and presence
    (OpenAI: generated tokens, by count and by presence): the sampled distribution after three
    generated tokens equals the reference's."""
    torch.manual_seed(3)
    logits = torch.randn(30)
    p = SamplingParams(temperature=1.0, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
    prompt, generated = [2, 5, 11], [5, 9, 9]
    n = 12000
    s = Sampler(n, 30, "cpu")
    for r in range(n):
        s.set_row(r, SamplingParams(**{**p.__dict__, "seed": r}), prompt)
    for t in generated:  # as if each row had generated these: counts only
        s.counts[:, t] += 1
    got = torch.bincount(s.select(logits.expand(n, -1).contiguous()), minlength=30).double()
    ref = reference(logits, p, generated, prompt)
    chi2 = float(((got - ref * n) ** 2 / (ref * n)).sum())
    assert chi2 < chi2_limit(29), chi2
    # and a penalty moves the distribution: the unpenalised one is far off
    plain = reference(logits, SamplingParams(temperature=1.0))
    assert float(((got - plain * n) ** 2 / (plain * n)).sum()) > 5 * chi2_limit(29)


def test_counts_advance_only_on_active_rows():
    s = Sampler(3, 50, "cpu")
    for r in range(3):
        s.set_row(r, SamplingParams(temperature=1.0, seed=r))
    s.set_active([True, False, True])
    ids = s.select(torch.zeros(3, 50))
    assert s.counter.tolist() == [1, 0, 1]
    assert s.counts[1].sum() == 0 and s.counts[0, ids[0]] == 1 and s.counts[2, ids[2]] == 1


def test_select_rows_continues_each_rows_stream():
    """A prompt's first token (select_rows over some rows) and then the batched steps draw what a
    row drawing alone draws."""
    logits = torch.zeros(1, 500)
    alone = Sampler(1, 500, "cpu")
    alone.set_row(0, SamplingParams(temperature=1.0, seed=42))
    want = [int(alone.select(logits)) for _ in range(4)]
    pool = Sampler(3, 500, "cpu")
    for r in range(3):
        pool.set_row(r, SamplingParams(temperature=1.0, seed=42 if r == 2 else r))
    got = [int(pool.select_rows(logits, [2])[0])]
    got += [int(pool.select(logits.expand(3, -1).contiguous())[2]) for _ in range(3)]
    assert got == want


def test_uniform_is_uniform():
    n = 200000
    u = uniform(torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u.float(), bins=20, min=0, max=1)
    chi2 = float(((hist - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < chi2_limit(19)
    # a step's counter decorrelates: consecutive draws of one seed are not ordered
    v = uniform(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), torch.arange(n))
    assert abs(float(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1])) < 0.01


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.5, "temperature"), ("temperature", float("nan"), "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -1, "top_k"),
    ("min_p", 1.2, "min_p"), ("min_p", -0.1, "min_p"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("presence_penalty", float("inf"), "presence_penalty"), ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("seed", 2**64, "seed"), ("seed", -2**63 - 1, "seed"), ("seed", True, "seed"),
])
def test_bad_parameters_name_themselves(field, value, match):
    with pytest.raises(SamplingParamError, match=match) as e:
        SamplingParams(**{field: value}).check(100)
    assert e.value.param == field and isinstance(e.value, InputError)


def test_bad_logit_bias_is_named():
    with pytest.raises(SamplingParamError, match="outside the vocabulary") as e:
        SamplingParams.make(logit_bias={100: 1.0}).check(100)
    assert e.value.param == "logit_bias"
    with pytest.raises(SamplingParamError, match="finite"):
        SamplingParams.make(logit_bias={"3": float("nan")}).check(100)
    with pytest.raises(SamplingParamError, match="token ids"):
        SamplingParams.make(logit_bias={"three": 1.0})
    with pytest.raises(SamplingParamError, match="at most"):
        SamplingParams.make(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}).check()
    assert SamplingParams.make(logit_bias={"3": 2}).logit_bias == ((3, 2.0),)  # JSON keys are strings


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_gpu_selects_what_the_cpu_selects():
    torch.manual_seed(4)
    logits = torch.randn(32, 4000)
    for p in CASES:
        picks = []
        for device in ("cpu", "cuda"):
            s = Sampler(32, 4000, device)
            for r in range(32):
                s.set_row(r, SamplingParams(**{**p.__dict__, "seed": r}), [1, 2, 3])
            picks.append(torch.stack([s.select(logits.to(device), ALL_STAGES).cpu() for _ in range(3)]))
        # the same u and the same rule; a token may differ only where float rounding moves a boundary
        assert (picks[0] != picks[1]).float().mean() < 0.02, p


def captured_select(s: Sampler, logits: torch.Tensor, stages) -> tuple:
    """(a CUDA graph of `s.select(logits, stages)` into a static ids tensor, that tensor), after
    one eager warm-up selection on a side stream."""
    out = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(s.select(logits, stages))  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(s.select(logits, stages))
    return graph, out


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_selection_captures_in_a_cuda_graph_and_replays_new_draws():
    s = Sampler(4, 1000, "cuda")
    for r in range(4):
        s.set_row(r, SamplingParams(temperature=1.0, top_p=0.9, seed=r))
    logits = torch.randn(4, 1000, device="cuda")
    graph, out = captured_select(s, logits, ALL_STAGES)
    seen = []
    for _ in range(6):
        graph.replay()
        torch.cuda.synchronize()
        seen.append(out.tolist())
    assert s.counter.tolist() == [7] * 4  # the warm-up and six replays
    assert len({tuple(x) for x in seen}) > 1
    # a fresh sampler at the same seeds, stepped eagerly, draws the same tokens
    t = Sampler(4, 1000, "cuda")
    for r in range(4):
        t.set_row(r, SamplingParams(temperature=1.0, top_p=0.9, seed=r))
    t.select(logits, ALL_STAGES)
    assert [t.select(logits, ALL_STAGES).tolist() for _ in range(6)] == seen



@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_captured_selection_reads_each_steps_bitmask():
    """A graph captured with the grammar stage masks by the bitmask written before each replay
    (set_allowed writes the buffer the graph reads), greedy and sampled rows alike."""
    vocab = 5000
    s = Sampler(2, vocab, "cuda")
    s.set_row(0, SamplingParams(grammar="g"))
    s.set_row(1, SamplingParams(temperature=1.0, top_p=0.9, seed=1, grammar="g"))
    logits = torch.randn(2, vocab, device="cuda")
    stages = s.stages()
    assert stages.grammar and stages.draw
    graph, out = captured_select(s, logits, stages)
    for allowed in ([17], [4095], [31, 4999], [2500]):
        for r in range(2):
            s.set_allowed(r, _bitmask(allowed, vocab))
        graph.replay()
        torch.cuda.synchronize()
        got = out.tolist()
        assert got[0] == max(allowed, key=lambda t: float(logits[0, t])) and got[1] in allowed, (allowed, got)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_fused_kernels_equal_the_torch_ops():
    """sampling_gpu's two kernels (penalties; the weights at the temperature) against the torch
    ops they replace, and the ids selected either way."""
    from ktflow.backends.kernels import dequant_gpu, sampling_gpu
    from ktflow.backends.sampling import select_ids

    if not dequant_gpu.available(torch.device("cuda")):
        pytest.skip("Triton is not importable here")
    torch.manual_seed(5)
    rows, vocab = 8, 5001  # not a multiple of the kernels' block
    s = Sampler(rows, vocab, "cuda")
    for r in range(rows):
        s.set_row(r, SamplingParams(temperature=0.5 + 0.2 * r if r else 0.0, top_p=0.9, repetition_penalty=1.4,
                                    presence_penalty=0.3, frequency_penalty=0.2, seed=r), list(range(r, 60, 3)))
    s.counts[:, :200] = torch.randint(0, 3, (rows, 200), dtype=torch.int32, device="cuda")
    logits = torch.randn(rows, vocab, device="cuda") * 3
    before = logits.clone()
    x = logits.clone()
    sampling_gpu.penalize_(x, s.counts, s.in_prompt, s.repetition, s.presence, s.frequency)
    seen = s.in_prompt | (s.counts > 0)
    r = s.repetition[:, None]
    want = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    want = want - s.frequency[:, None] * s.counts - s.presence[:, None] * (s.counts > 0)
    torch.testing.assert_close(x, want)
    best = x.argmax(-1)
    t = torch.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    torch.testing.assert_close(sampling_gpu.weights(x, best, s.temperature),
                               torch.exp(x / t - (x / t).gather(1, best[:, None])))
    n = 1000
    seeds = torch.randint(0, 2**32, (3, n), dtype=torch.int64, device="cuda")
    assert torch.equal(sampling_gpu.uniform(*seeds), uniform(*seeds))  # the same bits
    fused = select_ids(logits, s, kernels=True)
    plain = select_ids(logits, s, kernels=False)
    assert torch.equal(fused, plain)
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_select_rows_advances_rows_a_batched_step_left_inactive():
    """A prompt's first token advances its row even where the last batched step marked it padding."""
    s = Sampler(2, 50, "cpu")
    for r in range(2):
        s.set_row(r, SamplingParams(temperature=1.0, seed=r))
    s.set_active([False, True])
    ids = s.select_rows(torch.zeros(1, 50), [0])
    assert s.counter.tolist() == [1, 0] and s.counts[0, ids[0]] == 1


def test_a_captured_step_runs_every_stage_but_for_a_greedy_batch_with_a_grammar():
    """captured_stages: a greedy structured batch runs the mask and the argmax alone; any other mix
    every stage (few graphs a batch size, all made at warm-up)."""
    from ktflow.backends.sampling import CAPTURED_STAGES

    s = Sampler(2, 100, "cpu")
    s.set_row(0, SamplingParams(grammar="g"))
    assert s.captured_stages() == CAPTURED_STAGES[1] and not s.captured_stages().draw
    s.set_row(1, SamplingParams(temperature=0.7))
    assert s.captured_stages() == ALL_STAGES
    s.set_row(0, SamplingParams())
    s.set_row(1, SamplingParams())
    assert s.captured_stages() == ALL_STAGES  # (a plain greedy batch takes the argmax path, not a sampler)
