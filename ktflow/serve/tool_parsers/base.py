"""What every tool-call parser shares: a parsed call, a parser's description, and `ToolStream`,
which holds streamed text back from a parser's opening marker on."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends arguments
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call(name: str, arguments: dict, id: str | None = None) -> ParsedCall:
    """A call of `name` with `arguments` (an object), its id given or a fresh one."""
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), id or f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call format: `parse(text)` gives (the content before the first call, or
    None when empty; the calls), all of `text` as content and no calls where the calls do not
    parse. `start` opens the calls (a stream holds text back from it on); `special`: its markers
    are special tokens, so a request with tools decodes its answer keeping them; `lark`: the
    grammar of one call (see the field)."""

    name: str
    start: str
    parse: Callable[[str], tuple[str | None, list[ParsedCall]]]
    special: bool = False
    #: a Lark grammar (llguidance's) of exactly one call, from the JSON schema text of the call
    #: object {"name", "arguments"}: what tool_choice required / a named function constrains the
    #: answer to; None where the format has none yet
    lark: Callable[[str], str] | None = None

    def __call__(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return self.parse(text)


def object_of(text: str) -> dict | None:
    """The JSON object `text` holds (surrounding blank space allowed), or None."""
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def section_calls(text: str, begin: str, end: str, call_begin: str, call_end: str,
                  one: Callable[[str], ParsedCall | None]) -> tuple[str | None, list[ParsedCall]]:
    """A format whose calls sit in one section (`begin` ... `end`), each between `call_begin` and
    `call_end`: (the content before the section, the calls `one` parses from each call's text);
    all of `text` as content and no calls where the section is missing or a call does not parse.
    A section or a call cut short (max_tokens) runs to the end of the text."""
    at = text.find(begin)
    if at < 0:
        return text, []
    calls = []
    for piece in text[at + len(begin):].split(end, 1)[0].split(call_begin)[1:]:
        parsed = one(piece.split(call_end, 1)[0])
        if parsed is None:
            return text, []
        calls.append(parsed)
    if not calls:
        return text, []
    content = text[:at].strip()
    return (content or None), calls


class ToolStream:
    """Streamed text with calls held back: `push(text)` gives what may be sent now (nothing from
    the parser's opening marker on, and not a trailing prefix of it); `finish(whole)` parses the
    whole."""

    def __init__(self, parser: ToolParser):
        self.parse, self.start, self.sent, self.held = parser, parser.start, 0, False

    def push(self, whole: str) -> str:
        """`whole` is all the text so far; returns the new part that is safe to send."""
        if self.held:
            return ""
        at = whole.find(self.start, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = whole[self.sent:at], at
            return out
        end = len(whole)
        for k in range(min(len(self.start) - 1, end - self.sent), 0, -1):  # a partial marker at the end waits
            if self.start.startswith(whole[end - k:]):
                end -= k
                break
        out, self.sent = whole[self.sent:end], end
        return out

    def finish(self, whole: str) -> tuple[str, list[ParsedCall]]:
        """(text not sent yet, the calls): the held-back text is sent as content when no call parses."""
        content, calls = self.parse(whole)
        if not calls:
            return whole[self.sent:], []
        sent_content = whole[:self.sent].strip()
        rest = (content or "")[len(sent_content):] if content and content.startswith(sent_content) else ""
        return rest, calls
