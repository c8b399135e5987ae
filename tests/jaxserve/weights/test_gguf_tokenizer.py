"""GGUF tokenizers beyond SmolLM's against transformers' own GGUF tokenizer conversion.

Each test file holds a small real vocabulary trained here with `tokenizers` on a
multilingual text and written into `tokenizer.ggml.*` with the `gguf` package:
byte-level BPE with Llama 3's (`llama-bpe`) and Qwen 2's (`qwen2`) word splitting, and a
SentencePiece vocabulary (`llama`, as Mistral and TinyLlama ship) with scores instead of
merges and byte fallback (`<0x00>`..`<0xFF>`) for what the vocabulary lacks.
"""

import json

import numpy as np
import pytest

from api.logprobs import TokenText
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Héllo wörld — naïve café, déjà vu, über straße, niño, façade, crème brûlée.",
    "Привет, мир! Как дела? Москва, спасибо, хорошо. Мир и дружба.",
    "日本語のテキストです。中文文本，你好世界。東京と北京。",
    "def main():\n    return 42\n\tx = [1, 2, 3]\n",
    "1234567890 3.14159 2024-01-01 I'm you're we'll",
]
# Several scripts, emoji the vocabularies lack, runs of spaces, tabs and newlines, digits.
TEXT = (
    "Héllo wörld — naïve café!  日本語のテキスト 中文，你好 Привет, мир 🙂🚀👍🏽 tabs\t\tand\n\n\nnew   lines "
    "12345 3.14159 I'm crème brûlée   "
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_tokenizer_gguf(path, tokenizer_fields):
    """A GGUF with a tiny llama model's metadata (what transformers needs to read it) and
    the given `tokenizer.ggml.*` fields (`add_*` GGUFWriter method suffix -> value)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    for method, value in tokenizer_fields.items():
        getattr(writer, f"add_{method}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokenizer_fields["token_list"]), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def train_bpe(pre_tokenizer, **trainer_args) -> dict:
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(show_progress=False, **trainer_args))
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"vocab": sorted(model["vocab"], key=model["vocab"].get), "merges": merges}


def byte_level_fields(pre: str) -> dict:
    from tokenizers import Regex, pre_tokenizers

    from jaxserve.weights.gguf_tokenizer import _REGEX_SPLIT

    splitter = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_REGEX_SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained = train_bpe(
        splitter, vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[BOS, EOS]
    )
    tokens = trained["vocab"]
    return dict(
        tokenizer_model="gpt2",
        tokenizer_pre=pre,
        token_list=tokens,
        token_merges=trained["merges"],
        token_types=[3 if t in (BOS, EOS) else 1 for t in tokens],
        bos_token_id=tokens.index(BOS),
        eos_token_id=tokens.index(EOS),
        add_bos_token=True,
    )


def sentencepiece_fields() -> dict:
    """Laid out like a llama.cpp conversion of a SentencePiece model: <unk>, <s>, </s>, the
    256 byte pieces, pieces in merge order (score -rank), then single characters; no merges."""
    from tokenizers import pre_tokenizers

    trained = train_bpe(
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        vocab_size=420,
        limit_alphabet=120,
    )
    merged = list(dict.fromkeys(m.replace(" ", "") for m in trained["merges"]))
    # Control characters (\t, \n) are left to byte fallback, as in Llama 2's vocabulary.
    chars = [t for t in trained["vocab"] if len(t) == 1 and t.isprintable()]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))] + [-1e4 - i for i in range(len(chars))]
    return dict(
        tokenizer_model="llama",
        token_list=tokens,
        token_scores=scores,
        token_types=[2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars)),
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
    )


@pytest.fixture(scope="module", params=["llama-bpe", "qwen2", "sentencepiece"])
def both(request, tmp_path_factory):
    """(ours, transformers') tokenizers for one GGUF file, and its kind."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(request.param) / "tokenizer.gguf"
    write_tokenizer_gguf(
        path, sentencepiece_fields() if request.param == "sentencepiece" else byte_level_fields(request.param)
    )
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tokenizer_from_gguf(GGUFFile(path).field), theirs, request.param


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("sp") / "tokenizer.gguf"
    write_tokenizer_gguf(path, sentencepiece_fields())
    return tokenizer_from_gguf(GGUFFile(path).field), AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name
    )


@pytest.mark.parametrize("text", [TEXT, "The dog sleeps.", "x", "", "Москва\n\n東京 2024"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_equal_transformers_gguf_tokenizer(both, text, add_special_tokens):
    ours, theirs, _ = both
    ids = ours.encode(text, add_special_tokens=add_special_tokens)
    assert ids == theirs.encode(text, add_special_tokens=add_special_tokens), ours.convert_ids_to_tokens(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True) == text


def test_vocabulary_is_real_and_specials_are_whole(both):
    """The comparison means something: words merge, and BOS / EOS stay one token each."""
    ours, theirs, kind = both
    pieces = ours.convert_ids_to_tokens(ours.encode(TEXT, add_special_tokens=False))
    assert len(pieces) < len(TEXT.encode()) / 2, pieces
    bos, eos = ("<s>", "</s>") if kind == "sentencepiece" else (BOS, EOS)
    text = f"{bos}hi{eos} there"
    assert ours.encode(text, add_special_tokens=False)[:1] == [ours.convert_tokens_to_ids(bos)]
    assert ours.convert_tokens_to_ids(eos) in ours.encode(text, add_special_tokens=False)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token) == (bos, eos)
    assert ours.encode("hi")[0] == ours.bos_token_id  # the file says add BOS (SentencePiece: by default)


def test_llama3_groups_digits_by_three_and_qwen2_splits_each(both):
    ours, _, kind = both
    pieces = [ours.decode([i]) for i in ours.encode("in 1234567", add_special_tokens=False)]
    digits = [p for p in pieces if p.strip().isdigit()]
    if kind == "llama-bpe":
        assert all(len(p) <= 3 for p in digits) and "".join(digits) == "1234567" and " " in pieces
    elif kind == "qwen2":
        assert digits == list("1234567")


def test_sentencepiece_falls_back_to_bytes(sentencepiece):
    ours, _ = sentencepiece
    pieces = ours.convert_ids_to_tokens(ours.encode("the🙂\tdog\n", add_special_tokens=False))
    assert pieces == ["\u2581the", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "<0x09>", "d", "og", "<0x0A>"]


@pytest.mark.parametrize("text", [" leading space", "  two"])
def test_sentencepiece_space_prefix_follows_llama_cpp(sentencepiece, text):
    """llama.cpp (and SentencePiece) put "▁" before the text even when it starts with a space,
    so it round-trips; transformers' GGUF conversion does not (it drops one space) -- the one
    place we differ from it on purpose."""
    ours, theirs = sentencepiece
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[0] == "\u2581"
    assert ours.decode(ids) == text
    assert theirs.decode(theirs.encode(text, add_special_tokens=False)) == text[1:]


@pytest.mark.parametrize("which", ["ours", "transformers"])
def test_logprob_token_strings_of_sentencepiece_pieces(sentencepiece, which):
    """Each token's bytes are what its piece means; together they are the text llama.cpp
    tokenized (the text behind the "▁" it puts first)."""
    tok = sentencepiece[0] if which == "ours" else sentencepiece[1]
    shown = TokenText(tok)
    assert shown.sentencepiece and not shown.byte_level
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(bytes(shown.bytes(i)) for i in ids) == (" " + tok.decode(ids)).encode()
    assert "".join(shown.text(i) for i in ids).startswith(" Héllo wörld — naïve caf")
    by_piece = {p: i for i, p in enumerate(tok.convert_ids_to_tokens(list(range(len(tok)))))}
    assert (shown.text(by_piece["\u2581wörld"]), shown.bytes(by_piece["\u2581wörld"])) == (
        " wörld",
        list(b" w\xc3\xb6rld"),
    )
    assert (shown.text(by_piece["<0xE2>"]), shown.bytes(by_piece["<0xE2>"])) == ("\\xe2", [0xE2])
    assert (shown.text(by_piece["<0x0A>"]), shown.bytes(by_piece["<0x0A>"])) == ("\n", [10])
    assert shown.text(by_piece["\u2581"]) == " "
    assert shown.text(tok.bos_token_id) == "<s>"


def test_sentencepiece_tokenizer_survives_the_weight_cache(sentencepiece, tmp_path):
    """The weight cache saves the tokenizer and reads it back as a tokenizer.json."""
    from jaxserve.weights.load import _fast_tokenizer

    ours, _ = sentencepiece
    ours.save_pretrained(str(tmp_path))
    back = _fast_tokenizer(tmp_path)
    for text in (TEXT, " leading space", "<s>hi</s> there"):
        assert back.encode(text) == ours.encode(text)
        assert back.decode(back.encode(text), skip_special_tokens=True) == ours.decode(
            ours.encode(text), skip_special_tokens=True
        )
    assert TokenText(back).sentencepiece
