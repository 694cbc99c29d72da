"""How the serving engine runs the model: the `Runner` interface and its first implementation.

The scheduler (`engine.py`) holds a fixed number of slots and speaks to the model only through a
Runner, in slot numbers and token ids:

- `start(slot)`: a new sequence begins in `slot` at position 0 (the slot's KV cache is reused,
  not reallocated: positions past the new sequence's are never read);
- `prefill(slot, ids, last)`: the next chunk of that sequence's prompt, continuing its cache;
  when `last` is set, returns the logits of the chunk's final position ([vocab], float32, CPU);
- `decode(slots, ids)`: one token for each listed slot (each at its own position), returning
  per slot either its next-token logits ([vocab], float32, CPU) or the exception that failed
  that slot only;
- `free(slot)`: the sequence in `slot` is finished.

`SequenceRunner` gives every slot its own batch-1 `State` and runs each slot's step as its own
`ktflow.execute` call: ktflow's `State` holds one position for its whole batch, so sequences at
different positions cannot share a batched step yet. A batched runner (one decode step over
every slot's row, each at its own position) drops in behind the same interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..runtime.execute import execute
from ..runtime.state import State


class Runner(Protocol):
    """What the scheduler needs from the model (see the module docstring)."""

    slots: int
    max_seq_len: int
    vocab_size: int

    def start(self, slot: int) -> None: ...

    def prefill(self, slot: int, ids: list[int], last: bool) -> torch.Tensor | None: ...

    def decode(self, slots: list[int], ids: list[int]) -> list[torch.Tensor | BaseException]: ...

    def free(self, slot: int) -> None: ...


class SequenceRunner:
    """A Runner that runs every slot as its own batch-1 sequence through `ktflow.execute`.

    The cuda_graph backend keeps one static KV cache per batch size, lent to the sequence that
    prefilled last, so on that backend this runner holds one slot (`note` says so)."""

    def __init__(self, compiled, slots: int):
        if slots < 1:
            raise ValueError(f"a runner needs at least one slot, got {slots}")
        self.compiled = compiled
        self.max_seq_len = compiled.max_seq_len
        self.vocab_size = compiled.vocab_size
        backend = compiled.executor(compiled.decode).backend.name
        self.note = ""
        if backend == "cuda_graph" and slots > 1:
            self.note = (f"the cuda_graph backend keeps one KV cache per batch size, so sequences run one at a time "
                         f"(--max-batch {slots} asked for); the others wait in the queue")
            slots = 1
        self.slots = slots
        fingerprint = compiled.plans.model.fingerprint
        self.states = [State(fingerprint, 1, self.max_seq_len) for _ in range(slots)]

    def warm(self) -> None:
        """Run one token in every slot, so each slot's KV cache (and the plans' first-use work)
        is made before the first request rather than during it."""
        for slot in range(self.slots):
            self.start(slot)
            self.prefill(slot, [0], last=False)
            self.start(slot)

    def start(self, slot: int) -> None:
        self.states[slot].position = 0

    def prefill(self, slot: int, ids: list[int], last: bool) -> torch.Tensor | None:
        out, _ = execute(self.compiled, torch.tensor([ids], dtype=torch.int64), self.states[slot], logits="last")
        return out[0, -1].float().cpu() if last else None

    def decode(self, slots: list[int], ids: list[int]) -> list[torch.Tensor | BaseException]:
        results: list[torch.Tensor | BaseException] = []
        for slot, tok in zip(slots, ids):
            try:
                out, _ = execute(self.compiled, torch.tensor([[tok]], dtype=torch.int64), self.states[slot],
                                 logits="last")
                results.append(out[0, -1].float().cpu())
            except Exception as e:  # noqa: BLE001 - one sequence's failure is that sequence's only
                results.append(e)
        return results

    def free(self, slot: int) -> None:
        pass  # the slot's cache stays allocated for its next sequence
