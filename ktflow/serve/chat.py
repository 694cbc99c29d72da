"""Chat for applications in Python: the checkpoint's template, its tokenizer and eos, the answer's
text whole or as it comes.

`chat(compiled, messages, max_new_tokens, stream=False, **sampling)` renders `messages` with the
checkpoint's chat template (as the server does: special tokens only from the template), generates
(sampling keywords as `ktflow.generate`'s; eos from the checkpoint), and returns the answer's text,
or with `stream=True` an iterator of its pieces (an incomplete UTF-8 character held back until it is
whole). The tokenizer is read from the compiled model's dir once.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import ConfigError
from ..runtime.generate import stream_tokens
from .stops import TextStream
from .tokenizer import ServeTokenizer

_TOKENIZERS: dict[str, ServeTokenizer] = {}


def tokenizer_of(compiled) -> ServeTokenizer:
    """The compiled model's ServeTokenizer (read once per model dir)."""
    model = getattr(compiled, "model", None)
    if model is None:
        raise ConfigError("chat needs the compiled model's checkpoint dir (its tokenizer and chat template): compile "
                          "from ktflow.load(dir)")
    key = str(model.path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = ServeTokenizer.from_dir(model.path, extra_eos_ids=tuple(model.eos_ids))
    return _TOKENIZERS[key]


def chat(compiled, messages: list[dict[str, Any]], max_new_tokens: int = 256, *, stream: bool = False,
         chat_template_kwargs: dict | None = None, **sampling) -> str | Iterator[str]:
    tok = tokenizer_of(compiled)
    ids = tok.encode_chat(messages, chat_template_kwargs)
    sampling.setdefault("eos_token_id", sorted(tok.eos_ids))
    pieces = _pieces(compiled, tok, ids, max_new_tokens, sampling)
    return pieces if stream else "".join(pieces)


def _pieces(compiled, tok: ServeTokenizer, ids: list[int], max_new_tokens: int, sampling: dict) -> Iterator[str]:
    text = TextStream(tok.decode, [])
    generated: list[int] = []
    for t in stream_tokens(compiled, ids, max_new_tokens, **sampling):
        generated.append(t)
        piece = text.push(generated)
        if piece:
            yield piece
    rest = text.finish(generated)
    if rest:
        yield rest
