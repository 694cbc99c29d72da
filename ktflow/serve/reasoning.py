"""A reasoning model's thinking split from its answer (`reasoning_content` beside `content`), as
DeepSeek-R1 and Qwen3 write it: the thinking between `<think>` and `</think>`, the answer after.

A chat template that opens the block itself (its generation prompt ends in `<think>`) makes the
output start inside it: `ThinkSplit(opened=True)`. Text with no closing tag is all thinking when
the block was open (cut off by max_tokens), else all answer. `push` routes streamed text as it
comes, holding back a partial tag at a chunk's end.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside a thinking block."""
    return prompt.rstrip().endswith(OPEN)


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """(the thinking or None, the answer) of a whole output."""
    body = text
    if not opened:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        body = stripped[len(OPEN):]
    at = body.find(CLOSE)
    if at < 0:
        return body.strip() or None, ""
    return body[:at].strip() or None, body[at + len(CLOSE):].lstrip()


class ThinkSplit:
    """Streamed text routed to thinking or answer: `feed(piece)` gives (new thinking, new answer);
    `flush()` at the end gives what a partial tag held back."""

    def __init__(self, opened: bool):
        self.opened = opened
        self.sent = 0  # of the whole text, what has been routed
        self.state = "thinking" if opened else "start"  # start: not yet known whether a block opens
        self.closed = False  # a block closed: the answer's leading whitespace is dropped, as split does
        self.whole = ""  # the text so far

    def feed(self, piece: str) -> tuple[str, str]:
        self.whole += piece
        return self._route(self.whole)

    def _route(self, whole: str) -> tuple[str, str]:
        if self.state == "start":
            stripped = whole.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):
                return "", ""  # may still become the opening tag
            if stripped.startswith(OPEN):
                self.state, self.sent = "thinking", len(whole) - len(stripped) + len(OPEN)
            else:
                self.state = "answer"
        if self.state == "answer":
            return "", self._answer(whole)
        at = whole.find(CLOSE, self.sent)
        if at >= 0:
            thinking = whole[self.sent:at]
            self.state, self.sent, self.closed = "answer", at + len(CLOSE), True
            return thinking, self._answer(whole)
        end = len(whole)
        for k in range(min(len(CLOSE) - 1, end - self.sent), 0, -1):  # a partial closing tag waits
            if CLOSE.startswith(whole[end - k:]):
                end -= k
                break
        out, self.sent = whole[self.sent:end], end
        return out, ""

    def flush(self) -> tuple[str, str]:
        """At the end: what a partial tag held back, as the text it was (thinking or answer)."""
        rest, self.sent = self.whole[self.sent:], len(self.whole)
        if self.state == "thinking":
            return rest, ""
        return "", rest

    def _answer(self, whole: str) -> str:
        out, self.sent = whole[self.sent:], len(whole)
        if self.closed:
            out = out.lstrip()
            self.closed = not out  # until the answer's first visible character
        return out
