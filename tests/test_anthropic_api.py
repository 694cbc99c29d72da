"""The Anthropic Messages API (`POST /v1/messages`) through the official `anthropic` client: the
same answers as the chat endpoint, stop reasons, streaming, tools both ways, errors in its form."""

import json

import anthropic
import openai
import pytest

from test_serve import (TOOL_TEMPLATE, ScriptedRunner, compiled, running, serve_dir, tok)  # noqa: F401

WEATHER_TOOL = {"name": "get_weather", "description": "the weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def server(compiled, tok):  # noqa: F811
    with running(compiled, tok, slots=2, prefill_tokens=32, api_key="sekret") as s:
        yield s


def _clients(base: str):
    return (anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0, timeout=60),
            openai.OpenAI(base_url=base + "/v1", api_key="sekret", max_retries=0, timeout=60))


def test_a_message_is_the_chat_endpoints_answer_with_its_stop_reason(server):
    a, o = _clients(server[0])
    msgs = [{"role": "user", "content": "say something"}]
    chat = o.chat.completions.create(model="demo", messages=msgs, max_tokens=12, temperature=0,
                                     extra_body=dict(ignore_eos=True))
    text = chat.choices[0].message.content
    m = a.messages.create(model="demo", max_tokens=12, messages=msgs, extra_body=dict(temperature=0))
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and text.startswith(m.content[0].text)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    cut = a.messages.create(model="demo", max_tokens=3, messages=msgs, extra_body=dict(temperature=0, ignore_eos=True))
    assert cut.usage.output_tokens == 3 and cut.stop_reason == "max_tokens"
    stop = text[4:7]
    assert stop and stop not in text[:4]
    s = a.messages.create(model="demo", max_tokens=12, messages=msgs, stop_sequences=[stop],
                          extra_body=dict(temperature=0))
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop and s.content[0].text == text[:4]
    with a.messages.stream(model="demo", max_tokens=12, messages=msgs, extra_body=dict(temperature=0)) as st:
        streamed = "".join(st.text_stream)
        final = st.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text and final.stop_reason == m.stop_reason
    system = a.messages.create(model="demo", max_tokens=4, messages=msgs, system="be brief",
                               extra_body=dict(temperature=0))
    assert system.usage.input_tokens + system.usage.cache_read_input_tokens > m.usage.input_tokens + \
        m.usage.cache_read_input_tokens  # the system prompt reached the template


def test_errors_come_in_the_messages_apis_form(server):
    base = server[0]
    a, _ = _clients(base)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        a.post("/v1/messages", body={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
               cast_to=object)
    with pytest.raises(anthropic.BadRequestError, match="not served here"):
        a.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="extended thinking"):
        a.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                          thinking={"type": "enabled", "budget_tokens": 1024})
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "x"}])


def test_tools_go_both_ways(compiled, tok, serve_dir, tmp_path):  # noqa: F811
    """A call parsed into a tool_use block (stop_reason tool_use, streamed or not), and the
    assistant's tool_use and the user's tool_result going back into the template as the chat
    endpoint's tool_calls and tool messages."""
    from ktflow.serve.tokenizer import ServeTokenizer

    f = tmp_path / "tools.jinja"
    f.write_text(TOOL_TEMPLATE)
    t = ServeTokenizer.from_dir(serve_dir, chat_template=f)
    answer = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    runner = ScriptedRunner.answering(compiled, t, answer)
    with running(compiled, t, runner=runner, tool_parser="hermes") as (base, _, _):
        a = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "weather in Paris?"}]
        m = a.messages.create(model="demo", max_tokens=90, messages=msgs, tools=[WEATHER_TOOL])
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
        assert m.content[0].text == "Let me look."
        use = m.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id
        with a.messages.stream(model="demo", max_tokens=90, messages=msgs, tools=[WEATHER_TOOL]) as st:
            final = st.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[0].text == "Let me look."
        assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Paris"}
        turn = msgs + [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                           "input": {"city": "Paris"}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                     "content": [{"type": "text", "text": "sunny"}]}]}]
        back = a.messages.create(model="demo", max_tokens=8, messages=turn, tools=[WEATHER_TOOL], system="sys")
        want = [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                                   "parameters": WEATHER_TOOL["input_schema"]}}]
        text = t.render_chat(want, None, tools)
        assert "sunny(toolu_1)" in text and '<tool_call>get_weather({"city": "Paris"})' in text
        assert back.usage.input_tokens + back.usage.cache_read_input_tokens == len(t.encode_rendered(text, want))
