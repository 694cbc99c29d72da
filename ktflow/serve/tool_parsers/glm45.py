"""`glm45`: GLM-4.5 / 4.6's format: each call `<tool_call>NAME` then its arguments as
`<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs (blank space between), then
`</tool_call>`. A value that reads as JSON other than a string (a number, true, an object) is
that value; any other value is the string as written. The text before the first call is the
content. The markers are special tokens."""

from __future__ import annotations

import json
import re

from .base import ParsedCall, ToolParser, call

START, END = "<tool_call>", "</tool_call>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _value(text: str):
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(v, str) else v


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    at = text.find(START)
    if at < 0:
        return text, []
    calls = []
    for piece in text[at:].split(START)[1:]:
        body = piece.split(END, 1)[0]
        name = body.split("<arg_key>", 1)[0].strip()
        rest = body[len(body.split("<arg_key>", 1)[0]):]
        pairs = PAIR.findall(rest)
        if not name or "\n" in name or PAIR.sub("", rest).strip():  # a name, then pairs and nothing else
            return text, []
        calls.append(call(name, {k.strip(): _value(v) for k, v in pairs}))
    content = text[:at].strip()
    return (content or None), calls


PARSER = ToolParser("glm45", START, parse, special=True)
