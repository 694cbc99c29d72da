"""A trained MoE scaled up for speed measurements without changing what it computes: every routed
and shared expert's intermediate size padded with zeros.

A small model trained here (train_small_moe.py) has learned routing, but its experts are too small
to cost real bandwidth, so a decode step's time says nothing about a real model's. Padding each
expert's gate and up projections with zero rows, and its down projection with zero columns, to
`--inter` leaves every output unchanged (the padded rows give silu(0) * 0 = 0, which the down
projection's zero columns ignore): the same routing, token for token, while each expert holds
(and each pick reads) `--inter / moe_intermediate_size` times the bytes. The routers, attention,
norms and the dense layers are untouched. So the hit rates, deferral choices and cache policies
measured on the scaled model are the trained model's, and its decode time is dominated by expert
bytes as a real model's is.

    python benchmarks/scale_moe.py /tmp/moe-tiny --inter 8192 -o /tmp/moe-tiny-x85

Writes the new checkpoint dir (config.json with the new moe_intermediate_size, every other file
copied), each safetensors file written atomically.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

EXPERT = re.compile(r"\.mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def padded(key: str, t, old: int, new: int, shared: int):
    """`t` padded to the new intermediate size if `key` is an expert's projection (the shared
    experts' intermediate size is `shared` times the routed ones'), else `t`."""
    import torch

    m = EXPERT.search(key)
    if m is None:
        return t
    mult = shared if m.group(1) == "shared_experts" else 1
    have, want = old * mult, new * mult
    if m.group(2) == "down_proj":
        if t.shape[1] != have:
            raise SystemExit(f"{key}: shape {list(t.shape)}, expected {have} columns")
        return torch.cat([t, torch.zeros(t.shape[0], want - have, dtype=t.dtype)], dim=1)
    if t.shape[0] != have:
        raise SystemExit(f"{key}: shape {list(t.shape)}, expected {have} rows")
    return torch.cat([t, torch.zeros(want - have, t.shape[1], dtype=t.dtype)], dim=0)


def scale(src: Path, dst: Path, inter: int) -> dict:
    """Write the scaled checkpoint; returns its config."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    old = cfg.get("moe_intermediate_size")
    if old is None:
        raise SystemExit(f"{src}/config.json has no moe_intermediate_size: not a DeepSeek-style MoE")
    if inter < old:
        raise SystemExit(f"--inter {inter} is below the model's moe_intermediate_size {old}: padding only grows it")
    shared = cfg.get("n_shared_experts") or 1
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not (f.suffix == ".safetensors" and f.name.startswith("model")):
            shutil.copy2(f, dst / f.name)
    for f in sorted(src.glob("model*.safetensors")):
        tensors = {k: padded(k, t, old, inter, shared).contiguous() for k, t in load_file(str(f)).items()}
        tmp = dst / (f.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(dst / f.name)
    cfg["moe_intermediate_size"] = inter
    tmp = dst / "config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.replace(dst / "config.json")
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a DeepSeek-style MoE checkpoint dir (e.g. from train_small_moe.py)")
    ap.add_argument("--inter", type=int, required=True, help="the new moe_intermediate_size")
    ap.add_argument("-o", "--output", required=True, help="the scaled checkpoint dir to write")
    a = ap.parse_args()
    src, dst = Path(a.model), Path(a.output)
    if src.resolve() == dst.resolve():
        raise SystemExit("-o must be another dir than the model's")
    cfg = scale(src, dst, a.inter)
    h, e = cfg["hidden_size"], cfg["n_routed_experts"]
    print(f"wrote {dst}: moe_intermediate_size {a.inter}, {3 * h * a.inter * 2 / 1e6:.1f} MB an expert in bf16, "
          f"{e} routed experts a layer", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
