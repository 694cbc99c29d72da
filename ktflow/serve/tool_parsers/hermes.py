"""`hermes`: the format Qwen2/Qwen3 (and Hermes) chat templates teach: each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; the text before the
first call is the content. A block that is not such an object leaves all of the text as text."""

from __future__ import annotations

import json

from .base import ParsedCall, ToolParser, call, object_of

START, END = "<tool_call>", "</tool_call>"


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    at = text.find(START)
    if at < 0:
        return text, []
    calls, rest = [], text[at:]
    while rest.startswith(START):
        close = rest.find(END)
        obj = object_of(rest[len(START):close if close >= 0 else len(rest)])
        if obj is None or not isinstance(obj.get("name"), str):
            return text, []  # not a call after all: all of it is text
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append(call(obj["name"], args))
        if close < 0:
            break
        rest = rest[close + len(END):].lstrip()
    content = text[:at].strip()
    return (content or None), calls


def lark(call_schema: str) -> str:
    """One call: the markers around a JSON object of `call_schema`."""
    return f'start: "{START}" call "{END}"\ncall: %json {call_schema}\n'


PARSER = ToolParser("hermes", START, parse, lark=lark)
