"""Tool calls parsed out of a model's text, one format a family (hermes: Qwen2/Qwen3; deepseek_v3;
glm45; kimi_k2), and streamed text holding them back."""

import json

import pytest

from ktflow.serve.tool_parsers import PARSERS, ToolStream, parser_for

hermes, deepseek, glm, kimi = (PARSERS[k] for k in ("hermes", "deepseek_v3", "glm45", "kimi_k2"))


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
    assert parser_for("qwen3_moe") is hermes and parser_for("deepseek_v3") is deepseek
    assert parser_for("glm4_moe") is glm and parser_for("kimi_k2") is kimi and parser_for("mixtral") is None
    assert parser_for("deepseek_v3", "hermes") is hermes
    assert not hermes.special and deepseek.special and glm.special and kimi.special


B, C, S, E, BE = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def test_deepseek_v3_parses_both_of_its_forms():
    v3 = (f"Checking.{B}{C}function{S}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```{E}"
          f"{C}function{S}get_time\n```json\n{{}}\n```{E}{BE}")
    content, calls = deepseek(v3)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    v31 = f"{B}{C}get_weather{S}{{\"city\": \"Oslo\", \"days\": 2}}{E}{BE}"
    content, calls = deepseek(v31)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2}
    cut = f"x{B}{C}get_weather{S}{{\"city\": \"Oslo\"}}"  # cut at max_tokens after the object
    assert [c.name for c in deepseek(cut)[1]] == ["get_weather"]
    for bad in (f"x{B}{C}get_weather{S}not json{E}{BE}", f"x{B}{C}no separator{E}{BE}", f"x{B}{BE}", "plain"):
        assert deepseek(bad) == (bad, []), bad


def test_glm45_parses_name_and_argument_pairs():
    text = ("Let me see.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key><arg_value>{\"t\": \"C\"}"
            "</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>")
    content, calls = glm(text)
    assert content == "Let me see." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "units": {"t": "C"}}
    assert json.loads(calls[1].arguments) == {}
    quoted = '<tool_call>f\n<arg_key>code</arg_key><arg_value>"007"</arg_value></tool_call>'
    assert json.loads(glm(quoted)[1][0].arguments) == {"code": '"007"'}  # a JSON string stays as written
    for bad in ("<tool_call>two words\nhere</tool_call>", "<tool_call>f junk <arg_key>a</arg_key></tool_call>",
                "<tool_call></tool_call>"):
        assert glm(bad) == (bad, []), bad


def test_kimi_k2_parses_its_section_and_keeps_the_call_ids():
    text = ("On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
            "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    content, calls = kimi(text)
    assert content == "On it." and [(c.name, c.id) for c in calls] == [("get_weather", "functions.get_weather:0"),
                                                                       ("get_time", "functions.get_time:1")]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    bad = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0 no arguments<|tool_call_end|>"
    assert kimi(bad) == (bad, [])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_parsers_stream_holds_back_its_marker(name):
    p = PARSERS[name]
    s = ToolStream(p)
    half = len(p.start) // 2
    assert s.push("Hi " + p.start[:half]) == "Hi " and s.push("Hi " + p.start + "rest") == "" and s.held
