"""The public API: load, compile, execute, generate."""

from __future__ import annotations

import os
from typing import Any

import torch
from pydantic import ValidationError

from .backends import get_backend, resolve_backend
from .config import DTYPE_BY_NAME
from .errors import ConfigError, InputError, PlanError
from .hw import HwProfile, resolve_hw
from .ir.graph import Graph
from .ir.ops import Op
from .ir.types import Device
from .model import Model, load
from .options import CompileContext, CompileOptions
from .cost import activation_peak, gpu_workspace_bytes
from .passes import run_pipeline
from .passes.buffers import plan_buffers
from .passes.schedule import schedule
from .plan import MemoryEstimate, ModelInfo, Plan, PlanFile
from .runtime.executor import Executor
from .runtime.state import State
from .weights import TORCH_DTYPE



class Compiled:
    """A model's prefill and decode plans, with the model they run (when it is loaded).

    `save(path)` writes the plan file; `Compiled.load(path, model)` reads it back, checking
    that it was compiled by this ktflow version for this model.
    """

    def __init__(self, plans: PlanFile, model: Model | None):
        self.plans, self.model = plans, model
        self._backend: Any = None
        self._executors: dict[str, Executor] = {}

    @property
    def prefill(self) -> Plan:
        return self.plans.prefill

    @property
    def decode(self) -> Plan:
        return self.plans.decode

    @property
    def max_seq_len(self) -> int:
        return self.prefill.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.prefill.ir.by_name("lm_head").attrs.vocab

    def save(self, path: str | os.PathLike) -> None:
        self.plans.save(path)

    @staticmethod
    def load(path: str | os.PathLike, model: Model | str | os.PathLike | None = None) -> "Compiled":
        """Read a plan file. `model` (a Model or a checkpoint dir) defaults to the dir the plan
        was compiled from; the plan must match its config fingerprint."""
        if model is None:
            pf = PlanFile.load(path)
            model = load(pf.model.path)
        elif not isinstance(model, Model):
            model = load(model)
        return Compiled(PlanFile.load(path, fingerprint=model.fingerprint), model)

    def summary(self) -> str:
        return self.plans.summary()

    def as_text(self) -> str:
        return self.prefill.as_text() + "\n" + self.decode.as_text()

    # -------------------------------------------------------------------------------- running
    def prepare(self) -> float:
        """Make both plans ready to run (the backend loads the weights); returns seconds taken.
        `execute` does this on first use; call it first to keep loading out of timings."""
        import time

        t0 = time.perf_counter()
        self.executor("prefill")
        self.executor("decode")
        return time.perf_counter() - t0

    def executor(self, phase: str) -> Executor:
        if phase not in self._executors:
            if self.model is None:
                raise PlanError("this plan has no model attached; use Compiled.load(path, model)")
            plan = self.prefill if phase == "prefill" else self.decode
            if self._backend is None:
                device = "cuda" if plan.device == "cuda" else "cpu"
                if device == "cuda":
                    check_gpu(self.plans)
                dtype = TORCH_DTYPE[plan.ir.act_dtype]
                name = resolve_backend(self.plans.options.backend, dtype, device)
                self._backend = get_backend(name)(device, dtype, options=self.plans.options)
            self._backend.prepare(plan.ir, self.model.weights)
            self._executors[phase] = Executor(plan, self._backend)
        return self._executors[phase]


#: how far this GPU's memory may be from the one a plan was compiled for
GPU_MEMORY_TOLERANCE = 0.03


def check_gpu(pf: PlanFile) -> None:
    """A plan whose GPU nodes run on CUDA needs a CUDA device here, with the memory it was
    placed for (its VRAM budget and expert placement assume that size)."""
    where = f"{pf.model.model_type} plan compiled for {pf.hw.name}"
    if not torch.cuda.is_available():
        raise PlanError(f"this {where} runs its GPU nodes on CUDA, but torch sees no CUDA device on this machine; "
                        "compile it for this machine (`ktflow compile --hw this`, or hw=None / device='cpu' in "
                        "ktflow.compile) and run that plan")
    if not pf.hw.gpus:
        return
    planned = pf.hw.gpus[0].memory_bytes
    here = float(torch.cuda.get_device_properties(0).total_memory)
    if abs(here - planned) > GPU_MEMORY_TOLERANCE * planned:
        raise PlanError(f"this {where} was placed for a GPU with {planned / 2**30:.1f} GiB of memory "
                        f"({pf.hw.gpus[0].name}); this GPU ({torch.cuda.get_device_name(0)}) has {here / 2**30:.1f} GiB. "
                        "Recompile it for this machine (`ktflow compile --hw this`, or `ktflow hw probe`)")


def _device(opts: CompileOptions, hw: HwProfile) -> str:
    if opts.device == "cpu":
        return "cpu"
    usable = hw.has_gpu and torch.cuda.is_available()
    if opts.device == "cuda" and not usable:
        raise ConfigError("device='cuda' was asked for but " + (
            f"hardware profile {hw.name!r} lists no GPU" if not hw.has_gpu else "torch sees no CUDA device"))
    return "cuda" if usable else "cpu"


def _memory(g: Graph, ctx: CompileContext) -> MemoryEstimate:
    """Predicted memory per device: weights and KV caches where their nodes are placed (a GPU
    expert has no host copy), one step's activations on each device that runs nodes, and the
    GPU reserve."""
    weights = {Device.CPU: 0.0, Device.GPU: 0.0}
    kv = {Device.CPU: 0.0, Device.GPU: 0.0}
    for n in g.nodes:
        dev = n.place.device
        weights[dev] += n.weight_elems() * ctx.weight_itemsize
        if n.op == Op.ATTENTION:
            kv[dev] += (n.attrs.kv_cache_elems_per_token() * ctx.max_seq_len * ctx.options.max_batch
                        * g.act_dtype.itemsize)
    act = activation_peak(g, ctx.tokens)
    on_gpu = any(n.place.device == Device.GPU for n in g.nodes)
    ws = gpu_workspace_bytes(ctx.hw) if on_gpu else 0.0
    return MemoryEstimate(weight_bytes=weights[Device.CPU] + weights[Device.GPU],
                          kv_cache_bytes=kv[Device.CPU] + kv[Device.GPU], activation_bytes=act, workspace_bytes=ws,
                          gpu_bytes=(weights[Device.GPU] + kv[Device.GPU] + act + ws + ctx.options.vram_reserve_gb * 1e9)
                          if on_gpu else 0.0,
                          host_bytes=weights[Device.CPU] + kv[Device.CPU] + act)


def compile(model: Model, hw: HwProfile | str | os.PathLike | None = None, *, print_after: str | None = None,
            **options: Any) -> Compiled:
    """Compile `model` into a prefill and a decode plan for hardware `hw` (a profile, a preset
    name, a profile JSON path, or None for this machine). Options: see `CompileOptions`."""
    try:
        opts = CompileOptions(**options)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, er['loc'])) or 'options'}: {er['msg']}" for er in e.errors())
        raise ConfigError(f"compile options: {msgs} (valid options: {', '.join(CompileOptions.model_fields)})") from None
    hwp = resolve_hw(hw)
    cfg = model.config
    act = DTYPE_BY_NAME[opts.dtype] if opts.dtype else cfg.weight_dtype
    max_seq = opts.max_seq_len or min(4096, cfg.max_position_embeddings)
    device = _device(opts, hwp)
    spec = model.graph(act)
    routing = None
    if opts.routing_profile:
        from .cost import RoutingProfile

        routing = RoutingProfile.load(opts.routing_profile)
        routing.check_against(spec)
    plans = {}
    for phase in ("prefill", "decode"):
        if phase == "prefill":
            tokens, batch = min(opts.prefill_tokens, max_seq), 1
            context = (tokens + 1) // 2
        else:
            tokens = batch = opts.max_batch
            context = max_seq // 2
        ctx = CompileContext(hw=hwp, options=opts, phase=phase, tokens=tokens, batch=batch, context=context,
                             weight_itemsize=cfg.weight_dtype.itemsize, max_seq_len=max_seq, device=device,
                             routing=routing)
        g, timings = run_pipeline(spec, ctx, print_after=print_after)
        steps = schedule(g, ctx)
        buffers, arenas = plan_buffers(g, steps, tokens)
        gpu_work = any(n.place.device == Device.GPU for n in g.nodes)
        plans[phase] = Plan(phase=phase, device=device, max_seq_len=max_seq, step_tokens=tokens, graph=g.to_dict(),
                            steps=steps, predicted_step_us=max((s.end_us for s in steps), default=0.0),
                            memory=_memory(g, ctx), pass_seconds=timings, buffers=buffers, arenas=arenas,
                            capture=[(0, len(steps) - 1)] if phase == "decode" and gpu_work else [])
    info = ModelInfo(model_type=cfg.model_type, fingerprint=model.fingerprint, path=str(model.path.resolve()),
                     layers=cfg.num_hidden_layers)
    pf = PlanFile(model=info, hw=hwp, options=opts, prefill=plans["prefill"], decode=plans["decode"])
    return Compiled(pf, model)


def _check_ids(compiled: Compiled, input_ids: Any, state: State | None) -> torch.Tensor:
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
    return input_ids.to(torch.int64)


@torch.inference_mode()
def execute(compiled: Compiled, input_ids: torch.Tensor, state: State | None = None) -> tuple[torch.Tensor, State]:
    """Run `input_ids` [batch, tokens]. With state=None: prefill from position 0; with a state:
    continue those sequences (one token = a decode step). Returns (logits [batch, tokens, vocab]
    float32 on the device of input_ids, state)."""
    ids = _check_ids(compiled, input_ids, state)
    if state is None:
        state = State(compiled.plans.model.fingerprint, ids.shape[0], compiled.max_seq_len)
    phase = "decode" if ids.shape[1] == 1 and state.position > 0 else "prefill"
    logits = compiled.executor(phase).run(ids, state)
    return logits.to(input_ids.device), state


def generate(compiled: Compiled, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None) -> torch.Tensor:
    """Prompt + up to `max_new_tokens` generated tokens per row, [batch, prompt + new] (greedy when
    temperature is 0; rows that reach an eos token are padded with it until all rows have)."""
    from .runtime.generate import generate_with_stats

    return generate_with_stats(compiled, input_ids, max_new_tokens, temperature=temperature, top_p=top_p,
                               seed=seed, eos_token_id=eos_token_id)[0]
