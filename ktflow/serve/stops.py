"""Generated ids to text, a piece at a time, with stop strings.

`TextStream.push(ids)` takes the ids generated so far and returns the text that is safe to send:
an incomplete UTF-8 character at the end (decoded as U+FFFD) is held back until its next byte
arrives, and so is any tail of the text that could still become a stop string, so a stop string
never reaches the client, streamed or not. When a stop string appears, the text ends just before
it and `stopped` is set.

`IncrementalText` keeps the cost of a token independent of the answer's length: the text of the
ids up to a committed offset is kept, and only a window of the last few ids is decoded again
(a token's text can depend on its neighbours: a leading space, a character split over tokens).
"""

from __future__ import annotations

from typing import Callable

_PARTIAL = "\ufffd"


class IncrementalText:
    """`decode(ids)` for ids that only grow, decoding a short window each time.

    Offsets p <= r: the text of ids[:r] is final (`stable`). For new ids the window ids[p:] is
    decoded and its part past the text of ids[p:r] is the new tail; once that tail ends in a whole
    character, it joins `stable`, and p, r move to r and the current end (the window keeps one
    step of context before the new ids). A window whose text does not start with its context's
    (a tokenizer that rewrites earlier text) falls back to decoding every id."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.stable, self.p, self.r, self.context = "", 0, 0, ""

    def of(self, ids: list[int]) -> str:
        if len(ids) < self.r:
            raise ValueError("IncrementalText takes ids that only grow")
        window = self.decode(ids[self.p:])
        if not window.startswith(self.context):
            return self.decode(ids)
        tail = window[len(self.context):]
        full = self.stable + tail
        if tail and not tail.endswith(_PARTIAL):
            self.stable = full
            self.p, self.r = self.r, len(ids)
            self.context = self.decode(ids[self.p:self.r])
        return full


class TextStream:
    """The text of one sequence's generated ids, released as deltas."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = IncrementalText(decode).of
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.sent = 0  # characters of the text released so far
        self.text = ""  # the text released so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended it, if one did

    def push(self, ids: list[int]) -> str:
        """The new text that `ids` (every id generated so far) makes safe to release."""
        if self.stopped:
            return ""
        full = self.decode(ids)
        if self.stops:
            at = self._find_stop(full)
            if at is not None:
                self.stopped = True
                return self._release(full, max(at, self.sent))
        end = len(full)
        while end > self.sent and full[end - 1] == _PARTIAL:  # an incomplete character: wait for its bytes
            end -= 1
        end -= self._partial_stop(full[:end])
        return self._release(full, max(end, self.sent))

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once generation ended for another reason than a stop string."""
        if self.stopped:
            return ""
        full = self.decode(ids)
        at = self._find_stop(full) if self.stops else None
        if at is not None:
            self.stopped = True
            return self._release(full, max(at, self.sent))
        return self._release(full, len(full))

    def _release(self, full: str, end: int) -> str:
        delta = full[self.sent:end]
        self.sent = end
        self.text += delta
        return delta

    def _find_stop(self, full: str) -> int | None:
        """Where the earliest stop string starts in `full` (searched from a little before the text
        already released), or None."""
        start = max(0, self.sent - self.longest)
        found = [(i, s) for i, s in ((full.find(s, start), s) for s in self.stops) if i >= 0]
        if not found:
            return None
        at = min(i for i, _ in found)
        self.matched = next(s for i, s in found if i == at)
        return at

    def _partial_stop(self, full: str) -> int:
        """How many characters at the end of `full` are the start of some stop string."""
        for k in range(min(self.longest - 1, len(full) - self.sent), 0, -1):
            tail = full[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
