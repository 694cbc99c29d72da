"""What a collective among the GPUs of one host costs, from the profile's `gpu_link`.

NCCL's ring algorithms, in its own terms: a collective of `nbytes` (the whole buffer: an
all-reduce's input, an all-gather's output, a reduce-scatter's input) over n ranks moves
factor(n) x nbytes through each link, at the link's bus bandwidth, after a fixed latency:

    all_reduce                        factor 2 (n - 1) / n
    all_gather, reduce_scatter        factor (n - 1) / n
    all_to_all                        factor (n - 1) / n
    send_recv (one GPU to another)    nbytes at p2p_gbps

One rank moves nothing and costs nothing.
"""

from __future__ import annotations

from ..errors import ConfigError
from .hw import HwProfile

#: the bus-bandwidth factor of each ring collective (send_recv has none: it is one transfer)
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
KINDS = (*RING_FACTOR, "send_recv")


def collective_seconds(kind: str, nbytes: float, ranks: int, hw: HwProfile) -> float:
    """Seconds of collective `kind` over `ranks` GPUs of `hw` moving a buffer of `nbytes`."""
    if kind not in KINDS:
        raise ConfigError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")
    if ranks <= 1:
        return 0.0
    link = hw.gpu_link
    if link is None:
        raise ConfigError(f"hardware profile {hw.name!r} has no gpu_link to price a {kind} over {ranks} GPUs: "
                          "`ktflow hw probe` on a machine with several GPUs measures one")
    latency = link.allreduce_latency_us * 1e-6
    if kind == "send_recv":
        return latency + nbytes / (link.p2p_gbps * 1e9)
    return latency + RING_FACTOR[kind](ranks) * nbytes / (link.allreduce_busbw_gbps * 1e9)
