"""Incremental detokenization on the default model's byte-level tokenizer, with
`tokenizers`' DecodeStream and with the Python path; the oracle is `tokenizer.decode`."""

import random

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["naïve café — déjà vu", "日本語のテキスト 🙂🚀 done", " leading space and\nnew lines\n\n", "x" * 50]


@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "python"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up(default_model, text, decode_stream):
    tok = default_model.tokenizer
    prompt = tok.encode("Say:", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, use_decode_stream=decode_stream)
    assert detok.uses_decode_stream == decode_stream
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


class PythonOnly:
    """The same tokenizer without its `tokenizers` backend: the detokenizer's Python path."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def random_ids(tok, rng: random.Random) -> list[int]:
    """Random ids, half of them single bytes (so characters split and UTF-8 goes invalid),
    with special tokens among them."""
    byte_ids = [i for i in range(256) if len(tok.convert_ids_to_tokens(i)) == 1]
    specials = tok.all_special_ids
    ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
    for _ in range(rng.randrange(3)):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "python"])
def test_streamed_text_is_the_decode_of_random_ids(default_model, skip_special_tokens, decode_stream):
    tok = default_model.tokenizer
    prompt = tok.encode("Say:", add_special_tokens=False)
    rng = random.Random(17)
    for _ in range(150):
        ids = random_ids(tok, rng)
        detok = IncrementalDetokenizer(
            tok if decode_stream else PythonOnly(tok), prompt, skip_special_tokens=skip_special_tokens
        )
        assert detok.uses_decode_stream == decode_stream
        pieces = [detok.push(t) for t in ids]
        pieces.append(detok.finish())
        assert "".join(pieces) == detok.text == whole_characters(tok, ids, skip_special_tokens), ids


def whole_characters(tok, ids: list[int], skip_special_tokens: bool) -> str:
    """tokenizer.decode of the longest prefix of `ids` that does not end in an incomplete
    character (what a stream may show: a trailing partial character is cut, not U+FFFD)."""
    for end in range(len(ids), 0, -1):
        text = tok.decode(ids[:end], skip_special_tokens=skip_special_tokens)
        if not text.endswith("\ufffd"):
            return text
    return ""


@pytest.mark.parametrize("decode_stream", [True, False], ids=["DecodeStream", "python"])
def test_special_tokens_are_shown_unless_skipped(default_model, decode_stream):
    tok = default_model.tokenizer
    ids = tok.encode("héllo 🙂<|im_end|>\n<|im_start|>assistant", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids
    for skip, spaces in [(True, True), (False, True), (False, False), (True, False)]:
        detok = IncrementalDetokenizer(
            tok if decode_stream else PythonOnly(tok),
            [],
            skip_special_tokens=skip,
            spaces_between_special_tokens=spaces,
        )
        text = run(detok, ids)
        assert text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert ("<|im_end|>" in text) == (not skip)


def test_decode_stream_only_where_it_matches_decode(default_model):
    """A tokenizer that cleans up spaces after decoding keeps the Python path (DecodeStream does not clean up)."""
    tok = default_model.tokenizer
    assert IncrementalDetokenizer(tok, []).uses_decode_stream
    assert not IncrementalDetokenizer(tok, [], use_decode_stream=False).uses_decode_stream
    assert not IncrementalDetokenizer(PythonOnly(tok), []).uses_decode_stream
    cleaning = PythonOnly(tok)
    cleaning.backend_tokenizer, cleaning.clean_up_tokenization_spaces = tok.backend_tokenizer, True
    assert not IncrementalDetokenizer(cleaning, []).uses_decode_stream
