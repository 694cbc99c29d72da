"""How the serving engine runs the model: the `Runner` interface and the runner over a `SlotPool`.

The scheduler (`engine.py`) speaks to the model only through a Runner, in slot numbers and ids:
- `cached(slot, prompt_ids)`: how many of the prompt's first tokens `slot`'s KV cache holds from
  its earlier sequences' prefills (0 with prefix reuse off);
- `start(slot, params, prompt_ids, reuse)`: a new sequence in `slot`, selecting its tokens by
  `params` (a backends.sampling.SamplingParams; a bad one raises InputError naming it), after the
  prompt's first `reuse` tokens (at most `cached`): the scheduler prefills only the rest;
- `prefill(items)`: per (slot, ids, last), the next chunk of that prompt; returns per item the
  first generated token (an int) where `last` is set, else None, or the exception that failed it;
- `decode(slots, ids)`: one token per listed slot, each at its own position, selected where the
  logits are; returns per slot its token (an int) or the exception that failed it;
- `free(slot)`: the sequence in `slot` is finished.
A token of a sequence whose params ask for `logprobs` is a `Chosen` (an int carrying its
log-probability and the most likely alternatives').
`PoolRunner` runs a decode as ONE batched step (a failure fails every slot in it) and an
iteration's chunks as ONE packed prefill step, run again chunk by chunk if it fails, so only the
chunks that fail alone fail. A slot that follows a grammar (`grammars`: structured output,
serve/grammar.py) has the tokens it allows next written into the pool's sampler before each step,
which masks the others where it selects (inside the step, on the device); its matcher takes each
token selected. A decode step with a slot that asks for logprobs brings the logits to the host and
selects there (by the same rule, mask and random streams as the device would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..backends.sampling import SamplingParams
from ..errors import InputError, NumericError
from ..runtime.slots import SlotPool


@dataclass(frozen=True)
class TokenLogprob:
    """A selected token's log-probability under the model's logits (softmax at temperature 1,
    before any penalty, bias or truncation), and the `k` most likely tokens' as (id, logprob)."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Chosen(int):
    """A selected token id that carries its `TokenLogprob` (`.logprob`)."""

    logprob: TokenLogprob

    @staticmethod
    def of(logits: torch.Tensor, token: int, k: int) -> "Chosen":
        """Token `token` selected from host `logits` [vocab], with the `k` most likely beside it."""
        lp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(lp, k) if k else None
        out = Chosen(token)
        out.logprob = TokenLogprob(int(token), float(lp[token]), tuple(
            (int(i), float(v)) for v, i in zip(top.values, top.indices)) if top is not None else ())
        return out


class Runner(Protocol):
    """What the scheduler needs from the model (see the module docstring)."""

    slots: int
    max_seq_len: int
    vocab_size: int

    def cached(self, slot: int, prompt_ids: list[int]) -> int: ...

    def held(self, slot: int) -> int: ...

    def start(self, slot: int, params: SamplingParams = SamplingParams(), prompt_ids: list[int] | None = None,
              reuse: int = 0, source: int | None = None) -> None: ...

    def prefill(self, items: list[tuple[int, list[int], bool]]) -> list[int | None | BaseException]: ...

    def decode(self, slots: list[int], ids: list[int]) -> list[int | BaseException]: ...

    def free(self, slot: int) -> None: ...


class PoolRunner:
    """A Runner over a `SlotPool` of `slots` sequences (see the module docstring); with
    `prefix_cache`, a sequence reuses the KV entries its slot holds for its prompt's first tokens."""

    def __init__(self, compiled, slots: int, prefix_cache: bool = True, grammars=None):
        self.pool = SlotPool(compiled, slots)
        self.slots, self.prefix_cache = slots, prefix_cache
        self.grammars = grammars  # serve/grammar.Grammars: a sequence whose params name a grammar follows it
        self.matchers: dict = {}  # slot -> its sequence's grammar Matcher
        self.max_seq_len = compiled.max_seq_len
        self.vocab_size = compiled.vocab_size

    def warm(self) -> None:
        """Run a prompt chunk and a decode step of every batch bucket (greedy, sampled, and greedy
        with a grammar: the selections a captured step is made for, backends.sampling's
        CAPTURED_STAGES), so the caches, the plans' first-use work and (on cuda_graph) each
        bucket's captured graphs are made before the first request rather than during it."""
        for slot in range(self.slots):
            self.start(slot)
        self.prefill([(slot, [0], False) for slot in range(self.slots)])
        for b in self.pool.buckets:
            self.pool.decode(list(range(b)), [0] * b, logits="argmax")
            self.pool.decode(list(range(b)), [0] * b, logits="sample")
        for slot in range(self.slots):  # a grammar allowing every token (its rows' mask: all set)
            self.pool.sampler.set_row(slot, SamplingParams(grammar="(warm-up)"))
        for b in self.pool.buckets:
            self.pool.decode(list(range(b)), [0] * b, logits="sample")
        for slot in range(self.slots):
            self.start(slot)

    def cached(self, slot: int, prompt_ids: list[int]) -> int:
        return self.pool.cached(slot, prompt_ids) if self.prefix_cache else 0

    def held(self, slot: int) -> int:
        """How many reusable entries `slot` holds (0 without prefix caching)."""
        return self.pool.prefilled(slot) if self.prefix_cache else 0

    def start(self, slot: int, params: SamplingParams = SamplingParams(), prompt_ids: list[int] | None = None,
              reuse: int = 0, source: int | None = None) -> None:
        self.matchers.pop(slot, None)
        matcher = None
        if params.grammar is not None and self.grammars is not None:  # (without: a follower rank's, ids dropped)
            try:
                matcher = self.grammars.matcher(params.grammar)
            except ValueError as e:
                raise InputError(str(e)) from None
        self.pool.start(slot, params, prompt_ids, reuse, source)
        if matcher is not None:
            self.matchers[slot] = matcher
            self.pool.sampler.set_allowed(slot, matcher.bitmask())

    def prefill(self, items: list[tuple[int, list[int], bool]]) -> list[int | None | BaseException]:
        try:
            return self._prefill_step(items)
        except Exception as e:  # noqa: BLE001 - again one at a time: only the chunks that fail alone fail
            if len(items) == 1:
                return [e]
        out: list[int | None | BaseException] = []
        for item in items:  # rewriting a chunk's cache entries at the same positions is harmless
            try:
                out += self._prefill_step([item])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out

    def _prefill_step(self, items: list[tuple[int, list[int], bool]]) -> list[int | None]:
        """The chunks of `items` in one packed prefill step (positions advance only if it ran),
        and the first token of each sequence whose prompt it ends."""
        want = any(last for _, _, last in items)
        out = self.pool.prefill_many([s for s, _, _ in items], [ids for _, ids, _ in items],
                                     logits="last" if want else "none")
        ending = [i for i, (_, _, last) in enumerate(items) if last]
        if not ending:
            return [None] * len(items)
        slots = [items[i][0] for i in ending]
        picked = self._select(slots, out[ending])
        first = dict(zip(ending, picked))
        return [first.get(i) for i in range(len(items))]

    def _select(self, slots: list[int], logits: torch.Tensor) -> list:
        """Each slot's token from host logits [len(slots), vocab] (its grammar's mask applied by
        the sampler), a `Chosen` where its params ask for logprobs (of the logits as the model
        made them); or the error of a slot whose logits are not finite (NumericError) or whose
        grammar failed (InputError)."""
        try:
            ids: list = self.pool.select_tokens(slots, logits)
        except NumericError as e:  # those sequences fail, the others have their token
            ids = [e if s in e.rows else t for s, t in zip(slots, e.ids)]
        ids = self._follow(slots, ids)
        params = self.pool.sampler.params
        return [Chosen.of(logits[i], t, params[s].logprobs)
                if params[s].logprobs is not None and not isinstance(t, BaseException) else t
                for i, (s, t) in enumerate(zip(slots, ids))]

    def _follow(self, slots: list[int], ids: list) -> list:
        """`ids` with each grammar-following slot's token taken by its matcher, and the tokens it
        allows next written into the sampler; an InputError in place of a token the grammar
        refused."""
        ids = list(ids)
        for i, (s, t) in enumerate(zip(slots, ids)):
            m = self.matchers.get(s)
            if m is None or isinstance(t, BaseException):
                continue
            try:
                m.advance(t)
            except ValueError as e:
                ids[i] = InputError(str(e))
                continue
            self.pool.sampler.set_allowed(s, m.bitmask())  # (once the value is complete: an eos only)
        return ids

    def decode(self, slots: list[int], ids: list[int]) -> list[int | BaseException]:
        # every listed sequence greedy on the logits as they are: the argmax, else each row's sampler
        # (a grammar's mask included); one that asks for logprobs: the logits on the host
        params = self.pool.sampler.params
        if any(params[s].logprobs is not None for s in slots):
            try:
                logits = self.pool.decode(slots, ids, logits="last")
            except Exception as e:  # noqa: BLE001 - the step's sequences fail, the server goes on
                return [e] * len(slots)
            return self._select(slots, logits)
        plain = all(params[s].plain_greedy and params[s].grammar is None for s in slots)
        try:
            out = self.pool.decode(slots, ids, logits="argmax" if plain else "sample").tolist()
        except NumericError as e:  # those sequences fail, the others have their token
            out = [e if s in e.rows else t for s, t in zip(slots, e.ids)]
        except Exception as e:  # noqa: BLE001 - the step's sequences fail, the server goes on
            return [e] * len(slots)
        return self._follow(slots, out)

    def free(self, slot: int) -> None:
        pass  # the slot's cache stays allocated for its next sequence
