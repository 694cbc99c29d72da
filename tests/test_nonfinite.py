"""Non-finite logits are never silent: every token selection checks the logits it selects from
(inside the captured decode step on a GPU: -1 in the ids, one read with them) and a row whose
logits hold a NaN or an infinity is a NumericError naming the step; in the server only that row's
request fails."""

import contextlib

import pytest
import torch

import ktflow
from ktflow.backends.sampling import Sampler, SamplingParams, mark_nonfinite
from ktflow.errors import NumericError, require_finite
from ktflow.ir.ops import Op
from ktflow.runtime.slots import SlotPool
from ktflow.serve.runner import PoolRunner
from test_cuda_graph import gpu

NAN = float("nan")


@pytest.fixture(autouse=True)
def _no_node_checks(monkeypatch):
    """The suite checks every node's values (conftest); here the selection's own check is tested."""
    monkeypatch.delenv("KTFLOW_CHECK_FINITE", raising=False)


@contextlib.contextmanager
def poisoned(compiled, device: str = "cpu"):
    """Add `poison[row]` to each row of every lm_head output the compiled model's backends make
    (0: as it was; NaN or inf: that row's logits are not finite). Yields `poison` [64]."""
    poison = torch.zeros(64, device=device)
    bes = {id(ex.backend): ex.backend for ex in (compiled.executor(compiled.decode),
                                                  compiled.executor(compiled.prefill_plan(1)))}
    real = {k: be.run for k, be in bes.items()}
    for k, be in bes.items():
        def run(node, inputs, ctx, _real=real[k]):
            out = _real(node, inputs, ctx)
            return out + poison[:out.shape[0], None].to(out.dtype) if node.op == Op.LM_HEAD else out
        be.run = run
    try:
        yield poison
    finally:
        for k, be in bes.items():
            del be.run


def test_a_row_with_nan_or_inf_logits_selects_no_token():
    logits = torch.randn(4, 50)
    logits[1, 7], logits[3, 0] = NAN, float("inf")
    ids = mark_nonfinite(logits, logits.argmax(-1))
    assert ids.tolist()[0] >= 0 and ids[1] == -1 and ids[2] >= 0 and ids[3] == -1
    s = Sampler(4, 50, "cpu")
    for r in range(4):
        s.set_row(r, SamplingParams(temperature=0.8, seed=r))
    got = s.select(logits)
    assert got[1] == -1 and got[3] == -1 and got[0] >= 0 and got[2] >= 0
    assert s.counts[1].sum() == 0 and s.counts[0].sum() == 1  # a refused row counts no token as generated
    with pytest.raises(NumericError, match=r"the decode step: the logits of row\(s\) \[1, 3\] hold a NaN") as e:
        require_finite(got, "the decode step")
    assert e.value.rows == (1, 3) and e.value.ids is got


@pytest.mark.parametrize("backend", ["torch_ref", "native"])
def test_generate_stops_with_an_error_naming_the_step(demo_dir, backend):
    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", device="cpu", max_seq_len=64, backend=backend)
    prompt = torch.tensor([[1, 5, 9, 33]])
    with poisoned(c) as poison:
        poison[0] = NAN
        with pytest.raises(NumericError, match=r"the prompt's last position: the logits of row\(s\) \[0\]"):
            ktflow.generate(c, prompt, 4)
        with pytest.raises(NumericError, match=r"the decode step: the logits of row\(s\) \[0\]"):
            _decode_then_poison(c, prompt, poison)
        poison[0] = 0.0
        assert ktflow.generate(c, prompt, 4).shape == (1, 8)


def _decode_then_poison(c, prompt, poison):
    """Prefill and one decode step clean, then a poisoned decode step."""
    from ktflow.runtime.execute import execute

    poison[0] = 0.0
    ids, state = execute(c, prompt, logits="argmax")
    ids, state = execute(c, ids, state, logits="argmax")
    poison[0] = float("inf")
    execute(c, ids, state, logits="argmax")


@torch.inference_mode()
def test_in_the_server_only_the_rows_with_bad_logits_fail(demo_dir):
    """A prefill ending two prompts and a decode step over two slots: the slot whose logits are
    not finite gets a NumericError, the other its token, the same as without the bad row; the
    bad prompt's entries are no longer reusable."""
    c = ktflow.compile(ktflow.load(demo_dir), hw="cpu", device="cpu", max_seq_len=64, max_batch=2)
    a, b = [1, 5, 9, 33, 7], [2, 4, 6]
    want = PoolRunner(c, 2)
    for s, p in ((0, a), (1, b)):
        want.start(s, SamplingParams(), p)
    first = want.prefill([(0, a, True), (1, b, True)])
    after = want.decode([0, 1], first)
    runner = PoolRunner(c, 2)
    with poisoned(c) as poison:
        for s, p in ((0, a), (1, b)):
            runner.start(s, SamplingParams(), p)
        poison[1] = NAN
        got = runner.prefill([(0, a, True), (1, b, True)])
        assert got[0] == first[0] and isinstance(got[1], NumericError) and "slot(s) [1]" in str(got[1])
        assert runner.cached(1, b + [3]) == 0 and runner.cached(0, a + [3]) == len(a)
        runner.start(1, SamplingParams(), b)
        poison[1] = 0.0
        assert runner.prefill([(1, b, True)]) == [first[1]]
        poison[0] = float("-inf")
        out = runner.decode([0, 1], first)
        assert isinstance(out[0], NumericError) and "slot(s) [0]" in str(out[0]) and out[1] == after[1]


def test_the_cli_run_exits_1_in_one_line(demo_dir, capsys, monkeypatch):
    from ktflow.backends.native.backend import NativeBackend
    from ktflow.tools import cli

    real = NativeBackend.run

    def run(self, node, inputs, ctx):
        out = real(self, node, inputs, ctx)
        return out * NAN if node.op == Op.LM_HEAD else out

    monkeypatch.setattr(NativeBackend, "run", run)
    capsys.readouterr()
    code = cli.main(["run", str(demo_dir), "--hw", "cpu", "--input-ids", "1 2 3", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1 and "hold a NaN or an infinity" in err, err


@gpu
@torch.inference_mode()
def test_the_captured_decode_step_refuses_a_row_with_bad_logits(demo_dir):
    """Greedy and sampled steps and a run of four steps a launch, replayed from their graphs:
    a poisoned row is refused with the step named, the next clean step of the same graph works."""
    from ktflow.runtime.execute import decode_tokens, execute, start_sampling

    c = ktflow.compile(ktflow.load(demo_dir), device="cuda", backend="cuda_graph", max_seq_len=128, max_batch=2)
    prompt = torch.tensor([[1, 5, 9, 33], [2, 4, 6, 8]])
    with poisoned(c, "cuda") as poison:
        ids, state = execute(c, prompt, logits="argmax")
        for _ in range(3):  # eager, captured, replayed
            ids, state = execute(c, ids, state, logits="argmax")
        poison[1] = NAN
        with pytest.raises(NumericError, match=r"the decode step: the logits of row\(s\) \[1\]") as e:
            execute(c, ids, state, logits="argmax")
        assert e.value.ids[0, 0] >= 0 and e.value.ids[1, 0] == -1
        poison[1] = 0.0
        ids, state = execute(c, ids.clamp(min=0), state, logits="argmax")
        start_sampling(c, state, SamplingParams(temperature=0.7, top_p=0.95, seed=3))
        for _ in range(3):
            ids, state = execute(c, ids, state, logits="sample")
        poison[0] = float("inf")
        with pytest.raises(NumericError, match=r"row\(s\) \[0\]"):
            execute(c, ids, state, logits="sample")
        poison[0] = 0.0
        for _ in range(2):  # a run of four steps a launch: eager, then captured
            ids = decode_tokens(c, ids.clamp(min=0), state, 4)[:, -1:]
        poison[1] = NAN
        with pytest.raises(NumericError, match=r"a run of 4 decode steps: the logits of row\(s\) \[1\]"):
            decode_tokens(c, ids, state, 4)
