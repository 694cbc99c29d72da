"""Model specs, one file per family, and the registry from config.json's model_type.

A family module defines `Config` (a pydantic `ktflow.frontend.config.HFConfig` subclass),
`config(raw: dict, where: str) -> Config` and `build(cfg, act_dtype) -> Graph`. To add a family,
write `models/<family>.py` and add its model_type(s) to REGISTRY below.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ktflow.errors import ConfigError

#: config.json model_type -> module in this package
REGISTRY: dict[str, str] = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "deepseek_v2": "deepseek_v2",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "glm4_moe": "glm4_moe",
}


def family(model_type: str | None, where: str = "config.json") -> ModuleType:
    if not isinstance(model_type, str) or model_type not in REGISTRY:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: "
                          + ", ".join(sorted(REGISTRY)))
    return importlib.import_module(f"{__name__}.{REGISTRY[model_type]}")
