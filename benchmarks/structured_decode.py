"""Structured output and forced tool calls through the serving engine: decode speed against
unconstrained decoding, and how many forced answers are valid calls (issue 45).

    python benchmarks/structured_decode.py --model qwen3 --layers 12 --fp8 --vram-gb 24
    python benchmarks/structured_decode.py --demo --requests 4 --tokens 48     # the demo model, CPU

The model has random weights, so it gets a synthetic byte-level BPE tokenizer of its whole
vocabulary (random merges of the 256 byte symbols; one special end-of-text id): the grammar's
per-step mask work is that of a real vocabulary of this size. Three request kinds run on one
compiled model and one engine, one request at a time, greedy:

- `free`: unconstrained, `--tokens` tokens (eos ignored);
- `schema`: a JSON schema holding an array of at least `--tokens` // 3 small integers, so the answer
  is long; it ends where the grammar allows only the end of text;
- `tool`: `tool_choice="required"` over two declared functions (hermes format): each answer must
  parse as one call of a declared function whose arguments follow its schema.

Decode tok/s of a request: (tokens - 1) / (last token's time - first token's time). Prints a table;
appends one row per kind to --out. The targets: schema decode >= 0.9x free decode; 100% of forced
answers valid calls.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import HERE, append_jsonl, commit, machine  # noqa: E402
from e2e import add_checkpoint_args, bench_checkpoint  # noqa: E402

EOS = "<|endoftext|>"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["query"], "additionalProperties": False}}},
]


def synthetic_tokenizer(vocab: int, seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab` ids: the 256 byte symbols, then
    random merges of two tokens already made (short ones favoured), and EOS as the last id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    g = torch.Generator().manual_seed(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, seen, merges = list(alphabet), set(alphabet), []
    while len(tokens) < vocab - 1:
        pool = min(len(tokens), 4096)
        a, b = (tokens[int(i)] for i in torch.randint(0, pool, (2,), generator=g))
        if a + b in seen or len(a + b) > 12:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)
    return tok


def run_one(engine, prompt: list[int], tokens: int, sampling, decode) -> dict:
    """One request to the end: its Finished event and (tokens so far, time) at each new token."""
    from ktflow.serve.engine import Delta, Failed, Finished, GenRequest

    done, times, out = threading.Event(), [], {}

    def emit(ev):
        if isinstance(ev, Delta) and ev.completion_tokens and (not times or times[-1][0] < ev.completion_tokens):
            times.append((ev.completion_tokens, time.perf_counter()))
        if isinstance(ev, (Finished, Failed)):
            out["ev"] = ev
            done.set()

    req = GenRequest(list(prompt), tokens, emit, sampling=sampling, ignore_eos=sampling.grammar is None, decode=decode)
    engine.submit(req)
    done.wait()
    ev = out["ev"]
    if isinstance(ev, Failed):
        raise RuntimeError(f"a request failed: {ev.message}")
    return dict(ev=ev, times=times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(ap)
    ap.add_argument("--requests", type=int, default=8, help="requests of each kind")
    ap.add_argument("--tokens", type=int, default=192, help="tokens a free answer decodes (the schema's array "
                    "asks for a third as many numbers)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--out", default=str(HERE / "structured_decode.jsonl"))
    ap.add_argument("--run-id", default=time.strftime("%Y%m%d-%H%M%S"))
    a = ap.parse_args(argv)
    import ktflow
    from ktflow.backends.sampling import SamplingParams
    from ktflow.serve.engine import Engine
    from ktflow.serve.grammar import Grammars
    from ktflow.serve.runner import PoolRunner
    from ktflow.serve.tokenizer import ServeTokenizer
    from ktflow.serve.tool_parsers import PARSERS

    ckpt, name, layers = bench_checkpoint(a.demo, a.model, a.layers, a.fp8, a.dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    limits = {"free": a.tokens, "schema": 8 * a.tokens, "tool": 1024}  # the grammars end the answers
    opts = dict(hw=a.hw, device=device, max_seq_len=a.prompt + max(limits.values()) + 64, max_batch=1)
    if a.vram_gb:
        opts["vram_gb"] = a.vram_gb
    compiled = ktflow.compile(ktflow.load(ckpt), **opts)
    vocab = compiled.vocab_size
    t0 = time.perf_counter()
    tok = ServeTokenizer(synthetic_tokenizer(vocab), None, None, EOS)
    grammars = Grammars(tok, vocab, tok.eos_ids)
    grammars.matcher(grammars.compile({"type": "json_object"}))  # llguidance's tokenizer made: not timed below
    setup_s = time.perf_counter() - t0
    parser = PARSERS["hermes"]
    n = max(a.tokens // 3, 1)
    schema = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
        "type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99},
                                                    "minItems": n, "maxItems": n}},
        "required": ["values"], "additionalProperties": False}}}
    kinds = {"free": SamplingParams(),
             "schema": SamplingParams(grammar=grammars.compile(schema)),
             "tool": SamplingParams(grammar=grammars.tool_call(TOOLS, "required", parser))}
    runner = PoolRunner(compiled, 1, prefix_cache=False, grammars=grammars)
    runner.warm()
    engine = Engine(runner, lambda ids: tok.tok.decode(ids, skip_special_tokens=True), eos_ids=tok.eos_ids)
    engine.start()
    g = torch.Generator().manual_seed(1)
    decode = lambda ids: tok.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    info = dict(bench="structured_decode", run_id=a.run_id, commit=commit(), **machine(),
                gpu=torch.cuda.get_device_name(0) if device == "cuda" else None, model=name, layers=layers,
                checkpoint="fp8" if a.fp8 else "bf16", vram_gb=a.vram_gb, vocab=vocab, prompt=a.prompt,
                tokenizer_setup_s=round(setup_s, 3))
    rows = {k: [] for k in kinds}
    valid = {"schema": 0, "tool": 0}
    try:
        for kind, params in kinds.items():  # one warm-up request each: the first uses of their paths
            run_one(engine, torch.randint(0, vocab - 1, (a.prompt,), generator=g).tolist(), 8, params, decode)
        for r in range(a.requests):
            for kind, params in kinds.items():
                prompt = torch.randint(0, vocab - 1, (a.prompt,), generator=g).tolist()
                got = run_one(engine, prompt, limits[kind], params, decode)
                ev, times = got["ev"], got["times"]
                text, count = ev.text, ev.completion_tokens
                (n0, t0), (n1, t1) = times[0], times[-1]
                rate = (n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else float("nan")
                rows[kind].append(dict(tokens=count, decode_tok_s=rate, finish=ev.reason))
                if kind == "schema":
                    try:
                        obj = json.loads(text)
                        valid["schema"] += isinstance(obj, dict) and len(obj.get("values", [])) == n
                    except json.JSONDecodeError:
                        pass
                if kind == "tool":
                    ok = _valid_call(parser, text)
                    valid["tool"] += ok
                    if not ok:
                        print(f"not a valid call ({count} tokens, {ev.reason}): {text[:300]!r}")
    finally:
        engine.stop()
    mean = {k: sum(x["decode_tok_s"] for x in v) / len(v) for k, v in rows.items()}
    tokens = {k: sum(x["tokens"] for x in v) / len(v) for k, v in rows.items()}
    print(f"\n{name} ({layers or 'all'} layers), {device}, vocab {vocab}, {a.requests} requests a kind, "
          f"commit {info['commit']}")
    print(f"{'kind':>7} {'tokens':>7} {'decode tok/s':>13} {'vs free':>8} {'valid':>7}")
    for k in kinds:
        v = f"{valid[k]}/{a.requests}" if k in valid else "-"
        print(f"{k:>7} {tokens[k]:>7.1f} {mean[k]:>13.2f} {mean[k] / mean['free']:>8.3f} {v:>7}")
    print(f"schema decode {mean['schema'] / mean['free']:.3f}x free (target >= 0.9x); forced tool calls valid: "
          f"{valid['tool']}/{a.requests} (target all)")
    append_jsonl(a.out, [dict(info, kind=k, requests=a.requests, mean_tokens=round(tokens[k], 2),
                              decode_tok_s=round(mean[k], 3), ratio_vs_free=round(mean[k] / mean["free"], 4),
                              valid=valid.get(k)) for k in kinds])
    return 0


def _valid_call(parser, text: str) -> bool:
    """Whether `text` is one call of a declared tool whose arguments follow its schema (the
    schemas here: required keys, integer ranges, string lengths, no other keys)."""
    _, calls = parser(text)
    if len(calls) != 1:
        return False
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == calls[0].name), None)
    if tool is None:
        return False
    try:
        args, spec = json.loads(calls[0].arguments), tool["parameters"]
    except json.JSONDecodeError:
        return False
    if not set(spec["required"]) <= set(args) or not set(args) <= set(spec["properties"]):
        return False
    for key, value in args.items():
        p = spec["properties"][key]
        if p["type"] == "integer" and not (isinstance(value, int) and p["minimum"] <= value <= p["maximum"]):
            return False
        if p["type"] == "string" and not (isinstance(value, str) and len(value) <= p["maxLength"]):
            return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
