"""Token generation on top of `execute`: greedy, or temperature + top-p sampling with a seed."""

from __future__ import annotations

import math

import time
from dataclasses import dataclass

import torch

from ..errors import InputError
from .execute import decode_greedy, execute


@dataclass
class GenerationStats:
    prompt_tokens: int  # all rows
    new_tokens: int  # all rows, decode steps only (the first new token comes from prefill)
    prefill_seconds: float
    decode_seconds: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits [batch, vocab]."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above each one
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def generate_with_stats(compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                        top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None,
                        state=None) -> tuple[torch.Tensor, GenerationStats]:
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:  # NaN fails this too
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    need = input_ids.shape[-1] + max_new_tokens - 1
    if state is None and need > compiled.max_seq_len:
        raise InputError(f"prompt ({input_ids.shape[-1]} tokens) + {max_new_tokens} new tokens needs {need} "
                         f"positions, more than max_seq_len {compiled.max_seq_len}; compile with a larger max_seq_len")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    ids = input_ids
    greedy = temperature <= 0  # the steps return the next ids (taken on the GPU by a CUDA-graph step)
    mode = "argmax" if greedy else "last"
    t0 = time.perf_counter()
    own_state = state is None  # generate's own state: steps past an end-of-sequence token harm nothing
    step_out, state = execute(compiled, ids, state, logits=mode)  # next ids [b, 1] (greedy) or logits [b, 1, V]
    t1 = time.perf_counter()
    out = [ids]
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    steps = 0
    # decode steps per call of the decode plan: a greedy run may go past an end-of-sequence token,
    # which a caller's own state (continued after this call) must not see
    run = compiled.plans.options.greedy_steps if greedy and (own_state or not eos) else 1
    ahead: list[torch.Tensor] = []  # greedy ids a multi-step call returned, not yet taken
    from ..progress import bar

    for i in bar(range(max_new_tokens), "decode", "token", show=max_new_tokens > 1):
        nxt = step_out[:, -1].cpu() if greedy else sample(step_out[:, -1], temperature, top_p, gen).cpu()
        if eos:
            fill = next(iter(eos))
            nxt = torch.where(done, torch.full_like(nxt, fill), nxt)
            done |= torch.isin(nxt, torch.tensor(sorted(eos)))
        out.append(nxt[:, None])
        if i == max_new_tokens - 1 or bool(done.all()):
            break
        if not ahead and run > 1 and max_new_tokens - 1 - i >= run:
            ahead = list(decode_greedy(compiled, nxt[:, None], state, run).unbind(1))
        if ahead:
            step_out = ahead.pop(0)[:, None]
        else:
            step_out, state = execute(compiled, nxt[:, None], state, logits=mode)
        steps += 1
    t2 = time.perf_counter()
    stats = GenerationStats(prompt_tokens=ids.numel(), new_tokens=steps * ids.shape[0],
                            prefill_seconds=t1 - t0, decode_seconds=t2 - t1)
    return torch.cat(out, dim=1), stats
