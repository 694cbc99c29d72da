"""The Python API for applications: tokens as they come (`ktflow.stream`), and chat with the
checkpoint's template, tokenizer and eos (`ktflow.chat`), whole or streamed."""

import shutil

import pytest
import torch

import ktflow

OPTS = dict(hw="cpu", device="cpu", max_seq_len=96)


def test_stream_yields_generates_tokens_one_by_one(demo_dir):
    c = ktflow.compile(ktflow.load(demo_dir), **OPTS)
    prompt = [1, 5, 9, 33]
    whole = ktflow.generate(c, torch.tensor([prompt]), 10, eos_token_id=None)[0, 4:].tolist()
    it = ktflow.stream(c, prompt, 10, eos_token_id=None)
    assert next(it) == whole[0] and list(it) == whole[1:]
    stop = whole[3]
    assert list(ktflow.stream(c, prompt, 10, eos_token_id=stop)) == whole[:whole.index(stop)]  # eos not yielded
    sampled = list(ktflow.stream(c, prompt, 8, temperature=0.8, seed=4, eos_token_id=None))
    assert sampled == ktflow.generate(c, torch.tensor([prompt]), 8, temperature=0.8, seed=4,
                                      eos_token_id=None)[0, 4:].tolist()


def test_chat_renders_the_template_and_streams_the_same_text(demo_dir, tmp_path):
    from ktflow.serve.demo_tokenizer import write_demo_tokenizer
    from ktflow.serve.tokenizer import ServeTokenizer

    d = tmp_path / "m"
    shutil.copytree(demo_dir, d)
    write_demo_tokenizer(d)
    c = ktflow.compile(ktflow.load(d), **OPTS)
    msgs = [{"role": "user", "content": "Hello there"}]
    text = ktflow.chat(c, msgs, 12)
    tok = ServeTokenizer.from_dir(d)
    ids = tok.encode_chat(msgs)
    out = ktflow.generate(c, torch.tensor([ids]), 12)[0, len(ids):].tolist()
    out = out[:next((i for i, t in enumerate(out) if t in tok.eos_ids), len(out))]
    assert text == tok.decode(out)
    assert "".join(ktflow.chat(c, msgs, 12, stream=True)) == text


def test_chat_without_a_tokenizer_says_what_is_missing(demo_dir):
    from ktflow.errors import ConfigError

    c = ktflow.compile(ktflow.load(demo_dir), **OPTS)
    with pytest.raises(ConfigError, match="tokenizer.json"):
        ktflow.chat(c, [{"role": "user", "content": "hi"}], 4)
