"""A checkpoint's `generation_config.json`: its end-of-sequence ids and its sampling defaults.

Read as HF transformers writes it. `eos_token_id` (an id or a list) adds to config.json's. The
sampling fields the file names (temperature, top_p, top_k, min_p, repetition_penalty) are the
defaults of a request that leaves them out; a file with `"do_sample": false` names none (greedy,
as transformers decodes it). Fields the file does not name keep ktflow's defaults (transformers'
own implicit ones, such as top_k 50, are not applied). A missing file is no defaults; a malformed
one is a ConfigError naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

FILE = "generation_config.json"
#: the sampling fields a generation_config.json may set, and their checks
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    eos_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)  # only the fields the file names

    @staticmethod
    def read(model_dir: Path, vocab: int) -> "GenerationDefaults":
        p = Path(model_dir) / FILE
        if not p.exists():
            return GenerationDefaults()
        if not p.is_file():
            raise ConfigError(f"{p} is not a regular file")
        try:
            raw = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ConfigError(f"{p}: not valid JSON ({str(e) or type(e).__name__})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a JSON object")
        eos = raw.get("eos_token_id")
        eos = [] if eos is None else [eos] if not isinstance(eos, list) else eos
        for e in eos:
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab:
                raise ConfigError(f"{p}: eos_token_id {e!r} is not a token id in 0..{vocab - 1}")
        sampling: dict[str, float | int] = {}
        if raw.get("do_sample") is not False:
            for name in SAMPLING_FIELDS:
                v = raw.get(name)
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ConfigError(f"{p}: {name} must be a finite number >= 0, got {v!r}")
                sampling[name] = int(v) if name == "top_k" else float(v)
        return GenerationDefaults(tuple(dict.fromkeys(eos)), sampling)
