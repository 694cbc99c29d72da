"""llama.cpp held to the same VRAM limit as user_configs.py's ktflow (GPU machine).

The model is a full-depth GGUF with random Q8_0 weights written straight (`gguf_synth.py`: a
template of one or two layers converted by llama.cpp's own converter, its last block repeated),
since the checkpoint and a converted GGUF do not fit the disk together. Then, for each test
(prompt processing at each `--prefill` length and `-ub`, and token generation):

  probe    llama-bench -v with every expert on the CPU (`-ot exps=CPU`), the test's -p/-n/-ub,
           `-r 0 --no-warmup --delay 2`: nothing is timed; the log's CUDA model/KV/compute buffers
           and the card's memory while it sleeps (nvidia-smi, less what was used before) give what
           everything but the routed experts takes, CUDA context included.
  choose   `-ncmoe N`: the fewest leading blocks whose experts stay on the CPU such that the other
           blocks' expert tensors (their sizes read from the GGUF) fit the limit beside the probe's
           memory (llama.cpp's -ncmoe puts blocks 0..N-1's experts in CPU memory; no -ot besides).
  run      llama-bench -ncmoe N, the test timed (`-r`), the log's buffers and (prompt tests) the
           card's peak polled: a row per test with both, and whether they kept to the limit; a test
           over it is run once more with N raised by the excess.
  server   then one -ncmoe for every test, as one llama-server configuration holds it (`-c` the
           longest prompt, `-ub` the largest, the KV cache and compute buffer that size through
           prefill and decode alike): the N the longest prompt's test ran at (raised where it went
           over the limit), every prompt and decode timed at it (rows marked placement "server";
           `--no-server` skips them). The targets' ratios are against the best per test; the
           report shows these beside them.

`--fit` adds llama.cpp's own fitter at the largest -ub and thread count: `-fitt M` with M the
card's free MiB less the limit (it leaves M free: it fills the limit, partial blocks included).

llama-bench does not sample: its tg times `llama_decode` of one token a step (logits computed and
copied to the host, no sampler). What llama-cli / llama-server add per token with their default
chain (top-k 40, top-p, min-p 0.05, temperature, then a draw; penalties, DRY, typical and XTC are
no-ops at their defaults) is timed apart (`sampler_ms`: that chain from libllama.so through
ctypes over the model's vocabulary of random logits) and a `llama_sampler` row gives the sampled
rate it implies: 1 / (1 / tg + sampler time).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from gguf_synth import BLOCK_RE, EXPS_RE  # noqa: E402

MIB = 1 << 20
BUFFER_RE = re.compile(r"(\S+) (model|KV|compute) buffer size = +([\d.]+) MiB")


# ------------------------------------------------------------------------------------ arithmetic


def expert_bytes_by_block(sizes: list[tuple[str, int]]) -> dict[int, int]:
    """Routed-expert tensor bytes of each block (the tensors -ncmoe / -ot exps=CPU move)."""
    out: dict[int, int] = {}
    for name, nbytes in sizes:
        m = BLOCK_RE.match(name)
        if m and EXPS_RE.search("." + m.group(2)):
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + nbytes
    return out


def choose_ncmoe(per_block: dict[int, int], blocks: int, room: float) -> int:
    """The fewest leading blocks N whose experts go to the CPU such that the experts of blocks
    N .. blocks - 1 take at most `room` bytes of GPU memory."""
    for n in range(blocks + 1):
        if sum(b for i, b in per_block.items() if i >= n) <= room:
            return n
    return blocks


def buffers(log: str) -> dict[str, float]:
    """GPU buffers (MiB) a llama-bench -v log names: the model's (largest load) and the
    contexts' KV and compute (largest context); host buffers (CPU, CUDA_Host) left out."""
    got: dict[str, float] = {"model": 0.0, "KV": 0.0, "compute": 0.0}
    for name, kind, mib in BUFFER_RE.findall(log):
        if name.startswith("CUDA") and not name.startswith("CUDA_Host"):
            got[kind] = max(got[kind], float(mib))
    return got


# ------------------------------------------------------------------------------------ the card


def card(field: str = "memory.used") -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return float(out) if field.startswith("memory") else out
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def bench(cmd: list[str], poll: float | None) -> tuple[list[dict], str, float | None, int]:
    """Run llama-bench: (its JSONL rows, its log, the card's peak memory above what was used
    before it started (MiB; polled every `poll` s, None: not polled), return code)."""
    before = card() if poll else None
    peak = [0.0]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def watch():
        while p.poll() is None:
            used = card()
            if used is not None:
                peak[0] = max(peak[0], used)
            time.sleep(poll)

    t = threading.Thread(target=watch, daemon=True) if poll and before is not None else None
    if t:
        t.start()
    out, err = p.communicate()
    if t:
        t.join()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows, err, (peak[0] - before if t else None), p.returncode


# ------------------------------------------------------------------------------------ the sampler


class TokenData(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int32), ("logit", ctypes.c_float), ("p", ctypes.c_float)]


class ChainParams(ctypes.Structure):
    _fields_ = [("no_perf", ctypes.c_bool)]


class TokenDataArray(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(TokenData)), ("size", ctypes.c_size_t), ("selected", ctypes.c_int64),
                ("sorted", ctypes.c_bool)]


def sampler_ms(libllama: Path, vocab: int, temperature: float, top_p: float, iters: int = 200) -> dict:
    """llama-cli's default sampling chain at this temperature and top-p, per token (ms): the
    candidates filled from `vocab` random logits, then top-k 40, top-p, min-p 0.05, temperature and
    the draw (libllama's own samplers through ctypes)."""
    lib = ctypes.CDLL(str(libllama))
    vp = ctypes.c_void_p
    lib.llama_sampler_chain_default_params.restype = ChainParams
    lib.llama_sampler_chain_init.argtypes, lib.llama_sampler_chain_init.restype = [ChainParams], vp
    lib.llama_sampler_chain_add.argtypes = [vp, vp]
    for fn, args in (("top_k", [ctypes.c_int32]), ("top_p", [ctypes.c_float, ctypes.c_size_t]),
                     ("min_p", [ctypes.c_float, ctypes.c_size_t]), ("temp", [ctypes.c_float]),
                     ("dist", [ctypes.c_uint32])):
        f = getattr(lib, f"llama_sampler_init_{fn}")
        f.argtypes, f.restype = args, vp
    lib.llama_sampler_apply.argtypes = [vp, ctypes.POINTER(TokenDataArray)]
    lib.llama_sampler_free.argtypes = [vp]
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    for s in (lib.llama_sampler_init_top_k(40), lib.llama_sampler_init_top_p(top_p, 1),
              lib.llama_sampler_init_min_p(0.05, 1), lib.llama_sampler_init_temp(temperature),
              lib.llama_sampler_init_dist(0)):
        lib.llama_sampler_chain_add(chain, s)
    rng = np.random.default_rng(0)
    cand = np.zeros(vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    ids = np.arange(vocab, dtype=np.int32)
    took = []
    for i in range(iters + 10):
        logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
        t0 = time.perf_counter()
        cand["id"], cand["logit"], cand["p"] = ids, logits, 0.0  # as common_sampler fills its candidates
        arr = TokenDataArray(cand.ctypes.data_as(ctypes.POINTER(TokenData)), vocab, -1, False)
        lib.llama_sampler_apply(chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError(f"llama.cpp's sampler chain selected no token ({arr.selected})")
        if i >= 10:
            took.append((time.perf_counter() - t0) * 1e3)
    lib.llama_sampler_free(chain)
    return dict(sampler_ms=round(statistics.median(took), 4), sampler_mean_ms=round(statistics.mean(took), 4),
                chain=f"top_k 40, top_p {top_p}, min_p 0.05, temp {temperature}, dist", vocab=vocab)


# ------------------------------------------------------------------------------------ tests


def dram_read() -> float | None:
    """The DRAM read of ktflow's instrument (every CPU streaming 1 GiB), where ktflow is built."""
    try:
        from ktflow.backends.native import binding as native

        pool = native.module().Pool(threads=0, groups=0, pin=True)
        gbps = native.module().stream_read_gbps(pool, 1 << 30, 3)
        del pool
        return round(gbps, 1)
    except Exception:  # noqa: BLE001 (a number beside the rows, not a requirement)
        return None


def test_args(kind: str, n: int, ub: int, threads: str, depth: int = 0) -> list[str]:
    if kind == "prefill":
        return ["-p", str(n), "-n", "0", "-ub", str(ub), "-b", str(max(ub, 2048)), "-t", threads]
    return ["-p", "0", "-n", str(n), "-t", threads] + (["-d", str(depth)] if depth else [])


class Llama:
    """Tests of one GGUF (`sizes`: its tensors' bytes) at the limit `a.vram_gb`, rows to `a.out`."""

    def __init__(self, a, binary: Path, gguf: Path, sizes: list[tuple[str, int]], info: dict):
        self.a, self.info = a, info
        self.base = [str(binary), "-m", str(gguf), "-ngl", "99", "-fa", "on", "-o", "jsonl", "-v"]
        self.per_block = expert_bytes_by_block(sizes)
        self.blocks = max(self.per_block) + 1
        self.budget = a.vram_gb * 1e9
        self.pick_share = 0.0  # top-k / experts: a token's share of a block's expert bytes (main sets it)

    def commit(self, reported: str | None) -> str | None:
        """The llama.cpp commit of a row: what llama-bench reports, or --llama-commit where it
        reports none (the carried prebuilt says "unknown")."""
        if reported and reported != "unknown":
            return reported
        return self.a.llama_commit or reported

    def emit(self, rows):
        append_jsonl(self.a.out, [dict(self.info, **r) for r in rows])

    def probe(self, kind: str, n: int, ub: int, threads: str, depth: int = 0) -> dict:
        t = threads.split(",")[-1]
        _, log, used, rc = bench(self.base + ["-ot", "exps=CPU", "-r", "0", "--no-warmup", "--delay", "2"]
                                 + test_args(kind, n, ub, t, depth), poll=0.2)
        b = buffers(log)
        process = used * MIB if used else sum(b.values()) * MIB + 0.6e9  # (no nvidia-smi: a context guessed)
        held = sum(b.values()) * MIB
        return dict(rc=rc, probe_buffers_gb=round(held / 1e9, 3), probe_process_gb=round(process / 1e9, 3),
                    overhead_gb=round((process - held) / 1e9, 3), room_gb=round((self.budget - process) / 1e9, 3))

    def run(self, kind: str, n: int, ub: int, threads: str, placement: str, depth: int = 0,
            ncmoe: int | None = None) -> list[dict]:
        """One test at the limit: probe, choose N (or llama.cpp's fitter), run; rows. `depth`: a
        decode test after that many tokens of context (llama-bench -d: its KV cache that full).
        `ncmoe` (placement "server"): N given, no probe (the server configuration's)."""
        reps = self.a.reps
        if ncmoe is not None:
            args, pr = ["-ncmoe", str(ncmoe)], dict(server_ncmoe=ncmoe)
        elif placement == "fit":
            free = card("memory.free")
            margin = int(free - self.budget / MIB) if free is not None else 0
            args, pr, ncmoe = ["-fitt", str(margin)], dict(fit_margin_mib=margin), None
        else:
            pr = self.probe(kind, n, ub, threads, depth)
            if pr["rc"]:
                print(f"  probe for {kind} {n} -ub {ub} failed ({pr['rc']}); not run", flush=True)
                self.emit([dict(table=f"llama_{kind}", error="probe failed", prompt=n, ub=ub, **pr)])
                return []
            ncmoe = choose_ncmoe(self.per_block, self.blocks, self.budget - pr["probe_process_gb"] * 1e9)
            args = ["-ncmoe", str(ncmoe)]
        for attempt in range(2):
            test = test_args(kind, n, ub, threads, depth)
            rows, log, used, rc = bench(self.base + args + ["-r", str(reps)] + test,
                                        poll=0.5 if kind == "prefill" or depth else None)
            b = buffers(log)
            gpu_experts = sum(v for i, v in self.per_block.items() if ncmoe is not None and i >= ncmoe)
            process = used * MIB if used else sum(b.values()) * MIB + pr.get("overhead_gb", 0.0) * 1e9
            over = process - self.budget
            if placement in ("fit", "server") or over <= 0.005 * self.budget or attempt or rc:
                break
            per = max(self.per_block.values())
            ncmoe = min(self.blocks, ncmoe + -(-int(over) // per))
            args = ["-ncmoe", str(ncmoe)]
            print(f"  {kind} {n} -ub {ub}: {over / 1e9:.2f} GB over the limit; again with -ncmoe {ncmoe}", flush=True)
        common = dict(placement=placement, n_cpu_moe=ncmoe, gpu_expert_blocks=sum(1 for i in self.per_block if
                                                                                 ncmoe is not None and i >= ncmoe),
                      gpu_expert_gb=round(gpu_experts / 1e9, 3) if ncmoe is not None else None,
                      buffers_gb={k: round(v * MIB / 1e9, 3) for k, v in b.items()},
                      process_gb=round(process / 1e9, 3), process_polled=used is not None,
                      within_limit=process <= self.budget * 1.005, vram_limit_gb=self.a.vram_gb, **pr)
        if rc or not rows:
            tail = log.strip().splitlines()[-3:]
            print(f"  llama-bench failed ({rc}): {tail}", flush=True)
            row = dict(table=f"llama_{kind}", error=log[-800:], prompt=n, ub=ub, **common)
            self.emit([row])
            return []
        out = []
        where = f"-ncmoe {ncmoe}" if ncmoe is not None else f"-fitt {pr['fit_margin_mib']}"
        for d in rows:
            system = (f"llama.cpp {where}" + (f", -ub {ub}" if kind == "prefill" else "")
                      + (" (one server configuration)" if placement == "server" else ""))
            row = dict(table=f"llama_{kind}", system=system,
                       tok_s=round(float(d["avg_ts"]), 2), sd=round(float(d["stddev_ts"]), 2),
                       threads=int(d["n_threads"]), llama_commit=self.commit(d.get("build_commit")), **common)
            row.update(prompt=n, ub=ub) if kind == "prefill" else row.update(decode_tokens=n, decode_depth=depth)
            dram = self.info.get("dram_gbps")
            if kind == "decode" and ncmoe is not None and self.pick_share and dram:
                # the physical limit: the expert bytes a token reads on the CPU (blocks 0..N-1's, its
                # share of each) at the DRAM read measured at the start
                bpt = sum(v for i, v in self.per_block.items() if i < ncmoe) * self.pick_share
                if bpt:
                    row.update(cpu_expert_bytes_per_token=round(bpt), cpu_roofline_tok_s=round(dram * 1e9 / bpt, 2),
                               cpu_roofline_fraction=round(row["tok_s"] * bpt / (dram * 1e9), 3))
            out.append(row)
            print(f"  {row['system']:34s} {kind} {n:6d} t{row['threads']}: {row['tok_s']:9.2f} +- {row['sd']:7.2f} "
                  f"tok/s; VRAM {row['process_gb']} GB ({'polled' if used else 'buffers + probe overhead'})",
                  flush=True)
        self.emit(out)
        return out


# ------------------------------------------------------------------------------------ main


def prepare_gguf(a, binary: Path, out: Path) -> None:
    """The full-depth random GGUF (gguf_synth), from a template llama.cpp's converter makes."""
    import gguf_synth
    import llama_cpp
    from e2e import write_checkpoint
    from user_configs import MODELS

    cfg = dict(MODELS[a.model], **({"num_hidden_layers": a.layers} if a.layers else {}))
    tdir = out.with_name(out.stem + "-template")
    write_checkpoint(gguf_synth.template_config(cfg), tdir)
    tmpl = llama_cpp.gguf_for(tdir, "q8_0")
    llama_cpp.convert(tdir, tmpl, "q8_0", Path(a.llama_src), Path(a.tools), binary)
    gguf_synth.import_gguf(Path("/tmp/llama-src"))
    gguf_synth.synthesize(tmpl, out, cfg["num_hidden_layers"])
    bf16 = llama_cpp.gguf_for(tdir, "bf16")
    for p in (tdir, Path(f"{tmpl}.src"), tmpl, bf16, Path(f"{bf16}.src")):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--gguf", default=None, help="default /tmp/ktflow-e2e/<model>[-<layers>l].q8_0-random.gguf")
    ap.add_argument("--vram-gb", type=float, required=True)
    ap.add_argument("--llama", required=True,
                    help="llama-bench: a build dir, or a dir with the prebuilt tarball's parts")
    ap.add_argument("--llama-src", default="", help="llama.cpp source .tgz (converter, gguf-py): to write the GGUF")
    ap.add_argument("--tools", default="", help="dir with gguf-convert.py and tiny-tokenizer.py")
    ap.add_argument("--llama-commit", default=os.environ.get("LLAMA_COMMIT", ""),
                    help="the llama.cpp commit to record where llama-bench reports none (env LLAMA_COMMIT)")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--ub", default="512,2048,4096")
    ap.add_argument("--ub512-max", type=int, default=8192, help="longest prompt timed at -ub 512 (its slowest mode)")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", default="", help="decode thread counts (default: CPUs - 2 .. CPUs)")
    ap.add_argument("--decode-depth", default="", help="also decode at these context depths (llama-bench -d; "
                    "comma list), at the best decode thread count")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fit", action="store_true", help="also llama.cpp's fitter (-fitt) at the largest -ub and threads")
    ap.add_argument("--no-server", dest="server", action="store_false",
                    help="skip the tests at one server configuration's -ncmoe (the longest prompt's at the largest -ub)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--prepare-only", action="store_true", help="write the GGUF and stop")
    ap.add_argument("--run-id", default=os.environ.get("RUN_ID", time.strftime("%Y%m%d-%H%M%S")))
    ap.add_argument("--out", default=str(HERE / "user_configs.jsonl"))
    a = ap.parse_args(argv)
    import llama_cpp

    binary = llama_cpp.llama_bench(Path(a.llama))
    gguf = Path(a.gguf or f"/tmp/ktflow-e2e/{a.model}{f'-{a.layers}l' if a.layers else ''}.q8_0-random.gguf")
    if not gguf.exists():
        t0 = time.perf_counter()
        gguf.parent.mkdir(parents=True, exist_ok=True)
        prepare_gguf(a, binary, gguf)
        print(f"GGUF {gguf} ({gguf.stat().st_size / 1e9:.1f} GB) written in {time.perf_counter() - t0:.0f} s",
              flush=True)
    if a.prepare_only:
        return 0
    cpus = len(os.sched_getaffinity(0))
    threads = a.threads or ",".join(str(t) for t in range(max(1, cpus - 2), cpus + 1))
    info = dict(bench="user_configs", run_id=a.run_id, commit=commit(), **machine(), gpu=card("name"), model=a.model,
                layers=None, gguf="q8_0 random (gguf_synth)", vram_gb=a.vram_gb, dram_gbps=dram_read())
    from gguf_synth import tensor_sizes

    ll = Llama(a, binary, gguf, tensor_sizes(gguf), info)
    info["layers"] = ll.blocks
    from user_configs import MODELS

    cfg = MODELS[a.model]
    ll.pick_share = cfg["num_experts_per_tok"] / (cfg.get("num_experts") or cfg["n_routed_experts"])
    print(f"llama.cpp at {a.vram_gb} GB: {gguf.name}, {ll.blocks} blocks, experts "
          f"{sum(ll.per_block.values()) / 1e9:.1f} "
          f"GB ({max(ll.per_block.values()) / 1e9:.3f} GB a block); DRAM {info['dram_gbps']} GB/s", flush=True)
    ubs = [int(u) for u in a.ub.split(",") if u]
    prefilled: list[dict] = []
    for n in [int(x) for x in a.prefill.split(",") if x]:
        for ub in ubs:
            if ub == 512 and n > a.ub512_max:
                continue
            prefilled += ll.run("prefill", n, ub, str(cpus), "ncmoe")
        if a.fit:
            ll.run("prefill", n, max(ubs), str(cpus), "fit")
    decode = ll.run("decode", a.decode, 0, threads, "ncmoe") if a.decode else []
    if a.fit and a.decode:
        decode += ll.run("decode", a.decode, 0, str(cpus), "fit")
    best = max(decode, key=lambda r: r["tok_s"], default=None)
    for depth in [int(x) for x in a.decode_depth.split(",") if x and int(x) > 0]:
        if best:
            ll.run("decode", a.decode, 0, str(best["threads"]), "ncmoe", depth)
    # one server configuration for every test (llama-server -c <longest> -ub <largest>): the -ncmoe
    # of the longest prompt's test, held for the shorter prompts and for decode, as ktflow's one plan
    longest = max((int(x) for x in a.prefill.split(",") if x), default=0)
    if a.server and longest:
        # the longest prompt's test at the largest -ub, as it ran (its -ncmoe raised where it went
        # over the limit); none where that test did not run (its probe failed)
        ran = next((r for r in prefilled if r["prompt"] == longest and r["ub"] == max(ubs)), None)
        n_srv = ran["n_cpu_moe"] if ran else None
        if n_srv is not None:
            print(f"llama.cpp as one server configuration (-c {longest} -ub {max(ubs)}): -ncmoe {n_srv}", flush=True)
            for n in sorted(int(x) for x in a.prefill.split(",") if x):
                ll.run("prefill", n, max(ubs), str(cpus), "server", ncmoe=n_srv)
            if best:
                ll.run("decode", a.decode, 0, str(best["threads"]), "server", ncmoe=n_srv)
                for depth in [int(x) for x in a.decode_depth.split(",") if x and int(x) > 0]:
                    ll.run("decode", a.decode, 0, str(best["threads"]), "server", depth, ncmoe=n_srv)
    info["dram_gbps_after"] = dram_read()
    vocab = cfg["vocab_size"]
    s = sampler_ms(binary.parent / "libllama.so", vocab, a.temperature, a.top_p)
    if best:
        s.update(tg_tok_s=best["tok_s"], tg_system=best["system"], tg_threads=best["threads"],
                 sampled_estimate_tok_s=round(1 / (1 / best["tok_s"] + s["sampler_ms"] / 1e3), 2))
    print(f"  llama.cpp sampler ({s['chain']}): {s['sampler_ms']} ms a token"
          + (f"; tg {best['tok_s']} -> sampled about {s['sampled_estimate_tok_s']} tok/s" if best else ""), flush=True)
    ll.emit([dict(table="llama_sampler", **s)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
