"""What a node costs inside a replayed CUDA graph (GPU machine): the decode step's graph is a few
hundred small kernels with copies across PCIe and stream memory operations among them, and on the
GPU a node's cost can be far from its own run time.

Each row is a graph of `--kernels` small elementwise kernels (about 1 us each) with N nodes of one
kind spread among them; reported: us per replay (back-to-back replays, mean) and us per added node
against the kernels-only graph. Kinds:

  memcpy d2h / h2d     a 4 KB copy to / from pinned host memory as a copy-engine memcpy node
  kernel d2h / h2d     the same copy as backends/pinned_copy's kernel on the mapped buffer
  write+wait pairs     cuStreamWriteValue32 then cuStreamWaitValue32 on a pinned word already set

    python benchmarks/graph_nodes.py [--kernels 300] [--nodes 40]

Rows go to benchmarks/graph_nodes.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common import append_jsonl, commit, machine

HERE = Path(__file__).resolve().parent


def build(kernels: int, nodes: int, kind: str, stream: torch.cuda.Stream):
    """A captured graph of `kernels` small kernels with `nodes` nodes of `kind` among them."""
    from ktflow.backends.kernels import pinned_copy
    from ktflow.backends.cuda.backend import Driver

    x = torch.zeros(2048, device="cuda", dtype=torch.bfloat16)
    host = torch.zeros(2048, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.zeros_like(x)
    words = torch.ones(2 * max(nodes, 1), dtype=torch.int32, pin_memory=True)
    driver = Driver() if kind == "write+wait pairs" else None
    base = driver.device_address(words) if driver else 0
    with torch.cuda.stream(stream):  # the Triton kernel compiles outside the capture
        pinned_copy.copy(host, x)
        pinned_copy.copy(dev, host)
    torch.cuda.synchronize()
    every = max(kernels // max(nodes, 1), 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = x
        for i in range(kernels):
            y = y + 1
            if not nodes or i % every or i // every >= nodes:
                continue
            j = i // every
            if kind == "memcpy d2h":
                host.copy_(y, non_blocking=True)
            elif kind == "kernel d2h":
                pinned_copy.copy(host, y)
            elif kind == "memcpy h2d":
                y = y + dev.copy_(host, non_blocking=True)
            elif kind == "kernel h2d":
                y = y + pinned_copy.copy(dev, host)
            elif kind == "write+wait pairs":
                driver.write_value(stream, base + 8 * j + 4, 1)
                driver.wait_value(stream, base + 8 * j, 1)
    return graph, (x, host, dev, words)


def per_replay_us(graph, stream: torch.cuda.Stream, n: int) -> float:
    with torch.cuda.stream(stream):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(n):
            graph.replay()
    stream.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--nodes", type=int, default=40)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "graph_nodes.jsonl"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("graph_nodes.py needs a CUDA GPU", file=sys.stderr)
        return 2
    stream = torch.cuda.Stream()
    kinds = ["none", "memcpy d2h", "kernel d2h", "memcpy h2d", "kernel h2d", "write+wait pairs"]
    rows, base = [], None
    print(f"{a.kernels} small kernels per graph, {a.nodes} nodes of each kind among them; us per replay "
          f"(mean of {a.replays} back-to-back replays, median of 3 runs)")
    for kind in kinds:
        graph, keep = build(a.kernels, 0 if kind == "none" else a.nodes, kind, stream)
        us = sorted(per_replay_us(graph, stream, a.replays) for _ in range(3))[1]
        base = us if kind == "none" else base
        added = None if kind == "none" else (us - base) / a.nodes
        print(f"  {kind:18s} {us:8.1f} us" + (f"  ({added:+.1f} us a node)" if added is not None else ""), flush=True)
        rows.append(dict(machine(), commit=commit(), bench="graph_nodes", kind=kind, kernels=a.kernels,
                         nodes=0 if kind == "none" else a.nodes, us_per_replay=round(us, 1),
                         us_per_node=None if added is None else round(added, 2),
                         gpu=torch.cuda.get_device_name(0)))
        del graph, keep
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
