"""Speculative decoding, greedy and sampled, with a checkpoint's multi-token-prediction (MTP) layer:
k draft tokens a step (chained MTP steps), verified by the main model in one step.

The loop keeps one invariant: the main model's state and the MTP's state have both reached
position p, and `pending` is the token at position p (selected, not yet run); the MTP's last
logits give the first draft d1. A step:

1. draft: d1, then for d2..dk the MTP runs again on its own pre-norm hidden state and the draft
   before (positions p, p + 1, ...: entries of its cache the step later overwrites);
2. verify: the main model runs [pending, d1..dk] at positions p..p + k (one prefill step over its
   state), keeping its final hidden states h_p..h_{p+k}; y_i is its token after position p + i;
3. accept the longest run of drafts with d_{i+1} = y_i: the step yields y_0..y_j (j drafts kept,
   y_j the token after them, which is y_k where every draft was kept); the main state goes back to
   position p + j + 1 (the dropped drafts' entries are overwritten later);
4. the MTP goes back to position p and runs the decided pairs (h_{p+i}, y_i), i = 0..j, over its
   state; its last logits give the next d1.

Every yielded token is the main model's argmax given the tokens before it, so the output is plain
greedy decoding's wherever the two-token verification step and a one-token decode step give the
same argmax (float rounding of different step shapes can flip a near tie, as in any speculative
decoder). Runs eagerly (the backends that run a plan as a whole keep no hidden states yet).

Sampled speculation (`speculative_sampled`) keeps the output distribution by the rejection rule
(`accept_drafts`): a draft d drawn from the draft's distribution q is kept with probability
min(1, p(d) / q(d)) under the main model's distribution p, else the token is drawn from
max(p - q, 0) renormalised; either way the token is distributed as p. p and q are the sampler's
own distributions (`backends.sampling.probabilities`: bias, penalties over the tokens so far,
temperature, top-k / top-p / min-p), so the tokens follow plain sampling's distribution; they are
not plain sampling's tokens for a seed (the draws are made in another order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..backends.sampling import Sampler, SamplingParams, probabilities
from ..errors import InputError, NumericError
from ..frontend.load import part_fingerprint
from .execute import execute
from .state import State


@dataclass
class SpeculativeStats:
    """What a speculative run did: verification steps, drafts accepted, tokens yielded."""

    steps: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification step yielded (the first token is the prompt step's)."""
        return (self.tokens - 1) / self.steps if self.steps else 0.0


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule, per row: p, q [rows, vocab] the target's and the draft's distributions
    (`backends.sampling.probabilities`), `drafts` [rows] tokens drawn from q, u and v [rows]
    uniforms in [0, 1). Returns (the tokens, which drafts were kept): a draft is kept when
    u * q(d) < p(d); else the token is where the mass of max(p - q, 0) passes v of its total (p
    itself in the measure-zero case that p and q are equal there)."""
    pd = p.gather(1, drafts[:, None]).squeeze(1)
    qd = q.gather(1, drafts[:, None]).squeeze(1)
    kept = u * qd < pd
    rest = (p - q).clamp(min=0)
    total = rest.sum(-1, keepdim=True)
    rest = torch.where(total > 0, rest, p)
    cdf = rest.cumsum(-1)
    target = torch.minimum(v[:, None] * cdf[:, -1:], cdf[:, -1:] * (1 - 2.0 ** -20))
    at = (cdf <= target).sum(-1).clamp(max=p.shape[1] - 1)  # the first token whose mass passes the target
    return torch.where(kept, drafts, at), kept


@torch.inference_mode()
def speculative_greedy(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids=(), drafts: int = 1
                       ) -> tuple[list[int], SpeculativeStats]:
    """Up to `max_new_tokens` greedy tokens after `prompt` (ids), drafting with `mtp` (the compiled
    `Model.mtp()` of the same checkpoint) and verifying with `main` (its compiled main model);
    ends after the first token in `eos_ids`; `drafts` chained MTP drafts a step. Returns the tokens
    and the run's stats."""
    return _speculate(main, mtp, prompt, max_new_tokens, eos_ids, None, drafts)


@torch.inference_mode()
def speculative_sampled(main, mtp, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                        eos_ids=(), drafts: int = 1) -> tuple[list[int], SpeculativeStats]:
    """As `speculative_greedy`, the tokens selected by `params` (a seed reproduces the run): each
    draft drawn from the MTP's distribution under `params`, kept or redrawn by `accept_drafts`
    against the main model's, so the tokens follow plain sampling's distribution."""
    return _speculate(main, mtp, prompt, max_new_tokens, eos_ids, params, drafts)


def _require_draft_of(main, mtp) -> None:
    """An InputError unless `mtp` is the compiled multi-token-prediction layer of `main`'s checkpoint."""
    if mtp.plans.model.fingerprint != part_fingerprint(main.plans.model.fingerprint, "mtp"):
        raise InputError("the draft is not this model's multi-token-prediction layer: compile model.mtp() of the "
                         "same checkpoint")


def _finite(logits: torch.Tensor, what: str) -> None:
    """A NumericError naming `what` where `logits` hold a NaN or an infinity (no token can be
    selected from them), as plain decoding's selection raises."""
    if not bool(torch.isfinite(logits).all()):
        raise NumericError(f"{what}: the logits hold a NaN or an infinity, so no token can be selected (the model's "
                           "values overflowed, or its weights hold non-finite values)", rows=(0,))


class _Draws:
    """The sampled side of a run: the target's and the draft's samplers (one row each, the same
    parameters, both counting the tokens so far for penalties) and the run's uniforms."""

    def __init__(self, vocab: int, params: SamplingParams, prompt: list[int]):
        self.target, self.draft = Sampler(1, vocab, "cpu"), Sampler(1, vocab, "cpu")
        for smp in (self.target, self.draft):
            smp.set_row(0, params, prompt)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()).item())
        self.g = torch.Generator().manual_seed(seed % (1 << 63))

    def p(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits.reshape(1, -1).float().cpu(), self.target)

    def q(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits.reshape(1, -1).float().cpu(), self.draft)

    def draw(self, dist: torch.Tensor) -> int:
        return int(torch.multinomial(dist, 1, generator=self.g))

    def uniforms(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(1, generator=self.g), torch.rand(1, generator=self.g)

    def took(self, token: int) -> None:
        for smp in (self.target, self.draft):
            smp.counts[0, token] += 1


def _speculate(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids, params: SamplingParams | None,
               drafts: int) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    out = list(speculative_tokens(main, mtp, prompt, max_new_tokens, eos_ids, params, stats, drafts))
    return out, stats


def speculative_tokens(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids, params: SamplingParams | None,
                       stats: SpeculativeStats, drafts: int = 1) -> Iterator[int]:
    """The loop of the module docstring with `drafts` chained MTP drafts a step, each token
    yielded as it is known (greedy where `params` is None or plain greedy, else sampled); `stats`
    counts the run. Ends after the first token in `eos_ids` or the `max_new_tokens`-th."""
    _require_draft_of(main, mtp)
    if not prompt or max_new_tokens < 1 or drafts < 1:
        raise InputError("speculative decoding needs a prompt of at least one token, max_new_tokens >= 1 and "
                         "drafts >= 1")
    if len(prompt) + max_new_tokens + drafts > min(main.max_seq_len, mtp.max_seq_len):
        raise InputError(f"{len(prompt)} prompt tokens and {max_new_tokens} new ones (and {drafts} draft(s)) pass "
                         f"max_seq_len {min(main.max_seq_len, mtp.max_seq_len)}; compile both with a larger max_seq_len")
    eos = frozenset(eos_ids)
    draws = None if params is None or params.plain_greedy else _Draws(main.vocab_size, params, prompt)

    def select(logits: torch.Tensor) -> int:  # the main model's token at a position
        _finite(logits, "the main model's step")
        if draws is None:
            return int(logits.argmax())
        token = draws.draw(draws.p(logits))
        draws.took(token)
        return token

    def propose(logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:  # a draft and its distribution
        _finite(logits, "the MTP layer's draft step")
        if draws is None:
            return int(logits.argmax()), None
        q = draws.q(logits)
        return draws.draw(q), q

    state = State(main.plans.model.fingerprint, 1, main.max_seq_len, keep_hidden=True)
    logits, state = execute(main, torch.tensor([prompt]), state, logits="last")
    pending = select(logits[0, -1])
    # the MTP over the prompt: position i pairs h_i with token i + 1 (the last with `pending`); part
    # of the prompt's work, so the first token is yielded after it
    mstate = State(mtp.plans.model.fingerprint, 1, mtp.max_seq_len, keep_hidden=True)
    mlogits, mstate = execute(mtp, torch.tensor([prompt[1:] + [pending]]), mstate, logits="last",
                              hidden=state.hidden_out)
    yield pending
    made = stats.tokens = 1
    while made < max_new_tokens and pending not in eos:
        p = state.position  # the MTP's state is there too
        k = min(drafts, max_new_tokens - made - 1)  # a step yields up to k + 1 tokens
        # draft: k chained MTP steps, each after the first reading the MTP's own hidden state and
        # its draft (the draft sampler counts the drafts before it, for penalties, until verified)
        ds, qs = [], []
        for i in range(k):
            d, q = propose(mlogits[0, -1])
            ds.append(d)
            qs.append(q)
            if draws is not None:
                draws.draft.counts[0, d] += 1
            if i + 1 < k:
                mlogits, mstate = execute(mtp, torch.tensor([[d]]), mstate, logits="last",
                                          hidden=mstate.hidden_out[:, -1:])
        if draws is not None:
            for d in ds:
                draws.draft.counts[0, d] -= 1
        # verify: the main model over [pending, drafts], each draft kept while the rule keeps it
        logits, state = execute(main, torch.tensor([[pending, *ds]]), state, logits="all")
        h = state.hidden_out
        stats.steps += 1
        new: list[int] = []
        for i in range(k + 1):
            if i == k:  # every draft kept: the token after them
                new.append(select(logits[0, k]))
                break
            _finite(logits[0, i], "the main model's verification step")
            if draws is None:
                y = int(logits[0, i].argmax())
                kept = y == ds[i]
            else:
                u, v = draws.uniforms()
                tok, kept_t = accept_drafts(draws.p(logits[0, i]), qs[i], torch.tensor([ds[i]]), u, v)
                y, kept = int(tok), bool(kept_t)
                draws.took(y)
            new.append(y)
            if not kept or y in eos:
                break
            stats.accepted += 1
        j = len(new)
        state.position = p + j  # pending and the kept drafts hold entries; the rest are dropped
        for t in new:
            yield t
        made = stats.tokens = made + j
        pending = new[-1]
        if made >= max_new_tokens or pending in eos:
            break
        # the MTP over the positions now decided: (h_{p+i}, token p + 1 + i), over its chain's entries
        mstate.position = p
        mlogits, mstate = execute(mtp, torch.tensor([new]), mstate, logits="last", hidden=h[:, :j])


@torch.inference_mode()
def acceptance_rates(main, mtp, prompts: list[list[int]], continuations: list[list[int]], depth: int
                     ) -> tuple[list[float], list[float], int]:
    """(by depth d = 1..depth: of the positions whose first d - 1 chained greedy drafts were right,
    the share whose d-th was too; for k = 1..depth the tokens a greedy speculative run of k drafts
    a step yields a step on these continuations; the positions tried at depth 1), over each
    prompt's greedy continuation (the model's own greedy tokens, which a draft is right to equal:
    what a greedy speculative run accepts). At each position the MTP drafts as the speculative loop
    does: the pair (h_i, token i + 1), then `depth` - 1 steps on its own pre-norm hidden state,
    whose entries the next position's pair overwrites. The tokens a step replay the loop's steps
    over each position's run of right drafts: steps start right after the last one's tokens, where
    rejections cluster, which the rates' product misses. Depths no position reached are left out."""
    _require_draft_of(main, mtp)
    tried, right = [0] * depth, [0] * depth
    yielded, steps = [0] * depth, [0] * depth  # per k: the replayed loop's tokens and steps
    for prompt, cont in zip(prompts, continuations):
        seq = (prompt + cont)[:min(main.max_seq_len, mtp.max_seq_len)]
        n, first = len(seq), max(len(prompt) - 2, 0)  # pair i drafts token i + 2: from the continuation's first
        if not cont or n < 3:
            continue
        state = State(main.plans.model.fingerprint, 1, main.max_seq_len, keep_hidden=True)
        _, state = execute(main, torch.tensor([seq]), state, logits="last")
        h = state.hidden_out
        mstate = State(mtp.plans.model.fingerprint, 1, mtp.max_seq_len, keep_hidden=True)
        if first:
            _, mstate = execute(mtp, torch.tensor([seq[1:first + 1]]), mstate, logits="last", hidden=h[:, :first])
        run = {}  # pair i -> how many of its chained drafts were right in a row
        for i in range(first, n - 2):
            logits, mstate = execute(mtp, torch.tensor([[seq[i + 1]]]), mstate, logits="last", hidden=h[:, i:i + 1])
            after = mstate.position
            run[i] = 0
            for m in range(depth):
                if i + 2 + m >= n:
                    break
                tried[m] += 1
                d = int(logits[0, -1].argmax())
                if d != seq[i + 2 + m]:
                    break
                right[m] += 1
                run[i] += 1
                if m + 1 < depth:
                    logits, mstate = execute(mtp, torch.tensor([[d]]), mstate, logits="last",
                                             hidden=mstate.hidden_out[:, -1:])
            mstate.position = after  # the chain's entries: the next pair overwrites them
        for k in range(1, depth + 1):  # the loop: its first step drafts from the pair of the first new token
            i = len(prompt) - 1
            while i in run:
                kept = min(run[i], k)
                yielded[k - 1] += kept + 1
                steps[k - 1] += 1
                i += kept + 1
    if not tried[0]:
        raise InputError("measuring the MTP's acceptance needs prompts with a greedy continuation (decode >= 1)")
    return ([r / t for r, t in zip(right, tried) if t], [y / s for y, s in zip(yielded, steps) if s], tried[0])
