"""Token generation on top of `execute`: each row greedy or sampled (backends.sampling: temperature,
top-p, top-k, min-p, penalties, logit_bias, a seed), its tokens selected where the logits are."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..backends.sampling import SamplingParams
from ..errors import InputError, require_finite
from .execute import decode_tokens, execute, start_sampling


@dataclass
class GenerationStats:
    prompt_tokens: int  # all rows
    new_tokens: int  # all rows, decode steps only (the first new token comes from prefill)
    prefill_seconds: float
    decode_seconds: float
    speculative: object | None = None  # a speculative run's SpeculativeStats (runtime/speculative.py)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0


#: generate's default eos_token_id: every end-of-sequence id the checkpoint declares
MODEL_EOS = "model"


def eos_set(compiled, eos_token_id) -> set[int]:
    """The ids that end a row: the checkpoint's for MODEL_EOS (config.json and
    generation_config.json), the given id or ids, or none for None / []."""
    if eos_token_id == MODEL_EOS:
        model = getattr(compiled, "model", None)
        return set(model.eos_ids) if model is not None else set()
    return set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))


def token_steps(compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                top_p: float = 1.0, seed: int | None = None, eos_token_id: int | Sequence[int] | None | str = MODEL_EOS,
                state=None, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                timing: dict | None = None, progress: bool = False, **params) -> Iterator[torch.Tensor]:
    """Each new token of every row as it is selected: [rows] int64 (CPU) per step, up to
    `max_new_tokens` steps or until every row has reached an end-of-sequence id (a row that has is
    padded with it). The parameters are generate_with_stats'; `timing` (a dict) receives the
    prompt's start, its first token's time and the end (perf_counter seconds) and the decode steps."""
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if sampling is None:
        sampling = SamplingParams.make(temperature=temperature, top_p=top_p, seed=seed, **params).check()
    elif params or temperature or top_p != 1.0 or seed is not None:
        raise InputError("give the sampling parameters either as sampling= or as keyword arguments, not both")
    rows_params = [sampling] if isinstance(sampling, SamplingParams) else list(sampling)
    if compiled.plans.options.gpus > 1 and any(not p.greedy and p.seed is None for p in rows_params):
        raise InputError("a plan over several GPU ranks samples the same tokens on every rank only with a seed: "
                         "pass seed= (every rank the same)")
    need = input_ids.shape[-1] + max_new_tokens - 1
    if state is None and need > compiled.max_seq_len:
        raise InputError(f"prompt ({input_ids.shape[-1]} tokens) + {max_new_tokens} new tokens needs {need} "
                         f"positions, more than max_seq_len {compiled.max_seq_len}; compile with a larger max_seq_len")
    timing = timing if timing is not None else {}
    timing.update(start=time.perf_counter(), steps=0)
    if max_new_tokens == 0:
        timing.update(first=timing["start"], end=timing["start"])
        return
    eos = eos_set(compiled, eos_token_id)
    eos_ids = torch.tensor(sorted(eos), dtype=torch.int64)  # made once: checked every step
    rows = input_ids.shape[0]
    draft = getattr(compiled, "draft", None)
    spec = compiled.plans.speculation if draft is not None else None
    if draft is not None and state is None and rows == 1 and (spec.sampled or rows_params[0].plain_greedy) and \
            input_ids.shape[-1] + max_new_tokens + spec.k <= min(compiled.max_seq_len, draft.max_seq_len):
        yield from _speculated(compiled, input_ids, max_new_tokens, rows_params[0], eos, timing)
        return
    own_state = state is None  # generate's own state: steps past an end-of-sequence token harm nothing
    step_out, state = execute(compiled, input_ids, state, logits="last")
    start_sampling(compiled, state, sampling, input_ids.cpu())
    nxt = require_finite(state.sampler.select(step_out[:, -1].to(state.sampler.device)), "the prompt's last position").cpu()
    sampled = not state.sampler.plain_greedy
    timing["first"] = time.perf_counter()
    done = torch.zeros(rows, dtype=torch.bool)
    # decode steps per call of the decode plan: a run may go past an end-of-sequence token, which a
    # caller's own state (continued after this call) must not see
    run = compiled.plans.options.greedy_steps if own_state or not eos else 1
    ahead: list[torch.Tensor] = []  # ids a multi-step call returned, not yet taken
    from ..util.progress import bar

    try:
        for i in bar(range(max_new_tokens), "decode", "token", show=progress and max_new_tokens > 1):
            if i:
                nxt = ahead.pop(0) if ahead else decode_tokens(compiled, nxt[:, None], state, 1, sampled=sampled)[:, 0]
            if eos:
                nxt = torch.where(done, torch.full_like(nxt, int(eos_ids[0])), nxt)
                done |= torch.isin(nxt, eos_ids)
            yield nxt
            if i == max_new_tokens - 1 or bool(done.all()):
                break
            if not ahead and run > 1 and max_new_tokens - 1 - i >= run:
                ahead = list(decode_tokens(compiled, nxt[:, None], state, run, sampled=sampled).unbind(1))
            timing["steps"] += 1
    finally:
        timing["end"] = time.perf_counter()


def _speculated(compiled, input_ids: torch.Tensor, max_new_tokens: int, params: SamplingParams, eos: set[int],
                timing: dict) -> Iterator[torch.Tensor]:
    """token_steps for one row by speculative decoding with the compiled model's draft (the MTP
    layer the compile chose, runtime/speculative.py); `timing` as token_steps fills it, with the
    run's SpeculativeStats as 'speculative'."""
    from .speculative import SpeculativeStats, speculative_tokens

    stats = timing["speculative"] = SpeculativeStats()
    try:
        for i, t in enumerate(speculative_tokens(compiled, compiled.draft, input_ids[0].tolist(), max_new_tokens, eos,
                                                 None if params.plain_greedy else params, stats,
                                                 drafts=compiled.plans.speculation.k)):
            if i == 0:
                timing["first"] = time.perf_counter()
            else:
                timing["steps"] += 1
            yield torch.tensor([t])
    finally:
        timing["end"] = time.perf_counter()


def stream_tokens(compiled, input_ids, max_new_tokens: int, **kwargs) -> Iterator[int]:
    """One prompt's new token ids as they are selected (a list of ids or a [1, T] tensor), ending
    before the first end-of-sequence id (the checkpoint's by default; eos_token_id as in
    generate) or after `max_new_tokens`. Sampling keywords as generate's."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)
    eos = eos_set(compiled, kwargs.get("eos_token_id", MODEL_EOS))
    for nxt in token_steps(compiled, ids, max_new_tokens, **kwargs):
        t = int(nxt[0])
        if t in eos:
            return
        yield t


def generate_with_stats(compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int | None = None,
                        eos_token_id: int | Sequence[int] | None | str = MODEL_EOS,
                        state=None, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                        **params) -> tuple[torch.Tensor, GenerationStats]:
    """Prompt + up to `max_new_tokens` new tokens per row, and the run's stats. Each row's tokens
    are selected on the device that makes the logits (in the captured decode step on the GPU)
    by `sampling` (one SamplingParams for every row, or one per row), else by the keyword
    parameters (temperature, top_p, seed and the other SamplingParams fields: top_k, min_p,
    repetition_penalty, presence_penalty, frequency_penalty, logit_bias). Decode steps run
    `greedy_steps` a call of the decode plan (one graph launch on the cuda_graph backend),
    greedy or sampled, where the rows' run may pass an end-of-sequence token unseen by the
    caller (generate's own state, or no eos). A row ends at any of `eos_token_id`'s ids (default:
    the checkpoint's; None: none)."""
    timing: dict = {}
    out = [input_ids.cpu()]
    for nxt in token_steps(compiled, input_ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           eos_token_id=eos_token_id, state=state, sampling=sampling, timing=timing, progress=True,
                           **params):
        out.append(nxt[:, None])
    rows = input_ids.shape[0]
    first = timing.get("first", timing["start"])
    stats = GenerationStats(prompt_tokens=input_ids.numel(), new_tokens=timing["steps"] * rows,
                            prefill_seconds=first - timing["start"], decode_seconds=timing["end"] - first,
                            speculative=timing.get("speculative"))
    return torch.cat(out, dim=1).to(input_ids.device), stats
