"""`SlotPool`: KV caches for a fixed number of sequences that start, grow and end on their own,
decoded together in one batched step (what a server's continuous batching needs).

The pool owns one `State` of `slots` rows, its caches made once (no allocation later); a sequence
lives in a slot (a row) at its own position. `start(slot, params, prompt)` begins one at position
0 (the row's old entries are never read again), selecting tokens by `params`; `prefill(slot, ids)`
continues its prompt, `prefill_many(slots, chunks)` several prompts in ONE packed step;
`select_tokens(slots, logits)` gives each slot's next token from host logits; `decode(slots, ids)` runs ONE ragged
step over rows 0..b-1, b the smallest batch bucket (1, 2, 4, 8, ... capped at `slots`) holding the
highest listed slot. Unlisted rows in it are padding: outputs dropped, nothing of theirs a later
step reads changed. Take the lowest free slot and the buckets stay small. On the cuda_graph backend
each bucket is bound and captured once, over rows 0..b-1. Padding rows: docs/design-notes.md.

Prefix reuse: each slot knows the token ids whose KV entries its row holds (`held`: what its
prefills and decode steps fed, in order) and how many of them prefill steps computed (`exact`;
a decode step's entries differ from a prefill's in rounding). `cached(slot, prompt)` is how many of
a prompt's first tokens the prefilled entries cover (at most all but its last, which must run to
give logits), and `start(..., reuse=n)`, n up to that, begins the sequence after n of them: the
caller prefills only the rest. `start(..., reuse=n, source=other)` takes them from another slot's
row (running or not), copied into this one: a prefix several sequences share is prefilled once.
"""

from __future__ import annotations

import torch

from ..backends.kv import cache_of, copy_positions
from ..backends.sampling import Sampler, SamplingParams
from ..errors import ConfigError, InputError, NumericError
from ..ir.ops import Op
from .execute import check_ids, prefill, sampler_device
from .state import State


def buckets(slots: int) -> list[int]:
    """The batch sizes a pool of `slots` decodes at: the powers of two below it, and itself."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class SlotPool:
    """See the module docstring."""

    @torch.inference_mode()  # as `execute`: the backends' bound buffers are made and written in it
    def __init__(self, compiled, slots: int):
        if slots < 1:
            raise ConfigError(f"a slot pool needs at least one slot, got {slots}")
        planned = compiled.plans.options.max_batch
        if slots > planned:
            raise ConfigError(f"{slots} slots, but the plan's memory was planned for max_batch {planned}: compile "
                              f"with max_batch >= {slots} (the KV caches of every slot must fit)")
        self.compiled, self.slots = compiled, slots
        self.max_seq_len = compiled.max_seq_len
        self.buckets = buckets(slots)
        self.state = State(compiled.plans.model.fingerprint, slots, self.max_seq_len)
        self.positions = torch.zeros(slots, dtype=torch.int64)
        self.held: list[list[int]] = [[] for _ in range(slots)]  # per slot: the ids its KV entries are of
        self.exact = [0] * slots  # per slot: how many of those a prefill step computed
        self._make_caches()
        self.sampler = Sampler(slots, compiled.vocab_size, sampler_device(compiled))
        self.state.sampler = self.sampler
        # each bucket's rows 0..b-1 as a state of b rows (views: what it writes lands in the pool)
        self._views = {b: State(self.state.fingerprint, b, self.max_seq_len,
                                kv={layer: tuple(t[:b] for t in ts) for layer, ts in self.state.kv.items()},
                                sampler=self.sampler.rows_view(b))
                       for b in self.buckets}

    def _make_caches(self) -> None:
        """Every attention layer's cache for all slots, where the decode plan runs that layer."""
        ex = self.compiled.executor(self.compiled.decode)
        for n in ex.graph.nodes:
            if n.op == Op.ATTENTION:  # the pool's own caches, not a backend's static ones
                cache_of(self.state, n.attrs, self.slots, ex.backend.dtype, ex.backend.device_of(n))

    def _fed(self, slot: int, ids: list[int], prefilled: bool) -> None:
        """`ids` ran at `slot`'s next positions: its entries hold them now."""
        if prefilled and self.exact[slot] == len(self.held[slot]):
            self.exact[slot] += len(ids)
        self.held[slot] += ids

    def bucket(self, rows: int) -> int:
        """The smallest bucket of at least `rows` rows."""
        return next(b for b in self.buckets if b >= rows)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise InputError(f"slot {slot} does not exist: the pool has slots 0..{self.slots - 1}")

    def cached(self, slot: int, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens `slot`'s prefilled KV entries already hold, at most
        all but the last (a prefill of at least one token gives the first new token's logits)."""
        self._check_slot(slot)
        held, most = self.held[slot], min(self.exact[slot], len(prompt) - 1)
        n = 0
        while n < most and held[n] == prompt[n]:  # (no copies: the engine asks every free slot)
            n += 1
        return n

    def prefilled(self, slot: int) -> int:
        """How many KV entries of `slot` a prefill step computed (what `cached` can offer)."""
        self._check_slot(slot)
        return self.exact[slot]

    @torch.inference_mode()
    def start(self, slot: int, params: SamplingParams = SamplingParams(), prompt: list[int] | None = None,
              reuse: int = 0, source: int | None = None) -> None:
        """A new sequence in `slot`, selecting its tokens by `params` (checked: an InputError names
        a bad one), `prompt` being what its repetition penalty counts as seen; it begins after the
        first `reuse` tokens of `prompt` (at most `cached(source, prompt)`: their entries are kept,
        their prefill skipped), else at position 0. `source` (default `slot`): the slot whose
        entries those are; another slot's (running or not) are copied into this one's row first."""
        self._check_slot(slot)
        source = slot if source is None else source
        self._check_slot(source)
        if reuse and not 0 <= reuse <= self.cached(source, prompt or []):
            raise InputError(f"slot {source} holds {self.cached(source, prompt or [])} of this prompt's first tokens; "
                             f"it cannot start after {reuse}")
        self.sampler.set_row(slot, params, prompt)
        if source != slot:
            self.held[slot] = self.held[source][:reuse]
            if reuse:
                for caches in self.state.kv.values():
                    copy_positions(caches, source, slot, reuse)
                if any(t.is_cuda for ts in self.state.kv.values() for t in ts):
                    torch.cuda.synchronize()  # the steps run on their own streams (a replay waits on none)
        self.positions[slot] = reuse
        del self.held[slot][reuse:]
        self.exact[slot] = reuse

    @torch.inference_mode()
    def select_tokens(self, slots: list[int], logits: torch.Tensor) -> list[int]:
        """Each slot's next token from its logits on the host (`prefill_many`'s or `decode`'s
        with logits='last', [len(slots), vocab]), by its sampling parameters (its counts and
        random stream advance, as a step that selects on the device advances them). Slots whose logits are not
        finite: a NumericError naming them (`rows`), carrying the others' ids (-1 for them); their
        entries are no longer reusable."""
        ids = self.sampler.select_rows(logits, slots).tolist()
        bad = tuple(s for s, t in zip(slots, ids) if t < 0)
        for s in bad:
            self.exact[s] = 0
        if bad:
            raise NumericError(f"the logits of slot(s) {list(bad)} hold a NaN or an "
                               "infinity, so no token can be selected (the model's values overflowed, or its weights "
                               "hold non-finite values)", rows=bad, ids=ids)
        return ids

    def position(self, slot: int) -> int:
        return int(self.positions[slot])

    @torch.inference_mode()
    def prefill(self, slot: int, ids: torch.Tensor, logits: str = "last") -> torch.Tensor:
        """The next `ids` [1, n] of the sequence in `slot`; returns `execute`'s logits for them (on
        the device of `ids`, as `execute` does)."""
        self._check_slot(slot)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
            raise InputError(f"a slot holds one sequence: prefill takes ids of shape [1, n], got "
                             f"{list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        state = self.state.row(slot, self.position(slot))
        ids = check_ids(self.compiled, ids, state)
        out, _ = prefill(self.compiled, ids, state, logits, ids.device)
        self.positions[slot] = state.position
        self._fed(slot, ids[0].tolist(), prefilled=True)
        return out

    @torch.inference_mode()
    def prefill_many(self, slots: list[int], chunks: list[list[int]], logits: str = "last") -> torch.Tensor | None:
        """The next prompt chunk of each of `slots` (distinct), all in ONE packed prefill step (the
        chunks one after another, each continuing its own row: the experts are read once for all
        of them); returns each chunk's last logits [len(slots), vocab] (float32, host), or None
        with logits='none'. The chunks together must fit the largest prefill bucket."""
        if not slots or len(slots) != len(chunks) or len(set(slots)) != len(slots) or not all(chunks):
            raise InputError(f"prefill_many takes distinct slots and a non-empty chunk each: got slots {slots}")
        total = sum(len(c) for c in chunks)
        if total > self.compiled.chunk_tokens:
            raise InputError(f"{total} prompt tokens in one packed step: more than the largest prefill bucket "
                             f"({self.compiled.chunk_tokens}); pack fewer")
        for s, c in zip(slots, chunks):
            self._check_slot(s)
            if self.position(s) + len(c) > self.max_seq_len:
                raise InputError(f"slot {s}: {len(c)} more tokens at position {self.position(s)} pass max_seq_len "
                                 f"{self.max_seq_len}")
        ids = check_ids(self.compiled, torch.tensor([[t for c in chunks for t in c]], dtype=torch.int64), None)
        segments = tuple((s, self.position(s), len(c)) for s, c in zip(slots, chunks))
        out = self.compiled.executor(self.compiled.prefill_plan(total)).run(ids, self.state, logits=logits,
                                                                           segments=segments)
        for s, c in zip(slots, chunks):
            self.positions[s] += len(c)
            self._fed(s, c, prefilled=True)
        return None if out is None else out[:, 0].float().cpu()

    @torch.inference_mode()
    def decode(self, slots: list[int], ids: list[int], logits: str = "last") -> torch.Tensor:
        """One token for each of `slots` (distinct, each started and prefilled), `ids` in the same
        order, as one batched step; returns per listed slot, in order, the next-token logits
        [len(slots), vocab] (float32, host), or the next ids [len(slots)]: with logits='argmax'
        the greedy ones, with 'sample' those each slot's sampling parameters select (on the
        GPU inside the step where the backend can). Listed slots whose logits were not finite: a
        NumericError naming them (`rows`), carrying every listed slot's id (-1 for them); the
        step ran for all."""
        if not slots or len(slots) != len(ids) or len(set(slots)) != len(slots):
            raise InputError(f"decode takes distinct slots and one token id each: got slots {slots}, ids {ids}")
        for s in slots:
            self._check_slot(s)
            if self.position(s) == 0:
                raise InputError(f"slot {s} has no prompt yet: prefill it before decoding")
            if self.position(s) >= self.max_seq_len:
                raise InputError(f"slot {s} is at max_seq_len {self.max_seq_len}: its KV cache is full")
        vocab = self.compiled.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is out of range: the vocabulary has ids 0..{vocab - 1}")
        b = self.bucket(max(slots) + 1)
        rows = torch.tensor(slots, dtype=torch.int64)
        tokens = torch.zeros(b, 1, dtype=torch.int64)
        tokens[rows, 0] = torch.tensor(ids, dtype=torch.int64)
        # padding rows write at their own next position (full rows at their last, which then holds
        # nothing a sequence may reuse)
        positions = self.positions[:b].clamp(max=self.max_seq_len - 1)
        for r in range(b):
            if r not in slots and len(self.held[r]) >= self.max_seq_len:
                del self.held[r][self.max_seq_len - 1:]
                self.exact[r] = min(self.exact[r], self.max_seq_len - 1)
        ex = self.compiled.executor(self.compiled.decode)
        if logits == "sample":  # the padding rows' sampler state stays as it is
            listed = set(slots)
            self.sampler.set_active([i in listed for i in range(self.slots)])
        if ex.recorder is not None:  # routing counted for the listed rows only, not the padding
            listed = torch.zeros(b, dtype=torch.int64)
            listed[rows] = 1
            ex.recorder.set_rows(listed)
        bad: tuple[int, ...] = ()
        try:
            out = ex.run(tokens, self._views[b], positions=positions, logits=logits)
        except NumericError as e:  # some rows' logits were not finite: the others' ids are good
            if e.ids is None:
                raise
            out, bad = e.ids, tuple(s for s in slots if s in e.rows)
        finally:
            if ex.recorder is not None:
                ex.recorder.set_rows(None)
        self.positions[rows] += 1
        for s, t in zip(slots, ids):
            self._fed(s, [t], prefilled=False)
        out = out.reshape(b, -1)[rows]
        out = out[:, 0].cpu() if logits in ("argmax", "sample") else out.float()
        if bad:
            raise NumericError(f"the decode step of slot(s) {list(bad)}: its logits hold a NaN or an infinity, so no "
                               "token can be selected (the model's values overflowed, or its weights hold non-finite "
                               "values)", rows=bad, ids=out.tolist())
        return out
