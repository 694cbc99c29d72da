"""Serving over several GPU ranks: one HTTP front, every rank stepping together.

Rank 0 runs the app and the engine as one process does, through a `RanksRunner`: each Runner call
(start, prefill, decode, free, warm) is first sent to the other ranks, then made on rank 0's own
`PoolRunner`. Every other rank `follow`s: it makes the same call on its own PoolRunner, so the ranks
run the same steps with the same token ids in the same order, and their collectives meet. Rank 0's
results are the ones the engine sees (the others compute the same logits: the all-reduces give
every rank the same sums; their own selections are dropped, as each step's ids come from rank 0).

The calls travel as JSON messages over a gloo group (never pickled): the length, then the bytes,
broadcast from rank 0. A step error other than an input error (which every rank meets alike, before
any collective) may leave a collective unmet, so it ends the rank that met it, rank 0 included, and
the launcher then ends every rank and exits non-zero: no rank runs on half-alive. `stop()` ends
the followers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from ..backends.sampling import SamplingParams
from ..errors import InputError, KtflowError, NumericError
from ..runtime.ranks import patient_group
from .runner import PoolRunner


class Channel:
    """JSON messages from rank 0 to every rank, over a gloo group of all ranks whose waits last
    (followers wait on it between requests; the launcher ends them if rank 0 dies)."""

    def __init__(self):
        self.group = patient_group()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def send(self, msg: dict) -> None:
        data = json.dumps(msg).encode()
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def receive(self) -> dict:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return json.loads(buf.numpy().tobytes())


def _params(d: dict) -> SamplingParams:
    return SamplingParams(**{**d, "logit_bias": tuple((int(t), float(b)) for t, b in d["logit_bias"])})


class RanksRunner:
    """Rank 0's Runner: every call sent to the other ranks, then made on `inner`."""

    def __init__(self, inner: PoolRunner, channel: Channel):
        self.inner, self.channel = inner, channel
        self.slots, self.max_seq_len, self.vocab_size = inner.slots, inner.max_seq_len, inner.vocab_size
        self._lock = threading.Lock()  # one call at a time: its message, then rank 0's own step
        self._stopped = False

    def _call(self, msg: dict, fn, *args):
        with self._lock:
            if self._stopped:
                raise KtflowError("the other ranks have stopped: this server is shutting down")
            self.channel.send(msg)
            out = fn(*args)
        error = _step_error(out) if isinstance(out, list) else None
        if error is not None:  # a collective may be unmet, the ranks out of step: the server ends, loudly
            print(f"ktflow serve: rank 0's step failed ({type(error).__name__}: {error}); with several ranks "
                  "that ends the server", file=sys.stderr, flush=True)
            os._exit(1)
        return out

    def warm(self) -> None:
        self._call({"op": "warm"}, self.inner.warm)

    def cached(self, slot: int, prompt_ids: list[int]) -> int:
        return self.inner.cached(slot, prompt_ids)  # every rank's slots hold the same ids: a local question

    def held(self, slot: int) -> int:
        return self.inner.held(slot)  # a local question, as `cached`

    def start(self, slot: int, params: SamplingParams = SamplingParams(), prompt_ids: list[int] | None = None,
              reuse: int = 0, source: int | None = None) -> None:
        # rank 0 first (a start runs no collective): a request it refuses (a bad grammar, say) never
        # reaches the others, whose slots would otherwise change where rank 0's did not
        with self._lock:
            if self._stopped:
                raise KtflowError("the other ranks have stopped: this server is shutting down")
            self.inner.start(slot, params, prompt_ids, reuse, source)
            self.channel.send({"op": "start", "slot": slot, "params": dataclasses.asdict(params),
                               "prompt_ids": prompt_ids, "reuse": reuse, "source": source})

    def prefill(self, items: list[tuple[int, list[int], bool]]) -> list[int | None | BaseException]:
        return self._call({"op": "prefill", "items": [[s, list(ids), last] for s, ids, last in items]},
                          self.inner.prefill, items)

    def decode(self, slots: list[int], ids: list[int]) -> list[int | BaseException]:
        return self._call({"op": "decode", "slots": list(slots), "ids": list(ids)}, self.inner.decode, slots, ids)

    def free(self, slot: int) -> None:
        self._call({"op": "free", "slot": slot}, self.inner.free, slot)

    def stop(self) -> None:
        """The other ranks' `follow` returns (after the call in progress, if any)."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self.channel.send({"op": "stop"})


def _step_error(results: list) -> BaseException | None:
    """The first error of a step's results other than an input error (which every rank meets
    alike, before any collective) or a row's non-finite logits (every rank's alike, after the
    step's last collective): one that may have left a collective unmet."""
    return next((r for r in results if isinstance(r, BaseException) and not isinstance(r, (InputError, NumericError))),
                None)


def _check(results: list, what: str) -> None:
    """A follower's step results: an error other than an input error ends the follower."""
    error = _step_error(results)
    if error is not None:
        raise KtflowError(f"{what} failed on this rank: {type(error).__name__}: {error}") from error


def follow(inner: PoolRunner, channel: Channel) -> None:
    """Make rank 0's Runner calls on `inner` until it sends stop."""
    while True:
        msg = channel.receive()
        op = msg["op"]
        if op == "stop":
            return
        if op == "warm":
            inner.warm()
        elif op == "start":
            try:
                inner.start(msg["slot"], _params(msg["params"]), msg["prompt_ids"], msg["reuse"], msg["source"])
            except InputError:
                pass  # rank 0 met it too and answered the request
        elif op == "prefill":
            _check(inner.prefill([(s, ids, last) for s, ids, last in msg["items"]]), "a prefill step")
        elif op == "decode":
            _check(inner.decode(msg["slots"], msg["ids"]), "a decode step")
        elif op == "free":
            inner.free(msg["slot"])
        else:
            raise KtflowError(f"rank 0 sent an unknown call {op!r}")
