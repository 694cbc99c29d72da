"""Tool calls parsed out of a model's text (hermes: Qwen2/Qwen3), and streamed text holding them back."""

import json

from ktflow.serve.tool_parsers import ToolStream, hermes, parser_for


def test_hermes_parses_one_or_several_calls_and_leaves_the_rest_as_text():
    content, calls = hermes('Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert content == "Sure." and [c.name for c in calls] == ["a", "b"]
    assert [json.loads(c.arguments) for c in calls] == [{"x": 1}, {"y": 2}] and calls[0].id != calls[1].id
    assert hermes("no calls here") == ("no calls here", [])
    bad = 'x <tool_call>{"name": 3}</tool_call>'
    assert hermes(bad) == (bad, [])  # not a call: all of it is text
    assert hermes('<tool_call>not json</tool_call>') == ('<tool_call>not json</tool_call>', [])
    content, calls = hermes('<tool_call>{"name": "a", "arguments": {}}')  # cut at max_tokens after the object
    assert content is None and [c.name for c in calls] == ["a"]


def test_a_stream_never_sends_call_markup_even_split_across_chunks():
    s = ToolStream(hermes)
    whole, sent = "", ""
    for piece in ["Hi <to", "ol_ca", 'll>{"name": "a", "arguments": {}}', "</tool_call>"]:
        whole += piece
        sent += s.push(whole)
    assert sent == "Hi " and s.finish(whole)[1][0].name == "a"
    s2 = ToolStream(hermes)
    assert s2.push("a <to") == "a " and s2.push("a <tomato") == "<tomato"  # a prefix that was not a marker
    assert s2.finish("a <tomato") == ("", [])


def test_the_parser_follows_the_family_unless_overridden():
    assert parser_for("qwen3_moe") is hermes and parser_for("deepseek_v3") is None
    assert parser_for("deepseek_v3", "hermes") is hermes
