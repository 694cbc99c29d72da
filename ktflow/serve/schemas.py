"""Request and response bodies of the OpenAI-compatible endpoints, as pydantic models.

Requests are validated here, strictly (JSON types as OpenAI's: no string for a number or a
boolean, no number for a boolean; an explicit null where the field has a default means the
default), with ranges and `n` up to MAX_CHOICES; what needs the model (the prompt's length
against `max_seq_len`, the model name) is checked by the app. A failed validation becomes an
`ApiError` whose `param` names the field, which the app answers with HTTP 400 and the OpenAI
error body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..backends.sampling import SamplingParamError, SamplingParams


class ApiError(Exception):
    """An error answered to the client: HTTP `status`, a one-line `message`, the request field it
    is about (`param`, or None) and the OpenAI error `type`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


#: the most choices (`n`) one request may ask for: each is a sequence of its own, in a slot of its own
MAX_CHOICES = 16


class _Body(BaseModel):
    """A request body's part: JSON types as OpenAI's, no coercion (fields it does not know are
    ignored, pydantic's default)."""

    model_config = ConfigDict(strict=True)


class _Request(_Body):
    """Fields the two generation endpoints share. Fields ktflow does not use (user, metadata,
    ...) are accepted and ignored; ones that would change the answer and are not supported
    (echo, best_of > 1) are refused."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    # token selection beyond OpenAI's two (backends.sampling); selected on the GPU in the decode step
    top_k: int | None = Field(default=None, ge=0)  # an extension (0: no limit)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)  # an extension
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # an extension
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> bias in [-100, 100]
    stop: str | list[str] | list[int] | None = None
    stop_token_ids: list[int] | None = None  # an extension: stop at any of these token ids
    ignore_eos: bool = False  # an extension: generate past eos (fixed lengths for load tests)
    n: int = 1
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (serve/grammar.py)
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        kind = (v or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {kind!r}: send 'text', 'json_object' or 'json_schema'")
        return v

    def structured(self) -> dict[str, Any] | None:
        """The response_format that constrains the output (json_object, json_schema), or None."""
        return self.response_format if (self.response_format or {}).get("type", "text") != "text" else None

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in 1..{MAX_CHOICES}, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids, got {key!r}") from None
            if not -100.0 <= bias <= 100.0:  # NaN fails this too
                raise ValueError(f"logit_bias for token {key} must be in [-100, 100], got {bias}")
        return v

    def reported(self) -> int | None:
        """How many most likely tokens each selected token's report lists (None: no report)."""
        return None

    def sampling(self, vocab: int, defaults: dict[str, Any] | None = None):
        """The request's token selection as SamplingParams, checked against the vocabulary (an
        ApiError naming the field otherwise); a field the request leaves out takes `defaults`'
        value (the checkpoint's generation_config.json) where it names one."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        for k, v in (defaults or {}).items():
            if k in given and k not in self.model_fields_set:
                given[k] = v
        try:
            return SamplingParams.make(temperature=given["temperature"], top_p=given["top_p"], seed=self.seed,
                                       top_k=given["top_k"], min_p=given["min_p"],
                                       repetition_penalty=given["repetition_penalty"],
                                       presence_penalty=self.presence_penalty,
                                       frequency_penalty=self.frequency_penalty,
                                       logit_bias=self.logit_bias, logprobs=self.reported()).check(vocab)
        except SamplingParamError as e:
            raise ApiError(400, str(e), param=e.param) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v):
        ok = v is None or isinstance(v, str) or isinstance(v, list) and (
            all(isinstance(s, str) for s in v) or all(isinstance(s, int) and not isinstance(s, bool) for s in v))
        if not ok:
            raise ValueError("stop must be a string, a list of strings, or a list of token ids")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError(f"at most 16 stop sequences, got {len(v)}")
        if isinstance(v, list) and any(isinstance(s, str) and not s for s in v) or v == "":
            raise ValueError("a stop string must not be empty")
        return v

    def stop_strings(self) -> list[str]:
        if isinstance(self.stop, str):
            return [self.stop]
        return [s for s in self.stop or [] if isinstance(s, str)]

    def stop_ids(self) -> list[int]:
        ids = [s for s in self.stop or [] if isinstance(s, int)] if isinstance(self.stop, list) else []
        return ids + list(self.stop_token_ids or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolFunction(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class Tool(_Body):
    type: Literal["function"]
    function: ToolFunction


class CalledFunction(_Body):
    name: str
    arguments: str  # a JSON object's text


class MessageToolCall(_Body):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None  # required; null only where the role allows it
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's thinking (templates may drop it)

    @model_validator(mode="after")
    def _content_for_role(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required in a {self.role!r} message")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as transformers passes it to a chat template."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # further template variables (enable_thinking)
    tools: list[Tool] | None = None
    _opened: bool = PrivateAttr(default=False)  # the rendered prompt opens a thinking block (the app sets it)
    tool_choice: str | dict[str, Any] | None = None  # none / auto (default with tools) / required / a function
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    functions: list[Any] | None = None  # the legacy form of tools
    function_call: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} (the legacy form) is not supported: send tools and tool_choice")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def reported(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str)
        if v is not None and v not in ("none", "auto", "required") and not named:
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                             "{'name': ...}}")
        return v

    def calls_tools(self) -> bool:
        """Whether the tools reach the template (some given, tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs(cls, v):
        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(v or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)} (the server sets those)")
        return v

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        ids = lambda x: isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)  # noqa: E731
        ok = isinstance(v, str) or ids(v) or isinstance(v, list) and (
            all(isinstance(p, str) for p in v) or all(ids(p) for p in v))
        if not ok:
            raise ValueError("prompt must be a string, a list of token ids, or a list holding one of those")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            v = v[0]
        if isinstance(v, (list, str)) and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        if v and not (info.field_name == "best_of" and v == 1):
            raise ValueError(f"{info.field_name} is not supported")
        return v

    def reported(self) -> int | None:
        return self.logprobs

    def limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Body):
    """POST /tokenize: a prompt's ids as the completions endpoint encodes it, or messages' as the
    chat endpoint renders and encodes them (one of the two)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """POST /detokenize: the text of token ids."""

    model: str | None = None
    tokens: list[int]


def parse(cls: type[BaseModel], raw: bytes) -> Any:
    """The request body `raw` as `cls`, or an ApiError (400) naming the field that is wrong."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    # an explicit null where the field has a default (OpenAI's clients send them) means the default
    data = {k: v for k, v in data.items() if not (v is None and k in cls.model_fields
                                                   and cls.model_fields[k].default is not None
                                                   and not cls.model_fields[k].is_required())}
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        er = e.errors()[0]
        loc = [str(p) for p in er["loc"] if not _is_union_branch(p)]
        param = ".".join(loc) or None
        msg = er["msg"].removeprefix("Value error, ")
        more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
        where = param or "request"
        text = msg if msg.startswith(where) else f"{where}: {msg}"
        raise ApiError(400, f"{text}{more}", param=loc[0] if loc else None) from None


def _is_union_branch(p: Any) -> bool:
    """pydantic names the branch of a union it tried in the error location ('str', 'list[int]')."""
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("function-"))


# ------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV entries a slot held from an earlier request (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatChoiceMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
