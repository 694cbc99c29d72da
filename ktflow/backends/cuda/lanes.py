"""The plan's GPU lanes as CUDA streams: the record and wait steps of one run, shared by every
runner that issues a plan on streams (decode.py, prefill.py).

A record step marks its event on its lane's stream; a wait step holds its lane's stream until that
event. Events of lanes without a stream (the CPU's) are left alone: host nodes order those."""

from __future__ import annotations

import torch

from ...plan.artifact import Step


class Lanes:
    """One run's lane streams and the events its record steps made (a fresh Lanes per run)."""

    def __init__(self, streams: dict[str, torch.cuda.Stream]):
        self.streams = streams
        self.events: dict[str, torch.cuda.Event] = {}

    def stream(self, step: Step) -> torch.cuda.Stream | None:
        """The stream of the step's lane; None for a lane without one (the CPU's)."""
        return self.streams.get(step.lane)

    def record(self, i: int, step: Step, values: dict) -> None:
        stream = self.streams.get(step.lane)
        if stream is not None:
            self.events[step.event] = torch.cuda.Event()
            self.events[step.event].record(stream)

    def wait(self, i: int, step: Step, values: dict) -> None:
        stream = self.streams.get(step.lane)
        if stream is not None and step.event in self.events:
            stream.wait_event(self.events[step.event])
