"""Compiled: a plan file with the model it runs, its backend and one executor per plan; and the
check that this machine's GPU is the one the plans were placed for (`check_gpu`)."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..backends import get_backend, resolve_backend
from ..errors import PlanError, ResourceError
from ..frontend.load import Model, load, part_of
from ..frontend.weights import TORCH_DTYPE
from ..ir.ops import Op
from ..plan.artifact import Plan, PlanFile
from ..plan.check import spec_mismatches
from .executor import Executor

class Compiled:
    """A model's plans: prefill plans for buckets of prompt length (ascending `step_tokens`; a
    step longer than the last runs as chunks of it) and one decode plan, with the model they run
    (when it is loaded).

    `save(path)` writes the plan file; `Compiled.load(path, model)` reads it back, checking
    that it was compiled by this ktflow version for this model.
    """

    def __init__(self, plans: PlanFile, model: Model | None):
        self.plans, self.model = plans, model
        #: the MTP layer's compiled plans, where the compile chose speculative decoding (generate uses them)
        self.draft = Compiled(plans.draft, model.mtp()) if plans.draft is not None and model is not None else None
        self._backend: Any = None
        self._executors: dict[int, Executor] = {}
        #: check every step's values for NaN and infinity (also KTFLOW_CHECK_FINITE=1): slower, for finding
        #: where a model goes non-finite
        self.check_finite = False

    @property
    def prefill(self) -> list[Plan]:
        """The prefill plans, one per prompt-length bucket, ascending."""
        return self.plans.prefill

    @property
    def decode(self) -> Plan:
        return self.plans.decode

    @property
    def max_seq_len(self) -> int:
        return self.decode.max_seq_len

    @property
    def chunk_tokens(self) -> int:
        """Most tokens one prefill step runs; longer prompts run as chunks of this many."""
        return self.prefill[-1].step_tokens

    @functools.cached_property
    def hidden_width(self) -> int:
        """The width of the hidden vectors the model reads beside its token ids (a multi-token-
        prediction layer's), 0 for a model that reads token ids only."""
        return next((n.attrs.hidden for n in self.decode.ir.nodes if n.op == Op.INPUT and n.attrs.hidden), 0)

    @property
    def vocab_size(self) -> int:
        return self.decode.ir.by_name(self.decode.ir.outputs[0]).attrs.vocab

    def prefill_plan(self, tokens: int) -> Plan:
        """The prefill plan of the smallest bucket that holds a step of `tokens` tokens (the
        largest bucket for a longer step, which runs as chunks)."""
        return self.plans.prefill_for(tokens)

    def save(self, path: str | os.PathLike) -> None:
        self.plans.save(path)

    @staticmethod
    def load(path: str | os.PathLike, model: Model | str | os.PathLike | None = None) -> "Compiled":
        """Read a plan file. `model` (a Model or a checkpoint dir) defaults to the dir the plan
        was compiled from; the plan must match its config fingerprint."""
        pf = PlanFile.load(path)  # read and verified once
        mtp = part_of(pf.model.fingerprint) == "mtp"  # a plan of the checkpoint's MTP layer (Model.mtp())
        if model is None:
            model = load(pf.model.path)
        elif not isinstance(model, Model):
            model = load(model)
        if mtp and model.part != "mtp" and model.has_mtp:
            model = model.mtp()
        pf.require_model(model.fingerprint, path)
        parts = [(pf, model)]
        if pf.draft is not None:  # the MTP layer's plans, the speculative draft
            part = model.mtp()
            pf.draft.require_model(part.fingerprint, path)
            parts.append((pf.draft, part))
        for plans, part in parts:
            for plan in plans.plans:
                bad = spec_mismatches(plan, part.graph(plan.ir.act_dtype))
                if bad:
                    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                    raise PlanError(f"plan file {path}: its {plan.phase} plan does not match the model at {part.path}: "
                                    f"{bad[0]}{more}. Recompile it with `ktflow compile`.")
        return Compiled(pf, model)

    def summary(self) -> str:
        return self.plans.summary()

    def as_text(self) -> str:
        return "\n".join(p.as_text() for p in (*self.prefill, self.decode))

    # -------------------------------------------------------------------------------- running
    def prepare(self) -> float:
        """Make every plan ready to run (the backend loads the weights); returns seconds taken.
        `execute` does this on first use; call it first to keep loading out of timings."""
        import time

        t0 = time.perf_counter()
        for plan in (self.decode, *self.prefill):  # decode first: prefill plans stream from its packed experts
            self.executor(plan)
        return time.perf_counter() - t0

    def executor(self, plan: Plan | str) -> Executor:
        """The executor of `plan` (or of the decode plan / the first prefill plan, by phase name)."""
        if isinstance(plan, str):
            plan = self.decode if plan == "decode" else self.prefill[0]
        key = id(plan)
        if key not in self._executors and plan is not self.decode and any(n.op == Op.FETCH for n in plan.ir.nodes):
            # the decode plan's CPU experts packed first: a prefill fetch then copies from them (NUMA
            # shards included) instead of packing the layer's experts again
            self.executor(self.decode)
        if key not in self._executors:
            if self.model is None:
                raise PlanError("this plan has no model attached; use Compiled.load(path, model)")
            if self._backend is None:
                device = "cuda" if plan.device == "cuda" else "cpu"
                if device == "cuda":
                    check_gpu(self.plans)
                dtype = TORCH_DTYPE[plan.ir.act_dtype]
                name = resolve_backend(self.plans.options.backend, dtype, device)
                self._backend = get_backend(name)(device, dtype, options=self.plans.options)
            self._backend.prepare(plan.ir, self.model.weights)
            if plan.lent_experts and hasattr(self._backend, "lend"):
                # before its first step (a decode graph captured later reads the region's addresses); a
                # backend without lending runs the borrowing plans with staging of their own
                self._backend.lend([plan.ir.by_name(n) for n in plan.lent_experts])
            self._executors[key] = Executor(plan, self._backend)
        ex = self._executors[key]
        ex.check_finite = ex.check_finite or self.check_finite
        return ex


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
    gpu = pf.hw.gpus[min(pf.options.rank, len(pf.hw.gpus) - 1)]  # this rank's GPU (rank r: the current device)
    planned = gpu.memory_bytes
    here = float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    if abs(here - planned) > GPU_MEMORY_TOLERANCE * planned:
        raise PlanError(f"this {where} was placed for a GPU with {planned / 2**30:.1f} GiB of memory "
                        f"({gpu.name}); this GPU ({torch.cuda.get_device_name()}) has {here / 2**30:.1f} GiB. "
                        "Recompile it for this machine (`ktflow compile --hw this`, or `ktflow hw probe`)")
    # before anything is allocated: what the plans will take against what is free now (memory this
    # process's allocator already holds counts as free; the reserve is what the plan leaves unused)
    need = max((p.memory.gpu_bytes for p in pf.plans if p.device == "cuda"), default=0.0)
    free, total = torch.cuda.mem_get_info()
    usable = free + torch.cuda.memory_reserved()
    if need > usable:
        raise ResourceError(f"the {where} needs {need / 1e9:.1f} GB of GPU memory; {usable / 1e9:.1f} GB of "
                            f"{total / 1e9:.1f} GB are free (other processes hold the rest). Free the GPU, or compile "
                            "with a smaller --vram-gb")
