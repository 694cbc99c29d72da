"""One process a GPU rank, over torch.distributed: starting the ranks, joining them under
torchrun, and checking that their plans agree.

`run_ranks(n, target, *args, cuda=...)` starts n processes on this host (spawned), calls
`target(rank, *args)` in each, and returns when all have; a rank that raises or dies ends the
others, and the error names it. The process group: gloo alone (the correctness mode, GPU work on
the CPU), or with `cuda` one GPU a rank (rank r's current device is cuda:r, its local rank under
torchrun) and NCCL for CUDA tensors beside gloo for CPU ones; NCCL's communicator is made at the
start, before any step is captured. `join_from_env(cuda)` is the same group under torchrun (RANK,
WORLD_SIZE, MASTER_ADDR/PORT in the environment), so several machines join with `torchrun
--nnodes`. `check_plans_agree(plans)`: every rank's plans must list the same collectives in the
same order, or the ranks would wait on each other forever, and together compute each routed
expert of each layer exactly once; both are checked across the group at the start.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable

from ..errors import KtflowError
from ..util import env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=env.get("KTFLOW_RANK_TIMEOUT"))


def _init_group(cuda: bool, local_rank: int, global_rank: int, **kw) -> None:
    """This process's group: gloo, or with `cuda` NCCL for CUDA tensors too, on GPU `local_rank`
    (its communicator made now by a first all-reduce: a CUDA graph cannot capture its making). A
    rank past 0 drives no CPU experts: its native pool gets one unpinned worker, leaving the
    cores to rank 0's."""
    import torch
    import torch.distributed as dist

    if global_rank > 0:
        for name, value in (("KTFLOW_THREADS", "1"), ("KTFLOW_NUMA_GROUPS", "1"), ("KTFLOW_PIN", "0")):
            env.put(name, value)

    if not cuda:
        dist.init_process_group("gloo", timeout=_timeout(), **kw)
        return
    if local_rank >= torch.cuda.device_count():
        raise KtflowError(f"rank with local rank {local_rank} has no GPU: torch sees {torch.cuda.device_count()} "
                          "CUDA device(s) on this host; start at most that many ranks here")
    torch.cuda.set_device(local_rank)
    # NCCL's registration of a captured collective's buffers assumes each stays one allocation, which
    # the CUDA backend's expandable segments do not promise: left off (the all-reduces are latency-bound)
    os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
    dist.init_process_group("cpu:gloo,cuda:nccl", timeout=_timeout(), **kw)
    one = torch.ones(1, device="cuda")
    dist.all_reduce(one)
    torch.cuda.synchronize()


def _rank_main(rank: int, world: int, port: int, target: Callable, args: tuple, errors, cuda: bool = False) -> None:
    import torch.distributed as dist

    if rank > 0:  # Ctrl-C and SIGTERM are rank 0's to act on: it ends the others (or the parent does)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    code = 0
    try:
        _init_group(cuda, rank, rank, rank=rank, world_size=world)
        target(rank, *args)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the rank
        # stamped before the group goes down: its peers' errors (a lost connection) come after
        errors.put((time.time(), rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        code = 1
    finally:
        leave_group(ok=code == 0)
    if code:
        raise SystemExit(code)


def run_ranks(n: int, target: Callable, *args: Any, cuda: bool = False) -> None:
    """Run `target(rank, *args)` in n processes of one process group (`cuda`: rank r on GPU r,
    NCCL beside gloo); `target` and `args` must be importable and picklable (the processes are
    spawned). Raises
    KtflowError naming the first rank that failed, with its error; the other ranks are stopped,
    so nothing waits on a dead peer."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    if cuda:
        import torch

        if torch.cuda.device_count() < n:
            raise KtflowError(f"{n} CUDA ranks need {n} GPUs; torch sees {torch.cuda.device_count()} on this host "
                              f"(lower --gpus, or run the correctness mode with --device cpu)")
    procs = [ctx.Process(target=_rank_main, args=(r, n, port, target, args, errors, cuda), name=f"ktflow-rank{r}")
             for r in range(n)]
    for p in procs:
        p.start()
    # this process waits: Ctrl-C reaches the ranks themselves (rank 0 acts on it), SIGTERM goes on to rank 0
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, lambda sig, frame: procs[0].terminate())}
    try:
        failed = None
        while any(p.is_alive() for p in procs):
            bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            time.sleep(0.05)
        if failed is None:
            bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
            failed = bad[0] if bad else None
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    if failed is not None:
        deadline = time.monotonic() + 2  # the others' fates, briefly: a peer's lost connection follows a cause
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in procs:  # the other ranks ignore SIGTERM: stopped outright
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
        codes = [p.exitcode for p in procs]
        if 130 in codes:  # Ctrl-C: rank 0 acted on it, its peers lost their connections
            raise KeyboardInterrupt
        reports = []  # the first error raised is the cause (its peers then lose their connections)
        while not errors.empty():
            reports.append(errors.get())
        reported = {r for _, r, _, _ in reports}
        # a rank that died with no report (a signal: the OOM killer, a crash) is the cause before any error
        silent = [(r, c) for r, c in enumerate(codes) if c not in (0, None) and r not in reported]
        if silent:
            first, code = silent[0]
            msg = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            tb = ""
        elif reports:
            _, first, msg, tb = min(reports)
        else:
            first, msg, tb = failed[0], f"exited with code {failed[1]}", ""
        if env.get("KTFLOW_DEBUG") and tb:
            msg += "\n" + tb
        raise KtflowError(f"rank {first} of {n} failed: {msg} (the other ranks were stopped)")
    for p in procs:
        p.join()


def join_from_env(cuda: bool = False) -> tuple[int, int]:
    """(rank, world size) of this process under torchrun, its process group joined (`cuda`: on
    GPU LOCAL_RANK, NCCL beside gloo)."""
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise KtflowError(f"joining the ranks from the environment needs {', '.join(missing)} (torchrun sets them)")
    if not dist.is_initialized():
        _init_group(cuda, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["RANK"]))
    return dist.get_rank(), dist.get_world_size()


def leave_group(ok: bool) -> None:
    """Take this process out of its group before it exits. `ok` (its work done): first wait until
    every rank is done too, so that none tears down connections a peer still reads; a group left
    to the interpreter's exit can abort the process (a torchrun rank did, killed by SIGABRT)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    global _patient
    try:
        if ok:
            dist.barrier(group=patient_group())
    except Exception:  # noqa: BLE001 - a peer failed after its last step: its error is the one reported
        pass
    finally:
        dist.destroy_process_group()
        _patient = None


#: how long a rank waits on the others outside the steps (rank 0 packing its CPU experts, a
#: server's followers between requests): the launcher ends every rank when one dies
PATIENT = datetime.timedelta(days=365)


def patient_group():
    """A gloo group of every rank whose waits last PATIENT (made once; every rank must call this
    at the same point, as for any group)."""
    import torch.distributed as dist

    global _patient
    if _patient is None:
        _patient = dist.new_group(backend="gloo", timeout=PATIENT)
    return _patient


_patient = None


def all_ready() -> None:
    """Wait until every rank got here (its weights prepared), however long that takes."""
    import torch.distributed as dist

    dist.barrier(group=patient_group())


def common_seed(seed: int | None) -> int:
    """`seed`, or where None rank 0's random one, the same on every rank (sampled tokens must be)."""
    import random

    import torch
    import torch.distributed as dist

    t = torch.tensor([random.getrandbits(62) if seed is None else seed], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def plans_digest(plans) -> int:
    """A 63-bit digest of the collectives of `plans` (each plan's phase, step size and
    `collective_signature`, in order)."""
    from ..ir.ops import collective_signature

    h = hashlib.sha256()
    for p in plans:
        h.update(repr((p.phase, p.step_tokens, collective_signature(p.ir))).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def expert_cover(plans, experts: int):
    """(the spread MoE layers, [plans, layers, experts] int32): how many of each plan's
    routed-experts nodes compute each expert of each layer whose parts a collective sums (a NUMA
    shard of rows counted at its first slice only)."""
    import torch

    from ..ir.ops import Op

    layers = sorted({n.attrs.layer for p in plans for n in p.ir.nodes if n.op == Op.COLLECTIVE})
    row = {layer: i for i, layer in enumerate(layers)}
    cover = torch.zeros(len(plans), len(layers), experts, dtype=torch.int32)
    for i, p in enumerate(plans):
        for n in p.ir.nodes:
            if n.op == Op.ROUTED_EXPERTS and n.attrs.layer in row and n.attrs.rows[0] == 0:
                cover[i, row[n.attrs.layer], list(n.attrs.ids)] += 1
    return layers, cover


def check_plans_agree(plans) -> None:
    """Raise KtflowError on every rank where the ranks' plans do not list the same collectives
    in the same order (`plans_digest` gathered over the process group), naming the ranks, or
    where they do not compute each routed expert of each layer exactly once between them
    (`expert_cover` summed over the group): a rank compiled from another profile or options."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([plans_digest(plans)], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    digests = [int(t.item()) for t in every]
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        raise KtflowError(f"the ranks' plans disagree: rank(s) {odd} list other collectives than rank 0 (compile "
                          "every rank from the same model, options and hardware profile)")
    from ..ir.ops import Op

    most = torch.tensor([max((n.attrs.experts for p in plans for n in p.ir.nodes if n.op == Op.ROUTED_EXPERTS),
                             default=0)], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    layers, cover = expert_cover(plans, int(most.item()))
    dist.all_reduce(cover)
    bad = (cover != 1).nonzero()
    if len(bad):
        i, row, e = (int(x) for x in bad[0])
        raise KtflowError(f"the ranks' plans divide the experts wrongly: {plans[i].phase} plan "
                          f"({plans[i].step_tokens} tokens a step), expert {e} of layer {layers[row]} is computed "
                          f"{int(cover[i, row, e])} times over the ranks, not once ({len(bad)} such); compile every "
                          "rank from the same model, options and hardware profile")
