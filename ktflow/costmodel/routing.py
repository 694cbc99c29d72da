"""What a model's routers pick, as the cost model reads it: a recorded `RoutingProfile` (each MoE
layer's pick probabilities, checked against the model it is applied to) and the expert cache's
`CacheCurve`s (hits and copies per row count) measured from it."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, field_validator

from ..errors import ConfigError
from ..ir.graph import Graph
from ..ir.ops import Op
from ..util.fsutil import read_model_json


class CacheCurve(BaseModel):
    """One layer at one refill interval of the decode-time expert cache, for S = 1 .. experts - 1
    rows: `hits[S - 1]`, the share of decoded tokens' picks the rows served; `copies[S - 1]`,
    experts copied in per decoded token (ktflow.runtime.cache_curves measures them)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    hits: list[float]
    copies: list[float]

    @field_validator("hits")
    @classmethod
    def _shares(cls, v: list[float]) -> list[float]:
        if any(not 0.0 <= h <= 1.0 for h in v):
            raise ValueError("every cache hit share must be in [0, 1]")
        return v

    @field_validator("copies")
    @classmethod
    def _copies(cls, v: list[float]) -> list[float]:
        if any(not c >= 0.0 for c in v):
            raise ValueError("every cache copies-per-token figure must be >= 0")
        return v


class RoutingProfile(BaseModel):
    """Measured routing: `layers[layer][e]` is the fraction of tokens that pick expert e in that
    MoE layer (each token picks top_k experts, so a layer's fractions sum to top_k)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    layers: dict[int, list[float]]
    model_type: str | None = None
    tokens: int | None = None  # how many tokens the frequencies were counted over
    #: optional, `pairs[layer][i][j]`: the fraction of tokens that pick both experts i and j (the
    #: diagonal is `layers`); measured by `ktflow profile --pairs`, not read by placement yet
    pairs: dict[int, list[list[float]]] | None = None
    #: optional: by depth d, how often the checkpoint's multi-token-prediction layer's d-th chained
    #: greedy draft equals the model's greedy token where the drafts before it did, over the
    #: profiled prompts' decoded tokens (`ktflow profile --mtp`); speculation is priced by them
    mtp_acceptance: list[float] | None = None
    #: optional, for k = 1..: the tokens a greedy speculative run of k chained drafts a step yielded
    #: a step, replayed on the same continuations (`ktflow profile --mtp`); priced by before the rates
    mtp_tokens_per_step: list[float] | None = None
    #: optional, `neighbours[layer][e]`: the fraction of neighbouring decoded token pairs that both
    #: pick expert e (`ktflow profile --decode N`); a speculative verification step is priced by it
    neighbours: dict[int, list[float]] | None = None
    #: optional, `cache[N][layer]`: what an expert cache refilled every N decoded tokens served
    #: on the profiled conversations (`ktflow profile --decode`); placement prices cached layers by it
    cache: dict[int, dict[int, CacheCurve]] | None = None
    #: optional, `cache_batched[B][N][layer]`: the same for B conversations decoded together in
    #: lockstep with one cache, `hits` being the share of the steps' expert reads it served
    cache_batched: dict[int, dict[int, dict[int, CacheCurve]]] | None = None

    @field_validator("layers", "neighbours")
    @classmethod
    def _fractions(cls, v, info):
        for layer, fr in (v or {}).items():
            if not fr or any(not 0.0 <= f <= 1.0 for f in fr):
                what = "expert frequency" if info.field_name == "layers" else "expert's neighbour co-pick fraction"
                raise ValueError(f"{info.field_name}, layer {layer}: every {what} must be in [0, 1]")
        return v

    @field_validator("mtp_acceptance")
    @classmethod
    def _rate(cls, v):
        if v is not None and (not v or any(not 0.0 <= a <= 1.0 for a in v)):
            raise ValueError(f"mtp_acceptance must list rates in [0, 1] by depth, got {v}")
        return v

    @field_validator("cache_batched")
    @classmethod
    def _batches(cls, v):
        if v and any(b < 2 for b in v):
            raise ValueError("cache_batched is keyed by batches of 2 or more conversations (one is `cache`)")
        return v

    def probs(self, layer: int) -> tuple[float, ...] | None:
        fr = self.layers.get(layer)
        return tuple(fr) if fr is not None else None

    def cache_for(self, batch: int, layer: int) -> tuple[dict[int, CacheCurve], int]:
        """(layer `layer`'s cache curves by refill interval, the batch they price) for decode steps
        of up to `batch` conversations: those of the largest profiled batch not above `batch` (the
        smallest where all are above it); one conversation's at 1, with no batched curves, or where
        the batched curves leave the layer out."""
        def of(table: dict[int, dict[int, CacheCurve]]) -> dict[int, CacheCurve]:
            return {every: c[layer] for every, c in table.items() if layer in c}

        if batch > 1 and self.cache_batched:
            sizes = sorted(self.cache_batched)
            b = max([s for s in sizes if s <= batch], default=sizes[0])
            curves = of(self.cache_batched[b])
            if curves:
                return curves, b
        return of(self.cache or {}), 1

    def check_against(self, g: Graph) -> None:
        for n in g.nodes:
            if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in self.layers:
                fr = self.layers[n.attrs.layer]
                if len(fr) != n.attrs.experts:
                    raise ConfigError(f"routing profile: layer {n.attrs.layer} lists {len(fr)} experts, "
                                      f"the model has {n.attrs.experts}")
                if abs(sum(fr) - n.attrs.top_k) > 0.05 * n.attrs.top_k:
                    raise ConfigError(f"routing profile: layer {n.attrs.layer} frequencies sum to {sum(fr):.3f}, "
                                      f"expected top_k = {n.attrs.top_k}")
                near = (self.neighbours or {}).get(n.attrs.layer)
                if near is not None and len(near) != n.attrs.experts:
                    raise ConfigError(f"routing profile: layer {n.attrs.layer}'s neighbour co-picks list {len(near)} "
                                      f"experts, the model has {n.attrs.experts}")
                tables = [(1, self.cache or {})] + sorted((self.cache_batched or {}).items())
                for batch, table in tables:
                    for every, curves in table.items():
                        curve = curves.get(n.attrs.layer)
                        if curve is not None and not len(curve.hits) == len(curve.copies) == n.attrs.experts - 1:
                            of = f", batch {batch}" if batch > 1 else ""
                            raise ConfigError(f"routing profile: the cache curve of layer {n.attrs.layer} (every "
                                              f"{every} tokens{of}) has {len(curve.hits)} sizes, the layer has "
                                              f"{n.attrs.experts} experts (expected {n.attrs.experts - 1} sizes)")

    @staticmethod
    def load(path: str | os.PathLike) -> "RoutingProfile":
        return read_model_json(RoutingProfile, path, "routing profile")
