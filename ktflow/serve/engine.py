"""The serving engine: an iteration-level (continuous-batching) scheduler in one background thread.

Requests wait in a bounded queue (`submit` raises `QueueFull` when it is full, `Draining` once
shutdown began). Each iteration: retires cancelled sequences and admits waiting requests into free
slots (the runner's fixed number), reusing the longest prefix of the prompt that any slot's KV
cache holds (the runner's `cached`, cut to a multiple of `prefill_tokens`; the entries a prefill
from scratch makes, chunk for chunk), copied from that slot, running or not, when the request runs
in another; it runs in the free slot whose cached history it overwrites least (counted only from
PROTECTED_TOKENS, so short histories do not spread requests over slots and their larger decode
buckets), then the one holding the longest prefix, then the lowest;
prefills, in admission order, chunks of at most `prefill_tokens` prompt tokens, `prefill_tokens`
in all (at least one chunk), as one step, the chunk that ends a prompt giving its first token;
decodes one token for every sequence with one pending; retires finished sequences (a stop string,
a stop token id or eos, max_tokens, cancelled), freeing their slots. A prompt is always cut at
multiples of `prefill_tokens`. The model is reached only through
a `Runner` (`runner.py`), which selects each row's tokens by its request's `SamplingParams` from
its own random stream (seeded by `seed`, advanced only by its own steps). A request hears of its
sequence through its `emit(event)`, called on the scheduler thread: `Delta`s, then one `Finished`
or `Failed`. A step that raises as a whole fails the sequences running then and frees their
slots; the engine serves on (only an interrupt or `stop` ends it). On batching and
reproducibility: docs/design-notes.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..backends.sampling import SamplingParams
from ..errors import KtflowError, first_line
from .runner import Runner
from .stops import TextStream


log = logging.getLogger("ktflow.serve")
#: a runner call longer than this is stuck, not slow (--step-timeout): a 32k-token prompt's chunk
#: on the CPU takes seconds; a step that never returns would hold its requests for ever
STEP_TIMEOUT_S = 600.0
#: a free slot's cached history past what a new request reuses counts as lost from this many tokens:
#: a request goes to another free slot rather than overwrite a conversation this long
PROTECTED_TOKENS = 1024


def _log_request(s: "_Seq", status: str) -> None:
    """One line a finished request: its id, outcome, tokens, time to first token and decode rate."""
    now = time.monotonic()
    r = s.req
    ttft = f"{1e3 * (s.first_token - r.arrived):.0f} ms" if s.first_token is not None else "-"
    rate = (f"{(len(s.generated) - 1) / (now - s.first_token):.1f} tok/s"
            if s.first_token is not None and len(s.generated) > 1 and now > s.first_token else "-")
    log.info(f"request {r.tag or '-'} {status}: prompt {len(r.prompt_ids)} tokens ({s.cached} cached), "
             f"completion {len(s.generated)}, "
             f"first token {ttft}, decode {rate}, {now - r.arrived:.2f} s")


class QueueFull(Exception):
    """The waiting queue holds `max_queue` requests already."""


class Draining(Exception):
    """The engine is shutting down and admits nothing new."""


@dataclass
class Delta:
    """New text of a sequence (may be empty when tokens are held back), and its token count so far;
    with logprobs asked for, the `TokenLogprob`s of the tokens selected since the last Delta."""
    text: str
    completion_tokens: int
    logprobs: list | None = None


@dataclass
class Finished:
    """The sequence ended: `reason` is 'stop', 'length' or 'cancelled'; `text` is all of it."""
    reason: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV entries a slot held from an earlier sequence
    logprobs: list | None = None  # with logprobs asked for: every selected token's TokenLogprob
    stop_string: str | None = None  # the stop string that ended it, if one did


@dataclass
class Failed:
    """The sequence failed; the other sequences go on."""
    message: str


Event = Delta | Finished | Failed


@dataclass(eq=False)
class GenRequest:
    """One generation request as the engine sees it."""
    prompt_ids: list[int]
    max_tokens: int
    emit: Callable[[Event], None]
    sampling: SamplingParams = SamplingParams()  # greedy by default
    stops: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    tag: str = ""  # the request's id, named in its log line
    decode: Callable[[list[int]], str] | None = None  # its text from ids, where not the engine's


class Metrics:
    """What the engine reports as it runs; the default records nothing (`metrics.py` has the
    Prometheus one)."""

    def time_to_first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def tokens(self, prompt: int, completion: int) -> None: ...


@dataclass(eq=False)
class _Seq:
    req: GenRequest
    slot: int
    text: TextStream
    prefilled: int = 0
    cached: int = 0  # the prompt's first tokens a slot's KV cache held (not prefilled again)
    source: int | None = None  # the slot holding them (copied into this one's row when another)
    generated: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # the selected tokens' TokenLogprobs (where asked for)
    reported: int = 0  # how many of them a Delta carried
    pending: int | None = None  # the sampled token the next decode step feeds
    last_token: float = 0.0
    first_token: float | None = None
    done: bool = False


class Engine:
    """The scheduler thread and its queue (see the module docstring)."""

    def __init__(self, runner: Runner, decode_text: Callable[[list[int]], str], *, eos_ids=frozenset(),
                 max_queue: int = 64, prefill_tokens: int = 256, metrics: Metrics | None = None,
                 step_timeout: float = STEP_TIMEOUT_S):
        if max_queue < 0 or prefill_tokens < 1:
            raise ValueError("max_queue must be >= 0 and prefill_tokens >= 1")
        self.runner, self.decode_text = runner, decode_text
        self.eos_ids = frozenset(eos_ids)
        self.max_queue, self.prefill_tokens = max_queue, prefill_tokens
        self.metrics = metrics or Metrics()
        self._cond = threading.Condition()
        self._waiting: deque[GenRequest] = deque()
        self._free = list(range(runner.slots))  # the lowest free slot first where no cache tells (small buckets)
        self._running: list[_Seq] = []
        self._draining = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.iterations = 0
        self.error: BaseException | None = None  # what stopped the thread (an interrupt, not a step's error)
        self.step_timeout = step_timeout  # a runner call longer than this is stuck (the watchdog)
        self._step: tuple[float, list] | None = None  # the runner call in progress: (its start, its sequences)
        self.stuck = 0  # steps the watchdog gave up on (their requests failed); health says so while one runs
        self.step_errors = 0  # steps that raised as a whole: their sequences failed, the engine went on

    # ----------------------------------------------------------------------------- client side
    @property
    def slots(self) -> int:
        return self.runner.slots

    def stats(self) -> dict[str, int | bool]:
        with self._cond:
            return dict(waiting=len(self._waiting), running=len(self._running), slots=self.runner.slots,
                        free_slots=len(self._free), draining=self._draining, stuck=self._stuck_now())

    def _stuck_now(self) -> bool:
        step = self._step
        return step is not None and time.monotonic() - step[0] > self.step_timeout

    def submit(self, req: GenRequest) -> None:
        """Queue `req`; QueueFull when max_queue requests wait already, Draining after shutdown began."""
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self._waiting) - len(self._free) >= self.max_queue:  # those that will not get a slot now
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(req)
            self._cond.notify()

    def cancel(self, req: GenRequest) -> None:
        """The client is gone: its sequence ends (reason 'cancelled') and its slot is freed at the
        next iteration; a request still waiting leaves the queue."""
        with self._cond:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
                self._emit(req, Finished("cancelled", "", len(req.prompt_ids), 0))
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ktflow-serve-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="ktflow-serve-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Fail the requests of a runner call that has run past step_timeout (a stuck step, not a
        slow one: the limit is far past any step's time); the engine thread stays in the call, and
        the server answers health 503 until it returns."""
        while self._thread is not None and self._thread.is_alive():
            time.sleep(min(1.0, self.step_timeout / 4))
            step = self._step
            if step is None or time.monotonic() - step[0] <= self.step_timeout:
                continue
            with self._cond:
                if self._step is not step:
                    continue
                self.stuck += 1
                for s in step[1]:
                    self._fail(s, KtflowError(f"the step held this request for more than {self.step_timeout:g} s "
                                              "(--step-timeout): it is stuck; the request failed"))
                while self._step is step:  # wait for the call to return (or the engine to end)
                    self._cond.wait(1.0)

    def _call(self, seqs: list, fn, *args):
        """A runner call for `seqs`, watched (see _watch)."""
        self._step = (time.monotonic(), list(seqs))
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._step = None
                self._cond.notify_all()

    def drain(self) -> None:
        """Admit no new request (submit raises Draining); what is queued or running goes on."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 0.0) -> None:
        """Drain, give what is queued and running up to `timeout` seconds to finish, cancel the
        rest, and end the thread."""
        self.drain()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._waiting or self._running) and time.monotonic() < deadline and self._alive():
                self._cond.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
            self._stopping = True
            for req in self._waiting:
                req.cancelled = True
                self._emit(req, Failed("the server shut down before this request started"))
            self._waiting.clear()
            for s in self._running:
                s.req.cancelled = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -------------------------------------------------------------------------- scheduler side
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._waiting and not self._running:
                        self._cond.wait()
                    if self._stopping and not self._running:
                        return
                    admitted = self._admit()
                try:
                    for s in admitted:
                        self._start(s)
                    self._iterate()
                except Exception as e:  # noqa: BLE001 - one step's failure is its requests', not the server's
                    self._step_failed(e)
                self.iterations += 1
        except BaseException as e:  # noqa: BLE001 - an interrupt: no client may hang on it
            self.error = e
            with self._cond:
                self._draining = True
                for s in self._running:
                    self._emit(s.req, Failed(f"the serving engine stopped: {type(e).__name__}: {first_line(e)}"))
                for req in self._waiting:
                    self._emit(req, Failed(f"the serving engine stopped: {type(e).__name__}: {first_line(e)}"))
                self._waiting.clear()
                self._running.clear()
                self._cond.notify_all()

    def _step_failed(self, e: Exception) -> None:
        """A step raised as a whole (not per sequence): every running sequence fails with it and
        gives back its slot; the waiting ones and later requests are served."""
        self.step_errors += 1
        for s in list(self._running):
            self._fail(s, e)
            try:
                self._release(s)  # the slot comes back even when the runner's free raises
            except Exception:  # noqa: BLE001 - the slot's state is reset when it starts again
                pass

    def _admit(self) -> list[_Seq]:
        """Waiting requests into free slots (under the lock)."""
        out, taken = [], set()
        while self._free and self._waiting:
            req = self._waiting.popleft()
            # (a slot taken in this loop is no source: its start, before this one's, changes what it holds)
            matched = {k: self.runner.cached(k, req.prompt_ids) if k not in taken else 0
                       for k in range(self.runner.slots)}
            reuse = {k: n // self.prefill_tokens * self.prefill_tokens for k, n in matched.items()}
            lost = {k: self.runner.held(k) - matched[k] for k in self._free}
            slot = min(self._free, key=lambda k: (lost[k] if lost[k] >= PROTECTED_TOKENS else 0, -reuse[k], k))
            source = max(range(self.runner.slots), key=lambda k: (reuse[k], k == slot, -k))
            if reuse[source] <= reuse[slot]:
                source = slot
            self._free.remove(slot)
            taken.add(slot)
            s = _Seq(req, slot, TextStream(req.decode or self.decode_text, req.stops), cached=reuse[source],
                     source=source)
            self._running.append(s)
            out.append(s)
        return out

    def _start(self, s: _Seq) -> None:
        try:
            self._call([s], self.runner.start, s.slot, s.req.sampling, s.req.prompt_ids, s.cached, s.source)
            s.prefilled = s.cached
        except Exception as e:  # noqa: BLE001
            s.cached = 0
            self._fail(s, e)

    def _iterate(self) -> None:
        for s in list(self._running):
            if s.req.cancelled:
                self._finish(s, "cancelled")
        budget = self.prefill_tokens
        chunks: list[tuple[_Seq, int, bool]] = []  # (sequence, tokens, ends its prompt)
        for s in list(self._running):
            prompt = s.req.prompt_ids
            if s.done or s.prefilled >= len(prompt):
                continue
            # chunks start at multiples of prefill_tokens whatever else runs (only rounding depends on
            # the load); the first chunk always runs
            n = min(self.prefill_tokens, len(prompt) - s.prefilled)
            if n > budget and budget < self.prefill_tokens:
                break
            chunks.append((s, n, s.prefilled + n == len(prompt)))
            budget -= n
        if chunks:  # one step for all of them
            items = [(s.slot, s.req.prompt_ids[s.prefilled:s.prefilled + n], last) for s, n, last in chunks]
            for (s, n, last), out in zip(chunks, self._call([c[0] for c in chunks], self.runner.prefill, items)):
                if s.done:  # failed meanwhile (the watchdog)
                    continue
                if isinstance(out, BaseException):  # this sequence fails, the others go on
                    self._fail(s, out)
                    continue
                s.prefilled += n
                if last:
                    self._accept(s, out)
        batch = [s for s in self._running if not s.done and s.pending is not None]
        if batch:
            outs = self._call(batch, self.runner.decode, [s.slot for s in batch], [s.pending for s in batch])
            for s, out in zip(batch, outs):
                if s.done:  # failed meanwhile (the watchdog)
                    continue
                if isinstance(out, BaseException):
                    self._fail(s, out)
                else:
                    self._accept(s, out)
        for s in [s for s in self._running if s.done]:
            self._release(s)

    def _accept(self, s: _Seq, tok: int) -> None:
        """Take the token the runner selected and see whether the sequence ends."""
        if s.req.cancelled:
            self._finish(s, "cancelled")
            return
        now = time.monotonic()
        if s.generated:
            self.metrics.inter_token(now - s.last_token)
        else:
            self.metrics.time_to_first_token(now - s.req.arrived)
            s.first_token = now
        s.last_token = now
        if hasattr(tok, "logprob"):  # a runner's Chosen
            s.logprobs.append(tok.logprob)
        tok = int(tok)
        s.generated.append(tok)
        s.pending = tok
        if tok in s.req.stop_ids or (tok in self.eos_ids and not s.req.ignore_eos):
            text_ids = s.generated[:-1]
            self._delta(s, s.text.finish(text_ids))
            self._finish(s, "stop")
            return
        delta = s.text.push(s.generated)
        if s.text.stopped:
            self._delta(s, delta)
            self._finish(s, "stop")
        elif len(s.generated) >= s.req.max_tokens:
            self._delta(s, delta + s.text.finish(s.generated))
            self._finish(s, "stop" if s.text.stopped else "length")
        else:
            self._delta(s, delta)

    def _delta(self, s: _Seq, text: str) -> None:
        new = s.logprobs[s.reported:] if s.req.sampling.logprobs is not None else None
        s.reported = len(s.logprobs)
        self._emit(s.req, Delta(text, len(s.generated), new))

    def _finish(self, s: _Seq, reason: str) -> None:
        if s.done:
            return
        s.done = True
        self.metrics.tokens(len(s.req.prompt_ids), len(s.generated))
        self._emit(s.req, Finished(reason, s.text.text, len(s.req.prompt_ids), len(s.generated), s.cached,
                                   list(s.logprobs) if s.req.sampling.logprobs is not None else None,
                                   s.text.matched))
        _log_request(s, reason)

    def _fail(self, s: _Seq, e: BaseException) -> None:
        if s.done:
            return
        s.done = True
        self._emit(s.req, Failed(f"{type(e).__name__}: {first_line(e)}"))
        _log_request(s, f"failed ({type(e).__name__}: {first_line(e)})")

    def _release(self, s: _Seq) -> None:
        try:
            self.runner.free(s.slot)
        finally:
            with self._cond:
                self._running.remove(s)
                self._free.append(s.slot)
                self._cond.notify_all()

    @staticmethod
    def _emit(req: GenRequest, event: Event) -> None:
        try:
            req.emit(event)
        except Exception:  # noqa: BLE001 - a client that went away cannot take events; the engine goes on
            pass
