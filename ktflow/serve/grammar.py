"""Structured output: a request's `response_format` as a grammar, and the per-sequence matcher that
masks each step's logits to the tokens the grammar allows (llguidance).

`Grammars(tokenizer, vocab, eos_ids)` holds the tokenizer as llguidance reads it (made by `warm()`,
which the server calls at start, or on first use: up to seconds for a large vocabulary; the server
compiles grammars off its event loop; a tokenizer llguidance refused is refused again at once).
`compile(response_format)` gives the grammar text of json_object (any JSON object) or json_schema
(that schema), JSON written without free whitespace, or a ValueError naming what is wrong; it
builds the grammar's matcher once, kept (the last PROTOTYPES grammars) so that `matcher(grammar)`,
a fresh `Matcher`, is a copy of it: a request's grammar is compiled once, a schema sent again not
at all. A Matcher's `bitmask()`
is the tokens the grammar allows next, in the layout `backends.sampling.Sampler.set_allowed` reads
(the sampler masks the others inside the step, on the device); `advance(token)` takes the selected
token; once the value is complete the grammar allows only an eos token, so the sequence ends there.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger("ktflow.serve")

#: grammars whose built matcher is kept (agents send the same schema or tools every turn)
PROTOTYPES = 64


class Matcher:
    """One sequence's place in its grammar (see the module docstring)."""

    def __init__(self, matcher):
        self.m = matcher

    def bitmask(self) -> bytes:
        """The tokens the grammar allows next: token i where bit i % 32 of little-endian 32-bit word
        i // 32 is set, ceil(vocab / 32) words."""
        return self.m.compute_bitmask()

    def advance(self, token: int) -> None:
        """Take the selected token; a ValueError where the grammar is in error."""
        self.m.consume_token(int(token))
        if self.m.is_error():
            raise ValueError(f"structured output: {self.m.get_error()}")


class Grammars:
    """The grammar side of one served model (see the module docstring)."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, sorted(eos_ids)
        self._ll = None
        self._refused: str | None = None  # why llguidance could not read the tokenizer
        self._built: OrderedDict[str, Any] = OrderedDict()  # grammar text -> its matcher, never advanced
        self._lock = threading.Lock()  # compiles run in worker threads, matchers are made on the engine's

    def warm(self) -> bool:
        """Make the tokenizer as llguidance reads it now (a server does at start, so no request
        waits for it); False where llguidance is not installed or cannot read this tokenizer (a
        warning says which; structured requests then get a 400 saying it)."""
        try:
            self._llt()
        except ImportError:
            return False
        except Exception as e:  # noqa: BLE001 - llguidance's own error: each structured request reports it
            log.warning(f"{e}: structured requests will be refused")
            return False
        return True

    def _llt(self):
        if self._ll is None:
            import llguidance

            if self._refused is not None:
                raise ValueError(self._refused)
            try:
                self._ll = llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab, eos_token=self.eos)
            except Exception as e:  # noqa: BLE001 - llguidance's own error, kept: every later request hears it
                self._refused = f"structured output is not available: llguidance cannot read this tokenizer ({e})"
                raise ValueError(self._refused) from None
        return self._ll

    def _prototype(self, grammar: str, what: str):
        """The built matcher of `grammar` (kept, never advanced); a ValueError starting with `what`
        where llguidance refuses the grammar."""
        with self._lock:
            m = self._built.get(grammar)
            if m is not None:
                self._built.move_to_end(grammar)
                return m
        import llguidance

        m = llguidance.LLMatcher(self._llt(), grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{what}: {m.get_error().splitlines()[0]}")
        with self._lock:
            self._built[grammar] = m
            while len(self._built) > PROTOTYPES:
                self._built.popitem(last=False)
        return m

    def compile(self, response_format: dict[str, Any]) -> str:
        """The grammar text of `response_format` (type json_object or json_schema); a ValueError
        saying what is wrong with it."""
        import llguidance

        kind = response_format.get("type")
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
            schema = spec.get("schema", {})
        else:
            raise ValueError(f"response_format type {kind!r}: send 'text', 'json_object' or 'json_schema'")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                      defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise ValueError(f"response_format: the schema is not usable: {e}") from None
        self._prototype(grammar, "response_format: the schema is not usable")
        return grammar

    def tool_call(self, tools: list[dict[str, Any]], choice, parser) -> str:
        """The grammar of exactly one call in `parser`'s format: of any of `tools` (OpenAI function
        tools) where `choice` is 'required', else of the function `choice` names; its arguments
        follow the tool's parameters schema; JSON without free whitespace."""
        import llguidance

        named = None if choice == "required" else choice["function"]["name"]
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "arguments": t["function"].get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for t in tools if named is None or t["function"]["name"] == named]
        if not calls:
            raise ValueError(f"tool_choice names function {named!r}, which is not among the tools")
        schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
        grammar = llguidance.LLMatcher.grammar_from_lark(parser.lark(json.dumps(schema)))
        self._prototype(grammar, "tools: a call of these tools cannot be constrained")
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        """A fresh Matcher at the start of `grammar` (a copy of its built one)."""
        proto = self._prototype(grammar, "structured output: the grammar is not usable")
        with self._lock:
            return Matcher(proto.deep_copy())
