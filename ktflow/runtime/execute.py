"""`execute`: one step of a compiled model (a prompt, in chunks of the largest prefill bucket, or
a decode step) through the plan's executor. `api` re-exports it; `generate` builds on it (this
module imports neither, so runtime and api do not import each other)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..backends.sampling import Sampler, SamplingParams
from ..errors import InputError, require_finite
from .state import State


def check_ids(compiled, input_ids: Any, state: State | None) -> torch.Tensor:
    """`input_ids` as int64 [batch, tokens], or an InputError saying what does not fit the
    compiled model (vocabulary, max_seq_len) or the state (model, batch, room left)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise InputError("input_ids must be an integer torch tensor of shape [batch, tokens]")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise InputError(f"input_ids must have shape [batch, tokens] with both >= 1, got {list(input_ids.shape)}")
    vocab = compiled.vocab_size
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is out of range: the vocabulary has ids 0..{vocab - 1}")
    b, s = input_ids.shape
    if state is None:
        if s > compiled.max_seq_len:
            raise InputError(f"the prompt has {s} tokens, more than max_seq_len {compiled.max_seq_len}; "
                             "compile with a larger max_seq_len")
    else:
        if state.fingerprint != compiled.plans.model.fingerprint:
            raise InputError("this state belongs to another model's plan")
        if state.batch != b:
            raise InputError(f"the state holds {state.batch} sequences but input_ids has batch {b}")
        if state.position + s > state.max_seq_len:
            raise InputError(f"cannot add {s} tokens at position {state.position}: that passes max_seq_len "
                             f"{state.max_seq_len} (the KV cache is full); compile with a larger max_seq_len")
    # token ids are read in host memory (the plans' input node): ids given on a GPU cross once
    return input_ids.to("cpu", torch.int64)


LOGITS = ("all", "last", "argmax", "sample")


def sampler_device(compiled) -> str:
    """Where a compiled model's logits are made in decode steps (and its tokens selected)."""
    return "cuda" if compiled.decode.device == "cuda" else "cpu"


def start_sampling(compiled, state: State, params: SamplingParams | Sequence[SamplingParams],
                   prompt_ids: torch.Tensor | None = None) -> Sampler:
    """From now on `state`'s rows select their tokens by `params` (one for every row, or one per
    row) on the device that makes the decode step's logits (`execute(..., logits='sample')`,
    `decode_tokens`); `prompt_ids` [batch, tokens] are what the repetition penalty counts as
    seen. Returns the sampler (also `state.sampler`). Bad parameters: an InputError naming one."""
    rows = [params] * state.batch if isinstance(params, SamplingParams) else list(params)
    if len(rows) != state.batch:
        raise InputError(f"{len(rows)} sampling parameter sets for {state.batch} sequences: give one, or one per row")
    sampler = Sampler(state.batch, compiled.vocab_size, sampler_device(compiled))
    for r, p in enumerate(rows):
        sampler.set_row(r, p, None if prompt_ids is None else prompt_ids[r])
    state.sampler = sampler
    return sampler


@torch.inference_mode()
def execute(compiled, input_ids: torch.Tensor, state: State | None = None, *,
            logits: str = "all", hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
    """Run `input_ids` [batch, tokens] (int64 or int32, on the CPU or a GPU). With state=None:
    prefill from position 0; with a state: continue those sequences (one token = a decode step).
    Returns (logits float32 on the device of input_ids, state): [batch, tokens, vocab], or with
    logits='last' the last position's only, [batch, 1, vocab], or the next token ids [batch, 1]
    (int64, on the device of input_ids): logits='argmax' the greedy ones, logits='sample' those
    the state's sampler selects (`start_sampling`). A CUDA-graph decode step selects them on the
    GPU inside its graph, and only the ids reach the host. A prompt longer than the largest
    prefill bucket runs as chunks of it.

    `hidden` [batch, tokens, width]: the hidden vectors of a model that reads them, one a token
    (a multi-token-prediction layer, `Model.mtp()`: the main model's final normalised hidden
    states, which a State made with keep_hidden=True holds in `hidden_out`); required there,
    refused elsewhere."""
    if logits not in LOGITS:
        raise InputError(f"logits={logits!r}: ask for 'all' (every position), 'last' (the last position's), "
                         "'argmax' (the greedy next token ids) or 'sample' (the ids the state's sampler selects)")
    if logits == "sample" and (state is None or state.sampler is None):
        raise InputError("logits='sample' selects by the state's sampling parameters: start them with "
                         "ktflow.runtime.execute.start_sampling(compiled, state, params) (generate does)")
    ids = check_ids(compiled, input_ids, state)
    hidden = check_hidden(compiled, ids, hidden)
    if state is None:
        state = State(compiled.plans.model.fingerprint, ids.shape[0], compiled.max_seq_len)
    b, s = ids.shape
    if s == 1 and state.position > 0:
        out = compiled.executor(compiled.decode).run(ids, state, logits=logits, hidden=hidden)
        return out.to(input_ids.device), state
    if logits == "sample":
        out, state = prefill(compiled, ids, state, "last", hidden=hidden)
        chosen = require_finite(state.sampler.select(out[:, -1].to(state.sampler.device)), "the prompt's last position")
        return chosen.view(b, 1).to(input_ids.device), state
    return prefill(compiled, ids, state, logits, input_ids.device, hidden)


def check_hidden(compiled, ids: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor | None:
    """`hidden` as the compiled model reads it ([batch, tokens, width] floats, one vector a token of
    `ids`), None for a model without a hidden input, or an InputError saying what does not fit."""
    width = compiled.hidden_width
    if not width:
        if hidden is not None:
            raise InputError("hidden= is for a model that reads hidden vectors (a multi-token-prediction layer, "
                             "Model.mtp()); this one reads token ids only")
        return None
    if hidden is None:
        raise InputError(f"this model (a multi-token-prediction layer) reads the main model's hidden states beside "
                         f"the token ids: pass hidden= [batch, tokens, {width}]")
    want = (*ids.shape, width)
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or tuple(hidden.shape) != want:
        got = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise InputError(f"hidden must be a float tensor {list(want)} (one {width}-wide vector a token), got {got}")
    return hidden


@torch.inference_mode()
def decode_tokens(compiled, input_ids: torch.Tensor, state: State, steps: int, *, sampled: bool | None = None
                  ) -> torch.Tensor:
    """`steps` decode steps continuing `state` from input_ids [batch, 1] (the last token of each
    sequence): each step's selected token is the next one's input. Selected by the state's
    sampler (`start_sampling`) where it has one (`sampled`=None) or `sampled` is True, else
    greedily. Returns the new ids [batch, steps] (int64, CPU); the same as `steps` calls of
    execute(..., logits='sample' or 'argmax'). A CUDA-graph decode plan runs them as one graph
    launch, each step's token chosen on the GPU (the decode plan's `greedy_steps` option is the
    run length `generate` asks for)."""
    if not isinstance(steps, int) or not 1 <= steps <= 64:  # each K is captured as its own graph: a few, small
        raise InputError(f"steps must be an integer from 1 to 64, got {steps!r}")
    if state is None or state.position == 0:
        raise InputError("decoding continues a prefilled state: run the prompt with execute first")
    if sampled is None:
        sampled = state.sampler is not None and not state.sampler.plain_greedy
    if sampled and state.sampler is None:
        raise InputError("sampled decoding selects by the state's sampling parameters: start them with start_sampling")
    ids = check_ids(compiled, input_ids, state)
    check_hidden(compiled, ids, None)  # a model that reads hidden vectors decodes through execute(hidden=)
    if ids.shape[1] != 1:
        raise InputError(f"decoding takes one token per sequence, got input_ids of shape {list(ids.shape)}")
    if state.position + steps > state.max_seq_len:
        raise InputError(f"cannot decode {steps} tokens at position {state.position}: that passes max_seq_len "
                         f"{state.max_seq_len} (the KV cache is full); compile with a larger max_seq_len")
    return compiled.executor(compiled.decode).tokens(ids, state, steps, sampled)


def decode_greedy(compiled, input_ids: torch.Tensor, state: State, steps: int) -> torch.Tensor:
    """`steps` greedy decode steps (`decode_tokens` with sampled=False)."""
    return decode_tokens(compiled, input_ids, state, steps, sampled=False)


def prefill(compiled, ids: torch.Tensor, state: State, logits: str, device=None,
            hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
    """Run the prompt `ids` [batch, tokens] (checked) through prefill plans, from state.position,
    in chunks of the largest prefill bucket (even a one-token chunk past position 0 runs a
    prefill plan); returns the logits `execute` describes (None for logits='none'), on `device`
    (default: where they are), and the state."""
    b, s = ids.shape
    rows = max(1, compiled.chunk_tokens // b)
    pieces, hiddens = [], []
    for lo in range(0, s, rows):
        part = ids[:, lo:lo + rows]
        final = lo + rows >= s
        want = logits if final else ("all" if logits == "all" else "none")  # argmax: the final chunk's
        out = compiled.executor(compiled.prefill_plan(part.numel())).run(
            part, state, logits=want, hidden=None if hidden is None else hidden[:, lo:lo + rows])
        if out is not None:
            pieces.append(out if device is None else out.to(device))
        if state.keep_hidden:
            hiddens.append(state.hidden_out)
    if len(hiddens) > 1:
        state.hidden_out = torch.cat(hiddens, dim=1)
    if not pieces:  # logits='none'
        return None, state
    if logits == "argmax":
        return pieces[-1], state
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), state
