"""`kimi_k2`: Kimi-K2's format: the calls between `<|tool_calls_section_begin|>` and
`<|tool_calls_section_end|>`, each `<|tool_call_begin|>functions.NAME:INDEX` then
`<|tool_call_argument_begin|>` and the JSON object, then `<|tool_call_end|>`. The call's id is
its header (`functions.NAME:INDEX`), as Kimi's template writes it back. The text before the
calls is the content. The markers are special tokens."""

from __future__ import annotations

from .base import ParsedCall, ToolParser, call, object_of, section_calls

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _one(body: str) -> ParsedCall | None:
    """One call's text (`functions.NAME:INDEX`, the argument marker, the object), or None."""
    header, sep, args = body.partition(ARGS)
    header = header.strip()
    name = header.removeprefix("functions.").rsplit(":", 1)[0]
    obj = object_of(args)
    return call(name, obj, id=header) if sep and name and obj is not None else None


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    return section_calls(text, SECTION, SECTION_END, CALL, CALL_END, _one)


PARSER = ToolParser("kimi_k2", SECTION, parse, special=True)
