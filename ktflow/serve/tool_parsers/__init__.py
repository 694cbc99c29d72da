"""Tool calls in a model's output, parsed per family into OpenAI's `tool_calls`: one format a
file (`hermes` for Qwen2/Qwen3, `deepseek_v3` for DeepSeek-V3/R1/V3.1, `glm45` for GLM-4.5/4.6,
`kimi_k2` for Kimi-K2), each a `ToolParser` (base.py). Which parser a checkpoint gets follows its
model_type (`parser_for`); `serve --tool-parser` overrides it. A family without one has its
requests with `tools` refused, never answered as if the tools were ignored. `ToolStream` holds
streamed text back from a parser's opening marker on, so a stream's content never shows call
markup. A parser whose markers are special tokens (`special`) has a request with tools decode
its answer keeping special tokens.
"""

from __future__ import annotations

from . import deepseek_v3, glm45, hermes, kimi_k2
from .base import ParsedCall, ToolParser, ToolStream

PARSERS: dict[str, ToolParser] = {m.PARSER.name: m.PARSER for m in (hermes, deepseek_v3, glm45, kimi_k2)}
#: the parser a model_type's chat template teaches
FAMILY_PARSER = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "deepseek_v3": "deepseek_v3", "glm4_moe": "glm45",
                 "kimi_k2": "kimi_k2"}

__all__ = ["PARSERS", "FAMILY_PARSER", "ParsedCall", "ToolParser", "ToolStream", "parser_for"]


def parser_for(model_type: str, override: str | None = None) -> ToolParser | None:
    """The parser named `override`, else the one `model_type`'s template teaches, else None."""
    if override is not None:
        return PARSERS[override]
    name = FAMILY_PARSER.get(model_type)
    return PARSERS[name] if name else None
