"""A full-depth GGUF with random weights, written straight: no full-size checkpoint converted.

A checkpoint of the model's full depth and its GGUF do not fit the GPU machine's 64 GB disk
together (Qwen3-30B-A3B: 31 GB FP8 safetensors, 32 GB Q8_0 GGUF). So llama.cpp's own converter
makes a *template*: the same widths cut to one or two layers (`template_config`; a shallow random
checkpoint converted, `llama_cpp.convert`), whose metadata (tokenizer included), tensor names,
shapes and types are what llama.cpp reads. `synthesize` copies that metadata with the block count
raised and repeats the template's last block up to the full depth; every Q8_0 tensor of a new
block is cut from a pool of valid random Q8_0 blocks (f16 scale 2.7e-4, int8 quants uniform in
[-127, 127]: values of sd ~0.02, like the checkpoint writer's), other tensors (norms, f32
routers) are the template block's bytes. The weights are random on both sides, not the same
ones: routing is near uniform for llama.cpp and ktflow alike (no hot experts to exploit).

Needs gguf-py (from the llama.cpp tree on sys.path: `llama_cpp.convert` unpacks it to
/tmp/llama-src; `import_gguf` finds it there).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import numpy as np

Q8_0_BLOCK = 34  # bytes of one Q8_0 block: f16 scale + 32 int8 quants
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
EXPS_RE = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")  # llama.cpp's LLM_FFN_EXPS_REGEX


def import_gguf(src: Path | None = None):
    """gguf-py: importable already, or from a llama.cpp tree (`src`, LLAMA_SRC, /tmp/llama-src)."""
    try:
        import gguf

        return gguf
    except ImportError:
        for d in (src, os.environ.get("LLAMA_SRC"), "/tmp/llama-src", "/tmp/llama"):
            if d and (Path(d) / "gguf-py" / "gguf").is_dir():
                sys.path.insert(0, str(Path(d) / "gguf-py"))
                break
    import gguf

    return gguf


def template_config(cfg: dict) -> dict:
    """The shallow config llama.cpp's converter turns into the template: the model's widths with
    the fewest layers that hold one block of every kind (a leading dense block where the model has
    one, then a MoE block)."""
    dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    return dict(cfg, num_hidden_layers=dense + 1)


def q8_0_pool(blocks: int, seed: int) -> np.ndarray:
    """`blocks` valid Q8_0 blocks as bytes [blocks * 34]: scale 2.7e-4 in f16, random quants."""
    rng = np.random.default_rng(seed)
    pool = np.empty((blocks, Q8_0_BLOCK), dtype=np.uint8)
    pool[:, :2] = np.frombuffer(np.float16(0.02 / 73.3).tobytes(), dtype=np.uint8)
    pool[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    return pool.reshape(-1)


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def synthesize(template: Path, out: Path, layers: int, seed: int = 0, pool_blocks: int = 1 << 21,
               log=print) -> float:
    """Write `out`: `template`'s metadata with `<arch>.block_count` = `layers`, its tensors, and
    its last block repeated as blocks template_layers .. layers - 1 (Q8_0 tensors random, the
    rest copied). Returns seconds taken. Written to `out.part` and renamed when complete."""
    gguf = import_gguf()
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(template)
    arch = _field(reader, "general.architecture")
    have = int(_field(reader, f"{arch}.block_count"))
    if layers < have:
        raise ValueError(f"template {template} has {have} blocks, more than the {layers} asked for")
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    align = _field(reader, "general.alignment")
    if align is not None:
        writer.data_alignment = int(align)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(name, value, vtype, sub_type=sub)
    last = {}  # suffix -> the template's last block's tensor
    order = []  # (name, template tensor, random?)
    for t in reader.tensors:
        m = BLOCK_RE.match(t.name)
        if m and int(m.group(1)) == have - 1:
            last[m.group(2)] = t
    for t in reader.tensors:
        order.append((t.name, t, False))
        m = BLOCK_RE.match(t.name)
        if m and int(m.group(1)) == have - 1 and m.group(2) == next(reversed(last)):
            for b in range(have, layers):  # after the template's last block: the new ones, in order
                order += [(f"blk.{b}.{suffix}", lt, lt.tensor_type == gguf.GGMLQuantizationType.Q8_0)
                          for suffix, lt in last.items()]
    for name, t, _ in order:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pool = q8_0_pool(pool_blocks, seed)
    rng = np.random.default_rng(seed + 1)
    written = 0
    for name, t, rand in order:
        if rand:
            n = t.data.nbytes
            start = int(rng.integers(0, pool_blocks)) * Q8_0_BLOCK
            reps = -(-(start + n) // pool.size)
            data = (np.tile(pool, reps) if reps > 1 else pool)[start:start + n]
            writer.write_tensor_data(data.reshape(t.data.shape))
        else:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        written += t.data.nbytes
    writer.close()
    os.sync()
    tmp.rename(out)
    secs = time.perf_counter() - t0
    log(f"  synthesized {out} ({written / 1e9:.1f} GB, {layers} blocks from {have}) in {secs:.0f} s")
    return secs


def tensor_sizes(path: Path) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor of a GGUF."""
    gguf = import_gguf()
    return [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors]
