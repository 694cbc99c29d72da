"""Property-based fuzzing (hypothesis, bounded example counts): the safetensors header parser,
the config loader, the plan loader and the CLI take generated input and end in success or a
KtflowError, never another exception; a mutated plan that loads runs to the original's output."""

import contextlib
import io
import json
import os
import struct

import pytest
import torch

pytest.importorskip("hypothesis", reason="the test extra installs hypothesis (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ktflow  # noqa: E402
from ktflow.tools import cli  # noqa: E402
from ktflow.errors import KtflowError  # noqa: E402
from ktflow.frontend.weights import SafetensorsFile  # noqa: E402

#: examples per property: bounded for `make test`; KTFLOW_FUZZ_EXAMPLES=N for a longer run
N = int(os.environ.get("KTFLOW_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck))

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                        st.text(max_size=8))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                          max_leaves=12)


# ------------------------------------------------------------------------------------- headers

entry = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "F8_E4M3"]), json_value),
    "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), json_value),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 64), min_size=2, max_size=2), json_value),
})


@FUZZ
@given(header=st.dictionaries(st.text(min_size=1, max_size=6), st.one_of(entry, json_value), max_size=4),
       data=st.binary(max_size=64), raw=st.one_of(st.none(), st.binary(max_size=80)))
def test_header_parser(tmp_path_factory, header, data, raw):
    p = tmp_path_factory.mktemp("st") / "x.safetensors"
    if raw is not None:
        p.write_bytes(raw)
    else:
        h = json.dumps(header).encode()
        p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    try:
        f = SafetensorsFile(p)
    except KtflowError:
        return
    for e in f.entries.values():  # what the parser accepts can be read
        try:
            t = f.tensor(e)
        except KtflowError:
            continue
        assert t.numel() * t.element_size() == e.end - e.begin


# ------------------------------------------------------------------------------------- configs

BASE = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
        "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "decoder_sparse_step": 1,
        "norm_topk_prob": True, "tie_word_embeddings": False}
small_int = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**62]))


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(sorted(BASE) + ["rope_scaling", "mlp_only_layers", "sliding_window"]),
                             st.one_of(small_int, json_value), max_size=3))
def test_config_loader_and_compile(tmp_path_factory, edits):
    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_text(json.dumps({**BASE, **edits}))
    try:
        model = ktflow.load(d)
        ktflow.compile(model, hw="cpu", max_seq_len=16)
    except KtflowError:
        pass


# ------------------------------------------------------------------------------------- plans

@pytest.fixture(scope="module")
def plan_case(demo_dir, tmp_path_factory):
    model = ktflow.load(demo_dir)
    c = ktflow.compile(model, hw="cpu", max_seq_len=32, backend="torch_ref", dtype="float32")
    path = tmp_path_factory.mktemp("plan") / "p.json"
    c.save(path)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    return model, json.loads(path.read_text()), ids, ktflow.execute(c, ids)[0]


def _paths(v, at=()):
    """Every path into a JSON value (dict keys, list indices)."""
    yield at
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, (*at, i))


def _mutate(raw, pick: int, how: str, value):
    paths = [p for p in _paths(raw) if p]
    path = paths[pick % len(paths)]
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "value":
        parent[key] = value
    elif how == "bump" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool):
        parent[key] = parent[key] + (value if isinstance(value, int) and not isinstance(value, bool) else 1)
    elif how == "swap" and isinstance(parent, list) and len(parent) > 1:
        j = (key + 1) % len(parent)
        parent[key], parent[j] = parent[j], parent[key]
    return path


@settings(max_examples=N + N // 3, deadline=None, suppress_health_check=list(HealthCheck))
@given(pick=st.integers(0, 10**9), how=st.sampled_from(["delete", "value", "bump", "swap"]),
       value=st.one_of(small_int, json_value))
def test_a_mutated_plan_is_refused_at_load_or_runs_to_the_same_output(tmp_path_factory, plan_case, pick, how, value):
    model, raw, ids, want = plan_case
    mutated = json.loads(json.dumps(raw))
    path = _mutate(mutated, pick, how, value)
    p = tmp_path_factory.mktemp("mut") / "p.json"
    p.write_text(json.dumps(mutated))
    try:
        c = ktflow.Compiled.load(p, model)
    except KtflowError:
        return
    try:
        got = ktflow.execute(c, ids)[0]
    except KtflowError:
        return  # refused before running (a flag or size check), with a message
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"mutation at {path} ran to another output"


# ------------------------------------------------------------------------------------- the CLI

flag = st.sampled_from(["--hw", "--max-seq-len", "--max-batch", "--dtype", "--device", "--backend", "--placement",
                        "--defer", "--vram-budget-gb", "--prefill-buckets", "--prefill-chunk", "--temperature",
                        "--top-p", "--input-ids", "--max-new-tokens", "--seed", "--plan", "-o", "--text"])
word = st.one_of(st.sampled_from(["cpu", "nan", "-1", "0", "1e11", "auto", "1,2", "x", "", "paper-a100", "1 2 3",
                                  "/", "/nonexistent/p.json", "float32", "inf"]), st.text(max_size=5))


@settings(max_examples=max(N * 2 // 3, 1), deadline=None, suppress_health_check=list(HealthCheck))
@given(command=st.sampled_from(["compile", "run", "inspect"]), args=st.lists(st.tuples(flag, word), max_size=4))
def test_cli_ends_in_an_exit_code_without_a_traceback(demo_dir, tmp_path_factory, command, args):
    argv = [command, str(demo_dir) if command != "inspect" else "/nonexistent.json"]
    for f, w in args:
        argv += [f, w] if f != "--text" else [f]
    if command == "run" and "--input-ids" not in argv:
        argv += ["--input-ids", "1 2", "--max-new-tokens", "1"]
    out_dir = tmp_path_factory.mktemp("o")
    for i, a in enumerate(argv[:-1]):  # every output into the temp dir
        if a == "-o":
            argv[i + 1] = str(out_dir / f"p{i}.json")
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(out_dir)  # and a relative path anywhere else lands there too
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's own usage errors
                code = e.code
    finally:
        os.chdir(cwd)
    assert code in (0, 1, 2), (argv, code, err.getvalue())
    assert "Traceback" not in err.getvalue() and "internal error" not in err.getvalue(), (argv, err.getvalue())
