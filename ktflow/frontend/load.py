"""`ktflow.load(path)`: an HF checkpoint dir as a spec graph plus a lazy weight source."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from ..errors import ConfigError
from ..ir.graph import Graph, Node
from ..ir.types import DType, WeightRef
from ..ir.verify import verify
from .config import HFConfig
from .generation import GenerationDefaults
from .quant import QuantConfig, stored_fp8
from .weights import WeightSource


def config_fingerprint(raw: dict) -> str:
    """Hash of the model's config.json content (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def part_fingerprint(fingerprint: str, part: str) -> str:
    """The fingerprint of a checkpoint's `part` ("main" or "mtp") from its config's: the MTP part's
    is marked as its own (its plans and states are not the main model's)."""
    return fingerprint if part == "main" else f"{fingerprint}-{part}"


def part_of(fingerprint: str) -> str:
    """Which part of a checkpoint a fingerprint (`part_fingerprint`) names."""
    return "mtp" if fingerprint.endswith("-mtp") else "main"


@dataclass
class Model:
    path: Path
    raw_config: dict
    config: HFConfig
    family: ModuleType
    weights: WeightSource | None
    quant: QuantConfig | None = None  # config.json's quantization_config (an FP8 release)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # generation_config.json
    #: which graph of the checkpoint this is: "main" (the model), or "mtp" (its multi-token-prediction
    #: layer: `mtp()`)
    part: str = "main"
    _graphs: dict = field(default_factory=dict, repr=False)  # act dtype -> verified spec graph

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def fingerprint(self) -> str:
        """The config's hash, marked with the part (`part_fingerprint`)."""
        return part_fingerprint(config_fingerprint(self.raw_config), self.part)

    @property
    def has_mtp(self) -> bool:
        """Whether the config declares a multi-token-prediction layer this family builds."""
        return hasattr(self.family, "build_mtp") and bool(getattr(self.config, "num_nextn_predict_layers", 0))

    def mtp(self) -> "Model":
        """The checkpoint's multi-token-prediction layer as a model of its own, to compile and run
        beside this one (its graph: frontend/spec.py's `mtp`; its inputs: the next tokens and this
        model's final normalised hidden states); of several declared, the first. A ConfigError
        where the checkpoint has none."""
        if not self.has_mtp:
            raise ConfigError(f"{self.path}: the config declares no multi-token-prediction layer "
                              "(num_nextn_predict_layers is 0 or absent, or the family has none)")
        m = replace(self, part="mtp", _graphs={})
        g = m.graph()
        if m.weights is not None:
            m.weights.validate(g)
        return m

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id the checkpoint declares: config.json's, then generation_config.json's."""
        return tuple(dict.fromkeys((*self.config.eos_ids, *self.generation.eos_ids)))

    def graph(self, act_dtype: DType | None = None) -> Graph:
        """The spec graph with activations in `act_dtype` (default: the checkpoint's dtype)."""
        dt = act_dtype or self.config.weight_dtype
        if dt not in self._graphs:  # built once per dtype: load validates it, compile reuses it
            if self.part == "mtp":
                g = self.family.build_mtp(self.config, dt, lambda key: self.weights is None or key in self.weights)
            else:
                g = self.family.build(self.config, dt)
            if self.quant is not None:
                g = g.map(self._stored_formats)
            verify(g, "spec")
            self._graphs[dt] = g
        return self._graphs[dt]

    def _stored_formats(self, n: Node) -> Node:
        """n with each weight's stored format: from the checkpoint's header where the weights are
        here, else by the layout FP8 releases use (`quant.stored_fp8`)."""
        def fmt(w: WeightRef) -> str:
            if self.weights is not None:
                return "fp8" if self.weights.stored_fp8(w) else ""
            return "fp8" if stored_fp8(w.key.replace("{e}", "0"), w.shape) else ""

        return replace(n, weights=tuple(replace(w, fmt=fmt(w)) for w in n.weights)) if n.weights else n

    def __repr__(self) -> str:
        w = "weights" if self.weights else "no weights"
        what = f"{self.config.num_hidden_layers} layers" if self.part == "main" else "its MTP layer"
        return f"Model({self.model_type}, {self.path}, {what}, {w})"


def read_config(path: str | os.PathLike) -> tuple[Path, dict]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model path {p} does not exist")
    if not p.is_dir():
        raise ConfigError(f"model path {p} is not a directory (give an HF checkpoint dir with config.json)")
    cfg = p / "config.json"
    if not cfg.exists():
        raise ConfigError(f"{p} has no config.json (an HF checkpoint dir holds config.json and *.safetensors)")
    if not cfg.is_file():
        raise ConfigError(f"{cfg} is not a regular file (a directory, FIFO or device): config.json must be a file")
    try:
        raw = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{cfg}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{cfg}: nested too deeply to be a model config") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg}: expected a JSON object")
    return p, raw


def load(path: str | os.PathLike) -> Model:
    """Read config.json, pick the family spec by model_type, open the weights (lazily).

    A dir with only config.json loads without weights: it can be compiled but not run. When
    safetensors files are present, every tensor the spec needs is checked (name, shape, dtype;
    an FP8 weight's block scales) from the headers alone. A quantization method ktflow does not
    read is refused here, by name.
    """
    from ..models import family as find_family

    p, raw = read_config(path)
    where = str(p / "config.json")
    fam = find_family(raw.get("model_type"), where)
    cfg = fam.config(raw, where)
    quant = QuantConfig.parse(raw.get("quantization_config"), where)
    weights = WeightSource(p, quant) if WeightSource.present(p) else None
    model = Model(p, raw, cfg, fam, weights, quant, GenerationDefaults.read(p, cfg.vocab_size))
    graph = model.graph()  # builds and verifies the spec: config errors surface here
    if weights is not None:
        weights.validate(graph)
    return model
