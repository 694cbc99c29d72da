"""`kimi_k2`: Kimi-K2's format: the calls between `<|tool_calls_section_begin|>` and
`<|tool_calls_section_end|>`, each `<|tool_call_begin|>functions.NAME:INDEX` then
`<|tool_call_argument_begin|>` and the JSON object, then `<|tool_call_end|>`. The call's id is
its header (`functions.NAME:INDEX`), as Kimi's template writes it back. The text before the
calls is the content. The markers are special tokens."""

from __future__ import annotations

from .base import ParsedCall, ToolParser, call, object_of

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    at = text.find(SECTION)
    if at < 0:
        return text, []
    section = text[at + len(SECTION):].split(SECTION_END, 1)[0]
    calls = []
    for piece in section.split(CALL)[1:]:
        header, sep, args = piece.split(CALL_END, 1)[0].partition(ARGS)
        header = header.strip()
        name = header.removeprefix("functions.").rsplit(":", 1)[0]
        obj = object_of(args)
        if not sep or not name or obj is None:
            return text, []
        calls.append(call(name, obj, id=header))
    if not calls:
        return text, []
    content = text[:at].strip()
    return (content or None), calls


PARSER = ToolParser("kimi_k2", SECTION, parse, special=True)
