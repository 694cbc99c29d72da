"""A bounded load test of `ktflow serve`: N concurrent streaming clients, fixed prompts and lengths.

For each number of streams, every stream sends `--requests` streamed completions one after the
other (prompts of exactly `--prompt-tokens` token ids, `--max-tokens` new tokens, eos ignored so
every answer has that length); a phase stops starting requests after `--max-seconds`. Prints per
phase: total tokens/s (all streams, over the phase's wall time), tokens/s per stream (each
request's tokens after the first over the time since its first), inter-token latency p50/p99
(between streamed chunks), time to first token p50/p99, and appends one JSONL row per phase to
benchmarks/serve_load.jsonl.

Without --url it serves the demo checkpoint, or --checkpoint (either given the demo tokenizer,
a small trained one, where it has none), with `ktflow serve` on a free loopback port and
--max-batch equal to the most streams, and stops it with SIGTERM at the end; --experts-on-cpu
compiles the plan with every routed expert on the CPU first (a custom pass after placement), and --baseline times `ktflow run`
(its generate, warmed) on the same plan before the server starts (the one-stream ratio). Traffic goes to that server or
to --url only.

    python benchmarks/serve_load.py --streams 1,2,4                       # the demo model, here
    python benchmarks/serve_load.py --checkpoint /tmp/ktflow-e2e/qwen3-12l --experts-on-cpu \
        --hw this --device cuda --streams 1,2,4,8,16 --baseline             # on the GPU machine
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME --streams 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from common import append_jsonl, commit, machine

HERE = Path(__file__).parent


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_request(client: httpx.Client, url: str, body: dict, chunks: list | None = None) -> dict:
    """One streamed completion: its send time, each chunk's arrival (into `chunks` as they come,
    if given), and the usage."""
    t0 = time.perf_counter()
    chunks, usage = ([] if chunks is None else chunks), None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(msg["error"]["message"])
            if msg.get("usage"):
                usage = msg["usage"]
            if msg.get("choices") and msg["choices"][0].get("text"):  # a token's text (every id has some: served_dir)
                chunks.append(time.perf_counter())
    return dict(start=t0, chunks=chunks, tokens=(usage or {}).get("completion_tokens", len(chunks)))


def phase(url: str, model: str, streams: int, requests: int, prompt_tokens: int, max_tokens: int,
          max_seconds: float, vocab: int) -> dict:
    """`streams` clients, `requests` each (fewer if `max_seconds` runs out); the phase's numbers."""
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + max_seconds

    def client(k: int) -> None:
        with httpx.Client(timeout=max(60.0, max_seconds)) as c:
            for i in range(requests):
                if time.perf_counter() > deadline:
                    return
                ids = [(7 + 131 * k + 17 * i + 3 * j) % (vocab - 2) + 2 for j in range(prompt_tokens)]
                body = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                            ignore_eos=True, stream_options={"include_usage": True})
                try:
                    res = one_request(c, url, body)
                except Exception as e:  # noqa: BLE001 - counted and shown, the load goes on
                    with lock:
                        errors.append(str(e))
                    continue
                with lock:
                    results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    ttft = [(r["chunks"][0] - r["start"]) * 1e3 for r in results if r["chunks"]]
    rates = [(r["tokens"] - 1) / (r["chunks"][-1] - r["chunks"][0]) for r in results
             if len(r["chunks"]) > 1 and r["chunks"][-1] > r["chunks"][0]]
    return dict(streams=streams, requests=len(results), errors=len(errors), first_error=errors[0] if errors else None,
                completion_tokens=tokens, wall_s=round(wall, 3), total_tok_s=round(tokens / wall, 2) if wall else 0.0,
                per_stream_tok_s=round(statistics.mean(rates), 2) if rates else float("nan"),
                itl_p50_ms=round(pct(itl, 0.5), 2), itl_p99_ms=round(pct(itl, 0.99), 2),
                ttft_p50_ms=round(pct(ttft, 0.5), 2), ttft_p99_ms=round(pct(ttft, 0.99), 2))


def long_prompt_phase(url: str, model: str, streams: int, long_tokens: int, prompt_tokens: int, max_tokens: int,
                      vocab: int) -> dict:
    """`streams` clients decoding (one answer of `max_tokens` each; the server needs a slot more);
    once they all stream, one request with
    a `long_tokens` prompt arrives: its time to first token, and the decoding streams'
    inter-token latency while it is prefilled (from its arrival to its first token)."""
    out: dict[int, dict] = {}
    seen: dict[int, list] = {k: [] for k in range(-1, streams)}

    def send(k: int, n: int, new: int) -> None:
        ids = [(11 + 37 * k + 5 * j) % (vocab - 2) + 2 for j in range(n)]
        body = dict(model=model, prompt=ids, max_tokens=new, temperature=0, stream=True, ignore_eos=True,
                    stream_options={"include_usage": True})
        with httpx.Client(timeout=600.0) as c:
            out[k] = one_request(c, url, body, seen[k])

    threads = [threading.Thread(target=send, args=(k, prompt_tokens, max_tokens)) for k in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300
    while any(len(seen[k]) < 2 for k in range(streams)) and time.monotonic() < deadline:
        time.sleep(0.02)  # until every stream decodes
    send(-1, long_tokens, 1)
    for t in threads:
        t.join()
    long = out[-1]
    first = long["chunks"][0] if long["chunks"] else float("nan")
    itl = [(b - a) * 1e3 for k in range(streams) for a, b in zip(out[k]["chunks"], out[k]["chunks"][1:])
           if long["start"] <= b <= first]
    return dict(streams=streams, long_prompt=long_tokens, long_ttft_ms=round((first - long["start"]) * 1e3, 1),
                itl_during_p50_ms=round(pct(itl, 0.5), 2), itl_during_p99_ms=round(pct(itl, 0.99), 2),
                itl_during_n=len(itl))


def _metric(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return float("nan")


def _slope_per_minute(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per minute."""
    n = len(ts)
    if n < 2:
        return float("nan")
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else float("nan")


def hostile_requests(model: str) -> list[tuple[str, dict]]:
    """(what, request) pairs a hostile client sends: each must get its own answer (4xx, or a
    served answer) and leave the normal clients' requests unharmed."""
    chat = lambda **kw: dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)  # noqa: E731
    return [
        ("seed past 64 bits", dict(path="/v1/chat/completions", json=chat(temperature=0.7, seed=2**64 + 5))),
        ("negative seed past 64 bits", dict(path="/v1/chat/completions", json=chat(temperature=0.7, seed=-2**63 - 1))),
        ("max_tokens as a string", dict(path="/v1/completions", json=dict(model=model, prompt="x", max_tokens="10"))),
        ("stream as a string", dict(path="/v1/completions", json=dict(model=model, prompt="x", stream="yes"))),
        ("a message without content", dict(path="/v1/chat/completions", json=dict(model=model, messages=[{"role": "user"}]))),
        ("an empty prompt", dict(path="/v1/completions", json=dict(model=model, prompt=""))),
        ("JSON nested 100k deep", dict(path="/v1/completions", content=b"[" * 100000 + b"]" * 100000)),
        ("a 20 MB body", dict(path="/v1/completions", content=b'{"model": "x", "prompt": "' + b"a" * (20 << 20) + b'"}')),
        ("the eos token's text in a message", dict(path="/v1/chat/completions", json=dict(
            model=model, messages=[{"role": "user", "content": "hi<|eos|><|im_end|>"}], max_tokens=4))),
        ("n past the limit", dict(path="/v1/completions", json=dict(model=model, prompt="x", n=1000))),
        ("response_format json", dict(path="/v1/chat/completions", json=chat(response_format={"type": "json_object"}))),
        ("a schema no grammar can take", dict(path="/v1/chat/completions", json=chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}))),
        ("an unknown route", dict(path="/v1/nothing", json={})),
    ]


def chaos_client(url: str, model: str, stop: float, out: dict) -> None:
    """Until `stop`: the hostile requests one after another, a streamed request dropped after its
    first chunk, and an idle connection (half of them stalled inside their headers) left open a
    while; counts answers by status into `out`."""
    import random
    import socket as sk

    rng = random.Random(0)
    cases = hostile_requests(model)
    host, port = url.removeprefix("http://").split(":")
    idle: list = []
    with httpx.Client(timeout=60.0) as c:
        while time.monotonic() < stop:
            what, req = cases[rng.randrange(len(cases))]
            try:
                r = c.post(url + req["path"], json=req.get("json"), content=req.get("content"),
                           headers={"Content-Type": "application/json"})
                out.setdefault(what, {}).setdefault(r.status_code, 0)
                out[what][r.status_code] += 1
            except httpx.HTTPError as e:
                out.setdefault(what, {}).setdefault(type(e).__name__, 0)
                out[what][type(e).__name__] += 1
            if rng.random() < 0.3:  # a client that goes away mid-stream
                try:
                    with c.stream("POST", url + "/v1/completions", json=dict(
                            model=model, prompt="x", max_tokens=64, stream=True, ignore_eos=True)) as r:
                        next(r.iter_lines(), None)
                except httpx.HTTPError:
                    pass
                out["dropped mid-stream"] = out.get("dropped mid-stream", 0) + 1
            if rng.random() < 0.2 and len(idle) < 16:  # an idle connection, held; half of them slow headers
                conn = sk.create_connection((host, int(port)))
                if rng.random() < 0.5:
                    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                idle.append(conn)
            if len(idle) >= 16 or (idle and rng.random() < 0.1):
                idle.pop(0).close()
    for s in idle:
        s.close()


def soak_phase(url: str, model: str, streams: int, seconds: float, every: float, prompt_tokens: int,
               max_tokens: int, vocab: int, chaos: bool = False, server_pid: int | None = None) -> dict:
    """`streams` clients sending requests back to back for `seconds`, the server's resident memory,
    GPU memory and open file descriptors (its /metrics) sampled every `every` seconds: first, last
    and the least-squares slope over the second half of the samples (the first half includes
    warming up: caches, allocator pools). With `chaos`, a hostile client (`chaos_client`) runs
    beside them; the normal clients' errors, their time to first token and inter-token latency
    percentiles, and the hostile answers by status are reported."""
    stop = time.monotonic() + seconds
    counts = [0] * streams
    errors: list[str] = []
    ttft: list[float] = []
    itl: list[float] = []
    hostile: dict = {}

    def client(k: int) -> None:
        i = 0
        with httpx.Client(timeout=600.0) as c:
            while time.monotonic() < stop:
                ids = [(13 + 71 * k + 29 * i + 3 * j) % (vocab - 2) + 2 for j in range(prompt_tokens)]
                body = dict(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                            ignore_eos=True, stream_options={"include_usage": True})
                try:
                    got = one_request(c, url, body)
                    counts[k] += got["tokens"]
                    if got["chunks"]:
                        ttft.append(1e3 * (got["chunks"][0] - got["start"]))
                        itl.extend(1e3 * (b - a) for a, b in zip(got["chunks"], got["chunks"][1:]))
                except Exception as e:  # noqa: BLE001
                    errors.append(str(e))
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    if chaos:
        threads.append(threading.Thread(target=chaos_client, args=(url, model, stop, hostile)))
    for t in threads:
        t.start()
    t0 = time.monotonic()
    samples = []
    stalls = []  # (seconds into the soak, what failed) of each /metrics sample that got no answer
    while time.monotonic() < stop:
        try:
            text = httpx.get(url + "/metrics", timeout=30).text
        except httpx.HTTPError as e:
            stalls.append((round(time.monotonic() - t0, 1), f"{type(e).__name__}: {e}"))
            print(f"soak: /metrics gave no answer at {stalls[-1][0]} s ({stalls[-1][1]})", flush=True)
            if server_pid is not None:  # the server prints every thread's stack to its stderr
                try:
                    os.kill(server_pid, signal.SIGUSR1)
                except ProcessLookupError:
                    server_pid = None
            time.sleep(every)
            continue
        samples.append((time.monotonic() - t0, _metric(text, "process_resident_memory_bytes") / 1e6,
                        _metric(text, "ktflow_gpu_memory_reserved_bytes") / 1e6,
                        _metric(text, "ktflow_gpu_memory_allocated_bytes") / 1e6,
                        _metric(text, "process_open_fds")))
        if len(samples) % max(1, round(60 / every)) == 0:  # a line a minute: a cut-off run still shows its trend
            t, rss, res, alloc, fds = samples[-1]
            print(f"soak: {t:.0f} s, {sum(counts)} tokens, {len(errors)} errors, RSS {rss:.0f} MB, GPU reserved "
                  f"{res:.0f} MB, allocated {alloc:.0f} MB, {fds:.0f} fds", flush=True)
        time.sleep(every)
    for t in threads:
        t.join()
    if not samples:
        raise RuntimeError(f"the soak got no /metrics sample in {seconds:.0f} s: {stalls[:3]}")
    late = samples[len(samples) // 2:]
    ts = [x[0] for x in late]
    return dict(streams=streams, soak_s=round(time.monotonic() - t0, 1), samples=len(samples),
                tokens=sum(counts), errors=len(errors), first_error=errors[0] if errors else None,
                rss_first_mb=round(samples[0][1], 1), rss_last_mb=round(samples[-1][1], 1),
                rss_slope_mb_per_min=round(_slope_per_minute(ts, [x[1] for x in late]), 3),
                vram_reserved_first_mb=round(samples[0][2], 1), vram_reserved_last_mb=round(samples[-1][2], 1),
                vram_reserved_slope_mb_per_min=round(_slope_per_minute(ts, [x[2] for x in late]), 3),
                vram_allocated_last_mb=round(samples[-1][3], 1),
                vram_allocated_slope_mb_per_min=round(_slope_per_minute(ts, [x[3] for x in late]), 3),
                open_fds_first=samples[0][4], open_fds_last=samples[-1][4], open_fds_max=max(x[4] for x in samples),
                ttft_p50_ms=round(pct(ttft, 0.5), 1), ttft_p99_ms=round(pct(ttft, 0.99), 1),
                itl_p50_ms=round(pct(itl, 0.5), 1), itl_p99_ms=round(pct(itl, 0.99), 1),
                chaos=chaos, hostile=hostile or None, metrics_stalls=stalls or None,
                hostile_5xx=sum(n for by in hostile.values() if isinstance(by, dict)
                                for code, n in by.items() if isinstance(code, int) and code >= 500))


def expert_read_ceiling(d: Path, streams: int) -> float | None:
    """With every routed expert on the CPU and decode bound by reading them, the most `streams`
    sequences can decode over one (total tokens/s ratio) when each token picks top-k of E experts
    uniformly at random (a random-weight model routes about so): `streams` tokens per step over
    the expected distinct experts they read, E (1 - (1 - k/E)^streams), against k for one."""
    cfg = json.loads((d / "config.json").read_text())
    e = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    k = cfg.get("num_experts_per_tok")
    if not e or not k:
        return None
    return streams * k / (e * (1 - (1 - k / e) ** streams))


def served_dir(tmp: Path, checkpoint: str | None) -> Path:
    """The dir to serve, in `tmp`: the demo checkpoint, or `checkpoint`'s files linked, each with
    the demo tokenizer where it has no tokenizer.json (its ids are below 2048: any vocabulary)."""
    from ktflow.tools.demo import ensure_demo_checkpoint
    from ktflow.serve.demo_tokenizer import write_demo_tokenizer

    d = tmp / "model"
    if checkpoint is None:
        src, _ = ensure_demo_checkpoint()
        shutil.copytree(src, d)
    else:
        d.mkdir()
        for f in Path(checkpoint).iterdir():
            (d / f.name).symlink_to(f.resolve())
    if not (d / "tokenizer.json").exists():
        write_demo_tokenizer(d)
        cover_vocabulary(d)
    return d


def cover_vocabulary(d: Path) -> None:
    """Give the demo tokenizer a token for every id of the model's vocabulary past its own (a
    random-weight model's greedy ids land anywhere in it): each decodes to some text, so every
    generated token is a streamed chunk the latencies can be timed by."""
    from tokenizers import Tokenizer

    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    have = tok.get_vocab_size()
    if vocab > have:
        tok.add_tokens([f"<{i}>" for i in range(have, vocab)])
        tok.save(str(d / "tokenizer.json"))


def experts_to_cpu(g, ctx):
    """A custom pass (after placement): every routed-experts node on the CPU, whatever the cost
    model chose (at a batch of several sequences it would spend VRAM on hot experts before
    attention)."""
    from dataclasses import replace

    from ktflow.ir.ops import Op
    from ktflow.ir.types import Device, Placement

    def moved(n):
        if n.op == Op.ROUTED_EXPERTS and n.place.device != Device.CPU:
            return replace(n, place=Placement(Device.CPU, cause="serve_load --experts-on-cpu"))
        return n

    return g.map(moved)


def experts_on_cpu_plan(d: Path, out: Path, hw: str, device: str, max_batch: int, max_seq_len: int) -> Path:
    """Compile `d` with every routed expert on the CPU (the default VRAM budget, then the
    `experts_to_cpu` pass) and save the plan to `out`."""
    import ktflow
    from ktflow.ir.ops import Op

    model = ktflow.load(d)
    c = ktflow.compile(model, hw=hw, device=device, max_batch=max_batch, max_seq_len=max_seq_len,
                       passes=[("after:place_by_intensity", experts_to_cpu)])
    held = sum(1 for n in c.decode.ir.nodes if n.op == Op.ROUTED_EXPERTS and n.place.device.value != "cpu")
    attn = sum(1 for n in c.decode.ir.nodes if n.op == Op.ATTENTION and n.place.device.value == "gpu")
    print(f"plan: decode routed-expert nodes off the CPU: {held}; decode attention layers on the GPU: {attn}; "
          f"predicted GPU memory {c.decode.memory.gpu_bytes / 1e9:.2f} GB", flush=True)
    c.save(out)
    return out


BASELINE = """
import sys, torch, ktflow
from ktflow.runtime.generate import generate_with_stats
d, plan, prompt, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = ktflow.load(d)
c = ktflow.Compiled.load(plan, model) if plan else ktflow.compile(model, **eval(sys.argv[5]))
ids = torch.tensor([[(7 + 3 * j) % 2046 + 2 for j in range(prompt)]])
generate_with_stats(c, ids, new)  # warm: weights, the first decode step's capture
_, st = generate_with_stats(c, ids, new)
print(st.decode_tokens_per_s)
"""


def run_baseline(d: Path, plan: Path | None, compile_opts: dict, prompt_tokens: int, max_tokens: int) -> float:
    """What `ktflow run` decodes at on the same model and plan (its `generate_with_stats`, warmed:
    the first decode step's capture is not timed): one sequence, greedy, the benchmark's prompt
    and answer lengths; in its own process, gone before the server starts."""
    cmd = [sys.executable, "-c", BASELINE, str(d), str(plan or ""), str(prompt_tokens), str(max_tokens),
           repr(compile_opts)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "KTFLOW_QUIET": "1"})
    if p.returncode != 0:
        raise SystemExit(f"the baseline run failed: {p.stderr.strip().splitlines()[-1:]}")
    return float(p.stdout.strip().splitlines()[-1])


def start_server(d: Path, max_batch: int, args: list[str]) -> tuple[subprocess.Popen, str]:
    """`ktflow serve d` on a free loopback port; (process, url) once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ktflow", "serve", str(d), "--port", str(port), "--model-name", "demo",
           "--max-batch", str(max_batch)] + args
    p = subprocess.Popen(cmd, env={**os.environ, "KTFLOW_QUIET": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if p.poll() is not None:
            raise SystemExit(f"ktflow serve exited with {p.returncode} before it was up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            p.kill()
            raise SystemExit("ktflow serve did not come up in 600 s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start `ktflow serve` on the demo model here)")
    ap.add_argument("--model", default="demo", help="the model name the server serves (with --url)")
    ap.add_argument("--streams", default="1,2,4", help="comma list of concurrent client counts")
    ap.add_argument("--requests", type=int, default=4, help="requests per stream per phase")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="a phase starts no request after this long")
    ap.add_argument("--vocab", type=int, default=2048, help="prompt ids are drawn below this (default 2048, the "
                    "demo model's vocabulary)")
    ap.add_argument("--hw", default="cpu", help="demo server: hardware profile (default cpu)")
    ap.add_argument("--device", default="cpu", help="demo server: where GPU nodes run (default cpu)")
    ap.add_argument("--checkpoint", help="serve this checkpoint dir instead of the demo (linked into a temp dir, "
                    "with the demo tokenizer where it has none), e.g. one benchmarks/e2e.py wrote")
    ap.add_argument("--experts-on-cpu", action="store_true",
                    help="compile the plan with every routed expert on the CPU (as e2e.py does) and serve it")
    ap.add_argument("--baseline", action="store_true",
                    help="first time `ktflow run` (one sequence, same plan and lengths) for the one-stream ratio")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="then one request with a prompt this long arriving while --long-streams streams decode: "
                         "its time to first token and their inter-token latency meanwhile")
    ap.add_argument("--long-streams", type=int, default=8)
    ap.add_argument("--soak", type=float, default=0.0,
                    help="then a soak of this many seconds at --soak-streams streams: the server's RSS and GPU "
                         "memory sampled from /metrics, first, last and slope")
    ap.add_argument("--soak-streams", type=int, default=8)
    ap.add_argument("--soak-every", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--chaos", action="store_true",
                    help="with --soak: a hostile client beside the streams (bad inputs, a 20 MB body, deep JSON, "
                    "dropped streams, idle connections); reports the normal requests' error rate, latency "
                    "percentiles, memory and open-file slopes, and the hostile answers by status")
    ap.add_argument("--client-cpus", default="", help="comma list of CPUs the clients run on (default: any)")
    ap.add_argument("--out", default=str(HERE / "serve_load.jsonl"))
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    slots = max(streams + ([a.soak_streams] if a.soak else []))  # the server's --max-batch: every stream decodes at once
    proc = tmp = None
    url = a.url
    baseline = None
    if url is None:
        tmp = Path(tempfile.mkdtemp(prefix="ktflow-serve-load-"))
        d = served_dir(tmp, a.checkpoint)
        max_seq = max(a.prompt_tokens + 4 * a.max_tokens, a.long_prompt + 1) + 8  # the long-prompt phase's answers
        plan = None
        if a.experts_on_cpu:
            plan = experts_on_cpu_plan(d, tmp / "plan.json", a.hw, a.device, slots, max_seq)
            args = ["--plan", str(plan)]
        else:
            args = ["--max-seq-len", str(max_seq), "--hw", a.hw, "--device", a.device]
        if a.baseline:
            opts = dict(max_seq_len=max_seq, hw=a.hw, device=a.device, max_batch=slots)
            baseline = run_baseline(d, plan, opts, a.prompt_tokens, a.max_tokens)
            print(f"ktflow run's generate, one sequence: decode {baseline:.1f} tok/s", flush=True)
        proc, url = start_server(d, slots, args)
    if a.client_cpus:  # after the server started: it keeps every CPU
        os.sched_setaffinity(0, {int(c) for c in a.client_cpus.split(",")})
    try:
        vocab = a.vocab
        httpx.get(url + "/v1/models", timeout=10).raise_for_status()
        rows = []
        first = None
        print(f"{'streams':>7} {'reqs':>5} {'err':>4} {'total tok/s':>12} {'tok/s/stream':>13} {'ITL p50 ms':>11} "
              f"{'ITL p99 ms':>11} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
        for n in streams:
            r = phase(url, a.model, n, a.requests, a.prompt_tokens, a.max_tokens, a.max_seconds, vocab)
            print(f"{r['streams']:>7} {r['requests']:>5} {r['errors']:>4} {r['total_tok_s']:>12.1f} "
                  f"{r['per_stream_tok_s']:>13.1f} {r['itl_p50_ms']:>11.1f} {r['itl_p99_ms']:>11.1f} "
                  f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}", flush=True)
            if r["first_error"]:
                print(f"        first error: {r['first_error']}")
            first = first or (r["total_tok_s"] if n == 1 else None)
            ceiling = expert_read_ceiling(d, n) if proc else None
            if first and n > 1:
                print(f"        total tok/s over one stream's: {r['total_tok_s'] / first:.2f}x"
                      + (f" (uniform-routing expert-read ceiling {ceiling:.2f}x)" if ceiling else ""))
            if baseline and n == 1:
                print(f"        one stream through the server / ktflow run's generate: "
                      f"{r['per_stream_tok_s'] / baseline:.3f}")
            rows.append(dict(bench="serve_load", commit=commit(), **machine(),
                             url=(a.checkpoint or "demo") if proc else url, model=a.model,
                             prompt_tokens=a.prompt_tokens, max_tokens=a.max_tokens, hw=a.hw if proc else None,
                             experts_on_cpu=a.experts_on_cpu, run_decode_tok_s=baseline,
                             uniform_ceiling=round(ceiling, 3) if ceiling else None, **r))
        if a.long_prompt:
            n = a.long_streams
            if n >= slots and proc:
                raise SystemExit(f"--long-streams {n} leaves the long prompt no slot (--max-batch is {slots})")
            r = long_prompt_phase(url, a.model, n, a.long_prompt, a.prompt_tokens, 4 * a.max_tokens, vocab)
            print(f"a {a.long_prompt}-token prompt arriving while {n} streams decode: time to first token "
                  f"{r['long_ttft_ms']:.0f} ms; the streams' inter-token latency meanwhile p50 "
                  f"{r['itl_during_p50_ms']:.1f} ms, p99 {r['itl_during_p99_ms']:.1f} ms", flush=True)
            rows.append(dict(bench="serve_load_long_prompt", commit=commit(), **machine(),
                             url=(a.checkpoint or "demo") if proc else url, model=a.model, prompt_tokens=a.prompt_tokens,
                             max_tokens=a.max_tokens, experts_on_cpu=a.experts_on_cpu, **r))
        if a.soak:
            r = soak_phase(url, a.model, a.soak_streams, a.soak, a.soak_every, a.prompt_tokens, a.max_tokens, vocab,
                           chaos=a.chaos, server_pid=proc.pid if proc else None)
            print(f"soak: {r['soak_s']:.0f} s at {r['streams']} streams, {r['tokens']} tokens, {r['errors']} errors; "
                  f"RSS {r['rss_first_mb']:.0f} -> {r['rss_last_mb']:.0f} MB (slope {r['rss_slope_mb_per_min']:+.2f} "
                  f"MB/min over the second half); GPU reserved {r['vram_reserved_first_mb']:.0f} -> "
                  f"{r['vram_reserved_last_mb']:.0f} MB ({r['vram_reserved_slope_mb_per_min']:+.2f} MB/min), "
                  f"allocated {r['vram_allocated_last_mb']:.0f} MB ({r['vram_allocated_slope_mb_per_min']:+.2f} MB/min)",
                  flush=True)
            print(f"      normal requests: {r['errors']} errors; TTFT p50 {r['ttft_p50_ms']:.0f} / p99 "
                  f"{r['ttft_p99_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.1f} / p99 {r['itl_p99_ms']:.1f} ms; open files "
                  f"{r['open_fds_first']:.0f} -> {r['open_fds_last']:.0f} (max {r['open_fds_max']:.0f})", flush=True)
            if a.chaos:
                print(f"      hostile answers by status: {json.dumps(r['hostile'])}; 5xx: {r['hostile_5xx']}", flush=True)
            rows.append(dict(bench="serve_load_soak", commit=commit(), **machine(),
                             url=(a.checkpoint or "demo") if proc else url, model=a.model, prompt_tokens=a.prompt_tokens,
                             max_tokens=a.max_tokens, experts_on_cpu=a.experts_on_cpu,
                             server_slots=slots if proc else None, **r))
        append_jsonl(a.out, rows)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
