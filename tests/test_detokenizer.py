"""Incremental detokenization: multi-byte characters and stop strings, one token at a time."""
from __future__ import annotations

import pytest

from deployments.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld! 日本語のテキスト, emoji 🙂🚀 and a plain ending. Is a test here? This is a test."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from engine.loader import load_tokenizer
    return load_tokenizer(smollm2_path)


def stream(tokenizer, text: str, stop: list[str] | None = None, batch: int = 1) -> tuple[list[str], object]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for i in range(0, len(ids), batch):
        step = detok.push(ids[i:i + batch])
        deltas.append(step.text)
        if step.stopped:
            return deltas, detok
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("batch", [1, 3])
def test_multibyte_characters_are_never_split(tokenizer, batch):
    deltas, _ = stream(tokenizer, TEXT, batch=batch)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["is a", "🚀", "テキ", "ending.", "Héllo", "st."])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_text_stops_before_the_stop_string_and_never_shows_part_of_it(tokenizer, stop, batch):
    expected = TEXT[:TEXT.index(stop)]
    deltas, detok = stream(tokenizer, TEXT, [stop], batch)
    assert detok.stopped and "".join(deltas) == expected
    released = ""
    for d in deltas:
        released += d
        assert expected.startswith(released)  # no byte of the stop string was ever sent


def test_earliest_of_several_stop_strings_wins(tokenizer):
    deltas, detok = stream(tokenizer, TEXT, ["test", "emoji", "zzz"])
    assert "".join(deltas) == TEXT[:TEXT.index("emoji")]


def test_a_tail_that_only_looks_like_a_stop_string_is_released_at_the_end(tokenizer):
    text = "The answer is"
    deltas, detok = stream(tokenizer, text, ["is not"])
    assert not detok.stopped and "".join(deltas) == text
    assert deltas[-1].endswith("is")  # held back until the sequence ended


def test_tokens_after_the_stop_are_not_consumed(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["three"])
    step = detok.push(ids)
    assert step.stopped and step.text == "one two "
    assert step.num_tokens < len(ids)
    assert tokenizer.decode(ids[:step.num_tokens]).endswith("three")


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids).text + detok.flush() == "hi"
