"""A small byte-level BPE tokenizer for the demo checkpoint (which ships none), so `ktflow serve`
can be tried, tested and load-tested on it without a download.

`write_demo_tokenizer(dir)` trains one on a fixed English text with the `tokenizers` library
(at most `vocab_size` ids, `<|bos|>` = 0 and `<|eos|>` = 1 to match the demo config's bos/eos ids,
a post-processor that starts every encoded prompt with `<|bos|>`) and writes `tokenizer.json`
and `tokenizer_config.json` with a simple chat template, both atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..util.fsutil import write_atomic

#: role markers; the template refuses any other role through raise_exception
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ m['role'] ~ ': use system, user or assistant') }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = ("the a model expert layer token prompt answer question server request stream batch slot queue cache "
          "router attention weight plan compile schedule decode prefill latency throughput memory machine "
          "hello world what is how many why when where who which this that these those there here one two three "
          "four five six seven eight nine ten red green blue small large fast slow good bad new old first last "
          "time day year people way thing man woman child life hand part place case week company system program "
          "number group problem fact be have do say get make go know take see come think look want give use find "
          "tell ask work seem feel try leave call and or but if then because so while after before").split()


def _corpus(lines: int = 6000) -> list[str]:
    """Deterministic sentences over a fixed word list and made-up words of two to four syllables
    (enough distinct pieces to fill a 2048-id vocabulary), plus digits and punctuation."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    out, x = [], 12345

    def rand(n: int) -> int:
        nonlocal x
        x = (1103515245 * x + 12345) % 2**31
        return (x >> 8) % n

    made = ["".join(syllables[rand(len(syllables))] for _ in range(2 + rand(3))) for _ in range(3000)]
    vocab = list(_WORDS) * 8 + made
    for i in range(lines):
        words = [vocab[rand(len(vocab))] for _ in range(6 + i % 9)]
        out.append(f"{' '.join(words).capitalize()}{'.?!,;:'[i % 6]} {i % 97} ({i % 13})")
    return out


def write_demo_tokenizer(directory: str | Path, vocab_size: int = 2048) -> Path:
    """Train the tokenizer and write it into `directory`; returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = Path(directory)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A $B",
                                                       special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    path = d / "tokenizer.json"
    write_atomic(path, tok.to_str())
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}
    write_atomic(d / "tokenizer_config.json", json.dumps(config, indent=1) + "\n")
    return path
