"""Speculative decoding, greedy and sampled, with a checkpoint's multi-token-prediction (MTP) layer:
one draft token a step, verified by the main model.

The loop keeps one invariant: the main model's state and the MTP's state have both reached
position p, and `pending` is the token at position p (selected, not yet run). A step:

1. verify: the main model runs [pending, draft] at positions p, p + 1 (a two-token prefill step
   over its state) and selects y0 (the token at p + 1) and y1 (the token at p + 2 were the draft
   right), keeping its final hidden states h_p, h_{p+1};
2. accept the draft where it equals y0: the step yields y0 and y1; else it yields y0 alone and the
   main state goes back to position p + 1 (the draft's KV entry is overwritten later);
3. draft: the MTP runs (h_p, y0), and on acceptance (h_{p+1}, y1), over its state; its last
   position's argmax is the next draft.

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
from ..errors import InputError
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
def speculative_greedy(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids=()) -> tuple[list[int], SpeculativeStats]:
    """Up to `max_new_tokens` greedy tokens after `prompt` (ids), drafting with `mtp` (the compiled
    `Model.mtp()` of the same checkpoint) and verifying with `main` (its compiled main model);
    ends after the first token in `eos_ids`. Returns the tokens and the run's stats."""
    return _speculate(main, mtp, prompt, max_new_tokens, eos_ids, None)


@torch.inference_mode()
def speculative_sampled(main, mtp, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                        eos_ids=()) -> tuple[list[int], SpeculativeStats]:
    """As `speculative_greedy`, the tokens selected by `params` (a seed reproduces the run): each
    draft drawn from the MTP's distribution under `params`, kept or redrawn by `accept_drafts`
    against the main model's, so the tokens follow plain sampling's distribution."""
    return _speculate(main, mtp, prompt, max_new_tokens, eos_ids, params)


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


def _speculate(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids, params: SamplingParams | None
               ) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    out = list(speculative_tokens(main, mtp, prompt, max_new_tokens, eos_ids, params, stats))
    return out, stats


def speculative_tokens(main, mtp, prompt: list[int], max_new_tokens: int, eos_ids, params: SamplingParams | None,
                       stats: SpeculativeStats) -> Iterator[int]:
    """The loop of the module docstring, each token yielded as it is known (greedy where `params`
    is None or plain greedy, else sampled); `stats` counts the run. Ends after the first token in
    `eos_ids` or the `max_new_tokens`-th."""
    if mtp.plans.model.fingerprint != part_fingerprint(main.plans.model.fingerprint, "mtp"):
        raise InputError("the draft is not this model's multi-token-prediction layer: compile model.mtp() of the "
                         "same checkpoint")
    if not prompt or max_new_tokens < 1:
        raise InputError("speculative decoding needs a prompt of at least one token and max_new_tokens >= 1")
    if len(prompt) + max_new_tokens + 1 > min(main.max_seq_len, mtp.max_seq_len):
        raise InputError(f"{len(prompt)} prompt tokens and {max_new_tokens} new ones (and one draft) pass max_seq_len "
                         f"{min(main.max_seq_len, mtp.max_seq_len)}; compile both with a larger max_seq_len")
    eos = frozenset(eos_ids)
    draws = None if params is None or params.plain_greedy else _Draws(main.vocab_size, params, prompt)

    def select(logits: torch.Tensor) -> int:  # the main model's token at a position
        if draws is None:
            return int(logits.argmax())
        token = draws.draw(draws.p(logits))
        draws.took(token)
        return token

    def propose(logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:  # a draft and its distribution
        if draws is None:
            return int(logits.argmax()), None
        q = draws.q(logits)
        return draws.draw(q), q

    ids = torch.tensor([prompt])
    state = State(main.plans.model.fingerprint, 1, main.max_seq_len, keep_hidden=True)
    logits, state = execute(main, ids, state, logits="last")
    pending = select(logits[0, -1])
    yield pending
    made = stats.tokens = 1
    # the MTP over the prompt: position i pairs h_i with token i + 1 (the last with `pending`)
    mids = torch.tensor([prompt[1:] + [pending]])
    mlogits, mstate = execute(mtp, mids, None, logits="last", hidden=state.hidden_out)
    draft, q = propose(mlogits[0, -1])
    while made < max_new_tokens and pending not in eos:
        p = state.position
        logits, state = execute(main, torch.tensor([[pending, draft]]), state, logits="all")
        h = state.hidden_out
        stats.steps += 1
        if draws is None:
            y0 = int(logits[0, 0].argmax())
            kept = y0 == draft
        else:
            u, v = draws.uniforms()
            tok, kept_t = accept_drafts(draws.p(logits[0, 0]), q, torch.tensor([draft]), u, v)
            y0, kept = int(tok), bool(kept_t)
            draws.took(y0)
        if kept and y0 not in eos and made + 1 < max_new_tokens:
            stats.accepted += 1
            new, pairs = [y0, select(logits[0, 1])], h
        else:
            state.position = p + 1  # the draft's entry is dropped
            new, pairs = [y0], h[:, :1]
        for t in new:
            yield t
        made = stats.tokens = made + len(new)
        pending = new[-1]
        if made >= max_new_tokens or pending in eos:
            break
        mlogits, mstate = execute(mtp, torch.tensor([new]), mstate, logits="last", hidden=pairs)
        draft, q = propose(mlogits[0, -1])
    # (a step takes its second token only with room left and its first not an eos: nothing to cut)


@torch.inference_mode()
def acceptance_rate(main, mtp, prompts: list[list[int]]) -> tuple[float, int]:
    """(how often the MTP's greedy draft equals the main model's greedy token, the positions
    counted), teacher-forced over `prompts` (token ids): at each position i + 2 of a prompt, the
    draft made from (h_i, token i + 1) against the main model's argmax after token i + 1. What
    speculation's cost model prices greedy decoding with (`ktflow profile --mtp` records it); on
    a model's own output the rate may differ from the text's."""
    if mtp.plans.model.fingerprint != part_fingerprint(main.plans.model.fingerprint, "mtp"):
        raise InputError("the draft is not this model's multi-token-prediction layer: compile model.mtp() of the "
                         "same checkpoint")
    hits = total = 0
    for ids in prompts:
        ids = ids[:min(main.max_seq_len, mtp.max_seq_len)]
        if len(ids) < 3:
            continue
        state = State(main.plans.model.fingerprint, 1, main.max_seq_len, keep_hidden=True)
        logits, state = execute(main, torch.tensor([ids]), state, logits="all")
        main_next = logits[0].argmax(-1)  # [n]: position i's greedy next token (that of i + 1)
        mlogits, _ = execute(mtp, torch.tensor([ids[1:]]), None, logits="all", hidden=state.hidden_out[:, :-1])
        drafts = mlogits[0].argmax(-1)  # [n - 1]: from (h_i, token i + 1), the token at i + 2
        hits += int((drafts[:-1] == main_next[1:-1]).sum())
        total += len(ids) - 2
    if not total:
        raise InputError("measuring the MTP's acceptance needs a prompt of at least 3 tokens")
    return hits / total, total
