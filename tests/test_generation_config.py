"""A checkpoint's generation_config.json: its eos ids end generation in `generate`, `run` and
`serve`; its sampling defaults fill the fields a request leaves out; a malformed file is named."""

import json
import shutil

import pytest
import torch

import ktflow
from ktflow.errors import ConfigError
from ktflow.frontend.generation import GenerationDefaults

PROMPT = [1, 5, 9, 33]
OPTS = dict(hw="cpu", device="cpu", max_seq_len=64)


def test_the_file_is_read_as_transformers_writes_it(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [7, 3, 7],
         "transformers_version": "4.51.0"}))
    g = GenerationDefaults.read(tmp_path, vocab=100)
    assert g.eos_ids == (7, 3) and g.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6,
                                                                 "eos_token_id": 2}))
    assert GenerationDefaults.read(tmp_path, vocab=100) == GenerationDefaults((2,), {})  # greedy: no defaults
    assert GenerationDefaults.read(tmp_path / "none", vocab=100) == GenerationDefaults()


@pytest.mark.parametrize("body,words", [
    ("{", "not valid JSON"), ("[1]", "expected a JSON object"), ('{"eos_token_id": 500}', "eos_token_id 500"),
    ('{"eos_token_id": [1, true]}', "eos_token_id True"), ('{"temperature": -1}', "temperature must be"),
    ('{"top_p": "0.9"}', "top_p must be"),
])
def test_a_malformed_file_is_named(tmp_path, body, words):
    (tmp_path / "generation_config.json").write_text(body)
    with pytest.raises(ConfigError, match=f"generation_config.json.*{words}"):
        GenerationDefaults.read(tmp_path, vocab=100)


def _with_generation_config(src, dst, cfg: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


def test_generate_and_run_stop_at_the_checkpoints_eos_ids(demo_dir, tmp_path, capfd):
    free = ktflow.generate(ktflow.compile(ktflow.load(demo_dir), **OPTS), torch.tensor([PROMPT]), 8,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    stop = free[2]
    first = free.index(stop)
    d = _with_generation_config(demo_dir, tmp_path / "m", {"eos_token_id": [stop]})
    model = ktflow.load(d)
    assert stop in model.eos_ids
    c = ktflow.compile(model, **OPTS)
    got = ktflow.generate(c, torch.tensor([PROMPT]), 8)[0, len(PROMPT):].tolist()
    assert got[:first + 1] == free[:first + 1] and set(got[first:]) == {stop}  # ended there, padded with it
    assert ktflow.generate(c, torch.tensor([PROMPT]), 8, eos_token_id=None)[0, len(PROMPT):].tolist() == free

    from ktflow.tools.cli import main

    assert main(["run", str(d), "--hw", "cpu", "--max-seq-len", "64", "--max-new-tokens", "8",
                 "--input-ids", ",".join(map(str, PROMPT))]) == 0
    line = next(ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("generated ids"))
    assert json.loads(line[len("generated ids "):].split("  ")[0]) == free[:first + 1]


def test_a_servers_request_takes_the_checkpoints_sampling_defaults_where_it_is_silent(demo_dir, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from ktflow.serve.demo_tokenizer import write_demo_tokenizer
    from ktflow.serve.tokenizer import ServeTokenizer
    from test_serve import COMPILE, reference, running

    d = _with_generation_config(demo_dir, tmp_path / "m", {"do_sample": True, "temperature": 0.0})
    write_demo_tokenizer(d)
    c, tok = ktflow.compile(ktflow.load(d), **COMPILE), ServeTokenizer.from_dir(d)
    with running(c, tok, slots=1) as (base, served, runner):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        ids = tok.encode("hello world")
        greedy = reference(c, ids, 12, tok)
        silent = client.completions.create(model="demo", prompt="hello world", max_tokens=12, seed=5)
        assert silent.choices[0].text == greedy  # generation_config.json's temperature 0: greedy
        hot = [client.completions.create(model="demo", prompt="hello world", max_tokens=12, seed=s,
                                         temperature=1.0).choices[0].text for s in range(4)]
        assert any(h != greedy for h in hot)  # the request's own temperature wins
