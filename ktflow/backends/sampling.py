"""Token selection on the device, per row: greedy or sampled, in tensor ops a CUDA graph captures.

A `Sampler` holds, for `rows` sequences, each row's `SamplingParams` as device tensors and its
running state (generated counts, prompt tokens, its random stream's counter, the tokens its
grammar allows next). `select(logits)` turns logits [rows, vocab] into the next ids [rows] without
a host synchronisation and with fixed shapes (the cuda_graph backend captures it in the decode
step); the CPU selects the same ids, up to the rounding of the logits themselves. Per row, in
vLLM's order with HF transformers' and OpenAI's rules: `logit_bias`; repetition, frequency and
presence penalties; a row with a grammar (`params.grammar`) sets every token its bitmask
(`set_allowed`) does not allow to MASKED; temperature 0 (or top_k 1) is the argmax, else top_k,
top_p and min_p keep a prefix of the sorted probabilities (at least one token; ties at the edge
all kept); the token is drawn with u = hash(seed, counter), so a seed reproduces on any device and
each row draws from its own stream. The counts and the counter advance only for active rows
(`set_active`). The rules in full: docs/design-notes.md.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..errors import InputError
from .kernels import dequant_gpu, sampling_gpu

#: most logit_bias entries a row may carry (OpenAI's limit): the bias tensors have this fixed width
MAX_LOGIT_BIAS = 300

_M32 = 0xFFFFFFFF

#: a Sampler's device tensors, each with one row per sequence
_TENSORS = ("temperature", "top_p", "min_p", "top_k", "repetition", "presence", "frequency", "bias_ids", "bias",
            "seed_lo", "seed_hi", "counter", "counts", "in_prompt", "active", "allowed", "constrained")

#: what a token a row's grammar does not allow becomes (finite: penalties and temperature keep it
#: finite, and the non-finite check reads the model's logits, never this)
MASKED = -1e30


class Stages(NamedTuple):
    """The stages of `select_ids` a step runs: a stage left out must be one no row needs (a
    captured step is keyed by its stages, so its graph is replayed only for rows that need no more)."""

    bias: bool = True  # some row has a logit_bias
    penalties: bool = True  # some row has a repetition, presence or frequency penalty
    draw: bool = True  # some row samples (else every row takes its argmax)
    truncation: bool = True  # some sampled row has top_k > 1, top_p < 1 or min_p > 0 (a sort)
    grammar: bool = True  # some row follows a grammar (its allowed tokens' bitmask)


#: every stage: a step that runs these selects correctly for any rows' parameters
ALL_STAGES = Stages()

#: the stages a captured step runs (`Sampler.captured_stages`): every one, or for a greedy batch
#: with a grammar (structured output) the mask and the argmax alone: two graphs a batch size,
#: both made at a server's warm-up
CAPTURED_STAGES = (ALL_STAGES, Stages(bias=False, penalties=False, draw=False, truncation=False, grammar=True))


class SamplingParamError(InputError):
    """A sampling parameter out of range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens (see the module docstring); the defaults are greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    #: reported, not selected by: each selected token's log-probability and the `logprobs` most
    #: likely tokens' (under the model's logits as they are, softmax at temperature 1); None: none
    logprobs: int | None = None
    #: a grammar the selected tokens must follow (serve/grammar.py's text; the server masks the
    #: logits by it before selecting); None: none
    grammar: str | None = None

    @staticmethod
    def make(*, logit_bias: dict | Sequence | None = None, **kw) -> "SamplingParams":
        """Params from keyword arguments (None means the default), `logit_bias` as a mapping
        token id -> bias; checked (`check`) against no vocabulary yet."""
        kw = {k: v for k, v in kw.items() if v is not None}
        unknown = set(kw) - set(SamplingParams.__dataclass_fields__)
        if unknown:
            raise SamplingParamError(sorted(unknown)[0], f"unknown sampling parameter(s) {sorted(unknown)}; known: "
                             f"{', '.join(SamplingParams.__dataclass_fields__)}")
        bias = ()
        if logit_bias:
            items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
            try:
                bias = tuple(sorted((_token_id(k), float(v)) for k, v in items))
            except (TypeError, ValueError):
                raise SamplingParamError("logit_bias", "logit_bias must map token ids (integers) to numbers") from None
        return SamplingParams(logit_bias=bias, **kw)

    @property
    def greedy(self) -> bool:
        """Whether the row takes the argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing changing the logits: the argmax of the logits as they are."""
        return (self.greedy and not self.logit_bias and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)

    def check(self, vocab: int | None = None) -> "SamplingParams":
        """Self, or an InputError naming the parameter out of range."""
        def bad(name: str, want: str):
            raise SamplingParamError(name, f"{name} must be {want}, got {getattr(self, name)!r}")

        num = (int, float)
        if not isinstance(self.temperature, num) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad("temperature", "a finite number >= 0 (0: greedy)")
        if not isinstance(self.top_p, num) or not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0: no limit)")
        if not isinstance(self.min_p, num) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if not isinstance(self.repetition_penalty, num) or not (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", "a finite number > 0 (1: none)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, num) or not math.isfinite(v):
                bad(name, "a finite number (0: none)")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamError("logit_bias", f"logit_bias has {len(self.logit_bias)} entries; at most "
                                     f"{MAX_LOGIT_BIAS}")
        for tok, v in self.logit_bias:
            if tok < 0 or (vocab is not None and tok >= vocab):
                raise SamplingParamError("logit_bias", f"logit_bias names token id {tok}, outside the vocabulary"
                                         + (f" (ids 0..{vocab - 1})" if vocab is not None else " (ids are >= 0)"))
            if not math.isfinite(v):
                raise SamplingParamError("logit_bias", f"logit_bias for token {tok} must be a finite number, got {v!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}] (the most likely tokens reported beside each one)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", "an integer in [-2**63, 2**64 - 1] (the random stream takes 64 bits)")
        return self


#: the most likely tokens a selected token's report may list (OpenAI's top_logprobs limit)
MAX_LOGPROBS = 20

#: the seeds the random stream takes: 64 bits, signed or not (a negative seed is its two's complement)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def _token_id(k) -> int:
    if isinstance(k, bool):
        raise TypeError
    if isinstance(k, str):  # JSON object keys arrive as strings
        return int(k.strip())
    if isinstance(k, int):
        return k
    raise TypeError


# ------------------------------------------------------------------------------- random stream


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x int64 in [0, 2**32) and a 32-bit constant c, in 16-bit halves (no
    product leaves int64's range)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, two rounds) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """u in [0, 1) (float64, 53 random bits) per element from a 64-bit seed (two 32-bit halves,
    int64) and a step counter: the same inputs give the same u on any device."""
    a = _mix((counter & _M32) ^ _mix(seed_hi ^ 0x9E3779B9))
    b = _mix(a ^ seed_lo)
    c = _mix(b ^ 0x85EBCA6B)
    return ((b >> 5) * 67108864 + (c >> 6)).to(torch.float64) / 9007199254740992.0  # (27 + 26 bits) / 2**53


# ------------------------------------------------------------------------------- the sampler


class Sampler:
    """Per-row selection state on `device` (see the module docstring)."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str):
        dev = torch.device(device)
        self.rows, self.vocab, self.device = rows, vocab, dev

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        self.temperature, self.top_p, self.min_p = zeros(rows), torch.ones(rows, device=dev), zeros(rows)
        self.top_k = zeros(rows, dtype=torch.int64)
        self.repetition, self.presence, self.frequency = torch.ones(rows, device=dev), zeros(rows), zeros(rows)
        self.bias_ids = zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64)
        self.bias = zeros(rows, MAX_LOGIT_BIAS)
        self.seed_lo, self.seed_hi = zeros(rows, dtype=torch.int64), zeros(rows, dtype=torch.int64)
        self.counter = zeros(rows, dtype=torch.int64)
        self.counts = zeros(rows, vocab, dtype=torch.int32)  # generated tokens, per token id
        self.in_prompt = zeros(rows, vocab, dtype=torch.bool)
        self.active = torch.ones(rows, dtype=torch.int32, device=dev)
        # the tokens a row's grammar allows next: token i is bit i % 32 of word i // 32 (llguidance's
        # layout); read only in rows whose `constrained` is 1 (set_row sets it from params.grammar)
        self.allowed = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32, device=dev)
        self.constrained = zeros(rows, dtype=torch.int32)
        self.params: list[SamplingParams] = [SamplingParams()] * rows  # the host's copy
        self._active_host = [True] * rows
        self.key = self._addresses()

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of the logits as they are (no sampling, bias or penalty)."""
        return all(p.plain_greedy for p in self.params)

    @torch.inference_mode()  # (its tensors may be inference tensors: a backend's static ones)
    def set_row(self, row: int, params: SamplingParams, prompt: Sequence[int] | torch.Tensor | None = ()) -> None:
        """Row `row` starts a sequence with `params` (checked against the vocabulary) after
        `prompt` (the token ids the repetition penalty counts): counts cleared, the stream at
        step 0 of `params.seed` (None: a random seed). Synchronous: done when it returns."""
        params.check(self.vocab)
        seed = params.seed if params.seed is not None else random.getrandbits(64)
        seed %= 1 << 64
        for dst, v in ((self.temperature, params.temperature), (self.top_p, params.top_p), (self.min_p, params.min_p),
                       (self.repetition, params.repetition_penalty), (self.presence, params.presence_penalty),
                       (self.frequency, params.frequency_penalty), (self.top_k, params.top_k)):
            dst[row] = v
        ids = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.int64)
        bias = torch.zeros(MAX_LOGIT_BIAS)
        for i, (tok, v) in enumerate(params.logit_bias):
            ids[i], bias[i] = tok, v
        self.bias_ids[row].copy_(ids)
        self.bias[row].copy_(bias)
        self.seed_lo[row], self.seed_hi[row] = seed & _M32, seed >> 32
        self.counter[row] = 0
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self.allowed[row].fill_(-1)  # every token, until the grammar's first set_allowed
        self.constrained[row] = int(params.grammar is not None)
        if prompt is not None and len(prompt):
            p = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1).to(self.device)
            self.in_prompt[row].index_fill_(0, p, True)
        self.params[row] = params
        self._sync()

    @torch.inference_mode()
    def set_allowed(self, row: int, bitmask) -> None:
        """The tokens row `row`'s grammar allows in its next step: `bitmask` (bytes or a buffer of
        little-endian 32-bit words; token i allowed where bit i % 32 of word i // 32 is set; words
        past the vocabulary ignored, tokens past the words not allowed). Read only where the row's
        params name a grammar. Synchronous: done when it returns, as `set_row`."""
        words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
        n = self.allowed.shape[1]
        if words.numel() < n:  # tokens past the grammar's vocabulary: not allowed
            words = torch.cat([words, torch.zeros(n - words.numel(), dtype=torch.int32)])
        self.allowed[row].copy_(words[:n])
        self._sync()

    @torch.inference_mode()
    def set_active(self, active: Sequence[bool]) -> None:
        """Which rows' counts and stream the next steps advance (the others are padding)."""
        active = [bool(a) for a in active]
        if active != self._active_host:
            self.active.copy_(torch.tensor(active, dtype=torch.int32))
            self._active_host = active
            self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def rows_view(self, rows: int) -> "Sampler":
        """A sampler over views of the first `rows` rows, for a step of that batch over them (what
        it selects and counts lands here). Rows are set and marked active on this sampler."""
        return self._derived(lambda t: t[:rows], self.params, self._active_host)

    def _derived(self, rows_of, params: list, active: list) -> "Sampler":
        """A sampler whose tensors are `rows_of(tensor)` of this one's (views or copies), its host
        copies `params` and `active`."""
        other = object.__new__(Sampler)
        for name in _TENSORS:
            setattr(other, name, rows_of(getattr(self, name)))
        other.rows, other.vocab, other.device = other.active.shape[0], self.vocab, self.device
        other.params, other._active_host = params, active
        other.key = other._addresses()
        return other

    @torch.inference_mode()
    def load(self, other: "Sampler") -> None:
        """Take `other`'s rows (same shape): parameters, counts, streams."""
        if (other.rows, other.vocab) != (self.rows, self.vocab):
            raise InputError(f"a sampler of {other.rows} rows x {other.vocab} tokens cannot stand in for one of "
                             f"{self.rows} x {self.vocab}")
        for name in _TENSORS:
            getattr(self, name).copy_(getattr(other, name))
        self.params = list(other.params)
        self._active_host = list(other._active_host)
        self._sync()

    def _addresses(self) -> tuple[int, ...]:
        """The addresses of the tensors a captured step reads and writes (a graph is bound to them;
        kept as `key`: the tensors are never replaced, only written)."""
        return tuple(getattr(self, name).data_ptr() for name in _TENSORS)

    # --------------------------------------------------------------------------- selecting
    @torch.inference_mode()
    def select(self, logits: torch.Tensor, stages: Stages | None = None) -> torch.Tensor:
        """The next ids [rows] (int64) from logits [rows, vocab] on the sampler's device, -1 in
        a row whose logits are not all finite (`mark_nonfinite`); every active row's counts and
        stream advance. Tensor ops only (capturable). `stages`: those to run (a captured graph's,
        which must cover what its rows need whenever it is replayed); None: `stages()`."""
        ids = mark_nonfinite(logits, select_ids(logits, self, *(stages or self.stages())))
        self.counts.scatter_add_(1, ids.clamp(min=0)[:, None], self.active[:, None] * (ids >= 0)[:, None])
        self.counter.add_(self.active)
        return ids

    def captured_stages(self) -> Stages:
        """The stages a captured step of these rows runs: theirs where that is one of
        CAPTURED_STAGES, else every stage (a step keyed by its stages would otherwise capture a
        graph mid-request for each new mix of parameters)."""
        own = self.stages()
        return own if own in CAPTURED_STAGES else ALL_STAGES

    def stages(self) -> Stages:
        """The stages of `select_ids` some row needs, from the host's copy of the rows' parameters."""
        params = self.params[:self.rows]
        return Stages(any(p.logit_bias for p in params),
                      any((p.repetition_penalty, p.presence_penalty, p.frequency_penalty) != (1.0, 0.0, 0.0)
                          for p in params),
                      any(not p.greedy for p in params),
                      any(not p.greedy and (p.top_k > 1 or p.top_p < 1.0 or p.min_p > 0.0) for p in params),
                      any(p.grammar is not None for p in params))

    @torch.inference_mode()
    def select_rows(self, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The next ids [len(rows)] from logits [len(rows), vocab] for those rows only (a prompt's
        first token; not captured); their counts and streams advance."""
        r = torch.as_tensor(list(rows), dtype=torch.int64, device=self.device)
        params = [self.params[i] for i in rows]
        picked = self._derived(lambda t: t.index_select(0, r), params, [True] * len(params))
        picked.active.fill_(1)  # (copies) each listed row advances, whatever a last batched step marked
        ids = picked.select(logits.to(self.device, torch.float32))  # the copies' counts and counters advance
        self.counts.index_copy_(0, r, picked.counts)
        self.counter.index_copy_(0, r, picked.counter)
        return ids


def mark_nonfinite(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`ids` [rows] selected from `logits` [rows, vocab], with -1 where a row's logits hold a NaN
    or an infinity (tensor ops: capturable; errors.require_finite turns them into an error)."""
    return torch.where(torch.isfinite(logits).all(-1), ids, torch.full_like(ids, -1))


#: tokens a chunk of the vocabulary holds where prefix sums are taken in two levels (sums of
#: chunks, then within one chunk): a full-width scan of a few rows is slow on a GPU
CHUNK = 512


def _chunks(w: torch.Tensor) -> torch.Tensor:
    """w [rows, vocab] as [rows, chunks, CHUNK], zero-padded."""
    rows, vocab = w.shape
    pad = -vocab % CHUNK
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.view(rows, -1, CHUNK)


def _first_passing(w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index i whose prefix sum w[:, :i + 1].sum() exceeds target [rows]
    (w >= 0), found in two levels: the chunk, then inside it. Where rounding leaves no prefix sum
    above target (the chunk sums and the sums inside a chunk round differently), the last index of
    positive w: never an index of w 0 (a masked or truncated token) in a row holding a positive."""
    c = _chunks(w)
    sums = c.sum(-1)
    ends = sums.cumsum(-1)
    j = torch.minimum((ends <= target[:, None]).sum(-1), _last_positive(sums))
    # the mass before chunk j as the chunk search saw it (ends[j - 1], not ends[j] - sums[j], which
    # can round above it and let a zero-weight first token pass)
    before = torch.nn.functional.pad(ends, (1, 0))[:, :-1].gather(1, j[:, None])
    chunk = c.gather(1, j[:, None, None].expand(-1, 1, CHUNK)).squeeze(1)
    i = torch.minimum(((chunk.cumsum(-1) + before) <= target[:, None]).sum(-1), _last_positive(chunk))
    return j * CHUNK + i


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [rows, n] (>= 0), the last index holding a positive value (0 where none)."""
    return ((x > 0) * torch.arange(x.shape[1], device=x.device)).amax(-1)


def _prefix(w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Per row, w[:, :i + 1].sum() for index i [rows], in two levels."""
    c = _chunks(w)
    sums = c.sum(-1)
    j = i // CHUNK
    before = (sums.cumsum(-1) - sums).gather(1, j[:, None]).squeeze(1)
    inner = c.gather(1, j[:, None, None].expand(-1, 1, CHUNK)).squeeze(1).cumsum(-1)
    return before + inner.gather(1, (i % CHUNK)[:, None]).squeeze(1)


def select_ids(logits: torch.Tensor, s: Sampler, biased=True, penalized=True, drawn=True, truncated=True,
               constrained=True, kernels: bool = True) -> torch.Tensor:
    """The rule of the module docstring, over the rows of `s`'s per-row tensors (its counts and
    counter are read, not advanced).
    A stage whose flag is off is left out: the caller knows no row needs it (bias: no row has a
    logit_bias; penalties: none has a penalty; a draw: every row is greedy; truncation: no
    sampled row has top_k > 1, top_p < 1 or min_p > 0, so nothing is sorted, the draw being the
    same as with the flag on; constrained: no row follows a grammar). Every pass over the vocabulary is an elementwise op or a
    reduction (no softmax or scan of a whole row: on a GPU those run a block a row); on a CUDA
    device the elementwise stages run as the fused kernels of `sampling_gpu` (`kernels`: where
    Triton is there; False: the torch ops, their reference)."""
    fused = kernels and dequant_gpu.available(logits.device)  # (Triton importable on a CUDA device)
    best, w = _weights(logits, s, biased, penalized, drawn, truncated, constrained, fused)
    if w is None:
        return best
    total = w.sum(-1)
    u = (sampling_gpu.uniform if fused else uniform)(s.seed_lo, s.seed_hi, s.counter).float() * total
    pick = _first_passing(w, torch.minimum(u, total * (1 - 2.0 ** -20)))  # where the mass passes u
    return torch.where((s.temperature > 0) & (s.top_k != 1), pick, best)


def probabilities(logits: torch.Tensor, s: Sampler) -> torch.Tensor:
    """The distribution [rows, vocab] (float32) each row's next token is drawn from by
    `select_ids` with every stage on: the truncated, renormalised probabilities of a sampled row,
    all the mass on the argmax for a greedy row (temperature 0 or top_k 1). What a speculative
    decoder's rejection rule compares (`runtime/speculative.accept_drafts`)."""
    best, w = _weights(logits, s, True, True, True, True, True, False)
    p = w / w.sum(-1, keepdim=True)
    greedy = (s.temperature <= 0) | (s.top_k == 1)
    onehot = torch.zeros_like(p).scatter_(1, best[:, None], 1.0)
    return torch.where(greedy[:, None], onehot, p)


def _weights(logits: torch.Tensor, s: Sampler, biased: bool, penalized: bool, drawn: bool, truncated: bool,
             constrained: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's argmax after bias and penalties, its unnormalised kept probabilities, the
    largest 1; None without a draw): `select_ids`' stages before the draw."""
    rows, vocab = logits.shape
    x = logits.float()
    if biased:
        x = x.scatter_add(1, s.bias_ids, s.bias)
    if penalized:
        if fused:
            x = sampling_gpu.penalize_(x if biased else x.clone(memory_format=torch.contiguous_format), s.counts,
                                       s.in_prompt, s.repetition, s.presence, s.frequency)
        else:
            seen = s.in_prompt | (s.counts > 0)
            r = s.repetition[:, None]
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            x = x - s.frequency[:, None] * s.counts - s.presence[:, None] * (s.counts > 0)
    if constrained:  # token i's bit: bit i % 32 of word i // 32 (an arithmetic shift keeps bit 31's)
        i = torch.arange(vocab, device=x.device)
        bits = (s.allowed.index_select(1, i >> 5) >> (i & 31).to(torch.int32)) & 1
        x = torch.where((s.constrained[:, None] != 0) & (bits == 0), torch.full_like(x, MASKED), x)
    best = x.argmax(-1)
    if not drawn:
        return best, None
    sampled = s.temperature > 0
    if fused:
        w = sampling_gpu.weights(x.contiguous(), best, s.temperature)
    else:
        t = torch.where(sampled, s.temperature, torch.ones_like(s.temperature))
        z = x / t[:, None]
        w = torch.exp(z - z.gather(1, best[:, None]))  # unnormalised probabilities, the largest 1
    if truncated:  # each row's kept tokens: those at least as likely as its last kept one in sorted order
        ws = w.sort(dim=-1, descending=True).values
        k = torch.where(s.top_k > 0, s.top_k.clamp(max=vocab), torch.full_like(s.top_k, vocab)) - 1  # last index
        target = s.top_p * _prefix(ws, k)  # top_p of the first top_k's mass
        last = torch.minimum(_first_passing(ws, target * (1 - 2.0 ** -20)), k)  # the mass before it is below
        cut = torch.maximum(ws.gather(1, last[:, None]), s.min_p[:, None])  # min_p times the most likely (1)
        w = w * (w >= cut)
    return best, w
