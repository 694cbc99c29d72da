"""Sampled decoding end to end: the sampler's tokens through execute / decode_tokens / generate on
every backend (on cuda_graph inside the captured step, K steps a launch too), token ids on the
CPU or a GPU, and bad parameters named. GPU tests skip without CUDA."""

import pytest
import torch

import ktflow
from ktflow.backends.native import binding as native
from ktflow.backends.sampling import SamplingParamError
from ktflow.errors import InputError
from ktflow.ir.ops import Op
from ktflow.runtime.execute import decode_tokens, start_sampling

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and native.available()),
                         reason="needs a CUDA GPU and the native module")


@pytest.fixture(scope="module")
def cpu_plan(demo_dir):
    return ktflow.compile(ktflow.load(demo_dir), hw="cpu", max_seq_len=64, max_batch=2)


def prompt(rows=2, n=6, seed=0):
    return torch.randint(0, 2048, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_top_k_one_and_a_zero_bias_decode_as_greedy(cpu_plan):
    """Rows that go through the sampler (top_k=1 at a temperature; a logit_bias of 0) take the
    argmax: the same tokens as greedy decoding."""
    p = prompt()
    greedy = ktflow.generate(cpu_plan, p, 8)
    assert torch.equal(ktflow.generate(cpu_plan, p, 8, temperature=1.3, top_k=1), greedy)
    assert torch.equal(ktflow.generate(cpu_plan, p, 8, logit_bias={5: 0.0}), greedy)


def test_a_seed_reproduces_each_row_its_own(cpu_plan):
    p = prompt()
    kw = dict(temperature=1.0, top_p=0.9, min_p=0.01, top_k=50)
    a = ktflow.generate(cpu_plan, p, 10, seed=3, **kw)
    assert torch.equal(a, ktflow.generate(cpu_plan, p, 10, seed=3, **kw))
    assert not torch.equal(a, ktflow.generate(cpu_plan, p, 10, seed=4, **kw))
    # one parameter set per row: row 1 greedy, row 0 sampled as above
    mixed = ktflow.generate(cpu_plan, p, 10, sampling=[ktflow.SamplingParams(seed=3, **kw), ktflow.SamplingParams()])
    assert torch.equal(mixed[0], a[0])
    assert torch.equal(mixed[1], ktflow.generate(cpu_plan, p, 10)[1])


def test_logit_bias_and_penalties_change_the_tokens(cpu_plan):
    p = prompt(rows=1)
    forced = ktflow.generate(cpu_plan, p, 6, temperature=1.0, seed=0, logit_bias={77: 100.0})
    assert forced[0, 6:].tolist() == [77] * 6
    banned = ktflow.generate(cpu_plan, p, 12, temperature=0.0, repetition_penalty=50.0, frequency_penalty=2.0)
    new = banned[0, 6:].tolist()
    assert len(set(new)) == len(new), "a penalised token came back"
    assert not set(new) & set(p[0].tolist())  # the repetition penalty counts the prompt too


def test_sampled_decode_steps_one_at_a_time_equal_a_run(cpu_plan):
    """decode_tokens(K) equals K calls of execute(logits='sample') from the same state and seeds."""
    p = prompt()
    params = ktflow.SamplingParams(temperature=0.8, top_p=0.95, seed=9)
    logits, s1 = ktflow.execute(cpu_plan, p, logits="last")
    _, s2 = ktflow.execute(cpu_plan, p, logits="last")
    start_sampling(cpu_plan, s1, params, p)
    start_sampling(cpu_plan, s2, params, p)
    nxt = s1.sampler.select(logits[:, -1])
    assert torch.equal(nxt, s2.sampler.select(logits[:, -1]))
    one = []
    ids = nxt[:, None]
    for _ in range(5):
        ids, s1 = ktflow.execute(cpu_plan, ids, s1, logits="sample")
        one.append(ids)
    assert torch.equal(decode_tokens(cpu_plan, nxt[:, None], s2, 5), torch.cat(one, 1))


def test_sample_without_parameters_and_bad_parameters_are_refused(cpu_plan):
    p = prompt()
    _, state = ktflow.execute(cpu_plan, p, logits="last")
    with pytest.raises(InputError, match="start_sampling"):
        ktflow.execute(cpu_plan, torch.tensor([[1], [2]]), state, logits="sample")
    for kw, name in ((dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"), (dict(presence_penalty=float("nan")),
                     "presence_penalty"), (dict(logit_bias={5000: 1.0}), "logit_bias"), (dict(top_p=0.0), "top_p")):
        with pytest.raises(SamplingParamError, match=name) as e:
            ktflow.generate(cpu_plan, p, 2, **kw)
        assert e.value.param == name


def test_int32_ids_and_logits_on_their_device(cpu_plan):
    p = prompt()
    a, _ = ktflow.execute(cpu_plan, p)
    b, _ = ktflow.execute(cpu_plan, p.to(torch.int32))
    assert torch.equal(a, b) and b.device.type == "cpu"


# ------------------------------------------------------------------------------------------ GPU


def hybrid(model, **options):
    from test_cuda_graph import hybrid as make

    return make(model, **options)


@gpu
@pytest.mark.parametrize("backend", ["torch_ref", "native", "cuda_graph"])
def test_ids_on_the_gpu_give_logits_and_ids_there(backend, tiny_dirs):
    d, _ = tiny_dirs("qwen3_moe")
    c = hybrid(ktflow.load(d), backend=backend)
    p = prompt(n=9).remainder(c.vocab_size)
    want, st = ktflow.execute(c, p)
    got, sg = ktflow.execute(c, p.cuda())
    assert got.device.type == "cuda" and torch.allclose(got.cpu(), want, atol=1e-3, rtol=0)
    ids, _ = ktflow.execute(c, torch.tensor([[3], [4]], device="cuda"), sg, logits="argmax")
    assert ids.device.type == "cuda" and ids.shape == (2, 1)
    out = ktflow.generate(c, p.cuda(), 4, temperature=0.7, top_p=0.95, seed=1)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), ktflow.generate(c, p, 4, temperature=0.7, top_p=0.95,
                                                                                 seed=1))


@gpu
@pytest.mark.parametrize("case,embed_cpu", [("qwen3_moe", False), ("deepseek_v3", False), ("deepseek_v2_lite", True)])
def test_sampled_runs_of_several_steps_a_launch_equal_one_step_a_launch(case, embed_cpu, tiny_dirs):
    """Sampled decoding in the captured step: K steps a launch (each step's token selected by the
    sampler on the GPU and fed to the next there) give the tokens of K one-step launches with the
    same seeds (the sampler's stream advances once a step either way); calls of K = 4, 4, 2, 4 run
    eager, captured and replayed graphs."""
    from test_cuda_graph import embed_on

    d, _ = tiny_dirs(case)
    model = ktflow.load(d)
    extra = dict(passes=[("after:place_by_intensity", embed_on("cpu" if embed_cpu else "gpu"))])
    one, many = hybrid(model, **extra), hybrid(model, **extra)
    p = prompt(n=9, seed=6).remainder(model.config.vocab_size)
    params = [ktflow.SamplingParams(temperature=0.9, top_p=0.9, seed=1),
              ktflow.SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.3, seed=2)]
    logits, s1 = ktflow.execute(one, p, logits="last")
    _, s2 = ktflow.execute(many, p, logits="last")
    for c, s in ((one, s1), (many, s2)):
        start_sampling(c, s, params, p)
    first = s1.sampler.select(logits[:, -1].cuda()).cpu()
    assert torch.equal(first, s2.sampler.select(logits[:, -1].cuda()).cpu())
    nxt, want, got = first[:, None], [], []
    for k in (4, 4, 2, 4):
        start = nxt
        for _ in range(k):
            nxt, s1 = ktflow.execute(one, nxt, s1, logits="sample")
            want.append(nxt)
        got.append(decode_tokens(many, start, s2, k))
        assert torch.equal(got[-1][:, -1:], nxt)
    runner = many.executor("decode").runner
    # (with the embedding on the CPU a first call runs one step a launch: a first step binds the lookups)
    assert {k for (k, sampled, _), run in runner.bound[2].runs.items() if run.graph and sampled} - {1} == {4, 2}
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))
    assert s2.sampler is runner.bound[2].sampler  # the batch size's static sampler, lent to this sequence


@gpu
def test_a_zero_bias_through_the_graph_decodes_as_greedy(tiny_dirs):
    d, _ = tiny_dirs("qwen3_moe")
    c = hybrid(ktflow.load(d))
    p = prompt(n=9).remainder(c.vocab_size)
    assert torch.equal(ktflow.generate(c, p, 12, logit_bias={3: 0.0}), ktflow.generate(c, p, 12))


@gpu
def test_one_graph_launch_per_sampled_token(demo_dir):
    """Sampled steps (logits='sample'): one graph launch a token and nothing else launched or
    copied: the selection is inside the graph and only the ids cross."""
    from torch.profiler import ProfilerActivity, profile

    from test_cuda_graph import OTHER_LAUNCHES, hw_here

    c = ktflow.compile(ktflow.load(demo_dir), hw=hw_here(), device="cuda", vram_budget_gb=0.01, defer=1, max_seq_len=64)
    assert any(n.op == Op.SUBMIT for n in c.decode.ir.nodes)
    ids = prompt(rows=1, n=8)
    _, state = ktflow.execute(c, ids, logits="last")
    start_sampling(c, state, ktflow.SamplingParams(temperature=0.7, top_p=0.95, presence_penalty=0.5, seed=0), ids)
    for t in range(2):  # eager + capture, then a first replay
        _, state = ktflow.execute(c, torch.tensor([[t + 1]]), state, logits="sample")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for t in range(4):
            _, state = ktflow.execute(c, torch.tensor([[t + 5]]), state, logits="sample")
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 4
    assert not [n for n in names if n in OTHER_LAUNCHES]


@gpu
def test_a_pools_ragged_sampled_step_selects_in_the_graph_what_the_sampler_selects_from_its_logits(tiny_dirs):
    """The server's path: a SlotPool's ragged step with logits='sample' (selected inside the
    captured graph, rows 0 and 2 listed, row 1 padding) gives the ids the same sampler state
    selects from the logits a logits='last' step returns; the padding row's stream and counts
    stay where they were."""
    from ktflow.runtime.slots import SlotPool

    d, _ = tiny_dirs("qwen3_moe")
    c = hybrid(ktflow.load(d), max_batch=4)
    params = [ktflow.SamplingParams(temperature=0.8, top_p=0.9, seed=s, presence_penalty=0.2) for s in range(3)]
    prompts = [prompt(rows=1, n=5 + s, seed=s)[0].remainder(c.vocab_size).tolist() for s in range(3)]
    pools = [SlotPool(c, 4), SlotPool(c, 4)]
    firsts = []
    for pool in pools:
        for s in range(3):
            pool.start(s, params[s], prompts[s])
        logits = pool.prefill_many([0, 1, 2], prompts)
        firsts.append(pool.select_tokens([0, 1, 2], logits))
    assert firsts[0] == firsts[1]
    a, b = pools
    ids = [firsts[0][0], firsts[0][2]]
    for _ in range(4):
        logits = a.decode([0, 2], ids, logits="last")
        want = a.sampler.select_rows(logits, [0, 2]).cpu()
        counter1, counts1 = int(b.sampler.counter[1]), b.sampler.counts[1].clone()
        got = b.decode([0, 2], ids, logits="sample")
        assert torch.equal(got, want)
        assert int(b.sampler.counter[1]) == counter1 and torch.equal(b.sampler.counts[1], counts1)
        ids = got.tolist()
