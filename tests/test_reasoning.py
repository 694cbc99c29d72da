"""A reasoning model's thinking split from its answer, whole or streamed in any chunking."""

import pytest

from ktflow.serve.reasoning import ThinkSplit, opens_thinking, split

CASES = [
    ("<think>\nlet me see</think>\n\nThe answer.", False, ("let me see", "The answer.")),
    ("let me see</think>The answer.", True, ("let me see", "The answer.")),
    ("Plain answer, no thinking.", False, (None, "Plain answer, no thinking.")),
    ("still thinking when cut", True, ("still thinking when cut", "")),
    ("<think>x</think>", False, ("x", "")),
]


@pytest.mark.parametrize("text,opened,want", CASES)
def test_split_whole(text, opened, want):
    assert split(text, opened) == want


@pytest.mark.parametrize("text,opened,want", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_a_stream_in_any_chunking_routes_the_same_text(text, opened, want, size):
    s, thinking, answer = ThinkSplit(opened), "", ""
    for at in range(0, len(text), size):
        t, a = s.feed(text[at:at + size])
        thinking, answer = thinking + t, answer + a
    t, a = s.flush()
    thinking, answer = thinking + t, answer + a
    assert (thinking.strip() or None, answer) == want


def test_a_prompt_that_opens_the_block():
    assert opens_thinking("<|Assistant|><think>\n") and not opens_thinking("<|Assistant|>")
