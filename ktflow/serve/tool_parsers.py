"""Tool calls in a model's output, parsed per family into OpenAI's `tool_calls`.

`hermes`: the format Qwen2/Qwen3 (and Hermes) chat templates teach: each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; the text before the
first call is the message's content. A block that is not such an object stays text. Which parser a
checkpoint gets follows its model_type (`parser_for`); `--tool-parser` overrides it. Families whose
format is not parsed yet (DeepSeek-V3's tool-call tokens, GLM-4.5's, Kimi-K2's) have none: their
requests with `tools` are refused, never answered as if the tools were ignored.

`ToolStream` holds back streamed text from the first `<tool_call>` on (and a partial marker at
a chunk's end), so a stream's content deltas never show call markup.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Callable

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends arguments
    id: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content before the first call or None when empty, the calls) of `text`."""
    at = text.find(START)
    if at < 0:
        return text, []
    calls, rest = [], text[at:]
    while rest.startswith(START):
        close = rest.find(END)
        body = rest[len(START):close if close >= 0 else len(rest)]
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return text, []  # not a call after all: all of it is text
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}"))
        if close < 0:
            break
        rest = rest[close + len(END):].lstrip()
    content = text[:at].strip()
    return (content or None), calls


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ParsedCall]]]] = {"hermes": hermes}
#: the parser a model_type's chat template teaches
FAMILY_PARSER = {"qwen3_moe": "hermes", "qwen2_moe": "hermes"}


def parser_for(model_type: str, override: str | None = None):
    """The parser named `override`, else the one `model_type`'s template teaches, else None."""
    if override is not None:
        return PARSERS[override]
    name = FAMILY_PARSER.get(model_type)
    return PARSERS[name] if name else None


class ToolStream:
    """Streamed text with calls held back: `push(text)` gives what may be sent now (nothing from
    the first START on, and not a trailing prefix of START); `finish(whole)` parses the whole."""

    def __init__(self, parse):
        self.parse, self.sent, self.held = parse, 0, False

    def push(self, whole: str) -> str:
        """`whole` is all the text so far; returns the new part that is safe to send."""
        if self.held:
            return ""
        at = whole.find(START, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = whole[self.sent:at], at
            return out
        end = len(whole)
        for k in range(min(len(START) - 1, end - self.sent), 0, -1):  # a partial marker at the end waits
            if START.startswith(whole[end - k:]):
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
