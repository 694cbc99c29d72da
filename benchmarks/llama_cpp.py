"""llama.cpp beside ktflow in one run (GPU machine): the same random-weight checkpoint converted to
GGUF with llama.cpp's own converter, prompt processing timed with llama-bench in its modes, and
decode (`-ot exps=CPU`, every routed expert on the CPU, as ktflow's decode variants run) at the
thread counts given, its best quoted.

llama-bench comes prebuilt (a tarball in parts, unpacked once into /tmp) or from a build dir; the
converter from a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/). Modes, all
with the routed experts' weights in CPU memory (`-ot exps=CPU`) and flash attention on:
  op offload, -ub 512     llama.cpp's default: prompt experts computed on the GPU for batches of
                          32+ tokens, their weights uploaded per micro-batch
  op offload, -ub 2048 / 4096   larger micro-batches (fewer uploads per prompt)
  no op offload (-nopo 1) experts computed on the CPU
  whole model on the GPU  no `-ot` (the upper bound, where it fits)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: (name, llama-bench arguments, largest prompt timed: slow modes skip the long ones)
MODES: list[tuple[str, list[str], int]] = [
    ("llama.cpp op offload, -ub 512", ["-ot", "exps=CPU"], 8192),
    ("llama.cpp op offload, -ub 2048", ["-ot", "exps=CPU", "-b", "2048", "-ub", "2048"], 8192),
    ("llama.cpp op offload, -ub 4096", ["-ot", "exps=CPU", "-b", "4096", "-ub", "4096"], 32768),
    ("llama.cpp no op offload (-nopo 1)", ["-ot", "exps=CPU", "-nopo", "1"], 2048),
    ("llama.cpp whole model on the GPU", [], 32768),
]


def llama_bench(where: Path) -> Path:
    """The llama-bench binary: `where` is a build dir holding it, or a dir with the prebuilt
    tarball's parts (llama-bench-cuda.tar.xz.part00..), unpacked into /tmp once."""
    for cand in (where / "llama-bench", where / "bin" / "llama-bench", where / "build" / "bin" / "llama-bench"):
        if cand.exists():
            return cand
    out = Path("/tmp/llama-bench-cuda/llama-bench")
    if not out.exists():
        parts = sorted(where.glob("*.part0*"))
        if not parts:
            raise SystemExit(f"no llama-bench under {where}: give a build dir or the prebuilt tarball's parts")
        joined = Path("/tmp/llama-bench-cuda.tar.xz")
        with open(joined, "wb") as f:
            for p in parts:
                f.write(p.read_bytes())
        with tarfile.open(joined, "r:xz") as t:
            t.extractall("/tmp", filter="data")
    return out


def gguf_for(ckpt: Path, outtype: str) -> Path:
    """Where the GGUF twin of checkpoint dir `ckpt` in `outtype` goes (beside the dir)."""
    return Path(f"{ckpt}.{outtype}.gguf")


def convert(ckpt: Path, gguf: Path, outtype: str, converter_src: Path, tools: Path, binary: Path | None = None) -> float:
    """GGUF of the checkpoint (llama.cpp's converter; a tiny tokenizer beside links to the
    checkpoint's files, as the converter needs one). Q8_0 is quantized from the bf16 GGUF by
    llama-quantize (beside `binary`, llama-bench) where there is one: seconds instead of a second
    conversion. Returns seconds taken (0 when reused)."""
    if gguf.exists():
        return 0.0
    t0 = time.perf_counter()
    quantize = binary.parent / "llama-quantize" if binary is not None else None
    bf16 = gguf_for(ckpt, "bf16")
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    room = bf16.exists() or shutil.disk_usage(gguf.parent).free > 1.6 * ckpt_bytes  # the bf16 GGUF and the Q8_0 one
    if outtype == "q8_0" and quantize is not None and quantize.exists() and room:
        convert(ckpt, bf16, "bf16", converter_src, tools)
        tmp = gguf.with_name(gguf.name + ".part")
        r = subprocess.run([str(quantize), str(bf16), str(tmp), "Q8_0", str(len(os.sched_getaffinity(0)))],
                           capture_output=True, text=True)
        if r.returncode == 0:
            tmp.rename(gguf)
            os.sync()
            return time.perf_counter() - t0
        # llama-quantize reads the model's hyperparameters, which some architectures refuse at a
        # depth other than a released one (a shallow deepseek2 template): the converter quantizes
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        print(f"  llama-quantize refused {bf16.name} ({r.returncode}): {' | '.join(tail)}; converting to Q8_0 "
              "with llama.cpp's converter instead", flush=True)
        tmp.unlink(missing_ok=True)
    src = Path("/tmp/llama-src")
    if not (src / "convert_hf_to_gguf.py").exists():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(converter_src) as t:
            t.extractall(src, filter="data")
    linked = Path(str(gguf) + ".src")
    linked.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.is_file() and not (linked / f.name).exists():
            (linked / f.name).symlink_to(f)
    subprocess.run([sys.executable, str(tools / "tiny-tokenizer.py"), str(linked)], check=True)
    env = dict(os.environ, LLAMA_SRC=str(src), PYTHONPATH=f"{src / 'gguf-py'}:{src}")
    tmp = gguf.with_name(gguf.name + ".part")
    subprocess.run([sys.executable, str(tools / "gguf-convert.py"), str(linked), "--outtype", outtype,
                    "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(gguf)
    os.sync()  # its dirty pages on disk before anything is timed
    return time.perf_counter() - t0


def bench(binary: Path, gguf: Path, lengths: list[int], reps: int, threads: int, log) -> list[dict]:
    """Prompt processing in every mode: rows of (mode, prompt tokens, tok/s mean and sd)."""
    rows = []
    for name, args, longest in MODES:
        todo = [n for n in lengths if n <= longest]
        if not todo:
            continue
        cmd = [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-t", str(threads), "-p",
               ",".join(map(str, todo)), "-n", "0", "-r", str(reps), "-o", "jsonl", *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            log(f"  {name}: llama-bench failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:] }")
            rows.append(dict(system=name, error=r.stderr[-500:]))
            continue
        for line in r.stdout.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                row = dict(system=name, prompt=int(d["n_prompt"]), tok_s=round(float(d["avg_ts"]), 1),
                           sd=round(float(d["stddev_ts"]), 1), n_ubatch=d.get("n_ubatch"), threads=threads,
                           llama_commit=d.get("build_commit"))
                rows.append(row)
                log(f"  {name:36s} prefill {row['prompt']:6d}: {row['tok_s']:9.1f} +- {row['sd']:6.1f} tok/s")
    return rows


def decode(binary: Path, gguf: Path, tokens: int, reps: int, threads: list[int], log,
           cpus: set[int] | None = None) -> list[dict]:
    """Token generation after an empty prompt (llama-bench's tg), routed experts on the CPU, one
    row per thread count: tok/s mean and sd over `reps`. `cpus`: the CPUs llama-bench may run on
    (default: the caller's; a process whose own thread is confined to a few CPUs passes all)."""
    cmd = [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-ot", "exps=CPU", "-p", "0", "-n", str(tokens),
           "-t", ",".join(map(str, threads)), "-r", str(reps), "-o", "jsonl"]
    r = subprocess.run(cmd, capture_output=True, text=True,
                       preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if r.returncode != 0:
        log(f"  llama.cpp decode: llama-bench failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        return [dict(system="llama.cpp decode", error=r.stderr[-500:])]
    rows = []
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            row = dict(system="llama.cpp -ot exps=CPU", decode_tokens=int(d["n_gen"]), threads=int(d["n_threads"]),
                       decode_tok_s=round(float(d["avg_ts"]), 2), decode_sd=round(float(d["stddev_ts"]), 2),
                       type_k=d.get("type_k"), model_type=d.get("model_type"), llama_commit=d.get("build_commit"))
            rows.append(row)
            log(f"  llama.cpp decode, {row['threads']:2d} threads: {row['decode_tok_s']:7.2f} +- {row['decode_sd']:5.2f} tok/s"
                f" ({row['model_type']})")
    return rows
