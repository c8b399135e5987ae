"""Incremental detokenization on the default model's byte-level tokenizer."""

import pytest

from jaxserve.detokenizer import IncrementalDetokenizer

TEXTS = ["naïve café — déjà vu", "日本語のテキスト 🙂🚀 done", " leading space and\nnew lines\n\n", "x" * 50]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up(default_model, text):
    tok = default_model.tokenizer
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(t) for t in ids] + [detok.finish()]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids) == detok.text
    if any(ord(c) > 0xFFFF for c in text):  # emoji span several byte-level tokens
        assert len([p for p in pieces if p]) < len(ids)


def test_stop_string_is_cut_and_never_streamed(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("one two three STOP four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=("STOP", "never"))
    snapshots, streamed = [], ""
    for t in ids:
        streamed += detok.push(t)
        snapshots.append(streamed)
        if detok.stop_reason:
            break
    final = streamed + detok.finish()
    assert detok.stop_reason == "STOP"
    assert final == detok.text == "one two three "
    # Nothing that the stop string later cut was ever handed out.
    assert all(final.startswith(s) for s in snapshots)


def run(detok, ids):
    text = ""
    for t in ids:
        text += detok.push(t)
        if detok.stop_reason:
            break
    return text + detok.finish()


def test_stop_string_is_kept_with_include_stop_str_in_output(default_model):
    tok = default_model.tokenizer
    ids = tok.encode("one two three STOP four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",), include_stop=True)
    assert run(detok, ids) == detok.text == "one two three STOP"
    assert detok.stop_reason == "STOP"


def test_stop_strings_wait_for_min_tokens(default_model):
    """vLLM's rule: no stop string is matched before min_tokens tokens exist; one that
    ends later still is."""
    tok = default_model.tokenizer
    ids = tok.encode("a STOP b c d STOP e f", add_special_tokens=False)
    first_stop_end = next(n for n in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:n]))
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",), min_tokens=first_stop_end + 1)
    assert run(detok, ids) == "a STOP b c d "
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",), min_tokens=first_stop_end)
    assert run(detok, ids) == "a "
