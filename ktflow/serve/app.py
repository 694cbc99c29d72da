"""The HTTP app (Starlette): OpenAI-compatible endpoints over the serving engine.

- `POST /v1/chat/completions`, `POST /v1/completions`: a whole answer, or with `"stream": true`
  server-sent events in OpenAI's chunk format ending with `data: [DONE]`;
- `GET /v1/models`, `GET /health` (the queue, the running batch, the free slots), `GET /metrics`
  (Prometheus text format).

Errors are answered in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400
for a request that cannot be served as sent (the field named in `param`), 401 without the API
key (when one is set), 429 with `Retry-After` when the queue is full, 503 while shutting down,
500 when the model failed on this request (the server goes on). A client that disconnects
cancels its sequence, which frees its slot at the scheduler's next iteration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Delta, Draining, Engine, Failed, Finished, GenRequest, QueueFull
from .metrics import ServerMetrics
from .schemas import (ApiError, ChatChoice, ChatChoiceMessage, ChatCompletion, ChatCompletionRequest, Completion,
                      CompletionChoice, CompletionRequest, DetokenizeRequest, PromptTokensDetails, TokenizeRequest,
                      Usage, parse)
from .tokenizer import ServeTokenizer, TemplateError
from .reasoning import ThinkSplit, opens_thinking
from .reasoning import split as split_thinking
from . import anthropic
from .tool_parsers import PARSERS, ToolStream

#: status recorded for a request whose client went away before its answer
CLIENT_GONE = 499
#: how often a request waiting for a whole answer checks that its client is still there
DISCONNECT_POLL_S = 0.25


#: the largest request body read (--max-body-mb): an agent's 30k-token history is well under 1 MB
DEFAULT_MAX_BODY_BYTES = 16 << 20


class ServeApp:
    """The routes and what they share: the engine, the tokenizer, the model's name and limits."""

    def __init__(self, engine: Engine, tokenizer: ServeTokenizer, model_name: str, *, api_key: str | None = None,
                 metrics: ServerMetrics | None = None, vocab_size: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, sampling_defaults: dict | None = None,
                 model_type: str = "", tool_parser=None, reasoning: bool = False, body_timeout_s: float = 30.0,
                 grammars=None):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.body_timeout_s = body_timeout_s  # a request body must arrive within this (408)
        self.grammars = grammars  # serve/grammar.Grammars: response_format's grammars (None: refused)
        self.sampling_defaults = sampling_defaults or {}  # generation_config.json's, for fields a request leaves out
        self.model_type, self.tool_parser = model_type, tool_parser  # tool_parsers: this model's calls, or None
        self.reasoning = reasoning  # split <think>...</think> into reasoning_content
        self.max_body_bytes = max_body_bytes
        self.max_seq_len = engine.runner.max_seq_len
        self.vocab_size = vocab_size or engine.runner.vocab_size
        self.api_key = api_key
        self.metrics = metrics or ServerMetrics(engine.stats)
        self.created = int(time.time())

    def starlette(self) -> Starlette:
        @asynccontextmanager
        async def lifespan(app):
            yield
            self.engine.stop(timeout=0.0)  # after the server's graceful wait: whatever still runs is cancelled

        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

        async def not_routed(request: Request, exc) -> JSONResponse:  # 404 / 405 as OpenAI error bodies
            status = getattr(exc, "status_code", 404)
            what = (f"no route {request.url.path}" if status == 404 else
                    f"{request.method} is not allowed on {request.url.path}")
            e = ApiError(status, f"{what} (the routes: /v1/chat/completions, /v1/completions, /v1/messages, "
                         "/v1/models, /tokenize, /detokenize, /health, /metrics)", type="invalid_request_error")
            return JSONResponse(e.body(), status_code=status, headers=getattr(exc, "headers", None) or {})

        return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_routed, 405: not_routed})

    # -------------------------------------------------------------------------------- helpers
    def _error(self, endpoint: str, e: ApiError) -> JSONResponse:
        self.metrics.request(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send x-api-key
            key = request.headers.get("x-api-key", "") if not given else ""
        if not key or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>' (or "
                           "'x-api-key: <key>')", type="authentication_error")

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(400, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                           param="model")

    def _limits(self, ids: list[int], limit: int | None, field: str) -> int:
        """max_tokens for a prompt of `ids`: the request's, or all the room left; 400 naming the
        field when the prompt or the request does not fit max_seq_len."""
        n, ctx = len(ids), self.max_seq_len
        if n == 0:
            raise ApiError(400, f"{field}: the prompt encodes to no tokens", param=field)
        if n >= ctx:
            raise ApiError(400, f"{field}: the prompt has {n} tokens; this model's context is {ctx} tokens, so a "
                           f"prompt may have {ctx - 1} at most", param=field)
        if limit is None:
            return ctx - n
        if n + limit > ctx:
            raise ApiError(400, f"max_tokens: the prompt ({n} tokens) + max_tokens ({limit}) exceed this model's "
                           f"context of {ctx} tokens; ask for {ctx - n} at most", param="max_tokens")
        return limit

    def _constrained(self, body, sampling):
        """`sampling` with the grammar the request's answer must follow (response_format, or
        tool_choice required / a named function), or a 400 saying why it cannot be; run off the
        event loop (a grammar's compile, and the first one's tokenizer, take a while)."""
        fmt = body.structured()
        forced = isinstance(body, ChatCompletionRequest) and body.calls_tools() and body.tool_choice not in (None, "auto")
        if forced:  # the answer is one call (serve/grammar.py)
            if fmt is not None or body.ignore_eos:
                raise ApiError(400, "tool_choice required or a named function makes the answer a call: leave out "
                               "response_format and ignore_eos", param="tool_choice")
            try:
                tools = [t.model_dump(exclude_none=True) for t in body.tools]
                sampling = dataclasses.replace(sampling, grammar=self.grammars.tool_call(tools, body.tool_choice,
                                                                                        self.tool_parser))
            except ImportError:
                raise ApiError(400, "tool_choice required needs the llguidance package on the server (pip install "
                               "llguidance)", param="tool_choice") from None
            except ValueError as e:
                raise ApiError(400, str(e), param="tool_choice") from None
        if fmt is not None:  # the output follows the format's grammar (serve/grammar.py)
            if body.ignore_eos:
                raise ApiError(400, "ignore_eos with response_format: a structured answer ends at its value's end",
                               param="ignore_eos")
            if self.grammars is None:
                raise ApiError(400, "response_format: this server has no structured output", param="response_format")
            try:
                sampling = dataclasses.replace(sampling, grammar=self.grammars.compile(fmt))
            except ImportError:
                raise ApiError(400, "response_format needs the llguidance package on the server (pip install "
                               "llguidance)", param="response_format") from None
            except ValueError as e:
                raise ApiError(400, str(e), param="response_format") from None
        return sampling

    async def _submit(self, body, ids: list[int], max_tokens: int, rid: str = "") -> tuple[list[GenRequest], asyncio.Queue]:
        """The request's `n` sequences queued (choice i sampled with seed + i where a seed is
        given); their events arrive on one queue as (choice, event). All or none: a full queue
        cancels the ones already queued."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop_ids = body.stop_ids()
        self._check_ids(stop_ids, "stop")
        sampling = body.sampling(self.vocab_size, self.sampling_defaults)
        if body.structured() is not None or (isinstance(body, ChatCompletionRequest) and body.calls_tools()
                                             and body.tool_choice not in (None, "auto")):
            sampling = await asyncio.to_thread(self._constrained, body, sampling)
        # a parser whose markers are special tokens reads them: the answer keeps its special tokens
        keep = isinstance(body, ChatCompletionRequest) and body.calls_tools() and self.tool_parser.special
        reqs: list[GenRequest] = []
        for i in range(body.n):
            params = sampling if sampling.seed is None or i == 0 else \
                dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 64))
            reqs.append(GenRequest(prompt_ids=ids, max_tokens=max_tokens, sampling=params, stops=body.stop_strings(),
                                   stop_ids=frozenset(stop_ids), ignore_eos=body.ignore_eos,
                                   tag=rid if body.n == 1 else f"{rid}/{i}", decode=self.tok.decode_all if keep else None,
                                   emit=lambda ev, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, ev))))
        try:
            for req in reqs:
                self.engine.submit(req)
        except (QueueFull, Draining) as e:
            for req in reqs:
                self.engine.cancel(req)
            if isinstance(e, Draining):
                raise ApiError(503, "the server is shutting down", type="server_error") from None
            raise ApiError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        return reqs, queue

    async def _wait(self, request: Request, reqs: list[GenRequest], queue: asyncio.Queue):
        """Every choice's final event (Finished or Failed), by choice, or None when the client
        went away (its sequences are cancelled)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        final: dict[int, Any] = {}
        while len(final) < len(reqs):
            try:
                item = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                item = None
            except asyncio.CancelledError:
                for req in reqs:
                    self.engine.cancel(req)
                raise
            if item is not None and isinstance(item[1], (Finished, Failed)):
                final[item[0]] = item[1]
                continue
            if loop.time() - checked >= DISCONNECT_POLL_S:  # also while tokens keep coming
                checked = loop.time()
                if await request.is_disconnected():
                    for req in reqs:
                        self.engine.cancel(req)
                    return None
        return [final[i] for i in range(len(reqs))]

    # ------------------------------------------------------------------------------ endpoints
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _read_body(self, request: Request) -> bytes:
        """The body, read no further than max_body_bytes (413 past it, or at once where the
        declared length says so), all of it within body_timeout_s (408 past it)."""
        limit = self.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit / 2**20:g} MB (--max-body-mb)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                           f"({n} bytes came; --request-timeout)", headers={"Connection": "close"}) from None
        return b"".join(chunks)

    def _prepare(self, raw: bytes, chat: bool):
        """The request parsed and its prompt tokenized (run off the event loop: a large body or a
        slow template never stalls the other clients): (body, prompt ids, the prompt's field)."""
        return self._prepare_body(parse(ChatCompletionRequest if chat else CompletionRequest, raw), chat)

    def _prepare_body(self, body, chat: bool):
        """A parsed request's prompt tokenized: (body, prompt ids, the prompt's field)."""
        self._check_model(body.model)
        if chat:
            tools = None
            if body.calls_tools():
                self._check_tools(body)
                tools = [t.model_dump(exclude_none=True) for t in body.tools]
            text, ids = self._encode_chat(body.messages, body.chat_template_kwargs, tools)
            body._opened = self.reasoning and opens_thinking(text)  # the answer starts inside its thinking
            return body, ids, "messages"
        if isinstance(body.prompt, str):
            return body, self.tok.encode(body.prompt), "prompt"
        ids = list(body.prompt)
        self._check_ids(ids, "prompt")
        return body, ids, "prompt"

    def _check_ids(self, ids: list[int], field: str) -> None:
        """A 400 naming `field` for the first id outside the vocabulary."""
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{field}: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                           param=field)

    def _encode_chat(self, messages, kwargs=None, tools=None) -> tuple[str, list[int]]:
        """Chat messages (request models) rendered with the template and encoded: (text, ids);
        a template's refusal is a 400 naming messages."""
        plain = [m.for_template() for m in messages]
        try:
            text = self.tok.render_chat(plain, kwargs, tools)
            return text, self.tok.encode_rendered(text, plain)
        except TemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None

    def _check_tools(self, body) -> None:
        """Tools are answered only where this model's calls can be parsed, and only as 'auto'."""
        if self.tool_parser is None:
            raise ApiError(400, f"tools: tool calls of this model ({self.model_type}) are not parsed yet (parsers: "
                           f"{', '.join(PARSERS)}; serve --tool-parser NAME picks one)", param="tools")
        if body.tool_choice not in (None, "auto") and (self.tool_parser.lark is None or self.grammars is None):
            raise ApiError(400, f"tool_choice {body.tool_choice!r} constrains the answer to a call, which this "
                           f"model's call format ({self.tool_parser.name}) cannot be yet: use 'auto' (or 'none')",
                           param="tool_choice")

    def _message(self, body, text: str, reason: str) -> tuple[ChatChoiceMessage, str]:
        """The answer's message: with a reasoning parser its thinking apart (reasoning_content);
        with tools, its calls parsed out (finish_reason 'tool_calls')."""
        thinking = None
        if self.reasoning:
            thinking, text = split_thinking(text, body._opened)
        if body.calls_tools():
            content, calls = self.tool_parser(text)
            if calls:
                return ChatChoiceMessage(content=content, reasoning_content=thinking,
                                         tool_calls=[c.openai() for c in calls]), "tool_calls"
        return ChatChoiceMessage(content=text, reasoning_content=thinking), reason

    async def _generate(self, request: Request, chat: bool) -> Response:
        endpoint = request.url.path
        try:
            self._check_key(request)
            body, ids, field = await asyncio.to_thread(self._prepare, await self._read_body(request), chat)
            max_tokens = self._limits(ids, body.limit(), field)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            reqs, queue = await self._submit(body, ids, max_tokens, rid)
        except ApiError as e:
            return self._error(endpoint, e)
        if body.stream:
            return StreamingResponse(self._stream(reqs, queue, body, rid, chat, endpoint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        evs = await self._wait(request, reqs, queue)
        if evs is None:
            self.metrics.request(endpoint, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        errors = [e for e in map(_unfinished, evs) if e is not None]
        if errors:  # a failure (500) before a shutdown (503)
            return self._error(endpoint, min(errors, key=lambda e: e.status))
        self.metrics.request(endpoint, 200)
        completion = sum(ev.completion_tokens for ev in evs)
        usage = Usage(prompt_tokens=evs[0].prompt_tokens, completion_tokens=completion,
                      total_tokens=evs[0].prompt_tokens + completion,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=evs[0].cached_tokens))
        if chat:
            answers = [self._message(body, ev.text, ev.reason) for ev in evs]
            out: Any = ChatCompletion(id=rid, created=int(time.time()), model=self.model_name, usage=usage,
                                      choices=[ChatChoice(index=i, message=m, finish_reason=reason,
                                                          logprobs=self._logprobs(ev.logprobs, chat))
                                               for i, ((m, reason), ev) in enumerate(zip(answers, evs))])
        else:
            out = Completion(id=rid, created=int(time.time()), model=self.model_name, usage=usage,
                             choices=[CompletionChoice(index=i, text=ev.text, finish_reason=ev.reason,
                                                       logprobs=self._logprobs(ev.logprobs, chat))
                                      for i, ev in enumerate(evs)])
        return JSONResponse(out.model_dump())

    def _logprobs(self, entries: list | None, chat: bool, offset: int = 0) -> dict[str, Any] | None:
        """Selected tokens' TokenLogprobs in OpenAI's form: chat's `content` list (each token's
        text, logprob, UTF-8 bytes and top_logprobs), or the completions endpoint's parallel
        lists (tokens, token_logprobs, top_logprobs, text_offset from `offset`). A token's text is
        its id decoded alone."""
        if entries is None:
            return None
        text = self.tok.decode

        def one(i: int, lp: float) -> dict[str, Any]:
            t = text([i])
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}

        if chat:
            return {"content": [dict(one(e.id, e.logprob), top_logprobs=[one(i, v) for i, v in e.top])
                                for e in entries]}
        tokens = [text([e.id]) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text([i]): v for i, v in e.top} for e in entries], "text_offset": offsets}

    # ----------------------------------------------------------------- the Anthropic Messages API
    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (serve/anthropic.py): one answer, streamed or not."""
        endpoint = request.url.path
        try:
            self._check_key(request)
            raw = await self._read_body(request)

            def prepare():
                return self._prepare_body(anthropic.to_chat(parse(anthropic.MessagesRequest, raw)), True)

            body, ids, field = await asyncio.to_thread(prepare)
            max_tokens = self._limits(ids, body.limit(), field)
            rid = f"msg_{uuid.uuid4().hex[:24]}"
            reqs, queue = await self._submit(body, ids, max_tokens, rid)
        except ApiError as e:
            self.metrics.request(endpoint, e.status)
            return JSONResponse(anthropic.error_body(e), status_code=e.status, headers=e.headers)
        if body.stream:
            return StreamingResponse(self._message_events(reqs[0], queue, body, rid, endpoint),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        evs = await self._wait(request, reqs, queue)
        if evs is None:
            self.metrics.request(endpoint, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        ev = evs[0]
        e = _unfinished(ev)
        if e is not None:
            self.metrics.request(endpoint, e.status)
            return JSONResponse(anthropic.error_body(e), status_code=e.status)
        self.metrics.request(endpoint, 200)
        msg, reason = self._message(body, ev.text, ev.reason)
        return JSONResponse(anthropic.message(rid, self.model_name, anthropic.content_blocks(msg.content, msg.tool_calls),
                                              anthropic.stop_reason(reason, ev.stop_string), ev.stop_string,
                                              ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens))

    async def _message_events(self, req: GenRequest, queue: asyncio.Queue, body, rid: str, endpoint: str):
        """The Messages API's server-sent events for one answer (serve/anthropic.py): a text block
        as its text comes (calls held back where tools were given), then a tool_use block per
        parsed call, the stop reason and the output tokens. A client that goes away cancels it."""
        sse = anthropic.sse
        held = ToolStream(self.tool_parser) if body.calls_tools() else None
        blocks = 0  # content blocks opened so far (the text block, where there is text, is block 0)
        ended, sofar = False, ""

        def text_events(text: str):
            """The text block's delta of `text`, opening the block first where it is not open."""
            nonlocal blocks
            if not blocks:
                blocks = 1
                yield sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
            yield sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})

        try:
            yield sse("message_start", {"type": "message_start", "message": anthropic.message(
                rid, self.model_name, [], None, None, len(req.prompt_ids), 0, 0)})
            while True:
                _, ev = await queue.get()
                if isinstance(ev, Delta):
                    sofar += ev.text
                    text = held.push(sofar) if held is not None else ev.text
                    if text:
                        for out in text_events(text):
                            yield out
                    continue
                ended = True
                e = _unfinished(ev)
                if e is not None:
                    self.engine.cancel(req)
                    self.metrics.request(endpoint, 500)
                    yield sse("error", anthropic.error_body(e))
                    return
                calls, reason = [], ev.reason
                if held is not None:
                    rest, parsed = held.finish(ev.text)
                    calls = [c.openai() for c in parsed]
                    if rest:
                        for out in text_events(rest):
                            yield out
                    reason = "tool_calls" if calls else reason
                if blocks:
                    yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                for c in calls:
                    block = anthropic.content_blocks(None, [c])[0]
                    yield sse("content_block_start", {"type": "content_block_start", "index": blocks,
                                                      "content_block": dict(block, input={})})
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": blocks, "delta": {
                        "type": "input_json_delta", "partial_json": c["function"]["arguments"]}})
                    yield sse("content_block_stop", {"type": "content_block_stop", "index": blocks})
                    blocks += 1
                self.metrics.request(endpoint, 200)
                yield sse("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": anthropic.stop_reason(reason, ev.stop_string), "stop_sequence": ev.stop_string},
                    "usage": {"output_tokens": ev.completion_tokens}})
                yield sse("message_stop", {"type": "message_stop"})
                return
        finally:
            if not ended:  # the client went away: free the slot
                self.engine.cancel(req)
                self.metrics.request(endpoint, CLIENT_GONE)

    async def _stream(self, reqs: list[GenRequest], queue: asyncio.Queue, body, rid: str, chat: bool, endpoint: str):
        """Server-sent events: a chunk per delta of text of each choice (its index in it), one with
        each choice's finish reason, optionally one with the usage, then [DONE]. A client that goes
        away cancels the sequences. The request is counted when the stream ends, by its outcome:
        200, 500 (failed after the 200 was sent) or 499 (the client went away)."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        reports = body.reported() is not None
        unsent: list[list] = [[] for _ in reqs]  # each choice's token reports not sent yet
        offsets = [0 for _ in reqs]  # each choice's text sent so far (completions' text_offset)

        def report(i: int, text: str | None) -> dict[str, Any] | None:
            """The choice's token reports not sent yet (they go with its next chunk)."""
            if not reports or not unsent[i]:
                return None
            out = self._logprobs(unsent[i], chat, offsets[i])
            unsent[i] = []
            offsets[i] += len(text or "")
            return out

        def chunk(i: int, text: str | None, finish: str | None, first: bool = False, calls=None,
                  thinking: str | None = None) -> str:
            logprobs = None if first else report(i, text)
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if thinking:
                    delta["reasoning_content"] = thinking
                if text is not None:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = [dict(c.openai(), index=k) for k, c in enumerate(calls)]
                choice: dict[str, Any] = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return _sse({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]})

        ended = False
        finals: dict[int, Any] = {}
        held = [ToolStream(self.tool_parser) if chat and body.calls_tools() else None for _ in reqs]
        thinks = [ThinkSplit(body._opened) if chat and self.reasoning else None for _ in reqs]
        sofar = ["" for _ in reqs]  # each choice's answer so far (its thinking apart)
        try:
            if chat:
                for i in range(len(reqs)):
                    yield chunk(i, "", None, first=True)
            while len(finals) < len(reqs):
                i, ev = await queue.get()
                if isinstance(ev, Delta):
                    unsent[i] += ev.logprobs or []
                    new = ev.text
                    if thinks[i] is not None:
                        thinking, new = thinks[i].feed(ev.text)
                        if thinking:
                            yield chunk(i, None, None, thinking=thinking)
                    sofar[i] += new
                    text = held[i].push(sofar[i]) if held[i] is not None else new
                    if text:
                        yield chunk(i, text, None)
                    continue
                finals[i] = ev
                e = _unfinished(ev)
                if e is not None:
                    ended = True
                    for req in reqs:
                        self.engine.cancel(req)
                    self.metrics.request(endpoint, 500)
                    yield _sse(ApiError(500, e.message, type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                if thinks[i] is not None:  # a tag's held-back part: flushed as what it was
                    thinking, new = thinks[i].flush()
                    if thinking:
                        yield chunk(i, None, None, thinking=thinking)
                    sofar[i] += new
                    if new and held[i] is None:
                        yield chunk(i, new, None)
                if held[i] is not None:  # the held-back text: its calls, or what was not sent yet
                    rest, calls = held[i].finish(sofar[i] if thinks[i] is not None else ev.text)
                    if rest or calls:
                        yield chunk(i, rest or None, None, calls=calls)
                    yield chunk(i, None, "tool_calls" if calls else ev.reason)
                    continue
                yield chunk(i, None if chat else "", ev.reason)
            ended = True
            self.metrics.request(endpoint, 200)
            if body.include_usage():
                completion = sum(ev.completion_tokens for ev in finals.values())
                prompt = finals[0].prompt_tokens
                usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                         "prompt_tokens_details": {"cached_tokens": finals[0].cached_tokens}}
                yield _sse({"id": rid, "object": kind, "created": created, "model": self.model_name,
                            "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            if not ended:  # the client went away (the response was cancelled): free the slots
                for req in reqs:
                    self.engine.cancel(req)
                self.metrics.request(endpoint, CLIENT_GONE)

    async def models(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except ApiError as e:
            return self._error(request.url.path, e)
        self.metrics.request(request.url.path, 200)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ktflow",
                "max_model_len": self.max_seq_len}

    def _tokens(self, raw: bytes) -> dict:
        body = parse(TokenizeRequest, raw)
        if body.model is not None:
            self._check_model(body.model)
        ids = self._encode_chat(body.messages)[1] if body.messages is not None else self.tok.encode(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_seq_len}

    def _text(self, raw: bytes) -> dict:
        body = parse(DetokenizeRequest, raw)
        if body.model is not None:
            self._check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        return {"prompt": self.tok.decode(body.tokens)}

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: the ids of a prompt or of chat messages (as the generation endpoints
        encode them), their count and the context length."""
        return await self._offloop(request, self._tokens)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: the text of token ids."""
        return await self._offloop(request, self._text)

    async def _offloop(self, request: Request, work) -> Response:
        endpoint = request.url.path
        try:
            self._check_key(request)
            out = await asyncio.to_thread(work, await self._read_body(request))
        except ApiError as e:
            return self._error(endpoint, e)
        self.metrics.request(endpoint, 200)
        return JSONResponse(out)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model, or a 404 naming the one asked for."""
        name = request.path_params["model"]
        try:
            self._check_key(request)
            if name != self.model_name:
                raise ApiError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                               param="model", type="not_found_error")
        except ApiError as e:
            return self._error("/v1/models/{model}", e)  # one metrics label, whatever the name asked for
        self.metrics.request("/v1/models/{model}", 200)
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        stats = self.engine.stats()
        ok = not stats["draining"] and not stats["stuck"] and self.engine.error is None
        return JSONResponse({"status": "ok" if ok else "unavailable", **stats}, status_code=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type=self.metrics.content_type)


def _unfinished(ev) -> ApiError | None:
    """The error a sequence's final event answers with, where it did not finish: 500 when it
    failed, 503 when the server shut down first; None when it finished."""
    if isinstance(ev, Failed):
        return ApiError(500, f"generation failed: {ev.message}", type="server_error")
    if ev.reason == "cancelled":
        return ApiError(503, "the server shut down before this request finished", type="server_error")
    return None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
