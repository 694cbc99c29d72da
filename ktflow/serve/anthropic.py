"""The Anthropic Messages API (`POST /v1/messages`) over the chat machinery: its request, what it
becomes, and its answer.

A `MessagesRequest` becomes a `ChatCompletionRequest` (`to_chat`): `system` is a system message;
a user turn's `tool_result` blocks are tool messages (answering their `tool_use_id`), its text
blocks its content; an assistant turn's `tool_use` blocks are its `tool_calls`; `tools`
(name, description, input_schema) are OpenAI function tools; `stop_sequences` are stop strings;
`tool_choice` auto / none / any / tool maps to auto / none / required / a named function (the
chat path decides what it serves). Every check of the chat path applies. Images, documents and
extended thinking are refused (400). The answer (`message`) is a text block and a `tool_use`
block per parsed call; `stop_reason` is end_turn, max_tokens, stop_sequence (with the string) or
tool_use. `stream_events` gives the streamed form: message_start, a content block's start, its
deltas (text_delta, input_json_delta) and stop, message_delta with the stop reason and the
output tokens, message_stop. Errors are `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from .schemas import ApiError, ChatCompletionRequest, _Body, parse

#: Anthropic's error type for an HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error"}


def error_body(e: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class Block(_Body):
    """A content block: text, tool_use (assistant) or tool_result (user); other kinds refused."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result: text, or text blocks
    is_error: bool | None = None  # tool_result

    def result_text(self) -> str:
        """A tool_result's content as text."""
        if isinstance(self.content, list):
            parts = []
            for b in self.content:
                if b.get("type") != "text" or not isinstance(b.get("text"), str):
                    raise ValueError(f"tool_result {self.tool_use_id}: only text content is supported")
                parts.append(b["text"])
            return "".join(parts)
        return self.content or ""


KINDS = ("text", "tool_use", "tool_result")


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _kinds(cls, v):
        for b in v if isinstance(v, list) else ():
            if isinstance(b, dict) and b.get("type") not in KINDS:
                raise ValueError(f"content blocks of type {b.get('type')!r} are not supported (the models served "
                                 "here read text): send text, tool_use and tool_result blocks")
        return v


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class MessagesRequest(_Body):
    """POST /v1/messages (fields a client may send and ktflow does not use, such as metadata,
    are ignored; extended thinking is refused)."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    ignore_eos: bool = False  # an extension, as on the OpenAI endpoints (fixed lengths for load tests)

    @field_validator("thinking")
    @classmethod
    def _no_thinking(cls, v):
        if v and v.get("type") != "disabled":
            raise ValueError("extended thinking is not supported here (serve --reasoning-parser think splits a "
                             "reasoning model's thinking on the OpenAI endpoint)")
        return v


def _text(content: str | list[Block], role: str) -> tuple[str, list[Block]]:
    """(the text blocks' text, the other blocks) of a turn's content."""
    if isinstance(content, str):
        return content, []
    text = "".join(b.text or "" for b in content if b.type == "text")
    others = [b for b in content if b.type != "text"]
    for b in others:
        if role == "user" and b.type != "tool_result" or role == "assistant" and b.type != "tool_use":
            raise ApiError(400, f"messages: a {role} turn cannot hold a {b.type} block", param="messages")
    return text, others


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request `req` asks for (see the module docstring); a 400 naming the field where
    the chat path refuses it."""
    msgs: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text or "" for b in req.system)
        msgs.append({"role": "system", "content": system})
    for m in req.messages:
        text, blocks = _text(m.content, m.role)
        if m.role == "user":
            for b in blocks:
                try:
                    msgs.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": b.result_text()})
                except ValueError as e:
                    raise ApiError(400, f"messages: {e}", param="messages") from None
            if text or not blocks:
                msgs.append({"role": "user", "content": text})
        else:
            out: dict[str, Any] = {"role": "assistant", "content": text}
            if blocks:
                out["tool_calls"] = [{"id": b.id or "", "type": "function",
                                      "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}}
                                     for b in blocks]
            msgs.append(out)
    body: dict[str, Any] = {"model": req.model, "messages": msgs, "max_tokens": req.max_tokens, "stream": req.stream,
                            "ignore_eos": req.ignore_eos}
    for ours, theirs in (("temperature", req.temperature), ("top_p", req.top_p), ("top_k", req.top_k),
                         ("stop", req.stop_sequences)):
        if theirs is not None:
            body[ours] = theirs
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema}} for t in req.tools]
    if req.tool_choice is not None:
        kind = req.tool_choice.get("type")
        choice = {"auto": "auto", "none": "none", "any": "required"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": req.tool_choice.get("name")}}
        if choice is None:
            raise ApiError(400, f"tool_choice type {kind!r}: send auto, any, tool or none", param="tool_choice")
        body["tool_choice"] = choice
    return parse(ChatCompletionRequest, json.dumps(body).encode())


def stop_reason(finish: str, stop_string: str | None) -> str:
    """Anthropic's stop_reason for the chat path's finish reason."""
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def content_blocks(content: str | None, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The answer's blocks: its text (where there is any), then a tool_use block per call."""
    out: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for c in calls or []:
        out.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"])})
    return out


def message(rid: str, model: str, blocks: list[dict[str, Any]], reason: str | None, stop_string: str | None,
            input_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_string,
            "usage": {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
