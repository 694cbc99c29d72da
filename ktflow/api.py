"""The public API: load, compile, execute, generate.

`compile` validates the options, resolves the hardware profile and where GPU nodes run, then
hands the model to the compile driver (passes.compile.compile_plans) and wraps its plan file as
a runnable `Compiled`.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
from pydantic import ValidationError

from .costmodel.hw import HwProfile, resolve_hw
from .errors import ConfigError
from .frontend.load import Model, load  # noqa: F401 (the public API's)
from .passes.compile import compile_plans
from .plan.options import CompileOptions
from .runtime.compiled import Compiled
from .runtime.execute import decode_greedy, decode_tokens, execute, start_sampling  # noqa: F401 (the public API's)
from .runtime.generate import generate_with_stats, stream_tokens


def compile(model: Model, hw: HwProfile | str | os.PathLike | None = None, *, print_after: str | None = None,
            passes: list | None = None, instruments: list | None = None, **options: Any) -> Compiled:
    """Compile `model` into prefill plans (one per prompt-length bucket) and a decode plan for
    hardware `hw` (a profile, a preset name, a profile JSON path, or None for this machine).
    Options: see `CompileOptions`. `passes` edits the pass pipeline (`passes.edit_pipeline`: a
    list of (where, pass) pairs such as ("after:place_by_intensity", my_pass)); the plan file
    records the pipeline that made it (`PlanFile.pipeline`). `instruments` (passes.Instrument)
    watch every pass of the decode plan and the largest prefill bucket's, as `print_after`
    (the graph printed after that pass) and KTFLOW_DUMP do."""
    try:
        opts = CompileOptions(**options)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'options'}: {er['msg']}" for er in e.errors())
        raise ConfigError(f"compile options: {msgs} (valid options: {', '.join(CompileOptions.model_fields)})") from None
    hwp = resolve_hw(hw)
    pf = compile_plans(model, hwp, opts, _device(opts, hwp), print_after, passes, instruments)
    return Compiled(pf, model)


def _device(opts: CompileOptions, hw: HwProfile) -> str:
    """Where GPU-placed nodes run: 'cuda' where the profile has a GPU and torch sees one (or the
    options say cpu), else 'cpu'."""
    if opts.device == "cpu":
        return "cpu"
    usable = hw.has_gpu and torch.cuda.is_available()
    if opts.device == "cuda" and not usable:
        raise ConfigError("device='cuda' was asked for but " + (
            f"hardware profile {hw.name!r} lists no GPU" if not hw.has_gpu else "torch sees no CUDA device"))
    return "cuda" if usable else "cpu"


def stream(compiled: Compiled, input_ids, max_new_tokens: int, **kwargs: Any) -> Iterator[int]:
    """One prompt's new token ids as they are selected (`input_ids`: a list of ids or a [1, T]
    tensor), up to `max_new_tokens`, ending before the first end-of-sequence id (the checkpoint's
    unless eos_token_id= names others, or None). Sampling keywords as generate's."""
    return stream_tokens(compiled, input_ids, max_new_tokens, **kwargs)


def generate(compiled: Compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None | str = "model",
             **sampling: Any) -> torch.Tensor:
    """Prompt + up to `max_new_tokens` generated tokens per row, [batch, prompt + new] (greedy when
    temperature is 0; rows that reach an eos token are padded with it until all rows have; the eos
    ids are the checkpoint's, from config.json and generation_config.json, unless `eos_token_id`
    names others, or None for none).
    `sampling`: the other token-selection parameters (top_k, min_p, repetition_penalty,
    presence_penalty, frequency_penalty, logit_bias; or sampling=SamplingParams, or a list with
    one per row), selected where the logits are (inside the captured decode step on a GPU).
    Decoding runs `greedy_steps` steps per call of the decode plan (`decode_tokens`: one graph
    launch on the cuda_graph backend), greedy or sampled; the ids are those of one step at a time."""
    return generate_with_stats(compiled, input_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, eos_token_id=eos_token_id, **sampling)[0]
