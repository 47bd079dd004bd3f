"""Incremental detokenization: decoding a few tokens at a time gives the whole output's decode, with no
partial character shown before its last byte arrives; stop strings are found across token boundaries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.detokenizer import IncrementalText, find_stop
from specserve.loader import default_model_path
from specserve.loader.tokenizer import load_tokenizer
from tests.conftest import byte_tokenizer

BYTES = byte_tokenizer()


def grow(tokenizer, ids: list[int], steps: list[int]) -> tuple[IncrementalText, list[str]]:
    text, shown = IncrementalText(), []
    i = 0
    for n in steps:
        i = min(len(ids), i + n)
        text.extend(tokenizer, ids[:i])
        shown.append(text.text)
        if i == len(ids):
            break
    text.extend(tokenizer, ids)
    text.flush(tokenizer, ids)
    return text, shown


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=30), st.lists(st.integers(1, 4), min_size=1))
def test_byte_level_text_equals_the_whole_decode(words, steps):
    ids = BYTES.encode(words)
    text, shown = grow(BYTES, ids, steps)
    assert text.text == BYTES.decode(ids, skip_special_tokens=True)
    for partial in shown:                      # never a half character, always a prefix of the final text
        assert "\ufffd" not in partial and text.text.startswith(partial)


def test_an_unfinished_character_waits_and_a_cut_one_is_flushed():
    ids = BYTES.encode("é")                     # two bytes, two tokens
    text = IncrementalText()
    text.extend(BYTES, ids[:1])
    assert text.text == ""
    text.extend(BYTES, ids)
    assert text.text == "é"
    cut = IncrementalText()
    cut.extend(BYTES, ids[:1])
    cut.flush(BYTES, ids[:1])
    assert cut.text == "\ufffd"


@pytest.mark.real_model
def test_the_embedded_tokenizer_token_by_token():
    tokenizer = load_tokenizer(default_model_path())
    sample = "Paris — la «Ville Lumière» 🌍 has 2,1 M inhabitants.\n\n```python\nprint('héllo')\n```"
    ids = tokenizer.encode(sample, add_special_tokens=False)
    text, _ = grow(tokenizer, ids, [1] * len(ids))
    assert text.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_strings_are_searched_where_new_text_can_complete_them():
    assert find_stop(("END",), "abc EN", 4) is None
    assert find_stop(("END",), "abc END more", 6) == 4       # only "D" is new, "EN" came before
    assert find_stop(("x", "END"), "abc END x", 6) == 4       # the earliest wins
    assert find_stop(("x", "END"), "abc END x", 8) == 8       # END was complete before the new text
    assert find_stop(("END",), "END later", 9) is None        # too far back: searched in an earlier step
