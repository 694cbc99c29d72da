"""Copies between the GPU and pinned host memory as a kernel (backends/pinned_copy): every
direction and word size, and inside a captured graph, replayed with the host side changed
between replays (a load must not be served from a line an earlier replay cached)."""

import pytest
import torch

from ktflow.backends.kernels import dequant_gpu, pinned_copy

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and dequant_gpu.available(torch.device("cuda"))),
                         reason="needs a CUDA GPU and Triton")


@gpu
@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 2048), (torch.int64, 3), (torch.float32, 5000),
                                     (torch.uint8, 7), (torch.bfloat16, 3)])
def test_both_directions_copy_every_byte(dtype, n):
    g = torch.Generator().manual_seed(n)
    src = (torch.randn(n, generator=g) * 100).to(dtype)
    host = src.pin_memory()
    dev = torch.empty(n, dtype=dtype, device="cuda")
    pinned_copy.copy(dev, host)
    back = torch.empty(n, dtype=dtype).pin_memory()
    pinned_copy.copy(back, dev * 1)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src) and torch.equal(back, src)


@gpu
def test_views_at_odd_offsets_copy_by_narrower_words():
    host = torch.arange(64, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")
    pinned_copy.copy(dev[3:10], host[1:8])  # neither address is even
    halves = torch.arange(32, dtype=torch.bfloat16).pin_memory()
    out = torch.zeros(32, dtype=torch.bfloat16, device="cuda")
    pinned_copy.copy(out[1:5], halves[3:7])  # 2-byte aligned, not 4
    torch.cuda.synchronize()
    assert torch.equal(dev[3:10].cpu(), host[1:8]) and torch.equal(out[1:5].cpu(), halves[3:7])


@gpu
def test_replays_read_the_host_values_of_their_time():
    host_in = torch.zeros(1024, dtype=torch.float32).pin_memory()
    host_out = torch.zeros(1024, dtype=torch.float32).pin_memory()
    dev = torch.empty(1024, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # compile outside the capture
        pinned_copy.copy(host_out, pinned_copy.copy(dev, host_in) + 1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        pinned_copy.copy(host_out, pinned_copy.copy(dev, host_in) + 1)
    for step in range(20):
        host_in.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(host_out, torch.full((1024,), step + 1.0)), step


@gpu
@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 2048), (torch.float32, 1500)])
def test_rows_gathered_from_a_page_locked_table_by_ids_on_the_gpu(dtype, width):
    """gather_rows: an ordinary CPU tensor page-locked by staging.pin_tensor (as an embedding table
    the plan keeps on the CPU), rows picked by GPU ids, into pinned host memory and into GPU memory."""
    from ktflow.backends.native.staging import pin_tensor

    table = torch.randn(3000, width, generator=torch.Generator().manual_seed(width)).to(dtype)
    ids = torch.tensor([2999, 0, 17, 17, 1234], device="cuda")
    out_host = torch.zeros(5, width, dtype=dtype).pin_memory()
    out_dev = torch.zeros(5, width, dtype=dtype, device="cuda")
    assert pinned_copy.can_gather(table, out_host, pinned=False) and not pinned_copy.can_gather(table, out_host)
    assert pin_tensor(table) and pin_tensor(table)  # twice: counted, one registration
    assert pinned_copy.can_gather(table, out_host) and pinned_copy.can_gather(table, out_dev)
    pinned_copy.gather_rows(out_host, table, ids)
    pinned_copy.gather_rows(out_dev, table, ids)
    torch.cuda.synchronize()
    want = table[ids.cpu()]
    assert torch.equal(out_host, want) and torch.equal(out_dev.cpu(), want)
    assert not pinned_copy.can_gather(table, torch.zeros(5, width, dtype=torch.float16).pin_memory())


def test_unpinned_or_cpu_only_copies_fall_back_to_copy_():
    a, b = torch.arange(6), torch.zeros(6, dtype=torch.int64)
    assert torch.equal(pinned_copy.copy(b, a), a)
