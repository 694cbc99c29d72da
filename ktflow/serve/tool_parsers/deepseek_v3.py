"""`deepseek_v3`: DeepSeek-V3 / R1 / V3.1's tool-call tokens. The calls sit between
`<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, each between `<｜tool▁call▁begin｜>` and
`<｜tool▁call▁end｜>`, in one of two forms: V3 and R1 write `function<｜tool▁sep｜>NAME` and the
arguments as a fenced JSON block on the next lines; V3.1 writes `NAME<｜tool▁sep｜>` and the JSON
object. The text before the calls is the content. The markers are special tokens."""

from __future__ import annotations

from .base import ParsedCall, ToolParser, call, object_of, section_calls

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _one(body: str) -> ParsedCall | None:
    """One call's text between its begin and end markers, or None where it does not parse."""
    left, sep, right = body.partition(SEP)
    if not sep:
        return None
    if left.strip() == "function":  # V3 / R1: the name, then ```json ... ```
        name, _, args = right.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args[3:]
            args = args[4:] if args.startswith("json") else args
            args = args.rsplit("```", 1)[0] if "```" in args else args
    else:  # V3.1
        name, args = left, right
    obj = object_of(args)
    name = name.strip()
    return call(name, obj) if obj is not None and name else None


def parse(text: str) -> tuple[str | None, list[ParsedCall]]:
    return section_calls(text, CALLS, CALLS_END, CALL, CALL_END, _one)


PARSER = ToolParser("deepseek_v3", CALLS, parse, special=True)
