"""The multi-token-prediction (MTP) layer of DeepSeek-V3 and GLM-4.5 as a graph of its own
(`Model.mtp()`): its logits against the reference written from the published architecture
(hf_mtp.py) on tiny checkpoints that carry one, through a prefill and decode steps, on the
reference and the native backends; the checkpoint's own embedding and head read where it stores
them; the main model reads none of the MTP's tensors; bad inputs are refused naming what is wrong.
"""

import pytest
import torch

import hf_mtp
import ktflow
from ktflow.errors import ConfigError, InputError
from ktflow.ir.ops import Op

TOL = 1e-4


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    pytest.importorskip("transformers")
    made = {}

    def get(case: str, own: bool = True):
        if (case, own) not in made:
            d = tmp_path_factory.mktemp(f"{case}-mtp")
            made[case, own] = (d, *hf_mtp.make_mtp(case, d, own_embed_and_head=own))
        return made[case, own]

    return get


def mtp_logits(model, ids: torch.Tensor, decode: int, backend: str = "torch_ref", dtype: str = "float32"):
    """The MTP's logits for ids [T] through ktflow: the main model's hidden states of the prompt
    ids[:T - decode] then one token at a time (state.keep_hidden), the MTP run over them the same
    way (a prefill, then decode steps), each position i paired with token i + 1."""
    main = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype=dtype, backend=backend)
    mtp = ktflow.compile(model.mtp(), hw="cpu", max_seq_len=64, dtype=dtype, backend=backend)
    t = ids.numel()
    prompt = t - decode
    state = ktflow.runtime.state.State(main.plans.model.fingerprint, 1, main.max_seq_len, keep_hidden=True)
    _, state = ktflow.execute(main, ids[:prompt].view(1, -1), state)
    hidden = [state.hidden_out]
    for i in range(prompt, t):
        _, state = ktflow.execute(main, ids[i:i + 1].view(1, 1), state)
        hidden.append(state.hidden_out)
    hidden = torch.cat(hidden, dim=1)  # [1, T, h]: position i's final hidden state
    # the MTP: position i reads hidden i and token i + 1 (positions 0 .. T - 2)
    got, mstate = ktflow.execute(mtp, ids[1:prompt].view(1, -1), hidden=hidden[:, :prompt - 1])
    rows = [got[0]]
    for i in range(prompt - 1, t - 1):
        logits, mstate = ktflow.execute(mtp, ids[i + 1:i + 2].view(1, 1), mstate, hidden=hidden[:, i:i + 1])
        rows.append(logits[0])
    return torch.cat(rows).float()


def assert_close(ref, got, tol=TOL):
    assert ref.shape == got.shape, (ref.shape, got.shape)
    err, scale = (ref - got).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"max |diff| {err:.3e} > {tol} * max|logit| {scale:.3e}"


@pytest.mark.parametrize("case,own", [("deepseek_v3", True), ("glm4_moe", False), ("deepseek_v3_plain_q_yarn", False)])
def test_mtp_logits_match_the_reference(case, own, mtp_dirs):
    d, main, mtp = mtp_dirs(case, own)
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (14,), generator=torch.Generator().manual_seed(5))
    ref = hf_mtp.mtp_logits(main, mtp, ids)
    assert_close(ref, mtp_logits(model, ids, decode=4))


def test_the_native_backend_computes_the_same(mtp_dirs):
    from ktflow.backends.native import binding as native

    if not native.available():
        pytest.skip("the native module is not built")
    d, main, mtp = mtp_dirs("deepseek_v3", True)
    model = ktflow.load(d)
    ids = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(6))
    ref = hf_mtp.mtp_logits(main, mtp, ids)
    got = mtp_logits(model, ids, decode=2, backend="native", dtype="bfloat16")
    assert (ref.argmax(-1) == got.argmax(-1)).float().mean() >= 0.75  # bf16 against float32
    assert_close(ref, got, tol=5e-2)


def test_the_layers_own_embedding_and_head_are_read_where_stored(mtp_dirs):
    d, _, _ = mtp_dirs("deepseek_v3", True)
    g = ktflow.load(d).mtp().graph()
    keys = {w.key for n in g.nodes for w in n.weights}
    assert "model.layers.3.embed_tokens.weight" in keys and "model.layers.3.shared_head.head.weight" in keys
    d, _, _ = mtp_dirs("glm4_moe", False)
    g = ktflow.load(d).mtp().graph()
    keys = {w.key for n in g.nodes for w in n.weights}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" in keys
    proj = [n for n in g.nodes if n.op == Op.PROJECT]
    assert len(proj) == 1 and proj[0].weights[0].key == "model.layers.3.eh_proj.weight"
    hidden = [n for n in g.nodes if n.op == Op.INPUT and n.attrs.hidden]
    assert len(hidden) == 1 and hidden[0].attrs.hidden == 64


def test_the_main_graph_reads_no_mtp_tensor(mtp_dirs):
    d, _, _ = mtp_dirs("deepseek_v3", True)
    model = ktflow.load(d)
    assert model.has_mtp and model.mtp().fingerprint != model.fingerprint
    keys = {w.key for n in model.graph().nodes for w in n.weights}
    assert not any(k.startswith("model.layers.3.") for k in keys)


def test_full_size_configs_compile_their_mtp_layer():
    """DeepSeek-V3's and GLM-4.5's published configs (no weights): the MTP graph compiles, its one
    MoE layer placed as the main model's are (experts on the CPU of a 24 GB card)."""
    for cfg in ("tests/data/deepseek-v3-config", "tests/data/glm-4.5-config"):
        model = ktflow.load(cfg)
        c = ktflow.compile(model.mtp(), hw="rtx4090-desktop", max_seq_len=32768, allow_oversize=True)
        experts = [n for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS]
        assert experts and all(n.attrs.layer == model.config.num_hidden_layers for n in experts)
        assert "mtp.proj" in c.decode.as_text()


def test_bad_inputs_are_refused_naming_what_is_wrong(mtp_dirs, demo_dir):
    d, _, _ = mtp_dirs("deepseek_v3", True)
    model = ktflow.load(d)
    mtp = ktflow.compile(model.mtp(), hw="cpu", max_seq_len=32, dtype="float32")
    main = ktflow.compile(model, hw="cpu", max_seq_len=32, dtype="float32")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match="hidden="):
        ktflow.execute(mtp, ids)
    with pytest.raises(InputError, match=r"\[1, 3, 64\]"):
        ktflow.execute(mtp, ids, hidden=torch.zeros(1, 2, 64))
    with pytest.raises(InputError, match="reads token ids only"):
        ktflow.execute(main, ids, hidden=torch.zeros(1, 3, 64))
    with pytest.raises(ConfigError, match="no multi-token-prediction layer"):
        ktflow.load(demo_dir).mtp()


@pytest.fixture(scope="module")
def v3_pair(mtp_dirs):
    d, _, _ = mtp_dirs("deepseek_v3", True)
    model = ktflow.load(d)
    main = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32")
    mtp = ktflow.compile(model.mtp(), hw="cpu", max_seq_len=64, dtype="float32")
    return model, main, mtp


def plain_greedy(main, prompt: list[int], n: int) -> list[int]:
    return ktflow.generate(main, torch.tensor([prompt]), n, eos_token_id=None)[0, len(prompt):].tolist()


def test_speculative_greedy_gives_plain_greedys_tokens(v3_pair):
    from ktflow.runtime.speculative import speculative_greedy

    model, main, mtp = v3_pair
    prompt = torch.randint(0, model.config.vocab_size, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    want = plain_greedy(main, prompt, 20)
    got, stats = speculative_greedy(main, mtp, prompt, 20)
    assert got == want and stats.tokens == 20 and stats.steps >= 10


@pytest.mark.parametrize("right,n", [(1.0, 25), (1.0, 24), (0.5, 25), (0.0, 25)])
def test_accepted_and_rejected_drafts_keep_the_tokens_exact(v3_pair, monkeypatch, right, n):
    """Drafts forced right (the greedy answer) or wrong, every time or every other step: the
    tokens are plain greedy's, each accepted draft saves a step, and a rejected one's KV entry is
    dropped (the next steps would differ otherwise)."""
    import ktflow.runtime.speculative as spec

    model, main, mtp = v3_pair
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(8)).tolist()
    want = plain_greedy(main, prompt, n)
    seq = prompt + want
    real = spec.execute
    calls = {"n": 0}

    def forced(compiled, ids, state=None, **kw):
        logits, state = real(compiled, ids, state, **kw)
        if compiled is mtp:  # the draft for the position after the MTP state's end
            calls["n"] += 1
            good = right == 1.0 or (right == 0.5 and calls["n"] % 2 == 0)
            nxt = seq[state.position + 1] if state.position + 1 < len(seq) else 0
            logits = torch.zeros_like(logits)
            logits[0, -1, nxt if good else (nxt + 1) % model.config.vocab_size] = 1.0
        return logits, state

    monkeypatch.setattr(spec, "execute", forced)
    got, stats = spec.speculative_greedy(main, mtp, prompt, n)
    assert got == want and stats.tokens == n
    if right == 1.0 and n == 25:
        assert stats.accepted == stats.steps and stats.steps == 12  # 1 + 12 * 2 tokens
    elif right == 1.0:  # 1 + 11 * 2, then one token of room: the right draft's step yields one
        assert stats.accepted == 11 and stats.steps == 12
    elif right == 0.0:
        assert stats.accepted == 0 and stats.steps == 24
    else:
        assert 0 < stats.accepted < stats.steps


def test_a_draft_of_another_checkpoint_is_refused(v3_pair, demo_dir):
    from ktflow.runtime.speculative import speculative_greedy

    _, main, mtp = v3_pair
    with pytest.raises(InputError, match="multi-token-prediction layer"):
        speculative_greedy(main, main, [1, 2], 4)
    with pytest.raises(InputError, match="max_seq_len"):
        speculative_greedy(main, mtp, [1, 2], 100)


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against p; infinite where a token of probability 0 was drawn."""
    keep = p > 0
    if counts[~keep].sum() > 0:
        return float("inf")
    expected = counts.sum() * p[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum())


def test_the_rejection_rule_draws_from_the_targets_distribution():
    """Drafts drawn from q, kept or redrawn by accept_drafts: the tokens follow p (chi-square on
    fixed logits, 200k draws, at most 7 degrees of freedom, against the 0.9999 quantile of 7: 29.9); the drafts
    taken as they are follow q and fail the same test; the sampler's own distribution (top_p,
    temperature) is what `probabilities` gives."""
    from ktflow.backends.sampling import Sampler, SamplingParams, probabilities
    from ktflow.runtime.speculative import accept_drafts

    g = torch.Generator().manual_seed(11)
    vocab, n = 8, 200_000
    s = Sampler(2, vocab, "cpu")
    s.set_row(0, SamplingParams(temperature=0.8, top_p=0.9))
    s.set_row(1, SamplingParams(temperature=1.3))
    logits = torch.randn(2, vocab, generator=g) * 1.5
    p, q = probabilities(logits, s)  # the target: a truncated distribution; the draft: another
    assert torch.allclose(p.sum(), torch.tensor(1.0)) and (p == 0).any() and (q > 0).all()
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    u, v = torch.rand(n, generator=g), torch.rand(n, generator=g)
    tokens, kept = accept_drafts(p.expand(n, -1), q.expand(n, -1), drafts, u, v)
    assert _chi2(torch.bincount(tokens, minlength=vocab).float(), p) < 29.9
    assert _chi2(torch.bincount(drafts, minlength=vocab).float(), p) > 1000  # the test can fail
    want = torch.minimum(p, q).sum()  # the chance a draft is kept
    assert abs(kept.float().mean() - want) < 0.01
    # the sampler's draws follow `probabilities` too (its own uniform stream)
    counts = torch.zeros(vocab)
    for seed in range(4000):
        one = Sampler(1, vocab, "cpu")
        one.set_row(0, SamplingParams(temperature=0.8, top_p=0.9, seed=seed))
        counts[int(one.select(logits[:1]))] += 1
    assert _chi2(counts, p) < 29.9
    # the ends of the uniforms: v = 0 redraws the first token with mass in max(p - q, 0), never one
    # of probability 0 under p
    p3, q3 = torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.5, 0.0]])
    for v0 in (0.0, 1.0 - 2.0 ** -24):
        tok, kept = accept_drafts(p3, q3, torch.tensor([0]), torch.tensor([0.5]), torch.tensor([v0]))
        assert not kept[0] and tok.item() == 1


def test_a_saved_mtp_plan_loads_with_the_checkpoint_dir(v3_pair, tmp_path):
    from ktflow.runtime.compiled import Compiled

    model, _, mtp = v3_pair
    mtp.save(tmp_path / "mtp.json")
    back = Compiled.load(tmp_path / "mtp.json")  # the plan's own checkpoint dir: its MTP part
    assert back.plans.model.fingerprint == model.mtp().fingerprint
    back = Compiled.load(tmp_path / "mtp.json", model.path)
    ids = torch.tensor([[3, 4]])
    hidden = torch.randn(1, 2, 64)
    assert torch.equal(ktflow.execute(back, ids, hidden=hidden)[0], ktflow.execute(mtp, ids, hidden=hidden)[0])


def test_decode_tokens_refuses_a_model_that_reads_hidden_vectors(v3_pair):
    _, _, mtp = v3_pair
    _, state = ktflow.execute(mtp, torch.tensor([[3, 4]]), hidden=torch.randn(1, 2, 64))
    with pytest.raises(InputError, match="hidden"):
        ktflow.decode_tokens(mtp, torch.tensor([[5]]), state, 2)


def test_sampled_speculation_follows_the_samplers_rules(v3_pair):
    """Greedy after a repetition penalty (one-hot distributions through the rejection rule, the
    counts kept as tokens come) gives plain decoding's tokens under the same penalty; a sampled
    run is reproduced by its seed and stays within the vocabulary."""
    from ktflow.backends.sampling import SamplingParams
    from ktflow.runtime.speculative import speculative_sampled

    model, main, mtp = v3_pair
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(9)).tolist()
    want = ktflow.generate(main, torch.tensor([prompt]), 16, eos_token_id=None,
                           repetition_penalty=1.5)[0, len(prompt):].tolist()
    got, stats = speculative_sampled(main, mtp, prompt, 16, SamplingParams(temperature=0.0, repetition_penalty=1.5))
    assert got == want and stats.tokens == 16
    hot = SamplingParams(temperature=0.9, top_p=0.95, seed=4)
    a, sa = speculative_sampled(main, mtp, prompt, 12, hot)
    b, _ = speculative_sampled(main, mtp, prompt, 12, hot)
    assert a == b and len(a) == 12 and all(0 <= t < model.config.vocab_size for t in a) and sa.steps >= 6


@pytest.mark.parametrize("wrong_at,expect", [(None, [1.0, 1.0, 1.0]), (2, [1.0, 0.0]), (1, [0.0])])
def test_acceptance_rates_count_chained_drafts_by_depth(v3_pair, monkeypatch, wrong_at, expect):
    """acceptance_rates over a greedy continuation: the MTP's chained drafts forced right up to
    depth `wrong_at` (then wrong) give rate 1 at the depths before it, 0 there, and nothing past
    it; positions tried at depth 1: every continuation token the loop can draft; the replayed
    loop's tokens a step: k + 1 where every draft is right (less at the end), 2 where only the
    first is, 1 where none is."""
    import ktflow.runtime.speculative as spec

    model, main, mtp = v3_pair
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    cont = plain_greedy(main, prompt, 10)
    seq = prompt + cont
    real = spec.execute
    at = {"depth": 1}  # the depth of the MTP's next one-token step: 1 for a pair, more along a chain

    def forced(compiled, x, state=None, **kw):
        out, st = real(compiled, x, state, **kw)
        if compiled is mtp and x.shape[1] == 1:
            d = at["depth"]
            good = wrong_at is None or d < wrong_at
            at["depth"] = d + 1 if good and d < 3 else 1  # a right draft short of depth 3 is chained on
            target = st.position + 1  # the token this step drafts
            out = torch.zeros_like(out)
            out[0, -1, ((seq[target] if target < len(seq) else 0) + (0 if good else 1)) % vocab] = 1.0
        return out, st

    monkeypatch.setattr(spec, "execute", forced)
    rates, per_step, tried = spec.acceptance_rates(main, mtp, [prompt], [cont], 3)
    assert tried == len(cont) and rates == expect
    if wrong_at is None:
        assert per_step[0] == 2.0 and 3.0 < per_step[2] <= 4.0
    else:
        assert per_step == [float(wrong_at)] * 3


def test_the_compile_prices_speculation_and_generate_follows_its_choice(v3_pair, tmp_path):
    """speculate='auto': off without an acceptance rate, on where the priced gain passes the margin,
    off where it does not, each with its cause; a plan that speculates keeps the MTP's plans
    (saved and loaded with it), and generate's greedy tokens are plain decoding's."""
    from ktflow.costmodel.speculation import MARGIN, MAX_DRAFTS, tokens_per_step
    from ktflow.runtime.generate import generate_with_stats

    model, main, _ = v3_pair
    opts = dict(hw="cpu", max_seq_len=64, dtype="float32")
    assert main.plans.speculation.k == 0 and "no acceptance rate" in main.plans.speculation.cause
    assert main.draft is None
    high = ktflow.compile(model, mtp_acceptance=0.95, **opts)
    low = ktflow.compile(model, mtp_acceptance=0.05, **opts)
    sp = high.plans.speculation
    # every k priced; the fastest kept, past the margin
    assert sorted(sp.gains) == list(range(MAX_DRAFTS + 1)) and sp.k == max(sp.gains, key=sp.gains.get)
    assert sp.k >= 1 and sp.gains[sp.k] > 1 + MARGIN and high.draft is not None
    for k in range(1, MAX_DRAFTS + 1):  # the gain is the cost model's: tokens a step over the step's time
        assert sp.gains[k] == pytest.approx(tokens_per_step(k, [0.95]) * sp.decode_us / (sp.verify_us[k] + k * sp.draft_us))
    # the verification steps run on a bucket of their own (k + 1 tokens, priced as the choice was)
    verify = high.prefill_plan(sp.k + 1)
    assert verify.step_tokens == sp.k + 1 and verify.predicted_step_us == sp.verify_us[sp.k]
    assert all(p.step_tokens > MAX_DRAFTS + 1 for p in low.prefill)
    assert low.plans.speculation.k == 0 and max(low.plans.speculation.gains.values()) < 1 + MARGIN
    assert low.draft is None
    two = ktflow.compile(model, speculate=2, mtp_acceptance=0.05, **opts).plans.speculation  # forced: priced alone
    assert two.k == 2 and list(two.verify_us) == [2] and "speculate=2 asked for it" in two.cause
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    want = ktflow.generate(main, ids, 16, eos_token_id=None)
    got, stats = generate_with_stats(high, ids, 16, eos_token_id=None)
    assert torch.equal(got, want) and stats.speculative is not None and stats.speculative.steps >= 15 // (sp.k + 1)
    # sampled requests decode plainly: the rejection rule's work is not priced
    assert not sp.sampled and generate_with_stats(high, ids, 8, temperature=0.8, seed=3)[1].speculative is None
    high.save(tmp_path / "plan.json")
    back = ktflow.Compiled.load(tmp_path / "plan.json", model)
    assert back.draft is not None and back.plans.speculation == sp
    assert torch.equal(ktflow.generate(back, ids, 16, eos_token_id=None), want)
    with pytest.raises(ConfigError, match="max_batch"):
        ktflow.compile(model, speculate=1, mtp_acceptance=0.5, max_batch=2, **opts)


def test_profile_measures_the_acceptance_and_compile_prices_speculation_by_it(mtp_dirs, tmp_path):
    """`ktflow profile --mtp` records the MTP draft's acceptance rate and the neighbour co-picks in
    the routing profile; `ktflow compile --routing-profile` prices speculation by them (--explain
    names the source)."""
    import json
    import shutil
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    src, _, _ = mtp_dirs("deepseek_v3", True)
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    g = torch.Generator().manual_seed(2)
    (tmp_path / "p.txt").write_text("\n".join(" ".join(f"w{int(i)}" for i in torch.randint(0, vocab, (12,), generator=g))
                                              for _ in range(3)) + "\n")
    opts = ["--hw", "cpu", "--dtype", "float32", "--max-seq-len", "64"]
    prof = subprocess.run([sys.executable, "-m", "ktflow", "profile", str(d), "--prompts", str(tmp_path / "p.txt"),
                           "-o", str(tmp_path / "r.json"), "--decode", "4", "--mtp", *opts],
                          capture_output=True, text=True, timeout=300)
    assert prof.returncode == 0, prof.stderr
    assert "chained greedy drafts were kept at" in prof.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert all(0.0 <= a <= 1.0 for a in r["mtp_acceptance"]) and set(map(int, r["neighbours"])) == set(map(int, r["layers"]))
    out = subprocess.run([sys.executable, "-m", "ktflow", "compile", str(d), "--routing-profile", str(tmp_path / "r.json"),
                          "--explain", *opts], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rates = "/".join(f"{a:.2f}" for a in r["mtp_acceptance"])
    assert f"acceptance {rates} by depth (the routing profile, tokens a step from its replayed runs)" in out.stdout
    assert len(r["mtp_tokens_per_step"]) == 4 and all(t >= 1.0 for t in r["mtp_tokens_per_step"])


@pytest.mark.parametrize("drafts", [2, 3])
@pytest.mark.parametrize("right", [1.0, 0.5, 0.0])
def test_chained_drafts_keep_the_tokens_exact(v3_pair, monkeypatch, drafts, right):
    """k chained MTP drafts a step (each after the first reading the MTP's own pre-norm hidden
    state): forced right, wrong, or wrong at every fifth position, the tokens are plain greedy's;
    all right, a step yields k + 1 tokens; all wrong, one."""
    import ktflow.runtime.speculative as spec

    model, main, mtp = v3_pair
    n = 21
    prompt = torch.randint(0, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    want = plain_greedy(main, prompt, n)
    seq = prompt + want
    real = spec.execute

    def forced(compiled, ids, state=None, **kw):
        logits, state = real(compiled, ids, state, **kw)
        if compiled is mtp:
            # the draft of token position + 1; "0.5": right except at every fifth position
            good = right == 1.0 or (right == 0.5 and (state.position + 1) % 5 != 0)
            nxt = seq[state.position + 1] if state.position + 1 < len(seq) else 0
            logits = torch.zeros_like(logits)
            logits[0, -1, nxt if good else (nxt + 1) % model.config.vocab_size] = 1.0
        return logits, state

    monkeypatch.setattr(spec, "execute", forced)
    got, stats = spec.speculative_greedy(main, mtp, prompt, n, drafts=drafts)
    assert got == want and stats.tokens == n
    assert stats.accepted + stats.steps == n - 1  # a step yields its kept drafts and one token more
    if right == 1.0:  # the first token from the prompt, then k + 1 a step (the last step what is left)
        assert stats.steps == -(-(n - 1) // (drafts + 1))
    elif right == 0.0:
        assert stats.accepted == 0 and stats.steps == n - 1
    else:  # some steps keep every draft, some stop at a wrong one
        assert 0 < stats.accepted < stats.steps * drafts


def test_chained_drafts_on_the_real_layer_give_plain_greedys_tokens_sampled_too(v3_pair):
    """Unforced, k = 3: greedy tokens are plain greedy's; sampled at temperature 0 with a penalty
    too (the draft sampler's tentative counts undone), and a seed reproduces a sampled run."""
    from ktflow.backends.sampling import SamplingParams
    from ktflow.runtime.speculative import speculative_greedy, speculative_sampled

    model, main, mtp = v3_pair
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(4)).tolist()
    assert speculative_greedy(main, mtp, prompt, 18, drafts=3)[0] == plain_greedy(main, prompt, 18)
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    want = ktflow.generate(main, torch.tensor([prompt]), 18, eos_token_id=None, sampling=pen)[0, 8:].tolist()
    assert speculative_sampled(main, mtp, prompt, 18, pen, drafts=3)[0] == want
    hot = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    a, b = (speculative_sampled(main, mtp, prompt, 18, hot, drafts=2)[0] for _ in range(2))
    assert a == b and len(a) == 18


def test_the_mtp_layer_keeps_its_pre_norm_hidden_state_for_a_chained_step(mtp_dirs):
    """State.keep_hidden on the MTP layer keeps the input of its final norm (shared_head.norm),
    what a chained draft step reads: that norm and the head over it give the step's logits; the
    main model keeps its head's input (its final normalised states)."""
    from ktflow.runtime.state import State

    d, _, mtp_mod = mtp_dirs("deepseek_v3", True)
    model = ktflow.load(d)
    main = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32")
    mtp = ktflow.compile(model.mtp(), hw="cpu", max_seq_len=64, dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    state = State(main.plans.model.fingerprint, 1, 64, keep_hidden=True)
    _, state = ktflow.execute(main, ids, state)
    mstate = State(mtp.plans.model.fingerprint, 1, 64, keep_hidden=True)
    logits, mstate = ktflow.execute(mtp, ids[:, 1:], mstate, logits="all", hidden=state.hidden_out[:, :-1])
    g = mstate.hidden_out.float()
    norm_w = mtp_mod["shared_head.norm"].float()
    normed = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps) * norm_w
    assert_close(logits.float(), normed @ mtp_mod["shared_head.head"].float().T)
    assert not torch.allclose(g.pow(2).mean(-1), torch.ones_like(g[..., 0]), atol=1e-2)  # not a normalised state


def test_speculation_under_a_vram_limit_forced_and_on_non_finite_logits(v3_pair, monkeypatch):
    """With a GPU profile's VRAM plan the MTP layer's plans get what the main plans leave (the
    reserve not held back twice) and fit it; speculate=k without an acceptance rate runs
    unpriced; NaN logits in a speculative run are a NumericError, as in plain decoding."""
    import ktflow.runtime.speculative as spec
    from ktflow.errors import NumericError

    model, main, mtp = v3_pair
    c = ktflow.compile(model, hw="h100", device="cpu", max_seq_len=64, dtype="float32", vram_gb=4, mtp_acceptance=0.95)
    sp, left = c.plans.speculation, c.plans.vram.limit_bytes - max(p.memory.gpu_bytes for p in c.plans.plans)
    assert sp.k >= 1 and c.draft is not None
    assert c.draft.plans.vram.limit_bytes <= left + 1 and all(p.memory.gpu_bytes <= left for p in c.draft.plans.plans)
    forced = ktflow.compile(model, hw="cpu", max_seq_len=64, dtype="float32", speculate=2).plans.speculation
    assert forced.k == 2 and forced.acceptance is None and "not priced" in forced.cause
    real = spec.execute

    def nan(compiled, x, state=None, **kw):
        out, st = real(compiled, x, state, **kw)
        return (out * float("nan") if compiled is main and x.shape[1] > 1 and st.position > 10 else out), st

    monkeypatch.setattr(spec, "execute", nan)
    with pytest.raises(NumericError, match="verification step"):
        spec.speculative_greedy(main, mtp, list(range(1, 9)), 12, drafts=2)


def test_chained_sampled_drafts_keep_the_targets_distribution(monkeypatch):
    """Two chained drafts a step through the rejection rule, the models replaced by fixed tables
    (the target's next-token logits and the draft's depend on the last token only): the three
    tokens of the first verification step, over 4000 runs, follow the target's chain (Pearson
    over the 27 sequences of three tokens, each expected 9 times or more, against the 0.9999
    quantile of 26 degrees of freedom, about 62); the same runs scored against the draft's chain
    fail."""
    from types import SimpleNamespace

    from ktflow.backends.sampling import SamplingParams
    from ktflow.runtime import speculative

    never = -1e4  # token 3 is the prompt's only: no row draws it
    P = torch.tensor([[1.0, 0.0, -0.5, never], [-0.5, 1.0, 0.3, never], [0.2, -0.7, 0.8, never],
                      [1e4, 0.0, 0.0, never]])  # row 3 (the prompt's token): the first token is 0
    Q = torch.tensor([[0.0, 1.0, 0.0, never], [1.0, -1.0, 1.0, never], [-1.0, 0.0, 2.0, never],
                      [0.0, 0.0, 0.0, never]])

    class FakeState:
        def __init__(self, *a, **kw):
            self.position, self.hidden_out = 0, None

    def fake_execute(model, ids, state, logits="all", hidden=None):
        table = P if model.name == "main" else Q
        rows = table[ids[0]]  # each position's next-token logits from its own token
        state.position += ids.shape[1]
        state.hidden_out = torch.zeros(1, ids.shape[1], 1)
        return (rows[-1:] if logits == "last" else rows)[None], state

    monkeypatch.setattr(speculative, "execute", fake_execute)
    monkeypatch.setattr(speculative, "State", FakeState)
    monkeypatch.setattr(speculative, "_require_draft_of", lambda main, mtp: None)
    model = lambda name: SimpleNamespace(name=name, vocab_size=4, max_seq_len=64,  # noqa: E731
                                         plans=SimpleNamespace(model=SimpleNamespace(fingerprint=name)))
    main, mtp = model("main"), model("mtp")
    counts = torch.zeros(27)
    for seed in range(4000):
        stats = speculative.SpeculativeStats()
        out = list(speculative.speculative_tokens(main, mtp, [3], 4, (), SamplingParams(temperature=1.0, seed=seed),
                                                  stats, drafts=2))
        assert out[0] == 0 and len(out) == 4 and max(out) < 3  # the prompt's row makes the first token 0
        counts[9 * out[1] + 3 * out[2] + out[3]] += 1

    def chain(table):  # the probability of each (t2, t3, t4) after t1 = 0
        p = table[:3, :3].softmax(-1)
        return torch.tensor([p[0, a] * p[a, b] * p[b, c] for a in range(3) for b in range(3) for c in range(3)])

    assert _chi2(counts, chain(P)) < 62.0
    assert _chi2(counts, chain(Q)) > 500
