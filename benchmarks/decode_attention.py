"""A captured decode step's attention on the GPU machine: `attention_gpu.attend` (GQA, Qwen3-30B-A3B's
32 query and 4 key heads of 128) and `attend_latent` (MLA, DeepSeek-V2-Lite's 16 heads over a
512-wide latent) for one token over a cache of 32960 positions (a 32k-token agent's plan), at an early,
a middle and a late position. Each call's kernels (attention and the merge of the cache's splits)
are captured 20 at a time in a CUDA graph and replayed, so the time is the GPU's, without the host's
launches. `--combine-tiles` also times `combine` at other tile sizes (attention_gpu.COMBINE_TILE).

    python benchmarks/decode_attention.py                      # this tree
    python benchmarks/decode_attention.py --combine-tiles 4096,32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402

CACHE = 32960
POSITIONS = (40, 2000, 32000)


def gpu_us(fn, calls: int = 200) -> float:
    """GPU microseconds of one call of `fn`, from CUDA-graph replays of 20 calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls // 20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls // 20 * 20) * 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--combine-tiles", default="", help="comma list of COMBINE_TILE values to time beside the default")
    ap.add_argument("--out", default=str(HERE / "decode_attention.jsonl"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from ktflow.backends.kernels import attention_gpu as ag

    dev, bf16 = "cuda", torch.bfloat16
    rope = SimpleNamespace(dim=128, pairs="half")
    gqa = SimpleNamespace(kind="gqa", heads=32, kv_heads=4, head_dim=128, softmax_scale=128 ** -0.5, window=0, rope=rope)
    kc = torch.randn(1, 4, CACHE, 128, device=dev, dtype=bf16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, 32, 128, device=dev, dtype=bf16)
    mla = SimpleNamespace(kind="mla", heads=16, kv_lora_rank=512, qk_rope_dim=64, softmax_scale=0.1)
    cache = torch.randn(1, CACHE, 576, device=dev, dtype=bf16)
    q_lat = torch.randn(1, 16, 512, device=dev, dtype=bf16)
    q_rope = torch.randn(1, 16, 64, device=dev, dtype=bf16)
    info = dict(bench="decode_attention", commit=commit(), **machine(), gpu=torch.cuda.get_device_name(0), cache=CACHE)
    default = ag.COMBINE_TILE
    tiles = [default] + [int(x) for x in a.combine_tiles.split(",") if x and int(x) != default]
    rows = []
    print("| combine tile | position | GQA 32/4 x 128 (us) | MLA 16 x 512 (us) |\n|---|---|---|---|")
    for tile in tiles:
        ag.COMBINE_TILE = tile
        for p in POSITIONS:
            pos = torch.tensor([p], device=dev)
            g = gpu_us(lambda: ag.attend(gqa, q, kc, vc, pos, 1, False))
            m = gpu_us(lambda: ag.attend_latent(mla, q_lat, q_rope, cache, pos, 1, False))
            print(f"| {tile}{' (default)' if tile == default else ''} | {p} | {g:.1f} | {m:.1f} |", flush=True)
            rows += [dict(info, kind="gqa", position=p, combine_tile=tile, us=round(g, 2)),
                     dict(info, kind="mla", position=p, combine_tile=tile, us=round(m, 2))]
    ag.COMBINE_TILE = default
    append_jsonl(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
