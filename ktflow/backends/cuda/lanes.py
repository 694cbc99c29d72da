"""The plan's GPU lanes as CUDA streams: the record and wait instructions of one run, shared by
every runner that issues a plan on streams (decode.py, prefill.py).

A record instruction marks its event on its lane's stream; a wait instruction holds its lane's
stream until that event. Events of lanes without a stream (the CPU's) are left alone: host nodes
order those."""

from __future__ import annotations

import torch

from ...plan.artifact import Instruction


class Lanes:
    """One run's lane streams and the events its record instructions made (a fresh Lanes per run)."""

    def __init__(self, streams: dict[str, torch.cuda.Stream]):
        self.streams = streams
        self.events: dict[str, torch.cuda.Event] = {}

    def stream(self, ins: Instruction) -> torch.cuda.Stream | None:
        """The stream of the instruction's lane; None for a lane without one (the CPU's)."""
        return self.streams.get(ins.lane)

    def record(self, i: int, ins: Instruction, values: dict) -> None:
        stream = self.streams.get(ins.lane)
        if stream is not None:
            self.events[ins.event] = torch.cuda.Event()
            self.events[ins.event].record(stream)

    def wait(self, i: int, ins: Instruction, values: dict) -> None:
        stream = self.streams.get(ins.lane)
        if stream is not None and ins.event in self.events:
            stream.wait_event(self.events[ins.event])
