"""The checkpoint's tokenizer for serving: `tokenizer.json` (the `tokenizers` library) and, from
`tokenizer_config.json`, the chat template and the bos/eos tokens.

Chat templates render as in HF transformers: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, the loop controls extension, `raise_exception(msg)`, a `tojson` filter that keeps
non-ASCII text, and the variables `messages`, `add_generation_prompt=True`, `bos_token` and
`eos_token`. The rendered text is encoded without adding special tokens (the template writes
them); special tokens come only from the template: a special token's string inside a message is
encoded as plain text. A plain completion prompt is raw text, encoded as the tokenizer does (its
post-processor and special tokens included).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, first_line


class TemplateError(Exception):
    """A chat template refused the messages (its `raise_exception`) or failed to render."""


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


#: a chat template's render gets this long and may write this much (a template comes with a
#: download: one that loops for ever or renders gigabytes fails its request, not the server)
RENDER_SECONDS = 2.0
RENDER_CHARS = 16 << 20
_budget = threading.local()  # the deadline of the render on this thread


def _check_budget() -> None:
    deadline = getattr(_budget, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateError(f"the chat template took longer than {RENDER_SECONDS:g} s to render: refused")


class ServeTokenizer:
    """Encodes prompts, renders chat messages and decodes generated ids for one checkpoint dir."""

    def __init__(self, tokenizer, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                 extra_eos_ids: tuple[int, ...] = (), special_in_messages: bool = False):
        self.tok = tokenizer
        self.chat_template = chat_template
        # message text is text: the special tokens' strings to look for (and `_plain`, made when a
        # message first holds one)
        self.special_in_messages = special_in_messages
        self._specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special},
                                key=len, reverse=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        eos = {tokenizer.token_to_id(eos_token)} if eos_token else set()
        self.eos_ids = frozenset(i for i in eos | set(extra_eos_ids) if i is not None)
        self._template = self._compile(chat_template) if chat_template else None

    @staticmethod
    def from_dir(path: str | Path, extra_eos_ids: tuple[int, ...] = (), special_in_messages: bool = False,
                 chat_template: str | Path | None = None) -> "ServeTokenizer":
        """Load `path`/tokenizer.json and tokenizer_config.json (optional; chat_template.jinja is
        read when the config has no template; a `chat_template` file given overrides both). A
        ConfigError names the missing or broken file."""
        from tokenizers import Tokenizer

        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"{d} has no tokenizer.json: serving text needs the checkpoint's tokenizer "
                              "(copy tokenizer.json and tokenizer_config.json from the model's release)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
            raise CheckpointError(f"{tok_file} cannot be loaded as a tokenizer ({first_line(e) or type(e).__name__})") from None
        cfg: dict[str, Any] = {}
        cfg_file = d / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{cfg_file} is not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise CheckpointError(f"{cfg_file} must hold a JSON object")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{cfg_file}: chat_template must be a string, got {type(template).__name__}")
        if chat_template is not None:
            given = Path(chat_template)
            if not given.is_file():
                raise ConfigError(f"--chat-template {given} is not a file (give a jinja template file)")
            try:
                template = given.read_text()
            except UnicodeDecodeError:
                raise ConfigError(f"--chat-template {given} is not UTF-8 text") from None
        return ServeTokenizer(tok, template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")),
                              extra_eos_ids, special_in_messages)

    @staticmethod
    def _compile(source: str):
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedEnvironment(ImmutableSandboxedEnvironment):
            """The sandbox, with the render's time budget checked at every call, attribute and item
            the template reaches (a loop that reaches none is bounded by the sandbox's range cap)."""

            def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's own signature
                _check_budget()
                return super().call(__context, __obj, *args, **kwargs)

            def getattr(self, obj, attribute):
                _check_budget()
                return super().getattr(obj, attribute)

            def getitem(self, obj, argument):
                _check_budget()
                return super().getitem(obj, argument)

        def raise_exception(message):
            raise TemplateError(str(message))

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(source)
        except TemplateSyntaxError as e:
            raise CheckpointError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def render_chat(self, messages: list[dict[str, str]], kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        """The prompt text for `messages` ([{role, content}]), with `kwargs` as further template
        variables (a request's chat_template_kwargs: Qwen3's enable_thinking); TemplateError when
        the template refuses them or there is no template."""
        if self._template is None:
            raise TemplateError("this model has no chat template (tokenizer_config.json has no chat_template): "
                                "use /v1/completions with a prompt instead")
        _budget.deadline = time.monotonic() + RENDER_SECONDS
        try:
            out, size = [], 0
            variables = {**(kwargs or {}), "messages": messages, "add_generation_prompt": True,
                         "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "tools": tools or None}
            for piece in self._template.generate(**variables):
                size += len(piece)
                if size > RENDER_CHARS:
                    raise TemplateError(f"the chat template's output passed {RENDER_CHARS} characters: refused")
                _check_budget()
                out.append(piece)
            return "".join(out)
        except TemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - any error inside the template fails this request only
            raise TemplateError(f"the chat template failed to render: {type(e).__name__}: {first_line(e)}") from None
        finally:
            _budget.deadline = None

    def encode_chat(self, messages: list[dict[str, str]], kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
        """The rendered prompt's ids. Special tokens come only from the template: a message whose
        text holds a special token's string (`<|im_end|>` typed by a user) has that span encoded
        as plain text, so it cannot end a turn or forge a role (unless special_in_messages). A
        prompt whose messages hold none encodes exactly as the whole rendered string does."""
        return self.encode_rendered(self.render_chat(messages, kwargs, tools), messages)

    @functools.cached_property
    def _plain(self):
        """A copy of the tokenizer that never parses special tokens (a copy, so encoding stays
        thread-safe)."""
        plain = type(self.tok).from_str(self.tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_rendered(self, text: str, messages: list[dict[str, str]]) -> list[int]:
        """`encode_chat` of a prompt already rendered from `messages`."""
        risky = [] if self.special_in_messages else [
            m["content"] for m in messages if isinstance(m.get("content"), str)
            and any(sp in m["content"] for sp in self._specials)]
        if not risky:
            return self.tok.encode(text, add_special_tokens=False).ids
        ids, pos = [], 0
        for content in risky:  # each message's text where the template put it, in order
            at = text.find(content, pos)
            if at < 0:
                raise TemplateError("a message holds a special token's text and the chat template changed that "
                                    "message, so it cannot be encoded as plain text: remove the special token text")
            ids += self.tok.encode(text[pos:at], add_special_tokens=False).ids
            ids += self._plain.encode(content, add_special_tokens=False).ids
            pos = at + len(content)
        return ids + self.tok.encode(text[pos:], add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def decode_all(self, ids: list[int]) -> str:
        """The text of `ids` with special tokens written out (a tool parser reads its markers)."""
        return self.tok.decode(ids, skip_special_tokens=False)
